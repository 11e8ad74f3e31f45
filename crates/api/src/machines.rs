//! Handlers that keep a machine's memory: pause, resume and fork under
//! `/api/sandbox/{id}/...` (Daytona's routes), the fork tree, seed 001's
//! `/api/vms/{id}/...` surface, archive, and the spot reclaim (a cove extension).

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::Json;
use serde::{Deserialize, Serialize};

use crate::dto::{NetworkSettingsRequest, Sandbox};
use crate::sandbox::{dto, to_dto, Reply};
use crate::{ApiError, AppState};

/// `POST /sandbox/{id}/pause` and `POST /vms/{id}/pause`.
pub(crate) async fn pause(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Reply {
    let record = tenant.sandboxes().pause(&id).await?;
    Ok(dto(&state, &headers, record))
}

/// `POST /vms/{id}/resume`: continue from memory.
pub(crate) async fn resume(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Reply {
    let record = tenant.sandboxes().resume(&id).await?;
    Ok(dto(&state, &headers, record))
}

/// `POST /vms/{id}/start`: seed 001's escape hatch, a paused sandbox boots from
/// its disk and its memory is discarded.
pub(crate) async fn cold_start(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Reply {
    let record = tenant.sandboxes().cold_start(&id).await?;
    Ok(dto(&state, &headers, record))
}

/// `POST /sandbox/{id}/archive`: a stopped sandbox's filesystem goes to the
/// archive; `start` brings it back.
pub(crate) async fn archive(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Reply {
    let record = tenant.sandboxes().archive(&id).await?;
    Ok(dto(&state, &headers, record))
}

/// `POST /sandbox/{id}/network-settings`: applies to a running sandbox at once.
pub(crate) async fn network_settings(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Result<Json<NetworkSettingsRequest>, axum::extract::rejection::JsonRejection>,
) -> Reply {
    let Json(change) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let record = tenant
        .sandboxes()
        .set_network_settings(&id, |current| change.apply(current))
        .await?;
    Ok(dto(&state, &headers, record))
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct ForkRequest {
    pub name: Option<String>,
}

/// `POST /sandbox/{id}/fork` `{"name": ...}`: answers with the new sandbox.
pub(crate) async fn fork(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Option<Json<ForkRequest>>,
) -> Reply {
    let request = body.map(|Json(b)| b).unwrap_or_default();
    let child = tenant
        .sandboxes()
        .fork(&id, request.name.as_deref())
        .await?;
    Ok(dto(&state, &headers, child))
}

/// The body of `POST /sandbox/{id}/forks`: `count` children, or one per
/// entry of `names`; with both, they must agree.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ForkManyRequest {
    pub count: Option<usize>,
    pub names: Option<Vec<String>>,
}

impl ForkManyRequest {
    /// One entry per child: its name, or `None` for its id.
    fn children(self) -> Result<Vec<Option<String>>, ApiError> {
        let max = cove_engine::MAX_FORK_CHILDREN;
        let names = match (self.count, self.names) {
            (None, None) => {
                return Err(ApiError::bad_request(
                    "say how many children to fork: {\"count\": N} or {\"names\": [...]}",
                ))
            }
            (Some(count), None) => vec![None; count],
            (count, Some(names)) => {
                if let Some(count) = count.filter(|count| *count != names.len()) {
                    return Err(ApiError::bad_request(format!(
                        "count {count} differs from the {} names given; give one or make them agree",
                        names.len()
                    )));
                }
                names.into_iter().map(Some).collect()
            }
        };
        if names.is_empty() || names.len() > max {
            return Err(ApiError::bad_request(format!(
                "count must be 1 to {max}, not {}",
                names.len()
            )));
        }
        Ok(names)
    }
}

/// `POST /sandbox/{id}/forks` `{"count": N}` or `{"names": [...]}` (a cove
/// extension beside Daytona's one-child `fork`): N children from one
/// instant of the parent, answered as a list in the order asked. Each
/// child counts as a create against the rate limit and the quota; all are
/// made or none is.
pub(crate) async fn fork_many(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    axum::Extension(caller): axum::Extension<cove_engine::Caller>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Result<Json<ForkManyRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Vec<Sandbox>>, axum::response::Response> {
    use axum::response::IntoResponse;
    // Another organization's sandbox is a 404 whatever the body says.
    tenant
        .sandboxes()
        .get(&id)
        .await
        .map_err(|error| ApiError::from(error).into_response())?;
    let Json(request) = body.map_err(|e| ApiError::bad_request(e.body_text()).into_response())?;
    let names = request.children().map_err(IntoResponse::into_response)?;
    crate::rate_limit::take_creates(&state, &caller, names.len() as u64).await?;
    let children = tenant
        .sandboxes()
        .fork_many(&id, &names)
        .await
        .map_err(|error| ApiError::from(error).into_response())?;
    Ok(Json(
        children
            .into_iter()
            .map(|r| to_dto(&state, &headers, r))
            .collect(),
    ))
}

/// `GET /sandbox/{id}/parent`.
pub(crate) async fn parent(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Reply {
    let record = tenant.sandboxes().fork_parent(&id).await?;
    Ok(dto(&state, &headers, record))
}

/// `GET /sandbox/{id}/forks`.
pub(crate) async fn forks(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Vec<Sandbox>>, ApiError> {
    let records = tenant.sandboxes().forks(&id).await?;
    Ok(Json(
        records
            .into_iter()
            .map(|r| to_dto(&state, &headers, r))
            .collect(),
    ))
}

/// `GET /sandbox/{id}/ancestors`: nearest first.
pub(crate) async fn ancestors(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Vec<Sandbox>>, ApiError> {
    let records = tenant.sandboxes().fork_ancestors(&id).await?;
    Ok(Json(
        records
            .into_iter()
            .map(|r| to_dto(&state, &headers, r))
            .collect(),
    ))
}

#[derive(Debug, Serialize)]
pub(crate) struct Reclaimed {
    pub id: String,
    pub action: &'static str,
}

/// `POST /admin/reclaim` (cove extension): reclaims every spot sandbox.
pub(crate) async fn reclaim(
    State(state): State<AppState>,
) -> Result<Json<Vec<Reclaimed>>, ApiError> {
    let done = state.engine.sandboxes().reclaim_spot().await?;
    Ok(Json(
        done.into_iter()
            .map(|(id, action)| Reclaimed { id, action })
            .collect(),
    ))
}
