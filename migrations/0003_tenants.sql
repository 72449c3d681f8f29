-- Tenants: identity, quotas and isolation.
--
-- Every tenant has a row here: created by `sandcell-admin tenant create` (with a broker user
-- and a database role), or registered with the operator's default quotas the first time a
-- trusted publisher submits for it. The scheduler locks the row while it checks the quotas,
-- so concurrent submissions of one tenant cannot both take the last slot.
--
-- Each tenant reads its results through its own login role, a member of `sandcell_tenant`.
-- Row-level security lets that role see only its own jobs, sessions, artifacts and tenant row;
-- the views are `security_invoker` so the policies apply through them. The service role owns
-- the tables and is not subject to the policies.
--
-- Completion notifications go to a per-tenant channel whose name is a random secret in the
-- tenant's own row: any role may LISTEN on any channel, so a shared channel would tell every
-- tenant who finished which job.

CREATE TABLE tenants (
    tenant              text        PRIMARY KEY,
    -- The login role the tenant reads through (opaque, so pg_roles reveals no tenant names).
    db_role             text        UNIQUE,
    notify_channel      text        NOT NULL UNIQUE
                                    DEFAULT 'sandcell_' || replace(gen_random_uuid()::text, '-', ''),
    max_sessions        integer     NOT NULL CHECK (max_sessions >= 0),
    max_queued_jobs     integer     NOT NULL CHECK (max_queued_jobs >= 0),
    max_artifact_bytes  bigint      NOT NULL CHECK (max_artifact_bytes >= 0),
    created_at          timestamptz NOT NULL DEFAULT now()
);

-- Existing tenants (from before tenants had rows) get the defaults of the time.
INSERT INTO tenants (tenant, max_sessions, max_queued_jobs, max_artifact_bytes)
SELECT DISTINCT tenant, 20, 1000, 5368709120 FROM jobs
ON CONFLICT DO NOTHING;

-- Quota checks count these per tenant.
CREATE INDEX jobs_unfinished_by_tenant ON jobs (tenant) WHERE status IN ('queued', 'running');
CREATE INDEX artifacts_available_by_tenant ON artifacts (tenant) INCLUDE (size_bytes) WHERE state = 'available';

-- What the sandbox's limits did to a job (see sandcell_protocol::JobResult).
ALTER TABLE jobs
    ADD COLUMN limits_hit        jsonb   NOT NULL DEFAULT '[]'::jsonb,
    ADD COLUMN skipped_files     jsonb   NOT NULL DEFAULT '[]'::jsonb,
    ADD COLUMN processes_killed  integer NOT NULL DEFAULT 0;

-- The broker user that published an unattributable message, when the broker vouched for one.
ALTER TABLE intake_rejections ADD COLUMN publisher text;

-- Notifications on the tenant's own channel.
CREATE OR REPLACE FUNCTION sandcell_notify_job() RETURNS trigger AS $$
DECLARE
    channel text;
BEGIN
    SELECT t.notify_channel INTO channel FROM tenants t WHERE t.tenant = NEW.tenant;
    IF channel IS NOT NULL THEN
        PERFORM pg_notify(channel,
            json_build_object('tenant', NEW.tenant, 'job_id', NEW.job_id, 'status', NEW.status)::text);
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

-- The result record, now with what the limits did.
CREATE OR REPLACE VIEW job_results AS
SELECT j.tenant,
       j.job_id,
       j.status,
       jsonb_build_object(
           'job_id', j.job_id,
           'tenant', j.tenant,
           'status', j.status,
           'language', j.language,
           'stdout', j.stdout,
           'stderr', j.stderr,
           'stdout_truncated', j.stdout_truncated,
           'stderr_truncated', j.stderr_truncated,
           'exit_code', j.exit_code,
           'error', j.error,
           'reason', j.reason,
           'outputs', j.outputs,
           'limits', j.limits,
           'worker_id', j.worker_id,
           'attempts', j.attempts,
           'timings', jsonb_build_object('queued_at', j.queued_at,
                                         'started_at', j.started_at,
                                         'finished_at', j.finished_at),
           'artifacts', COALESCE((
               SELECT jsonb_agg(jsonb_build_object(
                          'path', a.path,
                          'kind', a.kind,
                          'size_bytes', a.size_bytes,
                          'content_type', a.content_type,
                          'sha256', a.sha256,
                          's3_key', a.s3_key,
                          'expires_at', a.expires_at,
                          'state', a.state,
                          'download_url', CASE WHEN a.state = 'available' THEN a.download_url END)
                      ORDER BY a.id)
               FROM artifacts a
               WHERE a.tenant = j.tenant AND a.job_id = j.job_id), '[]'::jsonb),
           'session', (SELECT d.document FROM session_documents d WHERE d.session_id = j.session_id),
           'kernel_restarted', j.kernel_restarted,
           'files', j.files,
           'limits_hit', j.limits_hit,
           'skipped_files', j.skipped_files,
           'processes_killed', j.processes_killed
       ) AS result
FROM jobs j;

-- ------------------------------------------------------------------ isolation
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'sandcell_tenant') THEN
        CREATE ROLE sandcell_tenant NOLOGIN;
    END IF;
    -- Only sandcell's own roles connect; tenants through sandcell_tenant.
    EXECUTE format('REVOKE CONNECT, TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO sandcell_tenant', current_database());
END
$$;

GRANT USAGE ON SCHEMA public TO sandcell_tenant;
GRANT SELECT ON jobs, sessions, artifacts, tenants, job_results, session_documents TO sandcell_tenant;

ALTER VIEW job_results SET (security_invoker = true);
ALTER VIEW session_documents SET (security_invoker = true);

ALTER TABLE tenants ENABLE ROW LEVEL SECURITY;
ALTER TABLE jobs ENABLE ROW LEVEL SECURITY;
ALTER TABLE sessions ENABLE ROW LEVEL SECURITY;
ALTER TABLE artifacts ENABLE ROW LEVEL SECURITY;

CREATE POLICY tenant_reads_own_row ON tenants FOR SELECT TO sandcell_tenant
    USING (db_role = current_user);
CREATE POLICY tenant_reads_own_jobs ON jobs FOR SELECT TO sandcell_tenant
    USING (tenant = (SELECT t.tenant FROM tenants t WHERE t.db_role = current_user));
CREATE POLICY tenant_reads_own_sessions ON sessions FOR SELECT TO sandcell_tenant
    USING (tenant = (SELECT t.tenant FROM tenants t WHERE t.db_role = current_user));
CREATE POLICY tenant_reads_own_artifacts ON artifacts FOR SELECT TO sandcell_tenant
    USING (tenant = (SELECT t.tenant FROM tenants t WHERE t.db_role = current_user));
