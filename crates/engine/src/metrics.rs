//! What the engine measures of its own work, for the server's `/metrics`:
//! every sandbox operation it runs, counted by outcome and timed, and a
//! census taken when a scrape asks (sandboxes by state and class, what each
//! runtime and the network's pool hold, storage use).
//!
//! The engine counts; the API exposes: it makes a registry per scrape, has
//! [`crate::Engine::register_metrics`] add these families to it, and writes
//! the text format. Nothing here is tracked incrementally but the operation
//! counters: the census is read from the store and the runtimes' own tables
//! each time, so it cannot drift from them.
//!
//! Every label value is a `&'static str` written in this crate (operation,
//! class, state, outcome and filesystem names), so nothing a user or a
//! sandbox controls (ids, names, labels) can become a label: no series per
//! sandbox, and no text of theirs in the exposition.

use std::collections::BTreeMap;
use std::time::Duration;

use cove_lifecycle::{Operation, SandboxClass, SandboxState};
use cove_runtime::storage::{filesystem_usage, FilesystemUsage};
use cove_runtime::Census;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::shared::Shared;
use crate::EngineError;

/// An operation the engine measures: a new sandbox, or one lifecycle
/// operation on an existing one (a fork is `Run(Operation::Fork)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Measured {
    Create,
    Run(Operation),
}

