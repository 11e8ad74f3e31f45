-- Organizations: every sandbox, snapshot, volume, registry, API key, audit
-- row and meter interval belongs to one. Rows from before belong to the
-- default organization `cove` (made by the engine at start, with its time).
CREATE TABLE organizations (
    id TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL UNIQUE,
    default_region_id TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);

-- Names are unique per organization, not per server: the tables whose name
-- was UNIQUE on its own are rebuilt with the pair as the key instead.
CREATE TABLE sandboxes_by_organization (
    id TEXT PRIMARY KEY,
    organization_id TEXT NOT NULL,
    name TEXT NOT NULL,
    snapshot TEXT NOT NULL,
    class TEXT NOT NULL,
    state TEXT NOT NULL,
    desired_state TEXT NOT NULL,
    error_reason TEXT,
    os_user TEXT NOT NULL,
    cpu BIGINT NOT NULL,
    gpu BIGINT NOT NULL,
    memory_mib BIGINT NOT NULL,
    disk_gib BIGINT NOT NULL,
    env TEXT NOT NULL,
    labels TEXT NOT NULL,
    public BIGINT NOT NULL,
    auto_stop BIGINT NOT NULL,
    auto_pause BIGINT NOT NULL,
    auto_archive BIGINT NOT NULL,
    auto_delete BIGINT NOT NULL,
    ttl_minutes BIGINT NOT NULL,
    ttl_deadline_ms BIGINT,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    state_since_ms BIGINT NOT NULL,
    last_activity_ms BIGINT NOT NULL,
    persistent BIGINT NOT NULL DEFAULT 1,
    spot BIGINT NOT NULL DEFAULT 0,
    parent_id TEXT,
    network TEXT NOT NULL DEFAULT '{}',
    volumes TEXT NOT NULL DEFAULT '[]',
    linked_sandbox_id TEXT,
    UNIQUE (organization_id, name)
);
INSERT INTO sandboxes_by_organization (id, organization_id, name, snapshot, class, state,
    desired_state, error_reason, os_user, cpu, gpu, memory_mib, disk_gib, env, labels, public,
    auto_stop, auto_pause, auto_archive, auto_delete, ttl_minutes, ttl_deadline_ms,
    created_at_ms, updated_at_ms, state_since_ms, last_activity_ms, persistent, spot,
    parent_id, network, volumes, linked_sandbox_id)
SELECT id, 'cove', name, snapshot, class, state, desired_state, error_reason, os_user, cpu,
    gpu, memory_mib, disk_gib, env, labels, public, auto_stop, auto_pause, auto_archive,
    auto_delete, ttl_minutes, ttl_deadline_ms, created_at_ms, updated_at_ms, state_since_ms,
    last_activity_ms, persistent, spot, parent_id, network, volumes, linked_sandbox_id
FROM sandboxes ORDER BY rowid;
DROP TABLE sandboxes;
ALTER TABLE sandboxes_by_organization RENAME TO sandboxes;
CREATE INDEX sandboxes_by_linked ON sandboxes (linked_sandbox_id);

-- A general snapshot (the server's own images) is seen by every
-- organization; its row names the default organization.
CREATE TABLE snapshots_by_organization (
    id TEXT PRIMARY KEY,
    organization_id TEXT NOT NULL,
    name TEXT NOT NULL,
    class TEXT NOT NULL,
    state TEXT NOT NULL,
    error_reason TEXT,
    rootfs TEXT NOT NULL,
    cpu BIGINT NOT NULL,
    gpu BIGINT NOT NULL,
    memory_mib BIGINT NOT NULL,
    disk_gib BIGINT NOT NULL,
    size_bytes BIGINT,
    general BIGINT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    layers TEXT NOT NULL DEFAULT '[]',
    capture_id TEXT,
    source_sandbox TEXT,
    has_memory BIGINT NOT NULL DEFAULT 0,
    env TEXT NOT NULL DEFAULT '{}',
    workdir TEXT,
    image_user TEXT,
    entrypoint TEXT NOT NULL DEFAULT '[]',
    cmd TEXT NOT NULL DEFAULT '[]',
    UNIQUE (organization_id, name)
);
INSERT INTO snapshots_by_organization (id, organization_id, name, class, state, error_reason,
    rootfs, cpu, gpu, memory_mib, disk_gib, size_bytes, general, created_at_ms, updated_at_ms,
    layers, capture_id, source_sandbox, has_memory, env, workdir, image_user, entrypoint, cmd)
SELECT id, 'cove', name, class, state, error_reason, rootfs, cpu, gpu, memory_mib, disk_gib,
    size_bytes, general, created_at_ms, updated_at_ms, layers, capture_id, source_sandbox,
    has_memory, env, workdir, image_user, entrypoint, cmd
FROM snapshots ORDER BY rowid;
DROP TABLE snapshots;
ALTER TABLE snapshots_by_organization RENAME TO snapshots;

CREATE TABLE volumes_by_organization (
    id TEXT PRIMARY KEY NOT NULL,
    organization_id TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    last_used_at_ms BIGINT,
    UNIQUE (organization_id, name)
);
INSERT INTO volumes_by_organization (id, organization_id, name, created_at_ms, updated_at_ms,
    last_used_at_ms)
SELECT id, 'cove', name, created_at_ms, updated_at_ms, last_used_at_ms
FROM volumes ORDER BY rowid;
DROP TABLE volumes;
ALTER TABLE volumes_by_organization RENAME TO volumes;

ALTER TABLE docker_registries ADD COLUMN organization_id TEXT NOT NULL DEFAULT 'cove';

-- A key acts in its organization; its name is unique there.
ALTER TABLE api_keys ADD COLUMN organization_id TEXT NOT NULL DEFAULT 'cove';
DROP INDEX api_keys_by_name;
CREATE UNIQUE INDEX api_keys_by_name ON api_keys (organization_id, name);

ALTER TABLE audit_log ADD COLUMN organization_id TEXT NOT NULL DEFAULT 'cove';
CREATE INDEX audit_log_by_organization ON audit_log (organization_id, created_at_ms);

ALTER TABLE meter ADD COLUMN organization_id TEXT NOT NULL DEFAULT 'cove';

-- The server's one region is `us` from here (it was `local`), as Daytona's
-- default target is named: quotas set before follow it.
UPDATE region_quotas SET region_id = 'us' WHERE region_id = 'local';
