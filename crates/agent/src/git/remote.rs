//! Talking to other repositories: clone, pull, push, and the remotes list.
//! Request credentials go to git through [`Credentials`] only, so a clone
//! with a token leaves a remote URL without it.

use std::path::Path;

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use super::run::{redact_url, Credentials, Git};
use super::{existing_dir, require_name, PathQuery};
use crate::error::{ApiError, Json, Query};
use crate::AppState;

const DEFAULT_REMOTE: &str = "origin";

#[derive(Debug, Deserialize)]
pub struct CloneRequest {
    url: String,
    path: String,
    #[serde(default)]
    branch: Option<String>,
    #[serde(default)]
    commit_id: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    insecure_skip_tls: Option<bool>,
    #[serde(default)]
    depth: Option<i64>,
}

pub(crate) async fn clone(
    State(state): State<AppState>,
    Json(request): Json<CloneRequest>,
) -> Result<StatusCode, ApiError> {
    require_name("url", &request.url)?;
    if request.path.is_empty() {
        return Err(ApiError::BadRequest("path is required".into()));
    }
    let path = state.settings.resolve(&request.path);
    let credentials = Credentials::new(request.username, request.password)?;
    let commit = request.commit_id.filter(|c| !c.is_empty());
    let existed = tokio::fs::symlink_metadata(&path).await.is_ok();

    let description = format!(
        "git clone {} into {}",
        redact_url(&request.url),
        path.display()
    );
    let mut git = Git::new("clone", description.clone())
        .arg("--quiet")
        .arg_if(commit.is_some(), "--no-checkout")
        .credentials(&credentials);
    if let Some(branch) = request.branch.filter(|b| !b.is_empty()) {
        require_name("branch", &branch)?;
        git = git.arg("--branch").arg(branch);
    }
    match request.depth {
        Some(depth) if depth < 0 => {
            return Err(ApiError::BadRequest(format!("invalid depth {depth}")))
        }
        Some(depth) if depth > 0 => git = git.arg(format!("--depth={depth}")),
        _ => {}
    }
    if request.insecure_skip_tls.unwrap_or(false) {
        git = git.config("http.sslVerify", "false");
    }
    git.arg("--").arg(&request.url).arg(&path).run().await?;

    if let Some(commit) = commit {
        if let Err(error) = check_out_commit(&path, &commit, &description).await {
            // Leave nothing half made behind.
            discard_clone(&path, existed).await;
            return Err(error);
        }
    }
    Ok(StatusCode::OK)
}

/// Detaches HEAD at `commit`, which must name a commit of the fresh clone.
async fn check_out_commit(path: &Path, commit: &str, description: &str) -> Result<(), ApiError> {
    require_name("commit", commit)?;
    let verified = Git::in_repo(path, "rev-parse")
        .args(["--verify", "--quiet", "--end-of-options"])
        .arg(format!("{commit}^{{commit}}"))
        .output()
        .await?;
    if !verified.status.success() {
        return Err(super::GitError {
            failure: super::GitFailure::NotFound,
            command: description.to_string(),
            detail: format!("commit {commit} not found in the cloned repository"),
        }
        .into());
    }
    let sha = String::from_utf8_lossy(&verified.stdout).trim().to_string();
    Git::in_repo(path, "checkout")
        .args(["--quiet", "--detach"])
        .arg(sha)
        .run()
        .await?;
    Ok(())
}

