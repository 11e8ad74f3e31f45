//! The agent's toolbox API as the gateway uses it, over the sandbox's agent
//! socket: one-shot commands (`/process/execute`), PTY sessions (create and
//! attach over a WebSocket, resize, kill) and TCP tunnels (`/cove/tunnel/{port}`).
//! Works the same for containers and VMs, on this host (a Unix socket) or on
//! a runner elsewhere (a tunnel through it).
//! The calls go through `cove-agent-client` (the PTY's WebSocket on a
//! connection of its own, which tungstenite's client upgrades).

use std::collections::BTreeMap;

use base64::Engine as _;
use cove_agent_client::{AgentClient, AgentStream, Endpoint};
use cove_protocol::{ExecuteRequest, ExecuteResponse};
use http::{header, Method, Request, StatusCode};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::WebSocketStream;

/// Asks the agent for the `exited` control message with the exit code.
const EXIT_CONTROL_SUBPROTOCOL: &str = "X-Daytona-Pty-Exit-Control";
/// Carries the PTY's environment (base64url JSON), as the SDK sends it.
const ENVS_SUBPROTOCOL_PREFIX: &str = "X-Daytona-Pty-Envs~";
/// Deadline of an SSH `exec`: the agent's default (10 minutes) is meant for
/// API calls; an SSH command may run as long as a day.
const EXEC_TIMEOUT_SECS: u64 = 24 * 60 * 60;
/// The most of an agent's answer that is read. An `exec`'s whole output
/// comes back in one `/process/execute` answer; the sandbox, which writes
/// it, is not trusted to stop. (Heads are bounded by the client.)
pub(crate) const ANSWER_LIMIT: usize = 8 << 20;
/// The largest WebSocket message of a PTY session that is read.
const PTY_MESSAGE_LIMIT: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Client(#[from] cove_agent_client::AgentError),
    #[error("cannot reach the sandbox's agent at {socket}")]
    Connect {
        socket: String,
        #[source]
        source: std::io::Error,
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
pub(crate) struct Agent {
    client: AgentClient<Endpoint>,
    endpoint: Endpoint,
}

/// What `/process/execute` answers.
pub(crate) type Executed = ExecuteResponse;

/// A PTY session on the agent: its id and the attached WebSocket.
pub(crate) struct Pty {
    pub id: String,
    pub socket: WebSocketStream<AgentStream>,
}

impl Agent {
    pub(crate) fn new(sandbox: String, endpoint: Endpoint) -> Agent {
        Agent {
            client: AgentClient::new(sandbox, endpoint.clone(), ANSWER_LIMIT),
            endpoint,
        }
    }

    async fn connect(&self) -> Result<AgentStream, AgentError> {
        self.client
            .connect()
            .await
            .map_err(|source| AgentError::Connect {
                socket: match &self.endpoint {
                    Endpoint::Unix(socket) => socket.display().to_string(),
                    Endpoint::Runner(tunnel) => format!("runner {}", tunnel.address),
                },
                source,
            })
    }

    fn request(
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Request<cove_agent_client::Body> {
        let mut request = Request::builder().method(method).uri(path);
        if body.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let body = match body {
            Some(body) => cove_agent_client::full(body),
            None => cove_agent_client::empty(),
        };
        request
            .body(body)
            .expect("a path and a static header make a request")
    }

    /// Runs `command` with the sandbox's shell and waits for it.
    pub(crate) async fn execute(
        &self,
        command: &str,
        envs: &BTreeMap<String, String>,
    ) -> Result<Executed, AgentError> {
        let request = ExecuteRequest {
            command: command.to_owned(),
            cwd: None,
            envs: Some(envs.clone()),
            timeout: Some(EXEC_TIMEOUT_SECS),
        };
        Ok(self.client.execute(&request).await?)
    }

    /// Creates a PTY session running the sandbox's login shell and attaches to it.
    pub(crate) async fn open_pty(
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

    pub(crate) async fn resize_pty(
        &self,
        id: &str,
        cols: u16,
        rows: u16,
    ) -> Result<(), AgentError> {
        let body = serde_json::json!({ "cols": cols, "rows": rows }).to_string();
        let path = format!("/process/pty/{id}/resize");
        self.client
            .call_ok(Self::request(Method::POST, &path, Some(body.into_bytes())))
            .await?;
        Ok(())
    }

    /// Ends a PTY session and everything its shell started; one that has
    /// already ended is not an error.
    pub(crate) async fn kill_pty(&self, id: &str) -> Result<(), AgentError> {
        let path = format!("/process/pty/{id}");
        let (status, body) = self
            .client
            .call(Self::request(Method::DELETE, &path, None))
            .await?;
        if status.is_success() || status == StatusCode::NOT_FOUND {
            return Ok(());
        }
        Err(cove_agent_client::AgentError::Refused {
            sandbox: self.client.sandbox().to_owned(),
            what: format!("DELETE {path}"),
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
        .into())
    }

    /// A byte stream to 127.0.0.1:`port` inside the sandbox.
    pub(crate) async fn tunnel(&self, port: u16) -> Result<TokioIo<Upgraded>, AgentError> {
        match self.client.tunnel(port).await {
            Ok(upgraded) => Ok(TokioIo::new(upgraded)),
            Err(cove_agent_client::AgentError::TunnelRefused { status, .. })
                if status == StatusCode::BAD_GATEWAY =>
            {
                Err(AgentError::NothingListens { port })
            }
            Err(error) => Err(error.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent at a socket that answers every connection with `head` and
    /// then bytes that never stop.
    fn hostile_agent(head: &'static [u8]) -> (tempfile::TempDir, Agent) {
        let (dir, socket) = cove_agent_client::testing::hostile_agent(head);
        (dir, Agent::new("sbx-1".into(), Endpoint::Unix(socket)))
    }

    use cove_agent_client::AgentError as ClientError;

    #[tokio::test]
    async fn an_endless_exec_answer_is_cut_at_the_limit() {
        let (_dir, agent) = hostile_agent(b"HTTP/1.1 200 OK\r\n\r\n");
        let error = agent.execute("yes", &BTreeMap::new()).await.unwrap_err();
        assert!(
            matches!(&error, AgentError::Client(ClientError::TooLarge { sandbox, limit, .. }) if sandbox == "sbx-1" && *limit == ANSWER_LIMIT),
            "{error:?}"
        );
        assert!(error.to_string().contains("sandbox sbx-1"), "{error}");
    }

    #[tokio::test]
    async fn an_endless_tunnel_refusal_is_cut_at_the_limit() {
        let (_dir, agent) = hostile_agent(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        let error = agent.tunnel(8080).await.err().unwrap();
        assert!(
            matches!(error, AgentError::Client(ClientError::TooLarge { .. })),
            "{error:?}"
        );
    }

    #[tokio::test]
    async fn an_endless_header_is_refused() {
        let (_dir, agent) = hostile_agent(b"HTTP/1.1 200 OK\r\nX-Endless: ");
        let error = agent.execute("true", &BTreeMap::new()).await.unwrap_err();
        assert!(
            matches!(error, AgentError::Client(ClientError::Unanswered { .. })),
            "{error:?}"
        );
    }
}
