//! Work inside one repository: `init`, `add`, `commit`, `history`, `reset`,
//! `restore`.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use super::run::Git;
use super::{existing_dir, require_files, require_name, PathQuery};
use crate::error::{ApiError, Json, Query};
use crate::AppState;

#[derive(Debug, Deserialize)]
pub struct InitRequest {
    path: String,
    #[serde(default)]
    bare: Option<bool>,
    #[serde(default)]
    initial_branch: Option<String>,
}

pub(crate) async fn init(
    State(state): State<AppState>,
    Json(request): Json<InitRequest>,
) -> Result<StatusCode, ApiError> {
    if request.path.is_empty() {
        return Err(ApiError::BadRequest("path is required".into()));
    }
    let path = state.settings.resolve(&request.path);
    let mut git = Git::new("init", format!("git init {}", path.display()))
        .arg("--quiet")
        .arg_if(request.bare.unwrap_or(false), "--bare");
    if let Some(branch) = request.initial_branch.filter(|b| !b.is_empty()) {
        require_name("initial branch", &branch)?;
        git = git.arg(format!("--initial-branch={branch}"));
    }
    git.arg("--").arg(&path).run().await?;
    Ok(StatusCode::CREATED)
}

#[derive(Debug, Deserialize)]
pub struct AddRequest {
    path: String,
    files: Vec<String>,
}

pub(crate) async fn add(
    State(state): State<AppState>,
    Json(request): Json<AddRequest>,
) -> Result<StatusCode, ApiError> {
    let repo = existing_dir(&state, &request.path).await?;
    require_files(&request.files)?;
    Git::in_repo(&repo, "add")
        .arg("--")
        .args(&request.files)
        .run()
        .await?;
    Ok(StatusCode::OK)
}

#[derive(Debug, Deserialize)]
pub struct CommitRequest {
    path: String,
    message: String,
    author: String,
    email: String,
    #[serde(default)]
    allow_empty: Option<bool>,
}

#[derive(Debug, Serialize)]
pub(crate) struct CommitResponse {
    hash: String,
}

pub(crate) async fn commit(
    State(state): State<AppState>,
    Json(request): Json<CommitRequest>,
) -> Result<Json<CommitResponse>, ApiError> {
    let repo = existing_dir(&state, &request.path).await?;
    // Author and committer both, so a sandbox without user.name still commits.
    Git::in_repo(&repo, "commit")
        .arg("--quiet")
        .arg_if(request.allow_empty.unwrap_or(false), "--allow-empty")
        .arg("-m")
        .arg(&request.message)
        .env("GIT_AUTHOR_NAME", &request.author)
        .env("GIT_AUTHOR_EMAIL", &request.email)
        .env("GIT_COMMITTER_NAME", &request.author)
        .env("GIT_COMMITTER_EMAIL", &request.email)
        .run()
        .await?;
    let hash = Git::in_repo(&repo, "rev-parse")
        .args(["--verify", "HEAD"])
        .run()
        .await?;
    Ok(Json(CommitResponse {
        hash: hash.trim().to_string(),
    }))
}

#[derive(Debug, Serialize, PartialEq)]
pub(crate) struct CommitInfo {
    hash: String,
    author: String,
    email: String,
    /// RFC 3339 author date.
    timestamp: String,
    message: String,
}

/// Fields and records of `git log` are separated by ASCII unit and record
/// separators, which commit messages do not contain in practice.
const LOG_FORMAT: &str = "--format=%H%x1f%an%x1f%ae%x1f%aI%x1f%B%x1e";

pub(crate) async fn history(
    State(state): State<AppState>,
    Query(query): Query<PathQuery>,
) -> Result<Json<Vec<CommitInfo>>, ApiError> {
    let repo = existing_dir(&state, &query.path).await?;
    match Git::in_repo(&repo, "log").arg(LOG_FORMAT).run().await {
        Ok(output) => Ok(Json(parse_log(&output))),
        // A repository without commits has an empty history, not an error.
        Err(ApiError::Git(error)) if error.detail.contains("does not have any commits yet") => {
            Ok(Json(Vec::new()))
        }
        Err(error) => Err(error),
    }
}

