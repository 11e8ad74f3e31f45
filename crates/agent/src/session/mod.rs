//! Sessions (`/process/session...`): named, long-lived shells that keep their
//! working directory and exported variables across commands, with per-command
//! output, exit codes and logs. Owns the session and async-command limits.

mod command;
mod follow;
mod log;
pub(crate) mod routes;
mod shell;

use std::collections::BTreeMap;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

pub use log::{CommandRecord, Logs, Stream};
pub use routes::routes;
pub use shell::Session;

use crate::error::ApiError;
use crate::Settings;

/// Every live session of this agent.
pub struct Registry {
    settings: Arc<Settings>,
    sessions: Mutex<BTreeMap<String, Arc<Session>>>,
    async_running: Arc<AtomicUsize>,
}

impl Registry {
    pub fn new(settings: Arc<Settings>) -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt as _;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&settings.state_dir)?;
        Ok(Self {
            settings,
            sessions: Mutex::default(),
            async_running: Arc::default(),
        })
    }

    pub fn create(&self, id: String) -> Result<Arc<Session>, ApiError> {
        if id.is_empty() {
            return Err(ApiError::BadRequest("sessionId must not be empty".into()));
        }
        let mut sessions = self.sessions.lock().unwrap();
        if sessions.contains_key(&id) {
            return Err(ApiError::SessionExists(id));
        }
        let limit = self.settings.max_sessions;
        if sessions.len() >= limit {
            return Err(ApiError::LimitReached {
                what: "sessions",
                limit,
            });
        }
        let session = Session::start(id.clone(), &self.settings)?;
        sessions.insert(id, session.clone());
        Ok(session)
    }

    pub fn get(&self, id: &str) -> Result<Arc<Session>, ApiError> {
        self.sessions
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::SessionNotFound(id.to_string()))
    }

    pub fn list(&self) -> Vec<Arc<Session>> {
        self.sessions.lock().unwrap().values().cloned().collect()
    }

    pub fn delete(&self, id: &str) -> Result<(), ApiError> {
        let session = self
            .sessions
            .lock()
            .unwrap()
            .remove(id)
            .ok_or_else(|| ApiError::SessionNotFound(id.to_string()))?;
        session.kill();
        Ok(())
    }

    /// Runs `command` in session `id`; an asynchronous command takes one of the
    /// limited slots until it ends.
    pub async fn exec(
        &self,
        id: &str,
        command: String,
        is_async: bool,
        echo_input: bool,
    ) -> Result<Arc<CommandRecord>, ApiError> {
        let session = self.get(id)?;
        let slot = if is_async {
            Some(command::AsyncSlot::acquire(
                &self.async_running,
                self.settings.max_async_commands,
            )?)
        } else {
            None
        };
        command::start(
            &session,
            command,
            slot,
            echo_input,
            self.settings.max_log_bytes,
        )
        .await
    }

    pub async fn send_input(
        &self,
        id: &str,
        command_id: &str,
        data: &[u8],
    ) -> Result<(), ApiError> {
        let record = self.command(id, command_id)?;
        command::send_input(&record, data).await
    }

    pub fn command(&self, id: &str, command_id: &str) -> Result<Arc<CommandRecord>, ApiError> {
        self.get(id)?
            .command(command_id)
            .ok_or_else(|| ApiError::CommandNotFound(command_id.to_string()))
    }

    /// Kills every session's shell (agent shutdown).
    pub fn shutdown(&self) {
        for (_, session) in std::mem::take(&mut *self.sessions.lock().unwrap()) {
            session.kill();
        }
        let _ = std::fs::remove_dir_all(&self.settings.state_dir);
    }
}
