//! Importing images without a registry, for offline hosts: an OCI image layout
//! (a directory, or a tarball of one) and a `docker save` tarball (or its
//! unpacked directory, read through `manifest.json`).
//!
//! A tarball is read in place: one pass indexes where each member's bytes lie,
//! then each blob is read at its offset, so nothing is extracted twice.
//!
//! `import_beneath` reads only beneath a directory (the server's import
//! directory, where API clients name a path): the path and every name
//! inside a layout directory are opened with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS)`, so neither `..` nor a symbolic link anywhere on
//! the way leads out of it, and what was checked is what is read (one open
//! file, no second lookup by name).

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{Mode, OFlags, ResolveFlags};

use oci_client::manifest::{ImageIndexEntry, OciImageIndex, OciImageManifest};
use serde::Deserialize;

use crate::config;
use crate::digest::Digest;
use crate::error::{io_err, ImageError, Result};
use crate::media;
use crate::progress::{Progress, Sink};
use crate::store::{ImageStore, LayerSource, PulledImage};

/// The annotation naming an image (a tag or a full reference) in a layout.
const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// Largest JSON document (index, manifest, configuration) read into memory.
const MAX_JSON: u64 = 64 << 20;
/// How deep nested indexes are followed.
const MAX_INDEX_DEPTH: usize = 4;

impl ImageStore {
    /// Imports an image from an OCI image layout (directory or tarball) or a
    /// `docker save` tarball. `tag` chooses among several images (a layout's
    /// `org.opencontainers.image.ref.name`, or a tarball's `RepoTags` entry,
    /// full or just the tag); it may be left out when there is one linux/amd64
    /// image. Blocking: call it from a blocking thread.
    pub fn import(
        &self,
        path: &Path,
        tag: Option<&str>,
        progress: impl Fn(&Progress) + Send + Sync + 'static,
    ) -> Result<PulledImage> {
        let source = Source::open(path)?;
        self.import_from(source, path, tag, progress)
    }

