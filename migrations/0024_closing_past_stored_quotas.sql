-- A tenant over a quota on stored bytes may still close its sessions.
--
-- Why: `sandcell_record_job` refused every new job of a tenant keeping `max_result_bytes` or
-- more in job rows, or storing `max_artifact_bytes` of artifacts, the job that closes a session
-- included. Such a tenant could not end its sessions: each kept its sandbox (~100 MiB of a
-- worker's memory), a place in the tenant's `max_sessions` and its kept execution jobs (the
-- very bytes the quota counts) until its keep-alive ran out, up to an hour; the E2B gateway's
-- `DELETE /sandboxes/{id}` answered 404 and left the sandbox running.
--
-- Now a job that does nothing but close an existing session (`p_only_closes`: no code, no input
-- file, nothing to read back, no variables or context; `Submission::only_closes_its_session`)
-- passes those two quotas. It
-- still counts as a queued job (`max_queued_jobs`), and its result is a few hundred bytes: once
-- the session has ended, further closes of it are refused as `session_closed` before any quota.
--
-- The new parameter has a default, so a scheduler of the previous release calling the function
-- with eleven arguments during a rolling upgrade gets the previous behaviour.

DROP FUNCTION sandcell_record_job(text, text, text, text, jsonb, jsonb, text, integer, text, bytea, bytea);

CREATE FUNCTION sandcell_record_job(
    p_tenant text, p_job_id text, p_language text, p_sha256 text, p_limits jsonb,
    p_execution jsonb,
    -- The session the job opens (with its keep-alive), or the existing one it runs in.
    p_open_session text, p_keep_alive_s integer, p_session_id text,
    -- The job travels on the shared queue: its payload, held if the tenant is at its share.
    p_shared bytea,
    -- A session job's payload as routed (kept while the session lives).
    p_routed bytea,
    -- The job does nothing but close the session `p_session_id` (`Submission::only_closes_its_session`).
    p_only_closes boolean DEFAULT false)
RETURNS TABLE (outcome text, used bigint, quota bigint, session_state text, routed_to text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    q_jobs bigint; q_sessions bigint; q_bytes bigint; q_kept bigint;
    n_jobs bigint; n_sessions bigint; n_bytes bigint; n_kept bigint;
    in_flight integer; n_out bigint; n_waiting bigint;
    held bytea;
    inserted bigint;
    s_state text; s_worker text; s_parked boolean := false;
    v_routed_to text; v_parked boolean := false;
BEGIN
    IF p_session_id IS NOT NULL THEN
        -- The parked check is written so that only `jobs_parked` (a handful of rows) can serve
        -- it: with `j.status = 'queued'` the planner took `jobs_unfinished_by_session` and read
        -- the session's whole backlog (110 rows a submission with 16 sessions fed 200 jobs).
        SELECT s.state, s.worker_id,
               EXISTS (SELECT 1 FROM jobs j WHERE j.session_id = s.session_id AND j.parked AND COALESCE(j.status, '') = 'queued')
          INTO s_state, s_worker, s_parked
          FROM sessions s WHERE s.session_id = p_session_id AND s.tenant = p_tenant;
        IF NOT FOUND OR s_state NOT IN ('active', 'moving') OR (s_state = 'active' AND NOT s_parked AND s_worker IS NULL) THEN
            RETURN QUERY SELECT 'session_refused'::text, 0::bigint, 0::bigint, s_state, s_worker;
            RETURN;
        END IF;
        v_parked := s_state = 'moving' OR s_parked;
        v_routed_to := CASE WHEN v_parked THEN NULL ELSE s_worker END;
    END IF;
    PERFORM 1 FROM tenants WHERE tenant = p_tenant FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'unknown_tenant'::text, 0::bigint, 0::bigint, NULL::text, NULL::text;
        RETURN;
    END IF;
    SELECT t.max_queued_jobs, t.max_sessions, t.max_artifact_bytes, t.max_result_bytes,
           c.unfinished, c.kept,
           (SELECT count(*) FROM sessions s WHERE s.tenant = t.tenant AND s.state IN ('starting', 'active')),
           (SELECT COALESCE(sum(b.bytes), 0)::bigint FROM tenant_artifact_bytes b WHERE b.tenant = t.tenant)
      INTO q_jobs, q_sessions, q_bytes, q_kept, n_jobs, n_kept, n_sessions, n_bytes
      FROM tenants t,
           LATERAL (SELECT COALESCE(sum(jc.unfinished), 0)::bigint AS unfinished, COALESCE(sum(jc.kept_bytes), 0)::bigint AS kept
                      FROM tenant_job_counts jc WHERE jc.tenant = t.tenant) c
     WHERE t.tenant = p_tenant;
    -- A resubmitted id is not a new job: it is answered as a duplicate, over quota or not.
    IF EXISTS (SELECT 1 FROM jobs WHERE tenant = p_tenant AND job_id = p_job_id) THEN
        RETURN QUERY SELECT 'duplicate'::text, 0::bigint, 0::bigint, s_state, v_routed_to;
        RETURN;
    END IF;
    IF n_jobs >= q_jobs THEN
        RETURN QUERY SELECT 'over_queued_jobs'::text, n_jobs, q_jobs, NULL::text, NULL::text;
        RETURN;
    END IF;
    IF p_open_session IS NOT NULL AND n_sessions >= q_sessions THEN
        RETURN QUERY SELECT 'over_sessions'::text, n_sessions, q_sessions, NULL::text, NULL::text;
        RETURN;
    END IF;
    -- A job that only closes one of the tenant's live sessions stores nothing and frees a
    -- sandbox: the quotas on stored bytes let it through.
    IF n_bytes >= q_bytes AND NOT (p_only_closes AND p_session_id IS NOT NULL) THEN
        RETURN QUERY SELECT 'over_artifact_bytes'::text, n_bytes, q_bytes, NULL::text, NULL::text;
        RETURN;
    END IF;
    IF n_kept >= q_kept AND NOT (p_only_closes AND p_session_id IS NOT NULL) THEN
        RETURN QUERY SELECT 'over_result_bytes'::text, n_kept, q_kept, NULL::text, NULL::text;
        RETURN;
    END IF;
    IF p_shared IS NOT NULL THEN
        SELECT t.max_jobs_in_flight,
               (SELECT COALESCE(sum(c.shared_out), 0)::bigint FROM tenant_job_counts c WHERE c.tenant = t.tenant),
               (SELECT COALESCE(sum(c.shared_held), 0)::bigint FROM tenant_job_counts c WHERE c.tenant = t.tenant)
          INTO in_flight, n_out, n_waiting
          FROM tenants t WHERE t.tenant = p_tenant;
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
            p_shared IS NOT NULL, held, p_execution, clock_timestamp(), p_routed, v_routed_to, v_parked)
    ON CONFLICT (tenant, job_id) DO NOTHING;
    GET DIAGNOSTICS inserted = ROW_COUNT;
    IF inserted = 0 THEN
        -- Written meanwhile by a path that does not lock the tenant (a refusal's record): undo
        -- the session this copy opened; the caller reads the job as a duplicate.
        RAISE EXCEPTION 'job % of tenant % recorded meanwhile', p_job_id, p_tenant USING ERRCODE = 'SCDUP';
    END IF;
    RETURN QUERY SELECT (CASE WHEN v_parked THEN 'parked' WHEN held IS NOT NULL THEN 'held' ELSE 'new' END)::text, 0::bigint, 0::bigint,
                        s_state, v_routed_to;
END;
$$;

-- Tenants' roles call nothing of the service's.
REVOKE ALL ON FUNCTION sandcell_record_job(text, text, text, text, jsonb, jsonb, text, integer, text, bytea, bytea, boolean) FROM PUBLIC;
