//! `POST /files/folder` and `DELETE /files`.

use std::os::unix::fs::DirBuilderExt as _;

use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;

use crate::error::{ApiError, Query};
use crate::AppState;

#[derive(Debug, Deserialize)]
pub struct FolderQuery {
    path: String,
    mode: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct DeleteQuery {
    path: String,
    #[serde(default)]
    recursive: bool,
}

pub(crate) async fn create_folder(
    State(state): State<AppState>,
    Query(query): Query<FolderQuery>,
) -> Result<StatusCode, ApiError> {
    let path = state.settings.resolve(&query.path);
    let mode = match query.mode.as_deref() {
        None | Some("") => 0o755,
        Some(mode) => u32::from_str_radix(mode, 8)
            .ok()
            .filter(|mode| *mode <= 0o7777)
            .ok_or_else(|| ApiError::BadRequest(format!("invalid octal mode: {mode}")))?,
    };
    let target = path.clone();
    tokio::task::spawn_blocking(move || {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(&target)
    })
    .await
    .map_err(|e| ApiError::internal("creating folder", std::io::Error::other(e)))?
    .map_err(|e| ApiError::io(&path, e))?;
    Ok(StatusCode::CREATED)
}

pub(crate) async fn delete(
    State(state): State<AppState>,
    Query(query): Query<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    let path = state.settings.resolve(&query.path);
    let metadata = tokio::fs::symlink_metadata(&path)
        .await
        .map_err(|e| ApiError::io(&path, e))?;
    let removed = if !metadata.is_dir() {
        tokio::fs::remove_file(&path).await
    } else if query.recursive {
        tokio::fs::remove_dir_all(&path).await
    } else {
        tokio::fs::remove_dir(&path).await
    };
    match removed {
        Ok(()) => Ok(StatusCode::NO_CONTENT),
        Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty => {
            Err(ApiError::BadRequest(format!(
                "directory not empty: {} (use recursive=true)",
                path.display()
            )))
        }
        Err(e) => Err(ApiError::io(&path, e)),
    }
}
