-- sandcell's state: jobs and their results, artifacts with their expiry, and intake messages
-- that could not be attributed to a job. Clients poll `job_results` and LISTEN on
-- `sandcell_jobs`; statuses and their transitions are owned by sandcell_protocol::status.

CREATE TABLE jobs (
    tenant            text        NOT NULL,
    job_id            text        NOT NULL,
    status            text        NOT NULL CHECK (status IN ('queued','running','succeeded','failed',
                                   'timed_out','oom_killed','cancelled','rejected','infrastructure_error')),
    language          text,
    -- sha256 of the accepted submission body: tells a retried submission from a conflicting reuse of the id.
    submission_sha256 text,
    limits            jsonb,
    stdout            text        NOT NULL DEFAULT '',
    stderr            text        NOT NULL DEFAULT '',
    stdout_truncated  boolean     NOT NULL DEFAULT false,
    stderr_truncated  boolean     NOT NULL DEFAULT false,
    exit_code         integer,
    error             jsonb,
    reason            jsonb,
    outputs           jsonb       NOT NULL DEFAULT '[]'::jsonb,
    worker_id         text,
    attempts          integer     NOT NULL DEFAULT 0,
    queued_at         timestamptz NOT NULL DEFAULT now(),
    dispatched_at     timestamptz,
    started_at        timestamptz,
    finished_at       timestamptz,
    PRIMARY KEY (tenant, job_id)
);

-- The scheduler's redispatch scan and operators' dashboards look for unfinished jobs.
CREATE INDEX jobs_unfinished ON jobs (queued_at) WHERE status IN ('queued', 'running');

CREATE TABLE artifacts (
    id            bigserial   PRIMARY KEY,
    tenant        text        NOT NULL,
    job_id        text        NOT NULL,
    path          text        NOT NULL,
    kind          text        NOT NULL CHECK (kind IN ('file', 'display')),
    size_bytes    bigint      NOT NULL,
    content_type  text        NOT NULL,
    sha256        text        NOT NULL,
    s3_key        text        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL,
    state         text        NOT NULL DEFAULT 'available' CHECK (state IN ('available', 'expired')),
    download_url  text,
    FOREIGN KEY (tenant, job_id) REFERENCES jobs (tenant, job_id) ON DELETE CASCADE,
    UNIQUE (tenant, job_id, path)
);

-- The sweeper's scan: available artifacts by expiry.
CREATE INDEX artifacts_expiry ON artifacts (expires_at) WHERE state = 'available';

-- Intake messages that named no usable (tenant, job_id): kept for operators, also dead-lettered.
CREATE TABLE intake_rejections (
    id           bigserial   PRIMARY KEY,
    received_at  timestamptz NOT NULL DEFAULT now(),
    message_id   text,
    code         text        NOT NULL,
    message      text        NOT NULL,
    body_bytes   integer     NOT NULL,
    body_prefix  text        NOT NULL
);
CREATE INDEX intake_rejections_message_id ON intake_rejections (message_id);

-- The result record a client reads, shaped exactly like sandcell_protocol::JobResult.
CREATE VIEW job_results AS
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
               WHERE a.tenant = j.tenant AND a.job_id = j.job_id), '[]'::jsonb)
       ) AS result
FROM jobs j;

-- Completion notification: waiting clients LISTEN sandcell_jobs instead of sleep-polling.
CREATE FUNCTION sandcell_notify_job() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('sandcell_jobs',
        json_build_object('tenant', NEW.tenant, 'job_id', NEW.job_id, 'status', NEW.status)::text);
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER jobs_notify
    AFTER INSERT OR UPDATE OF status ON jobs
    FOR EACH ROW EXECUTE FUNCTION sandcell_notify_job();
