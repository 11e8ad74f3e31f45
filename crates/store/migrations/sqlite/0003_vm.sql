-- VM sandboxes: whether a sandbox may pause (persistent), whether cove may
-- reclaim it (spot: paused, not deleted), the sandbox it was forked from, and
-- whether a snapshot holds memory as well as disk.
ALTER TABLE sandboxes ADD COLUMN persistent BIGINT NOT NULL DEFAULT 1;
ALTER TABLE sandboxes ADD COLUMN spot BIGINT NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD COLUMN parent_id TEXT;
ALTER TABLE snapshots ADD COLUMN has_memory BIGINT NOT NULL DEFAULT 0;
-- The environment a snapshot's image asks for (PATH and the like), as a JSON
-- object; sandboxes made from it get it under their own variables.
ALTER TABLE snapshots ADD COLUMN env TEXT NOT NULL DEFAULT '{}';
-- A sandbox's egress policy (JSON: blockAll, allowList, denyList, domains).
ALTER TABLE sandboxes ADD COLUMN network TEXT NOT NULL DEFAULT '{}';
