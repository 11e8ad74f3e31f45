//! One session = one long-lived shell process. Commands are written to its
//! stdin as `command . script` with their streams redirected to FIFOs, so `cd`
//! and `export` persist between commands; after each command the shell prints
//! a status line on its own stdout, which only the agent reads.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::sync::oneshot;

use super::log::CommandRecord;
use crate::error::ApiError;
use crate::execute::exit_code;
use crate::Settings;

pub struct Session {
    pub id: String,
    /// Private directory of this session's scripts and FIFOs.
    pub dir: PathBuf,
    /// Random prefix of the status lines, so no output can fake one.
    token: String,
    stdin: tokio::sync::Mutex<ChildStdin>,
    pgid: Option<Pid>,
    commands: Mutex<Vec<Arc<CommandRecord>>>,
    pending: Arc<Mutex<Pending>>,
}

/// Commands written to the shell whose status line has not arrived yet.
#[derive(Default)]
struct Pending {
    /// The shell has exited; nothing more will run.
    ended: bool,
    waiting: HashMap<String, oneshot::Sender<i32>>,
}

impl Session {
    /// Starts the shell of a new session.
    pub fn start(id: String, settings: &Settings) -> Result<Arc<Self>, ApiError> {
        let dir = settings.state_dir.join(uuid::Uuid::new_v4().to_string());
        create_private_dir(&dir).map_err(|e| ApiError::internal("creating session dir", e))?;
        let cwd = if settings.work_dir.is_dir() {
            settings.work_dir.as_path()
        } else {
            Path::new("/")
        };
        let mut child = tokio::process::Command::new(&settings.session_shell)
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| ApiError::internal("starting the session shell", e))?;
        let stdin = child.stdin.take().expect("stdin is piped");
        let stdout = child.stdout.take().expect("stdout is piped");
        let pgid = child.id().map(|pid| Pid::from_raw(pid as i32));
        let token = format!("COVE-STATUS-{}", uuid::Uuid::new_v4().simple());
        let pending = Arc::new(Mutex::new(Pending::default()));
        tokio::spawn(read_status(stdout, child, token.clone(), pending.clone()));
        Ok(Arc::new(Self {
            id,
            dir,
            token,
            stdin: tokio::sync::Mutex::new(stdin),
            pgid,
            commands: Mutex::default(),
            pending,
        }))
    }

    pub fn commands(&self) -> Vec<Arc<CommandRecord>> {
        self.commands.lock().unwrap().clone()
    }

    pub fn command(&self, id: &str) -> Option<Arc<CommandRecord>> {
        self.commands
            .lock()
            .unwrap()
            .iter()
            .find(|c| c.id == id)
            .cloned()
    }

    pub fn add_command(&self, record: Arc<CommandRecord>) {
        self.commands.lock().unwrap().push(record);
    }

    /// Reserves the status line of command `id`; fails once the shell has exited.
    pub fn expect_status(&self, id: &str) -> Result<oneshot::Receiver<i32>, ApiError> {
        let mut pending = self.pending.lock().unwrap();
        if pending.ended {
            return Err(ApiError::SessionEnded(self.id.clone()));
        }
        let (sender, receiver) = oneshot::channel();
        pending.waiting.insert(id.to_string(), sender);
        Ok(receiver)
    }

    /// Hands the shell one command: source `script` with the given streams.
    pub async fn run(
        &self,
        id: &str,
        script: &Path,
        stdin: &Path,
        stdout: &Path,
        stderr: &Path,
    ) -> Result<(), ApiError> {
        // `command .` keeps a syntax error in the script from ending a POSIX shell.
        let line = format!(
            "command . {} <{} >{} 2>{}; printf '\\n%s %s %d\\n' {} {} \"$?\"\n",
            quote(script),
            quote(stdin),
            quote(stdout),
            quote(stderr),
            self.token,
            id
        );
        let mut shell = self.stdin.lock().await;
        if let Err(e) = shell.write_all(line.as_bytes()).await {
            tracing::debug!(session = %self.id, error = %e, "session shell is gone");
            self.pending.lock().unwrap().waiting.remove(id);
            return Err(ApiError::SessionEnded(self.id.clone()));
        }
        Ok(())
    }

    /// Kills the shell and everything in its process group.
    pub fn kill(&self) {
        if let Some(pgid) = self.pgid {
            let _ = killpg(pgid, Signal::SIGKILL);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Reads status lines until the shell exits, then completes every command
/// still waiting with the shell's own exit status (a command that ran `exit 3`
/// ends with 3).
async fn read_status(
    stdout: ChildStdout,
    mut child: Child,
    token: String,
    pending: Arc<Mutex<Pending>>,
) {
    let mut lines = BufReader::new(stdout);
    let mut line = Vec::new();
    let prefix = format!("{token} ");
    loop {
        line.clear();
        match lines.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&line);
        let Some(rest) = text.trim_end().strip_prefix(&prefix) else {
            continue;
        };
        let mut fields = rest.split(' ');
        let (Some(id), Some(Ok(code))) = (fields.next(), fields.next().map(str::parse::<i32>))
        else {
            continue;
        };
        if let Some(sender) = pending.lock().unwrap().waiting.remove(id) {
            let _ = sender.send(code);
        }
    }
    let status = child.wait().await.map(exit_code).unwrap_or(-1);
    let mut pending = pending.lock().unwrap();
    pending.ended = true;
    for (_, sender) in pending.waiting.drain() {
        let _ = sender.send(status);
    }
}

fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Single-quotes a path for the shell.
fn quote(path: &Path) -> String {
    format!("'{}'", path.to_string_lossy().replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::quote;
    use std::path::Path;

    #[test]
    fn quote_survives_single_quotes() {
        assert_eq!(quote(Path::new("/tmp/it's")), r"'/tmp/it'\''s'");
    }
}
