//! One SSH session channel: it collects `pty-req` and `env`, then runs what
//! `exec` or `shell` asks for inside the sandbox through its agent.
//!
//! - `exec` runs the command with the agent's `/process/execute` and answers
//!   its output and exit status. That endpoint takes no input and returns the
//!   output when the command ends (stdout and stderr in the order written), so
//!   client input is read and dropped while it runs: an interactive program
//!   wants `ssh -t` without a command, a shell.
//! - `shell` opens a PTY session on the agent (the sandbox's login shell, at
//!   the client's terminal size and `TERM`), relays keystrokes and output,
//!   follows `window-change`, and answers the shell's exit status.
//!
//! The channel is always read while anything runs: russh hands a channel's
//! messages over a bounded queue, and a full one would stall the connection.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use cove_engine::Engine;
use futures_util::{SinkExt as _, StreamExt as _};
use russh::server::{Handle, Msg};
use russh::{Channel, ChannelMsg};
use tokio_tungstenite::tungstenite::Message;

use crate::agent::{Agent, Pty};

/// Terminal size when the client asked for no PTY.
const DEFAULT_COLS: u16 = 80;
const DEFAULT_ROWS: u16 = 24;
/// The largest side the agent accepts.
const MAX_SIDE: u32 = 1000;
/// How often a long session counts as activity for the sandbox's idle clock.
const TOUCH_EVERY: Duration = Duration::from_secs(30);
/// The status ssh itself uses when the remote side could not run anything.
const FAILED_STATUS: u32 = 255;

/// What a session channel reaches: its sandbox and the connection it is on.
#[derive(Clone)]
pub(crate) struct Target {
    pub engine: Engine,
    pub sandbox_id: String,
    pub handle: Handle,
}

struct Terminal {
    term: String,
    cols: u16,
    rows: u16,
}

fn side(value: u32, default: u16) -> u16 {
    match value {
        0 => default,
        v => v.min(MAX_SIDE) as u16,
    }
}

/// Serves one session channel until it closes.
pub(crate) async fn serve(mut channel: Channel<Msg>, target: Target) {
    let id = channel.id();
    let mut terminal: Option<Terminal> = None;
    let mut envs = BTreeMap::new();
    while let Some(message) = channel.wait().await {
        match message {
            ChannelMsg::RequestPty {
                term,
                col_width,
                row_height,
                ..
            } => {
                terminal = Some(Terminal {
                    term,
                    cols: side(col_width, DEFAULT_COLS),
                    rows: side(row_height, DEFAULT_ROWS),
                });
                let _ = target.handle.channel_success(id).await;
            }
            // OpenSSH sends `env` without asking for a reply.
            ChannelMsg::SetEnv {
                variable_name,
                variable_value,
                ..
            } => {
                envs.insert(variable_name, variable_value);
            }
            ChannelMsg::Exec { command, .. } => {
                let _ = target.handle.channel_success(id).await;
                let command = String::from_utf8_lossy(&command).into_owned();
                run_exec(channel, &target, &command, &envs).await;
                return;
            }
            ChannelMsg::RequestShell { .. } => {
                let _ = target.handle.channel_success(id).await;
                run_shell(channel, &target, terminal, envs).await;
                return;
            }
            ChannelMsg::RequestSubsystem { .. }
            | ChannelMsg::RequestX11 { .. }
            | ChannelMsg::AgentForward { .. } => {
                let _ = target.handle.channel_failure(id).await;
            }
            ChannelMsg::Close => return,
            _ => {}
        }
    }
}

/// Reports a failure on the channel's stderr and ends it as ssh does.
async fn fail(channel: &Channel<Msg>, message: &str) {
    let text = format!("cove: {message}\r\n");
    let _ = channel
        .extended_data_bytes(1, Bytes::from(text.into_bytes()))
        .await;
    finish(channel, FAILED_STATUS).await;
}

async fn finish(channel: &Channel<Msg>, status: u32) {
    let _ = channel.exit_status(status).await;
    let _ = channel.eof().await;
    let _ = channel.close().await;
}

/// The sandbox's agent, if the sandbox still runs (and counts as activity).
async fn agent(target: &Target) -> Result<Agent, cove_engine::EngineError> {
    let (id, endpoint) = target
        .engine
        .sandboxes()
        .toolbox(&target.sandbox_id)
        .await?;
    Ok(Agent::new(id, endpoint))
}

fn exit_status(code: i32) -> u32 {
    u32::try_from(code).unwrap_or(FAILED_STATUS)
}

async fn run_exec(
    mut channel: Channel<Msg>,
    target: &Target,
    command: &str,
    envs: &BTreeMap<String, String>,
) {
    let agent = match agent(target).await {
        Ok(agent) => agent,
        Err(error) => return fail(&channel, &cove_engine::describe(&error)).await,
    };
    let executed = agent.execute(command, envs);
    tokio::pin!(executed);
    let executed = loop {
        tokio::select! {
            executed = &mut executed => break executed,
            message = channel.wait() => match message {
                // The client went away; the agent's deadline ends the command.
                Some(ChannelMsg::Close) | None => return,
                _ => {}
            },
        }
    };
    match executed {
        Ok(executed) => {
            if !executed.result.is_empty() {
                let output = Bytes::from(executed.result.into_bytes());
                if channel.data_bytes(output).await.is_err() {
                    return;
                }
            }
            if executed.timed_out {
                let _ = channel
                    .extended_data_bytes(1, Bytes::from_static(b"cove: the command timed out\r\n"))
                    .await;
            }
            finish(&channel, exit_status(executed.exit_code)).await;
        }
        Err(error) => fail(&channel, &error_chain(&error)).await,
    }
}

