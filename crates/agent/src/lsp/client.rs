//! One language server process and the JSON-RPC conversation with it.
//!
//! Three tasks per server: a writer that owns its stdin, a reader that owns
//! its stdout (answers to our requests go to whoever waits for them;
//! requests from the server are answered at once, so a server that asks for
//! its configuration or to register a capability never stalls; other
//! notifications are dropped), and a watcher that owns the process, reaps it
//! and tells everyone it has gone. A request waits at most its timeout, and
//! no longer than the server lives.
//!
//! The server runs as the agent runs (the sandbox's user, the sandbox's
//! environment), in the project directory, leading a process group of its
//! own: `stop` and dropping the server end the whole group.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::{mpsc, oneshot, watch};

use super::framing::{self, Decoder};
use super::language::Language;
use super::LspError;

/// How long `initialize` may take: tsserver loads a project first.
pub const INITIALIZE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long any other request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `stop` waits for a polite exit before it kills the group.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// The end of the server's stderr kept to explain an exit.
const STDERR_TAIL_BYTES: usize = 2048;

type Answer = Result<Value, RpcError>;
type Pending = Arc<Mutex<HashMap<i64, oneshot::Sender<Answer>>>>;

/// A JSON-RPC error a server answered with.
#[derive(Debug, Clone)]
pub(super) struct RpcError {
    pub code: i64,
    pub message: String,
}

/// A running language server.
pub struct Server {
    pub language: Language,
    pub project: PathBuf,
    pub pid: u32,
    outgoing: mpsc::UnboundedSender<Vec<u8>>,
    pending: Pending,
    next_id: AtomicI64,
    /// `Some(why)` once the process has exited or its output broke.
    ended: watch::Receiver<Option<String>>,
    /// Set once the process is reaped: from then on its pid may be anyone's.
    reaped: Arc<AtomicBool>,
    capabilities: Mutex<Value>,
}

impl Server {
    /// Starts `language`'s server in `project` and initialises it.
    pub async fn start(language: Language, project: &Path) -> Result<Arc<Self>, LspError> {
        let program = language.program()?;
        let mut child = tokio::process::Command::new(&program)
            .args(language.args())
            .current_dir(project)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| LspError::Spawn {
                language,
                program: program.clone(),
                source,
            })?;
        let pid = child.id().unwrap_or_default();
        let stdin = child.stdin.take().expect("stdin is piped");
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");

        let (outgoing, to_write) = mpsc::unbounded_channel();
        let (end, ended) = watch::channel(None);
        let end = Arc::new(end);
        let pending: Pending = Arc::default();
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let reaped = Arc::new(AtomicBool::new(false));

