//! What can go wrong in a runtime, by kind, with the sandbox it happened to.
//!
//! [`RuntimeError`] is the one error of the [`Runtime`](crate::Runtime)
//! trait. Its kinds are what a caller acts on: a sandbox that is not running,
//! already running, running where it must be stopped, an operation its class
//! does not support, the host out of something for the moment
//! ([`RuntimeError::is_transient`]), or a failure with its cause as the
//! `#[source]`, never repeated in the message. Every variant names the
//! sandbox (`-` for the runtime itself, as at its start).

use std::path::PathBuf;

use crate::container::{CgroupError, UsernsError};
use crate::storage::StorageError;
use crate::vm::{ConfineError, DiskError, MachineError, SharesError};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The operation needs the sandbox's machine running, and it is not.
    #[error("sandbox {id} is not running")]
    NotRunning { id: String },
    /// A start of a sandbox whose machine runs already.
    #[error("sandbox {id} is already running")]
    AlreadyRunning { id: String },
    /// The operation needs the sandbox stopped (its storage still).
    #[error("sandbox {id} is running, so it cannot {action}; stop it first")]
    Running { id: String, action: &'static str },
    /// The sandbox's class, or this host, does not do this.
    #[error("sandbox {id}: {what} is not supported {why}")]
    Unsupported {
        id: String,
        what: String,
        /// Where or why not, e.g. "by this sandbox class".
        why: String,
    },
    /// The host has none of something left for the moment (every id
    /// range in use); a retry once other sandboxes stop can succeed.
    #[error("sandbox {id} cannot start now: {reason}")]
    Busy { id: String, reason: String },
    /// An id that is not one plain path component.
    #[error(
        "sandbox id {id:?} is refused: an id must be 1 to 128 of [A-Za-z0-9._-] and not . or .."
    )]
    InvalidId { id: String },
    /// A file operation on the host failed.
    #[error("sandbox {id}: cannot {action} {}", path.display())]
    File {
        id: String,
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// An operating-system call failed, described by `action`.
    #[error("sandbox {id}: {action}")]
    Io {
        id: String,
        action: String,
        #[source]
        source: std::io::Error,
    },
    /// The btrfs storage refused (a subvolume, a quota, a send or receive).
    #[error("sandbox {id}: the storage could not {action}")]
    Storage {
        id: String,
        action: &'static str,
        #[source]
        source: StorageError,
    },
    /// The sandbox's cgroup could not be made, frozen, emptied or removed.
    #[error("sandbox {id}: its cgroup failed")]
    Cgroup {
        id: String,
        #[source]
        source: CgroupError,
    },
    /// The sandbox's user namespace could not be made.
    #[error("sandbox {id}: its user namespace could not be made")]
    Userns {
        id: String,
        #[source]
        source: UsernsError,
    },
    /// A VM's processes could not be confined (their ids, their cgroup,
    /// the files QEMU must read).
    #[error("sandbox {id}: its VM could not be confined")]
    Confine {
        id: String,
        #[source]
        source: ConfineError,
    },
    /// A VM's volumes could not be served (virtiofsd).
    #[error("sandbox {id}: its volumes could not be served")]
    Shares {
        id: String,
        #[source]
        source: SharesError,
    },
    /// QEMU, or QMP with it, failed to do `action`.
    #[error("sandbox {id}: the VM could not {action}")]
    Machine {
        id: String,
        action: String,
        #[source]
        source: MachineError,
    },
    /// A VM could not be brought up (launched, its agent connected, told
    /// who it is); the end of its console is what the guest said.
    #[error("sandbox {id}: the VM could not {step}; its console ends: {console}")]
    Boot {
        id: String,
        step: &'static str,
        console: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A pre-booted VM (a template, or a warm machine) could not be made
    /// or taken for the sandbox.
    #[error("sandbox {id}: a pre-booted VM could not be {step}")]
    Preboot {
        id: String,
        step: &'static str,
        #[source]
        source: Box<RuntimeError>,
    },
    /// A VM disk (a base image, a qcow2 overlay) could not be made or read.
    #[error("sandbox {id}: its disk could not be made")]
    Disk {
        id: String,
        #[source]
        source: DiskError,
    },
    /// The container init (the shim) reported that a step of building
    /// the container failed; its report names the step and the cause.
    #[error("sandbox {id} failed to start: {report}")]
    Shim { id: String, report: String },
    /// Blocking work off the async threads panicked or was cancelled.
    #[error("sandbox {id}: its {what} task failed")]
    Task {
        id: String,
        what: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
    /// A start failed for a reason with no other kind.
    #[error("sandbox {id} failed to start: {reason}")]
    Start { id: String, reason: String },
    /// A failure with no other kind.
    #[error("sandbox {id}: {reason}")]
    Other { id: String, reason: String },
}

impl RuntimeError {
    /// The sandbox the error is about (`-` for the runtime itself).
    pub fn sandbox_id(&self) -> &str {
        match self {
            Self::NotRunning { id }
            | Self::AlreadyRunning { id }
            | Self::Running { id, .. }
            | Self::Unsupported { id, .. }
            | Self::Busy { id, .. }
            | Self::InvalidId { id }
            | Self::File { id, .. }
            | Self::Io { id, .. }
            | Self::Storage { id, .. }
            | Self::Cgroup { id, .. }
            | Self::Userns { id, .. }
            | Self::Confine { id, .. }
            | Self::Shares { id, .. }
            | Self::Machine { id, .. }
            | Self::Disk { id, .. }
            | Self::Boot { id, .. }
            | Self::Preboot { id, .. }
            | Self::Shim { id, .. }
            | Self::Task { id, .. }
            | Self::Start { id, .. }
            | Self::Other { id, .. } => id,
        }
    }

    /// Whether the same request may succeed later without any change by
    /// the caller: the host was out of something for the moment.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Busy { .. } => true,
            Self::Confine { source, .. } => source.is_exhausted(),
            Self::Shares {
                source: SharesError::Jail(source),
                ..
            } => source.is_exhausted(),
            Self::Preboot { source, .. } => source.is_transient(),
            _ => false,
        }
    }

    /// `action` on `path` failed with the error given to the closure.
    pub(crate) fn file(
        id: &str,
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> RuntimeError {
        let (id, path) = (id.to_owned(), path.into());
        move |source| RuntimeError::File {
            id,
            action,
            path,
            source,
        }
    }

    /// The storage failed to do `action`.
    pub(crate) fn storage(
        id: &str,
        action: &'static str,
    ) -> impl FnOnce(StorageError) -> RuntimeError {
        let id = id.to_owned();
        move |source| RuntimeError::Storage { id, action, source }
    }

    /// QEMU failed to do `action`.
    pub(crate) fn machine(
        id: &str,
        action: impl Into<String>,
    ) -> impl FnOnce(MachineError) -> RuntimeError {
        let (id, action) = (id.to_owned(), action.into());
        move |source| RuntimeError::Machine { id, action, source }
    }

    /// This sandbox's class does not do `what`.
    pub(crate) fn unsupported(id: &str, what: &str) -> RuntimeError {
        RuntimeError::Unsupported {
            id: id.to_owned(),
            what: what.to_owned(),
            why: "by this sandbox class".to_owned(),
        }
    }

    pub(crate) fn start(id: &str, reason: impl Into<String>) -> RuntimeError {
        RuntimeError::Start {
            id: id.to_owned(),
            reason: reason.into(),
        }
    }

    pub(crate) fn other(id: &str, reason: impl Into<String>) -> RuntimeError {
        RuntimeError::Other {
            id: id.to_owned(),
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    #[test]
    fn a_file_error_keeps_its_cause_and_names_the_path() {
        let error = RuntimeError::file("sb1", "create", "/x/y")(std::io::Error::from(
            std::io::ErrorKind::PermissionDenied,
        ));
        assert_eq!(error.to_string(), "sandbox sb1: cannot create /x/y");
        let cause = error.source().expect("a source");
        assert!(cause.downcast_ref::<std::io::Error>().is_some());
        assert_eq!(error.sandbox_id(), "sb1");
    }

    #[test]
    fn only_busy_is_transient() {
        let busy = RuntimeError::Busy {
            id: "a".into(),
            reason: "no range".into(),
        };
        assert!(busy.is_transient());
        assert!(!RuntimeError::AlreadyRunning { id: "a".into() }.is_transient());
    }
}
