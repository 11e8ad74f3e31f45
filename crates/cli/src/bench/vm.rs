//! The VM scenarios: create from the template, pause, resume, fork (one
//! child, or many at once with `--children`). Each runs
//! on VMs of `--vm-snapshot` (`daytona-vm-small` by default; a larger one
//! shows whether a figure grows with memory size).

use std::time::{Duration, Instant};

use anyhow::Context;
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::scenarios::{delete_sandbox, run_command};
use super::{summarize, Measurement};
use crate::client::Client;

/// A process that wakes every 5 ms and keeps the longest gap it saw: how
/// long the VM's processes were stopped (a fork's freeze of its parent).
const TICKER: &str = "import time\nlast=time.monotonic();worst=0.0\nend=last+{secs}\n\
while time.monotonic()<end:\n    time.sleep(0.005)\n    now=time.monotonic();worst=max(worst,now-last);last=now\n\
open('/tmp/worst-gap','w').write(str(worst*1000))\n";

/// How long a VM operation may take before the bench gives up on it.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(300);

fn ms_since(started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1000.0
}

fn id_of(sandbox: &Value) -> anyhow::Result<String> {
    Ok(sandbox["id"]
        .as_str()
        .context("sandbox without id")?
        .to_owned())
}

pub(super) async fn create_vm(client: &Client, snapshot: &str) -> anyhow::Result<Value> {
    let sandbox = client
        .api(
            Method::POST,
            "/sandbox",
            Some(json!({ "snapshot": snapshot, "labels": { "cove-bench": "1" } })),
        )
        .await?;
    anyhow::ensure!(
        sandbox["sandboxClass"] == "linux-vm",
        "{snapshot} did not make a VM sandbox: {sandbox}"
    );
    Ok(sandbox)
}

/// Runs `work` on a new VM, deleted afterwards whatever happened.
async fn with_vm<T>(
    client: &Client,
    snapshot: &str,
    work: impl AsyncFnOnce(&Value) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let sandbox = create_vm(client, snapshot).await?;
    let result = work(&sandbox).await;
    delete_sandbox(client, &sandbox).await?;
    result
}

/// How long the create scenario waits between creates: a server may keep
/// VMs of the small size waiting (`serve --vm-warm-pool`), and making the
/// next one takes a second or so under TCG. Creates that come faster than
/// that find none waiting and each continue from the template in a QEMU
/// process of their own, as every create does without a pool.
const CREATE_SPACING: Duration = Duration::from_secs(3);

/// Create -> first command answered, each in a new VM (from the template),
/// one every [`CREATE_SPACING`].
pub(super) async fn create(
    client: &Client,
    snapshot: &str,
    n: usize,
) -> anyhow::Result<Measurement> {
    // The first create may wait for the template to be made; not measured.
    let warm = create_vm(client, snapshot).await?;
    run_command(client, &warm, "true").await?;
    delete_sandbox(client, &warm).await?;
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        tokio::time::sleep(CREATE_SPACING).await;
        let started = Instant::now();
        let sandbox = create_vm(client, snapshot).await?;
        run_command(client, &sandbox, "true").await?;
        samples.push(ms_since(started));
        delete_sandbox(client, &sandbox).await?;
    }
    let mut extra = Map::new();
    extra.insert(
        "spacing_ms".into(),
        json!(CREATE_SPACING.as_millis() as u64),
    );
    Ok(Measurement { samples, extra })
}

/// Pause (request until `paused`) and resume (request until a command
/// answers) of one VM, `n` times each; returns (pause, resume) samples and
/// what the paused VM's QEMU process held of the host's memory, if it kept
/// one (a warm pause) that this host can see.
pub(super) async fn pause_and_resume(
    client: &Client,
    snapshot: &str,
    n: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>, Option<HeldMemory>)> {
    with_vm(client, snapshot, async |sandbox| {
        let id = id_of(sandbox)?;
        // Something running, as in a real sandbox.
        start_session_command(client, sandbox, "busy", "while true; do sleep 0.1; done").await?;
        let mut pauses = Vec::with_capacity(n);
        let mut resumes = Vec::with_capacity(n);
        let mut held = None;
        for _ in 0..n {
            let started = Instant::now();
            let paused = client
                .api(Method::POST, &format!("/sandbox/{id}/pause"), None)
                .await?;
            pauses.push(ms_since(started));
            anyhow::ensure!(paused["state"] == "paused", "pause answered {paused}");
            held = qemu_of(&id).and_then(HeldMemory::of);
            let started = Instant::now();
            client
                .api(Method::POST, &format!("/sandbox/{id}/start"), None)
                .await?;
            run_command(client, sandbox, "true").await?;
            resumes.push(ms_since(started));
        }
        Ok((pauses, resumes, held))
    })
    .await
}

