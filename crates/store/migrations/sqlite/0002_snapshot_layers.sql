-- Snapshots taken from sandboxes: the read-only layers over `rootfs` (a JSON
-- array, topmost first), the capture that holds the top one, and the sandbox it
-- came from (which may revert to it).
ALTER TABLE snapshots ADD COLUMN layers TEXT NOT NULL DEFAULT '[]';
ALTER TABLE snapshots ADD COLUMN capture_id TEXT;
ALTER TABLE snapshots ADD COLUMN source_sandbox TEXT;
