//! The long-lived `python3` process behind one interpreter context: started
//! on the embedded driver script, fed one JSON request line per run, read
//! back as JSON event lines.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::{Child, ChildStdin};
use tokio::sync::mpsc;

/// The driver, written once into the agent's state dir so `ps` shows a path
/// rather than the whole script.
const DRIVER: &str = include_str!("driver.py");
/// Event lines buffered between the driver and the client.
const EVENT_BACKLOG: usize = 64;

/// One run as the driver reads it.
#[derive(Debug, Serialize)]
pub(super) struct RunRequest<'a> {
    pub code: &'a str,
    pub envs: &'a std::collections::HashMap<String, String>,
}

pub(super) struct Worker {
    child: Child,
    requests: ChildStdin,
    events: mpsc::Receiver<String>,
    /// The driver leads its own process group, with whatever it started.
    group: Pid,
}

impl Worker {
    /// Starts `python3` on the driver in `cwd`.
    pub(super) fn spawn(state_dir: &Path, cwd: &Path) -> io::Result<Self> {
        let driver = write_driver(state_dir)?;
        let mut child = tokio::process::Command::new("python3")
            .arg("-u")
            .arg(&driver)
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()?;
        let requests = child.stdin.take().expect("stdin is piped");
        let stdout = child.stdout.take().expect("stdout is piped");
        let group = Pid::from_raw(child.id().map_or(0, |pid| pid as i32));
        let (sender, events) = mpsc::channel(EVENT_BACKLOG);
        // A task of its own, so reading a line is never cut off by a select.
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if sender.send(line).await.is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            requests,
            events,
            group,
        })
    }

    pub(super) async fn send(&mut self, request: &RunRequest<'_>) -> io::Result<()> {
        let mut line = serde_json::to_vec(request).map_err(io::Error::other)?;
        line.push(b'\n');
        self.requests.write_all(&line).await?;
        self.requests.flush().await
    }

    /// The next event line; `None` once the driver has exited.
    pub(super) async fn next_event(&mut self) -> Option<String> {
        self.events.recv().await
    }

    /// Ctrl-C for the run: SIGINT to the driver and everything it started.
    pub(super) fn interrupt(&self) {
        signal_group(self.group, Signal::SIGINT);
    }

    pub(super) fn group(&self) -> Pid {
        self.group
    }

    /// Exit code of a driver that has ended (after [`Self::next_event`] gave `None`).
    pub(super) async fn exit_code(&mut self) -> i32 {
        self.child
            .wait()
            .await
            .map(crate::execute::exit_code)
            .unwrap_or(-1)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        signal_group(self.group, Signal::SIGKILL);
    }
}

pub(super) fn signal_group(group: Pid, signal: Signal) {
    if group.as_raw() > 0 {
        let _ = killpg(group, signal);
    }
}

fn write_driver(state_dir: &Path) -> io::Result<PathBuf> {
    let path = state_dir.join("interpreter-driver.py");
    if std::fs::read_to_string(&path).is_ok_and(|current| current == DRIVER) {
        return Ok(path);
    }
    std::fs::create_dir_all(state_dir)?;
    // Written aside and renamed, so a concurrent start never runs half a script.
    let partial = state_dir.join(format!(".interpreter-driver.{}.py", uuid::Uuid::new_v4()));
    std::fs::write(&partial, DRIVER)?;
    std::fs::rename(&partial, &path)?;
    Ok(path)
}