/// Host memory a process holds, from `/proc/PID/smaps_rollup`.
#[derive(Clone, Copy, Debug)]
pub(super) struct HeldMemory {
    rss_mib: f64,
    pss_mib: f64,
}

impl HeldMemory {
    fn of(pid: u32) -> Option<HeldMemory> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
        let field = |name: &str| -> Option<f64> {
            let kib: f64 = text
                .lines()
                .find_map(|line| line.strip_prefix(name))?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(kib / 1024.0)
        };
        Some(HeldMemory {
            rss_mib: field("Rss:")?,
            pss_mib: field("Pss:")?,
        })
    }

    fn insert_into(self, extra: &mut Map<String, serde_json::Value>) {
        extra.insert("paused_qemu_rss_mib".into(), json!(self.rss_mib));
        extra.insert("paused_qemu_pss_mib".into(), json!(self.pss_mib));
    }
}

/// The QEMU process of sandbox `id` on this host, if one runs: found by
/// the directory its `-name cove:{dir}/qmp.sock` names (a warm VM's old
/// name is a symbolic link to the sandbox's directory).
fn qemu_of(id: &str) -> Option<u32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let Some(name) = args
            .iter()
            .position(|arg| *arg == b"-name")
            .and_then(|at| args.get(at + 1))
        else {
            continue;
        };
        let name = String::from_utf8_lossy(name).replace(",,", ",");
        let Some(qmp) = name.strip_prefix("cove:") else {
            continue;
        };
        let dir = std::path::Path::new(qmp).parent()?;
        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
        if dir.file_name().is_some_and(|name| name == id) {
            return Some(pid);
        }
    }
    None
}

/// Fork request -> the child answers a command, `n` times from one parent
/// whose processes record the longest stop they saw.
pub(super) async fn fork(client: &Client, snapshot: &str, n: usize) -> anyhow::Result<Measurement> {
    with_vm(client, snapshot, async |parent| {
        let id = id_of(parent)?;
        let secs = 10 + n * 5;
        let script = TICKER.replace("{secs}", &secs.to_string());
        let command = format!("python3 -c \"{}\"", script.replace('"', "\\\""));
        start_session_command(client, parent, "ticker", &command).await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut samples = Vec::with_capacity(n);
        for i in 0..n {
            let started = Instant::now();
            let child = client
                .api(
                    Method::POST,
                    &format!("/sandbox/{id}/fork"),
                    Some(json!({ "name": format!("bench-fork-{}-{i}", &id[..8]) })),
                )
                .await?;
            let answered = run_command(client, &child, "true").await;
            samples.push(ms_since(started));
            delete_sandbox(client, &child).await?;
            answered?;
        }
        let worst_gap = longest_stall(client, parent).await?;
        let mut extra = Map::new();
        extra.insert("parent_longest_stall_ms".into(), json!(worst_gap));
        Ok(Measurement { samples, extra })
    })
    .await
}

