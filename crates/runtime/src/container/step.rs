//! A failed step of building a container, as the shim reports it.
//!
//! The shim and the container init work in steps (a mount, a system call,
//! a file written); one that fails is a [`StepError`]: what was being done
//! and the cause the kernel gave as its source. The shim sends it to the
//! server as one line of text ([`StepError::report`], the whole chain),
//! which becomes `RuntimeError::Shim` there: the report crosses a process
//! boundary, so text is its wire form. Nothing else of the runtime uses it.

use nix::errno::Errno;

use super::userns::UsernsError;

#[derive(Debug, thiserror::Error)]
pub(super) enum StepError {
    /// A system call failed.
    #[error("{step}")]
    Sys {
        step: String,
        #[source]
        source: Errno,
    },
    /// A file operation failed.
    #[error("{step}")]
    Io {
        step: String,
        #[source]
        source: std::io::Error,
    },
    /// A path beneath a sandbox-writable tree could not be opened or mounted.
    #[error("{step}")]
    Beneath {
        step: String,
        #[source]
        source: crate::beneath::BeneathError,
    },
    /// The sandbox's user namespace was not what the server passed.
    #[error(transparent)]
    Userns(#[from] UsernsError),
    /// The settings document on stdin could not be read.
    #[error("bad init arguments")]
    Settings(#[source] serde_json::Error),
    /// A host path the container cannot use.
    #[error(transparent)]
    Path(#[from] super::layout::PathRefused),
    /// The container init's own report of its failed step, which came
    /// through a pipe as text.
    #[error("{0}")]
    Init(String),
    /// A setting the step cannot use, named.
    #[error("{0}")]
    Refused(String),
}

impl StepError {
    /// The step and every cause, on one line: what the shim reports.
    pub(super) fn report(&self) -> String {
        let mut line = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            line.push_str(": ");
            line.push_str(&cause.to_string());
            source = cause.source();
        }
        line
    }
}

/// A system call's failure in `step` (described lazily: only a failure pays).
pub(super) fn sys(step: impl FnOnce() -> String) -> impl FnOnce(Errno) -> StepError {
    move |source| StepError::Sys {
        step: step(),
        source,
    }
}

/// A file operation's failure in `step`.
pub(super) fn io(step: impl FnOnce() -> String) -> impl FnOnce(std::io::Error) -> StepError {
    move |source| StepError::Io {
        step: step(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_carries_the_step_and_its_cause() {
        let error = sys(|| "mount overlay at /x".into())(Errno::EPERM);
        assert_eq!(
            error.report(),
            "mount overlay at /x: EPERM: Operation not permitted"
        );
        let nested = StepError::from(UsernsError::NotUserns {
            fd: 7,
            source: std::io::Error::from_raw_os_error(libc::EBADF),
        });
        let report = nested.report();
        assert!(
            report.starts_with("descriptor 7 is not the user namespace"),
            "{report}"
        );
        assert!(report.contains("os error 9"), "{report}");
    }
}
