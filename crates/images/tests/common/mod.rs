//! Test helpers: layer tars written byte by byte (so hostile names are
//! possible), OCI layouts, a local registry on loopback, skopeo, and a listing
//! of a tree that tests compare exactly.

#![allow(dead_code)]

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cove_images::Progress;
use sha2::{Digest, Sha256};

pub(crate) const M1: u64 = 1_600_000_000;
pub(crate) const M2: u64 = 1_700_000_000;

/// A scratch directory on the disk filesystem (hard links and xattrs need a
/// real one; /tmp may be tmpfs elsewhere).
pub(crate) fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("cove-images-test-")
        .tempdir_in("/var/tmp")
        .expect("create scratch dir")
}

/// Unpacking sets owners and file capabilities: only root can. CI runs as root.
pub(crate) fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Writes layer tars entry by entry with raw headers, so tests can write what
/// `tar::Builder` would refuse (`..`, absolute names).
pub(crate) struct LayerTar {
    builder: tar::Builder<Vec<u8>>,
    mtime: u64,
}

impl LayerTar {
    pub(crate) fn new(mtime: u64) -> Self {
        LayerTar {
            builder: tar::Builder::new(Vec::new()),
            mtime,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn entry(
        &mut self,
        kind: tar::EntryType,
        path: &str,
        link: Option<&str>,
        mode: u32,
        owner: (u64, u64),
        data: &[u8],
        xattrs: &[(&str, &[u8])],
    ) -> &mut Self {
        if !xattrs.is_empty() {
            let keys: Vec<String> = xattrs
                .iter()
                .map(|(k, _)| format!("SCHILY.xattr.{k}"))
                .collect();
            self.builder
                .append_pax_extensions(
                    keys.iter()
                        .map(String::as_str)
                        .zip(xattrs.iter().map(|(_, v)| *v)),
                )
                .unwrap();
        }
        let mut header = tar::Header::new_ustar();
        let bytes = path.as_bytes();
        assert!(bytes.len() < 100, "test paths stay short");
        header.as_old_mut().name[..bytes.len()].copy_from_slice(bytes);
        if let Some(link) = link {
            header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_uid(owner.0);
        header.set_gid(owner.1);
        header.set_mtime(self.mtime);
        header.set_size(data.len() as u64);
        header.set_cksum();
        self.builder.append(&header, data).unwrap();
        self
    }

    pub(crate) fn dir(&mut self, path: &str, mode: u32, owner: (u64, u64)) -> &mut Self {
        self.entry(tar::EntryType::Directory, path, None, mode, owner, b"", &[])
    }

    pub(crate) fn file(
        &mut self,
        path: &str,
        content: &str,
        mode: u32,
        owner: (u64, u64),
    ) -> &mut Self {
        self.entry(
            tar::EntryType::Regular,
            path,
            None,
            mode,
            owner,
            content.as_bytes(),
            &[],
        )
    }

    pub(crate) fn file_xattrs(
        &mut self,
        path: &str,
        content: &str,
        mode: u32,
        xattrs: &[(&str, &[u8])],
    ) -> &mut Self {
        self.entry(
            tar::EntryType::Regular,
            path,
            None,
            mode,
            (0, 0),
            content.as_bytes(),
            xattrs,
        )
    }

    pub(crate) fn symlink(&mut self, path: &str, target: &str) -> &mut Self {
        self.entry(
            tar::EntryType::Symlink,
            path,
            Some(target),
            0o777,
            (0, 0),
            b"",
            &[],
        )
    }

    pub(crate) fn hardlink(&mut self, path: &str, target: &str) -> &mut Self {
        self.entry(
            tar::EntryType::Link,
            path,
            Some(target),
            0o644,
            (0, 0),
            b"",
            &[],
        )
    }

    pub(crate) fn fifo(&mut self, path: &str, mode: u32) -> &mut Self {
        self.entry(tar::EntryType::Fifo, path, None, mode, (0, 0), b"", &[])
    }

    pub(crate) fn char_device(&mut self, path: &str) -> &mut Self {
        self.entry(tar::EntryType::Char, path, None, 0o666, (0, 0), b"", &[])
    }

    pub(crate) fn whiteout(&mut self, path: &str) -> &mut Self {
        self.entry(tar::EntryType::Regular, path, None, 0, (0, 0), b"", &[])
    }

    pub(crate) fn finish(&mut self) -> Vec<u8> {
        let builder = std::mem::replace(&mut self.builder, tar::Builder::new(Vec::new()));
        builder.into_inner().unwrap()
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Compression {
    None,
    Gzip,
    Zstd,
}

pub(crate) struct Layer {
    pub tar: Vec<u8>,
    pub compression: Compression,
}

#[derive(Clone, Debug)]
pub(crate) struct Descriptor {
    pub media_type: &'static str,
    pub digest: String,
    pub size: usize,
}

pub(crate) fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Writes a blob into a layout and describes it.
pub(crate) fn write_blob(layout: &Path, media_type: &'static str, bytes: &[u8]) -> Descriptor {
    let digest = sha256(bytes);
    let dir = layout.join("blobs/sha256");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(digest.trim_start_matches("sha256:")), bytes).unwrap();
    Descriptor {
        media_type,
        digest,
        size: bytes.len(),
    }
}

pub(crate) fn descriptor_json(d: &Descriptor) -> serde_json::Value {
    serde_json::json!({"mediaType": d.media_type, "digest": d.digest, "size": d.size})
}

/// Writes one image (layers, config, manifest) into a layout's blobs; returns
/// the manifest's descriptor and the config digest (the image id).
pub(crate) fn write_image(layout: &Path, layers: &[Layer], arch: &str) -> (Descriptor, String) {
    let mut layer_descs = Vec::new();
    let mut diff_ids = Vec::new();
    for layer in layers {
        diff_ids.push(sha256(&layer.tar));
        let (media_type, bytes) = match layer.compression {
            Compression::None => ("application/vnd.oci.image.layer.v1.tar", layer.tar.clone()),
            Compression::Gzip => {
                let mut enc =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                enc.write_all(&layer.tar).unwrap();
                (
                    "application/vnd.oci.image.layer.v1.tar+gzip",
                    enc.finish().unwrap(),
                )
            }
            Compression::Zstd => (
                "application/vnd.oci.image.layer.v1.tar+zstd",
                ruzstd::encoding::compress_to_vec(
                    &layer.tar[..],
                    ruzstd::encoding::CompressionLevel::Fastest,
                ),
            ),
        };
        layer_descs.push(descriptor_json(&write_blob(layout, media_type, &bytes)));
    }
    let config = serde_json::json!({
        "architecture": arch,
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hello world"],
            "WorkingDir": "/srv",
            "User": "1000:1000",
            "Entrypoint": ["/bin/tool"],
            "Cmd": ["--serve", "8080"]
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let config_desc = write_blob(
        layout,
        "application/vnd.oci.image.config.v1+json",
        &serde_json::to_vec(&config).unwrap(),
    );
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": descriptor_json(&config_desc),
        "layers": layer_descs,
    });
    let manifest_desc = write_blob(
        layout,
        "application/vnd.oci.image.manifest.v1+json",
        &serde_json::to_vec(&manifest).unwrap(),
    );
    (manifest_desc, config_desc.digest)
}

/// Writes an index blob over platform manifests: `(descriptor, arch)`.
pub(crate) fn write_platform_index(layout: &Path, manifests: &[(Descriptor, &str)]) -> Descriptor {
    let entries: Vec<_> = manifests
        .iter()
        .map(|(d, arch)| {
            let mut v = descriptor_json(d);
            v["platform"] = serde_json::json!({"architecture": arch, "os": "linux"});
            v
        })
        .collect();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": entries,
    });
    write_blob(
        layout,
        "application/vnd.oci.image.index.v1+json",
        &serde_json::to_vec(&index).unwrap(),
    )
}

/// Writes `index.json` and `oci-layout`, naming each entry by a tag.
pub(crate) fn write_layout_index(layout: &Path, entries: &[(Descriptor, &str)]) {
    let manifests: Vec<_> = entries
        .iter()
        .map(|(d, tag)| {
            let mut v = descriptor_json(d);
            v["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": tag});
            v
        })
        .collect();
    let index = serde_json::json!({"schemaVersion": 2, "manifests": manifests});
    std::fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    std::fs::write(
        layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
}

/// A `security.capability` value granting cap_net_raw, effective
/// (struct vfs_cap_data, revision 2).
pub(crate) fn net_raw_capability() -> Vec<u8> {
    let mut v = Vec::new();
    v.extend(0x0200_0001u32.to_le_bytes());
    v.extend((1u32 << 13).to_le_bytes());
    v.extend(0u32.to_le_bytes());
    v.extend(0u32.to_le_bytes());
    v.extend(0u32.to_le_bytes());
    v
}

/// The main test image: three layers (gzip, zstd, plain) with whiteouts, an
/// opaque directory, modes, owners, setuid, symlinks, hard links within and
/// across layers, xattrs, a FIFO and a device node.
pub(crate) fn sample_layers(second: Compression) -> Vec<Layer> {
    let capability = net_raw_capability();
    let layer1 = LayerTar::new(M1)
        .dir("./", 0o755, (0, 0))
        .dir("bin/", 0o755, (0, 0))
        .file("bin/tool", "tool v1", 0o755, (0, 0))
        .file("bin/su", "su", 0o4755, (0, 0))
        .file_xattrs(
            "bin/ping",
            "ping",
            0o755,
            &[("security.capability", &capability)],
        )
        .dir("etc/", 0o755, (0, 0))
        .file_xattrs("etc/config", "v1", 0o644, &[("user.note", b"hello")])
        .file("etc/old", "old", 0o644, (0, 0))
        .dir("etc/app/", 0o750, (1000, 1000))
        .file("etc/app/a.txt", "a", 0o640, (1000, 1000))
        .file("etc/app/b.txt", "b", 0o640, (1000, 1000))
        .dir("home/", 0o755, (0, 0))
        .dir("home/user/", 0o700, (1000, 1000))
        .file("home/user/notes", "n", 0o600, (1000, 1000))
        .dir("lib/", 0o755, (0, 0))
        .file("lib/libx.so.1", "elf", 0o755, (0, 0))
        .symlink("lib/libx.so", "libx.so.1")
        .symlink("lib/abs", "/etc/config")
        .dir("data/", 0o755, (0, 0))
        .file("data/hard1", "shared", 0o644, (0, 0))
        .hardlink("data/hard2", "data/hard1")
        .dir("usr/", 0o755, (0, 0))
        .file("usr/share/doc/readme", "docs", 0o644, (0, 0))
        .dir("run/", 0o755, (0, 0))
        .fifo("run/fifo", 0o620)
        .dir("dev/", 0o755, (0, 0))
        .char_device("dev/null")
        .finish();
    let layer2 = LayerTar::new(M2)
        .whiteout("etc/.wh.old")
        .whiteout("etc/app/.wh..wh..opq")
        .file("etc/app/c.txt", "c", 0o644, (1000, 1000))
        .file("etc/config", "v2", 0o600, (1000, 1000))
        .symlink("bin/tool", "tool2")
        .file("bin/tool2", "tool v2", 0o755, (0, 0))
        .hardlink("data/hard3", "data/hard1")
        .dir("lib/", 0o711, (0, 0))
        .file("usr/local/bin/x", "x", 0o755, (0, 0))
        .whiteout("home/.wh.user")
        .finish();
    let layer3 = LayerTar::new(M2)
        .dir("srv/", 0o775, (1000, 1000))
        .file("srv/app.py", "print('hi')", 0o644, (1000, 1000))
        .finish();
    vec![
        Layer {
            tar: layer1,
            compression: Compression::Gzip,
        },
        Layer {
            tar: layer2,
            compression: second,
        },
        Layer {
            tar: layer3,
            compression: Compression::None,
        },
    ]
}

/// What `sample_layers` must flatten to (from `listing`).
pub(crate) const SAMPLE_TREE: &str = "\
/ dir 755 0:0
/bin dir 755 0:0
/bin/ping file 755 0:0 \"ping\" security.capability=0100000200200000000000000000000000000000
/bin/su file 4755 0:0 \"su\"
/bin/tool link -> tool2
/bin/tool2 file 755 0:0 \"tool v2\"
/data dir 755 0:0
/data/hard1 file 644 0:0 \"shared\" #1
/data/hard2 file 644 0:0 \"shared\" #1
/data/hard3 file 644 0:0 \"shared\" #1
/dev dir 755 0:0
/etc dir 755 0:0
/etc/app dir 750 1000:1000
/etc/app/c.txt file 644 1000:1000 \"c\"
/etc/config file 600 1000:1000 \"v2\"
/home dir 755 0:0
/lib dir 711 0:0
/lib/abs link -> /etc/config
/lib/libx.so link -> libx.so.1
/lib/libx.so.1 file 755 0:0 \"elf\"
/run dir 755 0:0
/run/fifo fifo 620 0:0
/srv dir 775 1000:1000
/srv/app.py file 644 1000:1000 \"print('hi')\"
/usr dir 755 0:0
/usr/local dir 755 0:0
/usr/local/bin dir 755 0:0
/usr/local/bin/x file 755 0:0 \"x\"
/usr/share dir 755 0:0
/usr/share/doc dir 755 0:0
/usr/share/doc/readme file 644 0:0 \"docs\"
";

/// One line per entry: path, type, mode, owner, then content, link target,
/// hard link group (`#n`, numbered in order of appearance) and xattrs.
pub(crate) fn listing(root: &Path) -> String {
    let mut out = String::new();
    let mut inodes: HashMap<u64, usize> = HashMap::new();
    let mut counts: HashMap<u64, usize> = HashMap::new();
    let mut paths = Vec::new();
    collect(root, Path::new("/"), &mut paths);
    for (_, meta) in &paths {
        if meta.is_file() {
            *counts.entry(meta.ino()).or_default() += 1;
        }
    }
    for (rel, meta) in &paths {
        let full = root.join(rel.strip_prefix("/").unwrap());
        let ft = meta.file_type();
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_symlink() {
            "link"
        } else if ft.is_fifo() {
            "fifo"
        } else if ft.is_file() {
            "file"
        } else {
            "other"
        };
        if ft.is_symlink() {
            let target = std::fs::read_link(&full).unwrap();
            out.push_str(&format!("{} link -> {}\n", rel.display(), target.display()));
            continue;
        }
        out.push_str(&format!(
            "{} {kind} {:o} {}:{}",
            rel.display(),
            meta.mode() & 0o7777,
            meta.uid(),
            meta.gid()
        ));
        if ft.is_file() {
            let content = std::fs::read(&full).unwrap();
            out.push_str(&format!(" {:?}", String::from_utf8_lossy(&content)));
            if counts[&meta.ino()] > 1 {
                let next = inodes.len() + 1;
                let group = *inodes.entry(meta.ino()).or_insert(next);
                out.push_str(&format!(" #{group}"));
            }
        }
        for (name, value) in xattrs(&full) {
            out.push_str(&format!(" {name}={}", hex::encode(value)));
        }
        out.push('\n');
    }
    out
}

fn collect(root: &Path, rel: &Path, out: &mut Vec<(PathBuf, std::fs::Metadata)>) {
    let full = root.join(rel.strip_prefix("/").unwrap());
    let meta = std::fs::symlink_metadata(&full).unwrap();
    let is_dir = meta.is_dir();
    out.push((rel.to_owned(), meta));
    if is_dir {
        let mut names: Vec<_> = std::fs::read_dir(&full)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for name in names {
            collect(root, &rel.join(name), out);
        }
    }
}

/// The xattrs of a file (not following symlinks), sorted.
pub(crate) fn xattrs(path: &Path) -> Vec<(String, Vec<u8>)> {
    let mut names = vec![0u8; 65536];
    let Ok(len) = rustix::fs::llistxattr(path, &mut names[..]) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for name in names[..len].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let mut value = vec![0u8; 65536];
        let n = rustix::fs::lgetxattr(path, OsStr::from_bytes(name), &mut value[..]).unwrap();
        out.push((
            String::from_utf8_lossy(name).into_owned(),
            value[..n].to_vec(),
        ));
    }
    out.sort();
    out
}

pub(crate) fn mtime(path: &Path) -> u64 {
    std::fs::symlink_metadata(path).unwrap().mtime() as u64
}

/// Collects progress events for later checks.
#[derive(Clone, Default)]
pub(crate) struct Events(Arc<Mutex<Vec<Progress>>>);

impl Events {
    pub(crate) fn sink(&self) -> impl Fn(&Progress) + Send + Sync + 'static {
        let events = self.0.clone();
        move |p: &Progress| events.lock().unwrap().push(p.clone())
    }

