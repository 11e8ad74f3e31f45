//! `cove bench`: latency (and, for files, throughput) of a scenario over N runs.
//!
//! A benchmark measures; it asserts nothing. Without `--url` it starts its own
//! server as a child process on a temporary data directory, so the server's
//! memory can be read apart from the client's.

mod density;
mod desktop;
mod files;
mod neighbours;
mod own_server;
mod preview;
mod scenarios;
mod snapshot;
mod vm;

use anyhow::Context;
use serde_json::{json, Map, Value};

use crate::client::Client;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scenario {
    /// Create a sandbox until its first command answers (the sandbox is deleted untimed).
    Create,
    /// Round trip of `true` in a running sandbox.
    Exec,
    /// Upload then download a large file through the API (see --size-mb).
    Files,
    /// Live snapshots of a running sandbox that wrote --size-mb, then create
    /// from each snapshot to first command.
    Snapshot,
    /// Download a --size-mb file through a preview URL (cove's listener and the
    /// agent's tunnel to a server in the sandbox); also small-request round trips.
    Preview,
    /// Create to first command on a server without sandbox networking, then on
    /// one with it: the latency networking adds (own servers only).
    Net,
    /// Create a VM sandbox (from its pre-booted template) until its first
    /// command answers (see --vm-snapshot).
    VmCreate,
    /// Pause of a running VM until `paused`; resume figures beside.
    VmPause,
    /// Resume of a paused VM until its first command answers; pause figures beside.
    VmResume,
    /// Fork of a running VM until the child answers a command, with the
    /// longest stop the parent's processes saw; with --children N, a fork
    /// into N until every child answers.
    VmFork,
    /// --n idle containers (--vm: VMs of 256 MiB) at once: host memory
    /// each, create rate, and exec round trips at --n beside those at 10
    /// (the figures); all deleted after.
    Density,
    /// Full-screen screenshots of a 1280x800 desktop (PNG; JPEG at quality
    /// 70 beside), in a container, or a VM with --on-vm.
    Screenshot,
    /// The computer-use input round trip: a mouse move answered (--on-vm: in a VM).
    Input,
}

impl Scenario {
    fn uses_vms(self, args: &BenchArgs) -> bool {
        matches!(
            self,
            Scenario::VmCreate | Scenario::VmPause | Scenario::VmResume | Scenario::VmFork
        ) || (args.vm && self == Scenario::Density)
            || (args.on_vm && matches!(self, Scenario::Screenshot | Scenario::Input))
    }
}

#[derive(clap::Args, Debug)]
pub(crate) struct BenchArgs {
    pub scenario: Scenario,
    /// API URL of a running server; without it a server is started here.
    #[arg(long)]
    pub url: Option<String>,
    /// API key for --url.
    #[arg(long, env = "COVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Number of measured runs.
    #[arg(long, default_value_t = 50)]
    pub n: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Images directory of the server started here: by default the one of
    /// `cove serve` on its default data dir, so the default image is built
    /// once for both.
    #[arg(long, env = "COVE_IMAGES_DIR", default_value = crate::serve::DEFAULT_IMAGES_DIR)]
    pub images_dir: std::path::PathBuf,
    /// Size of the file of the `files`, `snapshot` and `preview` scenarios, in MiB.
    #[arg(long, default_value_t = 1024)]
    pub size_mb: u64,
    /// The snapshot of the VM scenarios (a larger one shows how memory size matters).
    #[arg(long, default_value = "daytona-vm-small")]
    pub vm_snapshot: String,
    /// Run the desktop scenarios (screenshot, input) in a VM of --vm-snapshot.
    #[arg(long)]
    pub on_vm: bool,
    /// Children of each fork of the vm-fork scenario: more than one forks
    /// into them all at once (`POST /sandbox/{id}/forks`).
    #[arg(long, default_value_t = 1)]
    pub children: usize,
    /// The density scenario on VMs of 256 MiB (`daytona-vm-tiny`) instead
    /// of containers; host memory is then the PSS of their QEMU processes.
    #[arg(long)]
    pub vm: bool,
    /// Idle time between the create scenario's runs, in milliseconds: with
    /// 0 each create follows the last one's delete at once, and the
    /// server's background work (its pools' refills, the last sandbox's
    /// teardown) shares the cores with it.
    #[arg(long, default_value_t = 0)]
    pub gap_ms: u64,
}

/// What one scenario measured: times of each run in milliseconds, and extra
/// figures it reports by name.
pub(crate) struct Measurement {
    pub samples: Vec<f64>,
    pub extra: Map<String, Value>,
}

/// Median, p95 and p99 of `samples` in milliseconds (nearest-rank).
pub(crate) fn summarize(samples: &mut [f64]) -> (f64, f64, f64) {
    samples.sort_by(f64::total_cmp);
    let rank = |p: f64| {
        let index = ((p / 100.0) * samples.len() as f64).ceil() as usize;
        samples[index.clamp(1, samples.len()) - 1]
    };
    (rank(50.0), rank(95.0), rank(99.0))
}

