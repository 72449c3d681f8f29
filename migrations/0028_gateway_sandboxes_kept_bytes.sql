-- What the E2B gateway keeps of a tenant's sandboxes counts in the bytes it makes Postgres keep
-- (`max_result_bytes`).
--
-- Why: each sandbox the gateway opens is a row of `gateway_sandboxes` holding the caller's
-- `metadata` (up to 16 KiB) and `envVars` (up to 64 KiB), kept until 30 days after its session
-- ended (migration 0025). The session's opening job, the only thing the quota counted, is about a
-- kilobyte: a tenant creating and killing sandboxes in a loop kept ~80 KB a sandbox that no quota
-- saw (at one create a second, ~7 GB a day).
--
-- Now `tenant_job_counts.kept_bytes` (migration 0022) counts each row's `metadata` and `env` as
-- stored, through a trigger of their own; a create of a tenant at or over its quota is refused
-- `quota_exceeded` at its opening job (`sandcell_record_job`), answered 429 by the gateway.

-- Adding to a tenant's kept bytes outside the job-count trigger (which moves several figures
-- at once): one function, called by the upload answers' trigger (0027's, redefined here to call
-- it) and the gateway sandboxes'. The delta goes to this backend's shard, as 0015's counts do.
CREATE FUNCTION sandcell_add_kept_bytes(p_tenant text, p_delta bigint) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p_delta = 0 THEN
        RETURN;
    END IF;
    UPDATE tenant_job_counts SET kept_bytes = kept_bytes + p_delta
     WHERE tenant = p_tenant AND shard = pg_backend_pid() % 16;
    IF NOT FOUND THEN
        INSERT INTO tenant_job_counts AS c (tenant, shard, kept_bytes)
        VALUES (p_tenant, pg_backend_pid() % 16, p_delta)
        ON CONFLICT (tenant, shard) DO UPDATE SET kept_bytes = c.kept_bytes + EXCLUDED.kept_bytes;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION sandcell_count_upload_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    d_kept bigint := 0;
    v_tenant text;
BEGIN
    IF TG_OP <> 'INSERT' THEN
        v_tenant := OLD.tenant;
        d_kept := -(COALESCE(pg_column_size(OLD.grant_doc), 0));
    END IF;
    IF TG_OP <> 'DELETE' THEN
        v_tenant := NEW.tenant;
        d_kept := d_kept + COALESCE(pg_column_size(NEW.grant_doc), 0);
    END IF;
    PERFORM sandcell_add_kept_bytes(v_tenant, d_kept);
    RETURN NULL;
END;
$$;

CREATE FUNCTION sandcell_count_gateway_sandbox_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    d_kept bigint := 0;
    v_tenant text;
BEGIN
    IF TG_OP <> 'INSERT' THEN
        v_tenant := OLD.tenant;
        d_kept := -(pg_column_size(OLD.metadata) + pg_column_size(OLD.env));
    END IF;
    IF TG_OP <> 'DELETE' THEN
        v_tenant := NEW.tenant;
        d_kept := d_kept + pg_column_size(NEW.metadata) + pg_column_size(NEW.env);
    END IF;
    PERFORM sandcell_add_kept_bytes(v_tenant, d_kept);
    RETURN NULL;
END;
$$;

CREATE TRIGGER gateway_sandboxes_count_insert AFTER INSERT ON gateway_sandboxes
    FOR EACH ROW EXECUTE FUNCTION sandcell_count_gateway_sandbox_bytes();
CREATE TRIGGER gateway_sandboxes_count_update AFTER UPDATE OF metadata, env, tenant ON gateway_sandboxes
    FOR EACH ROW EXECUTE FUNCTION sandcell_count_gateway_sandbox_bytes();
CREATE TRIGGER gateway_sandboxes_count_delete AFTER DELETE ON gateway_sandboxes
    FOR EACH ROW EXECUTE FUNCTION sandcell_count_gateway_sandbox_bytes();

-- The rows already there (the triggers count from here on, in this transaction, which holds
-- `gateway_sandboxes` against writes until it commits).
INSERT INTO tenant_job_counts AS c (tenant, shard, kept_bytes)
SELECT tenant, 0, sum(pg_column_size(metadata) + pg_column_size(env))::bigint FROM gateway_sandboxes GROUP BY tenant
ON CONFLICT (tenant, shard) DO UPDATE SET kept_bytes = c.kept_bytes + EXCLUDED.kept_bytes;

REVOKE ALL ON FUNCTION sandcell_count_gateway_sandbox_bytes() FROM PUBLIC;
REVOKE ALL ON FUNCTION sandcell_add_kept_bytes(text, bigint) FROM PUBLIC;
