//! Files (`/files...`): listing, metadata, folders, deletion, moves,
//! permissions, name and content search, replacement, change watching, and
//! streaming uploads and downloads. Relative paths resolve against the work dir.
//!
//! Paths are taken as the sandbox sees them: the agent runs inside the
//! sandbox's own mount and PID namespaces, so `..` and symlinks lead only to
//! the sandbox's own files, and no endpoint reaches beyond them. Tree walks
//! (search, find, watch) never follow symlinks below their root and never
//! enter `/proc` or `/sys` unless asked to start there. Errors name the path:
//! missing 404, forbidden 403, malformed request 400.

pub(crate) mod download;
pub(crate) mod info;
pub(crate) mod manage;
pub(crate) mod permissions;
pub(crate) mod rename;
pub(crate) mod replace;
pub(crate) mod search;
pub(crate) mod upload;
mod walk;
pub(crate) mod watch;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;

pub use info::FileInfo;

use crate::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/files", get(info::list).delete(manage::delete))
        .route("/files/info", get(info::info))
        .route("/files/folder", post(manage::create_folder))
        .route("/files/move", post(rename::move_file))
        .route("/files/permissions", post(permissions::set_permissions))
        .route("/files/search", get(search::search_files))
        .route("/files/find", get(search::find_in_files))
        .route("/files/replace", post(replace::replace_in_files))
        .route("/files/watch", get(watch::watch))
        .route("/files/download", get(download::download))
        .route("/files/bulk-download", post(download::bulk_download))
        .route(
            "/files/bulk-upload",
            // Uploads stream to disk, so they need no size cap in memory.
            post(upload::bulk_upload).layer(DefaultBodyLimit::disable()),
        )
        .route(
            "/files/upload-v2",
            post(upload::upload_v2).layer(DefaultBodyLimit::disable()),
        )
}
