//! The record of one session command: its output as ordered chunks tagged
//! stdout/stderr, its exit code once known, and a signal for waiters and
//! followers.

use std::sync::Mutex;

use bytes::Bytes;
use serde::Serialize;
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    /// The marker that switches the SDK's log demultiplexer to this stream.
    pub fn marker(self) -> &'static [u8] {
        match self {
            Self::Stdout => b"\x01\x01\x01",
            Self::Stderr => b"\x02\x02\x02",
        }
    }
}

pub struct CommandRecord {
    pub id: String,
    pub command: String,
    pub is_async: bool,
    /// Stdin of a running asynchronous command; `None` otherwise.
    pub(super) input: tokio::sync::Mutex<Option<super::command::Input>>,
    max_bytes_per_stream: usize,
    state: Mutex<CommandState>,
    changed: watch::Sender<()>,
}

#[derive(Default)]
struct CommandState {
    chunks: Vec<(Stream, Bytes)>,
    stored: [usize; 2],
    exit_code: Option<i32>,
}

/// Output of a command split the three ways the SDK asks for.
#[derive(Debug, Serialize)]
pub struct Logs {
    pub output: String,
    pub stdout: String,
    pub stderr: String,
}

impl CommandRecord {
    pub fn new(id: String, command: String, is_async: bool, max_bytes_per_stream: usize) -> Self {
        Self {
            id,
            command,
            is_async,
            input: tokio::sync::Mutex::new(None),
            max_bytes_per_stream,
            state: Mutex::default(),
            changed: watch::Sender::new(()),
        }
    }

    pub fn append(&self, stream: Stream, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let mut state = self.state.lock().unwrap();
        let slot = &mut state.stored[stream as usize];
        let room = self.max_bytes_per_stream.saturating_sub(*slot);
        let kept = &data[..data.len().min(room)];
        if kept.is_empty() {
            return;
        }
        *slot += kept.len();
        state.chunks.push((stream, Bytes::copy_from_slice(kept)));
        drop(state);
        self.changed.send_replace(());
    }

    pub fn finish(&self, exit_code: i32) {
        self.state.lock().unwrap().exit_code = Some(exit_code);
        self.changed.send_replace(());
    }

    pub fn exit_code(&self) -> Option<i32> {
        self.state.lock().unwrap().exit_code
    }

    /// Chunks from index `from` on, and whether the command had finished when
    /// they were taken (so no chunk of the command itself follows).
    pub fn chunks_since(&self, from: usize) -> (Vec<(Stream, Bytes)>, bool) {
        let state = self.state.lock().unwrap();
        let chunks = state.chunks.get(from..).unwrap_or_default().to_vec();
        (chunks, state.exit_code.is_some())
    }

    pub fn subscribe(&self) -> watch::Receiver<()> {
        self.changed.subscribe()
    }

    /// Waits until the exit code is known.
    pub async fn wait(&self) -> i32 {
        let mut changes = self.subscribe();
        loop {
            if let Some(code) = self.exit_code() {
                return code;
            }
            // The sender lives as long as `self`, so this cannot fail while we wait.
            let _ = changes.changed().await;
        }
    }

    pub fn logs(&self) -> Logs {
        let state = self.state.lock().unwrap();
        let mut all = Vec::new();
        let mut split = [Vec::new(), Vec::new()];
        for (stream, chunk) in &state.chunks {
            all.extend_from_slice(chunk);
            split[*stream as usize].extend_from_slice(chunk);
        }
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        Logs {
            output: text(&all),
            stdout: text(&split[0]),
            stderr: text(&split[1]),
        }
    }
}
