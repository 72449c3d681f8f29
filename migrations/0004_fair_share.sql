-- Fair share: a tenant has at most `max_jobs_in_flight` jobs of the shared queue dispatched and
-- unfinished. Its further jobs are recorded `queued` and held here (`held_job`: the execution
-- job as it will be published) until one of its jobs finishes; the scheduler's dispatcher then
-- publishes them round-robin across tenants (the tenant dispatched to longest ago goes first).
ALTER TABLE tenants
    ADD COLUMN max_jobs_in_flight integer NOT NULL DEFAULT 4 CHECK (max_jobs_in_flight > 0),
    ADD COLUMN last_dispatch_at   timestamptz;

ALTER TABLE jobs
    -- The job travels on the shared queue (one-off, or opening a session).
    ADD COLUMN shared   boolean NOT NULL DEFAULT false,
    ADD COLUMN held_job bytea;

CREATE INDEX jobs_held ON jobs (tenant, queued_at) WHERE held_job IS NOT NULL;
CREATE INDEX jobs_shared_unfinished ON jobs (tenant) WHERE shared AND status IN ('queued', 'running');
