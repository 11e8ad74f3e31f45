//! PTY sessions (`/process/pty...`): interactive shells on real
//! pseudo-terminals, streamed over WebSockets to any number of clients, with
//! resize and kill. Owns the PTY session limit; knows nothing of the
//! non-interactive sessions in [`crate::session`].

mod connect;
pub(crate) mod routes;
mod session;
mod terminal;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

pub use routes::routes;
pub use session::{PtySession, PtySessionInfo, PtySpec};

use crate::error::ApiError;

/// Largest terminal side accepted, as Daytona's daemon does.
pub const MAX_TERMINAL_SIDE: u16 = 1000;

/// Every PTY session of this agent, started or waiting for its first client.
#[derive(Default)]
pub struct Registry {
    sessions: Mutex<BTreeMap<String, Arc<PtySession>>>,
}

impl Registry {
    /// Adds a session (not started yet); `limit` caps the sessions alive at once.
    pub fn add(&self, spec: PtySpec, limit: usize) -> Result<Arc<PtySession>, ApiError> {
        if spec.id.is_empty() {
            return Err(ApiError::BadRequest(
                "pty session id must not be empty".into(),
            ));
        }
        for (name, side) in [("cols", spec.cols), ("rows", spec.rows)] {
            if side == 0 || side > MAX_TERMINAL_SIDE {
                return Err(ApiError::BadRequest(format!(
                    "{name} must be between 1 and {MAX_TERMINAL_SIDE}, got {side}"
                )));
            }
        }
        let mut sessions = self.sessions.lock().unwrap();
        if sessions.contains_key(&spec.id) {
            return Err(ApiError::SessionExists(spec.id));
        }
        if sessions.len() >= limit {
            return Err(ApiError::LimitReached {
                what: "pty sessions",
                limit,
            });
        }
        let session = PtySession::new(spec);
        sessions.insert(session.id().to_string(), session.clone());
        Ok(session)
    }

    pub fn get(&self, id: &str) -> Result<Arc<PtySession>, ApiError> {
        self.sessions
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::SessionNotFound(id.to_string()))
    }

    pub fn list(&self) -> Vec<PtySessionInfo> {
        let sessions: Vec<_> = self.sessions.lock().unwrap().values().cloned().collect();
        sessions.iter().map(|s| s.info()).collect()
    }

    /// Kills session `id` and forgets it.
    pub fn kill(&self, id: &str) -> Result<(), ApiError> {
        let session = self
            .sessions
            .lock()
            .unwrap()
            .remove(id)
            .ok_or_else(|| ApiError::SessionNotFound(id.to_string()))?;
        session.kill();
        Ok(())
    }

    /// Forgets `session` once its shell has ended, unless the id has been
    /// reused by a newer session meanwhile.
    fn forget(&self, session: &Arc<PtySession>) {
        let mut sessions = self.sessions.lock().unwrap();
        if sessions
            .get(session.id())
            .is_some_and(|current| Arc::ptr_eq(current, session))
        {
            sessions.remove(session.id());
        }
    }
}
