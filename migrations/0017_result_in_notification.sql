-- A job's final notification carries its result record, when it fits.
--
-- Why: a client waiting for a job used to be woken by `{tenant, job_id, status}` and then read
-- the row (`SELECT result FROM job_results ...`): one more round trip to Postgres on every
-- job's path, after the commit that already had the record in hand (the benchmark's
-- "notified → result read" stage, p50 0.5-0.7 ms of an in-session `1+1`'s 6-10 ms). The
-- payload is now `{tenant, job_id, status, result}`, `result` being exactly the row
-- `job_results` shows for the job at its commit (one owner of the result's shape: the view).
-- A result whose notification would not fit `pg_notify`'s limit (payloads must be shorter than
-- 8000 bytes) is announced as before, without `result`: the client reads the row.
--
-- The notification is built when the transaction commits (a deferred constraint trigger), not
-- when the job's status changes: a result committed with its artifacts inserts them after the
-- job's row, and a job that ends a session updates that session after it too; the record read
-- at commit holds them all.
CREATE OR REPLACE FUNCTION sandcell_notify_job() RETURNS trigger AS $$
DECLARE
    channel text;
    record jsonb;
    payload text;
BEGIN
    SELECT t.notify_channel INTO channel FROM tenants t WHERE t.tenant = NEW.tenant;
    IF channel IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT r.result INTO record FROM job_results r WHERE r.tenant = NEW.tenant AND r.job_id = NEW.job_id;
    IF record IS NOT NULL THEN
        payload := jsonb_build_object('tenant', NEW.tenant, 'job_id', NEW.job_id,
                                      'status', record->>'status', 'result', record)::text;
    END IF;
    IF payload IS NULL OR octet_length(payload) >= 8000 THEN
        payload := jsonb_build_object('tenant', NEW.tenant, 'job_id', NEW.job_id,
                                      'status', COALESCE(record->>'status', NEW.status))::text;
    END IF;
    PERFORM pg_notify(channel, payload);
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER jobs_notify ON jobs;
CREATE CONSTRAINT TRIGGER jobs_notify
    AFTER INSERT OR UPDATE OF status ON jobs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.status NOT IN ('queued', 'running'))
    EXECUTE FUNCTION sandcell_notify_job();
