//! `POST /process/execute`: one command, one shell, output collected in the
//! order it was produced, a deadline that kills the command's whole process
//! group. [`run`] is also how `/process/code-run` runs its program.
//!
//! A command that leaves a background process holding its output open (`cmd &`)
//! is answered [`EXIT_GRACE`] after it exits, not at its deadline: the SDK's
//! users start servers that way. The background process keeps running, and
//! the agent keeps its output pipe open (reading and discarding) so it never
//! writes into a closed pipe.
//!
//! This is on the benchmark path: per request there is one pipe, one spawn and
//! one read loop, nothing else.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use cove_protocol::execute::{ExecuteRequest, ExecuteResponse, PATH};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt as _;
use tokio::net::unix::pipe;
use tokio::time::Instant;

use crate::error::{ApiError, Json};
use crate::AppState;

/// Exit code reported when the deadline killed the command, as `timeout(1)` does.
pub const TIMED_OUT_EXIT_CODE: i32 = 124;

/// How long output is still collected after the command has exited while a
/// process it started keeps the output open: enough for what that process
/// prints at once (a server's "listening on"), short enough that `cmd &`
/// answers promptly.
pub const EXIT_GRACE: Duration = Duration::from_secs(1);

/// Most outputs the agent keeps draining for background processes at once;
/// beyond it such an output is closed, and its writers get `EPIPE`. One file
/// descriptor and one idle task each.
const MAX_DETACHED_OUTPUTS: usize = 256;

static DETACHED_OUTPUTS: AtomicUsize = AtomicUsize::new(0);

pub fn routes() -> Router<AppState> {
    Router::new().route(PATH, post(execute))
}

async fn execute(
    State(state): State<AppState>,
    Json(request): Json<ExecuteRequest>,
) -> Result<Json<ExecuteResponse>, ApiError> {
    let settings = &state.settings;
    let cwd = match request.cwd.as_deref() {
        Some(cwd) if !cwd.is_empty() => settings.resolve(cwd),
        _ => settings.work_dir.clone(),
    };
    let deadline = match request.timeout {
        Some(seconds) if seconds > 0 => Duration::from_secs(seconds),
        _ => settings.default_exec_timeout,
    };
    let mut command = match direct_program(&request.command, request.envs.as_ref()) {
        Some((program, args)) => {
            let mut command = std::process::Command::new(program);
            command.args(args).env("PWD", &cwd);
            command
        }
        None => {
            let mut command = std::process::Command::new(&settings.exec_shell);
            command.arg("-c").arg(&request.command);
            command
        }
    };
    command.envs(request.envs.iter().flatten());
    let finished = run(command, &cwd, deadline).await?;
    Ok(Json(ExecuteResponse {
        exit_code: finished.exit_code,
        result: String::from_utf8_lossy(&finished.output).into_owned(),
        timed_out: finished.timed_out,
    }))
}

/// How a command run by [`run`] ended.
#[derive(Debug)]
pub struct Finished {
    /// Standard output and error, in the order they were written.
    pub output: Vec<u8>,
    pub exit_code: i32,
    /// The deadline killed the command ([`TIMED_OUT_EXIT_CODE`]).
    pub timed_out: bool,
}

/// Runs `command` in `cwd` as the leader of a new process group, stdin from
/// `/dev/null`, stdout and stderr on one pipe, until it exits (plus
/// [`EXIT_GRACE`] if a process it started holds the pipe) or until `deadline`,
/// which kills the group.
pub async fn run(
    mut command: std::process::Command,
    cwd: &Path,
    deadline: Duration,
) -> Result<Finished, ApiError> {
    // One pipe for stdout and stderr keeps them in the order they were written.
    let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| ApiError::internal("creating output pipe", e.into()))?;
    let writer_for_stderr = writer
        .try_clone()
        .map_err(|e| ApiError::internal("duplicating output pipe", e))?;
    command
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::from(writer))
        .stderr(Stdio::from(writer_for_stderr))
        .process_group(0);
    let mut command = tokio::process::Command::from(command);
    let mut child = command.spawn().map_err(|e| spawn_error(cwd, e))?;
    // Our copies of the write end must close, or the read below never ends.
    drop(command);
    let pgid = child.id().map(|pid| Pid::from_raw(pid as i32));
    let mut output = pipe::Receiver::from_owned_fd(reader)
        .map_err(|e| ApiError::internal("reading command output", e))?;

    let mut result = Vec::new();
    let deadline = Instant::now() + deadline;
    let ended = tokio::time::timeout_at(
        deadline,
        collect(&mut child, &mut output, &mut result, deadline),
    )
    .await;
    let finished = match ended {
        Ok(status) => {
            let status = status.map_err(|e| ApiError::internal("waiting for command", e))?;
            Finished {
                output: result,
                exit_code: exit_code(status),
                timed_out: false,
            }
        }
        Err(_) => {
            if let Some(pgid) = pgid {
                let _ = killpg(pgid, Signal::SIGKILL);
            }
            let _ = child.wait().await;
            Finished {
                output: result,
                exit_code: TIMED_OUT_EXIT_CODE,
                timed_out: true,
            }
        }
    };
    // Open only if a process outside the group (or one started in the
    // background) still holds it.
    detach(output);
    Ok(finished)
}

