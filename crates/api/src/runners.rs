//! `/api/runners`: the machines sandboxes run on, in Daytona's `Runner`
//! shape, and the operator's switches that keep new sandboxes off one
//! (`PATCH .../scheduling`, `PATCH .../draining`). Runners are the server's,
//! not an organization's: every route here is the operator's
//! (`permissions.rs`).

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::Json;
use cove_engine::{RunnerSwitches, RunnerView};
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
            tags: Vec::new(),
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
