//! The records the store keeps, as plain data.

use std::collections::BTreeMap;

use cove_lifecycle::{DesiredState, SandboxClass, SandboxState, TimerSettings};

/// One sandbox row.
#[derive(Clone, Debug, PartialEq)]
pub struct SandboxRecord {
    pub id: String,
    /// The organization that owns it; its name is unique there.
    pub organization_id: String,
    pub name: String,
    pub snapshot: String,
    pub class: SandboxClass,
    pub state: SandboxState,
    pub desired_state: DesiredState,
    pub error_reason: Option<String>,
    pub os_user: String,
    pub cpu: i64,
    pub gpu: i64,
    pub memory_mib: i64,
    pub disk_gib: i64,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub public: bool,
    pub timers: TimerSettings,
    pub ttl_minutes: i64,
    pub ttl_deadline_ms: Option<i64>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub state_since_ms: i64,
    pub last_activity_ms: i64,
    /// May pause (keeps its memory on disk); ephemeral sandboxes are not persistent.
    pub persistent: bool,
    /// cove may reclaim its capacity: it is then paused (persistent) or deleted.
    pub spot: bool,
    /// The sandbox this one was forked from.
    pub parent_id: Option<String>,
    /// The sandbox this (ephemeral) one shares a private network with.
    pub linked_sandbox_id: Option<String>,
    /// Its egress policy, as the user gave it.
    pub network: NetworkSettings,
    /// The volumes it mounts.
    pub volumes: Vec<VolumeMount>,
    /// The runner that holds its storage and runs it; `None` only in a row
    /// from before runners, until the server's runner claims it.
    pub runner_id: Option<String>,
}

impl SandboxRecord {
    /// A started container sandbox as a fresh create makes it (1 vCPU,
    /// 1 GiB, 3 GiB, Daytona's default timers, no labels, created at the
    /// epoch): a base for tests of the crates that read records, which set
    /// what they look at.
    pub fn sample(id: &str, name: &str) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            organization_id: crate::DEFAULT_ORGANIZATION.into(),
            name: name.into(),
            snapshot: "cove-default".into(),
            class: SandboxClass::Container,
            state: SandboxState::Started,
            desired_state: DesiredState::Started,
            error_reason: None,
            os_user: "daytona".into(),
            cpu: 1,
            gpu: 0,
            memory_mib: 1024,
            disk_gib: 3,
            env: BTreeMap::new(),
            labels: BTreeMap::new(),
            public: false,
            timers: TimerSettings {
                auto_stop: 15,
                auto_pause: 0,
                auto_archive: 10080,
                auto_delete: -1,
            },
            ttl_minutes: 0,
            ttl_deadline_ms: None,
            created_at_ms: 0,
            updated_at_ms: 0,
            state_since_ms: 0,
            last_activity_ms: 0,
            persistent: true,
            spot: false,
            parent_id: None,
            linked_sandbox_id: None,
            network: NetworkSettings::default(),
            volumes: Vec::new(),
            runner_id: None,
        }
    }
}

/// A volume mounted into a sandbox.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMount {
    pub volume_id: String,
    /// Absolute path inside the sandbox.
    pub mount_path: String,
    /// A directory inside the volume mounted instead of its root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subpath: Option<String>,
}

/// A volume: a directory that outlives the sandboxes it is mounted into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeRecord {
    pub id: String,
    pub organization_id: String,
    pub name: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub last_used_at_ms: Option<i64>,
}

/// A sandbox's egress policy as the user gave it (checked by the engine).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct NetworkSettings {
    /// Nothing leaves the sandbox.
    pub block_all: bool,
    /// If not empty, only these CIDRs (and `domains`) are reachable.
    pub allow_list: Vec<String>,
    /// Never reachable (a cove extension).
    pub deny_list: Vec<String>,
    /// If not empty, only these names resolve, and what they resolve to is reachable.
    pub domains: Vec<String>,
}

/// Where a snapshot is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotState {
    Pending,
    /// An image is being pulled from its registry.
    Pulling,
    Building,
    Active,
    Inactive,
    Error,
}

