//! A small QMP client: one Unix socket to one QEMU process, each command
//! answered by the reply carrying its id.
//!
//! QMP speaks one JSON object per line: a greeting, then answers carrying the
//! `id` of their command (`{"return": ...}` or `{"error": ...}`) and
//! asynchronous events (`{"event": ...}`) in between, which the runtime does
//! not need (they are logged at debug level).

use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::oneshot;

/// How long one command may take before the client gives up on it.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("qmp socket: {0}")]
    Io(#[from] io::Error),
    #[error("qmp command {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("qmp connection closed while waiting for {0}")]
    Closed(String),
    #[error("qmp command {0} got no answer within {COMMAND_TIMEOUT:?}")]
    Timeout(String),
    #[error("qmp: unexpected message {0}")]
    Protocol(String),
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// A connected, negotiated QMP session.
#[derive(Debug)]
pub struct Qmp {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Pending,
    next_id: std::sync::atomic::AtomicU64,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Qmp {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Qmp {
    /// Connects to `socket`, reads the greeting and leaves negotiation mode.
    pub async fn connect(socket: &Path) -> Result<Qmp, QmpError> {
        let stream = UnixStream::connect(socket).await?;
        let (read, write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();
        let greeting = lines
            .next_line()
            .await?
            .ok_or_else(|| QmpError::Closed("the greeting".into()))?;
        if !greeting.contains("\"QMP\"") {
            return Err(QmpError::Protocol(greeting));
        }
        let pending: Pending = Arc::default();
        let reader = tokio::spawn(read_loop(lines, pending.clone()));
        let qmp = Qmp {
            writer: tokio::sync::Mutex::new(write),
            pending,
            next_id: 1.into(),
            reader,
        };
        qmp.execute("qmp_capabilities", json!({})).await?;
        Ok(qmp)
    }

    /// Runs one command; answers its `return` value.
    pub async fn execute(&self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (answer_tx, answer_rx) = oneshot::channel();
        self.pending
            .lock()
            .expect("qmp pending lock")
            .insert(id, answer_tx);
        let mut message = json!({ "execute": command, "id": id });
        if arguments.as_object().is_some_and(|a| !a.is_empty()) {
            message["arguments"] = arguments;
        }
        let mut line = message.to_string();
        line.push('\n');
        let written = self.writer.lock().await.write_all(line.as_bytes()).await;
        if let Err(error) = written {
            self.pending.lock().expect("qmp pending lock").remove(&id);
            return Err(error.into());
        }
        let answer = match tokio::time::timeout(COMMAND_TIMEOUT, answer_rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => return Err(QmpError::Closed(command.to_owned())),
            Err(_) => {
                self.pending.lock().expect("qmp pending lock").remove(&id);
                return Err(QmpError::Timeout(command.to_owned()));
            }
        };
        if let Some(error) = answer.get("error") {
            let text = |key: &str| {
                error
                    .get(key)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned()
            };
            return Err(QmpError::Command {
                command: command.to_owned(),
                class: text("class"),
                desc: text("desc"),
            });
        }
        Ok(answer.get("return").cloned().unwrap_or(Value::Null))
    }
}

async fn read_loop(
    mut lines: tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
    pending: Pending,
) {
    while let Ok(Some(line)) = lines.next_line().await {
        let Ok(message) = serde_json::from_str::<Value>(&line) else {
            tracing::debug!(line, "qmp sent something that is not json");
            continue;
        };
        if let Some(name) = message.get("event").and_then(Value::as_str) {
            let data = message.get("data").cloned().unwrap_or_default();
            tracing::debug!(event = name, %data, "qmp event");
            continue;
        }
        let Some(id) = message.get("id").and_then(Value::as_u64) else {
            continue;
        };
        if let Some(waiter) = pending.lock().expect("qmp pending lock").remove(&id) {
            let _ = waiter.send(message);
        }
    }
    // Dropping the senders tells every waiting command the connection is gone.
    pending.lock().expect("qmp pending lock").clear();
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A QMP server that answers every command with its id, with an event
    /// before the answer to `stop`.
    async fn fake_qemu(listener: UnixListener) {
        let (stream, _) = listener.accept().await.unwrap();
        let (read, mut write) = stream.into_split();
        write
            .write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\r\n")
            .await
            .unwrap();
        let mut lines = BufReader::new(read).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let message: Value = serde_json::from_str(&line).unwrap();
            let id = message["id"].clone();
            let reply = match message["execute"].as_str().unwrap() {
                "broken" => json!({"error": {"class": "GenericError", "desc": "no"}, "id": id}),
                "stop" => {
                    let event = json!({"event": "STOP", "data": {}, "timestamp": {}});
                    write
                        .write_all(format!("{event}\r\n").as_bytes())
                        .await
                        .unwrap();
                    json!({"return": {}, "id": id})
                }
                other => json!({"return": {"echo": other}, "id": id}),
            };
            write
                .write_all(format!("{reply}\r\n").as_bytes())
                .await
                .unwrap();
        }
    }

    #[tokio::test]
    async fn commands_get_their_answers_between_events() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(fake_qemu(listener));
        let qmp = Qmp::connect(&path).await.unwrap();
        let answer = qmp.execute("query-status", json!({})).await.unwrap();
        assert_eq!(answer["echo"], "query-status");
        assert_eq!(qmp.execute("stop", json!({})).await.unwrap(), json!({}));
        let error = qmp.execute("broken", json!({})).await.unwrap_err();
        assert!(error.to_string().contains("GenericError: no"), "{error}");
    }
}
