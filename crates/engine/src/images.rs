//! Snapshots made from container images: a registry reference (`python:3.12-slim`)
//! pulled through `cove-oci`, or the Dockerfile the SDK's `Image` builder sends.
//!
//! An image becomes an ordinary snapshot whose root filesystem is the unpacked
//! image and whose environment is the image's; the agent is not copied in (the
//! container backend mounts it into every sandbox). A snapshot is made once per
//! reference (or per Dockerfile text) and reused.

use std::collections::BTreeMap;

use cove_lifecycle::SandboxClass;
use cove_store::{SnapshotRecord, SnapshotState};
use sha2::{Digest as _, Sha256};

use crate::create::sized;
use crate::{now_ms, Engine, EngineError};

/// What a Dockerfile asks for, in the subset cove builds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DockerfilePlan {
    /// The image of the one `FROM`.
    pub base: String,
    /// `ENV` settings, in order (later ones win).
    pub env: Vec<(String, String)>,
}

/// Parses a Dockerfile into the steps cove can build, or names the first
/// instruction it cannot.
pub fn parse_dockerfile(text: &str) -> Result<DockerfilePlan, EngineError> {
    let mut plan = DockerfilePlan::default();
    // Continuation lines (`\` at the end) join into one instruction.
    let mut joined: Vec<String> = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if current.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
            continue;
        }
        current.push_str(trimmed);
        joined.push(std::mem::take(&mut current));
    }
    if !current.is_empty() {
        joined.push(current);
    }
    for instruction in joined {
        let (keyword, rest) = instruction
            .split_once(char::is_whitespace)
            .map(|(k, r)| (k, r.trim()))
            .unwrap_or((instruction.as_str(), ""));
        match keyword.to_ascii_uppercase().as_str() {
            "FROM" => {
                if !plan.base.is_empty() {
                    return Err(unsupported("a second FROM (multi-stage builds)"));
                }
                let mut words = rest.split_whitespace();
                let image = words.next().unwrap_or_default();
                let platform = image.starts_with("--");
                if image.is_empty() || platform || words.next().is_some() {
                    return Err(unsupported(&format!("FROM {rest}")));
                }
                plan.base = image.to_owned();
            }
            "ENV" => plan.env.extend(parse_env(rest)?),
            // Metadata only: nothing to build.
            "LABEL" | "EXPOSE" | "CMD" | "ENTRYPOINT" | "STOPSIGNAL" | "MAINTAINER" => {}
            "WORKDIR" | "USER" | "RUN" | "COPY" | "ADD" | "ARG" | "VOLUME" | "SHELL"
            | "ONBUILD" | "HEALTHCHECK" => {
                return Err(unsupported(&format!("the {keyword} instruction")));
            }
            other => {
                return Err(EngineError::Invalid {
                    field: "buildInfo.dockerfileContent",
                    reason: format!("{other:?} is not a Dockerfile instruction"),
                })
            }
        }
        if plan.base.is_empty() {
            return Err(EngineError::Invalid {
                field: "buildInfo.dockerfileContent",
                reason: "the Dockerfile must start with FROM".into(),
            });
        }
    }
    if plan.base.is_empty() {
        return Err(EngineError::Invalid {
            field: "buildInfo.dockerfileContent",
            reason: "the Dockerfile has no FROM".into(),
        });
    }
    Ok(plan)
}

fn unsupported(what: &str) -> EngineError {
    EngineError::NotImplemented {
        what: format!("building images with {what}"),
    }
}

/// `ENV KEY=value KEY2="two words"` or the old `ENV KEY value` form.
fn parse_env(rest: &str) -> Result<Vec<(String, String)>, EngineError> {
    let bad = || EngineError::Invalid {
        field: "buildInfo.dockerfileContent",
        reason: format!("cannot read ENV {rest}"),
    };
    let Some(first) = rest.split_whitespace().next() else {
        return Err(bad());
    };
    if !first.contains('=') {
        let (key, value) = rest.split_once(char::is_whitespace).ok_or_else(bad)?;
        return Ok(vec![(key.to_owned(), unquote(value.trim()))]);
    }
    let mut pairs = Vec::new();
    let mut chars = rest.chars().peekable();
    while chars.peek().is_some() {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() {
            break;
        }
        let mut value = String::new();
        let mut quote: Option<char> = None;
        while let Some(&c) = chars.peek() {
            match (quote, c) {
                (None, c) if c.is_whitespace() => break,
                (None, '"' | '\'') => quote = Some(c),
                (Some(q), c) if c == q => quote = None,
                _ => value.push(c),
            }
            chars.next();
        }
        if quote.is_some() || key.contains(char::is_whitespace) {
            return Err(bad());
        }
        pairs.push((key, value));
    }
    Ok(pairs)
}

