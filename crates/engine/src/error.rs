//! What can go wrong in an operation, worded for the user who asked for it.

use cove_lifecycle::{SandboxState, TimerSettingsError, TransitionError};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("sandbox {id} not found")]
    SandboxNotFound { id: String },
    #[error("sandbox {id} has no signed preview URL with this token for port {port}")]
    SignedPreviewNotFound { id: String, port: u16 },
    #[error("snapshot {name} not found")]
    SnapshotNotFound { name: String },
    #[error("snapshot {name} is {state}, not active{}", activate_hint(name, state))]
    SnapshotNotActive { name: String, state: &'static str },
    #[error("no Windows image is registered on this server, so snapshot {name} cannot be used")]
    NoWindows { name: String },
    #[error("docker registry {id} not found")]
    RegistryNotFound { id: String },
    #[error("volume {name} not found")]
    VolumeNotFound { name: String },
    #[error("a volume named {name} already exists")]
    VolumeTaken { name: String },
    #[error("sandbox {id} has volumes attached, so it cannot {action}: their files are shared and live outside its memory ({instead})")]
    HasVolumes {
        id: String,
        action: &'static str,
        instead: &'static str,
    },
    #[error("a snapshot named {name} already exists")]
    SnapshotTaken { name: String },
    #[error("{what} is in use by {}", users.join(", "))]
    InUse { what: String, users: Vec<String> },
    #[error("sandbox {id} is not persistent (ephemeral, or created with persistent false), so it cannot pause; stop it instead")]
    NotPersistent { id: String },
    #[error("sandbox {id} has active fork children ({}); delete them first", children.join(", "))]
    HasForks { id: String, children: Vec<String> },
    #[error("image {reference}: {reason}")]
    Image {
        reference: String,
        /// The HTTP status the image library suggests.
        status: u16,
        reason: String,
    },
    #[error("the image build failed: {reason}")]
    BuildFailed { reason: String },
    #[error("a sandbox named {name} already exists")]
    NameTaken { name: String },
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("{field} {requested} is above this server's ceiling of {ceiling}")]
    AboveCeiling {
        field: &'static str,
        requested: i64,
        ceiling: i64,
    },
    #[error("sandbox {id}: {source}")]
    Transition {
        id: String,
        #[source]
        source: TransitionError,
    },
    #[error("{0}")]
    Timers(#[from] TimerSettingsError),
    #[error("sandbox {id} is {state}; start it first")]
    NotStarted { id: String, state: SandboxState },
    #[error("{class} sandboxes are not available on this server")]
    ClassUnavailable { class: &'static str },
    #[error("{what} is not implemented by cove yet")]
    NotImplemented { what: String },
    #[error("sandbox {id} could not {operation}: {reason}")]
    Runtime {
        id: String,
        operation: &'static str,
        reason: String,
    },
    #[error("internal storage error")]
    Store(#[from] cove_store::StoreError),
    #[error("build context {key} is larger than this server's limit of {limit_bytes} bytes (serve --max-build-context-gib); nothing of it was kept")]
    ContextTooLarge { key: String, limit_bytes: u64 },
    #[error("{limit} uploads in parts are already in progress with these credentials; complete or abort one first")]
    TooManyUploads { limit: usize },
    #[error("import path {path:?} is refused: {reason}; images are imported only from inside this server's import directory {} (serve --import-dir), which `cove image import` copies a file into", import_dir.display())]
    OutsideImportDir {
        path: String,
        import_dir: std::path::PathBuf,
        reason: String,
    },
    /// A file on this server could not be read or written.
    #[error("{0}")]
    Io(String),
}

/// What to do about an inactive snapshot.
fn activate_hint(name: &str, state: &str) -> String {
    if state == "inactive" {
        format!("; activate it first (POST /api/snapshots/{name}/activate)")
    } else {
        String::new()
    }
}

/// How a front end should classify an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    NotFound,
    BadRequest,
    Conflict,
    NotImplemented,
    /// Something cove depends on (a registry) failed.
    BadGateway,
    Internal,
}

impl EngineError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::SandboxNotFound { .. }
            | Self::SnapshotNotFound { .. }
            | Self::VolumeNotFound { .. }
            | Self::RegistryNotFound { .. }
            | Self::SignedPreviewNotFound { .. } => ErrorKind::NotFound,
            Self::Invalid { .. }
            | Self::AboveCeiling { .. }
            | Self::Timers(_)
            | Self::NoWindows { .. }
            | Self::BuildFailed { .. }
            | Self::ContextTooLarge { .. }
            | Self::TooManyUploads { .. }
            | Self::OutsideImportDir { .. }
            | Self::SnapshotNotActive { .. } => ErrorKind::BadRequest,
            Self::Transition {
                source: TransitionError::NotSupported { .. },
                ..
            } => ErrorKind::BadRequest,
            Self::NameTaken { .. }
            | Self::SnapshotTaken { .. }
            | Self::VolumeTaken { .. }
            | Self::HasVolumes { .. }
            | Self::InUse { .. }
            | Self::NotPersistent { .. }
            | Self::HasForks { .. }
            | Self::Transition { .. }
            | Self::NotStarted { .. } => ErrorKind::Conflict,
            Self::ClassUnavailable { .. } | Self::NotImplemented { .. } => {
                ErrorKind::NotImplemented
            }
            Self::Image { status, .. } => match status {
                404 => ErrorKind::NotFound,
                400 | 401 | 422 => ErrorKind::BadRequest,
                502 => ErrorKind::BadGateway,
                _ => ErrorKind::Internal,
            },
            Self::Runtime { .. } | Self::Store(_) | Self::Io(_) => ErrorKind::Internal,
        }
    }
}