        tokio::spawn(write_frames(stdin, to_write));
        tokio::spawn(keep_tail(stderr, stderr_tail.clone()));
        tokio::spawn(read_frames(
            stdout,
            outgoing.clone(),
            pending.clone(),
            end.clone(),
            project.to_owned(),
        ));
        let reaped_by_watcher = reaped.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            // Group members that outlived the leader keep its id a group
            // id, so this reaches them and no one else.
            if pid > 0 {
                let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
            reaped_by_watcher.store(true, Ordering::Release);
            // Give the stderr reader a moment to take the last words.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let tail = String::from_utf8_lossy(stderr_tail.lock().unwrap().make_contiguous())
                .trim()
                .to_owned();
            let mut why = match status {
                Ok(status) => format!("exited with {status}"),
                Err(e) => format!("could not be waited for: {e}"),
            };
            if !tail.is_empty() {
                why.push_str(&format!("; it last wrote: {tail}"));
            }
            end.send_if_modified(|ended| {
                // A broken output (already reported) stays the reason.
                if ended.is_none() {
                    *ended = Some(why);
                    true
                } else {
                    false
                }
            });
        });

        let server = Arc::new(Self {
            language,
            project: project.to_owned(),
            pid,
            outgoing,
            pending,
            next_id: AtomicI64::new(1),
            ended,
            reaped,
            capabilities: Mutex::new(Value::Null),
        });
        let root = super::document::uri_of(project);
        let name = project
            .file_name()
            .map_or_else(|| "/".into(), |n| n.to_string_lossy().into_owned());
        let initialized = server
            .request_within(
                "initialize",
                initialize_params(&root, project, &name),
                INITIALIZE_TIMEOUT,
            )
            .await;
        match initialized {
            Ok(result) => {
                *server.capabilities.lock().unwrap() =
                    result.get("capabilities").cloned().unwrap_or(Value::Null);
                server.notify("initialized", json!({}))?;
                Ok(server)
            }
            Err(e) => {
                server.kill();
                Err(e)
            }
        }
    }

    /// Whether the server said it answers `capability` (a key of its
    /// `ServerCapabilities`; `true` or an options object both mean yes).
    pub fn has_capability(&self, capability: &str) -> bool {
        match self.capabilities.lock().unwrap().get(capability) {
            None | Some(Value::Null | Value::Bool(false)) => false,
            Some(_) => true,
        }
    }

    /// Why the server is gone, if it is.
    pub fn ended(&self) -> Option<String> {
        self.ended.borrow().clone()
    }

    /// Whether the server is gone or going: it ended, its process was
    /// reaped, or its input closed. The input closes (a write failed) a
    /// moment before the watcher records why it ended, so a start in
    /// between must not take it for a live server.
    pub fn is_gone(&self) -> bool {
        self.ended().is_some() || self.reaped.load(Ordering::Acquire) || self.outgoing.is_closed()
    }

    /// Sends a request and waits for its result, at most [`REQUEST_TIMEOUT`].
    pub async fn request(&self, method: &'static str, params: Value) -> Result<Value, LspError> {
        self.request_within(method, params, REQUEST_TIMEOUT).await
    }

    async fn request_within(
        &self,
        method: &'static str,
        params: Value,
        timeout: Duration,
    ) -> Result<Value, LspError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (answer, answered) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, answer);
        let sent =
            self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        if let Err(e) = sent {
            self.pending.lock().unwrap().remove(&id);
            return Err(e);
        }
        let mut ended = self.ended.clone();
        let gone = async move {
            let _ = ended.wait_for(Option::is_some).await;
        };
        let outcome = tokio::select! {
            answer = answered => match answer {
                Ok(Ok(result)) => Ok(result),
                Ok(Err(error)) => Err(LspError::ServerFailed {
                    language: self.language,
                    method,
                    code: error.code,
                    message: error.message,
                }),
                // The reader dropped every waiter: the output ended.
                Err(_) => Err(self.exited().await),
            },
            () = gone => Err(self.exited().await),
            () = tokio::time::sleep(timeout) => Err(LspError::TimedOut {
                language: self.language,
                method,
                seconds: timeout.as_secs(),
            }),
        };
        if outcome.is_err() {
            self.pending.lock().unwrap().remove(&id);
            if matches!(outcome, Err(LspError::TimedOut { .. })) {
                // The server may still be working on it; tell it to stop.
                let _ = self.notify("$/cancelRequest", json!({"id": id}));
            }
        }
        outcome
    }

    /// The reason the server is gone, waiting briefly for the watcher to
    /// have it (the output closes a moment before the process is reaped).
    async fn exited(&self) -> LspError {
        let mut ended = self.ended.clone();
        let reason = async move {
            match ended.wait_for(Option::is_some).await {
                Ok(why) => why.clone(),
                Err(_) => None,
            }
        };
        let why = tokio::time::timeout(Duration::from_secs(2), reason)
            .await
            .ok()
            .flatten()
            .unwrap_or_else(|| "closed its output".into());
        LspError::Exited {
            language: self.language,
            project: self.project.clone(),
            why,
        }
    }

    pub fn notify(&self, method: &str, params: Value) -> Result<(), LspError> {
        self.send(&json!({"jsonrpc": "2.0", "method": method, "params": params}))
    }

    fn send(&self, message: &Value) -> Result<(), LspError> {
        if let Some(why) = self.ended() {
            return Err(LspError::Exited {
                language: self.language,
                project: self.project.clone(),
                why,
            });
        }
        let body = serde_json::to_vec(message).expect("JSON values serialise");
        self.outgoing
            .send(framing::encode(&body))
            .map_err(|_| LspError::Exited {
                language: self.language,
                project: self.project.clone(),
                why: "closed its input".into(),
            })
    }

    /// Asks the server to shut down and exit, kills its process group if it
    /// has not within [`SHUTDOWN_GRACE`], and returns once it is reaped.
    pub async fn stop(&self) {
        if self.ended().is_none() {
            let polite = async {
                let _ = self
                    .request_within("shutdown", Value::Null, SHUTDOWN_GRACE)
                    .await;
                let _ = self.notify("exit", Value::Null);
                let mut ended = self.ended.clone();
                let _ = ended.wait_for(Option::is_some).await;
            };
            let _ = tokio::time::timeout(SHUTDOWN_GRACE * 2, polite).await;
        }
        self.kill();
        let mut ended = self.ended.clone();
        let _ = ended.wait_for(Option::is_some).await;
    }

    /// SIGKILL to the server's process group; the watcher reaps it.
    fn kill(&self) {
        if self.pid > 0 && !self.reaped.load(Ordering::Acquire) {
            let _ = killpg(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
        }
    }
}

