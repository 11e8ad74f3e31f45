//! Imports from OCI layouts (directory and tarball) and docker-save archives,
//! and what unpacking does with real-image features and with hostile layers.
//! Needs root (owners, setuid, file capabilities); the docker-archive test
//! also needs skopeo.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use common::*;
use cove_images::{ErrorKind, ImageConfig, ImageError, ImageStore, Progress, PulledImage};

fn sample_config() -> ImageConfig {
    ImageConfig {
        env: vec![
            "PATH=/usr/local/bin:/usr/bin:/bin".into(),
            "GREETING=hello world".into(),
        ],
        working_dir: Some("/srv".into()),
        user: Some("1000:1000".into()),
        entrypoint: vec!["/bin/tool".into()],
        cmd: vec!["--serve".into(), "8080".into()],
    }
}

/// Writes a one-image layout of `layers` tagged `v1`; returns its path and the image id.
fn layout_of(dir: &Path, layers: &[Layer]) -> (PathBuf, Descriptor, String) {
    let layout = dir.join("layout");
    let (manifest, id) = write_image(&layout, layers, "amd64");
    write_layout_index(&layout, &[(manifest.clone(), "v1")]);
    (layout, manifest, id)
}

fn import_layers(dir: &Path, layers: Vec<Layer>) -> Result<PulledImage, ImageError> {
    let (layout, _, _) = layout_of(dir, &layers);
    ImageStore::new(dir.join("cache")).import(&layout, None, |_| {})
}

fn plain(tar: Vec<u8>) -> Layer {
    Layer {
        tar,
        compression: Compression::None,
    }
}

#[test]
fn layout_import_gives_the_exact_tree() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let (layout, manifest, id) = layout_of(scratch.path(), &sample_layers(Compression::Zstd));
    let store = ImageStore::new(scratch.path().join("cache"));
    let events = Events::default();
    let image = store.import(&layout, None, events.sink()).unwrap();

    assert_eq!(image.id, id);
    assert_eq!(
        image.manifest_digest.as_deref(),
        Some(manifest.digest.as_str())
    );
    assert_eq!(listing(&image.rootfs), SAMPLE_TREE);
    assert_eq!(image.config, sample_config());
    // ping 4 + su 2 + tool2 7 + hard1 6 (three names, one inode) + c.txt 1 +
    // config 2 + libx.so.1 3 + app.py 11 + x 1 + readme 4
    assert_eq!(image.size_bytes, 41);

    // Times come from the highest layer that names an entry; directories a
    // layer only implies keep the time of the layer that named them.
    assert_eq!(mtime(&image.rootfs.join("etc/config")), M2);
    assert_eq!(mtime(&image.rootfs.join("bin/su")), M1);
    assert_eq!(mtime(&image.rootfs.join("lib")), M2);
    assert_eq!(mtime(&image.rootfs.join("etc")), M1);
    assert_eq!(mtime(&image.rootfs.join("usr")), M1);
    assert_eq!(mtime(&image.rootfs.join("srv")), M2);

    let all = events.all();
    assert_eq!(
        all[0],
        Progress::Resolving {
            reference: layout.display().to_string()
        }
    );
    assert!(
        matches!(all[1], Progress::Resolved { layers: 3, .. }),
        "{all:?}"
    );
    assert_eq!(events.count(|p| matches!(p, Progress::Unpacking { .. })), 3);
    assert_eq!(
        events.count(|p| matches!(p, Progress::Assembling { layers: 3 })),
        1
    );
    assert!(matches!(
        all.last(),
        Some(Progress::Done {
            cached: false,
            size_bytes: 41,
            ..
        })
    ));

    // A second import builds nothing.
    let again = Events::default();
    let second = store.import(&layout, Some("v1"), again.sink()).unwrap();
    assert_eq!(second.rootfs, image.rootfs);
    assert_eq!(
        again.count(|p| matches!(p, Progress::Unpacking { .. } | Progress::Assembling { .. })),
        0
    );
    assert!(matches!(
        again.all().last(),
        Some(Progress::Done { cached: true, .. })
    ));

    // Found again by id, without a source.
    let by_id = store.image(&id).unwrap().unwrap();
    assert_eq!((by_id.rootfs, by_id.config), (image.rootfs, image.config));
}

