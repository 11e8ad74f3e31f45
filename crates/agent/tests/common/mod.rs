//! Starts a real `cove-agent serve --socket` and talks HTTP/1.1 (and
//! WebSocket) to it over the Unix socket.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::UnixStream;

pub(crate) struct Agent {
    child: Child,
    client: Client,
    pub work_dir: PathBuf,
    _dir: tempfile::TempDir,
}

/// HTTP/1.1 and WebSocket requests to whatever serves on a Unix socket.
pub(crate) struct Client {
    socket: PathBuf,
}

impl std::ops::Deref for Agent {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

pub(crate) struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
}

impl Agent {
    pub(crate) fn start() -> Self {
        Self::start_with(&[])
    }

    pub(crate) fn start_with(env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let work_dir = dir.path().join("work");
        std::fs::create_dir(&work_dir).unwrap();
        let socket = dir.path().join("agent.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_cove-agent"))
            .args(["serve", "--socket"])
            .arg(&socket)
            .env("COVE_WORKDIR", &work_dir)
            .env("COVE_AGENT_STATE_DIR", dir.path().join("state"))
            .env("COVE_SECRET_OF_THE_AGENT", "hidden")
            .env("COVE_AGENT_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(Instant::now() < deadline, "agent did not start listening");
            std::thread::sleep(Duration::from_millis(10));
        }
        Self {
            child,
            client: Client { socket },
            work_dir,
            _dir: dir,
        }
    }

    pub(crate) fn path(&self, relative: &str) -> PathBuf {
        self.work_dir.join(relative)
    }

    /// The agent process's pid (its children are what it started).
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Client {
    pub(crate) fn at(socket: &Path) -> Self {
        Self {
            socket: socket.to_owned(),
        }
    }

    pub(crate) fn socket(&self) -> &Path {
        &self.socket
    }

    pub(crate) async fn request(
        &self,
        method: Method,
        uri: &str,
        content_type: Option<&str>,
        body: impl Into<Bytes>,
    ) -> Reply {
        let stream = UnixStream::connect(&self.socket).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(connection);
        let mut request = Request::builder()
            .method(method)
            .uri(uri)
            .header("host", "agent");
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        let response = sender
            .send_request(request.body(Full::new(body.into())).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Reply {
            status,
            headers,
            body,
        }
    }

    pub(crate) async fn get(&self, uri: &str) -> Reply {
        self.request(Method::GET, uri, None, Bytes::new()).await
    }

    pub(crate) async fn delete(&self, uri: &str) -> Reply {
        self.request(Method::DELETE, uri, None, Bytes::new()).await
    }

    pub(crate) async fn post_json(&self, uri: &str, body: Value) -> Reply {
        self.request(
            Method::POST,
            uri,
            Some("application/json"),
            body.to_string(),
        )
        .await
    }

    /// Opens a WebSocket on `uri` over the agent's socket.
    pub(crate) async fn websocket(
        &self,
        uri: &str,
    ) -> tokio_tungstenite::WebSocketStream<UnixStream> {
        let stream = UnixStream::connect(&self.socket).await.unwrap();
        let (socket, _) = tokio_tungstenite::client_async(format!("ws://agent{uri}"), stream)
            .await
            .unwrap();
        socket
    }
}

impl Drop for Agent {
    /// SIGTERM first: the agent then kills its sessions' process groups,
    /// which a bare SIGKILL would leave running after the test (a `sleep 30`
    /// of an async command). SIGKILL if it has not ended in a few seconds.
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `multipart/form-data` body and its content type.
pub(crate) fn multipart(parts: &[(&str, Option<&str>, &[u8])], close: bool) -> (String, Vec<u8>) {
    let boundary = "test-boundary-7MA4YWxkTrZu0gW";
    let mut body = Vec::new();
    for (name, filename, data) in parts {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        match filename {
            Some(filename) => body.extend_from_slice(
                format!(
                    "Content-Disposition: form-data; name=\"{name}\"; filename=\"{filename}\"\r\n\
                     Content-Type: application/octet-stream\r\n\r\n"
                )
                .as_bytes(),
            ),
            None => body.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
            ),
        }
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    if close {
        body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    }
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// Parts of a multipart response: (Content-Disposition name, filename, body).
pub(crate) fn parse_multipart(content_type: &str, body: &[u8]) -> Vec<(String, String, Vec<u8>)> {
    let boundary = content_type.split("boundary=").nth(1).expect("boundary");
    let delimiter = format!("--{boundary}");
    let closing = format!("--{boundary}--\r\n");
    assert!(
        body.ends_with(closing.as_bytes()),
        "missing closing boundary"
    );
    let mut parts = Vec::new();
    let mut rest = body;
    loop {
        rest = rest.strip_prefix(delimiter.as_bytes()).expect("delimiter");
        if rest.starts_with(b"--") {
            return parts;
        }
        rest = rest.strip_prefix(b"\r\n").unwrap();
        let head_end = find(rest, b"\r\n\r\n").unwrap();
        let head = String::from_utf8(rest[..head_end].to_vec()).unwrap();
        rest = &rest[head_end + 4..];
        let end = find(rest, format!("\r\n{delimiter}").as_bytes()).unwrap();
        let data = rest[..end].to_vec();
        rest = &rest[end + 2..];
        let param = |key: &str| {
            head.split(&format!("{key}=\""))
                .nth(1)
                .and_then(|v| v.split('"').next())
                .unwrap_or("")
                .to_string()
        };
        parts.push((param(" name"), param("filename"), data));
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

pub(crate) fn exists(path: &Path) -> bool {
    path.symlink_metadata().is_ok()
}
