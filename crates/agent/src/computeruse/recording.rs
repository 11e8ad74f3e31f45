//! Screen recordings (`/computeruse/recordings*`): ffmpeg grabbing the X
//! display into an MP4 file in the sandbox (`~/.cove/recordings`), stopped
//! by asking ffmpeg to finish (so the file is whole and playable).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::{Deserialize, Serialize};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tokio::io::AsyncWriteExt as _;
use tokio::sync::Mutex;

use crate::error::{ApiError, Json};
use crate::AppState;

/// Most recordings running at once.
const MAX_ACTIVE: usize = 2;
/// Frames per second recorded: enough to follow an agent's actions.
const FRAME_RATE: &str = "10";
/// How long ffmpeg has to begin its file.
const STARTING: Duration = Duration::from_secs(60);
/// How long ffmpeg has to write the end of its file once asked to stop.
const FINISH: Duration = Duration::from_secs(15);

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/computeruse/recordings", get(list))
        .route("/computeruse/recordings/start", post(start))
        .route("/computeruse/recordings/stop", post(stop))
        .route("/computeruse/recordings/{id}", get(one).delete(delete))
        .route("/computeruse/recordings/{id}/download", get(download))
}

#[derive(Debug, Deserialize)]
pub struct StartRecordingRequest {
    label: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct StopRecordingRequest {
    id: Option<String>,
}

/// `Recording` of the SDK.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Recording {
    id: String,
    file_name: String,
    file_path: String,
    start_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    end_time: Option<String>,
    /// `recording`, `completed` or `failed`.
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    duration_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    size_bytes: Option<u64>,
}

struct Entry {
    recording: Recording,
    started: Instant,
    ffmpeg: Option<tokio::process::Child>,
}

/// Every recording this agent made, by id.
pub struct Recordings {
    dir: PathBuf,
    entries: Mutex<BTreeMap<String, Entry>>,
}

impl Recordings {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            entries: Mutex::new(BTreeMap::new()),
        }
    }

    /// Finishes every running recording (the desktop is stopping).
    pub async fn stop_all(&self) {
        let mut entries = self.entries.lock().await;
        for entry in entries.values_mut() {
            finish(entry).await;
        }
    }
}

fn now() -> String {
    OffsetDateTime::now_utc()
        .format(&Rfc3339)
        .unwrap_or_default()
}

/// Asks ffmpeg to end its file (`q` on its input), then waits; kills it only
/// if it does not finish in time.
async fn finish(entry: &mut Entry) {
    let Some(mut ffmpeg) = entry.ffmpeg.take() else {
        return;
    };
    if let Some(mut stdin) = ffmpeg.stdin.take() {
        let _ = stdin.write_all(b"q").await;
        let _ = stdin.flush().await;
    }
    let status = match tokio::time::timeout(FINISH, ffmpeg.wait()).await {
        Ok(status) => status.ok(),
        Err(_) => {
            let _ = ffmpeg.kill().await;
            None
        }
    };
    let recording = &mut entry.recording;
    recording.end_time = Some(now());
    recording.duration_seconds = Some(entry.started.elapsed().as_secs_f64());
    let size = std::fs::metadata(&recording.file_path)
        .map(|m| m.len())
        .ok();
    recording.size_bytes = size;
    recording.status = match (status, size) {
        (Some(s), Some(n)) if s.success() && n > 0 => "completed",
        _ => "failed",
    };
}

/// A label that is safe inside a file name.
fn file_label(label: Option<&str>) -> String {
    let cleaned: String = label
        .unwrap_or("recording")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    if cleaned.is_empty() {
        "recording".into()
    } else {
        cleaned
    }
}

async fn start(
    State(state): State<AppState>,
    Json(request): Json<StartRecordingRequest>,
) -> Result<Response, ApiError> {
    let session = state.desktop.session()?;
    let ffmpeg = super::find_program("ffmpeg").map_err(|_| ApiError::FfmpegMissing)?;
    let (width, height) = state
        .desktop
        .with_screen(|s| Ok((s.width, s.height)))
        .await?;
    let recordings = &state.desktop.recordings;
    let mut entries = recordings.entries.lock().await;
    if entries.values().filter(|e| e.ffmpeg.is_some()).count() >= MAX_ACTIVE {
        return Err(ApiError::LimitReached {
            what: "recordings running at once",
            limit: MAX_ACTIVE,
        });
    }
    std::fs::create_dir_all(&recordings.dir).map_err(|e| ApiError::io(&recordings.dir, e))?;
    let id = uuid::Uuid::new_v4().to_string();
    let stamp = OffsetDateTime::now_utc().unix_timestamp();
    let file_name = format!(
        "{}_{stamp}_{}.mp4",
        file_label(request.label.as_deref()),
        &id[..8]
    );
    let file_path = recordings.dir.join(&file_name);
    // x264 needs even sides.
    let size = format!("{}x{}", width & !1, height & !1);
    let child = tokio::process::Command::new(ffmpeg)
        .args(["-hide_banner", "-loglevel", "error", "-y"])
        .args([
            "-f",
            "x11grab",
            "-framerate",
            FRAME_RATE,
            "-video_size",
            &size,
        ])
        .arg("-i")
        .arg(&session.display)
        .args([
            "-c:v",
            "libx264",
            "-preset",
            "ultrafast",
            "-pix_fmt",
            "yuv420p",
        ])
        .args(["-movflags", "+faststart"])
        .arg(&file_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| ApiError::Desktop(format!("could not start ffmpeg: {e}")))?;
    let child = capturing(child, &file_path).await?;
    let recording = Recording {
        id: id.clone(),
        file_name,
        file_path: file_path.display().to_string(),
        start_time: now(),
        end_time: None,
        status: "recording",
        duration_seconds: None,
        size_bytes: None,
    };
    entries.insert(
        id,
        Entry {
            recording: recording.clone(),
            started: Instant::now(),
            ffmpeg: Some(child),
        },
    );
    Ok((StatusCode::CREATED, Json(recording)).into_response())
}

