-- An organization's rate limits and counts (`UpdateOrganizationQuota`), as
-- one JSON object of the fields set; an organization without a row has none.
CREATE TABLE organization_quotas (
    organization_id TEXT PRIMARY KEY NOT NULL,
    settings TEXT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);
