//! The agent's toolbox API as the gateway uses it, over the sandbox's agent
//! socket: one-shot commands (`/process/execute`), PTY sessions (create and
//! attach over a WebSocket, resize, kill) and TCP tunnels (`/cove/tunnel/{port}`).
//! Works the same for containers and VMs: both expose the agent as a Unix socket.

use std::collections::BTreeMap;
use std::path::PathBuf;

use base64::Engine as _;
use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::WebSocketStream;

/// Asks the agent for the `exited` control message with the exit code.
const EXIT_CONTROL_SUBPROTOCOL: &str = "X-Daytona-Pty-Exit-Control";
/// Carries the PTY's environment (base64url JSON), as the SDK sends it.
const ENVS_SUBPROTOCOL_PREFIX: &str = "X-Daytona-Pty-Envs~";
/// How a tunnel upgrade is named (the agent's `/cove/tunnel/{port}` contract).
const TUNNEL_PROTOCOL: &str = "cove-tcp";
/// Deadline of an SSH `exec`: the agent's default (10 minutes) is meant for
/// API calls; an SSH command may run as long as a day.
const EXEC_TIMEOUT_SECS: u64 = 24 * 60 * 60;
/// The most of an agent's answer that is read. An `exec`'s whole output
/// comes back in one `/process/execute` answer; the sandbox, which writes
/// it, is not trusted to stop.
pub const ANSWER_LIMIT: usize = 8 << 20;
/// The most of a response head (status line and headers) that is read.
const HEAD_LIMIT: usize = 64 << 10;
/// The largest WebSocket message of a PTY session that is read.
const PTY_MESSAGE_LIMIT: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot reach the sandbox's agent at {socket}")]
    Connect {
        socket: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the sandbox's agent failed {what}")]
    Http {
        what: String,
        #[source]
        source: hyper::Error,
    },
    #[error("the sandbox's agent refused {what}: {status} {body}")]
    Refused {
        what: String,
        status: StatusCode,
        body: String,
    },
    #[error("nothing listens on port {port} inside the sandbox")]
    NothingListens { port: u16 },
    #[error("the sandbox's agent answered {what} with {reason}")]
    BadAnswer { what: String, reason: String },
    #[error("the agent of sandbox {sandbox} answered {what} with more than {limit} bytes; cove reads no more")]
    TooLarge {
        sandbox: String,
        what: String,
        limit: usize,
    },
    #[error("the sandbox's agent did not open the terminal")]
    WebSocket(#[source] Box<tokio_tungstenite::tungstenite::Error>),
}

/// The agent of one sandbox.
#[derive(Clone, Debug)]
pub struct Agent {
    sandbox: String,
    socket: PathBuf,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ExecuteRequest<'a> {
    command: &'a str,
    envs: &'a BTreeMap<String, String>,
    timeout: u64,
}

/// What `/process/execute` answers.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Executed {
    pub exit_code: i32,
    pub result: String,
    #[serde(default)]
    pub timed_out: bool,
}

/// A PTY session on the agent: its id and the attached WebSocket.
pub struct Pty {
    pub id: String,
    pub socket: WebSocketStream<UnixStream>,
}

impl Agent {
    pub fn new(sandbox: String, socket: PathBuf) -> Agent {
        Agent { sandbox, socket }
    }

    /// An HTTP/1 connection to the agent whose response heads are bounded.
    async fn handshake(
        &self,
        what: &str,
    ) -> Result<
        (
            hyper::client::conn::http1::SendRequest<Full<Bytes>>,
            hyper::client::conn::http1::Connection<TokioIo<UnixStream>, Full<Bytes>>,
        ),
        AgentError,
    > {
        hyper::client::conn::http1::Builder::new()
            .max_buf_size(HEAD_LIMIT.max(8192))
            .handshake(TokioIo::new(self.connect().await?))
            .await
            .map_err(|source| AgentError::Http {
                what: what.to_owned(),
                source,
            })
    }

