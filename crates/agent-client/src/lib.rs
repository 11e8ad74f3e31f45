//! The one client of the guest agent's HTTP API, for every host-side caller:
//! the toolbox proxy and previews (cove-api), SSH (cove-ssh), the image
//! builder (cove-engine) and the VM runtime's own calls (cove-runtime).
//!
//! A [`Dial`] says how a byte stream to an agent is made: a Unix socket
//! ([`UnixSocket`], [`Sockets`] by sandbox id) for any sandbox, or a stream
//! of a VM's agent channel (the runtime's). [`Pool`] is hyper's pooled
//! HTTP/1 client over it, with response heads bounded at [`HEAD_LIMIT`];
//! [`AgentClient`] adds the agent's contract (`cove-protocol`'s messages)
//! with every answer read up to a limit its owner sets, never further: the
//! sandbox writes those answers and is not trusted to stop.
//!
//! This crate sits under cove-runtime, the lowest crate all five callers
//! reach, and knows nothing of them: no sandboxes, no engine, no axum.

mod client;
mod dial;
mod error;
mod pool;
pub mod testing;

pub use client::{empty, full, read_bounded, AgentClient, Body};
pub use dial::{
    AgentStream, BoxFuture, Dial, Endpoint, RunnerTls, RunnerTunnel, Sockets, UnixSocket,
    RUNNER_TUNNEL_PROTOCOL,
};
pub use error::{report, AgentError};
pub use pool::{BoxError, Connector, Pool, PooledStream};

/// The most of a response head (status line and headers) that is read from
/// an agent, or from an app behind a tunnel.
pub const HEAD_LIMIT: usize = 64 << 10;
