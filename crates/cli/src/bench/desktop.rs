//! The computer-use scenarios: screenshots (a full 1280x800 PNG, and a JPEG
//! at quality 70 beside) and the input round trip (a mouse move answered),
//! on a sandbox whose desktop is started first (untimed).

use std::time::{Duration, Instant};

use anyhow::Context;
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::scenarios::delete_sandbox;
use super::{summarize, Measurement};
use crate::client::Client;

/// The desktop's size for the screenshot figures.
const RESOLUTION: &str = "1280x800";

/// Runs `work` on a new sandbox (a VM of `vm_snapshot` if given) with its
/// desktop started; the sandbox is deleted afterwards whatever happened.
async fn with_desktop<T>(
    client: &Client,
    vm_snapshot: Option<&str>,
    work: impl AsyncFnOnce(&Value) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let mut body = json!({
        "labels": { "cove-bench": "1" },
        "env": { "VNC_RESOLUTION": RESOLUTION },
    });
    if let Some(snapshot) = vm_snapshot {
        body["snapshot"] = json!(snapshot);
    }
    let sandbox = client.api(Method::POST, "/sandbox", Some(body)).await?;
    let result = async {
        client
            .toolbox(&sandbox, Method::POST, "/computeruse/start", Value::Null)
            .await
            .context("start the desktop")?;
        settle(client, &sandbox).await?;
        work(&sandbox).await
    }
    .await;
    delete_sandbox(client, &sandbox).await?;
    result
}

/// Waits until every desktop process runs, then a little more: the window
/// manager and panel draw for a while after they start, and those frames
/// are not what is measured.
async fn settle(client: &Client, sandbox: &Value) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let status = client
            .toolbox(sandbox, Method::GET, "/computeruse/status", Value::Null)
            .await?;
        if status["status"] == "active" {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the desktop did not start: {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    Ok(())
}

fn ms_since(started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1000.0
}

async fn timed(
    client: &Client,
    sandbox: &Value,
    method: Method,
    path: &str,
    body: &Value,
    n: usize,
) -> anyhow::Result<(Vec<f64>, Value)> {
    let mut last = Value::Null;
    // Unmeasured runs first: the X connection, the encoders' first use.
    for _ in 0..3 {
        last = client
            .toolbox(sandbox, method.clone(), path, body.clone())
            .await?;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        last = client
            .toolbox(sandbox, method.clone(), path, body.clone())
            .await?;
        samples.push(ms_since(started));
    }
    Ok((samples, last))
}

/// Full-screen PNG screenshots; the compressed (JPEG, quality 70) figures
/// and both sizes beside.
pub(super) async fn screenshot(
    client: &Client,
    vm_snapshot: Option<&str>,
    n: usize,
) -> anyhow::Result<Measurement> {
    with_desktop(client, vm_snapshot, async |sandbox| {
        let (samples, png) = timed(
            client,
            sandbox,
            Method::GET,
            "/computeruse/screenshot",
            &Value::Null,
            n,
        )
        .await?;
        let (mut jpeg_samples, jpeg) = timed(
            client,
            sandbox,
            Method::GET,
            "/computeruse/screenshot/compressed?format=jpeg&quality=70",
            &Value::Null,
            n,
        )
        .await?;
        let (median, p95, _) = summarize(&mut jpeg_samples);
        let mut extra = Map::new();
        extra.insert("resolution".into(), json!(RESOLUTION));
        extra.insert("png_bytes".into(), png["sizeBytes"].clone());
        extra.insert("jpeg70_median_ms".into(), json!(median));
        extra.insert("jpeg70_p95_ms".into(), json!(p95));
        extra.insert("jpeg70_bytes".into(), jpeg["sizeBytes"].clone());
        Ok(Measurement { samples, extra })
    })
    .await
}

/// A mouse move answered (the pointer where it was sent), alternating
/// between two points so each is a real move.
pub(super) async fn input(
    client: &Client,
    vm_snapshot: Option<&str>,
    n: usize,
) -> anyhow::Result<Measurement> {
    with_desktop(client, vm_snapshot, async |sandbox| {
        let mut samples = Vec::with_capacity(n);
        for i in 0..n + 3 {
            let x = if i % 2 == 0 { 100 } else { 200 };
            let started = Instant::now();
            let at = client
                .toolbox(
                    sandbox,
                    Method::POST,
                    "/computeruse/mouse/move",
                    json!({ "x": x, "y": 100 }),
                )
                .await?;
            let elapsed = ms_since(started);
            anyhow::ensure!(at["x"] == x, "the pointer is not where it was sent: {at}");
            if i >= 3 {
                samples.push(elapsed);
            }
        }
        Ok(Measurement {
            samples,
            extra: Map::new(),
        })
    })
    .await
}
