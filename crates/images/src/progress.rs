//! Progress of a pull or an import, for a CLI progress bar and build logs.

use std::fmt;
use std::sync::Arc;

/// One step of a pull or import. Layers are numbered from 1. Events come in
/// this order: `Resolving`, `Resolved`, then per layer `LayerCached` or
/// `Downloading`s (layers download concurrently, so their events interleave),
/// then `Unpacking` for each layer not unpacked before, `Assembling` if the root
/// filesystem is new, and `Done`. A step another process is doing at the same
/// time is waited for and not reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Looking up a reference in its registry, or reading an import source.
    Resolving { reference: String },
    /// The image is known: its layers and the bytes they take compressed.
    Resolved {
        manifest_digest: Option<String>,
        layers: usize,
        total_bytes: u64,
    },
    /// A layer is already in the cache; nothing to download.
    LayerCached {
        layer: usize,
        layers: usize,
        digest: String,
    },
    /// Bytes of a layer have arrived (sent at the start, every MiB and at the end).
    Downloading {
        layer: usize,
        layers: usize,
        digest: String,
        downloaded: u64,
        total: u64,
    },
    /// A layer is being unpacked into the cache.
    Unpacking {
        layer: usize,
        layers: usize,
        digest: String,
    },
    /// The layers are being stacked into the image's root filesystem.
    Assembling { layers: usize },
    /// The root filesystem is ready; `cached` when nothing had to be built.
    Done {
        id: String,
        size_bytes: u64,
        cached: bool,
    },
}

/// One line for a build log.
impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Progress::Resolving { reference } => write!(f, "resolving {reference}"),
            Progress::Resolved {
                manifest_digest,
                layers,
                total_bytes,
            } => {
                write!(
                    f,
                    "{layers} layers, {} compressed",
                    human_bytes(*total_bytes)
                )?;
                if let Some(digest) = manifest_digest {
                    write!(f, ", manifest {digest}")?;
                }
                Ok(())
            }
            Progress::LayerCached {
                layer,
                layers,
                digest,
            } => write!(
                f,
                "layer {layer}/{layers} {} already present",
                short(digest)
            ),
            Progress::Downloading {
                layer,
                layers,
                digest,
                downloaded,
                total,
            } => write!(
                f,
                "layer {layer}/{layers} {} downloading {}/{}",
                short(digest),
                human_bytes(*downloaded),
                human_bytes(*total)
            ),
            Progress::Unpacking {
                layer,
                layers,
                digest,
            } => write!(f, "layer {layer}/{layers} {} unpacking", short(digest)),
            Progress::Assembling { layers } => {
                write!(f, "assembling the root filesystem from {layers} layers")
            }
            Progress::Done {
                id,
                size_bytes,
                cached,
            } => write!(
                f,
                "image {} ready, {}{}",
                short(id),
                human_bytes(*size_bytes),
                if *cached { " (cached)" } else { "" }
            ),
        }
    }
}

fn short(digest: &str) -> &str {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    hex.get(..12).unwrap_or(hex)
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The callback every step reports to; shared with blocking unpack threads.
pub(crate) type Sink = Arc<dyn Fn(&Progress) + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines() {
        let digest = format!("sha256:{}", "ab".repeat(32));
        let line = Progress::Downloading {
            layer: 2,
            layers: 3,
            digest,
            downloaded: 3 * 1024 * 1024,
            total: 10 * 1024 * 1024,
        }
        .to_string();
        assert_eq!(line, "layer 2/3 abababababab downloading 3.0 MiB/10.0 MiB");
    }
}
