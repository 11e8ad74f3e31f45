-- An organization's quota in one region: totals over its running sandboxes
-- (CPU, memory) and all its unarchived ones (disk), how many may run at
-- once, and per-sandbox ceilings. NULL is no limit.
CREATE TABLE region_quotas (
    organization_id TEXT NOT NULL,
    region_id TEXT NOT NULL,
    total_cpu BIGINT,
    total_memory_gib BIGINT,
    total_disk_gib BIGINT,
    max_running_sandboxes BIGINT,
    max_cpu_per_sandbox BIGINT,
    max_memory_per_sandbox BIGINT,
    max_disk_per_sandbox BIGINT,
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (organization_id, region_id)
);
