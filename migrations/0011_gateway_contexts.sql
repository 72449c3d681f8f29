-- The gateway's code contexts, and a sandbox's own environment variables.
--
-- A context is a namespace of the session's kernel (a job's `context`): the gateway names it
-- `namespace`, which changes when the context is restarted (the kernel makes a fresh namespace
-- on first use of a new name). A deleted context's row is gone: runs naming it are refused.
CREATE TABLE gateway_contexts (
    session_id  text        NOT NULL REFERENCES gateway_sandboxes (session_id),
    context_id  text        NOT NULL,
    namespace   text        NOT NULL,
    language    text        NOT NULL,
    cwd         text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (session_id, context_id)
);

-- Variables every run and command of the sandbox sees (E2B's `envVars` at creation); a run's
-- own win over them.
ALTER TABLE gateway_sandboxes ADD COLUMN env jsonb NOT NULL DEFAULT '{}'::jsonb;
