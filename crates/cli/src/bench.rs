//! `cove bench`: latency of a scenario over N runs.
//!
//! A benchmark measures; it asserts nothing. Without `--url` it starts its own
//! server in this process on a temporary data directory.

use std::time::Instant;

use anyhow::Context;
use reqwest::Method;
use serde_json::json;

use crate::client::Client;
use crate::serve::ServeArgs;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// Create a sandbox until its first command answers (the sandbox is deleted untimed).
    Create,
    /// Round trip of `true` in a running sandbox.
    Exec,
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
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
    /// Images directory of the server started here (shared, so it is built once).
    #[arg(long, env = "COVE_IMAGES_DIR", default_value = "/var/tmp/cove/images")]
    pub images_dir: std::path::PathBuf,
}

/// Median, p95 and p99 of `samples` in milliseconds (nearest-rank).
pub fn summarize(samples: &mut [f64]) -> (f64, f64, f64) {
    samples.sort_by(f64::total_cmp);
    let rank = |p: f64| {
        let index = ((p / 100.0) * samples.len() as f64).ceil() as usize;
        samples[index.clamp(1, samples.len()) - 1]
    };
    (rank(50.0), rank(95.0), rank(99.0))
}

async fn create(client: &Client) -> anyhow::Result<serde_json::Value> {
    client
        .api(
            Method::POST,
            "/sandbox",
            Some(json!({ "labels": { "cove-bench": "1" } })),
        )
        .await
}

async fn exec_true(client: &Client, sandbox: &serde_json::Value) -> anyhow::Result<()> {
    let result = client
        .toolbox(
            sandbox,
            Method::POST,
            "/process/execute",
            json!({ "command": "true" }),
        )
        .await?;
    anyhow::ensure!(
        result["exitCode"] == 0,
        "`true` failed in the sandbox: {result}"
    );
    Ok(())
}

async fn delete(client: &Client, sandbox: &serde_json::Value) -> anyhow::Result<()> {
    let id = sandbox["id"].as_str().context("sandbox without id")?;
    client
        .api(Method::DELETE, &format!("/sandbox/{id}"), None)
        .await?;
    Ok(())
}

async fn measure(scenario: Scenario, client: &Client, n: usize) -> anyhow::Result<Vec<f64>> {
    let mut samples = Vec::with_capacity(n);
    match scenario {
        Scenario::Create => {
            // One unmeasured run warms caches (page cache of the image, connections).
            let warm = create(client).await?;
            exec_true(client, &warm).await?;
            delete(client, &warm).await?;
            for _ in 0..n {
                let started = Instant::now();
                let sandbox = create(client).await?;
                exec_true(client, &sandbox).await?;
                samples.push(started.elapsed().as_secs_f64() * 1000.0);
                delete(client, &sandbox).await?;
            }
        }
        Scenario::Exec => {
            let sandbox = create(client).await?;
            for _ in 0..5 {
                exec_true(client, &sandbox).await?;
            }
            for _ in 0..n {
                let started = Instant::now();
                exec_true(client, &sandbox).await?;
                samples.push(started.elapsed().as_secs_f64() * 1000.0);
            }
            delete(client, &sandbox).await?;
        }
    }
    Ok(samples)
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.n > 0, "--n must be at least 1");
    let mut own_server = None;
    let client = match &args.url {
        Some(url) => Client::new(
            url,
            args.api_key
                .as_deref()
                .context("--url needs an API key (COVE_API_KEY)")?,
        ),
        None => {
            let dir = tempfile::Builder::new()
                .prefix("cove-bench")
                .tempdir_in("/var/tmp")?;
            let key = "cove-bench-key";
            let running = crate::serve::start(ServeArgs {
                listen: "127.0.0.1:0".parse()?,
                data_dir: dir.path().to_owned(),
                images_dir: Some(args.images_dir.clone()),
                agent_bin: None,
                api_key: Some(key.to_owned()),
                public_url: None,
                max_cpu: 4,
                max_memory: 8,
                max_disk: 20,
                timer_tick_ms: 1000,
                storage_size_gib: 16,
            })
            .await?;
            let client = Client::new(&format!("http://{}/api", running.addr), key);
            own_server = Some((dir, running));
            client
        }
    };
    let measured = measure(args.scenario, &client, args.n).await;
    if let Some((dir, running)) = own_server {
        running.serve.abort();
        running.storage.unmount()?;
        drop(dir);
    }
    let mut samples = measured?;
    let (median, p95, p99) = summarize(&mut samples);
    let name = format!("{:?}", args.scenario).to_lowercase();
    if args.json {
        println!(
            "{}",
            json!({ "scenario": name, "n": args.n, "median_ms": median, "p95_ms": p95, "p99_ms": p99,
                    "min_ms": samples[0], "max_ms": samples[samples.len() - 1] })
        );
    } else {
        println!(
            "{name}: n={} median={median:.2} ms p95={p95:.2} ms p99={p99:.2} ms",
            args.n
        );
    }
    Ok(())
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
