-- Runners: the machines sandboxes run on. A one-machine server is a control
-- plane and one runner in one process; its runner has a row like any other.
-- What a runner reports of its host (load, memory and disk in use) is kept
-- as sent, in `usage`; what is allocated on it is counted from the
-- sandboxes' rows when asked.
CREATE TABLE runners (
    id TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL,
    region TEXT NOT NULL,
    classes TEXT NOT NULL,
    accelerator TEXT,
    cpu BIGINT NOT NULL,
    memory_gib BIGINT NOT NULL,
    disk_gib BIGINT NOT NULL,
    app_version TEXT NOT NULL,
    unschedulable BIGINT NOT NULL DEFAULT 0,
    draining BIGINT NOT NULL DEFAULT 0,
    usage TEXT NOT NULL DEFAULT '{}',
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    last_checked_ms BIGINT
);

-- The runner that holds each sandbox's storage. Rows from before runners
-- are claimed by the server's own runner when it registers.
ALTER TABLE sandboxes ADD COLUMN runner_id TEXT;
CREATE INDEX sandboxes_by_runner ON sandboxes (runner_id);
