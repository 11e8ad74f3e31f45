//! Git configuration: get and set one key at a scope, the user identity, and
//! credentials persisted in git's credential store.

use std::path::PathBuf;

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use super::run::Git;
use super::{existing_dir, require_name};
use crate::error::{ApiError, Json, Query};
use crate::AppState;

/// Where a key is read or written; `local` needs the repository.
enum Scope {
    Global,
    System,
    Local(PathBuf),
}

impl Scope {
    async fn parse(
        state: &AppState,
        scope: Option<&str>,
        path: Option<&str>,
    ) -> Result<Self, ApiError> {
        match scope.filter(|s| !s.is_empty()).unwrap_or("global") {
            "global" => Ok(Self::Global),
            "system" => Ok(Self::System),
            "local" => match path.filter(|p| !p.is_empty()) {
                Some(path) => Ok(Self::Local(existing_dir(state, path).await?)),
                None => Err(ApiError::BadRequest(
                    "path is required when scope is local".into(),
                )),
            },
            other => Err(ApiError::BadRequest(format!(
                "invalid scope {other:?}: expected global, local or system"
            ))),
        }
    }

    /// `git config --<scope>`.
    fn command(&self) -> Git {
        match self {
            Self::Global => Git::new("config", "git config --global".into()).arg("--global"),
            Self::System => Git::new("config", "git config --system".into()).arg("--system"),
            Self::Local(repo) => Git::in_repo(repo, "config").arg("--local"),
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct GetQuery {
    key: String,
    #[serde(default)]
    scope: Option<String>,
    #[serde(default)]
    path: Option<String>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ConfigValue {
    /// `null` when the key is not set.
    value: Option<String>,
}

pub(crate) async fn get(
    State(state): State<AppState>,
    Query(query): Query<GetQuery>,
) -> Result<Json<ConfigValue>, ApiError> {
    require_name("key", &query.key)?;
    let scope = Scope::parse(&state, query.scope.as_deref(), query.path.as_deref()).await?;
    let output = scope
        .command()
        .arg("--get")
        .arg(&query.key)
        .output()
        .await?;
    // Exit 1 without a message is git's "not set"; anything else is an error.
    let unset = output.status.code() == Some(1) && output.stderr.is_empty();
    if unset {
        return Ok(Json(ConfigValue { value: None }));
    }
    if !output.status.success() {
        let command = format!("git config --get {}", query.key);
        return Err(super::run::failure(&output, command, None).into());
    }
    let value = String::from_utf8_lossy(&output.stdout);
    Ok(Json(ConfigValue {
        value: Some(value.strip_suffix('\n').unwrap_or(&value).to_string()),
    }))
}

#[derive(Debug, Deserialize)]
pub struct SetRequest {
    key: String,
    value: String,
    #[serde(default)]
    scope: Option<String>,
    #[serde(default)]
    path: Option<String>,
}

pub(crate) async fn set(
    State(state): State<AppState>,
    Json(request): Json<SetRequest>,
) -> Result<StatusCode, ApiError> {
    require_name("key", &request.key)?;
    let scope = Scope::parse(&state, request.scope.as_deref(), request.path.as_deref()).await?;
    scope
        .command()
        .arg("--")
        .arg(&request.key)
        .arg(&request.value)
        .run()
        .await?;
    Ok(StatusCode::OK)
}

#[derive(Debug, Deserialize)]
pub struct UserRequest {
    name: String,
    email: String,
    #[serde(default)]
    scope: Option<String>,
    #[serde(default)]
    path: Option<String>,
}

pub(crate) async fn configure_user(
    State(state): State<AppState>,
    Json(request): Json<UserRequest>,
) -> Result<StatusCode, ApiError> {
    let scope = Scope::parse(&state, request.scope.as_deref(), request.path.as_deref()).await?;
    for (key, value) in [("user.name", &request.name), ("user.email", &request.email)] {
        scope.command().arg("--").arg(key).arg(value).run().await?;
    }
    Ok(StatusCode::OK)
}

#[derive(Debug, Deserialize)]
pub struct AuthenticateRequest {
    username: String,
    password: String,
    #[serde(default)]
    host: Option<String>,
    #[serde(default)]
    protocol: Option<String>,
}

/// Stores the credentials with git's `store` helper (plain text in
/// `~/.git-credentials`, as the SDK warns) and makes sure that helper is
/// configured globally. The password travels on git's stdin only.
pub(crate) async fn authenticate(
    Json(request): Json<AuthenticateRequest>,
) -> Result<StatusCode, ApiError> {
    let host = request
        .host
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "github.com".into());
    let protocol = request
        .protocol
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "https".into());
    let fields = [
        ("protocol", &protocol),
        ("host", &host),
        ("username", &request.username),
        ("password", &request.password),
    ];
    let mut input = String::new();
    for (key, value) in fields {
        if value.is_empty() || value.contains(['\n', '\0']) {
            return Err(ApiError::BadRequest(format!(
                "{key} must be non-empty and on one line"
            )));
        }
        input.push_str(&format!("{key}={value}\n"));
    }
    input.push('\n');
    Git::new(
        "credential",
        format!("git credential approve for {protocol}://{host}"),
    )
    // Only the store helper receives these, not whatever else is configured.
    .config("credential.helper", "")
    .config("credential.helper", "store")
    .arg("approve")
    .stdin(input.into_bytes())
    .run()
    .await?;

    let helpers = Git::new("config", "git config --global".into())
        .args(["--global", "--get-all", "credential.helper"])
        .output()
        .await?;
    let configured = String::from_utf8_lossy(&helpers.stdout)
        .lines()
        .any(|helper| helper.split_whitespace().next() == Some("store"));
    if !configured {
        Git::new("config", "git config --global".into())
            .args(["--global", "--add", "credential.helper", "store"])
            .run()
            .await?;
    }
    Ok(StatusCode::OK)
}
