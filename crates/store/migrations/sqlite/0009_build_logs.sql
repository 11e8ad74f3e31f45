-- The build log of a snapshot built from a Dockerfile or pulled from a
-- registry, kept when the build ends so it outlives the server that ran it:
-- its lines as a JSON array.
CREATE TABLE build_logs (
    snapshot_id TEXT PRIMARY KEY,
    lines TEXT NOT NULL
);
