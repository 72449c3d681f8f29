-- Results, refusals and upload answers are deleted SANDCELL_RESULT_RETENTION_S after they
-- ended (core::retention): the sweeper finds the oldest through these indexes. A finished
-- job's row gets one more index entry at its commit (the commit's update is not a HOT one
-- in any case: it changes indexed columns).
CREATE INDEX jobs_finished ON jobs (finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX uploads_created ON uploads (created_at);
