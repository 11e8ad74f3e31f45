-- Images built from Dockerfiles: what a snapshot's image asks of its
-- sandboxes besides the environment (WORKDIR, USER, ENTRYPOINT and CMD as
-- JSON arrays), and the build cache: one read-only layer per built step, keyed
-- by a hash of the Dockerfile up to and including that step and its base, so a
-- Dockerfile that shares a prefix with an earlier one reuses its layers.
ALTER TABLE snapshots ADD COLUMN workdir TEXT;
ALTER TABLE snapshots ADD COLUMN image_user TEXT;
ALTER TABLE snapshots ADD COLUMN entrypoint TEXT NOT NULL DEFAULT '[]';
ALTER TABLE snapshots ADD COLUMN cmd TEXT NOT NULL DEFAULT '[]';
CREATE TABLE build_steps (
    cache_key TEXT PRIMARY KEY,
    capture_id TEXT NOT NULL,
    layer TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL
);
