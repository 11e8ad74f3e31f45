//! Pulls from a real registry (Debian's `docker-registry`, the CNCF
//! distribution server) started on a free loopback port, with images built
//! here and pushed by skopeo. Nothing leaves the machine. Skips when the tools
//! are missing, except under COVE_TEST_STRICT=1 (`cove-testenv`), where they fail. Needs root.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use cove_images::{Credentials, ErrorKind, ImageStore, Progress};

fn ready() -> bool {
    root() && tools(&["docker-registry", "skopeo", "htpasswd"])
}

fn sample_layout(dir: &Path, second: Compression) -> (PathBuf, Descriptor) {
    let layout = dir.join(format!("layout-{second:?}"));
    let (manifest, _) = write_image(&layout, &sample_layers(second), "amd64");
    write_layout_index(&layout, &[(manifest.clone(), "v1")]);
    (layout, manifest)
}

#[tokio::test]
async fn pulls_oci_and_docker_v2_images_and_reuses_the_cache() {
    if !ready() {
        return;
    }
    let scratch = scratch();
    let registry = Registry::start(None);
    let (zstd_layout, _) = sample_layout(scratch.path(), Compression::Zstd);
    let (gzip_layout, _) = sample_layout(scratch.path(), Compression::Gzip);
    let pushed = registry.push(&zstd_layout, "v1", "test/sample:oci", &[]);
    registry.push(
        &gzip_layout,
        "v1",
        "test/sample:docker",
        &["--format", "v2s2"],
    );
    let store = ImageStore::new(scratch.path().join("cache"));

    let events = Events::default();
    let oci_ref = format!("{}/test/sample:oci", registry.host());
    let image = store.pull(&oci_ref, None, events.sink()).await.unwrap();
    assert_eq!(listing(&image.rootfs), SAMPLE_TREE);
    assert_eq!(image.manifest_digest.as_deref(), Some(pushed.as_str()));
    assert_eq!(image.config.user.as_deref(), Some("1000:1000"));
    assert_eq!(image.config.cmd, ["--serve", "8080"]);
    let all = events.all();
    assert_eq!(
        all[0],
        Progress::Resolving {
            reference: oci_ref.clone()
        }
    );
    assert!(
        matches!(all[1], Progress::Resolved { layers: 3, .. }),
        "{all:?}"
    );
    for layer in 1..=3 {
        let finished = all.iter().any(|p| {
            matches!(p, Progress::Downloading { layer: l, downloaded, total, .. } if *l == layer && downloaded == total)
        });
        assert!(finished, "layer {layer} finished downloading: {all:?}");
    }
    assert_eq!(events.count(|p| matches!(p, Progress::Unpacking { .. })), 3);
    assert!(matches!(
        all.last(),
        Some(Progress::Done { cached: false, .. })
    ));

    // Docker schema 2 media types (skopeo converted the manifest and config).
    let docker = store
        .pull(
            &format!("{}/test/sample:docker", registry.host()),
            None,
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(listing(&docker.rootfs), SAMPLE_TREE);

    // Pulled again: nothing downloaded or built.
    let again = Events::default();
    let second = store.pull(&oci_ref, None, again.sink()).await.unwrap();
    assert_eq!(second.rootfs, image.rootfs);
    assert_eq!(
        again.count(|p| matches!(
            p,
            Progress::Downloading { .. } | Progress::Unpacking { .. } | Progress::Assembling { .. }
        )),
        0
    );

    // By digest, once pulled, with the registry gone.
    drop(registry);
    let by_digest = format!("127.0.0.1:1/test/sample@{pushed}");
    let offline = store.pull(&by_digest, None, |_| {}).await.unwrap();
    assert_eq!(offline.rootfs, image.rootfs);
}

#[tokio::test]
async fn multi_arch_index_gives_linux_amd64() {
    if !ready() {
        return;
    }
    let scratch = scratch();
    let registry = Registry::start(None);
    let layout = scratch.path().join("layout");
    let marker = |arch: &str| {
        vec![Layer {
            tar: LayerTar::new(M1).file("arch", arch, 0o644, (0, 0)).finish(),
            compression: Compression::Gzip,
        }]
    };
    let (amd64, _) = write_image(&layout, &marker("amd64"), "amd64");
    let (arm64, _) = write_image(&layout, &marker("arm64"), "arm64");
    let multi = write_platform_index(
        &layout,
        &[(arm64.clone(), "arm64"), (amd64.clone(), "amd64")],
    );
    let arm_only = write_platform_index(&layout, &[(arm64, "arm64")]);
    write_layout_index(&layout, &[(multi.clone(), "multi"), (arm_only, "arm")]);
    registry.push(&layout, "multi", "test/multi:v1", &["--all"]);
    registry.push(&layout, "arm", "test/multi:arm", &["--all"]);
    let store = ImageStore::new(scratch.path().join("cache"));

    let image = store
        .pull(&format!("{}/test/multi:v1", registry.host()), None, |_| {})
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(image.rootfs.join("arch")).unwrap(),
        "amd64"
    );
    assert_eq!(
        image.manifest_digest.as_deref(),
        Some(amd64.digest.as_str())
    );

    // The index digest finds the image too.
    let by_index = store
        .pull(
            &format!("{}/test/multi@{}", registry.host(), multi.digest),
            None,
            |_| {},
        )
        .await
        .unwrap();
    assert_eq!(by_index.rootfs, image.rootfs);

    let err = store
        .pull(&format!("{}/test/multi:arm", registry.host()), None, |_| {})
        .await
        .unwrap_err();
    assert_eq!(
        (err.kind(), err.http_status()),
        (ErrorKind::Unsupported, 400),
        "{err}"
    );
    assert!(err.to_string().contains("linux/arm64"), "{err}");
}