    /// Imports, like [`ImageStore::import`], from `path` inside the
    /// directory `root`: relative to it, or absolute and under it. Nothing
    /// outside `root` is read: a path that leaves it (`..`, a symbolic link
    /// anywhere, also inside a layout directory) is refused with
    /// [`ImageError::OutsideRoot`]. Blocking: call it from a blocking thread.
    pub fn import_beneath(
        &self,
        root: &Path,
        path: &Path,
        tag: Option<&str>,
        progress: impl Fn(&Progress) + Send + Sync + 'static,
    ) -> Result<PulledImage> {
        let relative = if path.is_absolute() {
            path.strip_prefix(root)
                .map_err(|_| ImageError::OutsideRoot {
                    path: path.to_owned(),
                    root: root.to_owned(),
                    reason: "it is not under that directory",
                })?
        } else {
            path
        };
        let root_dir: OwnedFd = rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err(root, "open the import directory")(e.into()))?;
        let relative = if relative.as_os_str().is_empty() {
            Path::new(".")
        } else {
            relative
        };
        let file = open_beneath(&root_dir, relative).map_err(|e| match e.raw_os_error() {
            Some(errno) if is_escape(errno) => ImageError::OutsideRoot {
                path: path.to_owned(),
                root: root.to_owned(),
                reason: "it leads out of that directory or through a symbolic link",
            },
            _ => open_error(path, e),
        })?;
        let source = Source::from_file(file, path, Some(root))?;
        self.import_from(source, path, tag, progress)
    }

    fn import_from(
        &self,
        source: Source,
        path: &Path,
        tag: Option<&str>,
        progress: impl Fn(&Progress) + Send + Sync + 'static,
    ) -> Result<PulledImage> {
        let progress: Sink = Arc::new(progress);
        let label = path.display().to_string();
        progress(&Progress::Resolving {
            reference: label.clone(),
        });
        if source.size("oci-layout").is_some() && source.size("index.json").is_some() {
            self.import_layout(&source, &label, tag, &progress)
        } else if source.size("manifest.json").is_some() {
            self.import_docker_archive(&source, &label, tag, &progress)
        } else {
            Err(ImageError::unsupported(
                &label,
                "it is neither an OCI image layout (oci-layout, index.json) nor a docker-save archive (manifest.json)",
            ))
        }
    }

    fn import_layout(
        &self,
        source: &Source,
        label: &str,
        tag: Option<&str>,
        progress: &Sink,
    ) -> Result<PulledImage> {
        let index: OciImageIndex = source.json(label, "index.json")?;
        let mut candidates = Vec::new();
        collect_manifests(source, label, &index.manifests, None, 0, &mut candidates)?;
        let all_names: Vec<String> = candidates
            .iter()
            .filter_map(|c| c.ref_name.clone())
            .collect();
        if let Some(tag) = tag {
            candidates.retain(|c| {
                c.ref_name
                    .as_deref()
                    .is_some_and(|name| tag_matches(name, tag))
            });
            if candidates.is_empty() {
                return Err(ImageError::NotFound {
                    reference: format!("{label}:{tag}"),
                    detail: format!("the layout names: {}", all_names.join(", ")),
                });
            }
        }
        let before = candidates.len();
        candidates.retain(|c| c.platform.as_ref().is_none_or(|p| p == "linux/amd64"));
        if candidates.is_empty() {
            return Err(if before == 0 {
                ImageError::NotFound {
                    reference: label.to_owned(),
                    detail: "the layout holds no image manifest".into(),
                }
            } else {
                ImageError::unsupported(label, "it holds no linux/amd64 image")
            });
        }
        candidates.dedup_by(|a, b| a.digest == b.digest);
        if candidates.len() > 1 {
            return Err(ImageError::BadReference {
                reference: label.to_owned(),
                reason: format!(
                    "the layout holds {} images ({}); choose one by tag",
                    candidates.len(),
                    all_names.join(", ")
                ),
            });
        }
        let chosen = &candidates[0];
        let manifest_bytes = source.blob(label, &chosen.digest)?;
        let manifest: OciImageManifest = serde_json::from_slice(&manifest_bytes).map_err(|e| {
            ImageError::invalid(
                label,
                format!("manifest {} is not valid: {e}", chosen.digest),
            )
        })?;
        media::check_config(label, &manifest.config.media_type)?;
        let config_digest = parse_digest(label, &manifest.config.digest)?;
        let config_bytes = source.blob(label, &config_digest)?;
        let parsed = config::parse(label, &config_bytes)?;
        if parsed.diff_ids.len() != manifest.layers.len() {
            return Err(ImageError::invalid(
                label,
                "the manifest and the configuration list different layers",
            ));
        }
        let mut sources = Vec::new();
        let mut total = 0;
        for (descriptor, diff_id) in manifest.layers.iter().zip(parsed.diff_ids) {
            media::check_layer(label, &descriptor.media_type)?;
            let blob = parse_digest(label, &descriptor.digest)?;
            let name = format!("blobs/sha256/{}", blob.hex());
            total += source.size(&name).ok_or_else(|| missing(label, &name))?;
            sources.push(LayerSource {
                diff_id,
                blob_digest: Some(blob),
                open: Box::new(move || source.reader(label, &name)),
            });
        }
        progress(&Progress::Resolved {
            manifest_digest: Some(chosen.digest.to_string()),
            layers: sources.len(),
            total_bytes: total,
        });
        self.build(
            label,
            &config_bytes,
            Some(&chosen.digest),
            sources,
            progress,
        )
    }

    fn import_docker_archive(
        &self,
        source: &Source,
        label: &str,
        tag: Option<&str>,
        progress: &Sink,
    ) -> Result<PulledImage> {
        let entries: Vec<DockerManifest> = source.json(label, "manifest.json")?;
        let names = || {
            entries
                .iter()
                .flat_map(|e| e.repo_tags.clone().unwrap_or_default())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let chosen: Vec<&DockerManifest> = match tag {
            Some(tag) => entries
                .iter()
                .filter(|e| e.repo_tags.iter().flatten().any(|t| tag_matches(t, tag)))
                .collect(),
            None => entries.iter().collect(),
        };
        let entry = match chosen.as_slice() {
            [one] => *one,
            [] => {
                return Err(ImageError::NotFound {
                    reference: format!("{label}:{}", tag.unwrap_or("")),
                    detail: format!("the archive holds: {}", names()),
                })
            }
            _ => {
                return Err(ImageError::BadReference {
                    reference: label.to_owned(),
                    reason: format!(
                        "the archive holds several images ({}); choose one by tag",
                        names()
                    ),
                })
            }
        };
        let config_name = member_name(label, &entry.config)?;
        let config_bytes = source.read(label, &config_name)?;
        let parsed = config::parse(label, &config_bytes)?;
        if parsed.diff_ids.len() != entry.layers.len() {
            return Err(ImageError::invalid(
                label,
                "manifest.json and the configuration list different layers",
            ));
        }
        let mut sources = Vec::new();
        let mut total = 0;
        for (layer, diff_id) in entry.layers.iter().zip(parsed.diff_ids) {
            let name = member_name(label, layer)?;
            total += source.size(&name).ok_or_else(|| missing(label, &name))?;
            sources.push(LayerSource {
                diff_id,
                // docker save stores layers uncompressed under names of its
                // own; the diff id check covers their content.
                blob_digest: None,
                open: Box::new(move || source.reader(label, &name)),
            });
        }
        progress(&Progress::Resolved {
            manifest_digest: None,
            layers: sources.len(),
            total_bytes: total,
        });
        self.build(label, &config_bytes, None, sources, progress)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifest {
    config: String,
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

struct Candidate {
    digest: Digest,
    /// `os/arch`, when the index says.
    platform: Option<String>,
    ref_name: Option<String>,
}

fn collect_manifests(
    source: &Source,
    label: &str,
    entries: &[ImageIndexEntry],
    inherited_name: Option<&str>,
    depth: usize,
    out: &mut Vec<Candidate>,
) -> Result<()> {
    for entry in entries {
        let ref_name = entry
            .annotations
            .as_ref()
            .and_then(|a| a.get(REF_NAME))
            .map(String::as_str)
            .or(inherited_name);
        let digest = parse_digest(label, &entry.digest)?;
        if media::INDEX_TYPES.contains(&entry.media_type.as_str()) {
            if depth >= MAX_INDEX_DEPTH {
                return Err(ImageError::invalid(label, "indexes are nested too deep"));
            }
            let bytes = source.blob(label, &digest)?;
            let nested: OciImageIndex = serde_json::from_slice(&bytes).map_err(|e| {
                ImageError::invalid(label, format!("index {digest} is not valid: {e}"))
            })?;
            collect_manifests(source, label, &nested.manifests, ref_name, depth + 1, out)?;
        } else if media::MANIFEST_TYPES.contains(&entry.media_type.as_str()) {
            out.push(Candidate {
                digest,
                platform: entry
                    .platform
                    .as_ref()
                    .map(|p| format!("{}/{}", p.os, p.architecture)),
                ref_name: ref_name.map(str::to_owned),
            });
        }
    }
    Ok(())
}

/// Whether an image name from a layout or archive (`latest`,
/// `example.com/app:latest`, `app:latest`) answers to the tag the caller gave.
fn tag_matches(name: &str, wanted: &str) -> bool {
    name == wanted
        || name
            .rsplit_once(':')
            .is_some_and(|(_, tag)| tag == wanted && !tag.contains('/'))
        || crate::registry::normalize_reference(name)
            .ok()
            .zip(crate::registry::normalize_reference(wanted).ok())
            .is_some_and(|(a, b)| a == b)
}

fn parse_digest(label: &str, text: &str) -> Result<Digest> {
    Digest::parse(text)
        .ok_or_else(|| ImageError::unsupported(label, format!("digest {text:?} is not sha256")))
}

fn missing(label: &str, name: &str) -> ImageError {
    ImageError::invalid(label, format!("{name} is missing"))
}

/// A member name from a manifest, checked to stay inside the source.
fn member_name(label: &str, name: &str) -> Result<String> {
    let normalized = normalize(name);
    if normalized.is_empty() || normalized.split('/').any(|c| c == "..") {
        return Err(ImageError::invalid(
            label,
            format!("member name {name:?} leaves the archive"),
        ));
    }
    Ok(normalized)
}

/// Drops `.`, empty components and a leading `/`.
fn normalize(name: &str) -> String {
    name.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
}

/// Resolves `target` of a link at `link` the way a filesystem would, lexically.
fn resolve_relative(link: &str, target: &str) -> Option<String> {
    let mut parts: Vec<&str> = if target.starts_with('/') {
        Vec::new()
    } else {
        let mut base: Vec<&str> = link.split('/').collect();
        base.pop();
        base
    };
    for component in target.split('/') {
        match component {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            c => parts.push(c),
        }
    }
    Some(parts.join("/"))
}

enum Member {
    File {
        offset: u64,
        size: u64,
    },
    /// A symlink (resolved relative to its directory) or a hard link (relative to
    /// the archive root); `docker save` links repeated layers to one copy.
    Link(String),
}

/// Opens `name` beneath the directory `dir`: never through a symbolic link,
/// never out of `dir`. Non-blocking, so a FIFO planted there cannot hang
/// the open (it is then refused as neither a file nor a directory).
fn open_beneath(dir: &impl AsFd, name: &Path) -> io::Result<File> {
    let fd = rustix::fs::openat2(
        dir,
        name,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )?;
    Ok(File::from(fd))
}

/// Whether `openat2` refused a path for leaving its directory (EXDEV) or
/// for a symbolic link (ELOOP).
fn is_escape(errno: i32) -> bool {
    errno == rustix::io::Errno::XDEV.raw_os_error()
        || errno == rustix::io::Errno::LOOP.raw_os_error()
}

fn open_error(path: &Path, e: io::Error) -> ImageError {
    match e.kind() {
        io::ErrorKind::NotFound => ImageError::NotFound {
            reference: path.display().to_string(),
            detail: "no such file or directory".into(),
        },
        _ => io_err(path, "open")(e),
    }
}

/// Reads `len` bytes of a file from `offset` on, without moving a shared
/// file position (several layers may be read at once).
struct ReadAt<'a> {
    file: &'a File,
    offset: u64,
    end: u64,
}

impl Read for ReadAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.end.saturating_sub(self.offset);
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        if want == 0 {
            return Ok(0);
        }
        let read = self.file.read_at(&mut buf[..want], self.offset)?;
        self.offset += read as u64;
        Ok(read)
    }
}

