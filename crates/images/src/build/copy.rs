//! `COPY` and `ADD`: choosing files from the build context and writing them
//! as one tar archive of paths under the image's root, which the build
//! sandbox's agent unpacks at `/` (so a symlink already in the image is
//! followed inside the sandbox, never on this host).
//!
//! The context is the SDK's uploaded archives unpacked into a scratch
//! directory on this host. It is read without following symbolic links: a
//! link in the context is copied as a link, and a source path that goes
//! through one is refused.

use std::fs::{File, Metadata};
use std::io::{BufReader, Read, Seek as _, SeekFrom};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Component, Path, PathBuf};

use globset::GlobBuilder;

use super::dockerfile::Copy;

/// Why a `COPY` or `ADD` cannot be written: the source as the Dockerfile
/// wrote it, or the file on this host that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("{source_path} is outside the build context")]
    OutsideContext { source_path: String },
    #[error("cannot read source {source_path}")]
    BadSource { source_path: String },
    #[error("{source_path} is not in the build context")]
    NotInContext { source_path: String },
    #[error("{source_path} goes through a symbolic link in the build context")]
    ThroughSymlink { source_path: String },
    #[error("no file in the build context matches {source_path}")]
    NoMatch { source_path: String },
    #[error("pattern {source_path}: {error}")]
    BadPattern {
        source_path: String,
        error: globset::Error,
    },
    #[error("{} is neither a file, a directory nor a link", path.display())]
    NotCopyable { path: PathBuf },
    #[error("{} is a bzip2 or xz archive; ADD unpacks plain and gzip tar archives", path.display())]
    CompressedArchive { path: PathBuf },
    #[error("{}: a link without a target", archive.display())]
    LinkWithoutTarget { archive: PathBuf },
    /// An entry of an `ADD`ed archive names a path outside it.
    #[error("{}: {error}", archive.display())]
    InArchive {
        archive: PathBuf,
        error: Box<CopyError>,
    },
    /// A file of the context or of the archive being written.
    #[error("{action} {}: {error}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        error: std::io::Error,
    },
}

/// For `map_err`: an I/O error while doing `action` to `path`.
fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CopyError {
    let path = path.to_owned();
    move |error| CopyError::Io {
        action,
        path,
        error,
    }
}

/// Unpacks the context archives into `into`, later ones over earlier ones.
pub(super) fn unpack_contexts(archives: &[PathBuf], into: &Path) -> Result<(), CopyError> {
    std::fs::create_dir_all(into).map_err(io("creating", into))?;
    for archive in archives {
        let file = File::open(archive).map_err(io("opening build context", archive))?;
        let mut tar = tar::Archive::new(BufReader::new(file));
        tar.set_preserve_permissions(true);
        tar.set_preserve_mtime(true);
        tar.set_overwrite(true);
        tar.unpack(into)
            .map_err(io("unpacking build context", archive))?;
    }
    Ok(())
}

/// `path` made absolute against `workdir` and normalized (`.`, `..` and
/// repeated slashes resolved), without the leading `/`; empty for the root.
pub(super) fn image_path(path: &str, workdir: Option<&str>) -> String {
    let joined = if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("{}/{path}", workdir.unwrap_or("/"))
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in joined.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    parts.join("/")
}

/// A context path a source names, relative to the context root.
fn context_path(source: &str) -> Result<PathBuf, CopyError> {
    let mut path = PathBuf::new();
    for component in Path::new(source).components() {
        match component {
            Component::Normal(part) => path.push(part),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir => {
                if !path.pop() {
                    return Err(CopyError::OutsideContext {
                        source_path: source.to_owned(),
                    });
                }
            }
            Component::Prefix(_) => {
                return Err(CopyError::BadSource {
                    source_path: source.to_owned(),
                })
            }
        }
    }
    Ok(path)
}

/// Every path in the context, relative to it, parents before children.
fn walk(root: &Path, relative: &Path, out: &mut Vec<PathBuf>) -> Result<(), CopyError> {
    let dir = root.join(relative);
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .map_err(io("listing", &dir))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(io("listing", &dir))?;
    entries.sort();
    for name in entries {
        let path = relative.join(name);
        let is_dir = std::fs::symlink_metadata(root.join(&path))
            .map_err(io("inspecting", &path))?
            .is_dir();
        out.push(path.clone());
        if is_dir {
            walk(root, &path, out)?;
        }
    }
    Ok(())
}

