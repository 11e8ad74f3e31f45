//! `cove runner`: this machine as a runner of a control plane on another.
//!
//! The operator registers the runner on the control plane
//! (`POST /api/runners`, `cove admin add-runner`), which answers its token
//! once. With that token, `cove runner` checks in at start
//! (`GET /api/runners/me`) and then reports its host every few seconds
//! (`POST /api/runners/healthcheck`, Daytona's shape): its size, its load,
//! and the classes of sandbox it could run. The control plane lists it with
//! its load, shows it unresponsive when the reports stop, and can delete it,
//! which ends the process at its next report. The control plane does not
//! place sandboxes on it yet; the runner opens no listener and starts
//! nothing.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use cove_engine::RunnerUsage;
use serde_json::{json, Value};

#[derive(clap::Args, Debug)]
pub(crate) struct RunnerArgs {
    /// The control plane's API URL, as clients use it
    /// (`http://HOST:PORT/api`).
    #[arg(long, env = "COVE_CONTROL_URL")]
    control: String,
    /// This runner's token, as `POST /api/runners` answered it. Prefer the
    /// environment variable: the process's arguments are visible to every
    /// user of the machine.
    #[arg(long, env = "COVE_RUNNER_TOKEN", hide_env_values = true)]
    token: String,
    /// Where this runner keeps its sandboxes (made mode 0700); the disk it
    /// reports is this directory's filesystem.
    #[arg(long)]
    data_dir: PathBuf,
    /// The guest kernel and initramfs of VM sandboxes; without them (or
    /// with `--no-vm`) the runner offers containers only.
    #[arg(long, env = "COVE_VM_ASSETS", default_value = "/var/tmp/cove/vm")]
    vm_assets: PathBuf,
    #[arg(long)]
    no_vm: bool,
}

pub(crate) async fn run(args: RunnerArgs) -> anyhow::Result<()> {
    make_private_dir(&args.data_dir)?;
    let control = args.control.trim_end_matches('/').to_owned();
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(std::time::Duration::from_secs(10))
        .build()
        .context("building the HTTP client")?;
    let me = call(http.get(format!("{control}/runners/me")), &args.token)
        .await
        .with_context(|| format!("checking in with the control plane at {control}"))?;
    tracing::info!(
        runner = me["id"].as_str().unwrap_or_default(),
        name = me["name"].as_str().unwrap_or_default(),
        %control,
        "runner checked in"
    );
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut tick = tokio::time::interval(cove_engine::CHECK_IN_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = terminate.recv() => return Ok(()),
        }
        let report = report(&args.data_dir, (!args.no_vm).then_some(&*args.vm_assets));
        let sent = call(
            http.post(format!("{control}/runners/healthcheck"))
                .json(&report),
            &args.token,
        )
        .await;
        match sent {
            Ok(_) => {}
            Err(Refused::Unknown(message)) => {
                bail!("the control plane no longer knows this runner (deleted?): {message}")
            }
            Err(error) => tracing::warn!(%error, "runner report not taken; trying again"),
        }
    }
}

/// Why a call to the control plane failed, said as its answer said it.
#[derive(Debug)]
enum Refused {
    /// A 401: the token is no runner's (never was, or its runner was deleted).
    Unknown(String),
    Other(String),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Unknown(message) | Refused::Other(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for Refused {}

/// Sends `request` with the runner's token; its JSON answer, if any.
async fn call(request: reqwest::RequestBuilder, token: &str) -> Result<Value, Refused> {
    let response = request
        .bearer_auth(token)
        .send()
        .await
        .map_err(|error| Refused::Other(format!("{error:#}")))?;
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    if status.is_success() {
        return Ok(value);
    }
    let message = value["message"]
        .as_str()
        .map_or_else(|| text.clone(), str::to_owned);
    let message = format!("{status}: {message}");
    if status == reqwest::StatusCode::UNAUTHORIZED {
        Err(Refused::Unknown(message))
    } else {
        Err(Refused::Other(message))
    }
}

/// Daytona's `RunnerHealthcheck` for this host now, with cove's
/// `sandboxClasses` and `accelerator`.
fn report(data_dir: &Path, vm_assets: Option<&Path>) -> Value {
    let host = cove_engine::measure_host(data_dir);
    let RunnerUsage { cpu, memory, disk } = host.usage;
    let vm = vm_assets.map(cove_runtime::vm::probe);
    let mut classes = vec!["container"];
    let accelerator = match vm {
        Some(Ok(accelerator)) => {
            classes.push("linux-vm");
            Some(accelerator.name())
        }
        Some(Err(missing)) => {
            tracing::debug!(%missing, "no VM sandboxes on this runner");
            None
        }
        None => None,
    };
    json!({
        "appVersion": env!("CARGO_PKG_VERSION"),
        "metrics": {
            "cpu": host.cpu,
            "memoryGiB": host.memory_gib,
            "diskGiB": host.disk_gib,
            "currentCpuLoadAverage": cpu / 100.0 * host.cpu as f64,
            "currentCpuUsagePercentage": cpu,
            "currentMemoryUsagePercentage": memory,
            "currentDiskUsagePercentage": disk,
            // Nothing runs here yet.
            "currentAllocatedCpu": 0,
            "currentAllocatedMemoryGiB": 0,
            "currentAllocatedDiskGiB": 0,
            "currentSnapshotCount": 0,
            "currentStartedSandboxes": 0,
        },
        "serviceHealth": [{"serviceName": "runner", "healthy": true}],
        "sandboxClasses": classes,
        "accelerator": accelerator,
    })
}

/// Makes `dir` (and its parents) and leaves it to its owner alone (0700).
fn make_private_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("making {} private", dir.display()))
}
