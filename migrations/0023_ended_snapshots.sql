-- The sweeper deletes the snapshots (pickled variables of a drained session) of sessions that
-- ended before a move used them (scheduler::sweeper::sweep_snapshots): found through this index,
-- which holds only the few sessions with a snapshot.
CREATE INDEX sessions_with_snapshot ON sessions (session_id) WHERE snapshot_key IS NOT NULL;
