-- Preview URLs: each sandbox's own preview token (made on first request, then
-- stable), and signed preview URLs, each a token that opens one port of one
-- sandbox until it expires (expiring one early moves its deadline to now).
CREATE TABLE preview_tokens (
    sandbox_id TEXT PRIMARY KEY,
    token TEXT NOT NULL
);

CREATE TABLE signed_previews (
    token TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    port BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL
);
