-- A job's notification is sent when its status becomes final, no longer when it is recorded
-- (`queued`) or claimed (`running`): clients wait for the result, and both clients of the
-- project only ever acted on a final status.
--
-- Why: Postgres serialises the commits of every transaction that notifies, database-wide (a
-- lock taken at commit, held through its WAL flush). Three notifying commits per job made the
-- scheduler's record (which holds its tenant's row lock until it commits) and the worker's
-- claim queue behind every other job's commit: sampled every 5 ms through a quick benchmark run,
-- 2,419 of ~13,000 samples of active backends waited on that lock, and 7,063 on a tenant's
-- row lock held by a record waiting on it.
DROP TRIGGER jobs_notify ON jobs;
CREATE TRIGGER jobs_notify
    AFTER INSERT OR UPDATE OF status ON jobs
    FOR EACH ROW
    WHEN (NEW.status NOT IN ('queued', 'running'))
    EXECUTE FUNCTION sandcell_notify_job();