/// Where an import reads from.
enum Source {
    /// A directory; with `beneath`, its members are opened as
    /// `open_beneath` does.
    Dir {
        dir: File,
        path: PathBuf,
        beneath: bool,
    },
    Tar {
        file: File,
        members: HashMap<String, Member>,
    },
}

impl Source {
    /// The file or directory at `path`, trusted (a path the operator gave).
    fn open(path: &Path) -> Result<Source> {
        let file = File::open(path).map_err(|e| open_error(path, e))?;
        Source::from_file(file, path, None)
    }

    /// The source an open file is; `root` when it was opened beneath it.
    fn from_file(file: File, path: &Path, root: Option<&Path>) -> Result<Source> {
        let meta = file.metadata().map_err(io_err(path, "inspect"))?;
        if meta.is_dir() {
            return Ok(Source::Dir {
                dir: file,
                path: path.to_owned(),
                beneath: root.is_some(),
            });
        }
        if !meta.is_file() {
            return Err(ImageError::unsupported(
                &path.display().to_string(),
                "it is neither a regular file nor a directory",
            ));
        }
        let mut archive = tar::Archive::new(BufReader::new(&file));
        let label = path.display().to_string();
        let corrupt =
            |e: io::Error| ImageError::invalid(&label, format!("not a readable tar archive: {e}"));
        let mut members = HashMap::new();
        for entry in archive.entries().map_err(corrupt)? {
            let entry = entry.map_err(corrupt)?;
            let name = normalize(&String::from_utf8_lossy(&entry.path_bytes()));
            let link = || {
                entry
                    .link_name_bytes()
                    .map(|t| String::from_utf8_lossy(&t).into_owned())
            };
            let member = match entry.header().entry_type() {
                tar::EntryType::Regular | tar::EntryType::Continuous => Member::File {
                    offset: entry.raw_file_position(),
                    size: entry.size(),
                },
                tar::EntryType::Symlink => match link().and_then(|t| resolve_relative(&name, &t)) {
                    Some(target) => Member::Link(target),
                    None => continue,
                },
                tar::EntryType::Link => match link() {
                    Some(target) => Member::Link(normalize(&target)),
                    None => continue,
                },
                _ => continue,
            };
            members.insert(name, member);
        }
        drop(archive);
        Ok(Source::Tar { file, members })
    }

