//! `/api/runners`: the machines sandboxes run on, in Daytona's `Runner`
//! shape, and the operator's switches that keep new sandboxes off one
//! (`PATCH .../scheduling`, `PATCH .../draining`). Runners are the server's,
//! not an organization's: these routes are the operator's
//! (`permissions.rs`), but for those a runner on another machine calls
//! with its own token (`GET /runners/me`, `POST /runners/healthcheck`,
//! `GET /runners/me/images[/{*image}]`, `GET /runners/me/layers[/{capture}]`),
//! which sit outside the API key layer and take nothing else.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequestParts, Path, Query, RawQuery, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::Json;
use cove_engine::{
    NewRunner, RunnerRecord, RunnerReport, RunnerSwitches, RunnerUsage, RunnerView, ServiceReport,
};
use serde::{Deserialize, Serialize};

use crate::dto::rfc3339;
use crate::{ApiError, AppState};

/// A runner as Daytona's `Runner` reads, with cove's fields after.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Runner {
    id: String,
    name: String,
    region: String,
    /// vCPUs, GiB of memory and GiB of disk its host has.
    cpu: i64,
    memory: i64,
    disk: i64,
    gpu: i64,
    gpu_type: &'static str,
    /// Daytona gives a runner one class; cove's run several (all in
    /// `sandboxClasses`): this is the first, containers before VMs.
    sandbox_class: String,
    current_cpu_usage_percentage: f64,
    current_memory_usage_percentage: f64,
    current_disk_usage_percentage: f64,
    current_allocated_cpu: i64,
    #[serde(rename = "currentAllocatedMemoryGiB")]
    current_allocated_memory_gib: i64,
    #[serde(rename = "currentAllocatedDiskGiB")]
    current_allocated_disk_gib: i64,
    current_snapshot_count: i64,
    current_started_sandboxes: i64,
    availability_score: f64,
    state: &'static str,
    last_checked: Option<String>,
    unschedulable: bool,
    tags: Vec<String>,
    created_at: String,
    updated_at: String,
    version: &'static str,
    api_version: &'static str,
    /// Deprecated in Daytona's API, always `container` there.
    runner_class: &'static str,
    app_version: String,
    class: &'static str,
    // cove's own:
    /// No new sandbox goes to it; those it holds stay.
    draining: bool,
    sandbox_classes: Vec<String>,
    /// How its VMs execute (`kvm`, `tcg`).
    accelerator: Option<String>,
    /// Sandboxes whose storage it holds, in any state.
    sandboxes: i64,
}

