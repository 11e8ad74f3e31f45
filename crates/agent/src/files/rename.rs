//! `POST /files/move?source=&destination=`: renames a file or directory. The
//! destination must not exist (409) and its parent must (404). Where rename(2)
//! cannot work (across filesystems, or a directory of the image's lower layer on
//! overlayfs, both `EXDEV`) the tree is copied, keeping modes and symlinks, and
//! the source removed afterwards.

use std::io;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::Path;

use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;

use crate::error::{ApiError, Query};
use crate::AppState;

#[derive(Debug, Deserialize)]
pub struct MoveQuery {
    source: String,
    destination: String,
}

pub(crate) async fn move_file(
    State(state): State<AppState>,
    Query(query): Query<MoveQuery>,
) -> Result<StatusCode, ApiError> {
    if query.source.is_empty() || query.destination.is_empty() {
        return Err(ApiError::BadRequest(
            "source and destination are required".into(),
        ));
    }
    let source = state.settings.resolve(&query.source);
    let destination = state.settings.resolve(&query.destination);
    tokio::task::spawn_blocking(move || move_path(&source, &destination))
        .await
        .map_err(|e| ApiError::internal("moving files", io::Error::other(e)))??;
    Ok(StatusCode::OK)
}

fn move_path(source: &Path, destination: &Path) -> Result<(), ApiError> {
    let metadata = std::fs::symlink_metadata(source).map_err(|e| ApiError::io(source, e))?;
    let parent = destination
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .ok_or_else(|| {
            ApiError::BadRequest(format!("invalid destination: {}", destination.display()))
        })?;
    std::fs::metadata(parent).map_err(|e| ApiError::io(parent, e))?;
    if std::fs::symlink_metadata(destination).is_ok() {
        return Err(ApiError::AlreadyExists(destination.to_path_buf()));
    }
    if metadata.is_dir() && destination.starts_with(source) {
        return Err(ApiError::BadRequest(format!(
            "cannot move {} into itself",
            source.display()
        )));
    }
    match std::fs::rename(source, destination) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            if let Err(e) = copy_tree(source, destination) {
                let _ = remove_tree(destination);
                return Err(ApiError::io(destination, e));
            }
            remove_tree(source).map_err(|e| ApiError::io(source, e))
        }
        Err(e) => Err(ApiError::io(source, e)),
    }
}

/// Copies a file, symlink or directory tree; never follows a symlink.
fn copy_tree(source: &Path, destination: &Path) -> io::Result<()> {
    let metadata = std::fs::symlink_metadata(source)?;
    let file_type = metadata.file_type();
    if file_type.is_symlink() {
        std::os::unix::fs::symlink(std::fs::read_link(source)?, destination)?;
    } else if file_type.is_dir() {
        std::fs::DirBuilder::new()
            .mode(metadata.mode() & 0o7777)
            .create(destination)?;
        for entry in std::fs::read_dir(source)? {
            let entry = entry?;
            copy_tree(&entry.path(), &destination.join(entry.file_name()))?;
        }
    } else if file_type.is_file() {
        std::fs::copy(source, destination)?;
    } else {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "cannot copy a device, fifo or socket across filesystems",
        ));
    }
    if !file_type.is_symlink() {
        std::fs::set_permissions(
            destination,
            std::fs::Permissions::from_mode(metadata.mode() & 0o7777),
        )?;
        // Keeping the owner needs root; as anyone else the copy becomes theirs.
        let _ = std::os::unix::fs::lchown(destination, Some(metadata.uid()), Some(metadata.gid()));
    }
    Ok(())
}

fn remove_tree(path: &Path) -> io::Result<()> {
    if std::fs::symlink_metadata(path)?.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_tree_keeps_modes_and_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("src");
        std::fs::create_dir_all(source.join("sub")).unwrap();
        std::fs::write(source.join("sub/run.sh"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(
            source.join("sub/run.sh"),
            std::fs::Permissions::from_mode(0o751),
        )
        .unwrap();
        std::os::unix::fs::symlink("sub/run.sh", source.join("link")).unwrap();
        let copy = dir.path().join("copy");
        copy_tree(&source, &copy).unwrap();
        let mode = std::fs::metadata(copy.join("sub/run.sh")).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o751);
        assert_eq!(
            std::fs::read_link(copy.join("link")).unwrap(),
            Path::new("sub/run.sh")
        );
        remove_tree(&source).unwrap();
        assert!(!source.exists());
    }
}
