//! HTTP entry points of PTY sessions: request/response shapes, defaults and
//! status codes only; the terminal work is in [`super::session`].

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use base64::Engine as _;
use serde::{Deserialize, Serialize};

use super::connect::{self, EXIT_CONTROL_SUBPROTOCOL};
use super::{PtySessionInfo, PtySpec, Registry};
use crate::error::{ApiError, Json, Query};
use crate::AppState;

/// Subprotocol prefix under which the SDK sends the session's environment as
/// base64url (unpadded) JSON, keeping values out of URLs and logs.
const ENVS_SUBPROTOCOL_PREFIX: &str = "X-Daytona-Pty-Envs~";

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/process/pty", get(list).post(create))
        .route("/process/pty/create-connect", get(create_connect))
        .route("/process/pty/{session_id}", get(show).delete(kill))
        .route("/process/pty/{session_id}/connect", get(connect))
        .route("/process/pty/{session_id}/resize", post(resize))
        .layer(Extension(Arc::new(Registry::default())))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PtyCreateRequest {
    id: Option<String>,
    cwd: Option<String>,
    envs: Option<BTreeMap<String, String>>,
    cols: Option<u16>,
    rows: Option<u16>,
    #[serde(default)]
    lazy_start: bool,
}

/// Query of `create-connect`, the SDK's create-and-attach in one round trip.
#[derive(Debug, Deserialize)]
pub struct CreateConnectQuery {
    id: Option<String>,
    cwd: Option<String>,
    cols: Option<u16>,
    rows: Option<u16>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct PtyCreateResponse {
    session_id: String,
}

#[derive(Debug, Serialize)]
struct PtyListResponse {
    sessions: Vec<PtySessionInfo>,
}

#[derive(Debug, Deserialize)]
pub struct PtyResizeRequest {
    cols: u16,
    rows: u16,
}

#[derive(Debug, Serialize)]
struct Message {
    message: &'static str,
}

fn spec(state: &AppState, request: PtyCreateRequest) -> Result<PtySpec, ApiError> {
    let settings = &state.settings;
    let cwd = match request.cwd.as_deref() {
        Some(cwd) if !cwd.is_empty() => settings.resolve(cwd),
        _ => settings.work_dir.clone(),
    };
    if !cwd.is_dir() {
        return Err(ApiError::BadRequest(format!(
            "cwd is not a directory: {}",
            cwd.display()
        )));
    }
    Ok(PtySpec {
        id: request.id.unwrap_or_default(),
        shell: settings.session_shell.clone(),
        cwd,
        envs: request.envs.unwrap_or_default(),
        cols: request.cols.unwrap_or(80),
        rows: request.rows.unwrap_or(24),
        lazy_start: request.lazy_start,
    })
}

async fn create(
    State(state): State<AppState>,
    Extension(registry): Extension<Arc<Registry>>,
    Json(request): Json<PtyCreateRequest>,
) -> Result<Response, ApiError> {
    let spec = spec(&state, request)?;
    let lazy = spec.lazy_start;
    let session = registry.add(spec, state.settings.max_sessions)?;
    if !lazy {
        if let Err(e) = session.start(Arc::downgrade(&registry)) {
            let _ = registry.kill(session.id());
            return Err(e);
        }
    }
    let body = PtyCreateResponse {
        session_id: session.id().to_string(),
    };
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

async fn list(Extension(registry): Extension<Arc<Registry>>) -> Json<PtyListResponse> {
    Json(PtyListResponse {
        sessions: registry.list(),
    })
}

async fn show(
    Extension(registry): Extension<Arc<Registry>>,
    Path(session_id): Path<String>,
) -> Result<Json<PtySessionInfo>, ApiError> {
    Ok(Json(registry.get(&session_id)?.info()))
}

async fn kill(
    Extension(registry): Extension<Arc<Registry>>,
    Path(session_id): Path<String>,
) -> Result<Json<Message>, ApiError> {
    registry.kill(&session_id)?;
    Ok(Json(Message {
        message: "PTY session deleted",
    }))
}

async fn resize(
    Extension(registry): Extension<Arc<Registry>>,
    Path(session_id): Path<String>,
    Json(request): Json<PtyResizeRequest>,
) -> Result<Json<PtySessionInfo>, ApiError> {
    for (name, side) in [("cols", request.cols), ("rows", request.rows)] {
        if side == 0 || side > super::MAX_TERMINAL_SIDE {
            return Err(ApiError::BadRequest(format!(
                "{name} must be between 1 and {}, got {side}",
                super::MAX_TERMINAL_SIDE
            )));
        }
    }
    let session = registry.get(&session_id)?;
    session.resize(request.cols, request.rows)?;
    Ok(Json(session.info()))
}

async fn connect(
    Extension(registry): Extension<Arc<Registry>>,
    Path(session_id): Path<String>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let upgrade = upgrade.map_err(not_a_websocket)?;
    let session = registry.get(&session_id)?;
    Ok(attach(upgrade, session, registry))
}

async fn create_connect(
    State(state): State<AppState>,
    Extension(registry): Extension<Arc<Registry>>,
    Query(query): Query<CreateConnectQuery>,
    headers: HeaderMap,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let upgrade = upgrade.map_err(not_a_websocket)?;
    let request = PtyCreateRequest {
        id: query.id,
        cwd: query.cwd,
        envs: Some(envs_from_subprotocols(&headers)?),
        cols: query.cols,
        rows: query.rows,
        // Started by the attach below, after the client is subscribed, so it
        // sees the very first prompt.
        lazy_start: true,
    };
    let session = registry.add(spec(&state, request)?, state.settings.max_sessions)?;
    Ok(attach(upgrade, session, registry))
}

fn attach(
    upgrade: WebSocketUpgrade,
    session: Arc<super::PtySession>,
    registry: Arc<Registry>,
) -> Response {
    let upgrade = upgrade.protocols([EXIT_CONTROL_SUBPROTOCOL]);
    let exit_control = upgrade.selected_protocol().is_some();
    upgrade.on_upgrade(move |socket| {
        connect::serve(session, Arc::downgrade(&registry), socket, exit_control)
    })
}

fn not_a_websocket(rejection: WebSocketUpgradeRejection) -> ApiError {
    ApiError::BadRequest(format!(
        "this endpoint expects a WebSocket upgrade: {}",
        rejection.body_text()
    ))
}

/// The session environment from the `X-Daytona-Pty-Envs~<base64url JSON>`
/// subprotocol token, empty when absent.
fn envs_from_subprotocols(headers: &HeaderMap) -> Result<BTreeMap<String, String>, ApiError> {
    let tokens = headers
        .get_all(axum::http::header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim);
    for token in tokens {
        let Some(encoded) = token.strip_prefix(ENVS_SUBPROTOCOL_PREFIX) else {
            continue;
        };
        let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(encoded.trim_end_matches('='))
            .map_err(|e| ApiError::BadRequest(format!("pty envs subprotocol: {e}")))?;
        return serde_json::from_slice(&json)
            .map_err(|e| ApiError::BadRequest(format!("pty envs subprotocol: {e}")));
    }
    Ok(BTreeMap::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envs_come_from_the_subprotocol_token() {
        let encoded = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(r#"{"A":"1 2"}"#);
        let mut headers = HeaderMap::new();
        headers.insert(
            axum::http::header::SEC_WEBSOCKET_PROTOCOL,
            format!("{EXIT_CONTROL_SUBPROTOCOL}, {ENVS_SUBPROTOCOL_PREFIX}{encoded}")
                .parse()
                .unwrap(),
        );
        let envs = envs_from_subprotocols(&headers).unwrap();
        assert_eq!(envs.get("A").map(String::as_str), Some("1 2"));
        assert!(envs_from_subprotocols(&HeaderMap::new())
            .unwrap()
            .is_empty());
        headers.insert(
            axum::http::header::SEC_WEBSOCKET_PROTOCOL,
            format!("{ENVS_SUBPROTOCOL_PREFIX}!!").parse().unwrap(),
        );
        assert!(envs_from_subprotocols(&headers).is_err());
    }
}
