-- Sessions: long-lived kernels that hold variables and files across jobs, each owned by one
-- worker. The state machine is sandcell_protocol::session::SessionState; ownership
-- (worker_id) is written only by the worker that holds the session, expiry only by that
-- worker's keep-alive timer, and `lost` by a worker restarting or the scheduler's sweeper
-- noticing a worker whose heartbeat stopped.

CREATE TABLE sessions (
    session_id        text        PRIMARY KEY,
    tenant            text        NOT NULL,
    state             text        NOT NULL CHECK (state IN ('starting','active','expired','closed','lost','failed')),
    keep_alive_s      integer     NOT NULL CHECK (keep_alive_s > 0),
    worker_id         text,
    -- The job that opened it: only that job may bind it to a worker.
    created_by_job    text        NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    last_activity_at  timestamptz,
    expires_at        timestamptz,
    ended_at          timestamptz,
    end_reason        jsonb
);
CREATE INDEX sessions_live_by_worker ON sessions (worker_id) WHERE state IN ('starting', 'active');
CREATE INDEX sessions_by_tenant ON sessions (tenant, state);

-- Workers announce themselves and beat; the sweeper declares a silent worker's sessions lost.
CREATE TABLE workers (
    worker_id     text        PRIMARY KEY,
    started_at    timestamptz NOT NULL DEFAULT now(),
    last_seen_at  timestamptz NOT NULL DEFAULT now(),
    slots         integer     NOT NULL,
    max_sessions  integer     NOT NULL
);

ALTER TABLE jobs
    ADD COLUMN session_id        text REFERENCES sessions (session_id),
    ADD COLUMN kernel_restarted  boolean NOT NULL DEFAULT false,
    ADD COLUMN files             jsonb;
CREATE INDEX jobs_unfinished_by_session ON jobs (session_id) WHERE status IN ('queued', 'running');

ALTER TABLE artifacts DROP CONSTRAINT artifacts_kind_check;
ALTER TABLE artifacts ADD CONSTRAINT artifacts_kind_check CHECK (kind IN ('file', 'display', 'fetched'));

-- A session as a client reads it, shaped exactly like sandcell_protocol::Session.
CREATE VIEW session_documents AS
SELECT s.session_id,
       s.tenant,
       jsonb_build_object(
           'id', s.session_id,
           'tenant', s.tenant,
           'state', s.state,
           'keep_alive_s', s.keep_alive_s,
           'worker_id', s.worker_id,
           'created_at', s.created_at,
           'last_activity_at', s.last_activity_at,
           'expires_at', CASE WHEN s.state = 'active' THEN s.expires_at END,
           'ended_at', s.ended_at,
           'end_reason', s.end_reason
       ) AS document
FROM sessions s;

-- The result record, now with the job's session, kernel restarts and workspace listing.
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
           'files', j.files
       ) AS result
FROM jobs j;

-- The container currently running a session's kernel (changes when the kernel is restarted),
-- and the container that ran each job: for operators, and for tests proving clean-up.
ALTER TABLE sessions ADD COLUMN container_id text;
ALTER TABLE jobs ADD COLUMN container_id text;
