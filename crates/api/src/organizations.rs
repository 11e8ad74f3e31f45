//! `/api/organizations`: the tenants of a server, as Daytona's
//! `Organization`, with the limits in force (the quota's per-sandbox
//! ceilings where set, else the server's; the rate limits the operator
//! set). The operator makes and deletes them and sees every one; any other
//! key sees its own only (another is a 404, as if it did not exist).

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use cove_engine::{Caller, EngineError, OrganizationRecord};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::api_keys::USER_ID;
use crate::billing::check_organization;
use crate::dto::rfc3339;
use crate::{ApiError, AppState};

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Organization {
    id: String,
    name: String,
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
    default_region_id: String,
    authenticated_rate_limit: Option<u64>,
    authenticated_rate_limit_ttl_seconds: Option<u64>,
    sandbox_create_rate_limit: Option<u64>,
    sandbox_create_rate_limit_ttl_seconds: Option<u64>,
    sandbox_lifecycle_rate_limit: Option<u64>,
    sandbox_lifecycle_rate_limit_ttl_seconds: Option<u64>,
    experimental_config: Value,
    otel_config: Option<Value>,
}

async fn organization(
    state: &AppState,
    record: OrganizationRecord,
) -> Result<Organization, ApiError> {
    let billing = state.engine.billing();
    let region = billing.region_quota(&record.id).await?;
    let limits = billing.organization_quota(&record.id).await?;
    let server = &state.engine.config().ceilings;
    let at = rfc3339(record.created_at_ms);
    let updated = rfc3339(region.updated_at_ms.max(record.updated_at_ms));
    Ok(Organization {
        id: record.id,
        name: record.name,
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
        default_region_id: record.default_region_id,
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

/// `GET /api/organizations`: every organization for the operator, the
/// key's own for any other key.
pub(crate) async fn list(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Vec<Organization>>, ApiError> {
    let mut listed = Vec::new();
    for record in state.engine.organizations().list().await? {
        if caller.operator || record.id == caller.organization_id {
            listed.push(organization(&state, record).await?);
        }
    }
    Ok(Json(listed))
}

/// `GET /api/organizations/{organizationId}`.
pub(crate) async fn get(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<Organization>, ApiError> {
    check_organization(&state, &caller, &id).await?;
    let record = state.engine.organizations().get(&id).await?;
    Ok(Json(organization(&state, record).await?))
}

/// `CreateOrganization`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct CreateOrganization {
    name: String,
    default_region_id: Option<String>,
}

/// `POST /api/organizations` (the operator's): 201 with the new
/// organization. Its keys are made with `X-Daytona-Organization-ID` naming it.
pub(crate) async fn create(
    State(state): State<AppState>,
    body: Result<Json<CreateOrganization>, JsonRejection>,
) -> Result<(StatusCode, Json<Organization>), ApiError> {
    let Json(request) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let record = state
        .engine
        .organizations()
        .create(&request.name, request.default_region_id.as_deref())
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(organization(&state, record).await?),
    ))
}

/// `DELETE /api/organizations/{organizationId}` (the operator's): 204, with
/// its keys, registries and quotas; 409 while it owns sandboxes, snapshots
/// or volumes, and for the default organization.
pub(crate) async fn delete(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if !caller.operator {
        // The permission table lets only the operator here; a key of the
        // organization itself is told no more than that.
        return Err(EngineError::OrganizationNotFound { id }.into());
    }
    state.engine.organizations().delete(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}
