-- Sessions that survive their worker. A session whose worker died or drained becomes `moving`
-- (no owner); its next job takes it over on another worker, which puts its workspace back from
-- the store. Its jobs wait meanwhile, *parked*, and the scheduler's dispatcher publishes them
-- in order once the session has its new owner. State machine: sandcell_protocol::session.

ALTER TABLE sessions DROP CONSTRAINT sessions_state_check;
ALTER TABLE sessions ADD CONSTRAINT sessions_state_check
    CHECK (state IN ('starting','active','moving','expired','closed','lost','failed'));
ALTER TABLE sessions
    -- The worker that held it before its move, and why it moved (`worker_lost`, `drained`).
    ADD COLUMN moved_from    text,
    ADD COLUMN move_cause    text,
    -- The job sent to take it over: only that job may bind it (like `created_by_job`).
    ADD COLUMN adopting_job  text,
    ADD COLUMN moves         integer NOT NULL DEFAULT 0,
    -- A draining worker's snapshot of the session's variables (an object in the store, written
    -- with dill), the names it could not carry, and the move it was taken for (`moves` after
    -- that move): a snapshot is restored only by the move it was taken for.
    ADD COLUMN snapshot_key   text,
    ADD COLUMN variables_lost jsonb,
    ADD COLUMN snapshot_move  integer;
CREATE INDEX sessions_moving ON sessions (state) WHERE state = 'moving';

ALTER TABLE jobs
    -- A session job's execution job as published, kept while its session lives: re-published
    -- when the session moves before the job ran, and its input files put the workspace back.
    ADD COLUMN routed     bytea,
    -- The worker whose queue it was published to (a copy found in another worker's queue is stale).
    ADD COLUMN routed_to  text,
    -- Waiting for its session's new owner; the dispatcher publishes it.
    ADD COLUMN parked     boolean NOT NULL DEFAULT false;
CREATE INDEX jobs_parked ON jobs (session_id, queued_at) WHERE parked;
CREATE INDEX jobs_routed ON jobs (session_id) WHERE routed IS NOT NULL;
