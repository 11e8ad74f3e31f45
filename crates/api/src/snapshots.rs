//! Handlers of `/api/snapshots` and of a sandbox's snapshot and revert.

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::Json;
use cove_engine::{ImageSnapshotRequest, SnapshotRecord};
use serde::{Deserialize, Serialize};

use crate::dto::rfc3339;
use crate::sandbox::{dto, Reply};
use crate::{ApiError, AppState};

/// A snapshot as the SDK's `SnapshotDto` reads it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Snapshot {
    id: String,
    organization_id: String,
    general: bool,
    name: String,
    state: &'static str,
    size: Option<f64>,
    cpu: i64,
    gpu: i64,
    /// GiB, fractional for a guest of less than one.
    mem: f64,
    disk: i64,
    error_reason: Option<String>,
    created_at: String,
    updated_at: String,
    source_sandbox_id: Option<String>,
    sandbox_class: &'static str,
    /// Whether the snapshot holds memory as well as the filesystem.
    includes_memory: bool,
    /// The image's ENTRYPOINT and CMD, as Daytona reports a snapshot's entrypoint.
    entrypoint: Option<Vec<String>>,
}

impl From<SnapshotRecord> for Snapshot {
    fn from(s: SnapshotRecord) -> Snapshot {
        let entrypoint: Vec<String> = s
            .image
            .entrypoint
            .iter()
            .chain(&s.image.cmd)
            .cloned()
            .collect();
        Snapshot {
            id: s.id,
            organization_id: s.organization_id,
            general: s.general,
            name: s.name,
            state: s.state.as_str(),
            size: s.size_bytes.map(|b| b as f64 / f64::from(1u32 << 30)),
            cpu: s.cpu,
            gpu: s.gpu,
            mem: s.memory_mib as f64 / 1024.0,
            disk: s.disk_gib,
            error_reason: s.error_reason,
            created_at: rfc3339(s.created_at_ms),
            updated_at: rfc3339(s.updated_at_ms),
            source_sandbox_id: s.source_sandbox,
            sandbox_class: s.class.as_str(),
            includes_memory: s.has_memory,
            entrypoint: (!entrypoint.is_empty()).then_some(entrypoint),
        }
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SnapshotPage {
    items: Vec<Snapshot>,
    total: usize,
    page: usize,
    total_pages: usize,
}

#[derive(Debug, Deserialize)]
pub(crate) struct PageQuery {
    page: Option<usize>,
    limit: Option<usize>,
    sort: Option<String>,
    order: Option<String>,
}

pub(crate) async fn list(
    tenant: crate::auth::Tenant,
    Query(query): Query<PageQuery>,
) -> Result<Json<SnapshotPage>, ApiError> {
    let page = query.page.unwrap_or(1);
    let limit = query.limit.unwrap_or(100);
    if page == 0 || limit == 0 {
        return Err(ApiError::bad_request("page and limit start at 1"));
    }
    let mut all = tenant.snapshots().list().await?;
    crate::sort::sort_snapshots(&mut all, query.sort.as_deref(), query.order.as_deref())?;
    let total = all.len();
    let items = all
        .into_iter()
        .skip((page - 1) * limit)
        .take(limit)
        .map(Snapshot::from)
        .collect();
    Ok(Json(SnapshotPage {
        items,
        total,
        page,
        total_pages: total.div_ceil(limit),
    }))
}

pub(crate) async fn get(
    tenant: crate::auth::Tenant,
    Path(id): Path<String>,
) -> Result<Json<Snapshot>, ApiError> {
    Ok(Json(tenant.snapshots().get(&id).await?.into()))
}

pub(crate) async fn delete(
    tenant: crate::auth::Tenant,
    Path(id): Path<String>,
) -> Result<Json<Snapshot>, ApiError> {
    Ok(Json(tenant.snapshots().delete(&id).await?.into()))
}

/// `GET /snapshots/{id}/build-logs-url`: where the SDK reads the build log.
pub(crate) async fn build_logs_url(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<crate::dto::Url>, ApiError> {
    let snapshot = tenant.snapshots().get(&id).await?;
    Ok(Json(crate::dto::Url {
        url: format!(
            "{}/api/snapshots/{}/build-logs",
            crate::sandbox::public_base(&state, &headers),
            snapshot.id
        ),
    }))
}

#[derive(Debug, Deserialize)]
pub(crate) struct FollowQuery {
    #[serde(default)]
    follow: bool,
}

/// `GET /snapshots/{id}/build-logs[?follow=true]`: the build log as text, one
/// line per line; with `follow` the answer streams until the build ends.
pub(crate) async fn build_logs(
    tenant: crate::auth::Tenant,
    Path(id): Path<String>,
    Query(query): Query<FollowQuery>,
) -> Result<axum::response::Response, ApiError> {
    let log = tenant.snapshots().build_log(&id).await?;
    let text_plain = [(
        axum::http::header::CONTENT_TYPE,
        "text/plain; charset=utf-8",
    )];
    if !query.follow {
        let (lines, _) = log.read_all();
        let body: String = lines.iter().map(|l| format!("{l}\n")).collect();
        return Ok(axum::response::IntoResponse::into_response((
            text_plain, body,
        )));
    }
    let stream =
        futures_util::stream::unfold((log, 0usize, false), |(log, seen, ended)| async move {
            if ended {
                return None;
            }
            loop {
                let (lines, next, done) = log.read(seen);
                if !lines.is_empty() || done {
                    let chunk: String = lines.iter().map(|l| format!("{l}\n")).collect();
                    return Some((Ok::<_, std::convert::Infallible>(chunk), (log, next, done)));
                }
                log.wait(seen).await;
            }
        });
    Ok(axum::response::IntoResponse::into_response((
        text_plain,
        axum::body::Body::from_stream(stream),
    )))
}

/// `POST /snapshots/{id}/activate`
pub(crate) async fn activate(
    tenant: crate::auth::Tenant,
    Path(id): Path<String>,
) -> Result<Json<Snapshot>, ApiError> {
    Ok(Json(tenant.snapshots().activate(&id).await?.into()))
}

/// `POST /snapshots/{id}/deactivate`: 204, as Daytona answers.
pub(crate) async fn deactivate(
    tenant: crate::auth::Tenant,
    Path(id): Path<String>,
) -> Result<axum::http::StatusCode, ApiError> {
    tenant.snapshots().deactivate(&id).await?;
    Ok(axum::http::StatusCode::NO_CONTENT)
}

/// `POST /snapshots` as the SDK's `snapshot.create` sends it.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct CreateSnapshotRequest {
    name: String,
    image_name: Option<String>,
    build_info: Option<serde_json::Value>,
    cpu: Option<i64>,
    memory: Option<i64>,
    disk: Option<i64>,
    sandbox_class: Option<String>,
    entrypoint: Option<Vec<String>>,
    /// The region the snapshot is for: this server's one, or none.
    region_id: Option<String>,
}

/// `POST /snapshots`: pulls (or builds) the image, then answers the snapshot,
/// `active`.
pub(crate) async fn create(
    tenant: crate::auth::Tenant,
    body: Result<Json<CreateSnapshotRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Snapshot>, ApiError> {
    let Json(request) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    crate::regions::check("regionId", request.region_id.as_deref())?;
    if request.entrypoint.as_ref().is_some_and(|e| !e.is_empty()) {
        return Err(ApiError::new(
            axum::http::StatusCode::NOT_IMPLEMENTED,
            "snapshot entrypoints are not implemented by cove yet",
        ));
    }
    let dockerfile = match &request.build_info {
        None => None,
        Some(info) => Some(
            info.get("dockerfileContent")
                .and_then(|d| d.as_str())
                .ok_or_else(|| ApiError::bad_request("buildInfo needs dockerfileContent"))?
                .to_owned(),
        ),
    };
    let class = match request.sandbox_class.as_deref() {
        None => None,
        Some(name) => Some(name.parse().map_err(|_| {
            ApiError::bad_request(format!(
                "sandboxClass {name:?} is not one of container, linux-vm"
            ))
        })?),
    };
    let snapshot = tenant
        .snapshots()
        .create_image_snapshot(ImageSnapshotRequest {
            name: request.name,
            image: request.image_name,
            dockerfile,
            build_contexts: request
                .build_info
                .as_ref()
                .map(crate::dto::context_hashes)
                .unwrap_or_default(),
            class,
            cpu: request.cpu,
            memory_gib: request.memory,
            disk_gib: request.disk,
        })
        .await?;
    Ok(Json(snapshot.into()))
}

#[derive(Debug, Deserialize)]
pub(crate) struct ImportRequest {
    name: String,
    path: String,
}

/// `POST /snapshots/import` (a cove extension, used by `cove image import`):
/// registers an OCI layout directory or `docker save` tarball as a
/// snapshot. `path` names it inside the server's import directory (`serve
/// --import-dir`; relative to it, or absolute under it); anything else,
/// and a symbolic link on the way, is refused with 400 naming that
/// directory.
pub(crate) async fn import(
    tenant: crate::auth::Tenant,
    body: Result<Json<ImportRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Snapshot>, ApiError> {
    let Json(request) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let snapshot = tenant
        .snapshots()
        .import_image_snapshot(&request.name, std::path::Path::new(&request.path))
        .await?;
    Ok(Json(snapshot.into()))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SnapshotRequest {
    name: String,
    #[serde(default)]
    include_memory: bool,
}

/// `POST /sandbox/{id}/snapshot`
pub(crate) async fn take(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Result<Json<SnapshotRequest>, axum::extract::rejection::JsonRejection>,
) -> Reply {
    let Json(request) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let record = tenant
        .sandboxes()
        .snapshot(&id, &request.name, request.include_memory)
        .await?;
    Ok(dto(&state, &headers, record))
}

#[derive(Debug, Deserialize)]
pub(crate) struct RevertRequest {
    snapshot: String,
}

/// `POST /sandbox/{id}/revert` (a cove extension): rewind to a snapshot taken from it.
pub(crate) async fn revert(
    State(state): State<AppState>,
    tenant: crate::auth::Tenant,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Result<Json<RevertRequest>, axum::extract::rejection::JsonRejection>,
) -> Reply {
    let Json(request) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let record = tenant.sandboxes().revert(&id, &request.snapshot).await?;
    Ok(dto(&state, &headers, record))
}