/// The context paths `sources` name: globs (`*`, `?`, `[...]`, not across
/// `/`) expand to what they match, in order; a plain path must exist.
pub(super) fn resolve_sources(
    context: &Path,
    sources: &[String],
) -> Result<Vec<PathBuf>, CopyError> {
    let mut everything: Option<Vec<PathBuf>> = None;
    let mut resolved = Vec::new();
    for source in sources {
        let path = context_path(source)?;
        if source.contains(['*', '?', '[']) {
            let pattern = path.to_string_lossy().into_owned();
            let glob = GlobBuilder::new(&pattern)
                .literal_separator(true)
                .build()
                .map_err(|error| CopyError::BadPattern {
                    source_path: source.clone(),
                    error,
                })?
                .compile_matcher();
            let all = match &mut everything {
                Some(all) => all,
                None => {
                    let mut all = Vec::new();
                    walk(context, Path::new(""), &mut all)?;
                    everything.insert(all)
                }
            };
            let matched: Vec<PathBuf> = all.iter().filter(|p| glob.is_match(p)).cloned().collect();
            if matched.is_empty() {
                return Err(CopyError::NoMatch {
                    source_path: source.clone(),
                });
            }
            resolved.extend(matched);
            continue;
        }
        // Each component must be a real entry, not a link out of the context.
        let mut at = context.to_path_buf();
        let count = path.components().count();
        for (index, part) in path.components().enumerate() {
            at.push(part);
            let meta = std::fs::symlink_metadata(&at).map_err(|_| CopyError::NotInContext {
                source_path: source.clone(),
            })?;
            if meta.file_type().is_symlink() && index + 1 < count {
                return Err(CopyError::ThroughSymlink {
                    source_path: source.clone(),
                });
            }
        }
        resolved.push(path);
    }
    Ok(resolved)
}

/// How the archive writer treats what it copies.
#[derive(Clone, Copy, Debug)]
pub(super) struct Options {
    /// `--chmod`: the mode of every entry.
    pub chmod: Option<u32>,
    /// `ADD`: unpack local tar archives.
    pub unpack_archives: bool,
}

impl From<&Copy> for Options {
    fn from(copy: &Copy) -> Options {
        Options {
            chmod: copy.chmod,
            unpack_archives: copy.unpack_archives,
        }
    }
}

/// Writes the archive of a `COPY`/`ADD` to `out`: `sources` (context paths)
/// placed at `dest` (an image path from [`image_path`]), which is a
/// directory when `dest_is_dir`. Answers how many entries it holds.
pub(super) fn write_archive(
    context: &Path,
    sources: &[PathBuf],
    dest: &str,
    dest_is_dir: bool,
    options: Options,
    out: &Path,
) -> Result<u64, CopyError> {
    let file = File::create(out).map_err(io("creating", out))?;
    let mut archive = Archiver {
        builder: tar::Builder::new(std::io::BufWriter::new(file)),
        options,
        entries: 0,
    };
    archive.builder.follow_symlinks(false);
    let dest = PathBuf::from(dest);
    for source in sources {
        let full = context.join(source);
        let meta = std::fs::symlink_metadata(&full).map_err(io("inspecting", source))?;
        if meta.is_dir() {
            // A directory's contents are copied, not the directory itself.
            let mut inside = Vec::new();
            walk(&full, Path::new(""), &mut inside)?;
            for path in inside {
                archive.add(&full.join(&path), &dest.join(&path))?;
            }
            continue;
        }
        if options.unpack_archives && meta.is_file() && archive.add_unpacked(&full, &dest)? {
            continue;
        }
        let target = if dest_is_dir || dest.as_os_str().is_empty() {
            dest.join(source.file_name().unwrap_or(source.as_os_str()))
        } else {
            dest.clone()
        };
        archive.add(&full, &target)?;
    }
    let entries = archive.entries;
    archive
        .builder
        .into_inner()
        .and_then(|mut w| std::io::Write::flush(&mut w))
        .map_err(io("writing", out))?;
    Ok(entries)
}

struct Archiver {
    builder: tar::Builder<std::io::BufWriter<File>>,
    options: Options,
    entries: u64,
}

