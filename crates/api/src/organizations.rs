//! `GET /api/organizations` and `GET /api/organizations/{id}`: the one
//! organization of a server, as Daytona's `Organization`, with the limits in
//! force (the quota's per-sandbox ceilings where set, else the server's;
//! the rate limits the operator set). Making and deleting organizations is
//! not served: those routes answer 501 by name.

use axum::extract::{Path, State};
use axum::Json;
use serde::Serialize;
use serde_json::Value;

use crate::api_keys::USER_ID;
use crate::billing::check_organization;
use crate::dto::{rfc3339, ORGANIZATION_ID, TARGET};
use crate::{ApiError, AppState};

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Organization {
    id: &'static str,
    name: &'static str,
    created_by: &'static str,
    personal: bool,
    created_at: String,
    updated_at: String,
    suspended: bool,
    suspended_at: Option<String>,
    suspension_reason: Option<String>,
    suspended_until: Option<String>,
    suspension_cleanup_grace_period_hours: i64,
    max_cpu_per_sandbox: i64,
    max_memory_per_sandbox: i64,
    max_disk_per_sandbox: i64,
    secret_quota: i64,
    max_secrets_per_sandbox: i64,
    snapshot_deactivation_timeout_minutes: i64,
    sandbox_limited_network_egress: bool,
    preview_warning_enabled: bool,
    sso_enabled: bool,
    default_region_id: &'static str,
    authenticated_rate_limit: Option<u64>,
    authenticated_rate_limit_ttl_seconds: Option<u64>,
    sandbox_create_rate_limit: Option<u64>,
    sandbox_create_rate_limit_ttl_seconds: Option<u64>,
    sandbox_lifecycle_rate_limit: Option<u64>,
    sandbox_lifecycle_rate_limit_ttl_seconds: Option<u64>,
    experimental_config: Value,
    otel_config: Option<Value>,
}

async fn organization(state: &AppState) -> Result<Organization, ApiError> {
    let billing = state.engine.billing();
    let region = billing.region_quota().await?;
    let limits = billing.organization_quota().await?;
    let server = &state.engine.config().ceilings;
    let at = rfc3339(state.started_at_ms);
    let updated = rfc3339(region.updated_at_ms.max(state.started_at_ms));
    Ok(Organization {
        id: ORGANIZATION_ID,
        name: ORGANIZATION_ID,
        created_by: USER_ID,
        personal: false,
        created_at: at,
        updated_at: updated,
        suspended: false,
        suspended_at: None,
        suspension_reason: None,
        suspended_until: None,
        suspension_cleanup_grace_period_hours: 0,
        max_cpu_per_sandbox: region
            .max_cpu_per_sandbox
            .unwrap_or(server.cpu)
            .min(server.cpu),
        max_memory_per_sandbox: region
            .max_memory_per_sandbox
            .unwrap_or(server.memory_gib)
            .min(server.memory_gib),
        max_disk_per_sandbox: region
            .max_disk_per_sandbox
            .unwrap_or(server.disk_gib)
            .min(server.disk_gib),
        secret_quota: 0,
        max_secrets_per_sandbox: 0,
        snapshot_deactivation_timeout_minutes: 0,
        sandbox_limited_network_egress: false,
        preview_warning_enabled: false,
        sso_enabled: false,
        default_region_id: TARGET,
        authenticated_rate_limit: limits.authenticated.map(|l| l.requests),
        authenticated_rate_limit_ttl_seconds: limits.authenticated.map(|l| l.window_seconds),
        sandbox_create_rate_limit: limits.sandbox_create.map(|l| l.requests),
        sandbox_create_rate_limit_ttl_seconds: limits.sandbox_create.map(|l| l.window_seconds),
        sandbox_lifecycle_rate_limit: limits.sandbox_lifecycle.map(|l| l.requests),
        sandbox_lifecycle_rate_limit_ttl_seconds: limits
            .sandbox_lifecycle
            .map(|l| l.window_seconds),
        experimental_config: Value::Object(Default::default()),
        otel_config: None,
    })
}

/// `GET /api/organizations`: the server's one organization.
pub(crate) async fn list(
    State(state): State<AppState>,
) -> Result<Json<Vec<Organization>>, ApiError> {
    Ok(Json(vec![organization(&state).await?]))
}

/// `GET /api/organizations/{organizationId}`.
pub(crate) async fn get(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Organization>, ApiError> {
    check_organization(&id)?;
    Ok(Json(organization(&state).await?))
}
