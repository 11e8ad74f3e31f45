//! HTTP entry points of sessions: request/response shapes and status codes
//! only; the work happens in [`super::Registry`].

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::{Deserialize, Serialize};

use super::{CommandRecord, Session};
use crate::error::{ApiError, Json, Query};
use crate::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/process/session", get(list).post(create))
        .route("/process/session/{session_id}", get(show).delete(delete))
        .route("/process/session/{session_id}/exec", post(exec))
        .route(
            "/process/session/{session_id}/command/{command_id}",
            get(command),
        )
        .route(
            "/process/session/{session_id}/command/{command_id}/logs",
            get(logs),
        )
        .route(
            "/process/session/{session_id}/command/{command_id}/input",
            post(input),
        )
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateSessionRequest {
    session_id: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionExecuteRequest {
    command: String,
    #[serde(default)]
    run_async: bool,
    #[serde(default, rename = "async")]
    is_async: bool,
    /// Input sent to the command is not echoed into its log.
    #[serde(default)]
    suppress_input_echo: bool,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct SessionDto {
    session_id: String,
    commands: Vec<CommandDto>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct CommandDto {
    id: String,
    command: String,
    exit_code: Option<i32>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct SessionExecuteResponse {
    cmd_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    output: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stdout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stderr: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    exit_code: Option<i32>,
}

#[derive(Debug, Deserialize)]
pub struct LogsQuery {
    #[serde(default)]
    follow: bool,
}

#[derive(Debug, Deserialize)]
pub struct SendInputRequest {
    data: String,
}

impl From<&CommandRecord> for CommandDto {
    fn from(record: &CommandRecord) -> Self {
        Self {
            id: record.id.clone(),
            command: record.command.clone(),
            exit_code: record.exit_code(),
        }
    }
}

impl From<&Session> for SessionDto {
    fn from(session: &Session) -> Self {
        Self {
            session_id: session.id.clone(),
            commands: session
                .commands()
                .iter()
                .map(|c| CommandDto::from(&**c))
                .collect(),
        }
    }
}

async fn create(
    State(state): State<AppState>,
    Json(request): Json<CreateSessionRequest>,
) -> Result<StatusCode, ApiError> {
    state.sessions.create(request.session_id)?;
    Ok(StatusCode::CREATED)
}

async fn list(State(state): State<AppState>) -> Json<Vec<SessionDto>> {
    Json(
        state
            .sessions
            .list()
            .iter()
            .map(|s| SessionDto::from(&**s))
            .collect(),
    )
}

async fn show(
    State(state): State<AppState>,
    Path(session_id): Path<String>,
) -> Result<Json<SessionDto>, ApiError> {
    Ok(Json(SessionDto::from(&*state.sessions.get(&session_id)?)))
}

async fn delete(
    State(state): State<AppState>,
    Path(session_id): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.sessions.delete(&session_id)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn exec(
    State(state): State<AppState>,
    Path(session_id): Path<String>,
    Json(request): Json<SessionExecuteRequest>,
) -> Result<Response, ApiError> {
    let is_async = request.run_async || request.is_async;
    let record = state
        .sessions
        .exec(
            &session_id,
            request.command,
            is_async,
            !request.suppress_input_echo,
        )
        .await?;
    if is_async {
        // The SDK deserializes 200 and 202 only; 202 says "still running".
        let body = SessionExecuteResponse {
            cmd_id: record.id.clone(),
            output: None,
            stdout: None,
            stderr: None,
            exit_code: None,
        };
        return Ok((StatusCode::ACCEPTED, Json(body)).into_response());
    }
    let exit_code = record.wait().await;
    let logs = record.logs();
    let body = SessionExecuteResponse {
        cmd_id: record.id.clone(),
        output: Some(logs.output),
        stdout: Some(logs.stdout),
        stderr: Some(logs.stderr),
        exit_code: Some(exit_code),
    };
    Ok(Json(body).into_response())
}

async fn command(
    State(state): State<AppState>,
    Path((session_id, command_id)): Path<(String, String)>,
) -> Result<Json<CommandDto>, ApiError> {
    Ok(Json(CommandDto::from(
        &*state.sessions.command(&session_id, &command_id)?,
    )))
}

async fn logs(
    State(state): State<AppState>,
    Path((session_id, command_id)): Path<(String, String)>,
    Query(query): Query<LogsQuery>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let record = state.sessions.command(&session_id, &command_id)?;
    match upgrade {
        Ok(upgrade) if query.follow => {
            Ok(upgrade.on_upgrade(move |socket| super::follow::stream(record, socket)))
        }
        _ => Ok(Json(record.logs()).into_response()),
    }
}

async fn input(
    State(state): State<AppState>,
    Path((session_id, command_id)): Path<(String, String)>,
    Json(request): Json<SendInputRequest>,
) -> Result<StatusCode, ApiError> {
    state
        .sessions
        .send_input(&session_id, &command_id, request.data.as_bytes())
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
