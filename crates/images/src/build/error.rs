//! How a build fails: the Dockerfile, the host outside any step, or one step.

use super::copy::CopyError;
use super::dockerfile::DockerfileError;

/// Why a build ended without an image. `E` is the host's error
/// ([`BuildHost::Error`](super::BuildHost::Error)).
#[derive(Debug, thiserror::Error)]
pub enum BuildError<E: std::error::Error + 'static> {
    /// The Dockerfile cannot be built as written (an `ENV` that does not read).
    #[error(transparent)]
    Dockerfile(#[from] DockerfileError),
    /// The host failed outside a step (its layer cache): its error as it is.
    #[error(transparent)]
    Host(E),
    /// A step could not be done; `step` is its instruction as written.
    #[error("{step}: {error}")]
    Step { step: String, error: StepError<E> },
    /// A step's command failed.
    #[error("{step} {how}; output: {output_tail}")]
    Exited {
        step: String,
        /// `exited with code N` or `timed out after N s`.
        how: String,
        /// The end of its output.
        output_tail: String,
    },
}

/// What went wrong inside one step.
#[derive(Debug, thiserror::Error)]
pub enum StepError<E: std::error::Error + 'static> {
    /// The host's sandbox (start, run, copy in, stop, capture).
    #[error(transparent)]
    Host(E),
    /// Choosing or writing the files of a `COPY`/`ADD`.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// A blocking task of the step ended before answering.
    #[error("{0}")]
    Task(#[from] tokio::task::JoinError),
}
