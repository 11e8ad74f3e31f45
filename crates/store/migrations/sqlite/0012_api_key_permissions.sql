-- API keys as Daytona has them: a name, permissions, an expiry and a last
-- use. `masked` is the key's first and last characters, for listings.
ALTER TABLE api_keys ADD COLUMN name TEXT;
ALTER TABLE api_keys ADD COLUMN permissions TEXT NOT NULL DEFAULT '';
ALTER TABLE api_keys ADD COLUMN masked TEXT NOT NULL DEFAULT '';
ALTER TABLE api_keys ADD COLUMN expires_at_ms BIGINT;
ALTER TABLE api_keys ADD COLUMN last_used_at_ms BIGINT;
ALTER TABLE api_keys ADD COLUMN operator INTEGER NOT NULL DEFAULT 0;
-- Keys from before were made at first start: the operator's, with every
-- permission. The first is named `operator`; any others get their row number.
UPDATE api_keys
SET operator = 1,
    masked = 'cove_****',
    name = CASE WHEN rowid = (SELECT MIN(rowid) FROM api_keys) THEN 'operator'
                ELSE 'operator-' || rowid END
WHERE name IS NULL;
CREATE UNIQUE INDEX api_keys_by_name ON api_keys (name);
