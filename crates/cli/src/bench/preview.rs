//! The `preview` scenario: a large file downloaded through a sandbox's preview
//! URL (cove's listener, the agent's tunnel, a server in the sandbox), and the
//! round trip of a small request the same way.
//!
//! The server in the sandbox sends the large file as one block of
//! [`BLOCK_MB`] MiB, cached in memory, repeated with `sendfile`, so what is
//! measured is the preview path, not a disk or a slow server. (A sparse file
//! of the full size was not enough: reading its holes filled the page cache
//! with zeroed pages, and in a 1 GiB sandbox reclaiming them took the server
//! more CPU than the proxy took.)

use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::StreamExt;
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::scenarios::run_command;
use super::Measurement;
use crate::client::Client;

const PORT: u16 = 8765;
const DIR: &str = "/tmp/cove-preview";
const FILE: &str = "big.bin";
/// Small-request round trips measured besides the downloads.
const SMALL_RUNS: usize = 50;

/// Size of the block the large file is made of.
const BLOCK_MB: u64 = 64;

/// `http.server`, from the image's python3 alone: `/big.bin` is `argv[3]`
/// bytes of `block.bin` repeated, sent with `sendfile`; other paths are files.
const SERVER: &str = r#"
import http.server, os, sys
class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_GET(self):
        if self.path != "/big.bin":
            return super().do_GET()
        size = int(sys.argv[3])
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        self.wfile.flush()
        with open("block.bin", "rb") as block:
            length = os.fstat(block.fileno()).st_size
            sent = 0
            while sent < size:
                sent += self.connection.sendfile(block, 0, min(length, size - sent))
os.chdir(sys.argv[2])
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"#;

fn mb_per_s(bytes: u64, ms: f64) -> f64 {
    (bytes as f64 / 1e6) / (ms / 1000.0)
}

/// Starts the file server in `sandbox` and returns the preview URL and token.
async fn serve_file(
    client: &Client,
    sandbox: &Value,
    size: u64,
) -> anyhow::Result<(String, String)> {
    // Hex survives any quoting; python3 writes the script back out.
    let script: String = SERVER.bytes().map(|b| format!("{b:02x}")).collect();
    run_command(
        client,
        sandbox,
        &format!(
            "sh -c 'mkdir -p {DIR} && head -c {BLOCK_MB}M /dev/urandom > {DIR}/block.bin && echo small > {DIR}/small \
             && python3 -c \"import sys, pathlib; pathlib.Path(sys.argv[1]).write_bytes(bytes.fromhex(sys.argv[2]))\" {DIR}/server.py {script}'"
        ),
    )
    .await?;
    client
        .toolbox(
            sandbox,
            Method::POST,
            "/process/session",
            json!({ "sessionId": "preview-bench" }),
        )
        .await?;
    client
        .toolbox(
            sandbox,
            Method::POST,
            "/process/session/preview-bench/exec",
            json!({ "command": format!("python3 {DIR}/server.py {PORT} {DIR} {size}"), "runAsync": true }),
        )
        .await?;
    let id = sandbox["id"].as_str().context("sandbox has no id")?;
    let preview = client
        .api(
            Method::GET,
            &format!("/sandbox/{id}/ports/{PORT}/preview-url"),
            None,
        )
        .await?;
    let url = preview["url"]
        .as_str()
        .context("no preview url")?
        .to_owned();
    let token = preview["token"]
        .as_str()
        .context("no preview token")?
        .to_owned();
    Ok((url, token))
}

/// Downloads `size` bytes `n` times through the preview URL of `sandbox`.
pub(super) async fn download(
    client: &Client,
    sandbox: &Value,
    n: usize,
    size: u64,
) -> anyhow::Result<Measurement> {
    let (url, token) = serve_file(client, sandbox, size).await?;
    let http = reqwest::Client::builder()
        .build()
        .context("building the HTTP client")?;
    let get = |path: &str| {
        http.get(format!("{url}/{path}"))
            .header("X-Daytona-Preview-Token", &token)
            .send()
    };
    // The server needs a moment to listen: until then the preview answers 502.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match get("small").await {
            Ok(r) if r.status().is_success() => break,
            Ok(r) if Instant::now() >= deadline => {
                anyhow::bail!(
                    "the preview never answered: {} {}",
                    r.status(),
                    r.text().await?
                )
            }
            Err(e) if Instant::now() >= deadline => return Err(e).context("preview request"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }

    let mut small = Vec::new();
    for _ in 0..SMALL_RUNS {
        let started = Instant::now();
        let response = get("small").await?;
        anyhow::ensure!(
            response.status().is_success(),
            "small: {}",
            response.status()
        );
        response.bytes().await?;
        small.push(started.elapsed().as_secs_f64() * 1000.0);
    }

    let mut samples = Vec::new();
    for _ in 0..n {
        let started = Instant::now();
        let response = get(FILE).await?;
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
        anyhow::ensure!(
            received == size,
            "download returned {received} bytes of {size}"
        );
        samples.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    let (median, ..) = super::summarize(&mut samples.clone());
    let best = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let (small_median, small_p95, _) = super::summarize(&mut small);
    let mut extra = Map::new();
    extra.insert("size_mb".into(), json!(size >> 20));
    extra.insert("download_mb_s".into(), json!(mb_per_s(size, median)));
    extra.insert("best_download_mb_s".into(), json!(mb_per_s(size, best)));
    extra.insert("small_request_median_ms".into(), json!(small_median));
    extra.insert("small_request_p95_ms".into(), json!(small_p95));
    Ok(Measurement { samples, extra })
}
