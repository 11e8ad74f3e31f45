//! Language servers (`/lsp/*`): one process per (languageId, project), spoken
//! to in JSON-RPC over its stdin and stdout, its answers reshaped into the
//! SDK's types.
//!
//! - `framing.rs`: the base protocol's `Content-Length` frames, bounded.
//! - `client.rs`: a server process, its requests, timeouts and death.
//! - `language.rs`: which program serves which `languageId`.
//! - `document.rs`: the SDK's `file://` URIs and the files' text.
//! - `shapes.rs`: completion and symbol answers in every shape the protocol
//!   allows, normalised to the SDK's.
//! - `routes.rs`: the HTTP handlers.
//!
//! The SDK never sends a document's text, only its URI, so this module reads
//! the file and keeps the server's copy current: a document a request names
//! is opened if it is not, and changed (whole) if the file changed since.
//! Servers run as everything the agent starts runs: the sandbox's user, its
//! environment. Nothing here outlives the agent: servers lead their own
//! process group, which `stop`, a dropped server and a reaped leader kill.

mod client;
pub mod document;
pub mod framing;
pub mod language;
pub mod routes;
pub mod shapes;

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash as _, Hasher as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use serde_json::{json, Value};

pub use client::{Server, INITIALIZE_TIMEOUT, REQUEST_TIMEOUT};
pub use language::Language;
pub use routes::routes;