impl SnapshotState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Pulling => "pulling",
            Self::Building => "building",
            Self::Active => "active",
            Self::Inactive => "inactive",
            Self::Error => "error",
        }
    }

    pub fn parse(s: &str) -> Option<SnapshotState> {
        [
            Self::Pending,
            Self::Pulling,
            Self::Building,
            Self::Active,
            Self::Inactive,
            Self::Error,
        ]
        .into_iter()
        .find(|state| state.as_str() == s)
    }
}

/// One snapshot row: a root filesystem sandboxes start from.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotRecord {
    pub id: String,
    /// The organization that owns it (a general snapshot, which every
    /// organization sees, is the default organization's row).
    pub organization_id: String,
    pub name: String,
    pub class: SandboxClass,
    pub state: SnapshotState,
    pub error_reason: Option<String>,
    /// The read-only root filesystem on disk.
    pub rootfs: String,
    /// Read-only layers over `rootfs`, topmost first (captures of sandboxes).
    pub layers: Vec<String>,
    /// The runtime's capture holding the topmost layer, for a snapshot of a sandbox.
    pub capture_id: Option<String>,
    /// The sandbox the snapshot was taken from.
    pub source_sandbox: Option<String>,
    pub cpu: i64,
    pub gpu: i64,
    pub memory_mib: i64,
    pub disk_gib: i64,
    pub size_bytes: Option<i64>,
    /// Holds the machine's memory too: sandboxes made from it continue from it.
    pub has_memory: bool,
    /// Environment the image asks for; a sandbox's own variables override it.
    pub env: BTreeMap<String, String>,
    /// What the image asks of its sandboxes besides the environment.
    pub image: ImageSettings,
    /// Provided by the server itself rather than by a user.
    pub general: bool,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// An image's WORKDIR, USER, ENTRYPOINT and CMD.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageSettings {
    /// Where commands start; `None` is the user's home.
    pub workdir: Option<String>,
    /// Who the sandbox's processes run as; `None` is root.
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

impl ImageSettings {
    /// What a container of the image runs: the ENTRYPOINT with the CMD as
    /// its arguments, or the CMD alone.
    pub fn command(&self) -> Vec<String> {
        self.entrypoint.iter().chain(&self.cmd).cloned().collect()
    }
}

/// One cached step of an image build: the layer it made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildStepRecord {
    /// A hash of the base image and every instruction up to this one.
    pub cache_key: String,
    /// The runtime's capture that holds the layer.
    pub capture_id: String,
    pub layer: String,
    pub created_at_ms: i64,
}

impl SnapshotRecord {
    /// An active snapshot of a whole root filesystem, provided by the server
    /// (an image), with the default resources of 1 vCPU, 1 GiB and 3 GiB.
    pub fn for_image(name: &str, rootfs: &str, class: SandboxClass, at_ms: i64) -> SnapshotRecord {
        SnapshotRecord {
            id: name.to_owned(),
            organization_id: crate::DEFAULT_ORGANIZATION.into(),
            name: name.to_owned(),
            class,
            state: SnapshotState::Active,
            error_reason: None,
            rootfs: rootfs.to_owned(),
            layers: Vec::new(),
            capture_id: None,
            source_sandbox: None,
            cpu: 1,
            gpu: 0,
            memory_mib: 1024,
            disk_gib: 3,
            size_bytes: None,
            has_memory: false,
            env: BTreeMap::new(),
            image: ImageSettings::default(),
            general: true,
            created_at_ms: at_ms,
            updated_at_ms: at_ms,
        }
    }
}

/// Credentials for one image registry.
#[derive(Clone, PartialEq, Eq)]
pub struct DockerRegistryRecord {
    pub id: String,
    pub organization_id: String,
    pub name: String,
    /// As the user gave it: `host[:port]`, optionally with a scheme and path.
    pub url: String,
    pub username: String,
    pub password: String,
    /// A namespace within the registry; may be empty.
    pub project: String,
    /// Daytona's kind (`organization` for user-made ones).
    pub registry_type: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl std::fmt::Debug for DockerRegistryRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DockerRegistryRecord")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("url", &self.url)
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .field("project", &self.project)
            .finish()
    }
}
