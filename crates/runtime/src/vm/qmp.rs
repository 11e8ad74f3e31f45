//! A small QMP client: one Unix socket to one QEMU process, each command
//! answered by the reply carrying its id.
//!
//! QMP speaks one JSON object per line: a greeting, then answers carrying the
//! `id` of their command (`{"return": ...}` or `{"error": ...}`) and
//! asynchronous events (`{"event": ...}`) in between, which the runtime does
//! not need (they are logged at debug level).
//!
//! QEMU runs unprivileged and, under TCG, is no security boundary: what it
//! sends is read in lines of at most [`MAX_LINE`] bytes, and a longer one
//! ends the session. Descriptors QEMU cannot open itself (a TAP device, a
//! file to migrate to) are passed with `getfd` ([`Qmp::pass_fd`]).

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::oneshot;

/// How long one command may take before the client gives up on it.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest message QEMU may send (its answers and events are a few
/// hundred bytes).
const MAX_LINE: usize = 1 << 20;

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
pub(super) struct Qmp {
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
    pub(super) async fn connect(socket: &Path) -> Result<Qmp, QmpError> {
        let stream = UnixStream::connect(socket).await?;
        let (read, write) = stream.into_split();
        let mut lines = BufReader::new(read);
        let greeting = next_line(&mut lines)
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
    pub(super) async fn execute(&self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        self.run(command, arguments, None).await
    }

    /// Hands QEMU a copy of `fd` under `name` (`getfd`), for a later
    /// command to use (`fd:NAME` in a migration URI, `fd` of a netdev).
    pub(super) async fn pass_fd(&self, name: &str, fd: BorrowedFd<'_>) -> Result<(), QmpError> {
        self.run("getfd", json!({ "fdname": name }), Some(fd))
            .await
            .map(|_| ())
    }

    async fn run(
        &self,
        command: &str,
        arguments: Value,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Value, QmpError> {
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
        let written = {
            let mut writer = self.writer.lock().await;
            match fd {
                None => writer.write_all(line.as_bytes()).await,
                Some(fd) => send_with_fd(writer.as_ref(), line.as_bytes(), fd).await,
            }
        };
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

/// Writes `bytes` with `fd` attached (SCM_RIGHTS) to the first part sent.
async fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let fds = [fd.as_raw_fd()];
    let mut sent = 0;
    while sent < bytes.len() {
        stream.writable().await?;
        let attached = [ControlMessage::ScmRights(&fds)];
        let control: &[ControlMessage] = if sent == 0 { &attached } else { &[] };
        let result = stream.try_io(Interest::WRITABLE, || {
            let parts = [io::IoSlice::new(&bytes[sent..])];
            sendmsg::<()>(
                stream.as_raw_fd(),
                &parts,
                control,
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(io::Error::from)
        });
        match result {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// The next line QEMU sent, without its end; `None` at the end of the
/// stream. A line over [`MAX_LINE`] bytes is an error.
async fn next_line(reader: &mut BufReader<OwnedReadHalf>) -> io::Result<Option<String>> {
    let mut line = Vec::new();
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok((!line.is_empty()).then(|| String::from_utf8_lossy(&line).into_owned()));
        }
        let (taken, done) = match available.iter().position(|b| *b == b'\n') {
            Some(end) => (end + 1, true),
            None => (available.len(), false),
        };
        line.extend_from_slice(&available[..taken]);
        reader.consume(taken);
        if line.len() > MAX_LINE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("qemu sent a message over {MAX_LINE} bytes"),
            ));
        }
        if done {
            while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                line.pop();
            }
            return Ok(Some(String::from_utf8_lossy(&line).into_owned()));
        }
    }
}

async fn read_loop(mut lines: BufReader<OwnedReadHalf>, pending: Pending) {
    while let Ok(Some(line)) = next_line(&mut lines).await {
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

    /// Answers `qmp_capabilities`, then one command received with recvmsg,
    /// telling whether a descriptor came with it; then sends `tail`.
    fn fake_qemu_with_fd(listener: std::os::unix::net::UnixListener, tail: Vec<u8>) {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        use std::io::{BufRead, Write};
        let (mut stream, _) = listener.accept().unwrap();
        stream.write_all(b"{\"QMP\": {}}\n").unwrap();
        let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        stream.write_all(b"{\"return\": {}, \"id\": 1}\n").unwrap();
        let mut buf = [0u8; 256];
        let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
        let mut parts = [std::io::IoSliceMut::new(&mut buf)];
        let message = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut parts,
            Some(&mut space),
            MsgFlags::empty(),
        )
        .unwrap();
        let got_fd = message.cmsgs().unwrap().any(|c| match c {
            ControlMessageOwned::ScmRights(fds) => {
                fds.iter().for_each(|fd| {
                    let _ = nix::unistd::close(*fd);
                });
                !fds.is_empty()
            }
            _ => false,
        });
        let reply = format!("{{\"return\": {{\"fd\": {got_fd}}}, \"id\": 2}}\n");
        stream.write_all(reply.as_bytes()).unwrap();
        stream.write_all(&tail).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }

    #[tokio::test]
    async fn a_descriptor_travels_with_getfd_and_an_endless_line_ends_the_session() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let flood = vec![b'x'; MAX_LINE + 10];
        let server = std::thread::spawn(move || fake_qemu_with_fd(listener, flood));
        let qmp = Qmp::connect(&path).await.unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsFd;
        let answer = qmp
            .run("getfd", json!({ "fdname": "x" }), Some(file.as_fd()))
            .await
            .unwrap();
        assert_eq!(answer["fd"], true, "the descriptor arrived");
        let after = qmp.execute("query-status", json!({})).await.unwrap_err();
        assert!(matches!(after, QmpError::Closed(_)), "{after}");
        server.join().unwrap();
    }
}
