//! `POST /files/bulk-upload` (`files[i].path` + `files[i].file` parts) and
//! `POST /files/upload-v2?path=` (one `file` part). Each file streams into a
//! temporary file next to its destination and is renamed into place only when
//! complete, so a failed upload leaves nothing behind.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use axum::extract::multipart::{Field, Multipart, MultipartError};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt as _;

use crate::error::{ApiError, Json, Query};
use crate::AppState;

#[derive(Debug, Deserialize)]
pub struct UploadQuery {
    path: String,
}

#[derive(Debug, Serialize)]
pub struct UploadedFile {
    name: String,
    path: String,
    #[serde(rename = "type")]
    content_type: String,
}

/// An upload failure; the SDK reads the `errors` list of the body.
pub struct UploadError(ApiError);

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

pub async fn bulk_upload(
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

pub async fn upload_v2(
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
    let mut file = tokio::fs::File::create(&temporary)
        .await
        .map_err(|e| ApiError::io(destination, e))?;
    let written = async {
        while let Some(chunk) = field.chunk().await.map_err(malformed)? {
            file.write_all(&chunk)
                .await
                .map_err(|e| ApiError::io(destination, e))?;
        }
        file.flush()
            .await
            .map_err(|e| ApiError::io(destination, e))?;
        drop(file);
        tokio::fs::rename(&temporary, destination)
            .await
            .map_err(|e| ApiError::io(destination, e))
    }
    .await;
    if written.is_err() {
        let _ = tokio::fs::remove_file(&temporary).await;
    }
    written
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
