//! Object storage for build contexts, as the SDK's `Image` builder uses it.
//!
//! `GET /api/object-storage/push-access` hands out temporary credentials and
//! where to use them; the SDK then speaks S3 to that URL (`obstore`):
//! `HEAD` to see whether a context is already there, then `PUT`, or a
//! multipart upload (`POST ?uploads`, `PUT ?partNumber&uploadId`, `POST
//! ?uploadId`) for large ones. cove serves that subset of S3 itself under
//! `/object-storage/{bucket}/{key}`, checking each request's SigV4
//! signature against the issued secret; the engine keeps the objects and
//! bounds them: a context over the size limit answers S3's
//! `EntityTooLarge` (400), and nothing of it stays on disk.
//!
//! The SDK's S3 client refuses plain HTTP, so the storage URL must be
//! HTTPS: cove's own TLS listener (`serve --tls-listen`), or a public URL
//! behind a TLS proxy (`--public-url https://...`). Without either,
//! push-access answers 501 saying so.

mod sigv4;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cove_engine::{EngineError, PushGrant};
use serde::{Deserialize, Serialize};

use crate::{ApiError, AppState};

/// The one bucket build contexts go to.
pub(crate) const BUCKET: &str = "cove-build-contexts";
/// SigV4 needs a region; there is one.
const REGION: &str = "us-east-1";
/// A `CompleteMultipartUpload` body is a list of part numbers and ETags.
const MAX_COMPLETE_BYTES: usize = 4 << 20;

/// `StorageAccessDto`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct StorageAccess {
    access_key: String,
    secret: String,
    session_token: String,
    storage_url: String,
    organization_id: String,
    bucket: &'static str,
    region: &'static str,
}

/// The HTTPS URL the S3 routes are reached at, if there is one.
fn storage_url(state: &AppState, headers: &HeaderMap) -> Option<String> {
    if let Some(public) = &state.config.public_url {
        if public.starts_with("https://") {
            return Some(format!("{}/object-storage", public.trim_end_matches('/')));
        }
    }
    let port = state.config.tls_port?;
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    // The host without its port (an IPv6 literal keeps its brackets).
    let name = match host.rsplit_once(':') {
        Some((name, port)) if !port.contains(']') => name,
        _ => host,
    };
    Some(format!("https://{name}:{port}/object-storage"))
}

/// `GET /api/object-storage/push-access`.
pub(crate) async fn push_access(
    State(state): State<AppState>,
    axum::Extension(caller): axum::Extension<cove_engine::Caller>,
    headers: HeaderMap,
) -> Result<Json<StorageAccess>, ApiError> {
    let Some(storage_url) = storage_url(&state, &headers) else {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "object storage for build contexts (COPY/ADD files) needs HTTPS, because the \
             SDK's S3 client refuses plain HTTP: start cove with --tls-listen, --tls-cert and \
             --tls-key, or serve it behind TLS with --public-url https://...",
        ));
    };
    let grant = state
        .engine
        .snapshots()
        .issue_push_grant(&caller.organization_id)?;
    Ok(Json(StorageAccess {
        access_key: grant.access_key,
        secret: grant.secret,
        session_token: grant.session_token,
        storage_url,
        organization_id: caller.organization_id,
        bucket: BUCKET,
        region: REGION,
    }))
}

/// An S3 error: XML with a code, as S3 clients read it.
pub(crate) struct S3Error {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl S3Error {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> S3Error {
        S3Error {
            status,
            code,
            message: message.into(),
        }
    }
}

impl From<EngineError> for S3Error {
    fn from(error: EngineError) -> S3Error {
        // The status is the API's, from the error's kind; the code is S3's
        // name for it, which S3 clients act on.
        let status = crate::error::status_for(error.kind());
        let code = match (&error, status) {
            // S3's own answer to an object over its size limit, which S3
            // clients report as such rather than retry.
            (EngineError::ContextTooLarge { .. }, _) => "EntityTooLarge",
            (EngineError::TooManyUploads { .. }, _) => "TooManyUploads",
            (_, StatusCode::BAD_REQUEST) => "InvalidArgument",
            (_, StatusCode::NOT_FOUND) => "NoSuchKey",
            (_, StatusCode::NOT_IMPLEMENTED) => "NotImplemented",
            (_, StatusCode::CONFLICT) => "OperationAborted",
            (_, StatusCode::SERVICE_UNAVAILABLE) => "ServiceUnavailable",
            _ => "InternalError",
        };
        let message = cove_engine::describe(&error);
        crate::error::log_answered(status, &message);
        S3Error::new(status, code, message)
    }
}

fn escape(text: &str) -> String {
    quick_xml::escape::escape(text).into_owned()
}

fn xml(status: StatusCode, body: String) -> Response {
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/xml")],
        format!("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n{body}"),
    )
        .into_response()
}

