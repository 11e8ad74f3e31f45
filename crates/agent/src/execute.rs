//! `POST /process/execute`: one command, one shell, output collected in the
//! order it was produced, a deadline that kills the command's whole process
//! group.
//!
//! This is on the benchmark path: per request there is one pipe, one spawn and
//! one read loop, nothing else.

use std::collections::BTreeMap;
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use cove_protocol::execute::{ExecuteRequest, ExecuteResponse, PATH};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt as _;

use crate::error::{ApiError, Json};
use crate::AppState;

/// Exit code reported when the deadline killed the command, as `timeout(1)` does.
pub const TIMED_OUT_EXIT_CODE: i32 = 124;

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

    // One pipe for stdout and stderr keeps them in the order they were written.
    let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| ApiError::internal("creating output pipe", e.into()))?;
    let writer_for_stderr = writer
        .try_clone()
        .map_err(|e| ApiError::internal("duplicating output pipe", e))?;
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
    command
        .current_dir(&cwd)
        .envs(request.envs.iter().flatten())
        .stdin(Stdio::null())
        .stdout(Stdio::from(writer))
        .stderr(Stdio::from(writer_for_stderr))
        .process_group(0);
    let mut command = tokio::process::Command::from(command);
    let mut child = command.spawn().map_err(|e| spawn_error(&cwd, e))?;
    // Our copies of the write end must close, or the read below never ends.
    drop(command);
    let pgid = child.id().map(|pid| Pid::from_raw(pid as i32));
    let mut output = tokio::net::unix::pipe::Receiver::from_owned_fd(reader)
        .map_err(|e| ApiError::internal("reading command output", e))?;

    let mut result = Vec::new();
    let finished = tokio::time::timeout(deadline, async {
        // A background process that keeps the pipe open keeps us reading;
        // the SDK documents that behaviour.
        output.read_to_end(&mut result).await?;
        child.wait().await
    })
    .await;
    let response = match finished {
        Ok(status) => {
            let status = status.map_err(|e| ApiError::internal("waiting for command", e))?;
            ExecuteResponse {
                exit_code: exit_code(status),
                result: String::from_utf8_lossy(&result).into_owned(),
                timed_out: false,
            }
        }
        Err(_) => {
            if let Some(pgid) = pgid {
                let _ = killpg(pgid, Signal::SIGKILL);
            }
            let _ = child.wait().await;
            ExecuteResponse {
                exit_code: TIMED_OUT_EXIT_CODE,
                result: String::from_utf8_lossy(&result).into_owned(),
                timed_out: true,
            }
        }
    };
    Ok(Json(response))
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
) -> Option<(std::path::PathBuf, Vec<String>)> {
    if !command.chars().all(is_plain) || envs.is_some_and(|e| e.contains_key("PATH")) {
        return None;
    }
    let mut words = command.split(' ').filter(|w| !w.is_empty());
    let first = words.next()?;
    if first.contains('=') || first.contains('/') || SHELL_ONLY.contains(&first) {
        return None;
    }
    let path = std::env::var_os("PATH")?;
    let program = std::env::split_paths(&path)
        .map(|dir| dir.join(first))
        .find(|candidate| {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })?;
    Some((program, words.map(str::to_owned).collect()))
}

/// Exit status as a shell reports it: the code, or 128 + the killing signal.
pub fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|signal| 128 + signal))
        .unwrap_or(-1)
}

fn spawn_error(cwd: &std::path::Path, error: std::io::Error) -> ApiError {
    // The only path a spawn touches besides the shell is the working directory.
    if !cwd.is_dir() {
        return ApiError::io(cwd, error);
    }
    ApiError::internal("starting the shell", error)
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
