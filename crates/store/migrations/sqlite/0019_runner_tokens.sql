-- Runners on other machines: the operator registers one (POST /api/runners)
-- and is answered its token once; only the token's hash is kept. The runner
-- reports with it, giving the URLs it serves on. The server's own runner has
-- no token: it is this process.
ALTER TABLE runners ADD COLUMN token_hash TEXT;
ALTER TABLE runners ADD COLUMN tags TEXT NOT NULL DEFAULT '[]';
ALTER TABLE runners ADD COLUMN api_url TEXT;
ALTER TABLE runners ADD COLUMN proxy_url TEXT;
CREATE UNIQUE INDEX runners_by_token ON runners (token_hash);