impl Archiver {
    /// A header for `meta`: owned by root (an owner comes from `--chown`,
    /// applied where the archive is unpacked), its mode unless `--chmod`.
    fn header(&self, meta: &Metadata, kind: tar::EntryType) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mode(self.options.chmod.unwrap_or(meta.mode() & 0o7777));
        header.set_mtime(meta.mtime().max(0) as u64);
        header.set_size(0);
        header
    }

    /// Adds the context entry at `from` (not followed if a link) as `to`.
    fn add(&mut self, from: &Path, to: &Path) -> Result<(), CopyError> {
        let fail = |e: std::io::Error| io("copying", from)(e);
        let meta = std::fs::symlink_metadata(from).map_err(fail)?;
        let kind = meta.file_type();
        if kind.is_dir() {
            let mut header = self.header(&meta, tar::EntryType::Directory);
            self.builder
                .append_data(&mut header, to, std::io::empty())
                .map_err(fail)?;
        } else if kind.is_symlink() {
            let target = std::fs::read_link(from).map_err(fail)?;
            let mut header = self.header(&meta, tar::EntryType::Symlink);
            header.set_mode(0o777);
            self.builder
                .append_link(&mut header, to, target)
                .map_err(fail)?;
        } else if kind.is_file() {
            let mut header = self.header(&meta, tar::EntryType::Regular);
            header.set_size(meta.len());
            let file = File::open(from).map_err(fail)?;
            self.builder
                .append_data(&mut header, to, file)
                .map_err(fail)?;
        } else {
            return Err(CopyError::NotCopyable {
                path: from.to_owned(),
            });
        }
        self.entries += 1;
        Ok(())
    }

    /// `ADD`: if `from` is a tar archive (plain or gzip), adds its entries
    /// under `dest` and answers true; any other file is copied as it is.
    fn add_unpacked(&mut self, from: &Path, dest: &Path) -> Result<bool, CopyError> {
        let fail = |e: std::io::Error| io("reading", from)(e);
        let in_archive = |error: CopyError| CopyError::InArchive {
            archive: from.to_owned(),
            error: Box::new(error),
        };
        let mut file = File::open(from).map_err(fail)?;
        let mut magic = [0u8; 6];
        let read = read_up_to(&mut file, &mut magic).map_err(fail)?;
        let magic = &magic[..read];
        if magic.starts_with(b"BZh") || magic.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
            return Err(CopyError::CompressedArchive {
                path: from.to_owned(),
            });
        }
        file.seek(SeekFrom::Start(0)).map_err(fail)?;
        let gzip = magic.starts_with(&[0x1f, 0x8b]);
        let mut reader: Box<dyn Read> = if gzip {
            Box::new(flate2::read::GzDecoder::new(BufReader::new(file)))
        } else {
            Box::new(BufReader::new(file))
        };
        let mut block = vec![0u8; 512];
        let read = read_up_to(&mut reader, &mut block).map_err(fail)?;
        if read < 512 || &block[257..262] != b"ustar" {
            return Ok(false);
        }
        let reader = std::io::Cursor::new(block).chain(reader);
        let mut tar = tar::Archive::new(reader);
        for entry in tar.entries().map_err(fail)? {
            let mut entry = entry.map_err(fail)?;
            let path = entry.path().map_err(fail)?.into_owned();
            let inside = context_path(&path.to_string_lossy()).map_err(in_archive)?;
            if inside.as_os_str().is_empty() {
                continue;
            }
            let mut header = entry.header().clone();
            if let Some(mode) = self.options.chmod {
                header.set_mode(mode);
            }
            let to = dest.join(&inside);
            let kind = header.entry_type();
            if kind.is_symlink() || kind.is_hard_link() {
                let target = entry
                    .link_name()
                    .map_err(fail)?
                    .ok_or_else(|| CopyError::LinkWithoutTarget {
                        archive: from.to_owned(),
                    })?
                    .into_owned();
                // A hard link names another entry of the archive.
                let target = if kind.is_hard_link() {
                    dest.join(context_path(&target.to_string_lossy()).map_err(in_archive)?)
                } else {
                    target
                };
                self.builder
                    .append_link(&mut header, &to, target)
                    .map_err(fail)?;
            } else {
                self.builder
                    .append_data(&mut header, &to, &mut entry)
                    .map_err(fail)?;
            }
            self.entries += 1;
        }
        Ok(true)
    }
}

