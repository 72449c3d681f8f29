-- Ended sessions are forgotten too, after their jobs (core::retention::forget_sessions).
--
-- Why: the retention of 0021 deletes a session's jobs once it has ended, but the session's own
-- row (and, for a sandbox the E2B gateway opened, its `gateway_sandboxes` and `gateway_contexts`
-- rows) stayed for ever: one row per session a tenant ever opened, at the rate its sandboxes
-- start, without bound.
--
-- A session's row is deleted once it ended `SANDCELL_RESULT_RETENTION_S` ago, no job of it is
-- left (they go first: a job's `session_id` references it) and no snapshot of it waits for the
-- sweeper (`snapshot_key`).
--
-- `jobs_by_session` serves that "no job is left" and the foreign key's own check on the delete,
-- which without it read the whole `jobs` table for each session. It holds session jobs only:
-- a one-off job's insert does not touch it. Building it holds writes to `jobs` until it is built
-- (as 0021's index did): measured on this project's 2-core test machine, 0.35 s for a million
-- jobs (659 MB, a third of them in sessions, the table in memory).
CREATE INDEX jobs_by_session ON jobs (session_id) WHERE session_id IS NOT NULL;

-- The sessions that ended, oldest first. `ended_at` is written once, when a session ends: the
-- updates every job makes to its session's row (its activity, its expiry) stay heap-only.
CREATE INDEX sessions_ended ON sessions (ended_at) WHERE ended_at IS NOT NULL;
