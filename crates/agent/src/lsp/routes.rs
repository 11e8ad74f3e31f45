//! `/lsp/*`: the SDK's `LspServer` calls. Bodies and queries are the
//! toolbox client's models (`LspServerRequest`, `LspDocumentRequest`,
//! `LspCompletionParams`); answers are empty (200) or `CompletionList` and
//! `[LspSymbol]` (`shapes.rs`).

use std::path::PathBuf;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::json;

use super::shapes::{self, CompletionList, LspSymbol};
use super::{document, Language, LspError, Running};
use crate::error::{ApiError, Json, Query};
use crate::{AppState, Settings};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/lsp/start", post(start))
        .route("/lsp/stop", post(stop))
        .route("/lsp/did-open", post(did_open))
        .route("/lsp/did-close", post(did_close))
        .route("/lsp/completions", post(completions))
        .route("/lsp/document-symbols", get(document_symbols))
        .route("/lsp/workspacesymbols", get(workspace_symbols))
}

/// `LspServerRequest`: which server.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LspServerRequest {
    #[serde(default)]
    pub language_id: String,
    /// Relative paths are relative to the work dir, as the SDK documents.
    #[serde(default)]
    pub path_to_project: String,
}

/// `LspDocumentRequest` (did-open, did-close) and the document-symbols query.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LspDocumentRequest {
    #[serde(default)]
    pub language_id: String,
    #[serde(default)]
    pub path_to_project: String,
    /// `file://PATH`, PATH relative to the project unless absolute.
    pub uri: String,
}

/// `LspCompletionParams`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LspCompletionParams {
    #[serde(default)]
    pub language_id: String,
    #[serde(default)]
    pub path_to_project: String,
    pub uri: String,
    pub position: LspPosition,
    pub context: Option<CompletionContext>,
}

/// Zero-based line and UTF-16 character, as the protocol counts.
#[derive(Debug, Deserialize)]
pub struct LspPosition {
    pub line: u32,
    pub character: u32,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CompletionContext {
    pub trigger_kind: i64,
    pub trigger_character: Option<String>,
}

/// The workspace-symbols query.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceSymbolsQuery {
    #[serde(default)]
    pub query: String,
    #[serde(default)]
    pub language_id: String,
    #[serde(default)]
    pub path_to_project: String,
}

/// The language and the project's absolute, clean path.
fn server_key(
    settings: &Settings,
    language_id: &str,
    path_to_project: &str,
) -> Result<(Language, PathBuf), LspError> {
    let language = Language::parse(language_id)?;
    if path_to_project.is_empty() {
        return Err(LspError::NoProject);
    }
    Ok((language, settings.resolve(path_to_project)))
}

/// The running server and the file `uri` names.
fn server_and_file(
    state: &AppState,
    language_id: &str,
    path_to_project: &str,
    uri: &str,
) -> Result<(std::sync::Arc<Running>, PathBuf), LspError> {
    let (language, project) = server_key(&state.settings, language_id, path_to_project)?;
    let path = document::path_of(uri, &project)?;
    Ok((state.lsp.get(language, &project)?, path))
}

async fn start(
    State(state): State<AppState>,
    Json(request): Json<LspServerRequest>,
) -> Result<StatusCode, ApiError> {
    let (language, project) = server_key(
        &state.settings,
        &request.language_id,
        &request.path_to_project,
    )?;
    state.lsp.start(language, &project).await?;
    Ok(StatusCode::OK)
}

async fn stop(
    State(state): State<AppState>,
    Json(request): Json<LspServerRequest>,
) -> Result<StatusCode, ApiError> {
    let (language, project) = server_key(
        &state.settings,
        &request.language_id,
        &request.path_to_project,
    )?;
    state.lsp.stop(language, &project).await?;
    Ok(StatusCode::OK)
}

async fn did_open(
    State(state): State<AppState>,
    Json(request): Json<LspDocumentRequest>,
) -> Result<StatusCode, ApiError> {
    let (running, path) = server_and_file(
        &state,
        &request.language_id,
        &request.path_to_project,
        &request.uri,
    )?;
    running.sync(&path).await?;
    Ok(StatusCode::OK)
}

async fn did_close(
    State(state): State<AppState>,
    Json(request): Json<LspDocumentRequest>,
) -> Result<StatusCode, ApiError> {
    let (running, path) = server_and_file(
        &state,
        &request.language_id,
        &request.path_to_project,
        &request.uri,
    )?;
    running.close(&path).await?;
    Ok(StatusCode::OK)
}

async fn completions(
    State(state): State<AppState>,
    Json(request): Json<LspCompletionParams>,
) -> Result<Json<CompletionList>, ApiError> {
    let (running, path) = server_and_file(
        &state,
        &request.language_id,
        &request.path_to_project,
        &request.uri,
    )?;
    let uri = running.sync(&path).await?;
    let context = match &request.context {
        Some(context) => json!({
            "triggerKind": context.trigger_kind,
            "triggerCharacter": context.trigger_character,
        }),
        // Invoked: what an editor sends for an explicit completion.
        None => json!({"triggerKind": 1}),
    };
    let result = running
        .request(
            "textDocument/completion",
            json!({
                "textDocument": {"uri": uri},
                "position": {"line": request.position.line, "character": request.position.character},
                "context": context,
            }),
        )
        .await?;
    Ok(Json(shapes::completion_list(&result)))
}

async fn document_symbols(
    State(state): State<AppState>,
    Query(query): Query<LspDocumentRequest>,
) -> Result<Json<Vec<LspSymbol>>, ApiError> {
    let (running, path) = server_and_file(
        &state,
        &query.language_id,
        &query.path_to_project,
        &query.uri,
    )?;
    let uri = running.sync(&path).await?;
    let result = running
        .request(
            "textDocument/documentSymbol",
            json!({"textDocument": {"uri": uri}}),
        )
        .await?;
    Ok(Json(shapes::document_symbols(&result, &uri)))
}

async fn workspace_symbols(
    State(state): State<AppState>,
    Query(query): Query<WorkspaceSymbolsQuery>,
) -> Result<Json<Vec<LspSymbol>>, ApiError> {
    let (language, project) =
        server_key(&state.settings, &query.language_id, &query.path_to_project)?;
    let running = state.lsp.get(language, &project)?;
    // pylsp, for one, has no workspace symbols: none is the honest answer.
    if !running.server.has_capability("workspaceSymbolProvider") {
        return Ok(Json(Vec::new()));
    }
    let result = running
        .request("workspace/symbol", json!({"query": query.query}))
        .await?;
    Ok(Json(shapes::workspace_symbols(&result)))
}