impl Drop for Server {
    /// A server nobody holds any more (the agent is going away) dies with
    /// everything it started.
    fn drop(&mut self) {
        self.kill();
    }
}

fn initialize_params(root: &str, project: &Path, name: &str) -> Value {
    let symbol_kinds: Vec<u32> = (1..=26).collect();
    json!({
        "processId": std::process::id(),
        "clientInfo": {"name": "cove-agent", "version": env!("CARGO_PKG_VERSION")},
        "rootUri": root,
        "rootPath": project,
        "workspaceFolders": [{"uri": root, "name": name}],
        "capabilities": {
            "workspace": {
                "configuration": true,
                "workspaceFolders": true,
                "symbol": {"symbolKind": {"valueSet": symbol_kinds}},
            },
            "textDocument": {
                "synchronization": {"didSave": false, "willSave": false},
                "completion": {
                    "contextSupport": true,
                    "completionItem": {
                        "snippetSupport": false,
                        "documentationFormat": ["markdown", "plaintext"],
                    },
                },
                "documentSymbol": {
                    "hierarchicalDocumentSymbolSupport": true,
                    "symbolKind": {"valueSet": symbol_kinds},
                },
            },
            "window": {"workDoneProgress": true},
        },
    })
}

async fn write_frames(
    mut stdin: tokio::process::ChildStdin,
    mut frames: mpsc::UnboundedReceiver<Vec<u8>>,
) {
    while let Some(frame) = frames.recv().await {
        if stdin.write_all(&frame).await.is_err() || stdin.flush().await.is_err() {
            break;
        }
    }
}

/// Keeps the last [`STDERR_TAIL_BYTES`] of the server's stderr.
async fn keep_tail(mut stderr: impl AsyncRead + Unpin, tail: Arc<Mutex<VecDeque<u8>>>) {
    let mut buffer = [0; 4096];
    while let Ok(n) = stderr.read(&mut buffer).await {
        if n == 0 {
            break;
        }
        let mut tail = tail.lock().unwrap();
        tail.extend(&buffer[..n]);
        let excess = tail.len().saturating_sub(STDERR_TAIL_BYTES);
        tail.drain(..excess);
    }
}

async fn read_frames(
    mut stdout: impl AsyncRead + Unpin,
    outgoing: mpsc::UnboundedSender<Vec<u8>>,
    pending: Pending,
    end: Arc<watch::Sender<Option<String>>>,
    project: PathBuf,
) {
    let mut decoder = Decoder::default();
    let mut buffer = vec![0; 64 * 1024];
    let broken = 'read: loop {
        let n = match stdout.read(&mut buffer).await {
            Ok(0) => break None,
            Ok(n) => n,
            Err(e) => break Some(format!("its output could not be read: {e}")),
        };
        decoder.push(&buffer[..n]);
        loop {
            match decoder.next_message() {
                Ok(Some(body)) => dispatch(&body, &outgoing, &pending, &project),
                Ok(None) => break,
                Err(e) => break 'read Some(format!("wrote something that is not LSP: {e}")),
            }
        }
    };
    if let Some(why) = broken {
        end.send_if_modified(|ended| {
            if ended.is_none() {
                *ended = Some(why);
                true
            } else {
                false
            }
        });
    }
    // Nobody answers the waiters any more; dropping them wakes them.
    pending.lock().unwrap().clear();
}

