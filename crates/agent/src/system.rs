//! Facts about the sandbox the SDK asks for (agent version, work dir, home dir)
//! and `POST /env`, which changes the agent's own environment so that every
//! process it starts afterwards (execute, sessions, PTYs) inherits the change;
//! processes already running keep theirs.

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{ApiError, Json};
use crate::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/version", get(version))
        .route("/work-dir", get(work_dir))
        .route("/user-home-dir", get(user_home_dir))
        .route("/env", post(update_env))
}

async fn version() -> Json<Value> {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") }))
}

async fn work_dir(State(state): State<AppState>) -> Json<Value> {
    Json(json!({ "dir": state.settings.work_dir }))
}

async fn user_home_dir(State(state): State<AppState>) -> Json<Value> {
    Json(json!({ "dir": state.settings.home_dir }))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UpdateEnvRequest {
    #[serde(default)]
    set: HashMap<String, String>,
    #[serde(default)]
    unset: Vec<String>,
    unset_value_prefix: Option<String>,
}

/// Applies `unset`, then `unsetValuePrefix` (every variable whose value starts
/// with it and whose name is not in `set`), then `set`; answers the names set
/// and removed. The whole request is checked before anything changes.
///
/// The SDK sends this body without a `Content-Type` (toolbox.json declares no
/// `consumes` for it), so the body is read as JSON whatever its header says.
async fn update_env(body: Bytes) -> Result<Json<Value>, ApiError> {
    let request: UpdateEnvRequest =
        serde_json::from_slice(&body).map_err(|e| ApiError::InvalidBody(e.to_string()))?;
    for name in request.set.keys().chain(&request.unset) {
        if name.is_empty() || name.contains(['=', '\0']) {
            return Err(ApiError::BadRequest(format!(
                "invalid environment variable name: {name:?}"
            )));
        }
    }
    if let Some((name, _)) = request.set.iter().find(|(_, value)| value.contains('\0')) {
        return Err(ApiError::BadRequest(format!(
            "value of {name} contains a NUL byte"
        )));
    }
    let mut removed: Vec<String> = request.unset.clone();
    if let Some(prefix) = request
        .unset_value_prefix
        .as_deref()
        .filter(|p| !p.is_empty())
    {
        removed.extend(std::env::vars_os().filter_map(|(name, value)| {
            let name = name.into_string().ok()?;
            let starts = value.as_encoded_bytes().starts_with(prefix.as_bytes());
            (starts && !request.set.contains_key(&name)).then_some(name)
        }));
    }
    // std serialises its own environment reads and writes (spawning included)
    // behind one lock, and nothing in the agent reads the environment through
    // libc, so changing it while other threads run is sound here.
    for name in &removed {
        std::env::remove_var(name);
    }
    for (name, value) in &request.set {
        std::env::set_var(name, value);
    }
    let mut set: Vec<&String> = request.set.keys().collect();
    set.sort();
    removed.sort();
    removed.dedup();
    Ok(Json(json!({
        "set": set.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(","),
        "unset": removed.join(","),
    })))
}
