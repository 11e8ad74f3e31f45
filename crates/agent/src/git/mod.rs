//! `/git/*`: the SDK's `sandbox.git` operations, served by running the
//! sandbox's own `git` binary against a repository path.
//!
//! This module owns turning each request into git invocations and git's
//! output and failures back into the SDK's shapes and `GIT_*` error codes.
//! It never prompts (credentials come only with the request or from the
//! user's configured helpers) and never writes request credentials into a
//! repository's config.

pub(crate) mod branches;
pub(crate) mod config;
mod failure;
pub(crate) mod remote;
pub(crate) mod repo;
mod run;
mod status;

use std::path::PathBuf;

use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;

pub use failure::{GitError, GitFailure};

use crate::error::ApiError;
use crate::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/git/status", get(status::status))
        .route("/git/add", post(repo::add))
        .route("/git/commit", post(repo::commit))
        .route("/git/history", get(repo::history))
        .route("/git/init", post(repo::init))
        .route("/git/reset", post(repo::reset))
        .route("/git/restore", post(repo::restore))
        .route(
            "/git/branches",
            get(branches::list)
                .post(branches::create)
                .delete(branches::delete),
        )
        .route("/git/checkout", post(branches::checkout))
        .route("/git/clone", post(remote::clone))
        .route("/git/pull", post(remote::pull))
        .route("/git/push", post(remote::push))
        .route("/git/remotes", get(remote::list).post(remote::add))
        .route("/git/config", get(config::get).post(config::set))
        .route("/git/config/user", post(config::configure_user))
        .route("/git/credentials", post(config::authenticate))
}

/// `?path=` of the read-only endpoints.
#[derive(Debug, Deserialize)]
pub struct PathQuery {
    pub path: String,
}

/// The request's repository path, resolved; a missing path is a 404 naming it
/// (a path that exists but is no repository is git's `GIT_REPO_NOT_FOUND`).
pub async fn existing_dir(state: &AppState, path: &str) -> Result<PathBuf, ApiError> {
    if path.is_empty() {
        return Err(ApiError::BadRequest("path is required".into()));
    }
    let path = state.settings.resolve(path);
    let metadata = tokio::fs::metadata(&path)
        .await
        .map_err(|e| ApiError::io(&path, e))?;
    if !metadata.is_dir() {
        return Err(ApiError::io(
            &path,
            std::io::Error::from(std::io::ErrorKind::NotADirectory),
        ));
    }
    Ok(path)
}

/// Refuses empty file lists and option-like names (`--` separates them
/// anyway; this names the problem).
pub fn require_files(files: &[String]) -> Result<(), ApiError> {
    if files.is_empty() || files.iter().any(|f| f.is_empty()) {
        return Err(ApiError::BadRequest(
            "files must name at least one path".into(),
        ));
    }
    Ok(())
}

/// Refuses a ref-like argument git would take as an option.
pub fn require_name(what: &str, value: &str) -> Result<(), ApiError> {
    if value.is_empty() || value.starts_with('-') {
        return Err(ApiError::BadRequest(format!("invalid {what}: {value:?}")));
    }
    Ok(())
}