#[tokio::test]
async fn unknown_tags_and_repositories_are_not_found() {
    if !ready() {
        return;
    }
    let scratch = scratch();
    let registry = Registry::start(None);
    let (layout, _) = sample_layout(scratch.path(), Compression::Gzip);
    registry.push(&layout, "v1", "test/sample:v1", &[]);
    let store = ImageStore::new(scratch.path().join("cache"));
    for reference in ["test/sample:nope", "missing/repo:v1"] {
        let full = format!("{}/{reference}", registry.host());
        let err = store.pull(&full, None, |_| {}).await.unwrap_err();
        assert_eq!(
            (err.kind(), err.http_status()),
            (ErrorKind::NotFound, 404),
            "{err}"
        );
        assert!(
            err.to_string().contains(&full),
            "the message names the image: {err}"
        );
    }
    let err = store
        .pull("UPPER/case:bad tag", None, |_| {})
        .await
        .unwrap_err();
    assert_eq!(
        (err.kind(), err.http_status()),
        (ErrorKind::BadReference, 400),
        "{err}"
    );
}

#[tokio::test]
async fn registry_with_basic_auth() {
    if !ready() {
        return;
    }
    let scratch = scratch();
    let registry = Registry::start(Some(("cove", "s3cret")));
    let (layout, _) = sample_layout(scratch.path(), Compression::Gzip);
    registry.push(
        &layout,
        "v1",
        "private/app:v1",
        &["--dest-creds", "cove:s3cret"],
    );
    let store = ImageStore::new(scratch.path().join("cache"));
    let reference = format!("{}/private/app:v1", registry.host());

    let err = store.pull(&reference, None, |_| {}).await.unwrap_err();
    assert_eq!(
        (err.kind(), err.http_status()),
        (ErrorKind::Unauthorized, 401),
        "{err}"
    );
    let wrong = Credentials {
        username: "cove".into(),
        password: "wrong".into(),
    };
    let err = store
        .pull(&reference, Some(&wrong), |_| {})
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unauthorized, "{err}");
    assert!(
        !format!("{wrong:?}").contains("wrong"),
        "Debug hides the password"
    );

    let right = Credentials {
        username: "cove".into(),
        password: "s3cret".into(),
    };
    let image = store.pull(&reference, Some(&right), |_| {}).await.unwrap();
    assert_eq!(listing(&image.rootfs), SAMPLE_TREE);
}

#[tokio::test]
async fn unreachable_registry() {
    if !root() {
        return;
    }
    let scratch = scratch();
    let store = ImageStore::new(scratch.path().join("cache"));
    let reference = format!("127.0.0.1:{}/test/app:v1", free_port());
    let err = store.pull(&reference, None, |_| {}).await.unwrap_err();
    assert_eq!(
        (err.kind(), err.http_status()),
        (ErrorKind::Unreachable, 502),
        "{err}"
    );
}

#[tokio::test]
async fn concurrent_pulls_download_and_build_once() {
    if !ready() {
        return;
    }
    let scratch = scratch();
    let registry = Registry::start(None);
    let (layout, _) = sample_layout(scratch.path(), Compression::Zstd);
    registry.push(&layout, "v1", "test/sample:v1", &[]);
    let reference = format!("{}/test/sample:v1", registry.host());
    let events = Events::default();
    let first = ImageStore::new(scratch.path().join("cache"));
    let second = ImageStore::new(scratch.path().join("cache"));
    let (a, b) = tokio::join!(
        first.pull(&reference, None, events.sink()),
        second.pull(&reference, None, events.sink())
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.rootfs, b.rootfs);
    assert_eq!(listing(&a.rootfs), SAMPLE_TREE);
    let all = events.all();
    for layer in 1..=3 {
        let starts = all
            .iter()
            .filter(|p| matches!(p, Progress::Downloading { layer: l, downloaded: 0, .. } if *l == layer))
            .count();
        assert_eq!(starts, 1, "layer {layer} downloads: {all:?}");
    }
    assert_eq!(events.count(|p| matches!(p, Progress::Unpacking { .. })), 3);
    assert_eq!(
        events.count(|p| matches!(p, Progress::Assembling { .. })),
        1
    );
}

#[tokio::test]
async fn a_hostile_layer_from_a_registry_is_refused() {
    if !ready() {
        return;
    }
    let scratch = scratch();
    let registry = Registry::start(None);
    let layout = scratch.path().join("layout");
    let layer = LayerTar::new(M1)
        .file("../../escape", "pwned", 0o644, (0, 0))
        .finish();
    let (manifest, _) = write_image(
        &layout,
        &[Layer {
            tar: layer,
            compression: Compression::Gzip,
        }],
        "amd64",
    );
    write_layout_index(&layout, &[(manifest, "v1")]);
    registry.push(&layout, "v1", "test/hostile:v1", &[]);
    let store = ImageStore::new(scratch.path().join("cache"));
    let err = store
        .pull(
            &format!("{}/test/hostile:v1", registry.host()),
            None,
            |_| {},
        )
        .await
        .unwrap_err();
    assert_eq!(err.http_status(), 422, "{err}");
    assert!(!scratch.path().join("escape").exists());
    assert!(!scratch.path().join("cache/escape").exists());
    assert!(!scratch.path().join("cache/oci/escape").exists());
}
