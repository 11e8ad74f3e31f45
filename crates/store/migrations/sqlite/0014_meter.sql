-- The meter: what a sandbox or a snapshot was from when until when. Every
-- change of a metered column closes the resource's open interval and opens
-- the next, in the transaction that writes the change; rows outlive the
-- resource, so a deleted sandbox is still billed for its time.
CREATE TABLE meter (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    resource_id TEXT NOT NULL,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    cpu BIGINT NOT NULL,
    memory_mib BIGINT NOT NULL,
    disk_gib BIGINT NOT NULL,
    size_bytes BIGINT NOT NULL,
    started_ms BIGINT NOT NULL,
    ended_ms BIGINT
);
-- At most one open interval per resource: time is never counted twice.
CREATE UNIQUE INDEX meter_open ON meter (kind, resource_id) WHERE ended_ms IS NULL;
CREATE INDEX meter_by_time ON meter (started_ms);
-- Sandboxes and snapshots that exist when the meter is added start now.
INSERT INTO meter (kind, resource_id, name, state, cpu, memory_mib, disk_gib, size_bytes, started_ms)
    SELECT 'sandbox', id, name, state, cpu, memory_mib, disk_gib, 0, updated_at_ms FROM sandboxes;
INSERT INTO meter (kind, resource_id, name, state, cpu, memory_mib, disk_gib, size_bytes, started_ms)
    SELECT 'snapshot', id, name, state, 0, 0, 0, COALESCE(size_bytes, 0), updated_at_ms
    FROM snapshots WHERE general = 0 AND state = 'active';