impl Measured {
    /// The operation's label value (and its name in logs).
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Measured::Create => "create",
            // A label value reads better without a space.
            Measured::Run(Operation::ColdStart) => "cold_start",
            Measured::Run(operation) => operation.as_str(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation: &'static str,
    class: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DurationLabels {
    operation: &'static str,
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabels {
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProcessLabels {
    class: &'static str,
    process: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: &'static str,
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FilesystemLabels {
    filesystem: &'static str,
}

fn operation_buckets() -> Histogram {
    // 10 ms to about 5.5 minutes: a container starts in milliseconds, a VM
    // under TCG takes seconds, an archive of a large disk minutes.
    Histogram::new(exponential_buckets(0.01, 2.0, 16))
}

/// The engine's operation counters and timings; cheap to clone, clones share.
#[derive(Clone)]
pub(crate) struct Metrics {
    operations: Family<OperationLabels, Counter>,
    durations: Family<DurationLabels, Histogram, fn() -> Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            operations: Family::default(),
            durations: Family::new_with_constructor(operation_buckets),
        }
    }
}

impl Metrics {
    /// Counts one operation that ran (its side effect was tried) and how
    /// long it took.
    pub(crate) fn observe(
        &self,
        operation: Measured,
        class: SandboxClass,
        succeeded: bool,
        took: Duration,
    ) {
        let (operation, class) = (operation.as_str(), class.as_str());
        let outcome = if succeeded { "ok" } else { "error" };
        self.operations
            .get_or_create(&OperationLabels {
                operation,
                class,
                outcome,
            })
            .inc();
        self.durations
            .get_or_create(&DurationLabels { operation, class })
            .observe(took.as_secs_f64());
    }
}

/// What the census found, before it becomes gauges.
struct Found {
    /// Sandboxes by (state, class); every state of every class served is
    /// there, zero or not, so a series does not vanish when it empties.
    sandboxes: BTreeMap<(&'static str, &'static str), i64>,
    /// The disk sizes the sandboxes of each class were given, in bytes.
    disk_allocated: BTreeMap<&'static str, i64>,
    runtimes: Vec<(&'static str, Census)>,
    /// Namespaces waiting in the network's pool (containers take them).
    ready_namespaces: Option<usize>,
    snapshots: i64,
    /// The sizes the store records for snapshots (pulled images record
    /// theirs; captures record none).
    snapshot_bytes: i64,
    volumes: i64,
    volume_quota_bytes: Option<u64>,
    filesystems: Vec<(&'static str, FilesystemUsage)>,
}

impl Shared {
    async fn census(&self) -> Result<Found, EngineError> {
        let mut runtimes: Vec<(&'static str, Census)> = self
            .runtimes()
            .map(|(class, runtime)| (class.as_str(), runtime.census()))
            .collect();
        runtimes.sort_by_key(|(class, _)| *class);
        let mut sandboxes = BTreeMap::new();
        let mut disk_allocated = BTreeMap::new();
        for (class, _) in &runtimes {
            for state in SandboxState::ALL {
                sandboxes.insert((state.as_str(), *class), 0);
            }
            disk_allocated.insert(*class, 0);
        }
        for record in self.store.list_sandboxes().await? {
            let class = record.class.as_str();
            *sandboxes.entry((record.state.as_str(), class)).or_default() += 1;
            *disk_allocated.entry(class).or_default() += record.disk_gib << 30;
        }
        let snapshot_records = self.store.list_snapshots().await?;
        let volume_records = self.store.list_volumes().await?;
        let quota = self.config.volume_quota.as_ref();
        // One statvfs each: the data directory (database, images, archive)
        // and the loop-mounted storage every sandbox and volume writes.
        let mut filesystems = Vec::new();
        let storage = quota.map(|q| q.storage.root().to_owned());
        for (name, path) in [("data", self.config.data_dir.clone()), ("storage", storage)] {
            let Some(path) = path else { continue };
            match filesystem_usage(&path) {
                Ok(usage) => filesystems.push((name, usage)),
                // A scrape still answers; the gap in the series says the rest.
                Err(error) => tracing::warn!(%error, "metrics: filesystem usage"),
            }
        }
        Ok(Found {
            sandboxes,
            disk_allocated,
            runtimes,
            ready_namespaces: self.network().map(|network| network.ready_namespaces()),
            snapshots: snapshot_records.len() as i64,
            snapshot_bytes: snapshot_records.iter().filter_map(|s| s.size_bytes).sum(),
            volumes: volume_records.len() as i64,
            volume_quota_bytes: quota.map(|q| q.bytes),
            filesystems,
        })
    }

    /// Adds the operation counters and a census taken now to `registry`.
    pub(crate) async fn register_metrics(
        &self,
        registry: &mut Registry,
    ) -> Result<(), EngineError> {
        let found = self.census().await?;
        registry.register(
            "sandbox_operations",
            "Sandbox operations the engine ran, by operation, class and outcome",
            self.metrics.operations.clone(),
        );
        registry.register_with_unit(
            "sandbox_operation_duration",
            "How long sandbox operations took: a new sandbox from its row to started, any other operation its work (runtime, network, archive)",
            Unit::Seconds,
            self.metrics.durations.clone(),
        );

        let sandboxes = Family::<StateLabels, Gauge>::default();
        for ((state, class), count) in &found.sandboxes {
            sandboxes
                .get_or_create(&StateLabels { state, class })
                .set(*count);
        }
        registry.register("sandboxes", "Sandboxes by state and class", sandboxes);

        let disk = Family::<ClassLabels, Gauge>::default();
        for (class, bytes) in &found.disk_allocated {
            disk.get_or_create(&ClassLabels { class }).set(*bytes);
        }
        registry.register_with_unit(
            "sandbox_disk_allocated",
            "Disk sizes given to the stored sandboxes (their quotas), by class",
            Unit::Bytes,
            disk,
        );

        let processes = Family::<ProcessLabels, Gauge>::default();
        let pools = Family::<PoolLabels, Gauge>::default();
        for (class, census) in &found.runtimes {
            for (process, count) in [("agent", census.agents), ("qemu", census.qemu_processes)] {
                processes
                    .get_or_create(&ProcessLabels { class, process })
                    .set(count as i64);
            }
            pools
                .get_or_create(&PoolLabels {
                    pool: "machines",
                    class,
                })
                .set(census.warm as i64);
        }
        if let Some(ready) = found.ready_namespaces {
            pools
                .get_or_create(&PoolLabels {
                    pool: "network_namespaces",
                    class: SandboxClass::Container.as_str(),
                })
                .set(ready as i64);
        }
        registry.register(
            "runtime_processes",
            "Processes the runtimes hold for sandboxes: agents of live sandboxes, QEMU processes",
            processes,
        );
        registry.register(
            "warm_pool",
            "What waits ready for new sandboxes: warm machines, and network namespaces for containers",
            pools,
        );

        let filesystems = Family::<FilesystemLabels, Gauge>::default();
        let available = Family::<FilesystemLabels, Gauge>::default();
        for (filesystem, usage) in &found.filesystems {
            let labels = FilesystemLabels { filesystem };
            filesystems.get_or_create(&labels).set(usage.used as i64);
            available.get_or_create(&labels).set(usage.available as i64);
        }
        registry.register_with_unit(
            "filesystem_used",
            "Bytes used on the data directory's and the sandbox storage's filesystems",
            Unit::Bytes,
            filesystems,
        );
        registry.register_with_unit(
            "filesystem_available",
            "Bytes still available on the data directory's and the sandbox storage's filesystems",
            Unit::Bytes,
            available,
        );

        let snapshots: Gauge = Gauge::default();
        snapshots.set(found.snapshots);
        registry.register("snapshots", "Snapshots the server holds", snapshots);
        let snapshot_bytes: Gauge = Gauge::default();
        snapshot_bytes.set(found.snapshot_bytes);
        registry.register_with_unit(
            "snapshot_recorded_size",
            "The sizes recorded for snapshots (pulled images; captures record none)",
            Unit::Bytes,
            snapshot_bytes,
        );
        let volumes: Gauge = Gauge::default();
        volumes.set(found.volumes);
        registry.register("volumes", "Volumes the server holds", volumes);
        if let Some(bytes) = found.volume_quota_bytes {
            let quota: Gauge = Gauge::default();
            quota.set(bytes as i64);
            registry.register_with_unit(
                "volume_quota",
                "The size each volume may reach",
                Unit::Bytes,
                quota,
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_labels_are_single_words() {
        let mut names: Vec<&str> = Operation::ALL
            .into_iter()
            .map(|operation| Measured::Run(operation).as_str())
            .collect();
        names.push(Measured::Create.as_str());
        for name in names {
            assert!(
                name.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{name:?} is no plain label value"
            );
        }
    }

    #[test]
    fn an_operation_is_counted_by_outcome_and_timed() {
        let metrics = Metrics::default();
        let create = Measured::Create;
        metrics.observe(
            create,
            SandboxClass::Container,
            true,
            Duration::from_millis(20),
        );
        metrics.observe(
            create,
            SandboxClass::Container,
            false,
            Duration::from_secs(3),
        );
        let mut registry = Registry::with_prefix("cove");
        registry.register("sandbox_operations", "ops", metrics.operations.clone());
        registry.register_with_unit(
            "sandbox_operation_duration",
            "durations",
            Unit::Seconds,
            metrics.durations.clone(),
        );
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        for line in [
            r#"cove_sandbox_operations_total{operation="create",class="container",outcome="ok"} 1"#,
            r#"cove_sandbox_operations_total{operation="create",class="container",outcome="error"} 1"#,
            r#"cove_sandbox_operation_duration_seconds_count{operation="create",class="container"} 2"#,
            r#"cove_sandbox_operation_duration_seconds_bucket{operation="create",class="container",le="0.02"} 1"#,
            r#"cove_sandbox_operation_duration_seconds_bucket{operation="create",class="container",le="2.56"} 1"#,
            r#"cove_sandbox_operation_duration_seconds_bucket{operation="create",class="container",le="5.12"} 2"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from:\n{text}"
            );
        }
    }
}
