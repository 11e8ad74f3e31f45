//! The lifecycle scenarios: create to first command, and exec round trips.

use std::time::Instant;

use anyhow::Context;
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::{summarize, Measurement};
use crate::client::Client;

pub(super) async fn create_sandbox(client: &Client) -> anyhow::Result<Value> {
    client
        .api(
            Method::POST,
            "/sandbox",
            Some(json!({ "labels": { "cove-bench": "1" } })),
        )
        .await
}

pub(super) async fn run_command(
    client: &Client,
    sandbox: &Value,
    command: &str,
) -> anyhow::Result<String> {
    let result = client
        .toolbox(
            sandbox,
            Method::POST,
            "/process/execute",
            json!({ "command": command }),
        )
        .await?;
    anyhow::ensure!(
        result["exitCode"] == 0,
        "`{command}` failed in the sandbox: {result}"
    );
    Ok(result["result"].as_str().unwrap_or_default().to_owned())
}

pub(super) async fn delete_sandbox(client: &Client, sandbox: &Value) -> anyhow::Result<()> {
    let id = sandbox["id"].as_str().context("sandbox without id")?;
    client
        .api(Method::DELETE, &format!("/sandbox/{id}"), None)
        .await?;
    Ok(())
}

/// Runs `work` in a new sandbox, deleted afterwards whatever happened.
pub(super) async fn with_sandbox<T>(
    client: &Client,
    work: impl AsyncFnOnce(&Value) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let sandbox = create_sandbox(client).await?;
    let result = work(&sandbox).await;
    delete_sandbox(client, &sandbox).await?;
    result
}

fn ms_since(started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1000.0
}

/// Create -> first command answered, each in a new sandbox.
pub(super) async fn create_to_first_command(
    client: &Client,
    n: usize,
    gap: std::time::Duration,
) -> anyhow::Result<Measurement> {
    // One unmeasured run warms caches (the image's pages, connections).
    let warm = create_sandbox(client).await?;
    run_command(client, &warm, "true").await?;
    delete_sandbox(client, &warm).await?;
    let mut samples = Vec::with_capacity(n);
    // The two halves, so a change shows on which side of the answer it acts.
    let (mut creates, mut first_commands) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        tokio::time::sleep(gap).await;
        let started = Instant::now();
        let sandbox = create_sandbox(client).await?;
        creates.push(ms_since(started));
        let created = Instant::now();
        run_command(client, &sandbox, "true").await?;
        first_commands.push(ms_since(created));
        samples.push(ms_since(started));
        delete_sandbox(client, &sandbox).await?;
    }
    let mut extra = Map::new();
    extra.insert("create_median_ms".into(), json!(summarize(&mut creates).0));
    extra.insert(
        "first_command_median_ms".into(),
        json!(summarize(&mut first_commands).0),
    );
    Ok(Measurement { samples, extra })
}

/// The round trip of `true` in one running sandbox.
pub(super) async fn exec_round_trip(client: &Client, n: usize) -> anyhow::Result<Measurement> {
    with_sandbox(client, async |sandbox| {
        for _ in 0..5 {
            run_command(client, sandbox, "true").await?;
        }
        let mut samples = Vec::with_capacity(n);
        for _ in 0..n {
            let started = Instant::now();
            run_command(client, sandbox, "true").await?;
            samples.push(ms_since(started));
        }
        Ok(Measurement {
            samples,
            extra: Map::new(),
        })
    })
    .await
}
