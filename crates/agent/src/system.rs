//! Facts about the sandbox the SDK asks for: agent version, work dir, home dir.

use axum::extract::State;
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

use crate::error::Json;
use crate::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/version", get(version))
        .route("/work-dir", get(work_dir))
        .route("/user-home-dir", get(user_home_dir))
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
