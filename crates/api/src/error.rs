//! One error type for every handler, answered in the shape Daytona's SDK reads.
//!
//! [`status_for`] is the one table from an engine error's kind to an HTTP
//! status; every answer to an [`EngineError`] (the JSON API here, the S3
//! subset in `object_storage`) goes through it. The body is always
//! `{"statusCode", "message", "error"}`; the message is the error and its
//! causes on one line ([`cove_engine::describe`]). Server errors are logged
//! once, here, with that whole chain; client errors are answered, not logged.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use cove_engine::{EngineError, ErrorKind};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
}

/// The HTTP status of an engine error of `kind`.
pub(crate) fn status_for(kind: ErrorKind) -> StatusCode {
    match kind {
        ErrorKind::NotFound => StatusCode::NOT_FOUND,
        ErrorKind::BadRequest => StatusCode::BAD_REQUEST,
        ErrorKind::Forbidden => StatusCode::FORBIDDEN,
        ErrorKind::Conflict => StatusCode::CONFLICT,
        ErrorKind::NotImplemented => StatusCode::NOT_IMPLEMENTED,
        ErrorKind::BadGateway => StatusCode::BAD_GATEWAY,
        ErrorKind::ServiceUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// Logs an engine error answered with a server error status, with its whole
/// chain (`message`); a client error is the client's to act on.
pub(crate) fn log_answered(status: StatusCode, message: &str) {
    if status == StatusCode::INTERNAL_SERVER_ERROR || status == StatusCode::BAD_GATEWAY {
        tracing::error!(error = %message, status = status.as_u16(), "request failed");
    } else if status == StatusCode::SERVICE_UNAVAILABLE {
        tracing::warn!(error = %message, status = status.as_u16(), "request refused for now");
    }
}

impl From<EngineError> for ApiError {
    fn from(error: EngineError) -> ApiError {
        let status = status_for(error.kind());
        let message = cove_engine::describe(&error);
        log_answered(status, &message);
        ApiError { status, message }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "statusCode": self.status.as_u16(),
            "message": self.message,
            "error": self.status.canonical_reason().unwrap_or("Error"),
        });
        (self.status, Json(body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cove_runtime::RuntimeError;

    fn runtime(source: RuntimeError) -> EngineError {
        EngineError::runtime("sb1", "start")(source)
    }

    #[test]
    fn every_kind_has_its_status() {
        let table = [
            (ErrorKind::NotFound, 404),
            (ErrorKind::BadRequest, 400),
            (ErrorKind::Forbidden, 403),
            (ErrorKind::Conflict, 409),
            (ErrorKind::NotImplemented, 501),
            (ErrorKind::BadGateway, 502),
            (ErrorKind::ServiceUnavailable, 503),
            (ErrorKind::Internal, 500),
        ];
        for (kind, status) in table {
            assert_eq!(status_for(kind).as_u16(), status, "{kind:?}");
        }
    }

    #[test]
    fn runtime_kinds_reach_the_client_as_statuses() {
        let id = || "sb1".to_owned();
        let cases = [
            (RuntimeError::AlreadyRunning { id: id() }, 409),
            (RuntimeError::NotRunning { id: id() }, 409),
            (
                RuntimeError::Running {
                    id: id(),
                    action: "be restored",
                },
                409,
            ),
            (
                RuntimeError::Unsupported {
                    id: id(),
                    what: "pause".into(),
                    why: "by this sandbox class".into(),
                },
                501,
            ),
            (
                RuntimeError::Busy {
                    id: id(),
                    reason: "every id range is in use".into(),
                },
                503,
            ),
            (
                RuntimeError::Io {
                    id: id(),
                    action: "spawn the shim".into(),
                    source: std::io::Error::from(std::io::ErrorKind::NotFound),
                },
                500,
            ),
        ];
        for (error, status) in cases {
            assert_eq!(ApiError::from(runtime(error)).status.as_u16(), status);
        }
    }

    #[test]
    fn the_message_carries_the_cause_and_the_body_keeps_its_shape() {
        let error = ApiError::from(runtime(RuntimeError::Io {
            id: "sb1".into(),
            action: "spawn the shim".into(),
            // ENOENT: "No such file or directory (os error 2)".
            source: std::io::Error::from_raw_os_error(2),
        }));
        assert_eq!(error.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(
            error
                .message
                .starts_with("sandbox sb1 could not start: sandbox sb1: spawn the shim: "),
            "{}",
            error.message
        );
        assert!(error.message.contains("os error 2"), "{}", error.message);

        let conflict = ApiError::from(runtime(RuntimeError::AlreadyRunning { id: "sb1".into() }));
        assert_eq!(
            conflict.message,
            "sandbox sb1 could not start: sandbox sb1 is already running"
        );
        let response = conflict.into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        let body = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(http_body_util::BodyExt::collect(response.into_body()))
            .unwrap()
            .to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "statusCode": 409,
                "message": "sandbox sb1 could not start: sandbox sb1 is already running",
                "error": "Conflict",
            })
        );
    }
}
