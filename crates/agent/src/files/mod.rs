//! Files (`/files...`): listing, metadata, folders, deletion, and streaming
//! uploads and downloads. Relative paths resolve against the work dir.

mod download;
mod info;
mod manage;
mod upload;

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
