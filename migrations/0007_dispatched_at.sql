-- A result's timings say when the scheduler handed the job to the workers' queue
-- (`dispatched_at`, kept by the row since 0001), so a client and the benchmark can tell time
-- spent waiting for the scheduler from time spent waiting for a worker.

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
                                         'dispatched_at', j.dispatched_at,
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