/// Waits until ffmpeg has opened the display and begun its file, so the
/// recording covers what happens after `start` answers (ffmpeg takes a
/// while to start where the CPU is emulated).
async fn capturing(
    mut ffmpeg: tokio::process::Child,
    file: &std::path::Path,
) -> Result<tokio::process::Child, ApiError> {
    let deadline = Instant::now() + STARTING;
    loop {
        if std::fs::metadata(file).is_ok_and(|m| m.len() > 0) {
            return Ok(ffmpeg);
        }
        if let Ok(Some(status)) = ffmpeg.try_wait() {
            return Err(ApiError::Desktop(format!(
                "ffmpeg could not record the display ({status})"
            )));
        }
        if Instant::now() > deadline {
            let _ = ffmpeg.kill().await;
            return Err(ApiError::Desktop(format!(
                "ffmpeg did not begin recording within {}s",
                STARTING.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn stop(
    State(state): State<AppState>,
    Json(request): Json<StopRecordingRequest>,
) -> Result<Json<Recording>, ApiError> {
    let id = request
        .id
        .ok_or_else(|| ApiError::BadRequest("id is required".into()))?;
    let mut entries = state.desktop.recordings.entries.lock().await;
    let entry = entries
        .get_mut(&id)
        .ok_or_else(|| ApiError::RecordingNotFound(id.clone()))?;
    if entry.ffmpeg.is_none() {
        return Err(ApiError::BadRequest(format!(
            "recording {id} is not running"
        )));
    }
    finish(entry).await;
    Ok(Json(entry.recording.clone()))
}

#[derive(Serialize)]
struct List {
    recordings: Vec<Recording>,
}

async fn list(State(state): State<AppState>) -> Json<List> {
    let entries = state.desktop.recordings.entries.lock().await;
    Json(List {
        recordings: entries.values().map(|e| e.recording.clone()).collect(),
    })
}

async fn one(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Recording>, ApiError> {
    let entries = state.desktop.recordings.entries.lock().await;
    let entry = entries
        .get(&id)
        .ok_or_else(|| ApiError::RecordingNotFound(id.clone()))?;
    Ok(Json(entry.recording.clone()))
}

async fn delete(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<StatusCode, ApiError> {
    let mut entries = state.desktop.recordings.entries.lock().await;
    let entry = entries
        .get(&id)
        .ok_or_else(|| ApiError::RecordingNotFound(id.clone()))?;
    if entry.ffmpeg.is_some() {
        return Err(ApiError::RecordingActive(id));
    }
    let path = PathBuf::from(&entry.recording.file_path);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(ApiError::io(&path, e)),
        _ => {}
    }
    entries.remove(&id);
    Ok(StatusCode::NO_CONTENT)
}

async fn download(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Response, ApiError> {
    let path = {
        let entries = state.desktop.recordings.entries.lock().await;
        let entry = entries
            .get(&id)
            .ok_or_else(|| ApiError::RecordingNotFound(id.clone()))?;
        if entry.ffmpeg.is_some() {
            return Err(ApiError::RecordingActive(id));
        }
        entry.recording.clone()
    };
    let file = tokio::fs::File::open(&path.file_path)
        .await
        .map_err(|e| ApiError::io(std::path::Path::new(&path.file_path), e))?;
    let length = file.metadata().await.map(|m| m.len()).ok();
    let mut response = Response::new(Body::from_stream(tokio_util::io::ReaderStream::new(file)));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, "video/mp4".parse().expect("valid"));
    if let Ok(value) = format!("attachment; filename=\"{}\"", path.file_name).parse() {
        headers.insert(header::CONTENT_DISPOSITION, value);
    }
    if let Some(length) = length {
        headers.insert(header::CONTENT_LENGTH, length.into());
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_become_safe_file_names() {
        assert_eq!(file_label(Some("demo run")), "demo_run");
        assert_eq!(file_label(Some("../../etc/passwd")), "______etc_passwd");
        assert_eq!(file_label(None), "recording");
        assert_eq!(file_label(Some("")), "recording");
    }
}
