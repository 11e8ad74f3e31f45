//! The core of cove.
//!
//! The engine owns the sandboxes of one node: it takes an operation, asks the
//! lifecycle whether it is allowed, records the transient state, drives the
//! runtime, and records where the sandbox landed. Every front end (HTTP API, CLI
//! through the API, timers) goes through [`Engine`]; none of them touches the store
//! or a runtime directly. It knows nothing of HTTP or JSON.
//!
//! [`Engine`] is a façade over six parts, each with its own state over what
//! they all share ([`shared`]): [`Sandboxes`] (their lifecycle, forks,
//! captures, timers and recovery after a restart), [`Snapshots`] (images:
//! pulls, builds, build contexts, registries), [`Volumes`], [`Access`]
//! (API keys, previews, SSH access), [`Billing`] (the meter's intervals
//! priced) and [`Runners`] (the machines sandboxes run on, the operator's
//! switches of each, and the placement that `shared` does for a create
//! with what they report). A part reaches another only downwards:
//! sandboxes use snapshots and volumes; nothing uses sandboxes.
// EngineError keeps each cause whole as its source, so a caller can downcast
// it (to a RuntimeError, a NetError); errors are the cold path, so their size
// in every Result is accepted.
#![allow(clippy::result_large_err)]

mod access;
mod activity;
mod archive;
mod billing;
mod checks;
mod config;
mod error;
mod events;
mod failure;
mod metrics;
mod network;
mod organizations;
mod quota;
pub mod remote;
mod runners;
mod sandboxes;
mod shared;
mod snapshots;
mod volumes;

use std::collections::HashMap;
use std::sync::Arc;

use cove_lifecycle::SandboxClass;
use cove_runtime::Runtime;
use cove_store::Store;

pub use access::{
    constant_time_eq, hash_api_key, Access, ApiKeyInfo, Caller, IssuedSshAccess, KeyCheck,
    NewApiKey, Permission, SshAccessRecord, MAX_SSH_ACCESS_MINUTES,
};
pub use archive::{Archive, ArchiveError, MoveError};
pub use billing::Billing;
pub use config::{Ceilings, ContextLimits, EngineConfig, VolumeQuota};
pub use cove_billing::{month_containing, month_period, Bill, Line as BillLine, Prices};
pub use cove_lifecycle::{DesiredState, SandboxState};
pub use cove_store::{
    AuditQuery, AuditRecord, DockerRegistryRecord, NetworkSettings, OrganizationQuotaRecord,
    OrganizationRecord, RateLimit, RegionQuotaRecord, RunnerRecord, RunnerReport, RunnerSwitches,
    RunnerUsage, SandboxOrder, SandboxRecord, SandboxSortField, SignedPreview, SnapshotRecord,
    SortDirection, VolumeMount, VolumeRecord,
};
pub use error::{describe, EngineError, ErrorKind};
pub use events::{SandboxEvent, FEED_CAPACITY};
pub use network::{policy as network_policy, NetworkHandle};
pub use organizations::{Organizations, DEFAULT_ORGANIZATION};
pub use quota::{QuotaChange, Usage, REGION_ID};
pub use runners::{
    host_name, measure_host, send_subvolume, Host, ImageTar, NewRunner, RunnerIdentity,
    RunnerState, RunnerView, Runners, ServiceReport, CHECK_IN_EVERY, RUNNER_SILENCE,
    RUNNER_TOKEN_PREFIX,
};
pub use sandboxes::{CreateSandbox, Sandboxes, SettingChange, MAX_FORK_CHILDREN};
pub use snapshots::{
    parse_dockerfile, registry_host, BuildLog, ContextObject, DeclaredSha256, DockerfilePlan,
    ImageSnapshotRequest, PushGrant, RegistryRequest, Snapshots,
};
pub use volumes::Volumes;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The engine of one node. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<shared::Shared>,
    sandboxes: Sandboxes,
    snapshots: Snapshots,
    volumes: Volumes,
    access: Access,
    billing: Billing,
    organizations: Organizations,
    runners: Runners,
}

/// The parts of the engine as one organization sees them: lookups find only
/// its resources (another's are not found), and what is made is its.
#[derive(Clone)]
pub struct Scoped {
    sandboxes: Sandboxes,
    snapshots: Snapshots,
    volumes: Volumes,
}

impl Scoped {
    pub fn sandboxes(&self) -> &Sandboxes {
        &self.sandboxes
    }

    pub fn snapshots(&self) -> &Snapshots {
        &self.snapshots
    }

    pub fn volumes(&self) -> &Volumes {
        &self.volumes
    }
}