fn unquote(value: &str) -> String {
    let quoted = value.len() >= 2
        && ((value.starts_with('"') && value.ends_with('"'))
            || (value.starts_with('\'') && value.ends_with('\'')));
    if quoted {
        value[1..value.len() - 1].to_owned()
    } else {
        value.to_owned()
    }
}

impl Engine {
    /// The snapshot of a registry image, pulled on first use. Its name is the
    /// normalized reference (`docker.io/library/python:3.12-slim`).
    pub async fn image_snapshot(&self, reference: &str) -> Result<SnapshotRecord, EngineError> {
        let name =
            cove_oci::normalize_reference(reference).map_err(|e| image_error(reference, e))?;
        if let Some(found) = self.inner.store.find_snapshot(&name).await? {
            match found.state {
                SnapshotState::Active => return Ok(found),
                SnapshotState::Inactive => {
                    return Err(EngineError::SnapshotNotActive {
                        name: found.name,
                        state: found.state.as_str(),
                    })
                }
                _ => {}
            }
        }
        let images = self.image_store()?;
        let label = name.clone();
        let pulled = images
            .pull(reference, None, move |progress| {
                tracing::info!(image = %label, "{progress}");
            })
            .await
            .map_err(|e| image_error(reference, e))?;
        let snapshot = snapshot_of(self, &name, &pulled);
        self.inner.store.save_snapshot(&snapshot).await?;
        tracing::info!(image = %name, rootfs = %pulled.rootfs.display(), "image snapshot ready");
        Ok(snapshot)
    }

    /// The snapshot built from a Dockerfile, made once per Dockerfile text.
    pub async fn dockerfile_snapshot(&self, text: &str) -> Result<SnapshotRecord, EngineError> {
        let plan = parse_dockerfile(text)?;
        let base = self.image_snapshot(&plan.base).await?;
        if plan.env.is_empty() {
            return Ok(base);
        }
        let digest = Sha256::digest(text.as_bytes());
        let name = format!(
            "cove-build-{}",
            digest[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        );
        if let Some(found) = self.inner.store.find_snapshot(&name).await? {
            return Ok(found);
        }
        let mut env = base.env.clone();
        env.extend(plan.env);
        let now = now_ms();
        let snapshot = SnapshotRecord {
            id: name.clone(),
            name: name.clone(),
            env,
            created_at_ms: now,
            updated_at_ms: now,
            ..base
        };
        self.inner.store.save_snapshot(&snapshot).await?;
        Ok(snapshot)
    }
}

/// A snapshot a user asked to be made from an image.
#[derive(Clone, Debug, Default)]
pub struct ImageSnapshotRequest {
    pub name: String,
    /// A registry reference (`imageName`), or
    pub image: Option<String>,
    /// a Dockerfile (`buildInfo.dockerfileContent`).
    pub dockerfile: Option<String>,
    pub class: Option<SandboxClass>,
    pub cpu: Option<i64>,
    pub memory_gib: Option<i64>,
    pub disk_gib: Option<i64>,
}

impl Engine {
    /// Registers snapshot `name` made from a registry image or a Dockerfile;
    /// returns it `active` once the image is pulled.
    pub async fn create_image_snapshot(
        &self,
        request: ImageSnapshotRequest,
    ) -> Result<SnapshotRecord, EngineError> {
        check_snapshot_name(&request.name)?;
        if self
            .inner
            .store
            .find_snapshot(&request.name)
            .await?
            .is_some()
        {
            return Err(EngineError::SnapshotTaken { name: request.name });
        }
        let class = request.class.unwrap_or(SandboxClass::Container);
        self.runtime(class)?;
        let source = match (&request.image, &request.dockerfile) {
            (Some(image), None) => self.image_snapshot(image).await?,
            (None, Some(text)) => self.dockerfile_snapshot(text).await?,
            _ => {
                return Err(EngineError::Invalid {
                    field: "imageName",
                    reason: "give exactly one of imageName and buildInfo.dockerfileContent".into(),
                })
            }
        };
        let (cpu, memory_gib, disk_gib) = sized(
            self.inner.config.ceilings,
            (request.cpu, request.memory_gib, request.disk_gib),
            &source,
        )?;
        let now = now_ms();
        let snapshot = SnapshotRecord {
            id: uuid::Uuid::new_v4().to_string(),
            name: request.name.clone(),
            class,
            cpu,
            memory_gib,
            disk_gib,
            general: false,
            created_at_ms: now,
            updated_at_ms: now,
            ..source
        };
        self.inner
            .store
            .insert_snapshot(&snapshot)
            .await
            .map_err(|e| match e {
                cove_store::StoreError::Duplicate { name } => EngineError::SnapshotTaken { name },
                other => other.into(),
            })?;
        Ok(snapshot)
    }

