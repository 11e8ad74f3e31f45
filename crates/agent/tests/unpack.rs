//! `POST /cove/unpack`: the image builder's `COPY`, spoken to a real agent.
//! The agent unpacks at its `/`, so entries are named after a temporary
//! directory's path below `/`.

mod common;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use common::Agent;
use hyper::{Method, StatusCode};

/// A temporary directory and its path relative to `/`, as entries name it.
struct Target {
    dir: tempfile::TempDir,
    relative: PathBuf,
}

impl Target {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let relative = dir.path().strip_prefix("/").unwrap().to_path_buf();
        Self { dir, relative }
    }

    fn entry(&self, name: &str) -> PathBuf {
        self.relative.join(name)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// A header owned by the test's own user.
fn header(kind: tar::EntryType) -> tar::Header {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(kind);
    header.set_uid(nix::unistd::Uid::effective().as_raw().into());
    header.set_gid(nix::unistd::Gid::effective().as_raw().into());
    header.set_mode(0o777);
    header.set_mtime(1_600_000_000);
    header.set_size(0);
    header
}

fn file(builder: &mut tar::Builder<Vec<u8>>, name: &Path, mode: u32, data: &[u8]) {
    let mut header = header(tar::EntryType::Regular);
    header.set_mode(mode);
    header.set_size(data.len() as u64);
    builder.append_data(&mut header, name, data).unwrap();
}

async fn post(agent: &Agent, query: &str, body: Vec<u8>) -> common::Reply {
    agent
        .request(
            Method::POST,
            &format!("/cove/unpack{query}"),
            Some("application/x-tar"),
            body,
        )
        .await
}

#[tokio::test]
async fn a_stream_lands_under_the_root_and_the_answer_counts_its_entries() {
    let agent = Agent::start();
    let target = Target::new();
    let mut builder = tar::Builder::new(Vec::new());
    file(
        &mut builder,
        &target.entry("app/main.py"),
        0o640,
        b"print('hi')\n",
    );
    file(&mut builder, &target.entry("app/big"), 0o644, &[9; 3 << 20]);
    let mut header = header(tar::EntryType::Symlink);
    builder
        .append_link(&mut header, target.entry("app/link"), "main.py")
        .unwrap();
    let reply = post(&agent, "", builder.into_inner().unwrap()).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json(), serde_json::json!({ "entries": 3 }));

    let main = target.path("app/main.py");
    assert_eq!(std::fs::read(&main).unwrap(), b"print('hi')\n");
    let meta = std::fs::metadata(&main).unwrap();
    assert_eq!(meta.permissions().mode() & 0o7777, 0o640);
    assert_eq!(meta.mtime(), 1_600_000_000);
    assert_eq!(
        std::fs::read(target.path("app/big")).unwrap().len(),
        3 << 20
    );
    assert_eq!(
        std::fs::read_link(target.path("app/link")).unwrap(),
        Path::new("main.py")
    );
}

#[tokio::test]
async fn escaping_entries_and_unknown_owners_are_400_naming_them() {
    let agent = Agent::start();
    let target = Target::new();
    let escaping = format!("{}/../escaped", target.relative.display());
    let mut header = header(tar::EntryType::Regular);
    header.set_mode(0o644);
    header.as_old_mut().name[..escaping.len()].copy_from_slice(escaping.as_bytes());
    header.set_cksum();
    let mut builder = tar::Builder::new(Vec::new());
    builder.append(&header, std::io::empty()).unwrap();
    // More than a socket buffers: the client is still sending when refused.
    file(&mut builder, &target.entry("after"), 0o644, &[0; 32 << 20]);
    let reply = post(&agent, "", builder.into_inner().unwrap()).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let body = reply.json();
    assert_eq!(body["code"], "BAD_REQUEST");
    assert!(
        body["message"].as_str().unwrap().contains(&escaping),
        "{body}"
    );
    assert!(!target.dir.path().parent().unwrap().join("escaped").exists());
    assert!(!target.path("after").exists(), "nothing after a refusal");

    let mut builder = tar::Builder::new(Vec::new());
    file(&mut builder, &target.entry("owned"), 0o644, b"x");
    let stream = builder.into_inner().unwrap();
    let reply = post(&agent, "?owner=no-such-user-here", stream.clone()).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let body = reply.json();
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("no-such-user-here"),
        "{body}"
    );
    assert!(!target.path("owned").exists(), "nothing unpacked");

    if cove_testenv::root("unpacking with an owner") {
        let reply = post(&agent, "?owner=4242:77", stream).await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        let meta = std::fs::metadata(target.path("owned")).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (4242, 77));
    }
}
