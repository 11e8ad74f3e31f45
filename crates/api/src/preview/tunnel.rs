//! A pooled HTTP client whose connections are tunnels to a port inside a
//! sandbox: each is a connection to the sandbox's agent socket upgraded with
//! `GET /cove/tunnel/{port}` (`Upgrade: cove-tcp`, see the agent's `tunnel`
//! module), opened and pooled by `cove-agent-client`. The agent socket exists for every sandbox class, VMs included, so
//! this one path reaches any of them.

use axum::body::Body;
use axum::http::{StatusCode, Uri};
use cove_agent_client::{
    report, AgentClient, AgentError, BoxFuture, Dial, Endpoint, Pool, Sockets,
};
use cove_protocol::SandboxId;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;

/// The most of an agent's refusal of a tunnel that is read: a JSON message.
pub(super) const REFUSAL_LIMIT: usize = 64 << 10;

/// Why a tunnel could not be opened, with the status the preview answers.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub(crate) struct TunnelError {
    pub status: StatusCode,
    pub message: String,
}

impl TunnelError {
    fn bad_gateway(message: String) -> TunnelError {
        TunnelError {
            status: StatusCode::BAD_GATEWAY,
            message,
        }
    }
}

/// The client and the agent sockets it dials, by sandbox id.
#[derive(Clone)]
pub(crate) struct TunnelClient {
    sockets: Sockets,
    pub client: Pool<TunnelDialer, Body>,
}

impl TunnelClient {
    pub(crate) fn new() -> TunnelClient {
        let sockets = Sockets::default();
        // Bodies stream both ways untouched; only heads are parsed, and
        // they are bounded (`cove_agent_client::HEAD_LIMIT`, from an agent
        // and from an app behind a tunnel alike).
        let client = Pool::new(TunnelDialer {
            sockets: sockets.clone(),
        });
        TunnelClient { sockets, client }
    }

    /// Remembers where the agent of sandbox `id` listens (it changes when the
    /// sandbox restarts). An id that is none (it names no agent) is not
    /// kept, and its tunnels fail as those of an unknown sandbox.
    pub(crate) fn set_endpoint(&self, id: &str, endpoint: Endpoint) {
        if let Ok(id) = SandboxId::parse(id) {
            self.sockets.set(&id, endpoint);
        }
    }

    /// The URI of `path_and_query` on `port` of sandbox `id`: the pool keeps
    /// connections per authority, so each (sandbox, port) has its own.
    pub(crate) fn uri(id: &str, port: u16, path_and_query: &str) -> Option<Uri> {
        format!("http://{port}.{id}{path_and_query}").parse().ok()
    }
}

/// Opens a tunnel for a `http://{port}.{sandboxId}` URI.
#[derive(Clone)]
pub(crate) struct TunnelDialer {
    sockets: Sockets,
}

impl Dial for TunnelDialer {
    type Io = TokioIo<Upgraded>;
    type Error = TunnelError;

    fn dial(&self, host: &str) -> BoxFuture<Result<TokioIo<Upgraded>, TunnelError>> {
        let target = host
            .split_once('.')
            .and_then(|(port, id)| Some((port.parse::<u16>().ok()?, id.to_owned())));
        let host = host.to_owned();
        let sockets = self.sockets.clone();
        Box::pin(async move {
            let (port, id) = target
                .ok_or_else(|| TunnelError::bad_gateway(format!("no sandbox port in {host}")))?;
            let socket = sockets.get(&id).ok_or_else(|| {
                TunnelError::bad_gateway(format!("no agent known for sandbox {id}"))
            })?;
            open(&id, port, socket).await.map(TokioIo::new)
        })
    }
}

/// A tunnel to `port` of sandbox `id` through its agent at `endpoint`.
async fn open(id: &str, port: u16, endpoint: Endpoint) -> Result<Upgraded, TunnelError> {
    let agent = AgentClient::new(id, endpoint, REFUSAL_LIMIT);
    agent.tunnel(port).await.map_err(|error| {
        TunnelError::bad_gateway(match error {
            // The agent says why (nothing listening, most often).
            AgentError::TunnelRefused {
                status: StatusCode::BAD_GATEWAY,
                reason,
                ..
            } => format!("sandbox {id}: {reason}"),
            refused @ (AgentError::TunnelRefused { .. } | AgentError::TooLarge { .. }) => {
                refused.to_string()
            }
            error => format!(
                "the agent of sandbox {id} did not answer: {}",
                report(&error)
            ),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use cove_agent_client::testing::hostile_agent;

    #[tokio::test]
    async fn an_endless_refusal_is_cut_at_the_limit() {
        let (_dir, socket) = hostile_agent(b"HTTP/1.1 502 Bad Gateway\r\n\r\n");
        let error = open("sbx-1", 3000, Endpoint::Unix(socket))
            .await
            .err()
            .unwrap();
        assert_eq!(error.status, StatusCode::BAD_GATEWAY);
        assert!(error.message.contains("sandbox sbx-1"), "{}", error.message);
        assert!(error.message.contains("more than"), "{}", error.message);
    }

    #[tokio::test]
    async fn an_endless_header_is_refused() {
        let (_dir, socket) = hostile_agent(b"HTTP/1.1 101 Switching Protocols\r\nX-Endless: ");
        let error = open("sbx-2", 3000, Endpoint::Unix(socket))
            .await
            .err()
            .unwrap();
        assert!(error.message.contains("sandbox sbx-2"), "{}", error.message);
    }
}
