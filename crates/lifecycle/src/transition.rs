//! Which operation is allowed from which state, and where it leads.

use std::fmt;

use crate::state::{DesiredState, SandboxClass, SandboxState};

/// Every operation a sandbox can undergo. The HTTP API, the CLI and the timers
/// all ask for one of these; none of them implements a transition itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operation {
    Start,
    Stop,
    Pause,
    Resume,
    /// Start a paused sandbox from its disk, discarding its memory.
    ColdStart,
    Snapshot,
    Fork,
    Revert,
    Archive,
    Delete,
    /// Leave the `error` state by starting the sandbox again.
    Recover,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Start => "start",
            Self::Stop => "stop",
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::ColdStart => "cold start",
            Self::Snapshot => "snapshot",
            Self::Fork => "fork",
            Self::Revert => "revert",
            Self::Archive => "archive",
            Self::Delete => "delete",
            Self::Recover => "recover",
        }
    }

    pub const ALL: [Operation; 11] = [
        Self::Start,
        Self::Stop,
        Self::Pause,
        Self::Resume,
        Self::ColdStart,
        Self::Snapshot,
        Self::Fork,
        Self::Revert,
        Self::Archive,
        Self::Delete,
        Self::Recover,
    ];
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an allowed operation does to the recorded state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// The sandbox is already where the operation leads; nothing to do.
    AlreadyThere,
    /// Record `during` (and `desired`) before the side effect, `success` after it.
    Run {
        during: SandboxState,
        success: SandboxState,
        desired: DesiredState,
    },
}

