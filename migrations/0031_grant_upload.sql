-- An upload grant in one statement: the tenant's row lock, the standing answer, both quotas and
-- the grant's row, one round trip (`core::uploads::grant`).
--
-- Why: a grant was a transaction of eight round trips (begin, the tenant registered if new, its
-- row locked, a standing answer looked for, its stored bytes, its kept bytes, the insert, the
-- commit), six of them and the commit's flush under the tenant's row lock. A tenant's grants are
-- judged one after another under that lock, so a flood of granted requests (3,000 of 10 bytes,
-- spread over the intake's 8 partitions by upload id) left the partitions at ~600 a second and
-- held another tenant's job published behind it up 5.2 s. Now a grant is one statement, and the
-- scheduler's grant writer records many in one (`sandcell_grant_uploads` below), each tenant's
-- lock held from its first grant of the batch to the batch's commit. A tenant with no row yet (named by a trusted publisher) is answered
-- `unknown_tenant`; the caller registers it and asks again, as `sandcell_record_job` does.
--
-- With `p_wait` false the tenant's row is not waited for: a row another transaction holds is
-- answered `busy` (the grant writer's batches, which serve every tenant, never wait behind one
-- tenant's lock; its handler then asks on its own, waiting).
--
-- Outcomes: `granted` (`answer` the row as inserted, `inserted` true), `standing` (an earlier
-- answer for the same id, which stands), `busy`, `over_stored_bytes` (`used` bytes stored, reserved or
-- uploadable, against `quota`, `max_artifact_bytes`), `over_result_bytes` (`used` bytes kept in
-- the database, against `max_result_bytes`), `unknown_tenant`. A refusal is not recorded here:
-- the caller writes it as any other refused answer (`core::uploads::record`), no lock needed.

CREATE FUNCTION sandcell_grant_upload(p_tenant text, p_upload_id text, p_doc jsonb, p_bytes bigint, p_objects_expire_at timestamptz, p_wait boolean)
RETURNS TABLE (outcome text, answer jsonb, inserted boolean, used bigint, quota bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    q_bytes bigint; q_kept bigint;
    n_used bigint; n_kept bigint;
    v_doc jsonb; v_inserted boolean;
BEGIN
    IF p_wait THEN
        SELECT t.max_artifact_bytes, t.max_result_bytes INTO q_bytes, q_kept
          FROM tenants t WHERE t.tenant = p_tenant FOR UPDATE;
    ELSE
        SELECT t.max_artifact_bytes, t.max_result_bytes INTO q_bytes, q_kept
          FROM tenants t WHERE t.tenant = p_tenant FOR UPDATE SKIP LOCKED;
    END IF;
    IF NOT FOUND THEN
        IF NOT p_wait AND EXISTS (SELECT 1 FROM tenants t WHERE t.tenant = p_tenant) THEN
            RETURN QUERY SELECT 'busy'::text, NULL::jsonb, false, 0::bigint, 0::bigint;
        ELSE
            RETURN QUERY SELECT 'unknown_tenant'::text, NULL::jsonb, false, 0::bigint, 0::bigint;
        END IF;
        RETURN;
    END IF;
    SELECT u.grant_doc INTO v_doc FROM uploads u WHERE u.tenant = p_tenant AND u.upload_id = p_upload_id;
    IF FOUND THEN
        RETURN QUERY SELECT 'standing'::text, v_doc, false, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    n_used := sandcell_stored_bytes(p_tenant, NULL);
    -- used + wanted > quota, without overflowing: `p_bytes` may be the largest bigint.
    IF n_used > q_bytes - p_bytes THEN
        RETURN QUERY SELECT 'over_stored_bytes'::text, NULL::jsonb, false, n_used, q_bytes;
        RETURN;
    END IF;
    SELECT COALESCE(sum(c.kept_bytes), 0)::bigint INTO n_kept FROM tenant_job_counts c WHERE c.tenant = p_tenant;
    IF n_kept >= q_kept THEN
        RETURN QUERY SELECT 'over_result_bytes'::text, NULL::jsonb, false, n_kept, q_kept;
        RETURN;
    END IF;
    -- The no-op update makes a conflict return the standing row; `xmax = 0` holds only for a row
    -- this statement inserted.
    INSERT INTO uploads AS u (tenant, upload_id, grant_doc, granted_bytes, objects_expire_at)
    VALUES (p_tenant, p_upload_id, p_doc, p_bytes, p_objects_expire_at)
    ON CONFLICT (tenant, upload_id) DO UPDATE SET tenant = u.tenant
    RETURNING u.grant_doc, (u.xmax = 0) INTO v_doc, v_inserted;
    RETURN QUERY SELECT CASE WHEN v_inserted THEN 'granted' ELSE 'standing' END::text, v_doc, v_inserted, n_used, q_bytes;
END;
$$;

REVOKE ALL ON FUNCTION sandcell_grant_upload(text, text, jsonb, bigint, timestamptz, boolean) FROM PUBLIC;

-- Many grants in one statement and one commit (`core::uploads::grant_many`, the scheduler's grant
-- writer): each as `sandcell_grant_upload` answers it, in the order given, which the caller sorts
-- by tenant and upload id. A tenant's lock, once taken, is held to the batch's commit; the writer
-- passes `p_wait` false, so no batch waits for a tenant's row another transaction holds (and two
-- batches never hold the same tenant's), and bounds its other lock waits (`lock_timeout`). Why: each grant's commit is a WAL flush and a notification, and a
-- tenant's grants wait for each other's lock through it; a batch pays that once.
CREATE FUNCTION sandcell_grant_uploads(p_tenants text[], p_upload_ids text[], p_docs jsonb[], p_bytes bigint[], p_objects_expire_at timestamptz[], p_wait boolean)
RETURNS TABLE (ord integer, outcome text, answer jsonb, inserted boolean, used bigint, quota bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    FOR i IN 1 .. COALESCE(array_length(p_tenants, 1), 0) LOOP
        RETURN QUERY SELECT i, g.outcome, g.answer, g.inserted, g.used, g.quota
          FROM sandcell_grant_upload(p_tenants[i], p_upload_ids[i], p_docs[i], p_bytes[i], p_objects_expire_at[i], p_wait) g;
    END LOOP;
END;
$$;

REVOKE ALL ON FUNCTION sandcell_grant_uploads(text[], text[], jsonb[], bigint[], timestamptz[], boolean) FROM PUBLIC;