    /// A member of a directory source, opened.
    fn open_member(dir: &File, path: &Path, beneath: bool, name: &str) -> io::Result<File> {
        if beneath {
            open_beneath(dir, Path::new(name))
        } else {
            File::open(path.join(name))
        }
    }

    /// The (offset, size) of a tar member, following links.
    fn locate(members: &HashMap<String, Member>, name: &str) -> Option<(u64, u64)> {
        let mut name = name.to_owned();
        for _ in 0..16 {
            match members.get(&name)? {
                Member::File { offset, size } => return Some((*offset, *size)),
                Member::Link(target) => name = target.clone(),
            }
        }
        None
    }

    fn size(&self, name: &str) -> Option<u64> {
        match self {
            Source::Dir { dir, path, beneath } => Self::open_member(dir, path, *beneath, name)
                .and_then(|f| f.metadata())
                .ok()
                .filter(|m| m.is_file())
                .map(|m| m.len()),
            Source::Tar { members, .. } => Self::locate(members, name).map(|(_, size)| size),
        }
    }

    fn reader(&self, label: &str, name: &str) -> Result<Box<dyn Read + '_>> {
        match self {
            Source::Dir { dir, path, beneath } => {
                let file = Self::open_member(dir, path, *beneath, name)
                    .map_err(io_err(path.join(name), "open"))?;
                Ok(Box::new(file))
            }
            Source::Tar { file, members } => {
                let (offset, size) =
                    Self::locate(members, name).ok_or_else(|| missing(label, name))?;
                Ok(Box::new(ReadAt {
                    file,
                    offset,
                    end: offset + size,
                }))
            }
        }
    }

    fn read(&self, label: &str, name: &str) -> Result<Vec<u8>> {
        let size = self.size(name).ok_or_else(|| missing(label, name))?;
        if size > MAX_JSON {
            return Err(ImageError::invalid(
                label,
                format!("{name} is too large ({size} bytes)"),
            ));
        }
        let mut bytes = Vec::with_capacity(size as usize);
        self.reader(label, name)?
            .read_to_end(&mut bytes)
            .map_err(|e| ImageError::invalid(label, format!("{name} is unreadable: {e}")))?;
        Ok(bytes)
    }

    fn json<T: serde::de::DeserializeOwned>(&self, label: &str, name: &str) -> Result<T> {
        serde_json::from_slice(&self.read(label, name)?)
            .map_err(|e| ImageError::invalid(label, format!("{name} is not valid: {e}")))
    }

    /// A small blob of a layout, checked against its digest.
    fn blob(&self, label: &str, digest: &Digest) -> Result<Vec<u8>> {
        let bytes = self.read(label, &format!("blobs/sha256/{}", digest.hex()))?;
        if Digest::of_bytes(&bytes) != *digest {
            return Err(ImageError::invalid(
                label,
                format!("blob {digest} does not match its digest"),
            ));
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_match_short_and_full_names() {
        assert!(tag_matches("latest", "latest"));
        assert!(tag_matches("example.com/app:v1", "v1"));
        assert!(tag_matches("app:v1", "app:v1"));
        assert!(tag_matches("docker.io/library/app:v1", "app:v1"));
        assert!(!tag_matches("app:v1", "v2"));
    }

    #[test]
    fn links_resolve_lexically() {
        assert_eq!(
            resolve_relative("a/layer.tar", "../b/layer.tar").as_deref(),
            Some("b/layer.tar")
        );
        assert_eq!(resolve_relative("layer.tar", "../../x"), None);
        assert_eq!(member_name("x", "../etc/passwd").ok(), None);
        assert_eq!(
            member_name("x", "./abc/layer.tar").ok().as_deref(),
            Some("abc/layer.tar")
        );
    }
}
