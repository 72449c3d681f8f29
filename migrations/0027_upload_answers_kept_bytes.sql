-- A tenant's upload answers count in the bytes it makes Postgres keep (`max_result_bytes`).
--
-- Why: every upload request is answered by a row of `uploads`, kept for the retention (30 days),
-- and a `ready` answer holds a presigned URL for each of its up to 32 files. The only bound on
-- them was the stored-bytes quota on what the files may hold, which a tenant declaring one byte
-- a file never reaches: it could add answers of several kilobytes each at the intake's rate.
--
-- Now `tenant_job_counts.kept_bytes` (migration 0022) counts the upload answers' documents too
-- (`grant_doc` as stored), through a trigger of their own; an upload request of a tenant at or
-- over `max_result_bytes` is refused `quota_exceeded` (core::uploads::grant), and while it is
-- over, only its newest refusals are kept (core::uploads, KEPT_REFUSALS_OVER_QUOTA), as for jobs
-- (migration 0026).

CREATE FUNCTION sandcell_count_upload_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    d_kept bigint := 0;
    v_tenant text;
BEGIN
    IF TG_OP <> 'INSERT' THEN
        v_tenant := OLD.tenant;
        d_kept := -COALESCE(pg_column_size(OLD.grant_doc), 0);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        v_tenant := NEW.tenant;
        d_kept := d_kept + COALESCE(pg_column_size(NEW.grant_doc), 0);
    END IF;
    IF d_kept = 0 THEN
        RETURN NULL;
    END IF;
    UPDATE tenant_job_counts SET kept_bytes = kept_bytes + d_kept
     WHERE tenant = v_tenant AND shard = pg_backend_pid() % 16;
    IF NOT FOUND THEN
        INSERT INTO tenant_job_counts AS c (tenant, shard, kept_bytes)
        VALUES (v_tenant, pg_backend_pid() % 16, d_kept)
        ON CONFLICT (tenant, shard) DO UPDATE SET kept_bytes = c.kept_bytes + EXCLUDED.kept_bytes;
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER uploads_count_insert AFTER INSERT ON uploads
    FOR EACH ROW EXECUTE FUNCTION sandcell_count_upload_bytes();
CREATE TRIGGER uploads_count_update AFTER UPDATE OF grant_doc, tenant ON uploads
    FOR EACH ROW EXECUTE FUNCTION sandcell_count_upload_bytes();
CREATE TRIGGER uploads_count_delete AFTER DELETE ON uploads
    FOR EACH ROW EXECUTE FUNCTION sandcell_count_upload_bytes();

-- The answers already there (the triggers count from here on, in this transaction, which holds
-- `uploads` against writes until it commits).
INSERT INTO tenant_job_counts AS c (tenant, shard, kept_bytes)
SELECT tenant, 0, sum(pg_column_size(grant_doc))::bigint FROM uploads GROUP BY tenant
ON CONFLICT (tenant, shard) DO UPDATE SET kept_bytes = c.kept_bytes + EXCLUDED.kept_bytes;

-- A tenant's refused upload answers, newest first.
CREATE INDEX uploads_refused ON uploads (tenant, created_at) WHERE grant_doc->>'status' = 'rejected';

REVOKE ALL ON FUNCTION sandcell_count_upload_bytes() FROM PUBLIC;
