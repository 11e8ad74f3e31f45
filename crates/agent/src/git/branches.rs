//! Local branches: list, create, delete, and checkout.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use super::run::Git;
use super::{existing_dir, require_name, PathQuery};
use crate::error::{ApiError, Json, Query};
use crate::AppState;

#[derive(Debug, Serialize)]
pub(crate) struct BranchList {
    branches: Vec<String>,
    /// The checked-out branch, empty when HEAD is detached.
    current: String,
}

pub(crate) async fn list(
    State(state): State<AppState>,
    Query(query): Query<PathQuery>,
) -> Result<Json<BranchList>, ApiError> {
    let repo = existing_dir(&state, &query.path).await?;
    let (branches, current) = tokio::join!(
        Git::in_repo(&repo, "for-each-ref")
            .args(["--format=%(refname:short)", "refs/heads/"])
            .run(),
        // Also names an unborn branch, which for-each-ref cannot see.
        Git::in_repo(&repo, "branch").arg("--show-current").run(),
    );
    Ok(Json(BranchList {
        branches: branches?.lines().map(str::to_string).collect(),
        current: current?.trim().to_string(),
    }))
}

#[derive(Debug, Deserialize)]
pub struct BranchRequest {
    path: String,
    name: String,
}

/// Creates the branch at HEAD and switches to it, as Daytona's daemon does,
/// so the next commit lands on it.
pub(crate) async fn create(
    State(state): State<AppState>,
    Json(request): Json<BranchRequest>,
) -> Result<StatusCode, ApiError> {
    let repo = existing_dir(&state, &request.path).await?;
    require_name("branch name", &request.name)?;
    Git::in_repo(&repo, "switch")
        .args(["--quiet", "--create"])
        .arg(&request.name)
        .run()
        .await?;
    Ok(StatusCode::CREATED)
}

/// Deletes the branch whether or not it is merged, as Daytona's daemon does.
pub(crate) async fn delete(
    State(state): State<AppState>,
    Json(request): Json<BranchRequest>,
) -> Result<StatusCode, ApiError> {
    let repo = existing_dir(&state, &request.path).await?;
    require_name("branch name", &request.name)?;
    Git::in_repo(&repo, "branch")
        .args(["--quiet", "-D"])
        .arg(&request.name)
        .run()
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
pub struct CheckoutRequest {
    path: String,
    branch: String,
}

/// Checks out a branch (a remote-only branch gets a local tracking branch) or
/// any commit. The trailing `--` keeps a name that is also a file from
/// being taken as a path to restore.
pub(crate) async fn checkout(
    State(state): State<AppState>,
    Json(request): Json<CheckoutRequest>,
) -> Result<StatusCode, ApiError> {
    let repo = existing_dir(&state, &request.path).await?;
    require_name("branch", &request.branch)?;
    Git::in_repo(&repo, "checkout")
        .arg("--quiet")
        .arg(&request.branch)
        .arg("--")
        .run()
        .await?;
    Ok(StatusCode::OK)
}
