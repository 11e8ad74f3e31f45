//! The image configuration blob: how to run the image, and the digests of its
//! uncompressed layers.

use serde::Deserialize;

use crate::digest::Digest;
use crate::error::{ImageError, Result};

/// How the image wants to be run, from its configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageConfig {
    /// `KEY=value` entries, in the image's order.
    pub env: Vec<String>,
    /// The working directory; `None` when the image sets none (use `/`).
    pub working_dir: Option<String>,
    /// `user`, `uid`, `user:group` or `uid:gid`; `None` for root.
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

/// What the crate reads from a configuration blob.
pub(crate) struct ParsedConfig {
    pub config: ImageConfig,
    /// Digests of the uncompressed layer tars, lowest first.
    pub diff_ids: Vec<Digest>,
}

// Docker writes `null` for empty lists and omits fields freely; everything is optional.
#[derive(Deserialize)]
struct RawImage {
    architecture: Option<String>,
    os: Option<String>,
    config: Option<RawConfig>,
    rootfs: Option<RawRootfs>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawConfig {
    env: Option<Vec<String>>,
    working_dir: Option<String>,
    user: Option<String>,
    entrypoint: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
}

#[derive(Deserialize)]
struct RawRootfs {
    #[serde(rename = "type")]
    kind: Option<String>,
    diff_ids: Option<Vec<String>>,
}

/// Parses a configuration blob of `reference`, refusing images that are not
/// linux/amd64 (a single-platform image says so only here).
pub(crate) fn parse(reference: &str, bytes: &[u8]) -> Result<ParsedConfig> {
    let raw: RawImage = serde_json::from_slice(bytes).map_err(|e| {
        ImageError::invalid(
            reference,
            format!("image configuration is not valid JSON: {e}"),
        )
    })?;
    if let Some(os) = raw.os.as_deref().filter(|os| *os != "linux") {
        return Err(ImageError::unsupported(
            reference,
            format!("it is built for {os}, cove runs linux images"),
        ));
    }
    if let Some(arch) = raw.architecture.as_deref().filter(|a| *a != "amd64") {
        return Err(ImageError::unsupported(
            reference,
            format!("it is built for {arch}, this host runs amd64"),
        ));
    }
    let rootfs = raw
        .rootfs
        .ok_or_else(|| ImageError::invalid(reference, "image configuration has no rootfs"))?;
    if rootfs.kind.as_deref().is_some_and(|k| k != "layers") {
        return Err(ImageError::unsupported(
            reference,
            "its rootfs type is not `layers`",
        ));
    }
    let diff_ids = rootfs
        .diff_ids
        .unwrap_or_default()
        .iter()
        .map(|d| {
            Digest::parse(d).ok_or_else(|| {
                ImageError::unsupported(reference, format!("layer digest {d:?} is not sha256"))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let c = raw.config.unwrap_or(RawConfig {
        env: None,
        working_dir: None,
        user: None,
        entrypoint: None,
        cmd: None,
    });
    Ok(ParsedConfig {
        config: ImageConfig {
            env: c.env.unwrap_or_default(),
            working_dir: c.working_dir.filter(|w| !w.is_empty()),
            user: c.user.filter(|u| !u.is_empty()),
            entrypoint: c.entrypoint.unwrap_or_default(),
            cmd: c.cmd.unwrap_or_default(),
        },
        diff_ids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_config_with_nulls() {
        let d = format!("sha256:{}", "0".repeat(64));
        let json = format!(
            r#"{{"architecture":"amd64","os":"linux","config":{{"Env":["PATH=/usr/bin","LANG=C.UTF-8"],"Cmd":["python3"],"Entrypoint":null,"WorkingDir":"","User":"1000:1000"}},"rootfs":{{"type":"layers","diff_ids":["{d}"]}}}}"#
        );
        let parsed = parse("x", json.as_bytes()).unwrap();
        assert_eq!(
            parsed.config,
            ImageConfig {
                env: vec!["PATH=/usr/bin".into(), "LANG=C.UTF-8".into()],
                working_dir: None,
                user: Some("1000:1000".into()),
                entrypoint: vec![],
                cmd: vec!["python3".into()],
            }
        );
        assert_eq!(parsed.diff_ids.len(), 1);
    }

    #[test]
    fn other_platforms_are_unsupported() {
        let json =
            r#"{"architecture":"arm64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
        let err = parse("x", json.as_bytes()).err().unwrap();
        assert_eq!(err.kind(), crate::ErrorKind::Unsupported);
    }
}