#[test]
fn layout_tarball_import_matches_the_directory() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let (layout, _, id) = layout_of(scratch.path(), &sample_layers(Compression::Gzip));
    let tarball = scratch.path().join("layout.tar");
    let mut builder = tar::Builder::new(std::fs::File::create(&tarball).unwrap());
    builder.append_dir_all(".", &layout).unwrap();
    builder.finish().unwrap();
    drop(builder);

    let store = ImageStore::new(scratch.path().join("cache"));
    let image = store.import(&tarball, None, |_| {}).unwrap();
    assert_eq!(image.id, id);
    assert_eq!(listing(&image.rootfs), SAMPLE_TREE);
}

#[test]
fn docker_archive_import_shares_the_unpacked_layers() {
    if !root() || !tools(&["skopeo"]) {
        return;
    }
    let scratch = scratch();
    let (layout, _, _) = layout_of(scratch.path(), &sample_layers(Compression::Gzip));
    let archive = scratch.path().join("saved.tar");
    skopeo(&[
        "copy",
        &format!("oci:{}:v1", layout.display()),
        &format!("docker-archive:{}:example/app:v1", archive.display()),
    ]);
    let store = ImageStore::new(scratch.path().join("cache"));
    let from_layout = store.import(&layout, None, |_| {}).unwrap();

    let events = Events::default();
    let image = store
        .import(&archive, Some("example/app:v1"), events.sink())
        .unwrap();
    assert_eq!(image.manifest_digest, None);
    assert_eq!(listing(&image.rootfs), SAMPLE_TREE);
    assert_eq!(image.config, sample_config());
    // docker-archive layers are the same tars uncompressed: same diff ids, so
    // nothing is unpacked again.
    assert_eq!(events.count(|p| matches!(p, Progress::Unpacking { .. })), 0);
    let _ = from_layout;

    let wrong = store
        .import(&archive, Some("other:v9"), |_| {})
        .unwrap_err();
    assert_eq!(wrong.kind(), ErrorKind::NotFound, "{wrong}");
}

#[test]
fn concurrent_imports_build_once() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let (layout, _, _) = layout_of(scratch.path(), &sample_layers(Compression::Zstd));
    let events = Events::default();
    let results: Vec<PulledImage> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                // Separate stores on one directory, as two server processes would be.
                let store = ImageStore::new(scratch.path().join("cache"));
                let (layout, sink) = (layout.clone(), events.sink());
                s.spawn(move || store.import(&layout, None, sink).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results[0], results[1]);
    assert_eq!(events.count(|p| matches!(p, Progress::Unpacking { .. })), 3);
    assert_eq!(
        events.count(|p| matches!(p, Progress::Assembling { .. })),
        1
    );
    assert_eq!(listing(&results[0].rootfs), SAMPLE_TREE);
}

