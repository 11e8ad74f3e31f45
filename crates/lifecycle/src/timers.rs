//! The timer rules: which intervals a sandbox may have, and what is due when.
//!
//! All intervals are in minutes, as in Daytona's API. Times are milliseconds since
//! the Unix epoch, passed in so that tests choose the clock.

use crate::state::{SandboxClass, SandboxState};
use crate::transition::Operation;

pub const MINUTE_MS: i64 = 60_000;
/// The longest interval a timer or TTL may be set to (about a century):
/// far past any use, and small enough that a deadline in milliseconds
/// never overflows.
pub const MAX_MINUTES: i64 = 100 * 366 * 24 * 60;

/// Auto-stop when a user sets nothing, in minutes.
pub const DEFAULT_AUTO_STOP: i64 = 15;
/// Auto-pause of a pausable class when neither auto-pause nor auto-stop is set.
pub(crate) const DEFAULT_AUTO_PAUSE: i64 = 60;
/// Auto-archive when a user sets nothing: 7 days.
pub(crate) const DEFAULT_AUTO_ARCHIVE: i64 = 7 * 24 * 60;
/// The longest auto-archive interval, 30 days; 0 asks for it, and a longer
/// one is cut to it (Daytona's `maxAutoArchiveInterval`).
pub const MAX_AUTO_ARCHIVE: i64 = 30 * 24 * 60;

/// The intervals of one sandbox after defaults and rules were applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimerSettings {
    /// Minutes idle before a stop; 0 disables it.
    pub auto_stop: i64,
    /// Minutes idle before a pause; 0 disables it.
    pub auto_pause: i64,
    /// Minutes stopped before an archive, 1 to [`MAX_AUTO_ARCHIVE`]: a
    /// request for 0 (or more) is kept as [`MAX_AUTO_ARCHIVE`], as Daytona
    /// keeps and answers it.
    pub auto_archive: i64,
    /// Minutes stopped before a delete; 0 deletes on stop, -1 disables it.
    pub auto_delete: i64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TimerSettingsError {
    #[error("{field} must be between {min} and {MAX_MINUTES} minutes, got {value}")]
    OutOfRange {
        field: &'static str,
        min: i64,
        value: i64,
    },
    #[error("autoPauseInterval and autoStopInterval are mutually exclusive: at most one may be non-zero")]
    PauseAndStop,
    #[error("ephemeral sandboxes (autoDeleteInterval 0) cannot have auto-pause")]
    EphemeralPause,
    #[error("{class} sandboxes cannot pause, so autoPauseInterval must be 0")]
    PauseUnsupported { class: SandboxClass },
}

fn at_least(field: &'static str, min: i64, value: Option<i64>) -> Result<(), TimerSettingsError> {
    match value {
        Some(value) if value < min || value > MAX_MINUTES => {
            Err(TimerSettingsError::OutOfRange { field, min, value })
        }
        _ => Ok(()),
    }
}

impl TimerSettings {
    /// Applies defaults and checks the rules for the intervals a create request asked for.
    pub fn resolve(
        class: SandboxClass,
        auto_stop: Option<i64>,
        auto_pause: Option<i64>,
        auto_archive: Option<i64>,
        auto_delete: Option<i64>,
    ) -> Result<TimerSettings, TimerSettingsError> {
        at_least("autoStopInterval", 0, auto_stop)?;
        at_least("autoPauseInterval", 0, auto_pause)?;
        at_least("autoArchiveInterval", 0, auto_archive)?;
        at_least("autoDeleteInterval", -1, auto_delete)?;
        let auto_delete = auto_delete.unwrap_or(-1);
        let ephemeral = auto_delete == 0;
        let (auto_stop, auto_pause) = match (auto_stop, auto_pause) {
            (None, None) if class.can_pause() && !ephemeral => (0, DEFAULT_AUTO_PAUSE),
            // Asking for auto-pause alone means no auto-stop (they exclude each other).
            (None, Some(pause)) if pause != 0 => (0, pause),
            (stop, pause) => (stop.unwrap_or(DEFAULT_AUTO_STOP), pause.unwrap_or(0)),
        };
        let settings = TimerSettings {
            auto_stop,
            auto_pause,
            auto_archive: resolve_auto_archive(auto_archive.unwrap_or(DEFAULT_AUTO_ARCHIVE)),
            auto_delete,
        };
        settings.check(class)?;
        Ok(settings)
    }

    /// The rules every combination must keep, at create and after each setter.
    pub fn check(&self, class: SandboxClass) -> Result<(), TimerSettingsError> {
        if self.auto_pause != 0 && !class.can_pause() {
            return Err(TimerSettingsError::PauseUnsupported { class });
        }
        if self.auto_pause != 0 && self.auto_stop != 0 {
            return Err(TimerSettingsError::PauseAndStop);
        }
        if self.auto_pause != 0 && self.auto_delete == 0 {
            return Err(TimerSettingsError::EphemeralPause);
        }
        Ok(())
    }

