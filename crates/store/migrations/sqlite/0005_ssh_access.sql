-- SSH access tokens (`POST /api/sandbox/{id}/ssh-access`). Only a SHA-256 of
-- each token is kept, as for API keys: the token is shown once, when issued.
-- A token goes when revoked and with its sandbox (`delete_sandbox`; not a
-- foreign key: saving a sandbox is `INSERT OR REPLACE`, whose delete would
-- cascade).
CREATE TABLE ssh_access (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    token_hash TEXT NOT NULL UNIQUE,
    expires_at_ms BIGINT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);
CREATE INDEX ssh_access_sandbox ON ssh_access (sandbox_id);