/// Reads `output` into `result` until the pipe closes and the child has
/// exited; if the child exits first, reads on for at most [`EXIT_GRACE`]
/// (never past `deadline`). A command whose output closes with it is answered
/// at once.
async fn collect(
    child: &mut tokio::process::Child,
    output: &mut pipe::Receiver,
    result: &mut Vec<u8>,
    deadline: Instant,
) -> std::io::Result<ExitStatus> {
    let mut buffer = vec![0; 64 * 1024];
    let status = loop {
        tokio::select! {
            read = output.read(&mut buffer) => match read {
                Ok(n) if n > 0 => result.extend_from_slice(&buffer[..n]),
                // End of file (or a broken pipe): only the exit is left.
                _ => return child.wait().await,
            },
            status = child.wait() => break status?,
        }
    };
    let grace_over = (Instant::now() + EXIT_GRACE).min(deadline);
    loop {
        tokio::select! {
            read = output.read(&mut buffer) => match read {
                Ok(n) if n > 0 => result.extend_from_slice(&buffer[..n]),
                _ => return Ok(status),
            },
            () = tokio::time::sleep_until(grace_over) => return Ok(status),
        }
    }
}

/// Keeps reading (and discarding) an output pipe some background process may
/// still hold, so it never writes into a closed pipe, until that process
/// closes it; returns at once. Past [`MAX_DETACHED_OUTPUTS`] the pipe is closed.
fn detach(mut output: pipe::Receiver) {
    let reserved = DETACHED_OUTPUTS.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        (n < MAX_DETACHED_OUTPUTS).then_some(n + 1)
    });
    if reserved.is_err() {
        return;
    }
    tokio::spawn(async move {
        let mut sink = vec![0; 16 * 1024];
        while let Ok(n) = output.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
        DETACHED_OUTPUTS.fetch_sub(1, Ordering::AcqRel);
    });
}

/// Words a shell would treat specially somewhere in a simple command; a
/// command made only of other characters means the same with or without a shell.
fn is_plain(c: char) -> bool {
    c.is_ascii_alphanumeric()
        || matches!(
            c,
            ' ' | '-' | '_' | '.' | '/' | ':' | ',' | '@' | '%' | '+' | '='
        )
}

/// Shell keywords and builtins that also exist as programs but behave differently.
const SHELL_ONLY: &[&str] = &[
    "time", "exec", "command", "builtin", "type", "hash", "ulimit", "umask",
];

/// The program and arguments of a command that needs no shell: plain words only,
/// no assignment, a program found on `PATH`. bash itself execs such a command
/// without a fork of its own; skipping the shell saves its start-up (measured
/// here: about 2 ms of a 3 ms `true`). Anything else runs through the shell.
pub fn direct_program(
    command: &str,
    envs: Option<&BTreeMap<String, String>>,
) -> Option<(PathBuf, Vec<String>)> {
    if !command.chars().all(is_plain) || envs.is_some_and(|e| e.contains_key("PATH")) {
        return None;
    }
    let mut words = command.split(' ').filter(|w| !w.is_empty());
    let first = words.next()?;
    if first.contains('=') || first.contains('/') || SHELL_ONLY.contains(&first) {
        return None;
    }
    let path = std::env::var_os("PATH")?;
    let program = find_on_path(first, &path)?;
    Some((program, words.map(str::to_owned).collect()))
}

/// The first executable file `name` in the directories of `path` (a `PATH` value).
pub fn find_on_path(name: &str, path: &OsStr) -> Option<PathBuf> {
    std::env::split_paths(path)
        .map(|dir| dir.join(name))
        .find(|candidate| {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Exit status as a shell reports it: the code, or 128 + the killing signal.
pub fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|signal| 128 + signal))
        .unwrap_or(-1)
}

fn spawn_error(cwd: &Path, error: std::io::Error) -> ApiError {
    // The only path a spawn touches besides the shell is the working directory.
    if !cwd.is_dir() {
        return ApiError::io(cwd, error);
    }
    ApiError::internal("starting the command", error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_commands_skip_the_shell() {
        let (program, args) = direct_program("true", None).unwrap();
        assert!(program.ends_with("true"));
        assert!(args.is_empty());
        let (_, args) = direct_program("ls  -la /tmp --color=never", None).unwrap();
        assert_eq!(args, ["-la", "/tmp", "--color=never"]);
        for shell_needed in [
            "echo $HOME",
            "cd /tmp",
            "export A=1",
            "A=1 env",
            "ls *",
            "true && false",
            "echo 'x'",
            "time true",
            "./script",
            "no-such-program-anywhere",
            "echo a\tb",
            "",
        ] {
            assert!(
                direct_program(shell_needed, None).is_none(),
                "{shell_needed}"
            );
        }
        let path = BTreeMap::from([("PATH".to_string(), "/x".to_string())]);
        assert!(direct_program("true", Some(&path)).is_none());
    }
}
