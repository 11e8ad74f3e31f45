//! `cove bench density --n N`: N idle containers at once. Reports the host
//! memory each holds (the drop of `MemAvailable` over N, so it counts what
//! the kernel spends on them too; meaningful when the server is on this
//! machine), the create rate, and exec round trips with N running beside
//! the p50 with 10; then deletes them all and checks none is left.
//!
//! With `--vm`, N idle VMs of 256 MiB (`daytona-vm-tiny`): host memory is
//! then also the PSS of their QEMU processes (`/proc/PID/smaps_rollup`,
//! found through `vms/{id}/qemu.pid` of a server started here), which
//! shares the pages they map from the same template RAM file fairly among
//! them; after the deletes none of those processes may be left.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::scenarios::{create_sandbox, delete_sandbox, run_command};
use super::vm::create_vm;
use super::Measurement;
use crate::client::Client;

/// Exec round trips measured at each density.
const EXECS: usize = 30;
/// Deletes in flight at once when cleaning up.
const DELETES_AT_ONCE: usize = 16;

fn mem_available_kib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `EXECS` round trips of `true`, spread over `sandboxes`, in milliseconds.
async fn execs(client: &Client, sandboxes: &[Value]) -> anyhow::Result<Vec<f64>> {
    let mut samples = Vec::with_capacity(EXECS);
    for i in 0..EXECS {
        let sandbox = &sandboxes[(i * 7919) % sandboxes.len()];
        let started = Instant::now();
        run_command(client, sandbox, "true").await?;
        samples.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(samples)
}

fn p50(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    super::summarize(&mut sorted).0
}

async fn delete_all(client: &Client, sandboxes: &[Value]) -> anyhow::Result<()> {
    for batch in sandboxes.chunks(DELETES_AT_ONCE) {
        let deletes = batch.iter().map(|s| delete_sandbox(client, s));
        for result in futures_util::future::join_all(deletes).await {
            result?;
        }
    }
    Ok(())
}

/// The VMs of `--vm`: 256 MiB.
const VM_DENSITY_SNAPSHOT: &str = "daytona-vm-tiny";

pub(super) async fn density(client: &Client, n: usize) -> anyhow::Result<Measurement> {
    run_density(client, n, None).await
}

/// The density of VMs; `storage` is the server's storage directory when it
/// runs here (for the QEMU processes' PSS).
pub(super) async fn vm_density(
    client: &Client,
    n: usize,
    storage: Option<&Path>,
) -> anyhow::Result<Measurement> {
    run_density(client, n, Some(storage)).await
}

/// The pid of sandbox `id`'s QEMU process, from the server's storage.
fn qemu_pid(storage: &Path, id: &str) -> Option<u32> {
    let pid = std::fs::read_to_string(storage.join("vms").join(id).join("qemu.pid")).ok()?;
    pid.trim().parse().ok()
}

/// A process's proportional set size, in KiB.
fn pss_kib(pid: u32) -> Option<u64> {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let line = rollup.lines().find(|l| l.starts_with("Pss:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `vms`: `None` for containers, else VMs with the server's storage if known.
async fn run_density(
    client: &Client,
    n: usize,
    vms: Option<Option<&Path>>,
) -> anyhow::Result<Measurement> {
    let before_kib = mem_available_kib();
    let mut sandboxes: Vec<Value> = Vec::with_capacity(n);
    let mut qemu_pids: Vec<u32> = Vec::new();
    let result = async {
        let started = Instant::now();
        for i in 0..n {
            let sandbox = match vms {
                None => create_sandbox(client).await,
                Some(_) => create_vm(client, VM_DENSITY_SNAPSHOT).await,
            }
            .with_context(|| format!("create sandbox {} of {n}", i + 1))?;
            sandboxes.push(sandbox);
            if i + 1 == 10.min(n) {
                // Warm the path, then the baseline at 10 (or n, if fewer).
                execs(client, &sandboxes).await?;
            }
        }
        let create_seconds = started.elapsed().as_secs_f64();
        let at_ten = execs(client, &sandboxes[..10.min(n)]).await?;
        // Let the sandboxes settle into idleness before memory is read.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after_kib = mem_available_kib();
        let mut extra = Map::new();
        if let Some(Some(storage)) = vms {
            qemu_pids = sandboxes
                .iter()
                .filter_map(|s| qemu_pid(storage, s["id"].as_str()?))
                .collect();
            anyhow::ensure!(
                qemu_pids.len() == n,
                "found the QEMU process of {} of {n} VMs",
                qemu_pids.len()
            );
            let pss: Vec<u64> = qemu_pids.iter().filter_map(|pid| pss_kib(*pid)).collect();
            let total = pss.iter().sum::<u64>() as f64 / 1024.0;
            extra.insert("qemu_pss_mib_per_vm".into(), json!(total / n as f64));
            extra.insert(
                "qemu_pss_mib_max".into(),
                json!(pss.iter().max().copied().unwrap_or(0) as f64 / 1024.0),
            );
        }
        let at_n = execs(client, &sandboxes).await?;
        extra.insert("sandboxes".into(), json!(n));
        if vms.is_some() {
            extra.insert("snapshot".into(), json!(VM_DENSITY_SNAPSHOT));
        }
        extra.insert("creates_per_s".into(), json!(n as f64 / create_seconds));
        extra.insert("exec_p50_at_10_ms".into(), json!(p50(&at_ten)));
        extra.insert("exec_p50_at_n_ms".into(), json!(p50(&at_n)));
        if let (Some(before), Some(after)) = (before_kib, after_kib) {
            let per = before.saturating_sub(after) as f64 / 1024.0 / n as f64;
            extra.insert("host_mib_per_sandbox".into(), json!(per));
        }
        anyhow::Ok(Measurement {
            samples: at_n,
            extra,
        })
    }
    .await;
    let cleaned = delete_all(client, &sandboxes).await;
    let measured = result?;
    cleaned?;
    let left = client
        .api(
            Method::GET,
            "/sandbox?labels=%7B%22cove-bench%22%3A%221%22%7D",
            None,
        )
        .await?;
    let left = left
        .as_array()
        .or_else(|| left["items"].as_array())
        .map_or(0, Vec::len);
    anyhow::ensure!(
        left == 0,
        "{left} benchmark sandboxes are left after the deletes"
    );
    // A deleted VM's QEMU process is gone (a zombie for an instant at most).
    let began = Instant::now();
    let alive = |pid: &&u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            !stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
    };
    while qemu_pids.iter().any(|pid| alive(&pid)) && began.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let lingering: Vec<&u32> = qemu_pids.iter().filter(alive).collect();
    anyhow::ensure!(
        lingering.is_empty(),
        "QEMU processes {lingering:?} outlived their deleted VMs"
    );
    Ok(measured)
}
