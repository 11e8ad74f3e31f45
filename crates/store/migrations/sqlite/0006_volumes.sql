-- Volumes: directories that outlive sandboxes and are mounted into them.
CREATE TABLE volumes (
    id TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL UNIQUE,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    last_used_at_ms BIGINT
);
-- What a sandbox mounts (JSON: [{volumeId, mountPath, subpath}]).
ALTER TABLE sandboxes ADD COLUMN volumes TEXT NOT NULL DEFAULT '[]';