#[test]
fn layout_with_several_images_and_platforms() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let layout = scratch.path().join("layout");
    let marker = |arch: &str| {
        vec![plain(
            LayerTar::new(M1).file("arch", arch, 0o644, (0, 0)).finish(),
        )]
    };
    let (amd64, _) = write_image(&layout, &marker("amd64"), "amd64");
    let (arm64, _) = write_image(&layout, &marker("arm64"), "arm64");
    let multi = write_platform_index(&layout, &[(arm64.clone(), "arm64"), (amd64, "amd64")]);
    let arm_only = write_platform_index(&layout, &[(arm64, "arm64")]);
    write_layout_index(
        &layout,
        &[(multi.clone(), "multi"), (arm_only.clone(), "arm")],
    );
    let store = ImageStore::new(scratch.path().join("cache"));

    // One linux/amd64 image in all: no tag needed.
    let image = store.import(&layout, None, |_| {}).unwrap();
    assert_eq!(
        std::fs::read_to_string(image.rootfs.join("arch")).unwrap(),
        "amd64"
    );

    // Two: the caller must choose.
    let (other, _) = write_image(&layout, &marker("other"), "amd64");
    write_layout_index(
        &layout,
        &[(multi, "multi"), (arm_only, "arm"), (other, "other")],
    );
    let err = store.import(&layout, None, |_| {}).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BadReference, "{err}");
    assert!(err.to_string().contains("multi, arm, other"), "{err}");
    let image = store.import(&layout, Some("multi"), |_| {}).unwrap();
    assert_eq!(
        std::fs::read_to_string(image.rootfs.join("arch")).unwrap(),
        "amd64"
    );
    let err = store.import(&layout, Some("arm"), |_| {}).unwrap_err();
    assert_eq!(
        (err.kind(), err.http_status()),
        (ErrorKind::Unsupported, 400),
        "{err}"
    );
    let err = store.import(&layout, Some("nope"), |_| {}).unwrap_err();
    assert_eq!(
        (err.kind(), err.http_status()),
        (ErrorKind::NotFound, 404),
        "{err}"
    );
}

#[test]
fn corrupt_blobs_are_refused() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let layers = sample_layers(Compression::Gzip);
    let (layout, _, _) = layout_of(scratch.path(), &layers);
    // Replace the last (plain) layer blob with other bytes under the same name.
    let last = sha256(&layers[2].tar);
    let blob = layout
        .join("blobs/sha256")
        .join(last.trim_start_matches("sha256:"));
    std::fs::write(
        &blob,
        LayerTar::new(M1).file("x", "other", 0o644, (0, 0)).finish(),
    )
    .unwrap();

    let store = ImageStore::new(scratch.path().join("cache"));
    let err = store.import(&layout, None, |_| {}).unwrap_err();
    assert_eq!(
        (err.kind(), err.http_status()),
        (ErrorKind::InvalidImage, 422),
        "{err}"
    );
    assert!(store.image(&sha256(b"")).unwrap().is_none());
    // No image was assembled and no broken layer was kept.
    assert_eq!(
        std::fs::read_dir(scratch.path().join("cache/oci/images/sha256"))
            .map(|d| d.count())
            .unwrap_or(0),
        0
    );
    assert!(!scratch
        .path()
        .join("cache/oci/layers/sha256")
        .join(last.trim_start_matches("sha256:"))
        .exists());
}

#[test]
fn truncated_gzip_layer_is_refused() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let layers = vec![Layer {
        tar: LayerTar::new(M1)
            .file("big", &"x".repeat(100_000), 0o644, (0, 0))
            .finish(),
        compression: Compression::Gzip,
    }];
    let (layout, manifest, _) = layout_of(scratch.path(), &layers);
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            layout
                .join("blobs/sha256")
                .join(manifest.digest.trim_start_matches("sha256:")),
        )
        .unwrap(),
    )
    .unwrap();
    let layer_digest = manifest["layers"][0]["digest"].as_str().unwrap();
    let path = layout
        .join("blobs/sha256")
        .join(layer_digest.trim_start_matches("sha256:"));
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = ImageStore::new(scratch.path().join("cache"))
        .import(&layout, None, |_| {})
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidImage, "{err}");
}

