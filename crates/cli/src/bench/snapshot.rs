//! The `snapshot` scenario: live snapshots of a running container holding a
//! large written file, the stall its processes see, and create-from-snapshot
//! to first command.

use std::time::Instant;

use anyhow::Context;
use reqwest::Method;
use serde_json::{json, Map};

use super::scenarios::{delete_sandbox, run_command};
use super::Measurement;
use crate::client::Client;

/// A ticker inside the sandbox: wakes every millisecond and keeps the longest
/// gap it saw, which is how long its processes were stopped.
const TICKER: &str = "import time\nlast=time.monotonic();worst=0.0\nend=last+{secs}\n\
while time.monotonic()<end:\n    time.sleep(0.001)\n    now=time.monotonic();worst=max(worst,now-last);last=now\n\
open('/tmp/worst-gap','w').write(str(worst*1000))\n";

/// Writes `size_mb` in `sandbox`, then takes `n` live snapshots of it.
pub(super) async fn live(
    client: &Client,
    sandbox: &serde_json::Value,
    n: usize,
    size_mb: u64,
) -> anyhow::Result<Measurement> {
    let id = sandbox["id"]
        .as_str()
        .context("sandbox without id")?
        .to_owned();
    run_command(
        client,
        sandbox,
        &format!("dd if=/dev/zero of=$HOME/big bs=1M count={size_mb} status=none"),
    )
    .await?;
    // Long enough to span every snapshot below.
    let secs = 5 + n * 2;
    let script = TICKER.replace("{secs}", &secs.to_string());
    client
        .toolbox(
            sandbox,
            Method::POST,
            "/process/session",
            json!({ "sessionId": "ticker" }),
        )
        .await?;
    let command = format!("python3 -c \"{}\"", script.replace('"', "\\\""));
    client
        .toolbox(
            sandbox,
            Method::POST,
            "/process/session/ticker/exec",
            json!({ "command": command, "runAsync": true }),
        )
        .await?;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;

    let mut samples = Vec::with_capacity(n);
    let mut names = Vec::new();
    for i in 0..n {
        let name = format!("bench-{}-{i}", &id[..8]);
        let started = Instant::now();
        client
            .api(
                Method::POST,
                &format!("/sandbox/{id}/snapshot"),
                Some(json!({ "name": name })),
            )
            .await?;
        samples.push(started.elapsed().as_secs_f64() * 1000.0);
        names.push(name);
    }
    let mut from_snapshot = Vec::new();
    for name in &names {
        let started = Instant::now();
        let child = client
            .api(
                Method::POST,
                "/sandbox",
                Some(json!({ "snapshot": name, "labels": { "cove-bench": "1" } })),
            )
            .await?;
        run_command(client, &child, "true").await?;
        from_snapshot.push(started.elapsed().as_secs_f64() * 1000.0);
        delete_sandbox(client, &child).await?;
    }
    // Wait for the ticker to finish and report.
    let mut worst_gap = None;
    for _ in 0..(secs * 10 + 50) {
        if let Ok(out) = run_command(client, sandbox, "cat /tmp/worst-gap").await {
            worst_gap = out.trim().parse::<f64>().ok();
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    for name in &names {
        client
            .api(Method::DELETE, &format!("/snapshots/{name}"), None)
            .await?;
    }
    let mut extra = Map::new();
    extra.insert("written_mb".into(), json!(size_mb));
    extra.insert("longest_stall_seen_inside_ms".into(), json!(worst_gap));
    extra.insert(
        "create_from_snapshot_median_ms".into(),
        json!(super::summarize(&mut from_snapshot).0),
    );
    Ok(Measurement { samples, extra })
}