fn parse_log(output: &str) -> Vec<CommitInfo> {
    output
        .split('\x1e')
        .filter_map(|record| {
            let mut fields = record.trim_start_matches('\n').splitn(5, '\x1f');
            Some(CommitInfo {
                hash: fields.next().filter(|h| !h.is_empty())?.into(),
                author: fields.next()?.into(),
                email: fields.next()?.into(),
                timestamp: fields.next()?.into(),
                message: fields.next()?.trim_end().into(),
            })
        })
        .collect()
}

#[derive(Debug, Deserialize)]
pub struct ResetRequest {
    path: String,
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    target: Option<String>,
    #[serde(default)]
    files: Option<Vec<String>>,
}

pub(crate) async fn reset(
    State(state): State<AppState>,
    Json(request): Json<ResetRequest>,
) -> Result<StatusCode, ApiError> {
    let repo = existing_dir(&state, &request.path).await?;
    let mut git = Git::in_repo(&repo, "reset").arg("--quiet");
    let files = request.files.unwrap_or_default();
    match request.mode.as_deref().filter(|m| !m.is_empty()) {
        // git rejects `--mixed` with paths as deprecated; it is the default.
        Some("mixed") if !files.is_empty() => {}
        Some(mode @ ("soft" | "mixed" | "hard" | "merge" | "keep")) => {
            git = git.arg(format!("--{mode}"));
        }
        Some(other) => {
            return Err(ApiError::BadRequest(format!(
                "invalid reset mode {other:?}: expected soft, mixed, hard, merge or keep"
            )))
        }
        None => {}
    }
    if let Some(target) = request.target.filter(|t| !t.is_empty()) {
        require_name("target", &target)?;
        git = git.arg(target);
    }
    if !files.is_empty() {
        require_files(&files)?;
        git = git.arg("--").args(&files);
    }
    git.run().await?;
    Ok(StatusCode::OK)
}

#[derive(Debug, Deserialize)]
pub struct RestoreRequest {
    path: String,
    files: Vec<String>,
    #[serde(default)]
    staged: Option<bool>,
    #[serde(default)]
    worktree: Option<bool>,
    #[serde(default)]
    source: Option<String>,
}

pub(crate) async fn restore(
    State(state): State<AppState>,
    Json(request): Json<RestoreRequest>,
) -> Result<StatusCode, ApiError> {
    let repo = existing_dir(&state, &request.path).await?;
    require_files(&request.files)?;
    // Neither flag means the worktree, which is also git's default.
    let mut git = Git::in_repo(&repo, "restore")
        .arg_if(request.staged.unwrap_or(false), "--staged")
        .arg_if(request.worktree.unwrap_or(false), "--worktree");
    if let Some(source) = request.source.filter(|s| !s.is_empty()) {
        require_name("source", &source)?;
        git = git.arg(format!("--source={source}"));
    }
    git.arg("--").args(&request.files).run().await?;
    Ok(StatusCode::OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_records_keep_multi_line_messages() {
        let output =
            "aaa\x1fAnn\x1fann@x\x1f2024-01-02T03:04:05+00:00\x1fsubject\n\nbody line\n\x1e\n\
                      bbb\x1fBob\x1fbob@x\x1f2024-01-01T00:00:00+00:00\x1ffirst\n\x1e\n";
        let log = parse_log(output);
        assert_eq!(log.len(), 2);
        assert_eq!(log[0].hash, "aaa");
        assert_eq!(log[0].message, "subject\n\nbody line");
        assert_eq!(log[1].author, "Bob");
        assert_eq!(log[1].timestamp, "2024-01-01T00:00:00+00:00");
    }
}