    /// Registers snapshot `name` from an OCI layout directory or a `docker save`
    /// tarball on this host (for hosts without a registry).
    pub async fn import_image_snapshot(
        &self,
        name: &str,
        path: &std::path::Path,
    ) -> Result<SnapshotRecord, EngineError> {
        check_snapshot_name(name)?;
        if self.inner.store.find_snapshot(name).await?.is_some() {
            return Err(EngineError::SnapshotTaken {
                name: name.to_owned(),
            });
        }
        let images = self.image_store()?;
        let label = path.display().to_string();
        let source = path.to_owned();
        let pulled = tokio::task::spawn_blocking(move || {
            images.import(&source, None, move |progress| {
                tracing::info!(image = %label, "{progress}");
            })
        })
        .await
        .map_err(|e| EngineError::Runtime {
            id: name.to_owned(),
            operation: "import its image",
            reason: e.to_string(),
        })?
        .map_err(|e| image_error(&path.display().to_string(), e))?;
        let snapshot = snapshot_of(self, name, &pulled);
        self.inner
            .store
            .insert_snapshot(&snapshot)
            .await
            .map_err(|e| match e {
                cove_store::StoreError::Duplicate { name } => EngineError::SnapshotTaken { name },
                other => other.into(),
            })?;
        tracing::info!(snapshot = %name, from = %path.display(), "image imported");
        Ok(snapshot)
    }

    fn image_store(&self) -> Result<cove_oci::ImageStore, EngineError> {
        self.inner
            .config
            .images
            .clone()
            .ok_or_else(|| EngineError::NotImplemented {
                what: "images without an image cache (serve --images-dir)".into(),
            })
    }
}

/// Snapshot names are used in URLs: letters, digits, '-', '_', '.' and ':'.
fn check_snapshot_name(name: &str) -> Result<(), EngineError> {
    let valid = !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
    if valid {
        Ok(())
    } else {
        Err(EngineError::Invalid {
            field: "name",
            reason: format!(
                "snapshot name {name:?} must be 1 to 128 letters, digits, '-', '_', '.' or ':'"
            ),
        })
    }
}

/// An active container snapshot of an unpacked image.
fn snapshot_of(engine: &Engine, name: &str, pulled: &cove_oci::PulledImage) -> SnapshotRecord {
    let env: BTreeMap<String, String> = pulled
        .config
        .env
        .iter()
        .filter_map(|entry| entry.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let config = &engine.inner.config;
    SnapshotRecord {
        id: format!("{name}@{}", pulled.id),
        cpu: config.default_cpu,
        memory_gib: config.default_memory_gib,
        disk_gib: config.default_disk_gib,
        size_bytes: i64::try_from(pulled.size_bytes).ok(),
        env,
        general: false,
        ..SnapshotRecord::for_image(
            name,
            &pulled.rootfs.display().to_string(),
            SandboxClass::Container,
            now_ms(),
        )
    }
}

fn image_error(reference: &str, error: cove_oci::OciError) -> EngineError {
    EngineError::Image {
        reference: reference.to_owned(),
        status: error.kind().http_status(),
        reason: error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dockerfiles_cove_can_build() {
        let plan = parse_dockerfile(
            "# comment\nFROM python:3.12-slim\nENV A=1 B=\"two words\"\nENV C three\nLABEL x=y\n",
        )
        .unwrap();
        assert_eq!(plan.base, "python:3.12-slim");
        assert_eq!(
            plan.env,
            [
                ("A".to_owned(), "1".to_owned()),
                ("B".to_owned(), "two words".to_owned()),
                ("C".to_owned(), "three".to_owned()),
            ]
        );
        let joined = parse_dockerfile("FROM \\\n  alpine:3\n").unwrap();
        assert_eq!(joined.base, "alpine:3");
    }

    #[test]
    fn dockerfiles_cove_cannot_build_are_refused_by_name() {
        let err = parse_dockerfile("FROM debian\nRUN apt-get update\n").unwrap_err();
        assert!(err.to_string().contains("RUN"), "{err}");
        assert!(matches!(err, EngineError::NotImplemented { .. }));
        let err = parse_dockerfile("FROM a AS b\n").unwrap_err();
        assert!(err.to_string().contains("FROM a AS b"), "{err}");
        let err = parse_dockerfile("ENV A=1\n").unwrap_err();
        assert!(err.to_string().contains("must start with FROM"), "{err}");
        let err = parse_dockerfile("FROM a\nFROM b\n").unwrap_err();
        assert!(err.to_string().contains("multi-stage"), "{err}");
        let err = parse_dockerfile("FROM a\nFROBNICATE\n").unwrap_err();
        assert!(matches!(err, EngineError::Invalid { .. }), "{err}");
        assert!(parse_dockerfile("").is_err());
    }
}