fn dispatch(
    body: &[u8],
    outgoing: &mpsc::UnboundedSender<Vec<u8>>,
    pending: &Pending,
    project: &Path,
) {
    let Ok(message) = serde_json::from_slice::<Value>(body) else {
        tracing::debug!("a language server wrote a message that is not JSON");
        return;
    };
    let id = message.get("id").filter(|id| !id.is_null());
    match (message.get("method").and_then(Value::as_str), id) {
        (Some(method), Some(id)) => {
            let reply = match answer_server_request(method, message.get("params"), project) {
                Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
                Err(error) => json!({"jsonrpc": "2.0", "id": id, "error": error}),
            };
            let body = serde_json::to_vec(&reply).expect("JSON values serialise");
            let _ = outgoing.send(framing::encode(&body));
        }
        (None, Some(id)) => {
            let Some(waiter) = id
                .as_i64()
                .and_then(|id| pending.lock().unwrap().remove(&id))
            else {
                return;
            };
            let answer = match message.get("error") {
                Some(error) if !error.is_null() => Err(RpcError {
                    code: error.get("code").and_then(Value::as_i64).unwrap_or(0),
                    message: error
                        .get("message")
                        .and_then(Value::as_str)
                        .unwrap_or("no message")
                        .to_owned(),
                }),
                _ => Ok(message.get("result").cloned().unwrap_or(Value::Null)),
            };
            let _ = waiter.send(answer);
        }
        // Notifications (diagnostics, logs, progress): the SDK has no use for them.
        _ => {}
    }
}

/// The answer to a request the server sent us: what a minimal editor says,
/// so the server goes on with its defaults.
fn answer_server_request(
    method: &str,
    params: Option<&Value>,
    project: &Path,
) -> Result<Value, Value> {
    match method {
        // One "no settings" per item asked about.
        "workspace/configuration" => {
            let items = params
                .and_then(|p| p.get("items"))
                .and_then(Value::as_array)
                .map_or(0, Vec::len);
            Ok(Value::Array(vec![Value::Null; items]))
        }
        "window/workDoneProgress/create"
        | "client/registerCapability"
        | "client/unregisterCapability"
        | "window/showMessageRequest"
        | "workspace/semanticTokens/refresh"
        | "workspace/inlayHint/refresh"
        | "workspace/codeLens/refresh"
        | "workspace/diagnostic/refresh" => Ok(Value::Null),
        "workspace/workspaceFolders" => {
            let uri = super::document::uri_of(project);
            Ok(json!([{"uri": uri, "name": project.file_name().map(|n| n.to_string_lossy())}]))
        }
        // Nobody is there to approve an edit.
        "workspace/applyEdit" => Ok(json!({"applied": false})),
        _ => {
            Err(json!({"code": -32601, "message": format!("cove-agent does not handle {method}")}))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_requests_get_answers_that_let_it_go_on() {
        let project = Path::new("/p/proj");
        let params = json!({"items": [{"section": "pylsp"}, {"section": "python"}]});
        assert_eq!(
            answer_server_request("workspace/configuration", Some(&params), project),
            Ok(json!([null, null]))
        );
        for method in [
            "window/workDoneProgress/create",
            "client/registerCapability",
        ] {
            assert_eq!(
                answer_server_request(method, None, project),
                Ok(Value::Null)
            );
        }
        assert_eq!(
            answer_server_request("workspace/workspaceFolders", None, project),
            Ok(json!([{"uri": "file:///p/proj", "name": "proj"}]))
        );
        let unknown = answer_server_request("x/unknown", None, project).unwrap_err();
        assert_eq!(unknown["code"], -32601);
    }
}
