//! What can go wrong in an operation, worded for the user who asked for it.
//!
//! [`EngineError`] keeps the cause of a failure as its `#[source]` (a
//! runtime's [`RuntimeError`], the network's, the archive's, the store's),
//! and [`EngineError::kind`] says how a front end should answer it, from the
//! kind of that cause where it has one: a runtime's "already running" is a
//! conflict, its "not supported" not implemented, and a host out of
//! something for the moment unavailable. [`describe`] is the whole chain as
//! one line, for messages and logs.

use std::path::PathBuf;

use cove_lifecycle::{SandboxState, TimerSettingsError, TransitionError};
use cove_net::NetError;
use cove_runtime::RuntimeError;

use crate::archive::ArchiveError;

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
    #[error("this API key lacks the permission {permission}")]
    Forbidden { permission: &'static str },
    /// A sandbox would take its organization past a quota.
    #[error("{message}")]
    QuotaExceeded {
        quota: &'static str,
        limit: i64,
        message: String,
    },
    #[error("organization {id} not found")]
    OrganizationNotFound { id: String },
    #[error("an organization named {name} already exists")]
    OrganizationTaken { name: String },
    /// An organization that cannot be deleted, and why.
    #[error("{message}")]
    OrganizationInUse { message: String },
    #[error("API key {name} not found")]
    ApiKeyNotFound { name: String },
    #[error("an API key named {name} already exists")]
    ApiKeyTaken { name: String },
    #[error("API key {name} is the server operator's; it cannot be deleted")]
    OperatorKey { name: String },
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
    #[error("runner {id} not found")]
    RunnerNotFound { id: String },
    /// The sandbox's runner was deleted as lost, and its storage with it.
    #[error(
        "sandbox {id} was on runner {runner}, which was deleted as lost, and its files with \
         it; delete the sandbox, or create another from a snapshot of it"
    )]
    RunnerLost { id: String, runner: String },
    /// An archived sandbox is kept in the archive, on no runner.
    #[error("sandbox {id} is archived, so it is on no runner; a start places it on one")]
    OnNoRunner { id: String },
    /// A runner asked for an image no sandbox placed on it uses (or that
    /// this server does not hold): the same answer either way.
    #[error(
        "no sandbox placed on this runner uses the image at {image} under the images directory"
    )]
    ImageNotServed { image: String },
    /// A runner asked for a captured layer no sandbox placed on it uses:
    /// the same answer whether or not the capture exists.
    #[error("no sandbox placed on this runner uses the captured layer {capture}")]
    LayerNotServed { capture: String },
    /// The captured layer a runner asked for could not be sent.
    #[error("cannot send captured layer {capture}: {reason}")]
    LayerSend { capture: String, reason: String },
    #[error("a runner named {name} already exists")]
    RunnerTaken { name: String },
    /// A runner that cannot be deleted: the server's own, or one holding
    /// sandboxes.
    #[error("{message}")]
    RunnerInUse { message: String },
    /// A sandbox's runner is on another machine and has not reported its
    /// service since this server started (or stopped serving).
    #[error(
        "runner {id}, on another machine, has not reported where it serves since this \
         server started; its sandboxes are out of reach until it does"
    )]
    RunnerAway { id: String },
    /// Placement found no runner that may take the sandbox now.
    #[error("no runner can take this sandbox now: {reason}")]
    NoRunner { reason: String },
    #[error("{what} is not implemented by cove yet")]
    NotImplemented { what: String },
    /// The sandbox's runtime failed; its error says how (the message shows
    /// it too, for whoever prints only the top; `describe` repeats nothing).
    #[error("sandbox {id} could not {operation}: {source}")]
    Runtime {
        id: String,
        operation: &'static str,
        #[source]
        source: RuntimeError,
    },
    /// The sandbox network failed at `step` of the operation.
    #[error("sandbox {id} could not {operation}: {step}: {source}")]
    Network {
        id: String,
        operation: &'static str,
        step: &'static str,
        #[source]
        source: NetError,
    },
    /// The snapshot holding the sandbox's layers went away under it.
    #[error("sandbox {id} could not {operation}: its snapshot {snapshot} no longer exists")]
    SnapshotGone {
        id: String,
        operation: &'static str,
        snapshot: String,
    },
    /// A volume's storage (its btrfs subvolume and quota) failed.
    #[error("volume {id} could not {operation}: {source}")]
    VolumeStorage {
        id: String,
        operation: &'static str,
        #[source]
        source: cove_runtime::storage::StorageError,
    },
    /// The archive (object storage) failed.
    #[error("sandbox {id} could not {operation}: {source}")]
    Archive {
        id: String,
        operation: &'static str,
        #[source]
        source: ArchiveError,
    },
    /// Work handed to a task of its own panicked or was cancelled.
    #[error("{what} {id} could not {operation}: its task failed")]
    Task {
        /// What `id` names: a sandbox, a snapshot.
        what: &'static str,
        id: String,
        operation: &'static str,
        #[source]
        source: tokio::task::JoinError,
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
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl EngineError {
    /// `action` on `path` failed with the error given to the closure.
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> EngineError {
        let path = path.into();
        move |source| EngineError::Io {
            action,
            path,
            source,
        }
    }

    /// Sandbox `id`'s runtime failed to do `operation`.
    pub fn runtime(id: &str, operation: &'static str) -> impl FnOnce(RuntimeError) -> EngineError {
        let id = id.to_owned();
        move |source| EngineError::Runtime {
            id,
            operation,
            source,
        }
    }
}

/// `error` and every cause under it, on one line: the top's message, then
/// each source not already part of what is written (some messages include
/// their cause).
pub fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !text.is_empty() && !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    line
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
    /// The caller's key lacks a permission the request needs.
    Forbidden,
    Conflict,
    NotImplemented,
    /// Something cove depends on (a registry) failed.
    BadGateway,
    /// The host is out of something for the moment (id ranges, addresses);
    /// the same request may succeed later.
    ServiceUnavailable,
    Internal,
}