/// Reads until `buffer` is full or the input ends.
fn read_up_to(reader: &mut impl Read, buffer: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buffer.len() {
        match reader.read(&mut buffer[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    /// Path -> (mode, contents or link target) of an archive's entries.
    fn listing(archive: &Path) -> BTreeMap<String, (u32, String)> {
        let mut tar = tar::Archive::new(File::open(archive).unwrap());
        tar.entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let path = e.path().unwrap().display().to_string();
                let mode = e.header().mode().unwrap();
                let body = match e.link_name().unwrap() {
                    Some(link) => format!("-> {}", link.display()),
                    None => {
                        let mut bytes = Vec::new();
                        e.read_to_end(&mut bytes).unwrap();
                        String::from_utf8_lossy(&bytes).into_owned()
                    }
                };
                assert_eq!(e.header().uid().unwrap(), 0);
                (path, (mode, body))
            })
            .collect()
    }

    fn context() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("app/sub")).unwrap();
        std::fs::write(root.join("app/main.py"), "print(1)").unwrap();
        std::fs::set_permissions(
            root.join("app/main.py"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        std::fs::write(root.join("app/sub/data.txt"), "data").unwrap();
        std::fs::write(root.join("a.txt"), "a").unwrap();
        std::fs::write(root.join("b.txt"), "b").unwrap();
        std::os::unix::fs::symlink("/etc", root.join("escape")).unwrap();
        dir
    }

    fn archive(
        context: &Path,
        sources: &[&str],
        dest: &str,
        dest_is_dir: bool,
        options: Options,
    ) -> Result<BTreeMap<String, (u32, String)>, CopyError> {
        let sources: Vec<String> = sources.iter().map(|s| s.to_string()).collect();
        let resolved = resolve_sources(context, &sources)?;
        let out = tempfile::NamedTempFile::new().unwrap();
        write_archive(context, &resolved, dest, dest_is_dir, options, out.path())?;
        Ok(listing(out.path()))
    }

    const PLAIN: Options = Options {
        chmod: None,
        unpack_archives: false,
    };

    #[test]
    fn destinations_are_image_paths() {
        assert_eq!(image_path("/x/./y//z/", None), "x/y/z");
        assert_eq!(image_path("rel", Some("/work")), "work/rel");
        assert_eq!(image_path("../../..", Some("/a")), "");
    }

    #[test]
    fn a_file_goes_to_its_path_or_into_a_directory() {
        let ctx = context();
        let to_file = archive(ctx.path(), &["a.txt"], "srv/x.txt", false, PLAIN).unwrap();
        assert_eq!(to_file["srv/x.txt"].1, "a");
        let into_dir = archive(ctx.path(), &["/a.txt", "./b.txt"], "srv", true, PLAIN).unwrap();
        assert_eq!(
            into_dir.keys().collect::<Vec<_>>(),
            ["srv/a.txt", "srv/b.txt"]
        );
    }

    #[test]
    fn a_directory_copies_its_contents_with_modes() {
        let ctx = context();
        let copied = archive(ctx.path(), &["app"], "opt/app", false, PLAIN).unwrap();
        assert_eq!(
            copied.keys().collect::<Vec<_>>(),
            ["opt/app/main.py", "opt/app/sub", "opt/app/sub/data.txt"]
        );
        assert_eq!(copied["opt/app/main.py"], (0o755, "print(1)".into()));
        let chmod = Options {
            chmod: Some(0o600),
            unpack_archives: false,
        };
        let copied = archive(ctx.path(), &["app/sub"], "d", true, chmod).unwrap();
        assert_eq!(copied["d/data.txt"].0, 0o600);
    }

    #[test]
    fn globs_match_within_one_directory() {
        let ctx = context();
        let copied = archive(ctx.path(), &["*.txt"], "t", true, PLAIN).unwrap();
        assert_eq!(copied.keys().collect::<Vec<_>>(), ["t/a.txt", "t/b.txt"]);
        let err = archive(ctx.path(), &["*.md"], "t", true, PLAIN)
            .unwrap_err()
            .to_string();
        assert!(err.contains("matches *.md"), "{err}");
    }

    #[test]
    fn links_are_copied_as_links_and_never_followed() {
        let ctx = context();
        let copied = archive(ctx.path(), &["escape"], "x", true, PLAIN).unwrap();
        assert_eq!(copied["x/escape"].1, "-> /etc");
        let err = archive(ctx.path(), &["escape/passwd"], "x", true, PLAIN)
            .unwrap_err()
            .to_string();
        assert!(err.contains("symbolic link"), "{err}");
        let err = archive(ctx.path(), &["../outside"], "x", true, PLAIN)
            .unwrap_err()
            .to_string();
        assert!(err.contains("outside the build context"), "{err}");
        let err = archive(ctx.path(), &["missing.txt"], "x", true, PLAIN)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("missing.txt is not in the build context"),
            "{err}"
        );
    }

    #[test]
    fn add_unpacks_tar_archives_and_copies_other_files() {
        let ctx = context();
        // A gzip tar made by the same writer, from the context's app/.
        let inner = tempfile::NamedTempFile::new().unwrap();
        let resolved = resolve_sources(ctx.path(), &["app".into()]).unwrap();
        write_archive(ctx.path(), &resolved, "top", true, PLAIN, inner.path()).unwrap();
        let mut gz = flate2::write::GzEncoder::new(
            File::create(ctx.path().join("app.tar.gz")).unwrap(),
            flate2::Compression::fast(),
        );
        std::io::copy(&mut File::open(inner.path()).unwrap(), &mut gz).unwrap();
        gz.finish().unwrap();
        let add = Options {
            chmod: None,
            unpack_archives: true,
        };
        let unpacked = archive(ctx.path(), &["app.tar.gz", "a.txt"], "srv", true, add).unwrap();
        assert_eq!(
            unpacked.keys().collect::<Vec<_>>(),
            [
                "srv/a.txt",
                "srv/top/main.py",
                "srv/top/sub",
                "srv/top/sub/data.txt"
            ]
        );
        // COPY of the same archive copies it as a file.
        let copied = archive(ctx.path(), &["app.tar.gz"], "srv", true, PLAIN).unwrap();
        assert!(copied.contains_key("srv/app.tar.gz"));
    }
}