impl IntoResponse for S3Error {
    fn into_response(self) -> Response {
        xml(
            self.status,
            format!(
                "<Error><Code>{}</Code><Message>{}</Message></Error>",
                self.code,
                escape(&self.message)
            ),
        )
    }
}

/// The grant a request is signed with, once its signature checks out.
fn authenticate(
    state: &AppState,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<PushGrant, S3Error> {
    let forbidden = |r: sigv4::Refusal| S3Error::new(StatusCode::FORBIDDEN, r.code, r.message);
    let auth = sigv4::parse_authorization(headers).map_err(forbidden)?;
    let grant = state
        .engine
        .snapshots()
        .push_grant(&auth.access_key)
        .ok_or_else(|| {
            S3Error::new(
                StatusCode::FORBIDDEN,
                "InvalidAccessKeyId",
                "unknown or expired access key; ask /api/object-storage/push-access again",
            )
        })?;
    let token = headers
        .get("x-amz-security-token")
        .and_then(|t| t.to_str().ok());
    if token != Some(grant.session_token.as_str()) {
        return Err(S3Error::new(
            StatusCode::FORBIDDEN,
            "InvalidToken",
            "the session token is not the one issued with this access key",
        ));
    }
    let now = cove_engine::now_ms() / 1000;
    sigv4::verify(&auth, &grant.secret, method, uri, headers, now).map_err(forbidden)?;
    Ok(grant)
}

/// The payload checksum a request was signed with, if any.
fn declared_sha256(headers: &HeaderMap) -> Result<cove_engine::DeclaredSha256, S3Error> {
    let value = headers
        .get("x-amz-content-sha256")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("UNSIGNED-PAYLOAD");
    if value == "UNSIGNED-PAYLOAD" {
        return Ok(None);
    }
    let bad = || {
        S3Error::new(
            StatusCode::NOT_IMPLEMENTED,
            "NotImplemented",
            format!("x-amz-content-sha256 {value}: send the payload's SHA-256 or UNSIGNED-PAYLOAD"),
        )
    };
    if value.len() != 64 {
        return Err(bad());
    }
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&value[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(Some(digest))
}

/// The query parameters of the S3 operations served.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ObjectQuery {
    uploads: Option<String>,
    #[serde(rename = "uploadId")]
    upload_id: Option<String>,
    #[serde(rename = "partNumber")]
    part_number: Option<String>,
}

fn with_etag(etag: &str) -> Response {
    let mut response = StatusCode::OK.into_response();
    if let Ok(value) = HeaderValue::from_str(&format!("\"{etag}\"")) {
        response
            .headers_mut()
            .insert(axum::http::header::ETAG, value);
    }
    response
}

/// `CompleteMultipartUpload`'s body.
#[derive(Debug, Deserialize)]
struct CompleteMultipartUpload {
    #[serde(rename = "Part", default)]
    parts: Vec<CompletedPart>,
}

#[derive(Debug, Deserialize)]
struct CompletedPart {
    #[serde(rename = "PartNumber")]
    number: u32,
}

/// Every S3 request on an object: `/object-storage/{bucket}/{*key}`.
pub(crate) async fn object(
    State(state): State<AppState>,
    Path((bucket, key)): Path<(String, String)>,
    Query(query): Query<ObjectQuery>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, S3Error> {
    let grant = authenticate(&state, &method, &uri, &headers)?;
    if bucket != BUCKET {
        return Err(S3Error::new(
            StatusCode::NOT_FOUND,
            "NoSuchBucket",
            format!("bucket {bucket} does not exist; build contexts go to {BUCKET}"),
        ));
    }
    let engine = &state.engine;
    match (&method, &query) {
        (&Method::HEAD, _) => match engine.snapshots().head_context(&grant, &key).await? {
            None => Ok(StatusCode::NOT_FOUND.into_response()),
            Some(object) => {
                let modified = time::OffsetDateTime::from_unix_timestamp(object.modified_ms / 1000)
                    .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
                let format = time::macros::format_description!(
                    "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
                );
                let mut response = with_etag(&object.etag);
                let headers = response.headers_mut();
                headers.insert(axum::http::header::CONTENT_LENGTH, object.size.into());
                if let Ok(value) = modified
                    .format(&format)
                    .map_err(|_| ())
                    .and_then(|t| HeaderValue::from_str(&t).map_err(|_| ()))
                {
                    headers.insert(axum::http::header::LAST_MODIFIED, value);
                }
                Ok(response)
            }
        },
        (
            &Method::PUT,
            ObjectQuery {
                upload_id: Some(upload),
                part_number: Some(number),
                ..
            },
        ) => {
            let number = number.parse().map_err(|_| {
                S3Error::new(
                    StatusCode::BAD_REQUEST,
                    "InvalidArgument",
                    "partNumber must be a number",
                )
            })?;
            let declared = declared_sha256(&headers)?;
            let etag = engine
                .snapshots()
                .put_context_part(
                    &grant,
                    &key,
                    upload,
                    number,
                    body.into_data_stream(),
                    declared,
                )
                .await?;
            Ok(with_etag(&etag))
        }
        (
            &Method::PUT,
            ObjectQuery {
                upload_id: None,
                part_number: None,
                ..
            },
        ) => {
            let declared = declared_sha256(&headers)?;
            let etag = engine
                .snapshots()
                .put_context(&grant, &key, body.into_data_stream(), declared)
                .await?;
            Ok(with_etag(&etag))
        }
        (
            &Method::POST,
            ObjectQuery {
                uploads: Some(_), ..
            },
        ) => {
            let upload = engine
                .snapshots()
                .start_context_upload(&grant, &key)
                .await?;
            Ok(xml(
                StatusCode::OK,
                format!(
                    "<InitiateMultipartUploadResult><Bucket>{BUCKET}</Bucket><Key>{}</Key>\
                     <UploadId>{upload}</UploadId></InitiateMultipartUploadResult>",
                    escape(&key)
                ),
            ))
        }
        (
            &Method::POST,
            ObjectQuery {
                upload_id: Some(upload),
                ..
            },
        ) => {
            let bytes = axum::body::to_bytes(body, MAX_COMPLETE_BYTES)
                .await
                .map_err(|e| {
                    S3Error::new(StatusCode::BAD_REQUEST, "MalformedXML", e.to_string())
                })?;
            let text = String::from_utf8_lossy(&bytes);
            let complete: CompleteMultipartUpload =
                quick_xml::de::from_str(&text).map_err(|e| {
                    S3Error::new(StatusCode::BAD_REQUEST, "MalformedXML", e.to_string())
                })?;
            let parts: Vec<u32> = complete.parts.iter().map(|p| p.number).collect();
            let etag = engine
                .snapshots()
                .complete_context_upload(&grant, &key, upload, &parts)
                .await?;
            Ok(xml(
                StatusCode::OK,
                format!(
                    "<CompleteMultipartUploadResult><Bucket>{BUCKET}</Bucket><Key>{}</Key>\
                     <ETag>\"{etag}\"</ETag></CompleteMultipartUploadResult>",
                    escape(&key)
                ),
            ))
        }
        (
            &Method::DELETE,
            ObjectQuery {
                upload_id: Some(upload),
                ..
            },
        ) => {
            engine
                .snapshots()
                .abort_context_upload(&grant, &key, upload)
                .await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        _ => Err(S3Error::new(
            StatusCode::NOT_IMPLEMENTED,
            "NotImplemented",
            format!(
                "{method} {} is not served: cove's object storage takes build-context uploads \
                 (HEAD, PUT and multipart uploads) only",
                uri.path()
            ),
        )),
    }
}

/// A request on a bucket rather than an object (listing, ...): not served.
pub(crate) async fn bucket(method: Method, uri: Uri) -> S3Error {
    S3Error::new(
        StatusCode::NOT_IMPLEMENTED,
        "NotImplemented",
        format!(
            "{method} {} is not served: cove's object storage takes build-context uploads only",
            uri.path()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oversized_context_is_s3s_entity_too_large() {
        let error = S3Error::from(EngineError::ContextTooLarge {
            key: "cove/abc/context.tar".into(),
            limit_bytes: 10,
        });
        assert_eq!(error.status, StatusCode::BAD_REQUEST);
        assert_eq!(error.code, "EntityTooLarge");
        assert!(error.message.contains("10 bytes"), "{}", error.message);
    }
}
