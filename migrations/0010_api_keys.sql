-- API keys (the E2B-compatible gateway's credentials) and the gateway's sandboxes.
--
-- A key belongs to one tenant; `sandcell-admin key create` makes it and prints it once. Only
-- its SHA-256 is stored, so a leaked table does not hand out keys; a revoked key stays (its id
-- names it in logs) but is refused. Tenant roles are granted nothing here.
CREATE TABLE api_keys (
    key_id      text        PRIMARY KEY,
    tenant      text        NOT NULL REFERENCES tenants (tenant),
    key_sha256  text        NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
CREATE INDEX api_keys_tenant ON api_keys (tenant);

-- A sandbox the gateway opened: a sandcell session, with what E2B's API reports about it
-- that a session does not hold (its template, the caller's metadata, its container's shape).
-- The session's own state stays in `sessions`: this row never says whether it is running.
CREATE TABLE gateway_sandboxes (
    session_id  text        PRIMARY KEY,
    tenant      text        NOT NULL REFERENCES tenants (tenant),
    template_id text        NOT NULL,
    metadata    jsonb       NOT NULL DEFAULT '{}'::jsonb,
    cpu_count   integer     NOT NULL,
    memory_mb   integer     NOT NULL,
    disk_mb     integer     NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX gateway_sandboxes_tenant ON gateway_sandboxes (tenant, created_at);
