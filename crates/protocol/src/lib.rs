//! The contract between cove's server and the agent inside every sandbox,
//! written once and used by both ends: the sandbox id both sides name
//! sandboxes by, the `COVE_*` environment the runtime starts the agent with,
//! the messages of the agent's cove endpoints (execute, identity, unpack,
//! tunnel), and the handshake that opens a VM's agent channel.
//!
//! Plain data and pure functions only: no I/O, no HTTP client or server, no
//! async runtime. The agent (a static musl binary) and the host crates both
//! depend on it; it depends on nothing of either. The HTTP client that
//! carries these messages is `cove-agent-client`; the server side is the
//! agent's routers.

pub mod env;
pub mod execute;
pub mod handshake;
pub mod id;
pub mod identity;
pub mod tunnel;
pub mod unpack;

pub use env::AgentEnv;
pub use execute::{ExecuteRequest, ExecuteResponse};
pub use id::{InvalidSandboxId, SandboxId};
pub use identity::{GuestNetwork, GuestVolume, IdentityReply, IdentityRequest};
pub use unpack::{UnpackQuery, UnpackReply};