pub(crate) async fn run(args: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.n > 0, "--n must be at least 1");
    anyhow::ensure!(
        (1..=cove_engine::MAX_FORK_CHILDREN).contains(&args.children),
        "--children must be 1 to {}",
        cove_engine::MAX_FORK_CHILDREN
    );
    if args.scenario == Scenario::Net {
        anyhow::ensure!(
            args.url.is_none(),
            "the net scenario compares two servers of its own; it takes no --url"
        );
    }
    let own = match &args.url {
        Some(_) => None,
        None => {
            // A waiting VM of the warm pool would take CPU from container
            // scenarios; only the VM scenarios start VMs.
            let extra: &[&str] = if args.scenario.uses_vms(&args) {
                &[]
            } else {
                &["--no-vm"]
            };
            Some(own_server::OwnServer::start(&args.images_dir, extra).await?)
        }
    };
    let client = match (&args.url, &own) {
        (Some(url), _) => Client::new(
            url,
            args.api_key
                .as_deref()
                .context("--url needs an API key (COVE_API_KEY)")?,
        ),
        (None, Some(own)) => own.client(),
        (None, None) => unreachable!("a server is started when no URL is given"),
    };
    let measured = match args.scenario {
        Scenario::Create => {
            let gap = std::time::Duration::from_millis(args.gap_ms);
            scenarios::create_to_first_command(&client, args.n, gap).await
        }
        Scenario::Exec => scenarios::exec_round_trip(&client, args.n).await,
        Scenario::Files => {
            let size = args.size_mb << 20;
            scenarios::with_sandbox(&client, async |s| {
                files::transfer(&client, s, args.n, size).await
            })
            .await
        }
        Scenario::Snapshot => {
            scenarios::with_sandbox(&client, async |s| {
                snapshot::live(&client, s, args.n, args.size_mb).await
            })
            .await
        }
        Scenario::Preview => {
            let size = args.size_mb << 20;
            scenarios::with_sandbox(&client, async |s| {
                preview::download(&client, s, args.n, size).await
            })
            .await
        }
        Scenario::Net => network_cost(&client, &args).await,
        Scenario::VmCreate => vm::create(&client, &args.vm_snapshot, args.n).await,
        Scenario::VmPause => vm::pause(&client, &args.vm_snapshot, args.n).await,
        Scenario::VmResume => vm::resume(&client, &args.vm_snapshot, args.n).await,
        Scenario::VmFork if args.children > 1 => {
            vm::fork_many(&client, &args.vm_snapshot, args.n, args.children).await
        }
        Scenario::VmFork => vm::fork(&client, &args.vm_snapshot, args.n).await,
        Scenario::Density if args.vm => {
            let storage = own.as_ref().map(own_server::OwnServer::storage_dir);
            density::vm_density(&client, args.n, storage.as_deref()).await
        }
        Scenario::Density => density::density(&client, args.n).await,
        Scenario::Screenshot => {
            let vm = args.on_vm.then_some(args.vm_snapshot.as_str());
            desktop::screenshot(&client, vm, args.n).await
        }
        Scenario::Input => {
            let vm = args.on_vm.then_some(args.vm_snapshot.as_str());
            desktop::input(&client, vm, args.n).await
        }
    };
    // VM figures mean little without the accelerator they were taken on.
    let accelerator = match args.scenario.uses_vms(&args) {
        true => client
            .api(reqwest::Method::GET, "/config", None)
            .await
            .ok()
            .and_then(|config| {
                config["coveVmAccelerator"]["name"]
                    .as_str()
                    .map(str::to_owned)
            }),
        false => None,
    };
    let server_peak_rss_mb = own.as_ref().and_then(own_server::OwnServer::peak_rss_mb);
    if let Some(own) = own {
        own.stop().await?;
    }
    let Measurement {
        mut samples,
        mut extra,
    } = measured?;
    let (median, p95, p99) = summarize(&mut samples);
    if let Some(rss) = server_peak_rss_mb {
        extra.insert("server_peak_rss_mb".into(), json!(rss));
    }
    if let Some(accelerator) = accelerator {
        extra.insert("accelerator".into(), json!(accelerator));
    }
    let name = clap::ValueEnum::to_possible_value(&args.scenario)
        .map(|v| v.get_name().to_owned())
        .unwrap_or_default();
    if args.json {
        let mut report = json!({ "scenario": name, "n": args.n, "median_ms": median, "p95_ms": p95,
                                  "p99_ms": p99, "min_ms": samples[0],
                                  "max_ms": samples[samples.len() - 1] });
        report.as_object_mut().expect("an object").extend(extra);
        println!("{report}");
    } else {
        let extra: Vec<String> = extra.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "{name}: n={} median={median:.2} ms p95={p95:.2} ms p99={p99:.2} ms {}",
            args.n,
            extra.join(" ")
        );
    }
    Ok(())
}

/// Creates on this (networked) server, then on one of its own without
/// networking; reports the networked samples and the difference of medians.
async fn network_cost(client: &Client, args: &BenchArgs) -> anyhow::Result<Measurement> {
    let gap = std::time::Duration::from_millis(args.gap_ms);
    let mut with = scenarios::create_to_first_command(client, args.n, gap).await?;
    let bare = own_server::OwnServer::start(&args.images_dir, &["--no-network", "--no-vm"]).await?;
    let without = scenarios::create_to_first_command(&bare.client(), args.n, gap).await;
    bare.stop().await?;
    let mut without = without?;
    let (with_median, ..) = summarize(&mut with.samples.clone());
    let (without_median, without_p95, _) = summarize(&mut without.samples);
    with.extra
        .insert("no_network_median_ms".into(), json!(without_median));
    with.extra
        .insert("no_network_p95_ms".into(), json!(without_p95));
    with.extra.insert(
        "network_added_median_ms".into(),
        json!(with_median - without_median),
    );
    Ok(with)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let mut samples: Vec<f64> = (1..=100).map(f64::from).collect();
        samples.reverse();
        assert_eq!(summarize(&mut samples), (50.0, 95.0, 99.0));
        assert_eq!(summarize(&mut [7.0]), (7.0, 7.0, 7.0));
    }
}