async fn run_shell(
    channel: Channel<Msg>,
    target: &Target,
    terminal: Option<Terminal>,
    mut envs: BTreeMap<String, String>,
) {
    let agent = match agent(target).await {
        Ok(agent) => agent,
        Err(error) => return fail(&channel, &cove_engine::describe(&error)).await,
    };
    let (cols, rows) = match &terminal {
        Some(t) => {
            envs.insert("TERM".into(), t.term.clone());
            (t.cols, t.rows)
        }
        None => (DEFAULT_COLS, DEFAULT_ROWS),
    };
    let Pty { id: pty_id, socket } = match agent.open_pty(cols, rows, &envs).await {
        Ok(pty) => pty,
        Err(error) => return fail(&channel, &error_chain(&error)).await,
    };
    let (mut to_pty, mut from_pty) = socket.split();
    let (mut input, output) = channel.split();

    // Keystrokes and resizes, until the client closes the channel.
    let keys_agent = agent.clone();
    let keys_pty = pty_id.clone();
    let keys = tokio::spawn(async move {
        while let Some(message) = input.wait().await {
            match message {
                ChannelMsg::Data { data } => {
                    let Ok(()) = to_pty.send(Message::Binary(data)).await else {
                        break;
                    };
                }
                ChannelMsg::WindowChange {
                    col_width,
                    row_height,
                    ..
                } => {
                    let (cols, rows) = (side(col_width, cols), side(row_height, rows));
                    if let Err(error) = keys_agent.resize_pty(&keys_pty, cols, rows).await {
                        tracing::debug!(error = %error_chain(&error), "resizing an ssh pty");
                    }
                }
                ChannelMsg::Close => break,
                // EOF on a terminal changes nothing, as with sshd: the shell
                // ends when it is told to (`exit`, Ctrl-D).
                _ => {}
            }
        }
        // The client is gone: end the shell and what it started.
        if let Err(error) = keys_agent.kill_pty(&keys_pty).await {
            tracing::debug!(error = %error_chain(&error), "ending an ssh pty");
        }
    });

    // Output until the shell exits; the exit code comes in a control message
    // (and again in the close frame).
    let mut code: Option<i32> = None;
    let mut touch = tokio::time::interval(TOUCH_EVERY);
    loop {
        let message = tokio::select! {
            message = from_pty.next() => message,
            _ = touch.tick() => {
                target.engine.sandboxes().touch(&target.sandbox_id);
                continue;
            }
        };
        match message {
            Some(Ok(Message::Binary(data))) => {
                if output.data_bytes(data).await.is_err() {
                    break;
                }
            }
            Some(Ok(Message::Text(text))) => {
                if let Some(exited) = control_exit_code(&text) {
                    code = Some(exited);
                } else if let Some(error) = control_error(&text) {
                    let text = format!("cove: {error}\r\n");
                    let _ = output.extended_data_bytes(1, Bytes::from(text)).await;
                }
            }
            Some(Ok(Message::Close(frame))) => {
                if code.is_none() {
                    code = frame.and_then(|f| close_exit_code(&f.reason));
                }
                break;
            }
            Some(Ok(_)) => {}
            Some(Err(_)) | None => break,
        }
    }
    keys.abort();
    let _ = output
        .exit_status(code.map_or(FAILED_STATUS, exit_status))
        .await;
    let _ = output.eof().await;
    let _ = output.close().await;
    if code.is_none() {
        // The relay ended before the shell did (the channel closed).
        let _ = agent.kill_pty(&pty_id).await;
    }
}

/// `{"type":"control","status":"exited","exitCode":N}`
fn control_exit_code(text: &str) -> Option<i32> {
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    if value["type"] != "control" || value["status"] != "exited" {
        return None;
    }
    value["exitCode"]
        .as_i64()
        .and_then(|c| i32::try_from(c).ok())
}

/// `{"type":"control","status":"error","error":"..."}`
fn control_error(text: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    if value["type"] != "control" || value["status"] != "error" {
        return None;
    }
    Some(
        value["error"]
            .as_str()
            .unwrap_or("the terminal failed")
            .to_owned(),
    )
}

/// The close frame's reason: `{"exitCode":N,...}`.
fn close_exit_code(reason: &str) -> Option<i32> {
    let value: serde_json::Value = serde_json::from_str(reason).ok()?;
    value["exitCode"]
        .as_i64()
        .and_then(|c| i32::try_from(c).ok())
}

/// An error and its causes on one line.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_come_from_control_messages_and_close_frames() {
        assert_eq!(
            control_exit_code(r#"{"type":"control","status":"exited","exitCode":3}"#),
            Some(3)
        );
        assert_eq!(
            control_exit_code(r#"{"type":"control","status":"connected"}"#),
            None
        );
        assert_eq!(close_exit_code(r#"{"exitCode":0}"#), Some(0));
        assert_eq!(close_exit_code("slow consumer"), None);
        assert_eq!(
            control_error(r#"{"type":"control","status":"error","error":"boom"}"#).as_deref(),
            Some("boom")
        );
    }

    #[test]
    fn statuses_and_sides() {
        assert_eq!(exit_status(3), 3);
        assert_eq!(exit_status(-1), FAILED_STATUS);
        assert_eq!(side(0, 80), 80);
        assert_eq!(side(5000, 80), 1000);
        assert_eq!(side(120, 80), 120);
    }
}
