-- Portable SQL (SQLite today, PostgreSQL later): TEXT, BIGINT, no SQLite-only types.
-- Times are milliseconds since the Unix epoch.
CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    snapshot TEXT NOT NULL,
    class TEXT NOT NULL,
    state TEXT NOT NULL,
    desired_state TEXT NOT NULL,
    error_reason TEXT,
    os_user TEXT NOT NULL,
    cpu BIGINT NOT NULL,
    gpu BIGINT NOT NULL,
    memory_gib BIGINT NOT NULL,
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
    last_activity_ms BIGINT NOT NULL
);

CREATE TABLE snapshots (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    class TEXT NOT NULL,
    state TEXT NOT NULL,
    error_reason TEXT,
    rootfs TEXT NOT NULL,
    cpu BIGINT NOT NULL,
    gpu BIGINT NOT NULL,
    memory_gib BIGINT NOT NULL,
    disk_gib BIGINT NOT NULL,
    size_bytes BIGINT,
    general BIGINT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);

CREATE TABLE api_keys (
    hash TEXT PRIMARY KEY,
    created_at_ms BIGINT NOT NULL
);
