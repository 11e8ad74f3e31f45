//! A hostile registry that sends more bytes than a blob's descriptor
//! declares: the pull stops at the declared size and says which blob, how
//! many bytes were expected and which registry sent more. The registry is a
//! few lines of HTTP served by the test on loopback, so it can lie.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cove_images::{ErrorKind, ImageStore};
use sha2::{Digest, Sha256};

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One blob as the fake registry serves it.
struct Blob {
    digest: String,
    body: Arc<Vec<u8>>,
}

/// A registry on a free loopback port serving one manifest (`test/img:v1`)
/// and its blobs, each answered with whatever body the test gave, whatever
/// the manifest says. Counts the blob bytes it managed to send.
struct FakeRegistry {
    host: String,
    sent: Arc<AtomicU64>,
}

impl FakeRegistry {
    fn start(manifest: Vec<u8>, blobs: Vec<Blob>) -> FakeRegistry {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let host = listener.local_addr().unwrap().to_string();
        let sent = Arc::new(AtomicU64::new(0));
        let counter = sent.clone();
        let manifest = Arc::new(manifest);
        let blobs = Arc::new(blobs);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let manifest = manifest.clone();
                let blobs = blobs.clone();
                let counter = counter.clone();
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().unwrap());
                    let mut request_line = String::new();
                    if reader.read_line(&mut request_line).is_err() {
                        return;
                    }
                    loop {
                        let mut header = String::new();
                        match reader.read_line(&mut header) {
                            Ok(0) | Err(_) => return,
                            Ok(_) if header == "\r\n" => break,
                            Ok(_) => {}
                        }
                    }
                    let path = request_line.split(' ').nth(1).unwrap_or("").to_owned();
                    let (content_type, body) = if path.contains("/manifests/") {
                        ("application/vnd.oci.image.manifest.v1+json", manifest)
                    } else if let Some(blob) = blobs.iter().find(|b| path.ends_with(&b.digest)) {
                        ("application/octet-stream", blob.body.clone())
                    } else if path == "/v2/" {
                        ("application/json", Arc::new(b"{}".to_vec()))
                    } else {
                        let _ = stream.write_all(
                            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                        );
                        return;
                    };
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    if stream.write_all(head.as_bytes()).is_err() {
                        return;
                    }
                    for chunk in body.chunks(64 * 1024) {
                        if stream.write_all(chunk).is_err() {
                            return;
                        }
                        if path.contains("/blobs/") {
                            counter.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        FakeRegistry { host, sent }
    }
}

/// A manifest naming `config` (declared `config_size` bytes) and one gzip
/// layer (declared `layer_size` bytes).
fn manifest(config: &str, config_size: usize, layer: &str, layer_size: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config,
            "size": config_size,
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": layer,
            "size": layer_size,
        }],
    }))
    .unwrap()
}

fn config_json(diff_id: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {},
        "rootfs": { "type": "layers", "diff_ids": [diff_id] },
    }))
    .unwrap()
}

const TEN_MIB: usize = 10 << 20;

/// Attack: a layer declared as 1000 bytes whose registry sends 10 MiB (it
/// could send without end, filling the blob cache's disk). Before, the
/// whole body was written to disk and only then refused as a digest
/// mismatch; now the download stops past 1000 bytes, naming the layer, the
/// declared size and the registry.
#[tokio::test]
async fn a_layer_longer_than_its_descriptor_is_cut_off() {
    let scratch = tempfile::tempdir().unwrap();
    let layer_body = vec![0u8; TEN_MIB];
    let layer_digest = sha256(&layer_body[..1000]);
    let config = config_json(&sha256(b"diff"));
    let config_digest = sha256(&config);
    let registry = FakeRegistry::start(
        manifest(&config_digest, config.len(), &layer_digest, 1000),
        vec![
            Blob {
                digest: config_digest.clone(),
                body: Arc::new(config),
            },
            Blob {
                digest: layer_digest.clone(),
                body: Arc::new(layer_body),
            },
        ],
    );
    let store = ImageStore::new(scratch.path().join("cache"));
    let reference = format!("{}/test/img:v1", registry.host);
    let error = tokio::time::timeout(
        Duration::from_secs(60),
        store.pull(&reference, None, |_| {}),
    )
    .await
    .expect("the pull ends")
    .expect_err("a layer longer than declared is refused");
    assert_eq!(error.kind(), ErrorKind::InvalidImage, "{error}");
    let message = error.to_string();
    for part in [layer_digest.as_str(), "1000 bytes", registry.host.as_str()] {
        assert!(message.contains(part), "{message:?} names {part}");
    }
    let partial: Vec<_> = std::fs::read_dir(scratch.path().join("cache/oci/blobs/sha256"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        partial.is_empty(),
        "nothing of the blob is kept: {partial:?}"
    );
}

/// Attack: an image configuration (parsed in memory) declared as a few
/// bytes and sent as 10 MiB; before, all of it was read into memory. Now it
/// is refused at the declared size, and a configuration that declares more
/// than `MAX_CONFIG_BYTES` is refused before any byte is fetched.
#[tokio::test]
async fn a_configuration_longer_than_declared_or_than_the_cap_is_refused() {
    let scratch = tempfile::tempdir().unwrap();
    let config_body = vec![b' '; TEN_MIB];
    let config_digest = sha256(b"small");
    let layer_digest = sha256(b"layer");
    let registry = FakeRegistry::start(
        manifest(&config_digest, 5, &layer_digest, 10),
        vec![Blob {
            digest: config_digest.clone(),
            body: Arc::new(config_body.clone()),
        }],
    );
    let store = ImageStore::new(scratch.path().join("cache"));
    let reference = format!("{}/test/img:v1", registry.host);
    let error = store.pull(&reference, None, |_| {}).await.unwrap_err();
    let message = error.to_string();
    for part in [
        config_digest.as_str(),
        "5 bytes",
        registry.host.as_str(),
        "configuration",
    ] {
        assert!(message.contains(part), "{message:?} names {part}");
    }

    // Declared above the cap: refused without a download.
    let huge = cove_images::MAX_CONFIG_BYTES as usize + 1;
    let registry = FakeRegistry::start(
        manifest(&config_digest, huge, &layer_digest, 10),
        vec![Blob {
            digest: config_digest.clone(),
            body: Arc::new(config_body),
        }],
    );
    let reference = format!("{}/test/img:v1", registry.host);
    let error = store.pull(&reference, None, |_| {}).await.unwrap_err();
    let message = error.to_string();
    assert!(message.contains(&huge.to_string()), "{message}");
    assert_eq!(registry.sent.load(Ordering::Relaxed), 0, "{message}");
}
