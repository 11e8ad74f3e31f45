//! One error type for every handler, answered in the shape Daytona's SDK reads.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use cove_engine::EngineError;

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

impl From<EngineError> for ApiError {
    fn from(error: EngineError) -> ApiError {
        use cove_engine::ErrorKind;
        let status = match error.kind() {
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::BadRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Conflict => StatusCode::CONFLICT,
            ErrorKind::NotImplemented => StatusCode::NOT_IMPLEMENTED,
            ErrorKind::BadGateway => StatusCode::BAD_GATEWAY,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let mut message = error.to_string();
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            // Internal errors are logged once, here, with their whole chain.
            let mut source = std::error::Error::source(&error);
            while let Some(cause) = source {
                message.push_str(": ");
                message.push_str(&cause.to_string());
                source = cause.source();
            }
            tracing::error!(error = %message, "request failed");
        }
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
