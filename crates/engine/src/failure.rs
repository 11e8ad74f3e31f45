//! What failed inside an operation on a sandbox, before the operation names it.
//!
//! An operation's effect (start, pause, stop, archive, revert ...) drives the
//! runtime, the network and the archive in turn; [`Failure`] is whichever of
//! them failed, with its error as it came. The operation turns it into the
//! [`EngineError`] the caller sees ([`Failure::named`]), which keeps that
//! error as its source, so its kind (a runtime's "already running", the
//! network's "no address left") decides the answer.

use cove_net::NetError;
use cove_runtime::RuntimeError;

use crate::archive::ArchiveError;
use crate::EngineError;

#[derive(Debug, thiserror::Error)]
pub(crate) enum Failure {
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The network failed at `step` ("attach it to the network").
    #[error("{step}")]
    Network {
        step: &'static str,
        #[source]
        source: NetError,
    },
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    /// The snapshot the sandbox was made from, which holds its layers, is gone.
    #[error("its snapshot {name} no longer exists")]
    SnapshotGone { name: String },
    /// A failure the engine had already named (a store error, a missing class).
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl From<crate::archive::MoveError> for Failure {
    fn from(error: crate::archive::MoveError) -> Failure {
        match error {
            crate::archive::MoveError::Runtime(error) => Failure::Runtime(error),
            crate::archive::MoveError::Archive(error) => Failure::Archive(error),
        }
    }
}

impl Failure {
    /// The network's error at `step`.
    pub(crate) fn network(step: &'static str) -> impl FnOnce(NetError) -> Failure {
        move |source| Failure::Network { step, source }
    }

    /// The error of `operation` on sandbox `id` that failed so.
    pub(crate) fn named(self, id: &str, operation: &'static str) -> EngineError {
        let id = id.to_owned();
        match self {
            Failure::Runtime(source) => EngineError::Runtime {
                id,
                operation,
                source,
            },
            Failure::Network { step, source } => EngineError::Network {
                id,
                operation,
                step,
                source,
            },
            Failure::Archive(source) => EngineError::Archive {
                id,
                operation,
                source,
            },
            Failure::SnapshotGone { name } => EngineError::SnapshotGone {
                id,
                operation,
                snapshot: name,
            },
            Failure::Engine(error) => error,
        }
    }
}
