//! A VM this runtime started and that runs: its QEMU process, the session
//! with its agent, and the socket the server reaches the agent through.
//! Below `boot`, `pool` and `guard`, which all hold one; it knows nothing of
//! how the VM came up.

use std::io;
use std::time::Duration;

use cove_agent_client::{AgentClient, BoxFuture, Dial};

use super::bridge::{self, AgentStream, Bridge, Session};
use super::machine::Machine;

/// How long the agent may take to flush its disks.
const SYNC_TIMEOUT: Duration = Duration::from_secs(10);

/// A VM this runtime started and that runs.
pub(super) struct RunningVm {
    pub machine: Machine,
    pub session: Session,
    /// Serves `agent.sock`; dropped to stop it.
    pub bridge: Option<Bridge>,
    pub driver: tokio::task::JoinHandle<()>,
}

impl RunningVm {
    /// Has the agent write out what the guest holds in its page cache;
    /// whether it did, within [`SYNC_TIMEOUT`].
    pub(super) async fn flush_guest_disks(&self) -> bool {
        let synced = tokio::time::timeout(SYNC_TIMEOUT, agent(&self.session).sync()).await;
        matches!(synced, Ok(Ok(_)))
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        self.bridge.take();
        self.driver.abort();
    }
}

/// The agent of a VM, reached over its session's streams (the runtime's own
/// calls; the server's go through the bridge's socket).
#[derive(Clone)]
pub(super) struct OverSession(Session);

impl Dial for OverSession {
    type Io = AgentStream;
    type Error = io::Error;

    fn dial(&self, _: &str) -> BoxFuture<io::Result<AgentStream>> {
        let session = self.0.clone();
        Box::pin(async move { session.open().await })
    }
}

/// A client of the agent on `session`, its answers bounded at
/// [`bridge::ANSWER_LIMIT`].
pub(super) fn agent(session: &Session) -> AgentClient<OverSession> {
    AgentClient::new("vm", OverSession(session.clone()), bridge::ANSWER_LIMIT)
}
