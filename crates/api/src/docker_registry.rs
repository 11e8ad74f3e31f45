//! Handlers of `/api/docker-registry`: credentials for image registries. The
//! password is write-only: no answer carries it, as in Daytona.

use axum::extract::Path;
use axum::http::StatusCode;
use axum::Json;
use cove_engine::{DockerRegistryRecord, RegistryRequest};
use serde::{Deserialize, Serialize};

use crate::dto::rfc3339;
use crate::ApiError;

/// A registry as the SDK's `DockerRegistry` reads it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct DockerRegistry {
    id: String,
    name: String,
    url: String,
    username: String,
    project: String,
    registry_type: String,
    created_at: String,
    updated_at: String,
}

impl From<DockerRegistryRecord> for DockerRegistry {
    fn from(r: DockerRegistryRecord) -> DockerRegistry {
        DockerRegistry {
            id: r.id,
            name: r.name,
            url: r.url,
            username: r.username,
            project: r.project,
            registry_type: r.registry_type,
            created_at: rfc3339(r.created_at_ms),
            updated_at: rfc3339(r.updated_at_ms),
        }
    }
}

/// `CreateDockerRegistry` and `UpdateDockerRegistry` (whose password is optional).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RegistryBody {
    name: String,
    url: String,
    username: String,
    password: Option<String>,
    project: Option<String>,
}

impl From<RegistryBody> for RegistryRequest {
    fn from(b: RegistryBody) -> RegistryRequest {
        RegistryRequest {
            name: b.name,
            url: b.url,
            username: b.username,
            password: b.password,
            project: b.project,
        }
    }
}

type Body = Result<Json<RegistryBody>, axum::extract::rejection::JsonRejection>;

pub(crate) async fn list(
    tenant: crate::auth::Tenant,
) -> Result<Json<Vec<DockerRegistry>>, ApiError> {
    let all = tenant.snapshots().registries().await?;
    Ok(Json(all.into_iter().map(Into::into).collect()))
}

/// `POST /docker-registry`: 201 with the registry.
pub(crate) async fn create(
    tenant: crate::auth::Tenant,
    body: Body,
) -> Result<(StatusCode, Json<DockerRegistry>), ApiError> {
    let Json(body) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let record = tenant.snapshots().create_registry(body.into()).await?;
    Ok((StatusCode::CREATED, Json(record.into())))
}

pub(crate) async fn get(
    tenant: crate::auth::Tenant,
    Path(id): Path<String>,
) -> Result<Json<DockerRegistry>, ApiError> {
    Ok(Json(tenant.snapshots().get_registry(&id).await?.into()))
}

pub(crate) async fn update(
    tenant: crate::auth::Tenant,
    Path(id): Path<String>,
    body: Body,
) -> Result<Json<DockerRegistry>, ApiError> {
    let Json(body) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    Ok(Json(
        tenant
            .snapshots()
            .update_registry(&id, body.into())
            .await?
            .into(),
    ))
}

/// `DELETE /docker-registry/{id}`: 204.
pub(crate) async fn delete(
    tenant: crate::auth::Tenant,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    tenant.snapshots().delete_registry(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}
