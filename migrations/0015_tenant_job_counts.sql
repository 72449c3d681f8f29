-- A tenant's unfinished jobs are counted as they change, not counted again by every submission.
--
-- Why: `sandcell_record_job` counted the tenant's `queued` and `running` jobs (and, for a job of
-- the shared queue, its shared ones in flight and held) on every submission, under the tenant's
-- row lock: a scan of the tenant's whole backlog, one submission after another. With 1,600 jobs
-- queued (16 sessions fed 200 jobs each) that one statement took 0.62 ms of Postgres per
-- submission, and it grows with the backlog; reading the counts below takes 0.05 ms.
--
-- `tenant_job_counts` holds, per tenant, the jobs that are `queued` or `running`, and of those
-- the shared-queue jobs dispatched (`shared_out`) and held for fair share (`shared_held`). The
-- triggers below keep it: every insert, status or hold change and delete of a job row adds its
-- delta, so no code path can forget to. A tenant's figures are the sum of its rows: each
-- database connection adds to the row of its own shard (its backend pid modulo 16), so jobs of
-- one tenant finishing at once on different connections do not wait for each other's commit.
--
-- Exactness is the old count's: a submission reads the figures under its tenant's row lock, the
-- only place a job becomes `queued` or stops being held (the dispatcher takes held jobs under it
-- too), so every earlier submission's increment is visible; a job finishing in the same instant
-- may not be yet, which errs on the side of the quota, as the count did.

CREATE TABLE tenant_job_counts (
    tenant      text     NOT NULL,
    shard       smallint NOT NULL,
    -- `queued` or `running`.
    unfinished  bigint   NOT NULL DEFAULT 0,
    -- Of those, shared-queue jobs dispatched (not held), and held.
    shared_out  bigint   NOT NULL DEFAULT 0,
    shared_held bigint   NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, shard)
);

-- A job row's contribution (unfinished, shared_out, shared_held) is added when it appears or
-- changes and taken away when it changes or goes. An UPDATE of the connection's own row first:
-- the row exists for all but a tenant's first jobs on that connection.
CREATE FUNCTION sandcell_count_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    d_unfinished integer := 0;
    d_out integer := 0;
    d_held integer := 0;
    v_tenant text;
BEGIN
    IF TG_OP <> 'INSERT' THEN
        v_tenant := OLD.tenant;
        IF OLD.status IN ('queued', 'running') THEN
            d_unfinished := -1;
            IF OLD.shared THEN
                IF OLD.held_job IS NULL THEN d_out := -1; ELSE d_held := -1; END IF;
            END IF;
        END IF;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        v_tenant := NEW.tenant;
        IF NEW.status IN ('queued', 'running') THEN
            d_unfinished := d_unfinished + 1;
            IF NEW.shared THEN
                IF NEW.held_job IS NULL THEN d_out := d_out + 1; ELSE d_held := d_held + 1; END IF;
            END IF;
        END IF;
    END IF;
    IF d_unfinished = 0 AND d_out = 0 AND d_held = 0 THEN
        RETURN NULL;
    END IF;
    UPDATE tenant_job_counts
       SET unfinished = unfinished + d_unfinished, shared_out = shared_out + d_out, shared_held = shared_held + d_held
     WHERE tenant = v_tenant AND shard = pg_backend_pid() % 16;
    IF NOT FOUND THEN
        INSERT INTO tenant_job_counts AS c (tenant, shard, unfinished, shared_out, shared_held)
        VALUES (v_tenant, pg_backend_pid() % 16, d_unfinished, d_out, d_held)
        ON CONFLICT (tenant, shard) DO UPDATE
            SET unfinished = c.unfinished + EXCLUDED.unfinished,
                shared_out = c.shared_out + EXCLUDED.shared_out,
                shared_held = c.shared_held + EXCLUDED.shared_held;
    END IF;
    RETURN NULL;
END;
$$;

-- Only rows whose contribution may change fire it.
CREATE TRIGGER jobs_count_insert AFTER INSERT ON jobs
    FOR EACH ROW WHEN (NEW.status IN ('queued', 'running'))
    EXECUTE FUNCTION sandcell_count_jobs();
CREATE TRIGGER jobs_count_update AFTER UPDATE OF status, shared, held_job, tenant ON jobs
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.shared IS DISTINCT FROM NEW.shared
                       OR (OLD.held_job IS NULL) <> (NEW.held_job IS NULL) OR OLD.tenant IS DISTINCT FROM NEW.tenant)
    EXECUTE FUNCTION sandcell_count_jobs();
CREATE TRIGGER jobs_count_delete AFTER DELETE ON jobs
    FOR EACH ROW WHEN (OLD.status IN ('queued', 'running'))
    EXECUTE FUNCTION sandcell_count_jobs();

-- The figures of the jobs already there (the triggers exist from here on, in this transaction).
INSERT INTO tenant_job_counts (tenant, shard, unfinished, shared_out, shared_held)
SELECT tenant, 0, count(*),
       count(*) FILTER (WHERE shared AND held_job IS NULL),
       count(*) FILTER (WHERE shared AND held_job IS NOT NULL)
  FROM jobs WHERE status IN ('queued', 'running') GROUP BY tenant;

-- The record reads the figures instead of counting, and finds a session's parked jobs through
-- their own index (otherwise as in 0014).
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
REVOKE ALL ON FUNCTION sandcell_count_jobs() FROM PUBLIC;
