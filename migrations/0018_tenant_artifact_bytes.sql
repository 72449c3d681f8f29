-- A tenant's stored bytes are kept as its artifacts change, not summed again by every submission.
--
-- Why: `sandcell_record_job` summed the tenant's available artifacts (for the stored-bytes quota)
-- on every submission, under the tenant's row lock, and the worker summed them again to reserve a
-- job's bytes before its upload. Artifacts stay available for their TTL (a day by default, up to
-- a week), so a tenant that ran a bulk job writing one chart per input carried them into every
-- later submission: with 20,000 available artifacts the record took 3.8-4.2 ms of Postgres
-- against 0.13-0.18 ms with none (500 calls, three runs each), one submission after another.
--
-- `tenant_artifact_bytes` holds, per tenant, the bytes of its `available` artifacts. Statement
-- triggers on `artifacts` add each statement's change, from its transition tables, so no path
-- can forget to: a result's insert, the sweeper's expiry (one statement for a whole batch), a
-- deletion (a job's rows going with it by cascade). As with `tenant_job_counts` (0015), each
-- connection adds to the row of its own shard (its backend pid modulo 16), so results committing
-- at once on different connections do not wait for each other's commit, and a tenant's figure is
-- the sum of its rows. A statement that changes several tenants' rows takes them in the order of
-- the tenants' names, so two such statements on connections of the same shard cannot deadlock.
--
-- Exactness is the sum's: the change and the artifacts it counts commit together, so a reader
-- sees both or neither.

CREATE TABLE tenant_artifact_bytes (
    tenant text     NOT NULL,
    shard  smallint NOT NULL,
    bytes  bigint   NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, shard)
);

CREATE FUNCTION sandcell_count_artifact_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Each branch names only the transition tables its event has.
    IF TG_OP = 'INSERT' THEN
        INSERT INTO tenant_artifact_bytes AS c (tenant, shard, bytes)
        SELECT n.tenant, pg_backend_pid() % 16, sum(n.size_bytes)
          FROM new_rows n WHERE n.state = 'available'
         GROUP BY n.tenant ORDER BY n.tenant
        ON CONFLICT (tenant, shard) DO UPDATE SET bytes = c.bytes + EXCLUDED.bytes;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO tenant_artifact_bytes AS c (tenant, shard, bytes)
        SELECT d.tenant, pg_backend_pid() % 16, sum(d.bytes)
          FROM (SELECT n.tenant, n.size_bytes AS bytes FROM new_rows n WHERE n.state = 'available'
                UNION ALL
                SELECT o.tenant, -o.size_bytes FROM old_rows o WHERE o.state = 'available') d
         GROUP BY d.tenant HAVING sum(d.bytes) <> 0 ORDER BY d.tenant
        ON CONFLICT (tenant, shard) DO UPDATE SET bytes = c.bytes + EXCLUDED.bytes;
    ELSE
        INSERT INTO tenant_artifact_bytes AS c (tenant, shard, bytes)
        SELECT o.tenant, pg_backend_pid() % 16, -sum(o.size_bytes)
          FROM old_rows o WHERE o.state = 'available'
         GROUP BY o.tenant ORDER BY o.tenant
        ON CONFLICT (tenant, shard) DO UPDATE SET bytes = c.bytes + EXCLUDED.bytes;
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER artifacts_bytes_insert AFTER INSERT ON artifacts
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION sandcell_count_artifact_bytes();
CREATE TRIGGER artifacts_bytes_update AFTER UPDATE ON artifacts
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION sandcell_count_artifact_bytes();
CREATE TRIGGER artifacts_bytes_delete AFTER DELETE ON artifacts
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION sandcell_count_artifact_bytes();

-- The bytes of the artifacts already there (the triggers exist from here on, in this
-- transaction, which holds the table against writes until it commits).
INSERT INTO tenant_artifact_bytes (tenant, shard, bytes)
SELECT tenant, 0, sum(size_bytes) FROM artifacts WHERE state = 'available' GROUP BY tenant;

-- It served only the sums.
DROP INDEX artifacts_available_by_tenant;

-- The record reads the tenant's kept bytes instead of summing its artifacts (otherwise as in 0015).
CREATE OR REPLACE FUNCTION sandcell_record_job(
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
    SELECT t.max_queued_jobs, t.max_sessions, t.max_artifact_bytes,
           (SELECT COALESCE(sum(c.unfinished), 0)::bigint FROM tenant_job_counts c WHERE c.tenant = t.tenant),
           (SELECT count(*) FROM sessions s WHERE s.tenant = t.tenant AND s.state IN ('starting', 'active')),
           (SELECT COALESCE(sum(b.bytes), 0)::bigint FROM tenant_artifact_bytes b WHERE b.tenant = t.tenant)
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
REVOKE ALL ON FUNCTION sandcell_count_artifact_bytes() FROM PUBLIC;
