-- Large uploads by tenants: the scheduler's answer to an upload request (presigned PUT URLs
-- under the tenant's own upload prefix), one row per (tenant, upload_id), readable by the
-- tenant's role only, and announced on the tenant's notification channel.
CREATE TABLE uploads (
    tenant      text        NOT NULL,
    upload_id   text        NOT NULL,
    grant_doc   jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, upload_id)
);

GRANT SELECT ON uploads TO sandcell_tenant;
ALTER TABLE uploads ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_reads_own_uploads ON uploads FOR SELECT TO sandcell_tenant
    USING (tenant = (SELECT t.tenant FROM tenants t WHERE t.db_role = current_user));

CREATE OR REPLACE FUNCTION sandcell_notify_upload() RETURNS trigger AS $$
DECLARE
    channel text;
BEGIN
    SELECT t.notify_channel INTO channel FROM tenants t WHERE t.tenant = NEW.tenant;
    IF channel IS NOT NULL THEN
        PERFORM pg_notify(channel,
            json_build_object('tenant', NEW.tenant, 'upload_id', NEW.upload_id, 'status', NEW.grant_doc->>'status')::text);
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER uploads_notify AFTER INSERT ON uploads FOR EACH ROW EXECUTE FUNCTION sandcell_notify_upload();
