//! The sandbox lifecycle of cove as pure logic.
//!
//! This crate owns which operation is allowed from which state, what a sandbox is in
//! while an operation runs and where it lands, and what a timer does when it fires.
//! It knows nothing of HTTP, storage or runtimes: every function here is a plain
//! function over plain data, so every rule is unit-tested without a machine.

mod state;
mod timers;
mod transition;

pub use state::{DesiredState, SandboxClass, SandboxState};
pub use timers::{
    due_action, TimerAction, TimerSettings, TimerSettingsError, TimerView, DEFAULT_AUTO_STOP,
    MAX_AUTO_ARCHIVE, MAX_MINUTES, MINUTE_MS,
};
pub use transition::{plan, Operation, Transition, TransitionError};
