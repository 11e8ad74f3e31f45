//! `POST /files/bulk-upload` (`files[i].path` + `files[i].file` parts) and
//! `POST /files/upload-v2?path=` (one `file` part). Each file streams into a
//! temporary file next to its destination and is renamed into place only when
//! complete, so a failed upload leaves nothing behind.
//!
//! The bytes of a part are gathered into blocks of [`WRITE_BLOCK`] and written
//! by one blocking thread per file while the next block is being received: a
//! gibibyte is a thousand writes, not a spawned task per network read. The
//! [`BLOCKS`] block buffers go back and forth between the two, so an upload's
//! memory is bounded and never freshly faulted in. The chunks are copied, not
//! held: holding them would pin the network read buffer they are slices of
//! and make every read allocate a new one.

use std::collections::HashMap;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use axum::extract::multipart::{Field, Multipart, MultipartError};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::error::{ApiError, Json, Query};
use crate::AppState;

/// Bytes per write to disk.
const WRITE_BLOCK: usize = 1 << 20;
/// Block buffers per upload: one filling, the others written or waiting.
const BLOCKS: usize = 3;

#[derive(Debug, Deserialize)]
pub struct UploadQuery {
    path: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct UploadedFile {
    name: String,
    path: String,
    #[serde(rename = "type")]
    content_type: String,
}

/// An upload failure; the SDK reads the `errors` list of the body.
pub(crate) struct UploadError(ApiError);

impl From<ApiError> for UploadError {
    fn from(error: ApiError) -> Self {
        Self(error)
    }
}

impl IntoResponse for UploadError {
    fn into_response(self) -> Response {
        let mut body = self.0.body();
        body["errors"] = serde_json::json!([self.0.to_string()]);
        (self.0.status(), axum::Json(body)).into_response()
    }
}

pub(crate) async fn bulk_upload(
    State(state): State<AppState>,
    multipart: Result<Multipart, axum::extract::multipart::MultipartRejection>,
) -> Result<StatusCode, UploadError> {
    let mut multipart = multipart.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let mut paths: HashMap<String, String> = HashMap::new();
    while let Some(field) = multipart.next_field().await.map_err(malformed)? {
        let name = field.name().unwrap_or_default().to_string();
        let Some((index, kind)) = parse_field_name(&name) else {
            continue;
        };
        match kind {
            "path" => {
                let path = field.text().await.map_err(malformed)?;
                paths.insert(index.to_string(), path);
            }
            "file" => {
                // The SDK sends every path before every file, and the file's
                // own filename is its destination too.
                let requested = paths
                    .get(index)
                    .cloned()
                    .or_else(|| field.file_name().map(str::to_string))
                    .ok_or_else(|| ApiError::BadRequest(format!("no path for {name}")))?;
                let destination = state.settings.resolve(&requested);
                store(field, &destination).await?;
            }
            _ => {}
        }
    }
    Ok(StatusCode::OK)
}

pub(crate) async fn upload_v2(
    State(state): State<AppState>,
    Query(query): Query<UploadQuery>,
    multipart: Result<Multipart, axum::extract::multipart::MultipartRejection>,
) -> Result<Json<UploadedFile>, UploadError> {
    let mut multipart = multipart.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let destination = state.settings.resolve(&query.path);
    while let Some(field) = multipart.next_field().await.map_err(malformed)? {
        if field.name() != Some("file") {
            continue;
        }
        let content_type = field
            .content_type()
            .unwrap_or("application/octet-stream")
            .to_string();
        store(field, &destination).await?;
        return Ok(Json(UploadedFile {
            name: destination
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned(),
            path: destination.to_string_lossy().into_owned(),
            content_type,
        }));
    }
    Err(ApiError::BadRequest("multipart body has no \"file\" part".into()).into())
}

/// `files[3].path` → `("3", "path")`.
fn parse_field_name(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_prefix("files[")?;
    let (index, kind) = rest.split_once("].")?;
    (!index.is_empty() && index.bytes().all(|b| b.is_ascii_digit())).then_some((index, kind))
}

fn malformed(error: MultipartError) -> ApiError {
    ApiError::BadRequest(format!("malformed multipart body: {}", error.body_text()))
}

/// Streams one part to `destination` through a temporary sibling.
async fn store(mut field: Field<'_>, destination: &Path) -> Result<(), ApiError> {
    let parent = destination
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .ok_or_else(|| {
            ApiError::BadRequest(format!("not a file path: {}", destination.display()))
        })?;
    tokio::fs::create_dir_all(parent)
        .await
        .map_err(|e| ApiError::io(parent, e))?;
    let file_name = destination.file_name().ok_or_else(|| {
        ApiError::BadRequest(format!("not a file path: {}", destination.display()))
    })?;
    let temporary: PathBuf = parent.join(format!(
        ".{}.cove-upload-{}",
        file_name.to_string_lossy(),
        uuid::Uuid::new_v4().simple()
    ));
    let file = tokio::fs::File::create(&temporary)
        .await
        .map_err(|e| ApiError::io(destination, e))?
        .into_std()
        .await;

    let (full, queued) = mpsc::channel::<Vec<u8>>(BLOCKS);
    let (free, empty) = mpsc::channel::<Vec<u8>>(BLOCKS);
    for _ in 0..BLOCKS {
        let _ = free.try_send(Vec::with_capacity(WRITE_BLOCK));
    }
    let writer = tokio::task::spawn_blocking(move || write_blocks(file, queued, &free));
    let received = receive(&mut field, &full, empty).await;
    drop(full);
    // The writer ends once the sender is gone (all blocks written) or on its
    // first error; a disk error explains a refused block better than the refusal.
    let written = match writer.await {
        Ok(Ok(())) => received,
        Ok(Err(e)) => Err(ApiError::io(destination, e)),
        Err(e) => Err(ApiError::internal(
            "writing an upload",
            io::Error::other(e.to_string()),
        )),
    };
    let written = match written {
        Ok(()) => tokio::fs::rename(&temporary, destination)
            .await
            .map_err(|e| ApiError::io(destination, e)),
        Err(e) => Err(e),
    };
    if written.is_err() {
        let _ = tokio::fs::remove_file(&temporary).await;
    }
    written
}

/// Copies the part's chunks into free blocks and queues each full one for
/// the writer. Returns `Ok` also when the writer stopped early: its own error
/// is the one to report.
async fn receive(
    field: &mut Field<'_>,
    full: &mpsc::Sender<Vec<u8>>,
    mut empty: mpsc::Receiver<Vec<u8>>,
) -> Result<(), ApiError> {
    let Some(mut block) = empty.recv().await else {
        return Ok(());
    };
    while let Some(chunk) = field.chunk().await.map_err(malformed)? {
        let mut rest = &chunk[..];
        while !rest.is_empty() {
            let taken = rest.len().min(WRITE_BLOCK - block.len());
            block.extend_from_slice(&rest[..taken]);
            rest = &rest[taken..];
            if block.len() == WRITE_BLOCK {
                if full.send(block).await.is_err() {
                    return Ok(());
                }
                let Some(next) = empty.recv().await else {
                    return Ok(());
                };
                block = next;
            }
        }
    }
    if !block.is_empty() {
        let _ = full.send(block).await;
    }
    Ok(())
}

/// The writing thread: writes each queued block and hands it back emptied;
/// the file is closed when the queue ends.
fn write_blocks(
    mut file: std::fs::File,
    mut queued: mpsc::Receiver<Vec<u8>>,
    free: &mpsc::Sender<Vec<u8>>,
) -> io::Result<()> {
    while let Some(mut block) = queued.blocking_recv() {
        file.write_all(&block)?;
        block.clear();
        // Never full: only `BLOCKS` buffers exist.
        let _ = free.try_send(block);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_field_name;

    #[test]
    fn field_names_of_the_sdk() {
        assert_eq!(parse_field_name("files[0].path"), Some(("0", "path")));
        assert_eq!(parse_field_name("files[12].file"), Some(("12", "file")));
        assert_eq!(parse_field_name("files[].file"), None);
        assert_eq!(parse_field_name("files[x].file"), None);
        assert_eq!(parse_field_name("file"), None);
    }
}