impl Engine {
    pub fn new(
        config: EngineConfig,
        store: Store,
        runtimes: HashMap<SandboxClass, Arc<dyn Runtime>>,
    ) -> Engine {
        let shared = Arc::new(shared::Shared::new(config, store, runtimes));
        let snapshots = Snapshots::new(shared.clone());
        let volumes = Volumes::new(shared.clone());
        let access = Access::new(shared.clone());
        Engine {
            sandboxes: Sandboxes::new(shared.clone(), snapshots.clone(), volumes.clone()),
            organizations: Organizations::new(shared.clone(), access.clone()),
            access,
            billing: Billing::new(shared.clone()),
            runners: Runners::new(shared.clone()),
            shared,
            snapshots,
            volumes,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }

    /// The engine as organization `organization_id` sees it. Whether the
    /// organization exists is the caller's to check (its key was found in
    /// it, or the operator named it).
    pub fn scoped(&self, organization_id: &str) -> Scoped {
        let scope = organizations::Scope::Organization(organization_id.into());
        Scoped {
            sandboxes: self.sandboxes.scoped(scope.clone()),
            snapshots: self.snapshots.scoped(scope.clone()),
            volumes: self.volumes.scoped(scope),
        }
    }

    /// Organizations: made and deleted by the operator.
    pub fn organizations(&self) -> &Organizations {
        &self.organizations
    }

    /// Sandboxes of every organization: create, operate, fork, capture,
    /// revert, timers. A request from an organization goes through
    /// [`Engine::scoped`] instead.
    pub fn sandboxes(&self) -> &Sandboxes {
        &self.sandboxes
    }

    /// Snapshots: images sandboxes are made from, their pulls and builds.
    pub fn snapshots(&self) -> &Snapshots {
        &self.snapshots
    }

    /// Volumes sandboxes mount.
    pub fn volumes(&self) -> &Volumes {
        &self.volumes
    }

    /// API keys, previews and SSH access.
    pub fn access(&self) -> &Access {
        &self.access
    }

    /// The accelerator VM sandboxes run on (`kvm`, `tcg`) and why it was
    /// chosen; `None` on a server without VMs.
    pub fn vm_accelerator(&self) -> Option<(&'static str, &'static str)> {
        self.shared
            .runtime(SandboxClass::LinuxVm)
            .ok()?
            .accelerator()
    }

    /// The meter and the bill.
    pub fn billing(&self) -> &Billing {
        &self.billing
    }

    /// The runners sandboxes run on: the server's own, for now.
    pub fn runners(&self) -> &Runners {
        &self.runners
    }

    /// Adds the engine's metrics to `registry`: its operation counters and
    /// timings, and a census taken now (sandboxes by state and class, what
    /// the runtimes and pools hold, storage use). Label values come only from
    /// closed sets (`metrics.rs`).
    pub async fn register_metrics(
        &self,
        registry: &mut prometheus_client::registry::Registry,
    ) -> Result<(), EngineError> {
        self.shared.register_metrics(registry).await
    }

    /// A new subscription to the feed of sandbox changes (a sandbox created,
    /// its state or desired state recorded), from now on.
    pub fn events(&self) -> tokio::sync::broadcast::Receiver<SandboxEvent> {
        self.shared.events.subscribe()
    }

    /// Has `hook` told of every sandbox's agent as the sandbox starts (a
    /// create, start, resume, fork or recovery), before the start is
    /// recorded; it must not block. Set once: false if one was set before.
    pub fn on_agent_started(
        &self,
        hook: impl Fn(&str, &cove_runtime::AgentEndpoint) + Send + Sync + 'static,
    ) -> bool {
        self.shared.on_agent_started(Box::new(hook))
    }

    /// Forgets every running sandbox, as the server stops: their ends from
    /// here on are the stop's doing, not failures to record. They stay
    /// `started` in the store, and the next start brings them back.
    pub fn forget_all_running(&self) {
        self.shared.forget_all_running();
    }

    /// Reconciles what is stored with what runs. Call once at start-up,
    /// before serving requests: builds the last server ran are ended, then
    /// every sandbox is brought to the state its user asked for.
    pub async fn recover_after_restart(&self) -> Result<(), EngineError> {
        self.runners.register_local().await?;
        // Whatever was metered as open ran on until now, the recovery's
        // time; from here each sandbox's own recovery splits it again.
        let reopened = self.shared.store.reopen_meters(now_ms()).await?;
        tracing::debug!(
            reopened,
            "meter intervals closed at the recovery and reopened"
        );
        self.snapshots.recover_after_restart().await?;
        self.sandboxes.recover_after_restart().await
    }
}
