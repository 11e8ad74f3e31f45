//! HTTP entry points of the code interpreter: context CRUD and the run
//! WebSocket; request/response shapes and status codes only.

use std::sync::Arc;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{Path, State};
use axum::response::Response;
use axum::routing::{delete, get};
use axum::{Extension, Router};
use serde::{Deserialize, Serialize};

use super::{ContextInfo, Registry, PYTHON};
use crate::error::{ApiError, Json};
use crate::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/process/interpreter/context",
            get(list_contexts).post(create_context),
        )
        .route("/process/interpreter/context/{id}", delete(delete_context))
        .route("/process/interpreter/execute", get(execute))
        .layer(Extension(Arc::new(Registry::default())))
}

#[derive(Debug, Deserialize)]
pub struct CreateContextRequest {
    cwd: Option<String>,
    language: Option<String>,
}

#[derive(Debug, Serialize)]
struct ListContextsResponse {
    contexts: Vec<ContextInfo>,
}

#[derive(Debug, Serialize)]
struct Message {
    message: &'static str,
}

async fn create_context(
    State(state): State<AppState>,
    Extension(registry): Extension<Arc<Registry>>,
    Json(request): Json<CreateContextRequest>,
) -> Result<Json<ContextInfo>, ApiError> {
    if let Some(language) = request.language.as_deref() {
        if !language.eq_ignore_ascii_case(PYTHON) {
            return Err(ApiError::BadRequest(format!(
                "unsupported language: {language} (only {PYTHON} is supported)"
            )));
        }
    }
    let settings = &state.settings;
    let cwd = match request.cwd.as_deref() {
        Some(cwd) if !cwd.is_empty() => settings.resolve(cwd),
        _ => settings.work_dir.clone(),
    };
    let context = registry
        .create(settings, cwd, settings.max_sessions)
        .await?;
    Ok(Json(context.info()))
}

async fn list_contexts(
    Extension(registry): Extension<Arc<Registry>>,
) -> Json<ListContextsResponse> {
    Json(ListContextsResponse {
        contexts: registry.list(),
    })
}

async fn delete_context(
    Extension(registry): Extension<Arc<Registry>>,
    Path(id): Path<String>,
) -> Result<Json<Message>, ApiError> {
    registry.delete(&id)?;
    Ok(Json(Message {
        message: "Context deleted successfully",
    }))
}

async fn execute(
    State(state): State<AppState>,
    Extension(registry): Extension<Arc<Registry>>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let upgrade = upgrade.map_err(|rejection| {
        ApiError::BadRequest(format!(
            "this endpoint expects a WebSocket upgrade: {}",
            rejection.body_text()
        ))
    })?;
    let settings = state.settings.clone();
    Ok(upgrade.on_upgrade(move |socket| super::execute::serve(socket, registry, settings)))
}
