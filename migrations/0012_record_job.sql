-- A submission is recorded in one round trip (`JobStore::record_queued`): the tenant's row
-- lock, its quotas, its fair share, the session it opens and the job's row, which were five to
-- seven statements of a transaction, each a round trip from the scheduler.
--
-- Each statement of a VOLATILE plpgsql function takes a fresh snapshot under READ COMMITTED,
-- exactly as the separate statements did: the counts read after the lock is granted include
-- the job of the submission that held it. Quotas are checked here and nowhere else.
--
-- outcome: 'new', 'held' (fair share: the dispatcher publishes it), 'parked' (its session is
-- moving), 'duplicate' (the id is taken: nothing was written), 'unknown_tenant' (no row to
-- lock: register the tenant and call again), or the quota refused, with the count and the
-- quota: 'over_queued_jobs', 'over_sessions', 'over_artifact_bytes'.
CREATE OR REPLACE FUNCTION sandcell_record_job(
    p_tenant text, p_job_id text, p_language text, p_sha256 text, p_limits jsonb,
    p_execution jsonb,
    -- The session the job opens (with its keep-alive), or the existing one it runs in.
    p_open_session text, p_keep_alive_s integer, p_session_id text,
    -- The job travels on the shared queue: its payload, held if the tenant is at its share.
    p_shared bytea,
    -- A session job's payload as routed, the owner it was routed to, parked when none.
    p_routed bytea, p_routed_to text, p_parked boolean)
RETURNS TABLE (outcome text, used bigint, quota bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    q_jobs bigint; q_sessions bigint; q_bytes bigint;
    n_jobs bigint; n_sessions bigint; n_bytes bigint;
    in_flight integer; n_out bigint; n_waiting bigint;
    held bytea;
    inserted bigint;
BEGIN
    PERFORM 1 FROM tenants WHERE tenant = p_tenant FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'unknown_tenant'::text, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    SELECT t.max_queued_jobs, t.max_sessions, t.max_artifact_bytes,
           (SELECT count(*) FROM jobs j WHERE j.tenant = t.tenant AND j.status IN ('queued', 'running')),
           (SELECT count(*) FROM sessions s WHERE s.tenant = t.tenant AND s.state IN ('starting', 'active')),
           (SELECT COALESCE(sum(a.size_bytes), 0)::bigint FROM artifacts a WHERE a.tenant = t.tenant AND a.state = 'available')
      INTO q_jobs, q_sessions, q_bytes, n_jobs, n_sessions, n_bytes
      FROM tenants t WHERE t.tenant = p_tenant;
    -- A resubmitted id is not a new job: it is answered as a duplicate, over quota or not.
    IF EXISTS (SELECT 1 FROM jobs WHERE tenant = p_tenant AND job_id = p_job_id) THEN
        RETURN QUERY SELECT 'duplicate'::text, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    IF n_jobs >= q_jobs THEN
        RETURN QUERY SELECT 'over_queued_jobs'::text, n_jobs, q_jobs;
        RETURN;
    END IF;
    IF p_open_session IS NOT NULL AND n_sessions >= q_sessions THEN
        RETURN QUERY SELECT 'over_sessions'::text, n_sessions, q_sessions;
        RETURN;
    END IF;
    IF n_bytes >= q_bytes THEN
        RETURN QUERY SELECT 'over_artifact_bytes'::text, n_bytes, q_bytes;
        RETURN;
    END IF;
    IF p_shared IS NOT NULL THEN
        SELECT t.max_jobs_in_flight,
               count(j.job_id) FILTER (WHERE j.held_job IS NULL),
               count(j.job_id) FILTER (WHERE j.held_job IS NOT NULL)
          INTO in_flight, n_out, n_waiting
          FROM tenants t LEFT JOIN jobs j ON j.tenant = t.tenant AND j.shared AND j.status IN ('queued', 'running')
         WHERE t.tenant = p_tenant GROUP BY t.max_jobs_in_flight;
        IF n_waiting > 0 OR n_out >= in_flight THEN
            held := p_shared;
        END IF;
    END IF;
    IF p_open_session IS NOT NULL THEN
        INSERT INTO sessions (session_id, tenant, state, keep_alive_s, created_by_job)
        VALUES (p_open_session, p_tenant, 'starting', p_keep_alive_s, p_job_id);
    END IF;
    -- `queued_at` is read now, under the tenant's row lock, not at the statement's start: one
    -- tenant's jobs are recorded in the order they were admitted, which is the order held jobs
    -- are dispatched in (`take_held`).
    INSERT INTO jobs (tenant, job_id, status, language, submission_sha256, limits, session_id, shared, held_job, execution, queued_at,
                      routed, routed_to, parked)
    VALUES (p_tenant, p_job_id, 'queued', p_language, p_sha256, p_limits, COALESCE(p_open_session, p_session_id),
            p_shared IS NOT NULL, held, p_execution, clock_timestamp(), p_routed, p_routed_to, p_parked)
    ON CONFLICT (tenant, job_id) DO NOTHING;
    GET DIAGNOSTICS inserted = ROW_COUNT;
    IF inserted = 0 THEN
        -- Written meanwhile by a path that does not lock the tenant (a refusal's record): undo
        -- the session this copy opened; the caller reads the job as a duplicate.
        RAISE EXCEPTION 'job % of tenant % recorded meanwhile', p_job_id, p_tenant USING ERRCODE = 'SCDUP';
    END IF;
    RETURN QUERY SELECT (CASE WHEN p_parked THEN 'parked' WHEN held IS NOT NULL THEN 'held' ELSE 'new' END)::text, 0::bigint, 0::bigint;
END;
$$;

-- Tenants' roles call nothing of the service's.
REVOKE ALL ON FUNCTION sandcell_record_job(text, text, text, text, jsonb, jsonb, text, integer, text, bytea, bytea, text, boolean) FROM PUBLIC;
