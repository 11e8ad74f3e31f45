//! Computer use: the sandbox's desktop and what the toolbox does with it.
//!
//! STAND-IN: the desktop itself (Xvfb, the window manager, the session
//! D-Bus) is started by another module that replaces this file; until then
//! [`Desktop`] only holds the session someone set, so the accessibility
//! routes (`a11y/`) can be built and tested against a desktop a test starts.

pub mod a11y;

use std::sync::Mutex;

use crate::error::ApiError;

/// Where a running desktop can be reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// The X display, as `DISPLAY` names it (`:1`).
    pub display: String,
    /// The desktop's session bus, as `DBUS_SESSION_BUS_ADDRESS` names it.
    pub bus_address: String,
}

/// The sandbox's desktop: running or not.
#[derive(Debug, Default)]
pub struct Desktop {
    session: Mutex<Option<Session>>,
}

impl Desktop {
    /// The running desktop's session; 503 when it is not running.
    pub fn session(&self) -> Result<Session, ApiError> {
        self.session
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
            .ok_or(ApiError::DesktopNotRunning)
    }

    /// Records the desktop's session (`None`: stopped); tests set their own.
    pub fn set_session(&self, session: Option<Session>) {
        *self
            .session
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = session;
    }
}
