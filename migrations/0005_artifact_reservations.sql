-- A tenant's stored bytes are exact even when several of its jobs commit at the same moment.
-- Before it uploads a job's files, the worker reserves the bytes it may store, under the
-- tenant's row lock: what is available, plus what the tenant's other running jobs reserved, is
-- never more than `max_artifact_bytes`. The commit that records the artifacts deletes the
-- reservation in its own transaction; a reservation of a job that is no longer running (its
-- worker died) counts for nothing.
CREATE TABLE artifact_reservations (
    tenant      text        NOT NULL,
    job_id      text        NOT NULL,
    bytes       bigint      NOT NULL CHECK (bytes >= 0),
    reserved_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, job_id),
    FOREIGN KEY (tenant, job_id) REFERENCES jobs (tenant, job_id) ON DELETE CASCADE
);
