//! Handlers of `/api/volumes`: volumes that outlive sandboxes.

use axum::extract::Path;
use axum::http::StatusCode;
use axum::Json;
use cove_engine::VolumeRecord;
use serde::{Deserialize, Serialize};

use crate::dto::rfc3339;
use crate::ApiError;

/// A volume as the SDK's `VolumeDto` reads it. A cove volume is a directory
/// made at once, so it is `ready` from its creation.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Volume {
    id: String,
    name: String,
    organization_id: String,
    state: &'static str,
    created_at: String,
    updated_at: String,
    last_used_at: Option<String>,
    error_reason: Option<String>,
}

impl From<VolumeRecord> for Volume {
    fn from(v: VolumeRecord) -> Volume {
        Volume {
            id: v.id,
            name: v.name,
            organization_id: v.organization_id,
            state: "ready",
            created_at: rfc3339(v.created_at_ms),
            updated_at: rfc3339(v.updated_at_ms),
            last_used_at: v.last_used_at_ms.map(rfc3339),
            error_reason: None,
        }
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct CreateVolume {
    name: String,
}

pub(crate) async fn create(
    tenant: crate::auth::Tenant,
    Json(request): Json<CreateVolume>,
) -> Result<Json<Volume>, ApiError> {
    Ok(Json(tenant.volumes().create(&request.name).await?.into()))
}

pub(crate) async fn list(tenant: crate::auth::Tenant) -> Result<Json<Vec<Volume>>, ApiError> {
    let volumes = tenant.volumes().list().await?;
    Ok(Json(volumes.into_iter().map(Volume::from).collect()))
}

/// By id (or, as cove allows everywhere, by name).
pub(crate) async fn get(
    tenant: crate::auth::Tenant,
    Path(id): Path<String>,
) -> Result<Json<Volume>, ApiError> {
    Ok(Json(tenant.volumes().get(&id).await?.into()))
}

pub(crate) async fn get_by_name(
    tenant: crate::auth::Tenant,
    Path(name): Path<String>,
) -> Result<Json<Volume>, ApiError> {
    Ok(Json(tenant.volumes().get(&name).await?.into()))
}

pub(crate) async fn delete(
    tenant: crate::auth::Tenant,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    tenant.volumes().delete(&id).await?;
    Ok(StatusCode::OK)
}
