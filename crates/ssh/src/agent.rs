//! The agent's toolbox API as the gateway uses it, over the sandbox's agent
//! socket: one-shot commands (`/process/execute`), PTY sessions (create and
//! attach over a WebSocket, resize, kill) and TCP tunnels (`/cove/tunnel/{port}`).
//! Works the same for containers and VMs: both expose the agent as a Unix socket.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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
    #[error("the sandbox's agent did not open the terminal")]
    WebSocket(#[source] Box<tokio_tungstenite::tungstenite::Error>),
}

/// The agent of one sandbox.
#[derive(Clone, Debug)]
pub struct Agent {
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
    pub fn new(socket: PathBuf) -> Agent {
        Agent { socket }
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
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(self.connect().await?))
                .await
                .map_err(http_error)?;
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
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(http_error)?
            .to_bytes();
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
        let (socket, _) = tokio_tungstenite::client_async(request, self.connect().await?)
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
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(self.connect().await?))
                .await
                .map_err(http_error)?;
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
                let body = response
                    .into_body()
                    .collect()
                    .await
                    .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                    .unwrap_or_default();
                return Err(AgentError::Refused { what, status, body });
            }
        }
        let upgraded = hyper::upgrade::on(response).await.map_err(http_error)?;
        Ok(TokioIo::new(upgraded))
    }
}

impl From<&Path> for Agent {
    fn from(socket: &Path) -> Agent {
        Agent::new(socket.to_owned())
    }
}
