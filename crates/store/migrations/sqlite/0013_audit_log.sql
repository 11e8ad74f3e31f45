-- Who did what to which resource, when, with what outcome: one row per
-- change asked of the control API. `seq` orders rows as they were written.
CREATE TABLE audit_log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    created_at_ms BIGINT NOT NULL,
    key_name TEXT NOT NULL,
    key_masked TEXT NOT NULL,
    action TEXT NOT NULL,
    target_type TEXT NOT NULL,
    target_id TEXT,
    status_code INTEGER NOT NULL,
    error_message TEXT,
    user_agent TEXT
);
CREATE INDEX audit_log_by_time ON audit_log (created_at_ms);
