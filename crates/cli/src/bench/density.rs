//! `cove bench density --n N`: N idle containers at once. Reports the host
//! memory each holds (the drop of `MemAvailable` over N, so it counts what
//! the kernel spends on them too; meaningful when the server is on this
//! machine), the create rate, and exec round trips with N running beside
//! the p50 with 10; then deletes them all and checks none is left.

use std::time::Instant;

use anyhow::Context;
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::scenarios::{create_sandbox, delete_sandbox, run_command};
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

pub(super) async fn density(client: &Client, n: usize) -> anyhow::Result<Measurement> {
    let before_kib = mem_available_kib();
    let mut sandboxes: Vec<Value> = Vec::with_capacity(n);
    let result = async {
        let started = Instant::now();
        for i in 0..n {
            let sandbox = create_sandbox(client)
                .await
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
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        let after_kib = mem_available_kib();
        let at_n = execs(client, &sandboxes).await?;
        let mut extra = Map::new();
        extra.insert("sandboxes".into(), json!(n));
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
    Ok(measured)
}
