-- A tenant's database login opens at most `max_db_connections` connections at once.
--
-- Why: a tenant's role could open connections until Postgres' `max_connections` (100 by default)
-- were all taken; then no service could open one (a worker's or scheduler's pool growing, a
-- restarted process connecting) and every tenant's jobs stopped. Postgres enforces a role's
-- `CONNECTION LIMIT` itself, and a tenant cannot change it (its role has no CREATEROLE). The
-- quota lives in `tenants` beside the others (one owner: `core::tenants`), which sets the role's
-- limit whenever it creates the role or changes the quota.
--
-- 16 fits the clients sandcell ships several times over: the Rust client holds a pool of 4 and a
-- listener, the Python SDK a connection and a listener.

ALTER TABLE tenants ADD COLUMN max_db_connections integer NOT NULL DEFAULT 16 CHECK (max_db_connections > 0);

-- The roles of tenants registered before this migration get the limit now.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT t.db_role, t.max_db_connections FROM tenants t JOIN pg_roles p ON p.rolname = t.db_role LOOP
        EXECUTE format('ALTER ROLE %I CONNECTION LIMIT %s', r.db_role, r.max_db_connections);
    END LOOP;
END;
$$;