async fn discard_clone(path: &Path, existed: bool) {
    if !existed {
        let _ = tokio::fs::remove_dir_all(path).await;
        return;
    }
    // The destination was an empty directory: empty it again.
    if let Ok(mut entries) = tokio::fs::read_dir(path).await {
        while let Ok(Some(entry)) = entries.next_entry().await {
            let _ = tokio::fs::remove_dir_all(entry.path()).await;
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct PullRequest {
    path: String,
    #[serde(default)]
    branch: Option<String>,
    #[serde(default)]
    remote: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

pub(crate) async fn pull(
    State(state): State<AppState>,
    Json(request): Json<PullRequest>,
) -> Result<StatusCode, ApiError> {
    let repo = existing_dir(&state, &request.path).await?;
    let credentials = Credentials::new(request.username, request.password)?;
    let remote = request.remote.filter(|r| !r.is_empty());
    let branch = request.branch.filter(|b| !b.is_empty());

    let mut git = Git::in_repo(&repo, "pull")
        .args(["--quiet", "--no-edit"])
        .credentials(&credentials);
    // Without a configured way to reconcile divergent branches git refuses
    // to pull at all; merge, as git did by default for years.
    if !has_config(&repo, "^pull\\.(rebase|ff)$").await? {
        git = git.arg("--no-rebase");
    }
    let target = match (remote, branch) {
        (None, None) if has_upstream(&repo).await? => None,
        (remote, branch) => {
            let branch = match branch {
                Some(branch) => branch,
                None => current_branch(&repo, "pull").await?,
            };
            Some((remote.unwrap_or_else(|| DEFAULT_REMOTE.into()), branch))
        }
    };
    if let Some((remote, branch)) = target {
        require_name("remote", &remote)?;
        require_name("branch", &branch)?;
        git = git.arg(remote).arg(branch);
    }
    git.run().await?;
    Ok(StatusCode::OK)
}

#[derive(Debug, Deserialize)]
pub struct PushRequest {
    path: String,
    #[serde(default)]
    branch: Option<String>,
    #[serde(default)]
    remote: Option<String>,
    #[serde(default)]
    set_upstream: Option<bool>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

pub(crate) async fn push(
    State(state): State<AppState>,
    Json(request): Json<PushRequest>,
) -> Result<StatusCode, ApiError> {
    let repo = existing_dir(&state, &request.path).await?;
    let credentials = Credentials::new(request.username, request.password)?;
    let remote = request
        .remote
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| DEFAULT_REMOTE.into());
    let branch = match request.branch.filter(|b| !b.is_empty()) {
        Some(branch) => branch,
        None => current_branch(&repo, "push").await?,
    };
    require_name("remote", &remote)?;
    require_name("branch", &branch)?;
    Git::in_repo(&repo, "push")
        .arg("--quiet")
        .arg_if(request.set_upstream.unwrap_or(false), "--set-upstream")
        .credentials(&credentials)
        .arg(remote)
        .arg(branch)
        .run()
        .await?;
    Ok(StatusCode::OK)
}

/// The checked-out branch; a detached HEAD has none, so the caller must name one.
async fn current_branch(repo: &Path, operation: &str) -> Result<String, ApiError> {
    let branch = Git::in_repo(repo, "branch")
        .arg("--show-current")
        .run()
        .await?;
    let branch = branch.trim();
    if branch.is_empty() {
        return Err(ApiError::BadRequest(format!(
            "HEAD is detached in {}: name the branch to {operation}",
            repo.display()
        )));
    }
    Ok(branch.to_string())
}

async fn has_upstream(repo: &Path) -> Result<bool, ApiError> {
    let output = Git::in_repo(repo, "rev-parse")
        .args(["--abbrev-ref", "--symbolic-full-name", "@{upstream}"])
        .output()
        .await?;
    Ok(output.status.success())
}

async fn has_config(repo: &Path, pattern: &str) -> Result<bool, ApiError> {
    let output = Git::in_repo(repo, "config")
        .args(["--get-regexp", pattern])
        .output()
        .await?;
    Ok(output.status.success())
}

#[derive(Debug, Serialize, PartialEq)]
pub(crate) struct Remote {
    name: String,
    url: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct RemoteList {
    remotes: Vec<Remote>,
}

pub(crate) async fn list(
    State(state): State<AppState>,
    Query(query): Query<PathQuery>,
) -> Result<Json<RemoteList>, ApiError> {
    let repo = existing_dir(&state, &query.path).await?;
    let output = Git::in_repo(&repo, "remote").arg("-v").run().await?;
    Ok(Json(RemoteList {
        remotes: parse_remotes(&output),
    }))
}

/// `git remote -v`: `name<TAB>url (fetch)` and `(push)` lines; the fetch
/// URL is the remote's URL.
fn parse_remotes(output: &str) -> Vec<Remote> {
    output
        .lines()
        .filter_map(|line| {
            let (name, rest) = line.split_once('\t')?;
            let url = rest.strip_suffix(" (fetch)")?;
            Some(Remote {
                name: name.into(),
                url: url.into(),
            })
        })
        .collect()
}

#[derive(Debug, Deserialize)]
pub struct AddRemoteRequest {
    path: String,
    name: String,
    url: String,
    #[serde(default)]
    fetch: Option<bool>,
    #[serde(default)]
    overwrite: Option<bool>,
}

pub(crate) async fn add(
    State(state): State<AppState>,
    Json(request): Json<AddRemoteRequest>,
) -> Result<StatusCode, ApiError> {
    let repo = existing_dir(&state, &request.path).await?;
    require_name("remote name", &request.name)?;
    require_name("url", &request.url)?;
    let exists = Git::in_repo(&repo, "remote")
        .arg("get-url")
        .arg(&request.name)
        .output()
        .await?
        .status
        .success();
    let action = if exists && request.overwrite.unwrap_or(false) {
        "set-url"
    } else {
        "add"
    };
    Git::in_repo(&repo, "remote")
        .arg(action)
        .arg(&request.name)
        .arg(&request.url)
        .run()
        .await?;
    if request.fetch.unwrap_or(false) {
        Git::in_repo(&repo, "fetch")
            .arg("--quiet")
            .arg(&request.name)
            .run()
            .await?;
    }
    Ok(StatusCode::CREATED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_listing_keeps_fetch_urls() {
        let output = "origin\t/tmp/remote.git (fetch)\norigin\t/tmp/remote.git (push)\n\
                      up\thttps://example.com/a b.git (fetch)\nup\thttps://example.com/a b.git (push)\n";
        assert_eq!(
            parse_remotes(output),
            [
                Remote {
                    name: "origin".into(),
                    url: "/tmp/remote.git".into()
                },
                Remote {
                    name: "up".into(),
                    url: "https://example.com/a b.git".into()
                },
            ]
        );
    }
}