/// Every file under `dir`, for checking that nothing appeared.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.symlink_metadata().unwrap().is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[test]
fn dot_dot_entries_are_refused() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let layer = LayerTar::new(M1)
        .file("ok", "fine", 0o644, (0, 0))
        .file("../escape", "pwned", 0o644, (0, 0))
        .finish();
    let err = import_layers(scratch.path(), vec![plain(layer)]).unwrap_err();
    assert!(matches!(err, ImageError::UnsafeLayer { .. }), "{err}");
    assert_eq!(err.http_status(), 422);
    let escaped: Vec<_> = files_under(scratch.path())
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n == "escape"))
        .collect();
    assert!(escaped.is_empty(), "{escaped:?}");

    let scratch = common::scratch();
    let layer = LayerTar::new(M1)
        .file("target", "t", 0o644, (0, 0))
        .hardlink("stolen", "../../../../../../etc/passwd")
        .finish();
    let err = import_layers(scratch.path(), vec![plain(layer)]).unwrap_err();
    assert!(matches!(err, ImageError::UnsafeLayer { .. }), "{err}");
}

#[test]
fn a_symlink_in_a_lower_layer_is_never_written_through() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let host = scratch.path().join("host");
    std::fs::create_dir(&host).unwrap();
    let host_str = host.to_str().unwrap();
    let layer1 = LayerTar::new(M1)
        .symlink("evil", host_str)
        .symlink("up", "../../../../../../../../")
        .finish();
    let layer2 = LayerTar::new(M1)
        .file("evil/pwned", "pwned", 0o644, (0, 0))
        .file("up/tmp-pwned", "pwned", 0o644, (0, 0))
        .finish();
    let image = import_layers(scratch.path(), vec![plain(layer1), plain(layer2)]).unwrap();
    // Contained: as overlayfs would show it, the directory replaces the symlink.
    assert_eq!(
        listing(&image.rootfs),
        "/ dir 755 0:0\n/evil dir 755 0:0\n/evil/pwned file 644 0:0 \"pwned\"\n/up dir 755 0:0\n/up/tmp-pwned file 644 0:0 \"pwned\"\n"
    );
    assert!(files_under(&host).is_empty());
    assert!(!Path::new("/tmp-pwned").exists());
}

#[test]
fn a_symlink_in_the_same_layer_is_refused_as_a_parent() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let host = scratch.path().join("host");
    std::fs::create_dir(&host).unwrap();
    let layer = LayerTar::new(M1)
        .symlink("link", host.to_str().unwrap())
        .file("link/pwned", "pwned", 0o644, (0, 0))
        .finish();
    let err = import_layers(scratch.path(), vec![plain(layer)]).unwrap_err();
    assert!(matches!(err, ImageError::UnsafeLayer { .. }), "{err}");
    assert!(files_under(&host).is_empty());
}

#[test]
fn a_hard_link_through_a_lower_symlink_is_refused() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let host = scratch.path().join("host");
    std::fs::create_dir(&host).unwrap();
    std::fs::write(host.join("secret"), "secret").unwrap();
    let layer1 = LayerTar::new(M1)
        .symlink("sym", host.to_str().unwrap())
        .finish();
    let layer2 = LayerTar::new(M1).hardlink("grab", "sym/secret").finish();
    let err = import_layers(scratch.path(), vec![plain(layer1), plain(layer2)]).unwrap_err();
    assert!(matches!(err, ImageError::UnsafeLayer { .. }), "{err}");
    assert_eq!(std::fs::metadata(host.join("secret")).unwrap().nlink(), 1);
}

#[test]
fn absolute_names_devices_and_overlay_xattrs_stay_inside() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let layer = LayerTar::new(M1)
        .file("/abs/file", "inside", 0o644, (0, 0))
        .file_xattrs(
            "hidden",
            "h",
            0o644,
            &[("trusted.overlay.opaque", b"y"), ("user.kept", b"1")],
        )
        .char_device("dev/sda")
        .finish();
    let image = import_layers(scratch.path(), vec![plain(layer)]).unwrap();
    assert_eq!(
        listing(&image.rootfs),
        "/ dir 755 0:0\n/abs dir 755 0:0\n/abs/file file 644 0:0 \"inside\"\n/dev dir 755 0:0\n/hidden file 644 0:0 \"h\" user.kept=31\n"
    );
}