    /// The settings with one interval changed, if the result keeps the rules.
    pub fn with(
        mut self,
        class: SandboxClass,
        change: impl FnOnce(&mut TimerSettings),
    ) -> Result<TimerSettings, TimerSettingsError> {
        change(&mut self);
        at_least("autoStopInterval", 0, Some(self.auto_stop))?;
        at_least("autoPauseInterval", 0, Some(self.auto_pause))?;
        at_least("autoArchiveInterval", 0, Some(self.auto_archive))?;
        at_least("autoDeleteInterval", -1, Some(self.auto_delete))?;
        self.auto_archive = resolve_auto_archive(self.auto_archive);
        self.check(class)?;
        Ok(self)
    }

    /// Minutes stopped before an archive, as a client reads it; rows stored
    /// before 0 was resolved at write time still hold 0.
    pub fn archive_after(&self) -> i64 {
        resolve_auto_archive(self.auto_archive)
    }
}

/// The auto-archive interval a request for `minutes` (already checked to be
/// at least 0) stands for: 0 is the maximum, and nothing exceeds it.
fn resolve_auto_archive(minutes: i64) -> i64 {
    if minutes == 0 {
        MAX_AUTO_ARCHIVE
    } else {
        minutes.min(MAX_AUTO_ARCHIVE)
    }
}

/// What the timers look at for one sandbox.
#[derive(Clone, Copy, Debug)]
pub struct TimerView {
    pub state: SandboxState,
    pub settings: TimerSettings,
    /// Last API or toolbox interaction, or state change.
    pub last_activity_ms: i64,
    /// When the sandbox entered its current state.
    pub state_since_ms: i64,
    /// Wall-clock deadline after which the sandbox is destroyed in any state.
    pub ttl_deadline_ms: Option<i64>,
    /// Whether the class can archive its filesystem.
    pub can_archive: bool,
}

/// A timer that has fired, with the operation it asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimerAction {
    Ttl,
    AutoStop,
    AutoPause,
    AutoDelete,
    AutoArchive,
}

impl TimerAction {
    pub fn operation(self) -> Operation {
        match self {
            Self::Ttl | Self::AutoDelete => Operation::Delete,
            Self::AutoStop => Operation::Stop,
            Self::AutoPause => Operation::Pause,
            Self::AutoArchive => Operation::Archive,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ttl => "ttl",
            Self::AutoStop => "auto-stop",
            Self::AutoPause => "auto-pause",
            Self::AutoDelete => "auto-delete",
            Self::AutoArchive => "auto-archive",
        }
    }
}

