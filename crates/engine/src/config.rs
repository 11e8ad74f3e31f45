//! Settings of the engine.

use std::time::Duration;

/// The largest resources one sandbox may ask for. A request above them is refused,
/// never reduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ceilings {
    pub cpu: i64,
    pub memory_gib: i64,
    pub disk_gib: i64,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The snapshot a create without one starts from.
    pub default_snapshot: String,
    pub ceilings: Ceilings,
    /// Resources of a sandbox that asks for none.
    pub default_cpu: i64,
    pub default_memory_gib: i64,
    pub default_disk_gib: i64,
    /// The user sandboxes run as when neither the create nor the image
    /// names one and the image has it (`daytona`); root otherwise.
    pub os_user: String,
    /// How often timers are checked.
    pub timer_tick: Duration,
    /// Where archived sandboxes go; without one, archive is refused.
    pub archive: Option<crate::Archive>,
    /// The cache images from registries are pulled into; without one, creating
    /// from an image is refused.
    pub images: Option<cove_images::ImageStore>,
    /// The node's sandbox network; without one, sandboxes have only loopback.
    pub network: Option<crate::NetworkHandle>,
    /// Where volumes live (a directory each); without one, volumes are refused.
    pub volumes_dir: Option<std::path::PathBuf>,
    /// Caps each new volume (a subvolume of this storage, `volumes_dir` on it)
    /// so that no sandbox writing a volume can fill the storage every sandbox
    /// shares; without it a volume is a plain directory.
    pub volume_quota: Option<VolumeQuota>,
    /// Where uploaded build contexts (COPY/ADD files) are kept; without one,
    /// push access and builds with contexts are refused.
    pub build_contexts_dir: Option<std::path::PathBuf>,
    /// What one client may upload as build contexts.
    pub context_limits: ContextLimits,
    /// Where `POST /api/snapshots/import` may read image archives and
    /// layouts from (a client names a path inside it); without one,
    /// imports are refused.
    pub import_dir: Option<std::path::PathBuf>,
    /// The server's data directory, whose filesystem the metrics report
    /// (with the sandbox storage's, `volume_quota`'s); without one, only the
    /// storage's is reported.
    pub data_dir: Option<std::path::PathBuf>,
    /// What the bill charges: per vCPU-hour, GB-hour of memory and of disk,
    /// GB-month of snapshots past a free allowance, less monthly credits.
    pub prices: cove_billing::Prices,
    /// The server's own runner: every sandbox goes to it.
    pub runner: crate::RunnerIdentity,
    /// How long a runner on another machine may be silent before it is
    /// unresponsive.
    pub runner_silence: std::time::Duration,
    /// The client side of TLS to runners elsewhere (the roots their
    /// certificates chain to): with it, runners are reached over
    /// `https://` only; without it, over `http://`.
    pub runner_tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

/// Bounds on build-context uploads: a client with push credentials must
/// not be able to fill the server's disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextLimits {
    /// The largest context (one object, all its parts together), bytes.
    pub max_bytes: u64,
    /// How many uploads in parts one grant may have in progress at once.
    pub max_uploads_per_grant: usize,
}

impl Default for ContextLimits {
    fn default() -> Self {
        ContextLimits {
            max_bytes: 10 << 30,
            max_uploads_per_grant: 16,
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            default_snapshot: "cove-default".into(),
            ceilings: Ceilings {
                cpu: 4,
                memory_gib: 8,
                disk_gib: 20,
            },
            default_cpu: 1,
            default_memory_gib: 1,
            default_disk_gib: 3,
            os_user: cove_images::DEFAULT_USER.into(),
            timer_tick: Duration::from_secs(1),
            archive: None,
            images: None,
            network: None,
            volumes_dir: None,
            volume_quota: None,
            build_contexts_dir: None,
            context_limits: ContextLimits::default(),
            import_dir: None,
            data_dir: None,
            prices: cove_billing::Prices::default(),
            runner: crate::RunnerIdentity::default(),
            runner_silence: crate::runners::RUNNER_SILENCE,
            runner_tls: None,
        }
    }
}

/// The storage volumes are made on, and the size each may reach.
#[derive(Clone, Debug)]
pub struct VolumeQuota {
    pub storage: std::sync::Arc<cove_runtime::storage::Storage>,
    pub bytes: u64,
}
