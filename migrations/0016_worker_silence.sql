-- Whether a worker's silence is evidence that it died: the one rule, for every statement that
-- acts on it (the sweeper moving a silent worker's sessions and ending its jobs, a worker's
-- claim taking a redelivered job over from a silent one).
--
-- Heartbeats are rows in this database. While the database is down no worker can beat, and when
-- it comes back every heartbeat is as old as the outage, though no worker died. So silence counts
-- only once the database has been up for longer than the silence itself: by then every live
-- worker has beaten again (a heartbeat comes every `SANDCELL_HEARTBEAT_S`, 5 s by default, well
-- inside `SANDCELL_WORKER_DEAD_AFTER_S`, 30 s).
--
-- Why here and not only in the sweeper (which also waits out outages it sees): a statement held
-- up by the outage itself (its connection waits for the database to come back, as sqlx's pool
-- does) runs the moment it is back, against heartbeats the outage made old. Seen in CI: a job
-- running through a 16 s restart of Postgres was ended `worker_lost` by the sweeper the instant
-- Postgres answered again, with a dead-after of 12 s.
--
-- A worker with no row at all (never beat) is silent, as before.
CREATE FUNCTION sandcell_worker_silent(p_worker_id text, p_silence_ms bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT pg_postmaster_start_time() < now() - p_silence_ms * interval '1 millisecond'
       AND NOT EXISTS (SELECT 1 FROM workers w
                       WHERE w.worker_id = p_worker_id AND w.last_seen_at > now() - p_silence_ms * interval '1 millisecond')
$$;

-- Tenants' roles call nothing of the service's.
REVOKE ALL ON FUNCTION sandcell_worker_silent(text, bigint) FROM PUBLIC;