/// Fork into `children` at once -> every child answers a command, `n`
/// times from one parent whose processes record the longest stop they
/// saw. Each sample is the time until the last child answered; the time
/// each child took is reported beside (median and p95 over all of them).
pub(super) async fn fork_many(
    client: &Client,
    snapshot: &str,
    n: usize,
    children: usize,
) -> anyhow::Result<Measurement> {
    with_vm(client, snapshot, async |parent| {
        let id = id_of(parent)?;
        let secs = 20 + n * children * 3;
        let script = TICKER.replace("{secs}", &secs.to_string());
        let command = format!("python3 -c \"{}\"", script.replace('"', "\\\""));
        start_session_command(client, parent, "ticker", &command).await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut samples = Vec::with_capacity(n);
        let mut per_child = Vec::with_capacity(n * children);
        let mut answered_at_fork = Vec::with_capacity(n);
        for _ in 0..n {
            let started = Instant::now();
            let made = client
                .api(
                    Method::POST,
                    &format!("/sandbox/{id}/forks"),
                    Some(json!({ "count": children })),
                )
                .await?;
            answered_at_fork.push(ms_since(started));
            let made = made
                .as_array()
                .context("a fork into many answers a list")?
                .clone();
            anyhow::ensure!(
                made.len() == children,
                "asked {children}, made {}",
                made.len()
            );
            let answers = made.iter().map(|child| async move {
                run_command(client, child, "true").await?;
                anyhow::Ok(ms_since(started))
            });
            let answered = futures_util::future::join_all(answers).await;
            samples.push(ms_since(started));
            let deletes = made.iter().map(|child| delete_sandbox(client, child));
            for deleted in futures_util::future::join_all(deletes).await {
                deleted?;
            }
            for child in answered {
                per_child.push(child?);
            }
        }
        let worst_gap = longest_stall(client, parent).await?;
        let (child_median, child_p95, _) = summarize(&mut per_child);
        let (fork_median, fork_p95, _) = summarize(&mut answered_at_fork);
        let mut extra = Map::new();
        extra.insert("children".into(), json!(children));
        extra.insert("parent_longest_stall_ms".into(), json!(worst_gap));
        extra.insert("child_answers_median_ms".into(), json!(child_median));
        extra.insert("child_answers_p95_ms".into(), json!(child_p95));
        extra.insert("fork_request_median_ms".into(), json!(fork_median));
        extra.insert("fork_request_p95_ms".into(), json!(fork_p95));
        Ok(Measurement { samples, extra })
    })
    .await
}

/// The longest stop the ticker in `parent` saw, once it has written it (a
/// read between its open and its write finds the file empty: read again).
async fn longest_stall(client: &Client, parent: &Value) -> anyhow::Result<f64> {
    let began = Instant::now();
    loop {
        if let Ok(out) = run_command(client, parent, "cat /tmp/worst-gap").await {
            if let Ok(gap) = out.trim().parse::<f64>() {
                return Ok(gap);
            }
        }
        anyhow::ensure!(
            began.elapsed() < OPERATION_TIMEOUT,
            "the ticker in the parent never reported"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn start_session_command(
    client: &Client,
    sandbox: &Value,
    session: &str,
    command: &str,
) -> anyhow::Result<()> {
    client
        .toolbox(
            sandbox,
            Method::POST,
            "/process/session",
            json!({ "sessionId": session }),
        )
        .await?;
    client
        .toolbox(
            sandbox,
            Method::POST,
            &format!("/process/session/{session}/exec"),
            json!({ "command": command, "runAsync": true }),
        )
        .await?;
    Ok(())
}

/// The pause scenario's figures, with resume's beside them.
pub(super) async fn pause(
    client: &Client,
    snapshot: &str,
    n: usize,
) -> anyhow::Result<Measurement> {
    let (samples, mut resumes, held) = pause_and_resume(client, snapshot, n).await?;
    let (median, p95, _) = summarize(&mut resumes);
    let mut extra = Map::new();
    extra.insert("resume_to_command_median_ms".into(), json!(median));
    extra.insert("resume_to_command_p95_ms".into(), json!(p95));
    if let Some(held) = held {
        held.insert_into(&mut extra);
    }
    Ok(Measurement { samples, extra })
}

/// The resume scenario's figures, with pause's beside them.
pub(super) async fn resume(
    client: &Client,
    snapshot: &str,
    n: usize,
) -> anyhow::Result<Measurement> {
    let (mut pauses, samples, held) = pause_and_resume(client, snapshot, n).await?;
    let (median, p95, _) = summarize(&mut pauses);
    let mut extra = Map::new();
    extra.insert("pause_median_ms".into(), json!(median));
    extra.insert("pause_p95_ms".into(), json!(p95));
    if let Some(held) = held {
        held.insert_into(&mut extra);
    }
    Ok(Measurement { samples, extra })
}
