//! `cove image pull`: registers a snapshot from a registry image, then
//! follows its build log (`GET /snapshots/{id}/build-logs?follow=true`) and
//! draws one progress bar per layer from the log's `downloading` lines. On a
//! terminal other lines are printed above the bars; elsewhere every line but
//! the byte counts is printed as it comes.

use std::collections::BTreeMap;
use std::io::IsTerminal as _;

use anyhow::{bail, Context as _};
use futures_util::StreamExt as _;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use reqwest::Method;
use serde_json::json;

use crate::client::Client;

pub(crate) async fn pull(client: &Client, image: &str, name: &str) -> anyhow::Result<()> {
    let snapshot = client
        .api(
            Method::POST,
            "/snapshots",
            Some(json!({ "name": name, "imageName": image })),
        )
        .await?;
    let id = snapshot["id"]
        .as_str()
        .context("the server answered no snapshot id")?
        .to_owned();
    let response = client
        .raw(
            Method::GET,
            &format!("{}/snapshots/{id}/build-logs?follow=true", client.url()),
        )
        .send()
        .await?;
    if !response.status().is_success() {
        bail!("following the pull's log: {}", response.status());
    }
    let mut view = View::new(std::io::stderr().is_terminal());
    let mut body = response.bytes_stream();
    let mut pending: Vec<u8> = Vec::new();
    while let Some(chunk) = body.next().await {
        pending.extend_from_slice(&chunk?);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            view.line(String::from_utf8_lossy(&line).trim_end());
        }
    }
    if !pending.is_empty() {
        view.line(String::from_utf8_lossy(&pending).trim_end());
    }
    view.finish();

    let snapshot = client
        .api(Method::GET, &format!("/snapshots/{id}"), None)
        .await?;
    match snapshot["state"].as_str() {
        Some("active") => {
            println!("snapshot {name} ({id}) is active");
            Ok(())
        }
        Some("error") => bail!(
            "pulling {image} failed: {}",
            snapshot["errorReason"]
                .as_str()
                .unwrap_or("no reason given")
        ),
        other => bail!("the pull's log ended with snapshot {name} {other:?}"),
    }
}

/// What a build log line says about one layer.
#[derive(Debug, PartialEq)]
struct LayerLine<'a> {
    /// `1/3 0123456789ab`: the layer's number and short digest.
    label: String,
    step: Step<'a>,
}

#[derive(Debug, PartialEq)]
enum Step<'a> {
    Downloading {
        done: u64,
        total: u64,
    },
    /// Unpacking, already present, or anything else that ends its download.
    Other(&'a str),
}

/// Reads `layer {n}/{of} {digest} {what}` (see cove-images's `Progress`).
fn parse_layer(line: &str) -> Option<LayerLine<'_>> {
    let rest = line.strip_prefix("layer ")?;
    let mut words = rest.splitn(3, ' ');
    let (number, digest, what) = (words.next()?, words.next()?, words.next()?);
    number.split_once('/')?;
    let label = format!("{number} {digest}");
    let step = match what.strip_prefix("downloading ") {
        Some(amounts) => {
            let (done, total) = amounts.split_once('/')?;
            Step::Downloading {
                done: parse_bytes(done)?,
                total: parse_bytes(total)?,
            }
        }
        None => Step::Other(what),
    };
    Some(LayerLine { label, step })
}

/// `512 B`, `1.5 MiB` (as cove-images writes sizes) to bytes, to the precision shown.
fn parse_bytes(text: &str) -> Option<u64> {
    let (number, unit) = text.trim().split_once(' ')?;
    let number: f64 = number.parse().ok()?;
    let scale = match unit {
        "B" => 1u64,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    Some((number * scale as f64).round() as u64)
}

struct View {
    bars: Option<MultiProgress>,
    layers: BTreeMap<String, ProgressBar>,
}

impl View {
    fn new(terminal: bool) -> View {
        View {
            bars: terminal.then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr())),
            layers: BTreeMap::new(),
        }
    }

    fn line(&mut self, line: &str) {
        let Some(bars) = &self.bars else {
            // No terminal: the byte counts would be noise; the rest is the log.
            if !matches!(
                parse_layer(line),
                Some(LayerLine {
                    step: Step::Downloading { .. },
                    ..
                })
            ) {
                eprintln!("{line}");
            }
            return;
        };
        match parse_layer(line) {
            Some(LayerLine { label, step }) => {
                let bar = self.layers.entry(label.clone()).or_insert_with(|| {
                    let bar = bars.add(ProgressBar::new(0));
                    bar.set_style(
                        ProgressStyle::with_template(
                            "layer {prefix} [{bar:30}] {bytes}/{total_bytes} {msg}",
                        )
                        .expect("a valid template")
                        .progress_chars("=> "),
                    );
                    bar.set_prefix(label);
                    bar
                });
                match step {
                    Step::Downloading { done, total } => {
                        bar.set_length(total);
                        bar.set_position(done);
                    }
                    Step::Other(what) => {
                        bar.set_position(bar.length().unwrap_or(0));
                        bar.finish_with_message(what.to_owned());
                    }
                }
            }
            None => {
                let _ = bars.println(line);
            }
        }
    }

    fn finish(&mut self) {
        for bar in self.layers.values() {
            if !bar.is_finished() {
                bar.finish();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_layer_lines_of_a_pull_log() {
        assert_eq!(
            parse_layer("layer 2/3 0123456789ab downloading 1.5 MiB/40.0 MiB"),
            Some(LayerLine {
                label: "2/3 0123456789ab".into(),
                step: Step::Downloading {
                    done: 1_572_864,
                    total: 41_943_040
                },
            })
        );
        assert_eq!(
            parse_layer("layer 1/3 0123456789ab downloading 512 B/512 B"),
            Some(LayerLine {
                label: "1/3 0123456789ab".into(),
                step: Step::Downloading {
                    done: 512,
                    total: 512
                },
            })
        );
        assert_eq!(
            parse_layer("layer 1/3 0123456789ab unpacking"),
            Some(LayerLine {
                label: "1/3 0123456789ab".into(),
                step: Step::Other("unpacking"),
            })
        );
        assert_eq!(parse_layer("3 layers, 40.0 MiB compressed"), None);
        assert_eq!(parse_layer("layer 1/3 abc downloading lots"), None);
    }
}