/// Most language servers running at once: each is a process of hundreds of
/// MiB (tsserver) in the sandbox's memory.
pub const MAX_SERVERS: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum LspError {
    #[error("unknown languageId {0:?}: cove serves {known}", known = language::KNOWN)]
    UnknownLanguage(String),
    #[error("pathToProject is empty: give the project's directory")]
    NoProject,
    #[error("pathToProject {} is not a directory in the sandbox", .0.display())]
    ProjectNotADirectory(PathBuf),
    #[error("no {language} language server runs for {}; call lsp/start first", .project.display())]
    NotStarted {
        language: Language,
        project: PathBuf,
    },
    #[error("uri {0:?} is not a file:// URI of a file (the SDK sends file://PATH)")]
    BadUri(String),
    #[error("cannot read {}: {source}", .path.display())]
    Document {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is over {} MiB, too large for a language server", .0.display(), document::MAX_DOCUMENT_BYTES >> 20)]
    DocumentTooLarge(PathBuf),
    #[error("limit reached: at most {MAX_SERVERS} language servers; stop one first")]
    TooManyServers,
    /// The image lacks the server's program.
    #[error("the {language} language server needs {program} on PATH, which this sandbox does not have; install it in the image ({install})")]
    ServerMissing {
        language: Language,
        program: &'static str,
        install: &'static str,
    },
    #[error("starting the {language} language server {}: {source}", .program.display())]
    Spawn {
        language: Language,
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the {language} language server for {} has stopped ({why}); start it again", .project.display())]
    Exited {
        language: Language,
        project: PathBuf,
        why: String,
    },
    #[error("the {language} language server did not answer {method} within {seconds} s")]
    TimedOut {
        language: Language,
        method: &'static str,
        seconds: u64,
    },
    #[error("the {language} language server failed {method}: {message} (JSON-RPC error {code})")]
    ServerFailed {
        language: Language,
        method: &'static str,
        code: i64,
        message: String,
    },
}

impl LspError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::UnknownLanguage(_)
            | Self::NoProject
            | Self::ProjectNotADirectory(_)
            | Self::NotStarted { .. }
            | Self::BadUri(_)
            | Self::DocumentTooLarge(_) => StatusCode::BAD_REQUEST,
            Self::Document { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => StatusCode::NOT_FOUND,
                std::io::ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
                _ => StatusCode::BAD_REQUEST,
            },
            Self::TooManyServers => StatusCode::TOO_MANY_REQUESTS,
            // As `/process/code-run` answers for a runtime the image lacks.
            Self::ServerMissing { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Spawn { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            // The language server is the agent's upstream.
            Self::Exited { .. } | Self::ServerFailed { .. } => StatusCode::BAD_GATEWAY,
            Self::TimedOut { .. } => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    pub fn code(&self) -> &'static str {
        match self.status() {
            StatusCode::BAD_REQUEST => "BAD_REQUEST",
            StatusCode::NOT_FOUND => "FILE_NOT_FOUND",
            StatusCode::FORBIDDEN => "FILE_ACCESS_DENIED",
            StatusCode::TOO_MANY_REQUESTS => "TOO_MANY_REQUESTS",
            StatusCode::UNPROCESSABLE_ENTITY => "UNPROCESSABLE_ENTITY",
            StatusCode::BAD_GATEWAY => "BAD_GATEWAY",
            StatusCode::GATEWAY_TIMEOUT => "GATEWAY_TIMEOUT",
            _ => "INTERNAL_SERVER_ERROR",
        }
    }
}

/// Which server: a language in a project directory (absolute, clean).
type Key = (Language, PathBuf);

/// Every language server of this agent.
#[derive(Default)]
pub struct Registry {
    servers: Mutex<HashMap<Key, Arc<Running>>>,
    /// Starts and stops one at a time, so two starts of one key make one
    /// server and the limit holds.
    lifecycle: tokio::sync::Mutex<()>,
}

/// A server and the documents it has open.
pub struct Running {
    pub server: Arc<Server>,
    /// By path: the version last sent and a hash of the text it carried.
    /// Held across a file read and the notification it leads to, so a
    /// server sees each document's versions in order.
    documents: tokio::sync::Mutex<BTreeMap<PathBuf, (i64, u64)>>,
}

impl Registry {
    /// Starts `language`'s server for `project` unless one runs (a server
    /// that has stopped on its own is replaced).
    pub async fn start(&self, language: Language, project: &Path) -> Result<(), LspError> {
        if !project.is_dir() {
            return Err(LspError::ProjectNotADirectory(project.to_owned()));
        }
        let _one_at_a_time = self.lifecycle.lock().await;
        let key = (language, project.to_owned());
        let replaced = {
            let mut servers = self.servers.lock().unwrap();
            match servers.get(&key) {
                Some(running) if !running.server.is_gone() => return Ok(()),
                Some(_) => servers.remove(&key),
                None if servers.len() >= MAX_SERVERS => return Err(LspError::TooManyServers),
                None => None,
            }
        };
        if let Some(dead) = replaced {
            dead.server.stop().await;
        }
        let server = Server::start(language, project).await?;
        let running = Arc::new(Running {
            server,
            documents: tokio::sync::Mutex::default(),
        });
        self.servers.lock().unwrap().insert(key, running);
        Ok(())
    }

    /// Stops the server and waits until its process is gone.
    pub async fn stop(&self, language: Language, project: &Path) -> Result<(), LspError> {
        let _one_at_a_time = self.lifecycle.lock().await;
        let running = self
            .servers
            .lock()
            .unwrap()
            .remove(&(language, project.to_owned()))
            .ok_or_else(|| LspError::NotStarted {
                language,
                project: project.to_owned(),
            })?;
        running.server.stop().await;
        Ok(())
    }

    /// The running server, or why there is none.
    pub fn get(&self, language: Language, project: &Path) -> Result<Arc<Running>, LspError> {
        let running = self
            .servers
            .lock()
            .unwrap()
            .get(&(language, project.to_owned()))
            .cloned()
            .ok_or_else(|| LspError::NotStarted {
                language,
                project: project.to_owned(),
            })?;
        if let Some(why) = running.server.ended() {
            return Err(LspError::Exited {
                language,
                project: project.to_owned(),
                why,
            });
        }
        Ok(running)
    }

    /// The pids of the running servers (tests and diagnostics).
    pub fn pids(&self) -> Vec<u32> {
        let servers = self.servers.lock().unwrap();
        servers.values().map(|running| running.server.pid).collect()
    }
}

impl Running {
    /// Makes the server's copy of the file at `path` what is on disk:
    /// `didOpen` if it has none, a whole-text `didChange` if the file
    /// changed since. Returns the document's URI as the server knows it.
    pub async fn sync(&self, path: &Path) -> Result<String, LspError> {
        let mut documents = self.documents.lock().await;
        let text = document::read_text(path).await?;
        let uri = document::uri_of(path);
        let hash = {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            text.hash(&mut hasher);
            hasher.finish()
        };
        match documents.get(path).copied() {
            Some((_, known)) if known == hash => {}
            Some((version, _)) => {
                self.server.notify(
                    "textDocument/didChange",
                    json!({
                        "textDocument": {"uri": uri, "version": version + 1},
                        "contentChanges": [{"text": text}],
                    }),
                )?;
                documents.insert(path.to_owned(), (version + 1, hash));
            }
            None => {
                let language = document::language_of(path, self.server.language.id());
                self.server.notify(
                    "textDocument/didOpen",
                    json!({"textDocument": {
                        "uri": uri, "languageId": language, "version": 1, "text": text,
                    }}),
                )?;
                documents.insert(path.to_owned(), (1, hash));
            }
        }
        Ok(uri)
    }

    /// `didClose` for a document the server has open; nothing otherwise.
    pub async fn close(&self, path: &Path) -> Result<(), LspError> {
        let mut documents = self.documents.lock().await;
        if documents.remove(path).is_some() {
            self.server.notify(
                "textDocument/didClose",
                json!({"textDocument": {"uri": document::uri_of(path)}}),
            )?;
        }
        Ok(())
    }

    /// A request whose answer is JSON the caller reshapes.
    pub async fn request(&self, method: &'static str, params: Value) -> Result<Value, LspError> {
        self.server.request(method, params).await
    }
}
