-- What a tenant makes Postgres keep is counted, and bounded by a quota of its own.
--
-- Why: every job is a row (its result, and while its session lives or it waits for its share,
-- the execution job it carries: inline input files up to 10 MiB), and so is every refusal. The
-- stored-bytes quota counts the object store only; the database all tenants share had no bound
-- per tenant but the retention (core::retention, migration 0021): a tenant submitting jobs that
-- print their megabyte of output filled it at its own rate for 30 days.
--
-- `tenant_job_counts.kept_bytes` holds, per tenant (and shard, as its other figures), the bytes
-- of its job rows' documents as stored (`pg_column_size`, compressed or not): the result
-- (`execution`), the refusal or failure (`reason`), the execution job kept to move a session
-- (`routed`) or held for fair share (`held_job`). The count trigger of 0015 now adds each row's
-- change of size too, so no path can forget to: a record, a commit, a session's end dropping its
-- kept jobs, a dispatch of a held job, the retention's delete. It fires on the same statements
-- as before on a job's path (its insert, its claim, its commit), plus those that change a size.
--
-- `sandcell_record_job` refuses a new job, `quota_exceeded`, while the tenant keeps
-- `max_result_bytes` or more (checked as the other quotas, under the tenant's row lock; a job
-- recorded just under it may take it over by its own result, by at most one result's size).

ALTER TABLE tenants ADD COLUMN max_result_bytes bigint NOT NULL DEFAULT 2147483648 CHECK (max_result_bytes > 0);
ALTER TABLE tenant_job_counts ADD COLUMN kept_bytes bigint NOT NULL DEFAULT 0;

-- A job row's stored documents, as the count keeps them.
CREATE FUNCTION sandcell_job_kept_bytes(execution jsonb, reason jsonb, routed bytea, held_job bytea) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT (COALESCE(pg_column_size(execution), 0) + COALESCE(pg_column_size(reason), 0)
            + COALESCE(pg_column_size(routed), 0) + COALESCE(pg_column_size(held_job), 0))::bigint
$$;

CREATE OR REPLACE FUNCTION sandcell_count_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    d_unfinished integer := 0;
    d_out integer := 0;
    d_held integer := 0;
    d_kept bigint := 0;
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
        d_kept := -sandcell_job_kept_bytes(OLD.execution, OLD.reason, OLD.routed, OLD.held_job);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        v_tenant := NEW.tenant;
        IF NEW.status IN ('queued', 'running') THEN
            d_unfinished := d_unfinished + 1;
            IF NEW.shared THEN
                IF NEW.held_job IS NULL THEN d_out := d_out + 1; ELSE d_held := d_held + 1; END IF;
            END IF;
        END IF;
        d_kept := d_kept + sandcell_job_kept_bytes(NEW.execution, NEW.reason, NEW.routed, NEW.held_job);
    END IF;
    IF d_unfinished = 0 AND d_out = 0 AND d_held = 0 AND d_kept = 0 THEN
        RETURN NULL;
    END IF;
    UPDATE tenant_job_counts
       SET unfinished = unfinished + d_unfinished, shared_out = shared_out + d_out, shared_held = shared_held + d_held,
           kept_bytes = kept_bytes + d_kept
     WHERE tenant = v_tenant AND shard = pg_backend_pid() % 16;
    IF NOT FOUND THEN
        INSERT INTO tenant_job_counts AS c (tenant, shard, unfinished, shared_out, shared_held, kept_bytes)
        VALUES (v_tenant, pg_backend_pid() % 16, d_unfinished, d_out, d_held, d_kept)
        ON CONFLICT (tenant, shard) DO UPDATE
            SET unfinished = c.unfinished + EXCLUDED.unfinished,
                shared_out = c.shared_out + EXCLUDED.shared_out,
                shared_held = c.shared_held + EXCLUDED.shared_held,
                kept_bytes = c.kept_bytes + EXCLUDED.kept_bytes;
    END IF;
    RETURN NULL;
END;
$$;

-- Every insert and delete changes the bytes kept; so may every update that sets a counted
-- figure or document: the function finds the change from the rows as stored and does nothing
-- when there is none (a WHEN comparing sizes might not see the new row as it is stored). A
-- job's claim and commit fired it before as well.
DROP TRIGGER jobs_count_insert ON jobs;
DROP TRIGGER jobs_count_update ON jobs;
DROP TRIGGER jobs_count_delete ON jobs;
CREATE TRIGGER jobs_count_insert AFTER INSERT ON jobs
    FOR EACH ROW EXECUTE FUNCTION sandcell_count_jobs();
CREATE TRIGGER jobs_count_update AFTER UPDATE OF status, shared, held_job, tenant, execution, reason, routed ON jobs
    FOR EACH ROW EXECUTE FUNCTION sandcell_count_jobs();
CREATE TRIGGER jobs_count_delete AFTER DELETE ON jobs
    FOR EACH ROW EXECUTE FUNCTION sandcell_count_jobs();

-- The bytes of the rows already there (the trigger counts from here on, in this transaction,
-- which holds `jobs` against writes until it commits).
INSERT INTO tenant_job_counts AS c (tenant, shard, kept_bytes)
SELECT tenant, 0, sum(sandcell_job_kept_bytes(execution, reason, routed, held_job))::bigint FROM jobs GROUP BY tenant
ON CONFLICT (tenant, shard) DO UPDATE SET kept_bytes = c.kept_bytes + EXCLUDED.kept_bytes;

-- The record refuses a tenant keeping its `max_result_bytes` (otherwise as in 0018).
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
    IF n_bytes >= q_bytes THEN
        RETURN QUERY SELECT 'over_artifact_bytes'::text, n_bytes, q_bytes, NULL::text, NULL::text;
        RETURN;
    END IF;
    IF n_kept >= q_kept THEN
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

REVOKE ALL ON FUNCTION sandcell_job_kept_bytes(jsonb, jsonb, bytea, bytea) FROM PUBLIC;
