//! One PTY session: its settings, its terminal once started, and the fan-out
//! of terminal output to every connected client.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use tokio::process::Child;
use tokio::sync::{broadcast, watch};

use super::terminal::{Launch, Terminal};
use super::Registry;
use crate::error::ApiError;
use crate::execute::exit_code;

/// Output chunks buffered per client before it counts as too slow and is dropped.
const CLIENT_BACKLOG: usize = 1024;
/// After the shell exits, output still in flight is read until the terminal
/// has been quiet this long (the kernel hands slave writes to the master
/// asynchronously, so an immediate read can miss the last lines).
const DRAIN_QUIET: Duration = Duration::from_millis(100);

/// `PtySessionInfo` of the toolbox API.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PtySessionInfo {
    pub id: String,
    pub active: bool,
    pub cols: u16,
    pub rows: u16,
    pub cwd: String,
    pub envs: BTreeMap<String, String>,
    pub created_at: String,
    pub lazy_start: bool,
}

/// What a new session starts with.
pub struct PtySpec {
    pub id: String,
    pub shell: PathBuf,
    pub cwd: PathBuf,
    pub envs: BTreeMap<String, String>,
    pub cols: u16,
    pub rows: u16,
    pub lazy_start: bool,
}

pub struct PtySession {
    spec: PtySpec,
    created_at: String,
    state: Mutex<State>,
    output: broadcast::Sender<Bytes>,
    /// Exit code of the shell once it has ended and its output has been sent.
    exit: watch::Sender<Option<i32>>,
}

struct State {
    cols: u16,
    rows: u16,
    phase: Phase,
    /// A client connected and the shell is being started for it: the
    /// session counts as active from then on (see `mark_starting`).
    starting: bool,
}

enum Phase {
    /// Lazy session nobody has connected to yet.
    NotStarted,
    Running(Arc<Terminal>),
    Ended,
}

impl PtySession {
    pub fn new(spec: PtySpec) -> Arc<Self> {
        let created_at = time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        Arc::new(Self {
            state: Mutex::new(State {
                cols: spec.cols,
                rows: spec.rows,
                phase: Phase::NotStarted,
                starting: false,
            }),
            spec,
            created_at,
            output: broadcast::channel(CLIENT_BACKLOG).0,
            exit: watch::channel(None).0,
        })
    }

    pub fn id(&self) -> &str {
        &self.spec.id
    }

    pub fn info(&self) -> PtySessionInfo {
        let state = self.state.lock().unwrap();
        PtySessionInfo {
            id: self.spec.id.clone(),
            active: match state.phase {
                Phase::Running(_) => true,
                Phase::NotStarted => state.starting,
                Phase::Ended => false,
            },
            cols: state.cols,
            rows: state.rows,
            cwd: self.spec.cwd.to_string_lossy().into_owned(),
            envs: self.spec.envs.clone(),
            created_at: self.created_at.clone(),
            lazy_start: self.spec.lazy_start,
        }
    }

    /// Says a client is about to start the shell, which it does after it
    /// has told the client it is connected: from then on the session is
    /// active, as the client was told.
    pub fn mark_starting(&self) {
        self.state.lock().unwrap().starting = true;
    }

    /// Starts the shell unless it already runs; `registry` forgets the
    /// session when the shell ends.
    pub fn start(self: &Arc<Self>, registry: Weak<Registry>) -> Result<Arc<Terminal>, ApiError> {
        let mut state = self.state.lock().unwrap();
        let started = self.start_locked(&mut state, registry);
        if started.is_err() {
            state.starting = false;
        }
        started
    }

    fn start_locked(
        self: &Arc<Self>,
        state: &mut State,
        registry: Weak<Registry>,
    ) -> Result<Arc<Terminal>, ApiError> {
        match &state.phase {
            Phase::Running(terminal) => return Ok(terminal.clone()),
            Phase::Ended => return Err(ApiError::SessionEnded(self.spec.id.clone())),
            Phase::NotStarted => {}
        }
        let launch = Launch {
            shell: &self.spec.shell,
            cwd: &self.spec.cwd,
            envs: &self.spec.envs,
            cols: state.cols,
            rows: state.rows,
        };
        let (terminal, child) = Terminal::spawn(&launch).map_err(|e| {
            if self.spec.cwd.is_dir() {
                ApiError::internal("starting the pty shell", e)
            } else {
                ApiError::io(&self.spec.cwd, e)
            }
        })?;
        let terminal = Arc::new(terminal);
        state.phase = Phase::Running(terminal.clone());
        tokio::spawn(pump(self.clone(), terminal.clone(), child, registry));
        Ok(terminal)
    }

    /// Receives terminal output from now on, and the exit code once the shell ended.
    pub fn subscribe(&self) -> (broadcast::Receiver<Bytes>, watch::Receiver<Option<i32>>) {
        (self.output.subscribe(), self.exit.subscribe())
    }

    pub fn resize(&self, cols: u16, rows: u16) -> Result<(), ApiError> {
        let mut state = self.state.lock().unwrap();
        match &state.phase {
            Phase::Running(terminal) => terminal
                .resize(cols, rows)
                .map_err(|e| ApiError::internal("resizing the pty", e))?,
            Phase::NotStarted => {}
            Phase::Ended => return Err(ApiError::SessionEnded(self.spec.id.clone())),
        }
        state.cols = cols;
        state.rows = rows;
        Ok(())
    }

    /// Kills the shell and everything it started; connected clients are told
    /// the exit code (137) and closed by the output pump.
    pub fn kill(&self) {
        let mut state = self.state.lock().unwrap();
        match &state.phase {
            Phase::Running(terminal) => terminal.kill_session(),
            Phase::NotStarted => {
                state.phase = Phase::Ended;
                self.exit.send_replace(Some(exit_code_of_kill()));
            }
            Phase::Ended => {}
        }
    }
}

fn exit_code_of_kill() -> i32 {
    128 + libc::SIGKILL
}

/// Copies terminal output to the clients until the shell has exited and its
/// last output is out, then records the exit code and forgets the session.
async fn pump(
    session: Arc<PtySession>,
    terminal: Arc<Terminal>,
    mut child: Child,
    registry: Weak<Registry>,
) {
    let mut buf = vec![0u8; 32 * 1024];
    let status = loop {
        tokio::select! {
            read = terminal.read(&mut buf) => match read {
                Ok(0) | Err(_) => break child.wait().await,
                Ok(n) => {
                    let _ = session.output.send(Bytes::copy_from_slice(&buf[..n]));
                }
            },
            status = child.wait() => break status,
        }
    };
    while let Ok(Ok(n)) = tokio::time::timeout(DRAIN_QUIET, terminal.read(&mut buf)).await {
        if n == 0 {
            break;
        }
        let _ = session.output.send(Bytes::copy_from_slice(&buf[..n]));
    }
    let code = status.map(exit_code).unwrap_or(-1);
    session.state.lock().unwrap().phase = Phase::Ended;
    session.exit.send_replace(Some(code));
    if let Some(registry) = registry.upgrade() {
        registry.forget(&session);
    }
    tracing::debug!(session = %session.spec.id, code, "pty session ended");
}