impl From<RunnerView> for Runner {
    fn from(view: RunnerView) -> Runner {
        let availability_score = (view.availability() * 100.0).round() / 100.0;
        let RunnerView {
            record,
            state,
            allocated,
            sandboxes,
            snapshots,
        } = view;
        Runner {
            sandbox_class: record
                .classes
                .iter()
                .find(|class| *class == "container")
                .or(record.classes.first())
                .cloned()
                .unwrap_or_default(),
            id: record.id,
            name: record.name,
            region: record.region,
            cpu: record.cpu,
            memory: record.memory_gib,
            disk: record.disk_gib,
            gpu: 0,
            gpu_type: "",
            current_cpu_usage_percentage: record.usage.cpu,
            current_memory_usage_percentage: record.usage.memory,
            current_disk_usage_percentage: record.usage.disk,
            current_allocated_cpu: allocated.cpu,
            current_allocated_memory_gib: allocated.memory_gib,
            current_allocated_disk_gib: allocated.disk_gib,
            current_snapshot_count: snapshots,
            current_started_sandboxes: allocated.running,
            availability_score,
            state: state.as_str(),
            last_checked: record.last_checked_ms.map(rfc3339),
            unschedulable: record.unschedulable,
            tags: record.tags,
            created_at: rfc3339(record.created_at_ms),
            updated_at: rfc3339(record.updated_at_ms),
            version: "0",
            api_version: "0",
            runner_class: "container",
            app_version: record.app_version,
            class: "small",
            draining: record.draining,
            sandbox_classes: record.classes,
            accelerator: record.accelerator,
            sandboxes,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ListQuery {
    /// The spec's name for the filter; Daytona's server reads `region`.
    region_id: Option<String>,
    region: Option<String>,
}

/// `GET /runners`: every runner, oldest first, of one region if asked.
pub(crate) async fn list(
    State(state): State<AppState>,
    Query(query): Query<ListQuery>,
) -> Result<Json<Vec<Runner>>, ApiError> {
    let region = query.region_id.or(query.region).filter(|r| !r.is_empty());
    let views = state.engine.runners().list(region.as_deref()).await?;
    Ok(Json(views.into_iter().map(Runner::from).collect()))
}

/// `GET /runners/{id}`.
pub(crate) async fn get(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Runner>, ApiError> {
    Ok(Json(state.engine.runners().get(&id).await?.into()))
}

/// `GET /runners/by-sandbox/{sandboxId}`: the runner holding a sandbox (by
/// id or name, of any organization).
pub(crate) async fn by_sandbox(
    State(state): State<AppState>,
    Path(sandbox): Path<String>,
) -> Result<Json<Runner>, ApiError> {
    Ok(Json(
        state.engine.runners().of_sandbox(&sandbox).await?.into(),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Scheduling {
    unschedulable: bool,
}

/// `PATCH /runners/{id}/scheduling` with `{"unschedulable": bool}`.
pub(crate) async fn scheduling(
    State(state): State<AppState>,
    Path(id): Path<String>,
    body: Result<Json<Scheduling>, JsonRejection>,
) -> Result<Json<Runner>, ApiError> {
    switch(&state, &id, body, |body| RunnerSwitches {
        unschedulable: Some(body.unschedulable),
        ..RunnerSwitches::default()
    })
    .await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Draining {
    draining: bool,
}

/// `PATCH /runners/{id}/draining` with `{"draining": bool}`.
pub(crate) async fn draining(
    State(state): State<AppState>,
    Path(id): Path<String>,
    body: Result<Json<Draining>, JsonRejection>,
) -> Result<Json<Runner>, ApiError> {
    switch(&state, &id, body, |body| RunnerSwitches {
        draining: Some(body.draining),
        ..RunnerSwitches::default()
    })
    .await
}

/// Sets the switch a body names (a body that does not parse is a 400) and
/// answers the runner as it is then.
async fn switch<T>(
    state: &AppState,
    id: &str,
    body: Result<Json<T>, JsonRejection>,
    switches: impl FnOnce(T) -> RunnerSwitches,
) -> Result<Json<Runner>, ApiError> {
    let Json(body) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let view = state.engine.runners().switch(id, switches(body)).await?;
    Ok(Json(view.into()))
}

/// Daytona's `CreateRunner`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct CreateRunner {
    name: String,
    /// The server's one region when left out.
    region_id: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
}

/// Daytona's `CreateRunnerResponse`: the token is shown here only.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct CreatedRunner {
    id: String,
    api_key: String,
}

/// `POST /runners`: registers a runner on another machine and answers the
/// token it reports with (`cove runner --token`), once.
pub(crate) async fn create(
    State(state): State<AppState>,
    body: Result<Json<CreateRunner>, JsonRejection>,
) -> Result<(StatusCode, Json<CreatedRunner>), ApiError> {
    let Json(body) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let new = NewRunner {
        name: body.name,
        region: body
            .region_id
            .unwrap_or_else(|| cove_engine::REGION_ID.to_owned()),
        tags: body.tags,
    };
    let (record, token) = state.engine.runners().create(new).await?;
    Ok((
        StatusCode::CREATED,
        Json(CreatedRunner {
            id: record.id,
            api_key: token,
        }),
    ))
}

/// `DELETE /runners/{id}`: a runner holding no sandbox, with its token.
/// `?lost=true` (cove's): one whose machine is gone for good, whatever it
/// held; its sandboxes show `error` saying their files went with it.
pub(crate) async fn delete(
    State(state): State<AppState>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<StatusCode, ApiError> {
    let mut lost = false;
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match key.as_ref() {
            "lost" => lost = crate::list_filter::boolean(&key, &value)?,
            other => {
                return Err(ApiError::bad_request(format!(
                    "unknown parameter {other:?}; a runner's delete takes only lost=true"
                )))
            }
        }
    }
    state.engine.runners().delete(&id, lost).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A runner on another machine, known by the token it sends. No API key
/// passes here, and its token passes nowhere else (the key layer does not
/// know it).
pub(crate) struct RunnerCaller {
    record: RunnerRecord,
    token: String,
}

impl FromRequestParts<AppState> for RunnerCaller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<RunnerCaller, ApiError> {
        let Some(token) = crate::auth::bearer(&parts.headers) else {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing runner token: send Authorization: Bearer <the token POST /api/runners answered>",
            ));
        };
        match state.engine.runners().authenticate(token).await? {
            Some(record) => Ok(RunnerCaller {
                record,
                token: token.to_owned(),
            }),
            None => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid runner token: this route takes the token POST /api/runners \
                 answered for a runner that still exists, not an API key",
            )),
        }
    }
}

/// `GET /runners/me/images/{*image}`: the root filesystem a sandbox placed
/// on the calling runner starts from, named by its path under the images
/// directory as the runner was given it, as a tar the runner unpacks into
/// its own (cove's; a runner on another machine holds no image until it
/// asks). Any other image is a 404, whether or not it exists.
pub(crate) async fn image(
    State(state): State<AppState>,
    caller: RunnerCaller,
    Path(image): Path<String>,
) -> Result<axum::response::Response, ApiError> {
    let tar = state
        .engine
        .runners()
        .image_tar(&caller.record.id, &image)
        .await?;
    Ok(streamed("application/x-tar", tar))
}

/// A transfer to a runner as an answer of `content_type`, its body sent as
/// it is made (cut off if its sender fails).
fn streamed(content_type: &'static str, body: cove_engine::ImageTar) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    (
        [(axum::http::header::CONTENT_TYPE, content_type)],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

/// `GET /runners/me/layers/{capture}`: a captured layer of the snapshot a
/// sandbox placed on the calling runner starts from, by its capture id, as
/// the `btrfs send` stream the runner receives onto its own storage
/// (cove's). Any other capture is a 404, whether or not it exists.
pub(crate) async fn layer(
    State(state): State<AppState>,
    caller: RunnerCaller,
    Path(capture): Path<String>,
) -> Result<axum::response::Response, ApiError> {
    let stream = state
        .engine
        .runners()
        .layer_send(&caller.record.id, &capture)
        .await?;
    Ok(streamed("application/octet-stream", stream))
}

/// `GET /runners/me/images`: the images (paths under the images
/// directory, as a spec names them) the sandboxes placed on the calling
/// runner use; a starting runner deletes the images it fetched that no
/// runner sharing its images directory uses any more.
pub(crate) async fn images(
    State(state): State<AppState>,
    caller: RunnerCaller,
) -> Result<Json<serde_json::Value>, ApiError> {
    let images = state.engine.runners().images_on(&caller.record.id).await?;
    Ok(Json(serde_json::json!({ "images": images })))
}

/// `GET /runners/me/layers`: the capture ids of the captured layers the
/// sandboxes placed on the calling runner start from; a starting runner
/// deletes its copies of any other (their snapshots were deleted while it
/// could not be told).
pub(crate) async fn layers(
    State(state): State<AppState>,
    caller: RunnerCaller,
) -> Result<Json<serde_json::Value>, ApiError> {
    let captures = state.engine.runners().layers_on(&caller.record.id).await?;
    Ok(Json(serde_json::json!({ "captures": captures })))
}

/// Daytona's `RunnerFull`: a runner as it sees itself, with its token.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RunnerFull {
    #[serde(flatten)]
    runner: Runner,
    api_key: String,
    api_url: Option<String>,
    proxy_url: Option<String>,
    domain: Option<String>,
    region_type: &'static str,
}

/// `GET /runners/me`: the calling runner.
pub(crate) async fn me(
    State(state): State<AppState>,
    caller: RunnerCaller,
) -> Result<Json<RunnerFull>, ApiError> {
    let view = state.engine.runners().get(&caller.record.id).await?;
    Ok(Json(RunnerFull {
        api_url: view.record.api_url.clone(),
        proxy_url: view.record.proxy_url.clone(),
        domain: None,
        region_type: "shared",
        api_key: caller.token,
        runner: view.into(),
    }))
}

/// Daytona's `RunnerHealthcheck`, with cove's `sandboxClasses` and
/// `accelerator` after. Left-out metrics keep what the runner last said.
// No Debug: `serviceKey` is a secret.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Healthcheck {
    app_version: String,
    metrics: Option<HealthMetrics>,
    api_url: Option<String>,
    proxy_url: Option<String>,
    sandbox_classes: Option<Vec<String>>,
    accelerator: Option<String>,
    /// cove's: the key the runner's service at `apiUrl` takes. With it the
    /// control plane places sandboxes on the runner and drives them there.
    service_key: Option<String>,
    /// cove's: whether the runner gives its sandboxes a network of its own.
    sandbox_network: Option<bool>,
    /// cove's: the archive the runner moves stopped sandboxes to and from
    /// (an S3 location the control plane names the same way, to move
    /// sandboxes between runners).
    archive: Option<String>,
}

/// Daytona's `RunnerHealthMetrics`, the fields cove keeps.
#[derive(Debug, Deserialize)]
pub(crate) struct HealthMetrics {
    cpu: f64,
    #[serde(rename = "memoryGiB")]
    memory_gib: f64,
    #[serde(rename = "diskGiB")]
    disk_gib: f64,
    #[serde(rename = "currentCpuUsagePercentage")]
    cpu_percent: f64,
    #[serde(rename = "currentMemoryUsagePercentage")]
    memory_percent: f64,
    #[serde(rename = "currentDiskUsagePercentage")]
    disk_percent: f64,
}

/// `POST /runners/healthcheck`: the calling runner reports itself.
pub(crate) async fn healthcheck(
    State(state): State<AppState>,
    caller: RunnerCaller,
    body: Result<Json<Healthcheck>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    let Json(body) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let known = caller.record;
    // Whole units: a fraction of a vCPU or GiB is not offered.
    let whole = |n: f64| if n.is_finite() { n.floor() as i64 } else { -1 };
    let report = RunnerReport {
        classes: body.sandbox_classes.unwrap_or(known.classes),
        accelerator: body.accelerator,
        cpu: body.metrics.as_ref().map_or(known.cpu, |m| whole(m.cpu)),
        memory_gib: body
            .metrics
            .as_ref()
            .map_or(known.memory_gib, |m| whole(m.memory_gib)),
        disk_gib: body
            .metrics
            .as_ref()
            .map_or(known.disk_gib, |m| whole(m.disk_gib)),
        app_version: body.app_version,
        usage: body.metrics.as_ref().map_or(known.usage, |m| RunnerUsage {
            cpu: m.cpu_percent,
            memory: m.memory_percent,
            disk: m.disk_percent,
        }),
        api_url: body.api_url,
        proxy_url: body.proxy_url,
    };
    state
        .engine
        .runners()
        .report(
            &known.id,
            report,
            ServiceReport {
                key: body.service_key.as_deref(),
                networked: body.sandbox_network.unwrap_or(false),
                archive: body.archive.as_deref(),
            },
        )
        .await?;
    Ok(StatusCode::OK)
}
