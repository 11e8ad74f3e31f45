//! The `files` scenario: a large file uploaded and downloaded through the API
//! and the toolbox proxy, as the SDK does it (multipart bulk upload and bulk
//! download), streamed on the client side too so the client's memory stays flat.

use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::{json, Map};

use super::scenarios::run_command;
use super::Measurement;
use crate::client::Client;

const CHUNK: usize = 1 << 20;
// In /tmp: every user may write there (containers run as `daytona`, VMs as root).
const PATH: &str = "/tmp/cove-bench.bin";

fn mb_per_s(bytes: u64, ms: f64) -> f64 {
    (bytes as f64 / 1e6) / (ms / 1000.0)
}

/// Peak RSS of the agent processes in the sandbox, in MiB, read from inside.
async fn agent_peak_rss_mb(client: &Client, sandbox: &serde_json::Value) -> anyhow::Result<f64> {
    let out = run_command(
        client,
        sandbox,
        "awk '/^Name:/{n=$2} /^VmHWM:/{if (n==\"cove-agent\" && $2>m) m=$2} END{print m}' /proc/[0-9]*/status",
    )
    .await?;
    let kib: f64 = out
        .trim()
        .parse()
        .with_context(|| format!("agent VmHWM {out:?}"))?;
    Ok(kib / 1024.0)
}

/// Uploads and downloads `size` bytes `n` times in `sandbox`.
pub(super) async fn transfer(
    client: &Client,
    sandbox: &serde_json::Value,
    n: usize,
    size: u64,
) -> anyhow::Result<Measurement> {
    let base = sandbox["toolboxProxyUrl"]
        .as_str()
        .context("no toolboxProxyUrl")?;
    let id = sandbox["id"].as_str().context("no id")?;
    let pattern: Bytes = (0..CHUNK)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut samples = Vec::new();
    let (mut up_ms, mut down_ms) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let chunks = size.div_ceil(CHUNK as u64);
        let pattern = pattern.clone();
        let stream = futures_util::stream::iter(0..chunks).map(move |i| {
            let len = (size - i * CHUNK as u64).min(CHUNK as u64) as usize;
            Ok::<_, std::io::Error>(pattern.slice(..len))
        });
        let part =
            reqwest::multipart::Part::stream_with_length(reqwest::Body::wrap_stream(stream), size)
                .file_name(PATH)
                .mime_str("application/octet-stream")?;
        let form = reqwest::multipart::Form::new()
            .text("files[0].path", PATH)
            .part("files[0].file", part);
        let started = Instant::now();
        let response = client
            .raw(
                reqwest::Method::POST,
                &format!("{base}/{id}/files/bulk-upload"),
            )
            .multipart(form)
            .send()
            .await?;
        anyhow::ensure!(
            response.status().is_success(),
            "upload: {}",
            response.text().await?
        );
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        up_ms.push(ms);
        samples.push(ms);

        let started = Instant::now();
        let response = client
            .raw(
                reqwest::Method::POST,
                &format!("{base}/{id}/files/bulk-download"),
            )
            .header("accept", "multipart/form-data")
            .json(&json!({ "paths": [PATH] }))
            .send()
            .await?;
        anyhow::ensure!(
            response.status().is_success(),
            "download: {}",
            response.status()
        );
        let mut received = 0u64;
        let mut body = response.bytes_stream();
        while let Some(chunk) = body.next().await {
            received += chunk?.len() as u64;
        }
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        // The multipart framing adds a few hundred bytes around the file.
        anyhow::ensure!(
            received >= size,
            "download returned {received} bytes of {size}"
        );
        down_ms.push(ms);
        samples.push(ms);

        // Untimed: each run uploads into the same free space. Without this
        // the next upload replaces a 1 GiB file in a 3 GiB quota, and btrfs
        // flushes and commits on every reservation until the old file's
        // space is given back at a commit.
        run_command(client, sandbox, &format!("sh -c 'rm -f {PATH} && sync'")).await?;
    }
    let agent_rss = agent_peak_rss_mb(client, sandbox).await?;
    // Each run in order: a slow first (cold cache) or late run (a filling
    // disk quota) shows here, where the medians would hide it.
    let rounded = |v: &[f64]| v.iter().map(|ms| ms.round()).collect::<Vec<_>>();
    let mut extra = Map::new();
    extra.insert("upload_runs_ms".into(), json!(rounded(&up_ms)));
    extra.insert("download_runs_ms".into(), json!(rounded(&down_ms)));
    let median = |v: &mut Vec<f64>| super::summarize(v).0;
    extra.insert("size_mb".into(), json!(size >> 20));
    extra.insert(
        "upload_mb_s".into(),
        json!(mb_per_s(size, median(&mut up_ms))),
    );
    extra.insert(
        "download_mb_s".into(),
        json!(mb_per_s(size, median(&mut down_ms))),
    );
    extra.insert("agent_peak_rss_mb".into(), json!(agent_rss));
    Ok(Measurement { samples, extra })
}
