-- Credentials for image registries (`/api/docker-registry`). The password is
-- kept as given: cove must present it to the registry on every pull, so it
-- cannot be hashed; it is never answered back through the API.
CREATE TABLE docker_registries (
    id TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL,
    url TEXT NOT NULL,
    username TEXT NOT NULL,
    password TEXT NOT NULL,
    project TEXT NOT NULL,
    registry_type TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);
