//! `GET /files/download` and `POST /files/bulk-download`. Files are streamed
//! from disk, never held whole in memory; the bulk answer is
//! `multipart/form-data` with one `file` part per path (its `filename` is the
//! path exactly as requested) or an `error` part carrying the JSON error.
//!
//! A file is read by one blocking thread into [`STREAM_BUFFERS`] reused
//! buffers of [`STREAM_CHUNK`] bytes: each body frame borrows a buffer, which
//! goes back to the reader once hyper has written it. A gibibyte is then four
//! thousand reads into memory already mapped, instead of a spawned task and a
//! fresh allocation (a page fault per 4 KiB) per 64 KiB.

use std::io::{self, Read as _};
use std::sync::mpsc as pool;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::stream::{self, BoxStream, StreamExt as _};
use serde::Deserialize;
use tokio::sync::mpsc;

use crate::error::{ApiError, Json, Query};
use crate::{AppState, Settings};

/// Bytes read from disk per body frame.
const STREAM_CHUNK: usize = 256 << 10;
/// Buffers one file's stream may hold at once (read, queued, or in hyper's
/// write queue): the memory of a download is bounded by their total.
const STREAM_BUFFERS: usize = 8;
/// How often the reading thread, waiting for a buffer, checks that the stream
/// still has a consumer.
const RECLAIM_POLL: Duration = Duration::from_millis(500);

#[derive(Debug, Deserialize)]
pub struct PathQuery {
    path: String,
}

#[derive(Debug, Deserialize)]
pub struct DownloadRequest {
    paths: Vec<String>,
}

pub(crate) async fn download(
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
        Body::from_stream(file_stream(file)),
    )
        .into_response())
}

pub(crate) async fn bulk_download(
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
                .chain(file_stream(file))
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
) -> Result<(std::fs::File, u64), ApiError> {
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
    Ok((file.into_std().await, metadata.len()))
}

/// The bytes of `file` from its current offset to its end, read by a
/// blocking thread into pooled buffers.
fn file_stream(file: std::fs::File) -> BoxStream<'static, io::Result<Bytes>> {
    let (frames, received) = mpsc::channel(STREAM_BUFFERS / 2);
    tokio::task::spawn_blocking(move || read_frames(file, &frames));
    stream::unfold(received, |mut received| async move {
        received.recv().await.map(|frame| (frame, received))
    })
    .boxed()
}

/// A filled prefix of a pooled buffer; dropping it returns the buffer.
struct Frame {
    buffer: Vec<u8>,
    len: usize,
    pool: pool::Sender<Vec<u8>>,
}

impl AsRef<[u8]> for Frame {
    fn as_ref(&self) -> &[u8] {
        &self.buffer[..self.len]
    }
}

impl Drop for Frame {
    fn drop(&mut self) {
        // The reader may be gone already; the buffer is then simply freed.
        let _ = self.pool.send(std::mem::take(&mut self.buffer));
    }
}

/// The reading thread: fills a free buffer, sends it as a frame, until the
/// end of the file, a read error (sent as the stream's last item) or the
/// stream being dropped.
fn read_frames(mut file: std::fs::File, frames: &mpsc::Sender<io::Result<Bytes>>) {
    let (give_back, returned) = pool::channel::<Vec<u8>>();
    let mut allocated = 0;
    loop {
        let mut buffer = match returned.try_recv() {
            Ok(buffer) => buffer,
            Err(_) if allocated < STREAM_BUFFERS => {
                allocated += 1;
                vec![0; STREAM_CHUNK]
            }
            Err(_) => loop {
                match returned.recv_timeout(RECLAIM_POLL) {
                    Ok(buffer) => break buffer,
                    Err(_) if frames.is_closed() => return,
                    Err(_) => {}
                }
            },
        };
        let len = match fill(&mut file, &mut buffer) {
            Ok(0) => return,
            Ok(len) => len,
            Err(e) => {
                let _ = frames.blocking_send(Err(e));
                return;
            }
        };
        let frame = Frame {
            buffer,
            len,
            pool: give_back.clone(),
        };
        if frames.blocking_send(Ok(Bytes::from_owner(frame))).is_err() {
            return;
        }
    }
}

/// Reads until `buffer` is full or the file ends; the count read.
fn fill(file: &mut std::fs::File, buffer: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buffer.len() {
        match file.read(&mut buffer[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
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
