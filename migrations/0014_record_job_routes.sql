-- The route of a job in an existing session is read by the record's own statement
-- (`JobStore::record_queued`), not by a query of its own before it: one round trip less per
-- session job. Which session takes a job, and how, is decided here and nowhere else:
--
-- - no session of that id for that tenant, or one that is not `active` or `moving`, or an
--   `active` one without a worker: `session_refused`, with the session's state (NULL when there
--   is none) and its worker; nothing is written, and the caller records the refusal, whose
--   words `SessionState::refusal` owns;
-- - `moving`, or earlier jobs of it still parked: the job is recorded parked (its dispatcher
--   publishes it in order to the session's next owner);
-- - otherwise it is routed to the session's worker, returned as `routed_to`.
--
-- The session is read before the tenant's lock, as the separate query read it: a refused job
-- takes no lock and registers no tenant. A duplicate id is answered with the route too, so that
-- the delivery that recorded it can finish its dispatch.

DROP FUNCTION sandcell_record_job(text, text, text, text, jsonb, jsonb, text, integer, text, bytea, bytea, text, boolean);

CREATE FUNCTION sandcell_record_job(
    p_tenant text, p_job_id text, p_language text, p_sha256 text, p_limits jsonb,
    p_execution jsonb,
    -- The session the job opens (with its keep-alive), or the existing one it runs in.
    p_open_session text, p_keep_alive_s integer, p_session_id text,
    -- The job travels on the shared queue: its payload, held if the tenant is at its share.
    p_shared bytea,
    -- A session job's payload as routed (kept while the session lives).
    p_routed bytea)
RETURNS TABLE (outcome text, used bigint, quota bigint, session_state text, routed_to text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    q_jobs bigint; q_sessions bigint; q_bytes bigint;
    n_jobs bigint; n_sessions bigint; n_bytes bigint;
    in_flight integer; n_out bigint; n_waiting bigint;
    held bytea;
    inserted bigint;
    s_state text; s_worker text; s_parked boolean := false;
    v_routed_to text; v_parked boolean := false;
BEGIN
    IF p_session_id IS NOT NULL THEN
        SELECT s.state, s.worker_id,
               EXISTS (SELECT 1 FROM jobs j WHERE j.session_id = s.session_id AND j.parked AND j.status = 'queued')
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
    SELECT t.max_queued_jobs, t.max_sessions, t.max_artifact_bytes,
           (SELECT count(*) FROM jobs j WHERE j.tenant = t.tenant AND j.status IN ('queued', 'running')),
           (SELECT count(*) FROM sessions s WHERE s.tenant = t.tenant AND s.state IN ('starting', 'active')),
           (SELECT COALESCE(sum(a.size_bytes), 0)::bigint FROM artifacts a WHERE a.tenant = t.tenant AND a.state = 'available')
      INTO q_jobs, q_sessions, q_bytes, n_jobs, n_sessions, n_bytes
      FROM tenants t WHERE t.tenant = p_tenant;
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
    IF n_bytes >= q_bytes THEN
        RETURN QUERY SELECT 'over_artifact_bytes'::text, n_bytes, q_bytes, NULL::text, NULL::text;
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
REVOKE ALL ON FUNCTION sandcell_record_job(text, text, text, text, jsonb, jsonb, text, integer, text, bytea, bytea) FROM PUBLIC;
