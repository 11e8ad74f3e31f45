//! The one error type of the toolbox API and its JSON shape
//! (`{"message","statusCode","code","source":"DAYTONA_DAEMON"}`), which the SDK
//! maps to its exception classes by status and `code`.

use std::io;
use std::path::{Path, PathBuf};

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("invalid request body: {0}")]
    InvalidBody(String),
    #[error("file not found: {}", .0.display())]
    FileNotFound(PathBuf),
    #[error("permission denied: {}", .0.display())]
    AccessDenied(PathBuf),
    #[error("already exists: {}", .0.display())]
    AlreadyExists(PathBuf),
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("session not found: {0}")]
    SessionNotFound(String),
    #[error("session already exists: {0}")]
    SessionExists(String),
    #[error("session {0} has ended")]
    SessionEnded(String),
    #[error("command not found: {0}")]
    CommandNotFound(String),
    #[error("command {0} has already completed")]
    CommandCompleted(String),
    #[error("limit reached: at most {limit} {what}")]
    LimitReached { what: &'static str, limit: usize },
    #[error("no route for {0}")]
    NoRoute(String),
    /// A Daytona toolbox operation cove does not serve, as "METHOD /template".
    #[error("{0} is not implemented by cove yet")]
    NotImplemented(String),
    #[error("{context}: {source}")]
    Internal {
        context: &'static str,
        #[source]
        source: io::Error,
    },
    /// A git command failed; its class decides status and code.
    #[error(transparent)]
    Git(#[from] crate::git::GitError),
    #[error("interpreter context not found: {0}")]
    ContextNotFound(String),
    /// Nothing accepted a tunnel's connection: the client's answer, not our fault.
    #[error("nothing accepts connections on port {port} in the sandbox: {source}")]
    PortUnreachable {
        port: u16,
        #[source]
        source: io::Error,
    },
    /// `/process/code-run` for a language whose program the sandbox lacks.
    #[error("running {language} code needs {wanted} on PATH, which this sandbox does not have; install it in the image")]
    RuntimeMissing {
        language: &'static str,
        wanted: String,
    },
    /// A computer-use call while the desktop is stopped.
    #[error("the desktop is not running: start it with computer_use.start() first")]
    DesktopStopped,
    /// The X server or a desktop program failed.
    #[error("desktop: {0}")]
    Desktop(String),
    /// The image lacks a program the desktop needs.
    #[error("computer use needs {0} on PATH, which this sandbox does not have; install it in the image (cove's default image has the whole desktop)")]
    DesktopMissing(String),
    #[error("no desktop process {0}")]
    DesktopProcessNotFound(String),
    #[error("recording not found: {0}")]
    RecordingNotFound(String),
    #[error("recording {0} is still running; stop it first")]
    RecordingActive(String),
    #[error(
        "recording needs ffmpeg on PATH, which this sandbox does not have; install it in the image"
    )]
    FfmpegMissing,
    /// A `/cove/unpack` stream that was refused or failed; its kind decides.
    #[error(transparent)]
    Unpack(#[from] crate::unpack::UnpackError),
    /// An `/lsp/*` call that was refused or whose language server failed.
    #[error(transparent)]
    Lsp(#[from] crate::lsp::LspError),
    /// An accessibility request that failed; its kind decides.
    #[error(transparent)]
    A11y(#[from] crate::computeruse::a11y::A11yError),
}

impl ApiError {
    /// Classifies an I/O error on `path`: missing and forbidden paths are the
    /// client's business, anything else is ours.
    pub fn io(path: &Path, source: io::Error) -> Self {
        match source.kind() {
            io::ErrorKind::NotFound => Self::FileNotFound(path.to_path_buf()),
            io::ErrorKind::PermissionDenied => Self::AccessDenied(path.to_path_buf()),
            io::ErrorKind::AlreadyExists => Self::AlreadyExists(path.to_path_buf()),
            _ => Self::Io {
                path: path.to_path_buf(),
                source,
            },
        }
    }

    pub fn internal(context: &'static str, source: io::Error) -> Self {
        Self::Internal { context, source }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest(_) | Self::InvalidBody(_) => StatusCode::BAD_REQUEST,
            Self::FileNotFound(_)
            | Self::SessionNotFound(_)
            | Self::CommandNotFound(_)
            | Self::NoRoute(_)
            | Self::DesktopProcessNotFound(_)
            | Self::RecordingNotFound(_) => StatusCode::NOT_FOUND,
            Self::DesktopStopped | Self::RecordingActive(_) => StatusCode::CONFLICT,
            Self::Desktop(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::DesktopMissing(_) | Self::FfmpegMissing => StatusCode::UNPROCESSABLE_ENTITY,
            Self::AccessDenied(_) => StatusCode::FORBIDDEN,
            Self::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            Self::AlreadyExists(_) | Self::SessionExists(_) => StatusCode::CONFLICT,
            Self::SessionEnded(_) | Self::CommandCompleted(_) => StatusCode::GONE,
            Self::LimitReached { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Io { source, .. } if is_client_io_error(source) => StatusCode::BAD_REQUEST,
            Self::Io { .. } | Self::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Git(error) => error.failure.status(),
            Self::ContextNotFound(_) => StatusCode::NOT_FOUND,
            Self::PortUnreachable { .. } => StatusCode::BAD_GATEWAY,
            Self::RuntimeMissing { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Unpack(error) => error.status(),
            Self::Lsp(error) => error.status(),
            Self::A11y(error) => error.status(),
        }
    }

    /// The daemon error code the SDK recognises (`DaemonErrorCode` in toolbox.json).
    pub fn code(&self) -> &'static str {
        match self {
            Self::BadRequest(_) => "BAD_REQUEST",
            Self::InvalidBody(_) => "INVALID_REQUEST_BODY",
            Self::FileNotFound(_) => "FILE_NOT_FOUND",
            Self::AccessDenied(_) => "FILE_ACCESS_DENIED",
            Self::AlreadyExists(_) | Self::SessionExists(_) => "CONFLICT",
            Self::SessionNotFound(_) | Self::NoRoute(_) => "NOT_FOUND",
            Self::CommandNotFound(_) => "PROCESS_NOT_FOUND",
            Self::SessionEnded(_) => "SESSION_ENDED",
            Self::CommandCompleted(_) => "COMMAND_ALREADY_COMPLETED",
            Self::LimitReached { .. } => "TOO_MANY_REQUESTS",
            Self::Io { source, .. } if is_client_io_error(source) => "BAD_REQUEST",
            Self::Io { .. } | Self::Internal { .. } => "INTERNAL_SERVER_ERROR",
            Self::Git(error) => error.failure.code(),
            Self::ContextNotFound(_) => "NOT_FOUND",
            Self::PortUnreachable { .. } => "BAD_GATEWAY",
            Self::NotImplemented(_) => "NOT_IMPLEMENTED",
            Self::RuntimeMissing { .. } | Self::DesktopMissing(_) => "UNPROCESSABLE_ENTITY",
            Self::DesktopStopped => "CONFLICT",
            Self::Desktop(_) => "INTERNAL_SERVER_ERROR",
            Self::DesktopProcessNotFound(_) => "PROCESS_NOT_FOUND",
            Self::RecordingNotFound(_) => "NOT_FOUND",
            Self::RecordingActive(_) => "RECORDING_STILL_ACTIVE",
            Self::FfmpegMissing => "RECORDING_FFMPEG_NOT_FOUND",
            Self::Unpack(error) => error.code(),
            Self::Lsp(error) => error.code(),
            Self::A11y(error) => error.code(),
        }
    }

    /// The JSON error body, also used for the error parts of bulk downloads.
    pub fn body(&self) -> serde_json::Value {
        let status = self.status();
        serde_json::json!({
            "message": self.to_string(),
            "statusCode": status.as_u16(),
            "code": self.code(),
            "source": "DAYTONA_DAEMON",
        })
    }
}

fn is_client_io_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::NotADirectory
            | io::ErrorKind::IsADirectory
            | io::ErrorKind::DirectoryNotEmpty
            | io::ErrorKind::InvalidInput
            | io::ErrorKind::InvalidFilename
    )
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() && !matches!(self, Self::PortUnreachable { .. }) {
            tracing::error!(error = %self, "request failed");
        }
        (status, axum::Json(self.body())).into_response()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        Self::InvalidBody(rejection.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        Self::BadRequest(rejection.body_text())
    }
}

/// `axum::Json` whose rejection is an [`ApiError`] (400 in our JSON shape).
#[derive(Debug, axum::extract::FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct Json<T>(pub T);

/// `axum::extract::Query` whose rejection is an [`ApiError`].
#[derive(Debug, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct Query<T>(pub T);

impl<T: serde::Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_name_the_path_and_map_to_daemon_codes() {
        let path = Path::new("/data/x");
        let missing = ApiError::io(path, io::Error::from(io::ErrorKind::NotFound));
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
        assert_eq!(missing.body()["code"], "FILE_NOT_FOUND");
        assert!(missing.to_string().contains("/data/x"));
        let denied = ApiError::io(path, io::Error::from(io::ErrorKind::PermissionDenied));
        assert_eq!(denied.status(), StatusCode::FORBIDDEN);
        assert_eq!(denied.body()["source"], "DAYTONA_DAEMON");
        let limit = ApiError::LimitReached {
            what: "sessions",
            limit: 8,
        };
        assert_eq!(limit.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(limit.to_string(), "limit reached: at most 8 sessions");
    }
}
