//! One run over `/process/interpreter/execute`: the client sends one JSON
//! request, the server streams the driver's events as JSON text messages and
//! ends the run by closing the socket: 1000 when the code finished (errors
//! included), 4008 when the timeout interrupted it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use serde::Deserialize;
use tokio::time::{sleep_until, Instant};

use super::worker::RunRequest;
use super::Registry;
use crate::Settings;

/// Deadline of a run that names none, as in Daytona's daemon.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// How long an interrupted run may take to unwind before its driver is
/// killed (and the context restarts empty on its next run).
const INTERRUPT_GRACE: Duration = Duration::from_secs(3);

const CLOSE_NORMAL: u16 = 1000;
const CLOSE_PROTOCOL: u16 = 1002;
const CLOSE_POLICY: u16 = 1008;
const CLOSE_INTERNAL: u16 = 1011;
/// The SDK turns this close code into `DaytonaTimeoutError`.
const CLOSE_TIMEOUT: u16 = 4008;

/// The first message of a run. Not the server's `/process/execute` message
/// (`cove_protocol::ExecuteRequest`): only the SDK sends this one.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InterpreterExecuteRequest {
    code: String,
    context_id: Option<String>,
    #[serde(default)]
    envs: HashMap<String, String>,
    /// Seconds; 0 means none.
    timeout: Option<i64>,
}

/// How the run ended.
enum Outcome {
    Finished,
    TimedOut,
    /// The run ignored the interrupt; its driver has to be killed.
    Killed,
    /// The driver exited during the run.
    WorkerEnded(String),
}

pub(crate) async fn serve(mut socket: WebSocket, registry: Arc<Registry>, settings: Arc<Settings>) {
    let request = match first_request(&mut socket).await {
        Ok(request) => request,
        Err((code, reason)) => return close(&mut socket, code, reason).await,
    };
    if request.code.is_empty() {
        return close(&mut socket, CLOSE_POLICY, "code is required".into()).await;
    }
    let timeout = match request.timeout {
        None => Some(DEFAULT_TIMEOUT),
        Some(0) => None,
        Some(seconds) if seconds > 0 => Some(Duration::from_secs(seconds as u64)),
        Some(_) => {
            let reason = "timeout must be greater than or equal to 0".into();
            return close(&mut socket, CLOSE_POLICY, reason).await;
        }
    };
    let context = match registry.get(request.context_id.as_deref(), &settings) {
        Ok(context) => context,
        Err(e) => return close(&mut socket, CLOSE_POLICY, e.to_string()).await,
    };

    let mut slot = context.worker.lock().await;
    let worker = match context.ensure_worker(&mut slot, &settings) {
        Ok(worker) => worker,
        Err(e) => return close(&mut socket, CLOSE_INTERNAL, e.to_string()).await,
    };
    let run = RunRequest {
        code: &request.code,
        envs: &request.envs,
    };
    if let Err(e) = worker.send(&run).await {
        context.discard_worker(&mut slot);
        let reason = format!("interpreter context {} is gone: {e}", context.id);
        return close(&mut socket, CLOSE_INTERNAL, reason).await;
    }

    let far_future = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
    let deadline = timeout.map_or(far_future, |t| Instant::now() + t);
    let mut kill_at: Option<Instant> = None;
    let mut client_gone = false;
    let outcome = loop {
        tokio::select! {
            event = worker.next_event() => match event {
                Some(line) => {
                    if is_done(&line) {
                        break if kill_at.is_some() { Outcome::TimedOut } else { Outcome::Finished };
                    }
                    if !client_gone && socket.send(Message::Text(line.into())).await.is_err() {
                        client_gone = true;
                    }
                }
                None => {
                    let code = worker.exit_code().await;
                    break Outcome::WorkerEnded(format!(
                        "the interpreter process exited with code {code}; \
                         the context starts empty on its next run"
                    ));
                }
            },
            _ = sleep_until(deadline), if kill_at.is_none() => {
                worker.interrupt();
                kill_at = Some(Instant::now() + INTERRUPT_GRACE);
            },
            _ = sleep_until(kill_at.unwrap_or(far_future)), if kill_at.is_some() => {
                break Outcome::Killed;
            },
            // Reading keeps pings answered; the client has nothing else to say.
            incoming = socket.recv(), if !client_gone => {
                if matches!(incoming, None | Some(Err(_)) | Some(Ok(Message::Close(_)))) {
                    client_gone = true;
                }
            },
        }
    };
    match outcome {
        Outcome::Finished => {
            drop(slot);
            close(&mut socket, CLOSE_NORMAL, String::new()).await;
        }
        Outcome::TimedOut => {
            drop(slot);
            let reason = "execution timed out".into();
            close(&mut socket, CLOSE_TIMEOUT, reason).await;
        }
        Outcome::Killed => {
            context.discard_worker(&mut slot);
            drop(slot);
            let error = serde_json::json!({
                "type": "error",
                "name": "TimeoutError",
                "value": "the run did not stop when interrupted, so its interpreter process \
                          was killed; the context starts empty on its next run",
                "traceback": "",
            });
            let _ = socket.send(Message::Text(error.to_string().into())).await;
            close(&mut socket, CLOSE_TIMEOUT, "execution timed out".into()).await;
        }
        Outcome::WorkerEnded(message) => {
            context.discard_worker(&mut slot);
            drop(slot);
            let error = serde_json::json!({
                "type": "error",
                "name": "InterpreterExited",
                "value": message,
                "traceback": "",
            });
            let _ = socket.send(Message::Text(error.to_string().into())).await;
            close(&mut socket, CLOSE_NORMAL, String::new()).await;
        }
    }
}

/// The run request, the client's first message.
async fn first_request(socket: &mut WebSocket) -> Result<InterpreterExecuteRequest, (u16, String)> {
    loop {
        let payload = match socket.recv().await {
            Some(Ok(Message::Text(text))) => text.as_bytes().to_vec(),
            Some(Ok(Message::Binary(data))) => data.to_vec(),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            _ => return Err((CLOSE_PROTOCOL, "failed to read the run request".into())),
        };
        return serde_json::from_slice(&payload)
            .map_err(|e| (CLOSE_PROTOCOL, format!("invalid run request: {e}")));
    }
}

/// The driver's end-of-run marker, which is not forwarded.
fn is_done(line: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(line).is_ok_and(|event| event["type"] == "done")
}

async fn close(socket: &mut WebSocket, code: u16, reason: String) {
    // A close reason is at most 123 bytes.
    let mut end = reason.len().min(123);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let frame = CloseFrame {
        code,
        reason: reason[..end].into(),
    };
    let _ = socket.send(Message::Close(Some(frame))).await;
}