    pub(crate) fn all(&self) -> Vec<Progress> {
        self.0.lock().unwrap().clone()
    }

    pub(crate) fn count(&self, pred: impl Fn(&Progress) -> bool) -> usize {
        self.all().iter().filter(|p| pred(p)).count()
    }
}

fn have(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// `true` when the named programs exist. Otherwise the test is skipped
/// with the reason, or fails under `COVE_TEST_STRICT=1` (`cove-testenv`).
pub(crate) fn tools(programs: &[&str]) -> bool {
    let missing: Vec<&str> = programs.iter().copied().filter(|p| !have(p)).collect();
    if missing.is_empty() {
        return true;
    }
    cove_testenv::missing(&format!(
        "missing {} (apt-get install docker-registry skopeo apache2-utils)",
        missing.join(", ")
    ));
    false
}

/// Skips (or, under `COVE_TEST_STRICT=1`, fails) a test that needs root.
pub(crate) fn root() -> bool {
    cove_testenv::root("unpacking images")
}

/// A `docker-registry` (CNCF distribution) serving on a free loopback port
/// from its own temporary storage; killed (by PID) when dropped.
pub(crate) struct Registry {
    child: Child,
    pub port: u16,
    dir: tempfile::TempDir,
}

impl Registry {
    /// Starts a registry; with `user`, it requires that basic-auth login.
    pub(crate) fn start(user: Option<(&str, &str)>) -> Registry {
        let dir = scratch();
        let port = free_port();
        let mut config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n",
            dir.path().join("data").display()
        );
        if let Some((name, password)) = user {
            let out = Command::new("htpasswd")
                .args(["-Bbn", name, password])
                .output()
                .expect("run htpasswd");
            assert!(out.status.success(), "htpasswd failed");
            let htpasswd = dir.path().join("htpasswd");
            std::fs::write(&htpasswd, out.stdout).unwrap();
            config.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: cove-test\n    path: {}\n",
                htpasswd.display()
            ));
        }
        let config_path = dir.path().join("config.yml");
        std::fs::write(&config_path, config).unwrap();
        let log = std::fs::File::create(dir.path().join("registry.log")).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config_path)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start docker-registry");
        let registry = Registry { child, port, dir };
        // Wait until it listens; bounded, and not a timing assertion.
        for _ in 0..400 {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return registry;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("the registry did not start: {}", registry.log());
    }

    pub(crate) fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// Copies `oci:<layout>:<tag>` to `<this registry>/<repo>` with skopeo and
    /// returns the digest of the manifest as pushed (skopeo may rewrite it,
    /// e.g. compress a plain layer).
    pub(crate) fn push(&self, layout: &Path, tag: &str, repo: &str, extra: &[&str]) -> String {
        let dest = format!("docker://{}/{repo}", self.host());
        let digest_file = self.dir.path().join("pushed.digest");
        let digest_arg = format!("--digestfile={}", digest_file.display());
        let source = format!("oci:{}:{tag}", layout.display());
        let fixed = ["copy", "--dest-tls-verify=false", digest_arg.as_str()];
        skopeo(&[&fixed[..], extra, &[source.as_str(), dest.as_str()]].concat());
        std::fs::read_to_string(digest_file)
            .unwrap()
            .trim()
            .to_owned()
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn skopeo(args: &[&str]) {
    let out = Command::new("skopeo")
        .arg("--insecure-policy")
        .args(args)
        .output()
        .expect("run skopeo");
    assert!(
        out.status.success(),
        "skopeo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A loopback port nothing listens on right now.
pub(crate) fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}
