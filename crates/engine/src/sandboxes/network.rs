//! Sandbox networking: each started sandbox is attached to cove's network (an
//! address and an egress policy; a container gets its own namespace, a VM a
//! TAP device its guest configures) right before its runtime starts it,
//! detached when it stops or pauses, and its address is released when it is
//! deleted. Policy changes on a running sandbox apply live.

use cove_lifecycle::{SandboxClass, SandboxState};
use cove_net::{Deletion, Link, LinkKind};
use cove_runtime::{NetworkLink, SandboxNetwork, TapLink};
use cove_store::{NetworkSettings, SandboxRecord};

use super::Sandboxes;
use crate::failure::Failure;
use crate::network::policy;
use crate::EngineError;

impl Sandboxes {
    /// Attaches a sandbox that is about to start; `None` without networking.
    /// Its links to other sandboxes are made by [`Self::relink`], which
    /// may run while its machine starts.
    pub(crate) async fn attach_network(
        &self,
        record: &SandboxRecord,
    ) -> Result<Option<SandboxNetwork>, Failure> {
        // A runner elsewhere attaches its sandboxes to its own network as
        // it starts them: it is told the policy first.
        if let Some(remote) = self.shared.remote_of(record) {
            remote.0.policy_for_start(&record.id, &record.network);
            return Ok(None);
        }
        let Some(network) = self.local_network(record) else {
            return Ok(None);
        };
        let policy = policy(&record.network)?;
        let kind = match record.class {
            SandboxClass::Container => LinkKind::Namespace,
            SandboxClass::LinuxVm => LinkKind::Tap,
        };
        let attachment = network
            .attach_as(&record.id, &policy, kind)
            .await
            .map_err(Failure::network("attach it to the network"))?;
        let link = match &attachment.link {
            Link::Namespace(path) => NetworkLink::Namespace(path.clone()),
            Link::Tap(device) => NetworkLink::Tap(TapLink {
                device: device.clone(),
                mac: attachment.guest_mac(),
                address: attachment.address,
                prefix_len: attachment.prefix_len,
                gateway: attachment.gateway,
            }),
        };
        Ok(Some(SandboxNetwork {
            link,
            resolv_conf: attachment.resolv_conf,
        }))
    }

    /// The network of this server's a sandbox is on: `None` without
    /// networking, or for a sandbox on a runner elsewhere (whose own network
    /// it is on).
    fn local_network(&self, record: &SandboxRecord) -> Option<&std::sync::Arc<cove_net::Network>> {
        self.shared
            .network()
            .filter(|_| self.shared.is_local(record))
    }

    /// Links a sandbox that was just attached with the sandbox it is linked
    /// to and those linked to it, wherever the other end runs too (a link
    /// is kept while the server runs; a restart makes it again as each end
    /// starts), so the end that is not running links when it starts. A link
    /// that cannot be made is logged, not fatal: the sandbox runs, unlinked.
    /// Nothing for a sandbox on no network of this server's.
    pub(crate) async fn relink(&self, record: &SandboxRecord) {
        let Some(network) = self.local_network(record) else {
            return;
        };
        let store = &self.shared.store;
        let owner = match &record.linked_sandbox_id {
            Some(owner) => store
                .find_sandbox(None, owner)
                .await
                .map(|found| found.into_iter().collect()),
            None => Ok(Vec::new()),
        };
        let linked_here = store.sandboxes_linked_to(&record.id).await;
        let peers = match (owner, linked_here) {
            (Ok(mut owner), Ok(linked_here)) => {
                owner.extend(linked_here);
                owner
            }
            (Err(error), _) | (_, Err(error)) => {
                tracing::warn!(sandbox = %record.id, %error, "finding the sandboxes linked to it");
                return;
            }
        };
        for peer in peers {
            match network.link((&peer.id, &peer.name), (&record.id, &record.name)) {
                Ok(()) | Err(cove_net::NetError::NotAttached { .. }) => {}
                Err(error) => {
                    let error = crate::error::describe(&error);
                    tracing::warn!(sandbox = %record.id, peer = %peer.id, %error, "linking it");
                }
            }
        }
    }

    /// Takes a sandbox off the network (its port deleted now or, for a
    /// paused machine, after the pause answers: see `cove_net::Deletion`).
    pub(crate) async fn detach_network(
        &self,
        record: &SandboxRecord,
        deletion: Deletion,
    ) -> Result<(), Failure> {
        match self.local_network(record) {
            Some(network) => network
                .detach(&record.id, deletion)
                .await
                .map_err(Failure::network("detach it from the network")),
            None => Ok(()),
        }
    }

    /// Gives up a deleted sandbox's address.
    pub(crate) async fn release_network(&self, record: &SandboxRecord) -> Result<(), Failure> {
        match self.local_network(record) {
            Some(network) => network
                .release(&record.id)
                .await
                .map_err(Failure::network("release its network address")),
            None => Ok(()),
        }
    }

    /// Replaces a sandbox's egress policy; a running sandbox gets it at once.
    /// `change` turns the current settings (read under the sandbox's lock, so
    /// concurrent partial changes both apply) into the new ones.
    pub async fn set_network_settings(
        &self,
        id_or_name: &str,
        change: impl FnOnce(NetworkSettings) -> NetworkSettings,
    ) -> Result<SandboxRecord, EngineError> {
        let id = self.get(id_or_name).await?.id;
        let lock = self.shared.lock_for(&id);
        let _guard = lock.lock().await;
        let mut record = self.get(&id).await?;
        let settings = crate::network::normalised(change(record.network.clone()))?;
        let checked = policy(&settings)?;
        if !self.shared.is_local(&record) {
            // Its runner keeps it: told now, applied there (at once if it runs).
            match self.shared.remote_of(&record) {
                Some(remote) if remote.0.networked() => {
                    remote.0.set_network(&record.id, &settings).await.map_err(
                        EngineError::runtime(&record.id, "change its network policy"),
                    )?
                }
                _ if settings == NetworkSettings::default() => {}
                _ => return Err(elsewhere_without_network(&record)),
            }
        } else if self.shared.network().is_none() && settings != NetworkSettings::default() {
            return Err(EngineError::NotImplemented {
                what: format!(
                    "network policies for {} sandboxes on this server (no sandbox networking)",
                    record.class
                ),
            });
        } else if record.state == SandboxState::Started {
            if let Some(network) = self.shared.network() {
                network
                    .set_policy(&record.id, &checked)
                    .await
                    .map_err(|source| EngineError::Network {
                        id: record.id.clone(),
                        operation: "change its network policy",
                        step: "apply the policy",
                        source,
                    })?;
            }
        }
        record.network = settings;
        record.updated_at_ms = crate::now_ms();
        self.shared.store.save_sandbox(&record).await?;
        Ok(record)
    }
}

/// Why a sandbox on a runner elsewhere has no network to set.
fn elsewhere_without_network(record: &SandboxRecord) -> EngineError {
    EngineError::NotImplemented {
        what: format!(
            "a network policy for sandboxes on runner {}, which gives them no network \
             (it runs with --no-network, or has not reported since this server started),",
            record.runner_id.as_deref().unwrap_or_default()
        ),
    }
}