/// The timer that is due for a sandbox at `now_ms`, if any. TTL wins over
/// everything; among the others at most one can apply to a given state.
pub fn due_action(view: &TimerView, now_ms: i64) -> Option<TimerAction> {
    let s = &view.settings;
    if matches!(
        view.state,
        SandboxState::Destroying | SandboxState::Destroyed
    ) {
        return None;
    }
    if view
        .ttl_deadline_ms
        .is_some_and(|deadline| now_ms >= deadline)
    {
        return Some(TimerAction::Ttl);
    }
    let idle_for =
        |minutes: i64| minutes > 0 && now_ms - view.last_activity_ms >= minutes * MINUTE_MS;
    let stopped_for = |minutes: i64| now_ms - view.state_since_ms >= minutes * MINUTE_MS;
    match view.state {
        SandboxState::Started if idle_for(s.auto_pause) => Some(TimerAction::AutoPause),
        SandboxState::Started if idle_for(s.auto_stop) => Some(TimerAction::AutoStop),
        SandboxState::Stopped if s.auto_delete >= 0 && stopped_for(s.auto_delete) => {
            Some(TimerAction::AutoDelete)
        }
        SandboxState::Stopped if view.can_archive && stopped_for(s.archive_after()) => {
            Some(TimerAction::AutoArchive)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxClass::{Container, LinuxVm};

    fn resolve(
        class: SandboxClass,
        stop: Option<i64>,
        pause: Option<i64>,
        delete: Option<i64>,
    ) -> Result<TimerSettings, TimerSettingsError> {
        TimerSettings::resolve(class, stop, pause, None, delete)
    }

    #[test]
    fn container_defaults() {
        let s = resolve(Container, None, None, None).unwrap();
        assert_eq!(
            s,
            TimerSettings {
                auto_stop: 15,
                auto_pause: 0,
                auto_archive: 7 * 24 * 60,
                auto_delete: -1
            }
        );
    }

    #[test]
    fn pausable_class_defaults_to_auto_pause() {
        let s = resolve(LinuxVm, None, None, None).unwrap();
        assert_eq!((s.auto_stop, s.auto_pause), (0, 60));
        // Setting either one keeps the other at its plain default.
        let s = resolve(LinuxVm, Some(30), None, None).unwrap();
        assert_eq!((s.auto_stop, s.auto_pause), (30, 0));
        let s = resolve(LinuxVm, Some(0), Some(10), None).unwrap();
        assert_eq!((s.auto_stop, s.auto_pause), (0, 10));
    }

    #[test]
    fn ephemeral_vm_gets_auto_stop_not_auto_pause() {
        let s = resolve(LinuxVm, None, None, Some(0)).unwrap();
        assert_eq!((s.auto_stop, s.auto_pause, s.auto_delete), (15, 0, 0));
        assert_eq!(
            resolve(LinuxVm, Some(0), Some(5), Some(0)),
            Err(TimerSettingsError::EphemeralPause)
        );
    }

    #[test]
    fn pause_and_stop_are_exclusive() {
        assert_eq!(
            resolve(LinuxVm, Some(5), Some(5), None),
            Err(TimerSettingsError::PauseAndStop)
        );
        // Only auto-pause given (as the SDK sends for daytona-vm-small): no auto-stop.
        let s = resolve(LinuxVm, None, Some(5), None).unwrap();
        assert_eq!((s.auto_stop, s.auto_pause), (0, 5));
    }

    #[test]
    fn containers_cannot_auto_pause() {
        assert_eq!(
            resolve(Container, Some(0), Some(5), None),
            Err(TimerSettingsError::PauseUnsupported { class: Container })
        );
    }

    #[test]
    fn ranges() {
        assert!(matches!(
            resolve(Container, Some(-1), None, None),
            Err(TimerSettingsError::OutOfRange {
                field: "autoStopInterval",
                ..
            })
        ));
        assert!(matches!(
            resolve(Container, None, None, Some(-2)),
            Err(TimerSettingsError::OutOfRange {
                field: "autoDeleteInterval",
                ..
            })
        ));
        assert!(resolve(Container, None, None, Some(-1)).is_ok());
        // Past a century an interval in milliseconds would overflow on the way.
        assert!(resolve(Container, Some(MAX_MINUTES), None, None).is_ok());
        assert!(matches!(
            resolve(Container, Some(i64::MAX / 1000), None, None),
            Err(TimerSettingsError::OutOfRange {
                field: "autoStopInterval",
                ..
            })
        ));
    }

    #[test]
    fn setters_keep_the_rules() {
        let s = resolve(LinuxVm, None, None, None).unwrap();
        assert_eq!(
            s.with(LinuxVm, |s| s.auto_stop = 5),
            Err(TimerSettingsError::PauseAndStop)
        );
        let s = s.with(LinuxVm, |s| s.auto_pause = 0).unwrap();
        let s = s.with(LinuxVm, |s| s.auto_stop = 5).unwrap();
        assert_eq!(s.auto_stop, 5);
        assert_eq!(
            s.with(LinuxVm, |s| s.auto_delete = -3),
            Err(TimerSettingsError::OutOfRange {
                field: "autoDeleteInterval",
                min: -1,
                value: -3
            })
        );
    }

    fn view(state: SandboxState, settings: TimerSettings) -> TimerView {
        TimerView {
            state,
            settings,
            last_activity_ms: 0,
            state_since_ms: 0,
            ttl_deadline_ms: None,
            can_archive: true,
        }
    }

    const M: i64 = MINUTE_MS;

    #[test]
    fn auto_stop_after_idle() {
        let v = view(
            SandboxState::Started,
            resolve(Container, Some(15), None, None).unwrap(),
        );
        assert_eq!(due_action(&v, 15 * M - 1), None);
        assert_eq!(due_action(&v, 15 * M), Some(TimerAction::AutoStop));
        let off = view(
            SandboxState::Started,
            resolve(Container, Some(0), None, None).unwrap(),
        );
        assert_eq!(due_action(&off, 1000 * M), None);
    }

    #[test]
    fn auto_pause_after_idle() {
        let v = view(
            SandboxState::Started,
            resolve(LinuxVm, None, None, None).unwrap(),
        );
        assert_eq!(due_action(&v, 59 * M), None);
        assert_eq!(due_action(&v, 60 * M), Some(TimerAction::AutoPause));
        assert_eq!(TimerAction::AutoPause.operation(), Operation::Pause);
    }

    #[test]
    fn auto_delete_zero_deletes_on_stop() {
        let v = view(
            SandboxState::Stopped,
            resolve(Container, None, None, Some(0)).unwrap(),
        );
        assert_eq!(due_action(&v, 0), Some(TimerAction::AutoDelete));
        // ...but never while it runs.
        let v = view(
            SandboxState::Started,
            resolve(Container, Some(0), None, Some(0)).unwrap(),
        );
        assert_eq!(due_action(&v, 1000 * M), None);
    }

    #[test]
    fn auto_delete_counts_time_stopped() {
        let mut v = view(
            SandboxState::Stopped,
            resolve(Container, None, None, Some(10)).unwrap(),
        );
        v.state_since_ms = 100 * M;
        assert_eq!(due_action(&v, 109 * M), None);
        assert_eq!(due_action(&v, 110 * M), Some(TimerAction::AutoDelete));
        let off = view(
            SandboxState::Stopped,
            resolve(Container, None, None, Some(-1)).unwrap(),
        );
        assert_eq!(due_action(&off, 1000 * M), None);
    }

    #[test]
    fn auto_archive_default_and_zero_means_thirty_days() {
        let day = 24 * 60 * M;
        let v = view(
            SandboxState::Stopped,
            resolve(Container, None, None, None).unwrap(),
        );
        assert_eq!(due_action(&v, 7 * day - 1), None);
        assert_eq!(due_action(&v, 7 * day), Some(TimerAction::AutoArchive));
        let s = TimerSettings::resolve(Container, None, None, Some(0), None).unwrap();
        let v = view(SandboxState::Stopped, s);
        assert_eq!(due_action(&v, 29 * day), None);
        assert_eq!(due_action(&v, 30 * day), Some(TimerAction::AutoArchive));
        let mut no_archive = v;
        no_archive.can_archive = false;
        assert_eq!(due_action(&no_archive, 300 * day), None);
        // A row written before 0 was resolved at write time still means 30 days.
        let mut legacy = view(SandboxState::Stopped, s);
        legacy.settings.auto_archive = 0;
        assert_eq!(due_action(&legacy, 30 * day - 1), None);
        assert_eq!(
            due_action(&legacy, 30 * day),
            Some(TimerAction::AutoArchive)
        );
    }

    #[test]
    fn auto_archive_zero_and_beyond_are_kept_as_the_maximum() {
        for (asked, kept) in [
            (0, MAX_AUTO_ARCHIVE),
            (1, 1),
            (MAX_AUTO_ARCHIVE, MAX_AUTO_ARCHIVE),
            (MAX_AUTO_ARCHIVE + 1, MAX_AUTO_ARCHIVE),
            (MAX_MINUTES, MAX_AUTO_ARCHIVE),
        ] {
            let created = TimerSettings::resolve(Container, None, None, Some(asked), None).unwrap();
            assert_eq!(created.auto_archive, kept, "create with {asked}");
            let set = created.with(Container, |t| t.auto_archive = asked).unwrap();
            assert_eq!(set.auto_archive, kept, "set to {asked}");
        }
        assert_eq!(MAX_AUTO_ARCHIVE, 43_200);
        assert!(TimerSettings::resolve(Container, None, None, Some(-1), None).is_err());
        let created = TimerSettings::resolve(Container, None, None, None, None).unwrap();
        assert!(created.with(Container, |t| t.auto_archive = -1).is_err());
    }

    #[test]
    fn auto_delete_wins_over_auto_archive() {
        let s = TimerSettings::resolve(Container, None, None, Some(1), Some(5)).unwrap();
        let v = view(SandboxState::Stopped, s);
        assert_eq!(due_action(&v, 10 * M), Some(TimerAction::AutoDelete));
    }

    #[test]
    fn ttl_destroys_in_any_state() {
        let s = resolve(Container, Some(0), None, None).unwrap();
        for state in SandboxState::ALL {
            let mut v = view(state, s);
            v.ttl_deadline_ms = Some(5 * M);
            v.last_activity_ms = 5 * M;
            let expected = match state {
                SandboxState::Destroying | SandboxState::Destroyed => None,
                _ => Some(TimerAction::Ttl),
            };
            assert_eq!(due_action(&v, 5 * M), expected, "{state}");
            assert_eq!(due_action(&v, 5 * M - 1), None, "{state}");
        }
    }

    #[test]
    fn activity_resets_the_idle_clock() {
        let mut v = view(
            SandboxState::Started,
            resolve(Container, Some(15), None, None).unwrap(),
        );
        v.last_activity_ms = 10 * M;
        assert_eq!(due_action(&v, 24 * M), None);
        assert_eq!(due_action(&v, 25 * M), Some(TimerAction::AutoStop));
    }

    #[test]
    fn no_timer_acts_on_transient_states() {
        let s = TimerSettings {
            auto_stop: 1,
            auto_pause: 0,
            auto_archive: 1,
            auto_delete: 0,
        };
        for state in SandboxState::ALL.into_iter().filter(|s| s.is_transient()) {
            assert_eq!(due_action(&view(state, s), 1000 * M), None, "{state}");
        }
    }
}
