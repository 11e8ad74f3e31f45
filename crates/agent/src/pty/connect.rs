//! One WebSocket client of a PTY session: a `connected` control message
//! first, then terminal output as binary messages and client messages (text
//! or binary) as keyboard input; when the shell ends, an `exited` control
//! message (for clients that offered the exit-control subprotocol) and a
//! close frame whose reason is `{"exitCode":N,"exitReason":...}`.

use std::sync::{Arc, Weak};

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use serde_json::json;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};

use super::{PtySession, Registry};
use crate::error::ApiError;

/// Subprotocol by which a client asks for the `exited` control message.
pub(super) const EXIT_CONTROL_SUBPROTOCOL: &str = "X-Daytona-Pty-Exit-Control";

const CLOSE_NORMAL: u16 = 1000;
const CLOSE_POLICY: u16 = 1008;
const CLOSE_INTERNAL: u16 = 1011;

pub(super) async fn serve(
    session: Arc<PtySession>,
    registry: Weak<Registry>,
    mut socket: WebSocket,
    exit_control: bool,
) {
    // Subscribe before a lazy session starts, so its first output is seen.
    let (mut output, mut exit) = session.subscribe();
    // Told before the shell starts: the sync SDK waits only 100 ms for this
    // message (its timeout handling misses httpx_ws' `queue.Empty`), and
    // spawning a shell can take longer than that in a VM under emulation. A
    // shell that then fails to start is reported by an `error` message.
    session.mark_starting();
    let connected = json!({"type": "control", "status": "connected"});
    if socket
        .send(Message::Text(connected.to_string().into()))
        .await
        .is_err()
    {
        return;
    }
    // Forking the shell blocks; off the async workers, which in a one-vCPU VM
    // are one thread that also carries the virtio-serial channel.
    let starting = session.clone();
    let started = tokio::task::spawn_blocking(move || starting.start(registry))
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::internal(
                "starting the pty shell",
                std::io::Error::other(e.to_string()),
            ))
        });
    let terminal = match started {
        Ok(terminal) => terminal,
        Err(e) => {
            let error = json!({
                "type": "control",
                "status": "error",
                "error": format!("failed to connect to pty session: {e}"),
            });
            let _ = socket.send(Message::Text(error.to_string().into())).await;
            close(&mut socket, CLOSE_INTERNAL, e.to_string()).await;
            return;
        }
    };
    loop {
        if exit.borrow_and_update().is_some() {
            break;
        }
        tokio::select! {
            chunk = output.recv() => match chunk {
                Ok(chunk) => {
                    if socket.send(Message::Binary(chunk)).await.is_err() {
                        return;
                    }
                }
                Err(RecvError::Lagged(_)) => {
                    close(&mut socket, CLOSE_POLICY, "slow consumer".into()).await;
                    return;
                }
                Err(RecvError::Closed) => return,
            },
            changed = exit.changed() => if changed.is_err() {
                return;
            },
            incoming = socket.recv() => {
                let input = match incoming {
                    Some(Ok(Message::Binary(data))) => data,
                    Some(Ok(Message::Text(text))) => text.as_bytes().to_vec().into(),
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                    Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return,
                };
                if terminal.write_all(&input).await.is_err() {
                    close(&mut socket, CLOSE_INTERNAL, "pty session unavailable".into()).await;
                    return;
                }
            }
        }
    }
    // The pump sent all output before recording the exit code.
    loop {
        match output.try_recv() {
            Ok(chunk) => {
                if socket.send(Message::Binary(chunk)).await.is_err() {
                    return;
                }
            }
            Err(TryRecvError::Lagged(_)) => continue,
            Err(_) => break,
        }
    }
    let code = exit.borrow().unwrap_or(-1);
    let reason = exit_reason(code);
    if exit_control {
        let mut exited = json!({"type": "control", "status": "exited", "exitCode": code});
        if let Some(reason) = &reason {
            exited["exitReason"] = reason.clone().into();
        }
        let _ = socket.send(Message::Text(exited.to_string().into())).await;
    }
    let mut data = json!({ "exitCode": code });
    if let Some(reason) = reason {
        data["exitReason"] = reason.into();
    }
    let close_code = if code == 0 {
        CLOSE_NORMAL
    } else {
        CLOSE_INTERNAL
    };
    close(&mut socket, close_code, data.to_string()).await;
}

async fn close(socket: &mut WebSocket, code: u16, reason: String) {
    let frame = CloseFrame {
        code,
        reason: reason.into(),
    };
    let _ = socket.send(Message::Close(Some(frame))).await;
}

/// Human words for an exit code, as Daytona's daemon gives them; none for 0.
fn exit_reason(code: i32) -> Option<String> {
    match code {
        0 => None,
        130 => Some("Ctrl+C".into()),
        137 => Some("SIGKILL".into()),
        143 => Some("SIGTERM".into()),
        code if code > 128 => Some(format!("signal {}", code - 128)),
        _ => Some("non-zero exit".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::exit_reason;

    #[test]
    fn exit_reasons_name_signals() {
        assert_eq!(exit_reason(0), None);
        assert_eq!(exit_reason(137).as_deref(), Some("SIGKILL"));
        assert_eq!(exit_reason(129).as_deref(), Some("signal 1"));
        assert_eq!(exit_reason(3).as_deref(), Some("non-zero exit"));
    }
}