#[test]
fn whiteouts_of_dot_dot_are_refused() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let layer1 = LayerTar::new(M1)
        .file("sub/keep", "k", 0o644, (0, 0))
        .finish();
    let layer2 = LayerTar::new(M1).whiteout("sub/.wh...").finish();
    let err = import_layers(scratch.path(), vec![plain(layer1), plain(layer2)]).unwrap_err();
    assert!(matches!(err, ImageError::UnsafeLayer { .. }), "{err}");
    // The layer cache beside the image is intact.
    assert!(
        scratch
            .path()
            .join("cache/oci/layers/sha256")
            .read_dir()
            .unwrap()
            .count()
            >= 2
    );
}

#[test]
fn a_later_entry_replaces_a_cross_layer_hard_link() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let layer1 = LayerTar::new(M1).file("a", "A", 0o644, (0, 0)).finish();
    let layer2 = LayerTar::new(M1)
        .hardlink("b", "a")
        .file("b", "B", 0o600, (0, 0))
        .hardlink("c", "a")
        .finish();
    let image = import_layers(scratch.path(), vec![plain(layer1), plain(layer2)]).unwrap();
    assert_eq!(
        listing(&image.rootfs),
        "/ dir 755 0:0\n/a file 644 0:0 \"A\" #1\n/b file 600 0:0 \"B\"\n/c file 644 0:0 \"A\" #1\n"
    );
}

/// Copies a layout directory (plain files only).
fn copy_layout(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_dir() {
            copy_layout(&entry.path(), &to.join(entry.file_name()));
        } else {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// Attack: an API client names a host path for the server to import
/// (`/etc`, `../..`, or a symlink planted in the import directory, even one
/// inside a layout directory) to make the server read what it should not.
/// `import_beneath` reads only inside its directory: the same layout is
/// imported when it lies there, and refused by any way out.
#[test]
fn imports_beneath_a_directory_never_leave_it() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let import = scratch.path().join("import");
    let (layout, _, id) = layout_of(&import, &sample_layers(Compression::Gzip));
    let store = ImageStore::new(scratch.path().join("cache"));
    let image = store
        .import_beneath(&import, Path::new("layout"), None, |_| {})
        .unwrap();
    assert_eq!(image.id, id);
    let again = store
        .import_beneath(&import, &layout, None, |_| {})
        .unwrap();
    assert_eq!(again.id, id);

    let outside = scratch.path().join("outside");
    copy_layout(&layout, &outside.join("layout"));
    std::os::unix::fs::symlink(outside.join("layout"), import.join("link")).unwrap();
    std::fs::create_dir_all(import.join("dir")).unwrap();
    std::os::unix::fs::symlink(&outside, import.join("dir/up")).unwrap();
    for path in [
        PathBuf::from("link"),
        PathBuf::from("../outside/layout"),
        PathBuf::from("dir/up/layout"),
        outside.join("layout"),
        import.join("link"),
        PathBuf::from("/etc"),
    ] {
        let error = store
            .import_beneath(&import, &path, None, |_| {})
            .unwrap_err();
        assert!(
            matches!(error, ImageError::OutsideRoot { .. }),
            "{}: {error}",
            path.display()
        );
        assert_eq!(error.kind(), ErrorKind::BadReference);
        assert!(
            error.to_string().contains(&import.display().to_string()),
            "{error}"
        );
    }

    // A layout inside whose index is a link to one outside: its members
    // are opened beneath the directory too, so the link is not followed.
    let trap = import.join("trap");
    copy_layout(&layout, &trap);
    std::fs::remove_file(trap.join("index.json")).unwrap();
    std::os::unix::fs::symlink(outside.join("layout/index.json"), trap.join("index.json")).unwrap();
    let error = store
        .import_beneath(&import, Path::new("trap"), None, |_| {})
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unsupported, "{error}");
}
