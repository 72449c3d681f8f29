-- Built-in functions a tenant's database login must not execute, and what sandcell's own role
-- needs to see and end a tenant's session that holds what all share. Run once in sandcell's
-- database, as a superuser (only a built-in function's owner can revoke what PUBLIC holds on it,
-- and sandcell's own role is not one): `deploy/local/up.sh` and `deploy/local/test.sh` do;
-- elsewhere see docs/operations.md. Idempotent. sandcell's scheduler checks at start that it was
-- applied (`sandcell_core::tenants::lockdown_missing`) and logs an error naming
-- this file if not.
--
-- Why: a tenant gets a login that can only read its own rows, but PUBLIC may execute these in
-- every database, and with them one tenant harmed every other:
-- - advisory locks: ~12,000 of them, taken from one connection, fill Postgres' shared lock
--   table; then every new connection fails (`FATAL: out of shared memory`) and so does any
--   statement needing a lock the table has no room for, for as long as that session lives.
--   One lock of the schedulers' presence class made each scheduler count one more scheduler
--   and give up part of the intake's partitions, which nobody then consumed; one of the
--   partition class kept that partition from every scheduler;
-- - large objects: a tenant could create them without bound (`lo_from_bytea`), filling the
--   disk Postgres shares with every tenant, outside every quota;
-- - `pg_get_object_address` takes a lock on each object it is asked about, kept to the end of
--   the transaction: called for every function, type, operator and collation, 5,321 locks
--   from one session in 0.35 s, and four sessions filled the lock table as above;
-- - temporary files: a cursor declared `WITH HOLD` keeps its rows in one for the session's
--   life (936 MB from one statement in 2.7 s), and nothing bounded them (`temp_file_limit`,
--   set below).
-- sandcell's own role keeps the advisory locks (the intake's partitions, sqlx's migration lock);
-- it uses no large objects. And it is let see and end other roles' sessions
-- (`pg_read_all_stats`: without it `pg_stat_activity` hides their state; `pg_signal_backend`,
-- which cannot touch a superuser's): a tenant's session with a transaction open, one statement or
-- many, holds back vacuum for every table and holds the notification queue, which every job's commit
-- writes to (two connections of one tenant filled it in 44 s, and then every commit failed:
-- `too many notifications in the NOTIFY queue`); the scheduler ends such sessions
-- (`SANDCELL_TENANT_DB_HOLD_S`), and only a superuser can let it.

SET client_min_messages = warning;

DO $$
DECLARE
    owner name := (SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database());
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'pg_advisory_lock(bigint)', 'pg_advisory_lock(integer,integer)',
        'pg_advisory_lock_shared(bigint)', 'pg_advisory_lock_shared(integer,integer)',
        'pg_try_advisory_lock(bigint)', 'pg_try_advisory_lock(integer,integer)',
        'pg_try_advisory_lock_shared(bigint)', 'pg_try_advisory_lock_shared(integer,integer)',
        'pg_advisory_xact_lock(bigint)', 'pg_advisory_xact_lock(integer,integer)',
        'pg_advisory_xact_lock_shared(bigint)', 'pg_advisory_xact_lock_shared(integer,integer)',
        'pg_try_advisory_xact_lock(bigint)', 'pg_try_advisory_xact_lock(integer,integer)',
        'pg_try_advisory_xact_lock_shared(bigint)', 'pg_try_advisory_xact_lock_shared(integer,integer)'
    ] LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION pg_catalog.%s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION pg_catalog.%s TO %I', f, owner);
    END LOOP;
    FOREACH f IN ARRAY ARRAY['lo_creat(integer)', 'lo_create(oid)', 'lo_from_bytea(oid,bytea)', 'pg_get_object_address(text,text[],text[])'] LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION pg_catalog.%s FROM PUBLIC', f);
    END LOOP;
    EXECUTE format('GRANT pg_read_all_stats, pg_signal_backend TO %I', owner);
    -- Temporary files (a sort, a cursor held past its transaction) are written to the disk all
    -- share, and no quota counts them: a session of this database writes at most this much at
    -- once (a tenant cannot raise it: only a superuser may), but the owner's own.
    EXECUTE format('ALTER DATABASE %I SET temp_file_limit = %L', current_database(), '256MB');
    EXECUTE format('ALTER ROLE %I IN DATABASE %I SET temp_file_limit = -1', owner, current_database());
END;
$$;