/// How to answer a runtime's error, by its kind.
fn runtime_kind(error: &RuntimeError) -> ErrorKind {
    match error {
        RuntimeError::NotRunning { .. }
        | RuntimeError::AlreadyRunning { .. }
        | RuntimeError::Running { .. } => ErrorKind::Conflict,
        RuntimeError::Unsupported { .. } => ErrorKind::NotImplemented,
        error if error.is_transient() => ErrorKind::ServiceUnavailable,
        _ => ErrorKind::Internal,
    }
}

/// How to answer the network's error, by its kind.
fn network_kind(error: &NetError) -> ErrorKind {
    match error {
        NetError::Policy(_) => ErrorKind::BadRequest,
        NetError::Busy { .. } | NetError::RangeFull { .. } => ErrorKind::ServiceUnavailable,
        _ => ErrorKind::Internal,
    }
}

impl EngineError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::SandboxNotFound { .. }
            | Self::SnapshotNotFound { .. }
            | Self::VolumeNotFound { .. }
            | Self::RegistryNotFound { .. }
            | Self::ApiKeyNotFound { .. }
            | Self::OrganizationNotFound { .. }
            | Self::RunnerNotFound { .. }
            | Self::ImageNotServed { .. }
            | Self::LayerNotServed { .. }
            | Self::OnNoRunner { .. }
            | Self::SignedPreviewNotFound { .. } => ErrorKind::NotFound,
            Self::Forbidden { .. } | Self::QuotaExceeded { .. } => ErrorKind::Forbidden,
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
            | Self::ApiKeyTaken { .. }
            | Self::OrganizationTaken { .. }
            | Self::OrganizationInUse { .. }
            | Self::RunnerTaken { .. }
            | Self::RunnerInUse { .. }
            | Self::OperatorKey { .. }
            | Self::SnapshotTaken { .. }
            | Self::VolumeTaken { .. }
            | Self::HasVolumes { .. }
            | Self::InUse { .. }
            | Self::NotPersistent { .. }
            | Self::HasForks { .. }
            | Self::Transition { .. }
            | Self::RunnerLost { .. }
            | Self::NotStarted { .. } => ErrorKind::Conflict,
            Self::NoRunner { .. } | Self::RunnerAway { .. } => ErrorKind::ServiceUnavailable,
            Self::ClassUnavailable { .. } | Self::NotImplemented { .. } => {
                ErrorKind::NotImplemented
            }
            Self::Image { status, .. } => match status {
                404 => ErrorKind::NotFound,
                400 | 401 | 422 => ErrorKind::BadRequest,
                502 => ErrorKind::BadGateway,
                _ => ErrorKind::Internal,
            },
            Self::Runtime { source, .. } => runtime_kind(source),
            Self::Network { source, .. } => network_kind(source),
            Self::Archive {
                source: ArchiveError::NotConfigured,
                ..
            } => ErrorKind::NotImplemented,
            Self::Archive { .. }
            | Self::SnapshotGone { .. }
            | Self::VolumeStorage { .. }
            | Self::Task { .. }
            | Self::Store(_)
            | Self::Io { .. }
            | Self::LayerSend { .. } => ErrorKind::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    fn runtime(source: RuntimeError) -> EngineError {
        EngineError::runtime("sb1", "start")(source)
    }

    #[test]
    fn runtime_errors_are_classified_by_their_kind() {
        let id = || "sb1".to_owned();
        let cases = [
            (
                RuntimeError::AlreadyRunning { id: id() },
                ErrorKind::Conflict,
            ),
            (RuntimeError::NotRunning { id: id() }, ErrorKind::Conflict),
            (
                RuntimeError::Running {
                    id: id(),
                    action: "be archived",
                },
                ErrorKind::Conflict,
            ),
            (
                RuntimeError::Unsupported {
                    id: id(),
                    what: "pause".into(),
                    why: "by this sandbox class".into(),
                },
                ErrorKind::NotImplemented,
            ),
            (
                RuntimeError::Busy {
                    id: id(),
                    reason: "no range".into(),
                },
                ErrorKind::ServiceUnavailable,
            ),
            (
                RuntimeError::Start {
                    id: id(),
                    reason: "no luck".into(),
                },
                ErrorKind::Internal,
            ),
        ];
        for (error, kind) in cases {
            assert_eq!(runtime(error).kind(), kind);
        }
    }

    #[test]
    fn the_source_is_kept_and_described_once() {
        let error = runtime(RuntimeError::Io {
            id: "sb1".into(),
            action: "spawn the shim".into(),
            source: std::io::Error::other("no such file"),
        });
        let source = error.source().unwrap();
        assert!(source.is::<RuntimeError>());
        assert!(source.source().unwrap().is::<std::io::Error>());
        assert_eq!(
            describe(&error),
            "sandbox sb1 could not start: sandbox sb1: spawn the shim: no such file"
        );
        // A message that already holds its cause does not repeat it.
        let timers = EngineError::Timers(TimerSettingsError::PauseAndStop);
        assert!(timers.source().is_some());
        assert_eq!(describe(&timers), timers.to_string());
    }
}
