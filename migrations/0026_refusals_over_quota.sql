-- A tenant over its `max_result_bytes` keeps only its newest refusals (core::jobs,
-- KEPT_REFUSALS_OVER_QUOTA).
--
-- Why: every submission is answered by a row, its refusal included, kept for the retention
-- (30 days). Past `max_result_bytes` every new job of a tenant is refused, and each refusal was
-- one more row: a tenant over its quota that kept submitting grew the database all tenants share
-- at the intake's rate (measured: 1,500 refusals in 4.4 s from one client, ~500 bytes each,
-- some 15 GB a day). Now recording a refusal for a tenant over that quota deletes its refusals
-- past the newest KEPT_REFUSALS_OVER_QUOTA, in the same transaction. Only the refusals of
-- submissions (`JobStore::record_rejection`, rows without a session): a session's job rejected
-- after it was queued stays for the retention (a moving session's taking-over job among them,
-- which the sweeper reads to end the move).
--
-- This index walks a tenant's refusals newest first. It holds those rows only: a job that ran,
-- or one of a session, is never in it.
CREATE INDEX jobs_refused ON jobs (tenant, finished_at) WHERE status = 'rejected' AND session_id IS NULL;

-- Whether a tenant keeps its `max_result_bytes` or more (false for a tenant with no row): the
-- one test of it outside `sandcell_record_job`.
CREATE FUNCTION sandcell_over_result_bytes(p_tenant text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT COALESCE((SELECT sum(c.kept_bytes) FROM tenant_job_counts c WHERE c.tenant = p_tenant), 0)
           >= COALESCE((SELECT t.max_result_bytes FROM tenants t WHERE t.tenant = p_tenant), 9223372036854775807)
$$;

REVOKE ALL ON FUNCTION sandcell_over_result_bytes(text) FROM PUBLIC;