impl Transition {
    /// The transition of a new sandbox: recorded as `creating`, lands in `started`.
    pub fn create() -> Transition {
        Transition::Run {
            during: SandboxState::Creating,
            success: SandboxState::Started,
            desired: DesiredState::Started,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TransitionError {
    /// cannot {operation} a sandbox that is {from}
    #[error("cannot {operation} a sandbox that is {from}{hint}")]
    NotAllowed {
        operation: Operation,
        from: SandboxState,
        hint: &'static str,
    },
    /// the class does not support the operation
    #[error("{class} sandboxes do not support {operation}")]
    NotSupported {
        operation: Operation,
        class: SandboxClass,
    },
}

fn run(during: SandboxState, success: SandboxState, desired: DesiredState) -> Transition {
    Transition::Run {
        during,
        success,
        desired,
    }
}

/// Decides whether `operation` may run on a sandbox of `class` that is `from`,
/// and which states it passes through.
pub fn plan(
    operation: Operation,
    from: SandboxState,
    class: SandboxClass,
) -> Result<Transition, TransitionError> {
    use DesiredState as D;
    use SandboxState as S;

    let needs_pause = matches!(
        operation,
        Operation::Pause | Operation::Resume | Operation::ColdStart
    );
    if needs_pause && !class.can_pause() {
        return Err(TransitionError::NotSupported { operation, class });
    }
    if operation == Operation::Fork && class == SandboxClass::Container {
        return Err(TransitionError::NotSupported { operation, class });
    }

    let not_allowed = |hint: &'static str| TransitionError::NotAllowed {
        operation,
        from,
        hint,
    };
    let paused_state = matches!(from, S::Paused | S::Pausing | S::Resuming);
    if paused_state && !class.can_pause() && operation != Operation::Delete {
        // A class that cannot pause never gets here; refuse rather than guess.
        return Err(not_allowed(""));
    }
    match (operation, from) {
        (Operation::Start, S::Started) => Ok(Transition::AlreadyThere),
        (Operation::Start, S::Stopped) => Ok(run(S::Starting, S::Started, D::Started)),
        (Operation::Start | Operation::Resume, S::Paused) => {
            Ok(run(S::Resuming, S::Started, D::Started))
        }
        (Operation::Start, S::Archived) => Ok(run(S::Unarchiving, S::Started, D::Started)),
        (Operation::Start, S::Error) => Err(not_allowed(" (recover it first)")),

        (Operation::Resume, S::Started) => Ok(Transition::AlreadyThere),
        (Operation::ColdStart, S::Started) => Ok(Transition::AlreadyThere),
        (Operation::ColdStart, S::Paused | S::Stopped) => {
            Ok(run(S::Starting, S::Started, D::Started))
        }

        (Operation::Stop, S::Stopped) => Ok(Transition::AlreadyThere),
        (Operation::Stop, S::Started | S::Paused) => Ok(run(S::Stopping, S::Stopped, D::Stopped)),

        (Operation::Pause, S::Paused) => Ok(Transition::AlreadyThere),
        (Operation::Pause, S::Started) => Ok(run(S::Pausing, S::Paused, D::Paused)),

        (Operation::Snapshot | Operation::Revert, S::Paused) => {
            Err(not_allowed(" (resume it first)"))
        }
        (Operation::Snapshot, S::Started) => Ok(run(S::Snapshotting, S::Started, D::Started)),
        (Operation::Snapshot, S::Stopped) => Ok(run(S::Snapshotting, S::Stopped, D::Stopped)),
        (Operation::Revert, S::Started) => Ok(run(S::Reverting, S::Started, D::Started)),
        (Operation::Revert, S::Stopped) => Ok(run(S::Reverting, S::Stopped, D::Stopped)),

        (Operation::Fork, S::Started) => Ok(run(S::Forking, S::Started, D::Started)),

        (Operation::Archive, S::Archived) => Ok(Transition::AlreadyThere),
        (Operation::Archive, S::Stopped) => Ok(run(S::Archiving, S::Archived, D::Archived)),
        (Operation::Archive, _) => Err(not_allowed(" (stop it first)")),

        (Operation::Delete, S::Destroyed) => Ok(Transition::AlreadyThere),
        (Operation::Delete, S::Destroying) => Ok(Transition::AlreadyThere),
        // Delete is always possible from a resting state, and from an interrupted
        // one too: it is how a user gets rid of a sandbox stuck mid-operation.
        (Operation::Delete, _) => Ok(run(S::Destroying, S::Destroyed, D::Destroyed)),

        (Operation::Recover, S::Error) => Ok(run(S::Starting, S::Started, D::Started)),
        (Operation::Recover, S::Started) => Ok(Transition::AlreadyThere),

        _ => Err(not_allowed("")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use DesiredState as D;
    use Operation as O;
    use SandboxClass::{Container, LinuxVm};
    use SandboxState as S;

    /// One row of the expected table: `None` means "already there".
    type Row = (Operation, SandboxState, Option<(S, S, D)>);

    /// The whole table for one class: every (operation, state) pair not listed is refused.
    fn check(class: SandboxClass, allowed: &[Row]) {
        for operation in Operation::ALL {
            for from in SandboxState::ALL {
                let expected = allowed
                    .iter()
                    .find(|(o, s, _)| *o == operation && *s == from);
                let got = plan(operation, from, class);
                match expected {
                    Some((_, _, None)) => {
                        assert_eq!(got, Ok(Transition::AlreadyThere), "{operation} from {from}")
                    }
                    Some((_, _, Some((during, success, desired)))) => assert_eq!(
                        got,
                        Ok(Transition::Run {
                            during: *during,
                            success: *success,
                            desired: *desired
                        }),
                        "{operation} from {from} on {class}"
                    ),
                    None => assert!(got.is_err(), "{operation} from {from} on {class}: {got:?}"),
                }
            }
        }
    }

    fn common() -> Vec<Row> {
        let mut rows = vec![
            (O::Start, S::Started, None),
            (
                O::Start,
                S::Stopped,
                Some((S::Starting, S::Started, D::Started)),
            ),
            (
                O::Start,
                S::Archived,
                Some((S::Unarchiving, S::Started, D::Started)),
            ),
            (O::Stop, S::Stopped, None),
            (
                O::Stop,
                S::Started,
                Some((S::Stopping, S::Stopped, D::Stopped)),
            ),
            (
                O::Snapshot,
                S::Started,
                Some((S::Snapshotting, S::Started, D::Started)),
            ),
            (
                O::Snapshot,
                S::Stopped,
                Some((S::Snapshotting, S::Stopped, D::Stopped)),
            ),
            (
                O::Revert,
                S::Started,
                Some((S::Reverting, S::Started, D::Started)),
            ),
            (
                O::Revert,
                S::Stopped,
                Some((S::Reverting, S::Stopped, D::Stopped)),
            ),
            (O::Archive, S::Archived, None),
            (
                O::Archive,
                S::Stopped,
                Some((S::Archiving, S::Archived, D::Archived)),
            ),
            (O::Delete, S::Destroyed, None),
            (O::Delete, S::Destroying, None),
            (
                O::Recover,
                S::Error,
                Some((S::Starting, S::Started, D::Started)),
            ),
            (O::Recover, S::Started, None),
        ];
        for from in SandboxState::ALL {
            if !matches!(from, S::Destroyed | S::Destroying) {
                rows.push((
                    O::Delete,
                    from,
                    Some((S::Destroying, S::Destroyed, D::Destroyed)),
                ));
            }
        }
        rows
    }

    #[test]
    fn container_table() {
        check(Container, &common());
    }

    #[test]
    fn vm_table() {
        let mut rows = common();
        rows.extend([
            (
                O::Start,
                S::Paused,
                Some((S::Resuming, S::Started, D::Started)),
            ),
            (
                O::Resume,
                S::Paused,
                Some((S::Resuming, S::Started, D::Started)),
            ),
            (O::Resume, S::Started, None),
            (O::ColdStart, S::Started, None),
            (
                O::ColdStart,
                S::Paused,
                Some((S::Starting, S::Started, D::Started)),
            ),
            (
                O::ColdStart,
                S::Stopped,
                Some((S::Starting, S::Started, D::Started)),
            ),
            (
                O::Stop,
                S::Paused,
                Some((S::Stopping, S::Stopped, D::Stopped)),
            ),
            (O::Pause, S::Paused, None),
            (
                O::Pause,
                S::Started,
                Some((S::Pausing, S::Paused, D::Paused)),
            ),
            (
                O::Fork,
                S::Started,
                Some((S::Forking, S::Started, D::Started)),
            ),
        ]);
        check(LinuxVm, &rows);
    }

    #[test]
    fn refusals_name_both_sides() {
        let err = plan(O::Start, S::Stopping, Container).unwrap_err();
        assert_eq!(err.to_string(), "cannot start a sandbox that is stopping");
        let err = plan(O::Snapshot, S::Paused, LinuxVm).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot snapshot a sandbox that is paused (resume it first)"
        );
        let err = plan(O::Pause, S::Started, Container).unwrap_err();
        assert_eq!(err.to_string(), "container sandboxes do not support pause");
    }

    #[test]
    fn create_lands_in_started() {
        assert_eq!(
            Transition::create(),
            Transition::Run {
                during: S::Creating,
                success: S::Started,
                desired: D::Started
            }
        );
    }
}
