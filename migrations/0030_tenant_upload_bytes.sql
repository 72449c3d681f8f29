-- A tenant's uploadable bytes are kept as its upload grants change, not summed again by every
-- grant and every artifact reservation.
--
-- Why: what counts against a tenant's stored-bytes quota includes the bytes its upload grants
-- let it put whose objects are not removed yet (migration 0019), and `core::tenants::stored_bytes`
-- summed them from `uploads` on every upload grant and every job's artifact reservation, under
-- the tenant's row lock. A grant's objects live a day (`SANDCELL_UPLOAD_TTL_S`), and nothing
-- bounds how many grants a tenant holds but its quotas: a tenant asking for one byte a grant
-- carried each grant into every later one. With 100,000 live grants the sum took 16-22 ms of
-- Postgres a call (a scratch database, three calls), so each further grant, and each of the
-- tenant's jobs storing a file, cost the database every tenant shares that much, one after
-- another under the lock: quadratic in the grants, as the artifacts' sum was before 0018.
--
-- `tenant_upload_bytes` holds, per tenant, the granted bytes of its live grants
-- (`objects_expire_at` set, `objects_removed_at` not). Statement triggers on `uploads` add each
-- statement's change from its transition tables, so no path can forget to: a grant's insert,
-- the sweeper's removal, a row's deletion by the retention. As `tenant_artifact_bytes` (0018),
-- each connection adds to the row of its own shard (its backend pid modulo 16), a tenant's figure
-- is the sum of its rows, and a statement that changes several tenants' rows takes them in the
-- order of the tenants' names. The change and the grants it counts commit together.
--
-- `sandcell_stored_bytes` is the one sum of a tenant's footprint in the store (its available
-- artifacts, its running jobs' reservations, its live grants), read under the tenant's lock by
-- the grant and by the worker's reservation alike.

CREATE TABLE tenant_upload_bytes (
    tenant text     NOT NULL,
    shard  smallint NOT NULL,
    bytes  bigint   NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, shard)
);

CREATE FUNCTION sandcell_count_uploadable_bytes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO tenant_upload_bytes AS c (tenant, shard, bytes)
        SELECT n.tenant, pg_backend_pid() % 16, sum(n.granted_bytes)
          FROM new_rows n WHERE n.objects_expire_at IS NOT NULL AND n.objects_removed_at IS NULL
         GROUP BY n.tenant HAVING sum(n.granted_bytes) <> 0 ORDER BY n.tenant
        ON CONFLICT (tenant, shard) DO UPDATE SET bytes = c.bytes + EXCLUDED.bytes;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO tenant_upload_bytes AS c (tenant, shard, bytes)
        SELECT d.tenant, pg_backend_pid() % 16, sum(d.bytes)
          FROM (SELECT n.tenant, n.granted_bytes AS bytes FROM new_rows n
                 WHERE n.objects_expire_at IS NOT NULL AND n.objects_removed_at IS NULL
                UNION ALL
                SELECT o.tenant, -o.granted_bytes FROM old_rows o
                 WHERE o.objects_expire_at IS NOT NULL AND o.objects_removed_at IS NULL) d
         GROUP BY d.tenant HAVING sum(d.bytes) <> 0 ORDER BY d.tenant
        ON CONFLICT (tenant, shard) DO UPDATE SET bytes = c.bytes + EXCLUDED.bytes;
    ELSE
        INSERT INTO tenant_upload_bytes AS c (tenant, shard, bytes)
        SELECT o.tenant, pg_backend_pid() % 16, -sum(o.granted_bytes)
          FROM old_rows o WHERE o.objects_expire_at IS NOT NULL AND o.objects_removed_at IS NULL
         GROUP BY o.tenant HAVING sum(o.granted_bytes) <> 0 ORDER BY o.tenant
        ON CONFLICT (tenant, shard) DO UPDATE SET bytes = c.bytes + EXCLUDED.bytes;
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER uploads_uploadable_insert AFTER INSERT ON uploads
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION sandcell_count_uploadable_bytes();
CREATE TRIGGER uploads_uploadable_update AFTER UPDATE ON uploads
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION sandcell_count_uploadable_bytes();
CREATE TRIGGER uploads_uploadable_delete AFTER DELETE ON uploads
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION sandcell_count_uploadable_bytes();

-- The grants already there (the triggers count from here on, in this transaction, which holds
-- `uploads` against writes until it commits).
INSERT INTO tenant_upload_bytes (tenant, shard, bytes)
SELECT tenant, 0, sum(granted_bytes) FROM uploads
 WHERE objects_expire_at IS NOT NULL AND objects_removed_at IS NULL
 GROUP BY tenant;

-- The tenant's stored, reserved and uploadable bytes: its available artifacts, the reservations
-- of its running jobs but `p_except_job`'s, and its live grants. Read under the tenant's row lock.
CREATE FUNCTION sandcell_stored_bytes(p_tenant text, p_except_job text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT (COALESCE((SELECT sum(b.bytes) FROM tenant_artifact_bytes b WHERE b.tenant = p_tenant), 0)
          + COALESCE((SELECT sum(r.bytes) FROM artifact_reservations r
                      JOIN jobs j ON j.tenant = r.tenant AND j.job_id = r.job_id
                      WHERE r.tenant = p_tenant AND r.job_id IS DISTINCT FROM p_except_job AND j.status = 'running'), 0)
          + COALESCE((SELECT sum(u.bytes) FROM tenant_upload_bytes u WHERE u.tenant = p_tenant), 0))::bigint
$$;

-- `uploads_live`, the index only the sum read, is kept: during a rolling upgrade the binaries of
-- before this migration still sum from `uploads`, and without it they would read every row of a
-- tenant's under its lock. A later migration may drop it.

REVOKE ALL ON FUNCTION sandcell_stored_bytes(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION sandcell_count_uploadable_bytes() FROM PUBLIC;
