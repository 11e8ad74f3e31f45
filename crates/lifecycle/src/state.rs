//! The states a sandbox can be in and the states a user can ask for.

use std::fmt;
use std::str::FromStr;

/// The actual state of a sandbox. Each has one meaning and its own name
/// ([`SandboxState::as_str`], stored and logged); the name the SDKs see is
/// [`SandboxState::wire`], Daytona's lower-case one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SandboxState {
    Creating,
    Starting,
    Started,
    Stopping,
    Stopped,
    Pausing,
    Paused,
    Resuming,
    Snapshotting,
    Forking,
    Archiving,
    Archived,
    /// Bringing an archived sandbox's storage back (a start from `archived`).
    Unarchiving,
    /// Rewinding a sandbox's filesystem to one of its own snapshots.
    Reverting,
    Destroying,
    Destroyed,
    Error,
}

impl SandboxState {
    pub const ALL: [SandboxState; 17] = [
        Self::Creating,
        Self::Starting,
        Self::Started,
        Self::Stopping,
        Self::Stopped,
        Self::Pausing,
        Self::Paused,
        Self::Resuming,
        Self::Snapshotting,
        Self::Forking,
        Self::Archiving,
        Self::Archived,
        Self::Unarchiving,
        Self::Reverting,
        Self::Destroying,
        Self::Destroyed,
        Self::Error,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Creating => "creating",
            Self::Starting => "starting",
            Self::Started => "started",
            Self::Stopping => "stopping",
            Self::Stopped => "stopped",
            Self::Pausing => "pausing",
            Self::Paused => "paused",
            Self::Resuming => "resuming",
            Self::Snapshotting => "snapshotting",
            Self::Forking => "forking",
            Self::Archiving => "archiving",
            Self::Archived => "archived",
            Self::Unarchiving => "unarchiving",
            Self::Reverting => "reverting",
            Self::Destroying => "destroying",
            Self::Destroyed => "destroyed",
            Self::Error => "error",
        }
    }

    /// The name the SDKs know: Daytona has one state, `restoring`, for both
    /// bringing a sandbox back from the archive and reverting it.
    pub fn wire(self) -> &'static str {
        match self {
            Self::Unarchiving | Self::Reverting => "restoring",
            other => other.as_str(),
        }
    }

    /// A state an operation passes through; a sandbox found in one after a crash
    /// had its operation interrupted.
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            Self::Creating
                | Self::Starting
                | Self::Stopping
                | Self::Pausing
                | Self::Resuming
                | Self::Snapshotting
                | Self::Forking
                | Self::Archiving
                | Self::Unarchiving
                | Self::Reverting
                | Self::Destroying
        )
    }

    /// Whether processes of the sandbox may be running in this state.
    pub fn is_running(self) -> bool {
        matches!(self, Self::Started | Self::Snapshotting | Self::Forking)
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SandboxState {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // Stores written before `restoring` was split. Read as unarchiving,
        // a sandbox found there after a restart is recovered as it was then:
        // back to `archived` if the archive holds it, else started again.
        if s == "restoring" {
            return Ok(Self::Unarchiving);
        }
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| UnknownName(s.to_owned()))
    }
}

/// What the user last asked the sandbox to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DesiredState {
    Started,
    Stopped,
    Paused,
    Archived,
    Destroyed,
}

impl DesiredState {
    pub const ALL: [DesiredState; 5] = [
        Self::Started,
        Self::Stopped,
        Self::Paused,
        Self::Archived,
        Self::Destroyed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Stopped => "stopped",
            Self::Paused => "paused",
            Self::Archived => "archived",
            Self::Destroyed => "destroyed",
        }
    }
}

impl fmt::Display for DesiredState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DesiredState {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| UnknownName(s.to_owned()))
    }
}

/// The kind of machine behind a sandbox; it decides which operations exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SandboxClass {
    /// Namespaces, cgroups and overlayfs on the host kernel.
    Container,
    /// A QEMU microVM with its own kernel.
    LinuxVm,
}

impl SandboxClass {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Container => "container",
            Self::LinuxVm => "linux-vm",
        }
    }

    /// Only a VM keeps memory without running, so only a VM pauses.
    pub fn can_pause(self) -> bool {
        matches!(self, Self::LinuxVm)
    }
}

impl fmt::Display for SandboxClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SandboxClass {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "container" => Ok(Self::Container),
            "linux-vm" => Ok(Self::LinuxVm),
            other => Err(UnknownName(other.to_owned())),
        }
    }
}

/// A stored name that names no state or class.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown name {0:?}")]
pub struct UnknownName(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for state in SandboxState::ALL {
            assert_eq!(state.as_str().parse::<SandboxState>(), Ok(state));
        }
        for desired in DesiredState::ALL {
            assert_eq!(desired.as_str().parse::<DesiredState>(), Ok(desired));
        }
        assert!("STARTED".parse::<SandboxState>().is_err());
    }

    #[test]
    fn the_sdk_sees_one_restoring_for_unarchive_and_revert() {
        assert_eq!(SandboxState::Unarchiving.wire(), "restoring");
        assert_eq!(SandboxState::Reverting.wire(), "restoring");
        assert_eq!(SandboxState::Paused.wire(), "paused");
        assert_eq!("restoring".parse(), Ok(SandboxState::Unarchiving));
        let wire: std::collections::BTreeSet<_> =
            SandboxState::ALL.iter().map(|s| s.wire()).collect();
        assert_eq!(wire.len(), SandboxState::ALL.len() - 1);
    }
}
