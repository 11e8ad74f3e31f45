//! `GET /files/download` and `POST /files/bulk-download`. Files are streamed
//! from disk, never held whole in memory; the bulk answer is
//! `multipart/form-data` with one `file` part per path (its `filename` is the
//! path exactly as requested) or an `error` part carrying the JSON error.

use std::io;

use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::stream::{self, BoxStream, StreamExt as _};
use serde::Deserialize;
use tokio_util::io::ReaderStream;

use crate::error::{ApiError, Json, Query};
use crate::{AppState, Settings};

/// Bytes read from disk per body frame: few enough to keep memory flat,
/// enough that a gibibyte is not a quarter of a million frames.
const STREAM_CHUNK: usize = 64 << 10;

#[derive(Debug, Deserialize)]
pub struct PathQuery {
    path: String,
}

#[derive(Debug, Deserialize)]
pub struct DownloadRequest {
    paths: Vec<String>,
}

pub async fn download(
    State(state): State<AppState>,
    Query(query): Query<PathQuery>,
) -> Result<Response, ApiError> {
    let (file, size) = open_regular(&state.settings, &query.path).await?;
    let name = std::path::Path::new(&query.path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; {}", filename_param(&name)),
            ),
        ],
        Body::from_stream(ReaderStream::with_capacity(file, STREAM_CHUNK)),
    )
        .into_response())
}

pub async fn bulk_download(
    State(state): State<AppState>,
    Json(request): Json<DownloadRequest>,
) -> Response {
    let boundary = format!("cove-{}", uuid::Uuid::new_v4().simple());
    let settings = state.settings.clone();
    let part_boundary = boundary.clone();
    let parts = stream::iter(request.paths)
        .then(move |path| part(settings.clone(), part_boundary.clone(), path))
        .flatten();
    let closing = stream::once(std::future::ready(Ok(Bytes::from(format!(
        "--{boundary}--\r\n"
    )))));
    (
        [(
            header::CONTENT_TYPE,
            format!("multipart/form-data; boundary={boundary}"),
        )],
        Body::from_stream(parts.chain(closing)),
    )
        .into_response()
}

/// One part of the bulk answer: the file's bytes or the reason it has none.
async fn part(
    settings: std::sync::Arc<Settings>,
    boundary: String,
    requested: String,
) -> BoxStream<'static, io::Result<Bytes>> {
    match open_regular(&settings, &requested).await {
        Ok((file, size)) => {
            let head = format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; {}\r\n\
                 Content-Type: application/octet-stream\r\nContent-Length: {size}\r\n\r\n",
                filename_param(&requested)
            );
            stream::once(std::future::ready(Ok(Bytes::from(head))))
                .chain(ReaderStream::with_capacity(file, STREAM_CHUNK))
                .chain(stream::once(std::future::ready(Ok(Bytes::from_static(
                    b"\r\n",
                )))))
                .boxed()
        }
        Err(error) => {
            let text = format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"error\"; {}\r\n\
                 Content-Type: application/json\r\n\r\n{}\r\n",
                filename_param(&requested),
                error.body()
            );
            stream::once(std::future::ready(Ok(Bytes::from(text)))).boxed()
        }
    }
}

/// Opens a regular file for streaming; a directory is a client error.
async fn open_regular(
    settings: &Settings,
    requested: &str,
) -> Result<(tokio::fs::File, u64), ApiError> {
    let path = settings.resolve(requested);
    let file = tokio::fs::File::open(&path)
        .await
        .map_err(|e| ApiError::io(&path, e))?;
    let metadata = file.metadata().await.map_err(|e| ApiError::io(&path, e))?;
    if metadata.is_dir() {
        return Err(ApiError::BadRequest(format!(
            "is a directory: {}",
            path.display()
        )));
    }
    Ok((file, metadata.len()))
}

/// Escapes a value for a quoted `Content-Disposition` parameter.
/// The `filename` parameter of a Content-Disposition header. A header carries
/// Latin-1, so a name outside ASCII goes as RFC 5987 `filename*=utf-8''...`,
/// which the SDK decodes back to the exact path it asked for.
fn filename_param(name: &str) -> String {
    if name.is_ascii() && !name.contains(['\r', '\n']) {
        return format!("filename=\"{}\"", escape(name));
    }
    let encoded: String = name
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect();
    format!("filename*=utf-8''{encoded}")
}

fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace(['\r', '\n'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_ascii_names_use_the_extended_parameter() {
        assert_eq!(filename_param("/tmp/a b.txt"), "filename=\"/tmp/a b.txt\"");
        assert_eq!(
            filename_param("/tmp/\u{fc}.txt"),
            "filename*=utf-8''/tmp/%C3%BC.txt"
        );
    }
}
