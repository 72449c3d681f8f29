-- What a tenant uploads through its grants is its to keep for a while, not for ever: a grant's
-- objects are removed by the scheduler's sweeper once `objects_expire_at` passes
-- (`SANDCELL_UPLOAD_TTL_S` after the grant), and until then the bytes it granted count against
-- the tenant's stored-bytes quota (`tenants.max_artifact_bytes`), with its artifacts.
ALTER TABLE uploads ADD COLUMN granted_bytes bigint NOT NULL DEFAULT 0;
ALTER TABLE uploads ADD COLUMN objects_expire_at timestamptz;
ALTER TABLE uploads ADD COLUMN objects_removed_at timestamptz;

-- Grants made before this migration: what they granted, removed a day after their grant.
UPDATE uploads SET
    granted_bytes = (SELECT COALESCE(sum((f->>'size_bytes')::bigint), 0) FROM jsonb_array_elements(grant_doc->'files') f),
    objects_expire_at = created_at + interval '1 day'
WHERE grant_doc->>'status' = 'ready';

-- A tenant's live grants (the quota's sum), and the sweeper's next ones.
CREATE INDEX uploads_live ON uploads (tenant) WHERE objects_expire_at IS NOT NULL AND objects_removed_at IS NULL;
CREATE INDEX uploads_expiring ON uploads (objects_expire_at) WHERE objects_expire_at IS NOT NULL AND objects_removed_at IS NULL;