    /// A response body, read up to [`ANSWER_LIMIT`] and no further.
    async fn read_body(
        &self,
        what: &str,
        body: hyper::body::Incoming,
    ) -> Result<Bytes, AgentError> {
        match http_body_util::Limited::new(body, ANSWER_LIMIT)
            .collect()
            .await
        {
            Ok(collected) => Ok(collected.to_bytes()),
            Err(error) => match error.downcast::<hyper::Error>() {
                Ok(source) => Err(AgentError::Http {
                    what: what.to_owned(),
                    source: *source,
                }),
                Err(_) => Err(AgentError::TooLarge {
                    sandbox: self.sandbox.clone(),
                    what: what.to_owned(),
                    limit: ANSWER_LIMIT,
                }),
            },
        }
    }

    async fn connect(&self) -> Result<UnixStream, AgentError> {
        UnixStream::connect(&self.socket)
            .await
            .map_err(|source| AgentError::Connect {
                socket: self.socket.display().to_string(),
                source,
            })
    }

    /// One HTTP/1 request on a connection of its own; answers status and body.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), AgentError> {
        let what = format!("{method} {path}");
        let http_error = |source| AgentError::Http {
            what: what.clone(),
            source,
        };
        let (mut sender, connection) = self.handshake(&what).await?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "agent connection ended");
            }
        });
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "sandbox");
        if body.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| AgentError::BadAnswer {
                what: what.clone(),
                reason: e.to_string(),
            })?;
        let response = sender.send_request(request).await.map_err(http_error)?;
        let status = response.status();
        let body = self.read_body(&what, response.into_body()).await?;
        Ok((status, body))
    }

    async fn call_ok(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Bytes, AgentError> {
        let what = format!("{method} {path}");
        let (status, body) = self.call(method, path, body).await?;
        if !status.is_success() {
            return Err(AgentError::Refused {
                what,
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        Ok(body)
    }

    /// Runs `command` with the sandbox's shell and waits for it.
    pub async fn execute(
        &self,
        command: &str,
        envs: &BTreeMap<String, String>,
    ) -> Result<Executed, AgentError> {
        let request = ExecuteRequest {
            command,
            envs,
            timeout: EXEC_TIMEOUT_SECS,
        };
        let body = serde_json::to_vec(&request).map_err(|e| AgentError::BadAnswer {
            what: "POST /process/execute".into(),
            reason: e.to_string(),
        })?;
        let answer = self
            .call_ok(Method::POST, "/process/execute", Some(body))
            .await?;
        serde_json::from_slice(&answer).map_err(|e| AgentError::BadAnswer {
            what: "POST /process/execute".into(),
            reason: e.to_string(),
        })
    }

    /// Creates a PTY session running the sandbox's login shell and attaches to it.
    pub async fn open_pty(
        &self,
        cols: u16,
        rows: u16,
        envs: &BTreeMap<String, String>,
    ) -> Result<Pty, AgentError> {
        let id = format!("ssh-{}", uuid::Uuid::new_v4().simple());
        let url =
            format!("ws://sandbox/process/pty/create-connect?id={id}&cols={cols}&rows={rows}");
        let mut request = url
            .into_client_request()
            .map_err(|e| AgentError::WebSocket(Box::new(e)))?;
        let envs = serde_json::to_vec(envs).unwrap_or_else(|_| b"{}".to_vec());
        let envs = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(envs);
        let protocols = format!("{EXIT_CONTROL_SUBPROTOCOL}, {ENVS_SUBPROTOCOL_PREFIX}{envs}");
        request.headers_mut().insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            protocols
                .parse()
                .map_err(|e: header::InvalidHeaderValue| AgentError::BadAnswer {
                    what: "the PTY environment".into(),
                    reason: e.to_string(),
                })?,
        );
        // A PTY's messages are terminal output in small chunks; a message
        // past the limit ends the session rather than filling memory.
        let config = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
            .max_message_size(Some(PTY_MESSAGE_LIMIT))
            .max_frame_size(Some(PTY_MESSAGE_LIMIT));
        let (socket, _) = tokio_tungstenite::client_async_with_config(
            request,
            self.connect().await?,
            Some(config),
        )
        .await
        .map_err(|e| AgentError::WebSocket(Box::new(e)))?;
        Ok(Pty { id, socket })
    }

    pub async fn resize_pty(&self, id: &str, cols: u16, rows: u16) -> Result<(), AgentError> {
        let body = serde_json::json!({ "cols": cols, "rows": rows }).to_string();
        self.call_ok(
            Method::POST,
            &format!("/process/pty/{id}/resize"),
            Some(body.into_bytes()),
        )
        .await
        .map(drop)
    }

    /// Ends a PTY session and everything its shell started; one that has
    /// already ended is not an error.
    pub async fn kill_pty(&self, id: &str) -> Result<(), AgentError> {
        let (status, body) = self
            .call(Method::DELETE, &format!("/process/pty/{id}"), None)
            .await?;
        if status.is_success() || status == StatusCode::NOT_FOUND {
            return Ok(());
        }
        Err(AgentError::Refused {
            what: format!("DELETE /process/pty/{id}"),
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    /// A byte stream to 127.0.0.1:`port` inside the sandbox.
    pub async fn tunnel(&self, port: u16) -> Result<TokioIo<Upgraded>, AgentError> {
        let path = format!("/cove/tunnel/{port}");
        let what = format!("GET {path}");
        let http_error = |source| AgentError::Http {
            what: what.clone(),
            source,
        };
        let (mut sender, connection) = self.handshake(&what).await?;
        tokio::spawn(async move {
            if let Err(error) = connection.with_upgrades().await {
                tracing::debug!(%error, "agent tunnel connection ended");
            }
        });
        let request = Request::builder()
            .method(Method::GET)
            .uri(&path)
            .header(header::HOST, "sandbox")
            .header(header::CONNECTION, "Upgrade")
            .header(header::UPGRADE, TUNNEL_PROTOCOL)
            .body(Full::new(Bytes::new()))
            .map_err(|e| AgentError::BadAnswer {
                what: what.clone(),
                reason: e.to_string(),
            })?;
        let response = sender.send_request(request).await.map_err(http_error)?;
        match response.status() {
            StatusCode::SWITCHING_PROTOCOLS => {}
            StatusCode::BAD_GATEWAY => return Err(AgentError::NothingListens { port }),
            status => {
                let body = self.read_body(&what, response.into_body()).await?;
                let body = String::from_utf8_lossy(&body).into_owned();
                return Err(AgentError::Refused { what, status, body });
            }
        }
        let upgraded = hyper::upgrade::on(response).await.map_err(http_error)?;
        Ok(TokioIo::new(upgraded))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// An agent that answers every connection with `head` and then bytes
    /// that never stop.
    fn hostile_agent(head: &'static [u8]) -> (tempfile::TempDir, Agent) {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut request = [0u8; 4096];
                    let _ = stream.read(&mut request).await;
                    let chunk = vec![b'x'; 64 << 10];
                    let mut written = stream.write_all(head).await;
                    while written.is_ok() {
                        written = stream.write_all(&chunk).await;
                    }
                });
            }
        });
        (dir, Agent::new("sbx-1".into(), socket))
    }

    #[tokio::test]
    async fn an_endless_exec_answer_is_cut_at_the_limit() {
        let (_dir, agent) = hostile_agent(b"HTTP/1.1 200 OK\r\n\r\n");
        let error = agent.execute("yes", &BTreeMap::new()).await.unwrap_err();
        assert!(
            matches!(&error, AgentError::TooLarge { sandbox, limit, .. } if sandbox == "sbx-1" && *limit == ANSWER_LIMIT),
            "{error:?}"
        );
        assert!(error.to_string().contains("sandbox sbx-1"), "{error}");
    }

    #[tokio::test]
    async fn an_endless_tunnel_refusal_is_cut_at_the_limit() {
        let (_dir, agent) = hostile_agent(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        let error = agent.tunnel(8080).await.err().unwrap();
        assert!(matches!(error, AgentError::TooLarge { .. }), "{error:?}");
    }

    #[tokio::test]
    async fn an_endless_header_is_refused() {
        let (_dir, agent) = hostile_agent(b"HTTP/1.1 200 OK\r\nX-Endless: ");
        let error = agent.execute("true", &BTreeMap::new()).await.unwrap_err();
        assert!(matches!(error, AgentError::Http { .. }), "{error:?}");
    }
}
