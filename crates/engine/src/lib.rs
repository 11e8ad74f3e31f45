//! The core of cove.
//!
//! The engine owns the sandboxes of one node: it takes an operation, asks the
//! lifecycle whether it is allowed, records the transient state, drives the
//! runtime, and records where the sandbox landed. Every front end (HTTP API, CLI
//! through the API, timers) goes through [`Engine`]; none of them touches the store
//! or a runtime directly. It knows nothing of HTTP or JSON.
// EngineError keeps each cause whole as its source, so a caller can downcast
// it (to a RuntimeError, a NetError); errors are the cold path, so their size
// in every Result is accepted.
#![allow(clippy::result_large_err)]

mod activity;
mod archive;
mod auth;
mod build;
mod build_host;
mod config;
mod contexts;
mod create;
mod error;
mod failure;
mod forks;
mod images;
mod network;
mod operations;
mod preview;
mod recovery;
mod registries;
mod settings;
mod snapshots;
mod ssh_access;
mod timers;
mod volumes;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cove_lifecycle::SandboxClass;
use cove_runtime::{AgentEndpoint, Runtime};
use cove_store::Store;

pub use archive::{Archive, ArchiveError};
pub use auth::hash_api_key;
pub use build::{parse_dockerfile, BuildLog, DockerfilePlan};
pub use config::{Ceilings, ContextLimits, EngineConfig, VolumeQuota};
pub use contexts::{ContextObject, DeclaredSha256, PushGrant};
pub use cove_lifecycle::{DesiredState, SandboxState};
pub use cove_store::{
    DockerRegistryRecord, NetworkSettings, SandboxRecord, SignedPreview, SnapshotRecord,
    VolumeMount, VolumeRecord,
};
pub use create::CreateSandbox;
pub use error::{describe, EngineError, ErrorKind};
pub use images::ImageSnapshotRequest;
pub use network::{policy as network_policy, NetworkHandle};
pub use registries::{registry_host, RegistryRequest};
pub use settings::SettingChange;
pub use ssh_access::{IssuedSshAccess, SshAccessRecord, MAX_SSH_ACCESS_MINUTES};

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A sandbox the runtime reported running, and which start it came from.
#[derive(Clone, Debug)]
struct Running {
    agent: AgentEndpoint,
    /// How a VM executes ("kvm" or "tcg"); `None` for containers.
    accelerator: Option<&'static str>,
    /// Tells a late exit notice of an earlier start from the current one.
    generation: u64,
}

/// The engine of one node. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    config: EngineConfig,
    store: Store,
    runtimes: HashMap<SandboxClass, Arc<dyn Runtime>>,
    /// One lock per sandbox: operations on a sandbox run one after the other.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    running: Mutex<HashMap<String, Running>>,
    generation: std::sync::atomic::AtomicU64,
    activity: activity::Activity,
    /// Build logs of image builds since the server started, by snapshot id.
    builds: Mutex<HashMap<String, Arc<build::BuildLog>>>,
    /// Uploaded build contexts and the grants to upload them.
    contexts: Option<contexts::ContextStore>,
    /// Stored key hashes, read once: checking a key must not cost a query per request.
    api_keys: std::sync::RwLock<Option<Vec<String>>>,
    /// Bumped whenever SSH access tokens go away (revoked, or with their
    /// sandbox): live SSH connections re-check their token when it changes.
    ssh_revocations: tokio::sync::watch::Sender<u64>,
}

impl Engine {
    pub fn new(
        config: EngineConfig,
        store: Store,
        runtimes: HashMap<SandboxClass, Arc<dyn Runtime>>,
    ) -> Engine {
        let contexts = config
            .build_contexts_dir
            .clone()
            .map(|dir| contexts::ContextStore::new(dir, config.context_limits));
        Engine {
            inner: Arc::new(Inner {
                config,
                store,
                runtimes,
                locks: Mutex::default(),
                running: Mutex::default(),
                generation: Default::default(),
                activity: activity::Activity::default(),
                builds: Mutex::default(),
                contexts,
                api_keys: Default::default(),
                ssh_revocations: tokio::sync::watch::Sender::new(0),
            }),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    fn runtime(&self, class: SandboxClass) -> Result<&Arc<dyn Runtime>, EngineError> {
        self.inner
            .runtimes
            .get(&class)
            .ok_or(EngineError::ClassUnavailable {
                class: class.as_str(),
            })
    }

    fn lock_for(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.inner
            .locks
            .lock()
            .unwrap()
            .entry(id.to_owned())
            .or_default()
            .clone()
    }

    /// The sandbox with this id or name.
    pub async fn get(&self, id_or_name: &str) -> Result<SandboxRecord, EngineError> {
        let mut record = self
            .inner
            .store
            .find_sandbox(id_or_name)
            .await?
            .ok_or_else(|| EngineError::SandboxNotFound {
                id: id_or_name.to_owned(),
            })?;
        self.inner.activity.apply(&mut record);
        Ok(record)
    }

    /// Every sandbox, oldest first.
    pub async fn list(&self) -> Result<Vec<SandboxRecord>, EngineError> {
        let mut records = self.inner.store.list_sandboxes().await?;
        for record in &mut records {
            self.inner.activity.apply(record);
        }
        Ok(records)
    }

    /// Every snapshot sandboxes can be created from.
    pub async fn snapshots(&self) -> Result<Vec<SnapshotRecord>, EngineError> {
        Ok(self.inner.store.list_snapshots().await?)
    }

    /// Registers a snapshot (the server's own default image, for one).
    pub async fn register_snapshot(&self, snapshot: &SnapshotRecord) -> Result<(), EngineError> {
        Ok(self.inner.store.save_snapshot(snapshot).await?)
    }

    /// Where the agent of a started sandbox listens; counts as an interaction.
    pub async fn toolbox(&self, id_or_name: &str) -> Result<(String, AgentEndpoint), EngineError> {
        let (record, agent) = self.agent(id_or_name).await?;
        self.touch(&record.id);
        Ok((record.id, agent))
    }

    /// How a running VM executes ("kvm" or "tcg"); `None` for containers and
    /// for sandboxes that are not running.
    pub fn accelerator(&self, id: &str) -> Option<&'static str> {
        self.inner
            .running
            .lock()
            .unwrap()
            .get(id)
            .and_then(|r| r.accelerator)
    }

    /// Resets the idle clock of a sandbox.
    pub fn touch(&self, id: &str) {
        self.inner.activity.touch(id, now_ms());
    }
}
