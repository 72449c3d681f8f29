-- One result shape: what a job's code did (its output, error, figures, listing, the limits it
-- ran into, what it left behind) is one document, `jobs.execution`, of the protocol's
-- `Execution` type. The worker writes it whole at the commit; the `job_results` view merges it
-- into the record as it is, so a field added to `Execution` needs no SQL. Every row has one:
-- the scheduler writes the empty document (`Execution::default()`) when it records a job.

ALTER TABLE jobs ADD COLUMN execution jsonb;

UPDATE jobs SET execution = jsonb_build_object(
    'stdout', stdout,
    'stderr', stderr,
    'stdout_truncated', stdout_truncated,
    'stderr_truncated', stderr_truncated,
    'exit_code', exit_code,
    'error', error,
    'outputs', outputs,
    'kernel_restarted', kernel_restarted,
    'files', files,
    'limits_hit', limits_hit,
    'skipped_files', skipped_files,
    'processes_killed', processes_killed);

ALTER TABLE jobs ALTER COLUMN execution SET NOT NULL;

-- The row's own fields come last, so that the document can never override who a result
-- belongs to or where it stands.
CREATE OR REPLACE VIEW job_results AS
SELECT j.tenant,
       j.job_id,
       j.status,
       j.execution || jsonb_build_object(
           'job_id', j.job_id,
           'tenant', j.tenant,
           'status', j.status,
           'language', j.language,
           'reason', j.reason,
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
           'session', (SELECT d.document FROM session_documents d WHERE d.session_id = j.session_id)
       ) AS result
FROM jobs j;

ALTER VIEW job_results SET (security_invoker = true);

ALTER TABLE jobs
    DROP COLUMN stdout,
    DROP COLUMN stderr,
    DROP COLUMN stdout_truncated,
    DROP COLUMN stderr_truncated,
    DROP COLUMN exit_code,
    DROP COLUMN error,
    DROP COLUMN outputs,
    DROP COLUMN kernel_restarted,
    DROP COLUMN files,
    DROP COLUMN limits_hit,
    DROP COLUMN skipped_files,
    DROP COLUMN processes_killed;
