//! `/files...` through a real agent: streaming uploads and downloads in the
//! SDK's multipart formats, listing, metadata, folders, deletion, errors.

mod common;

use common::{exists, multipart, parse_multipart, Agent};
use hyper::Method;
use serde_json::json;

async fn upload(
    agent: &Agent,
    parts: &[(&str, Option<&str>, &[u8])],
    close: bool,
) -> common::Reply {
    let (content_type, body) = multipart(parts, close);
    agent
        .request(
            Method::POST,
            "/files/bulk-upload",
            Some(&content_type),
            body,
        )
        .await
}

#[tokio::test]
async fn bulk_upload_then_bulk_download_is_byte_exact() {
    let agent = Agent::start();
    let big: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let absolute = agent.path("abs/other.bin");
    let absolute = absolute.to_str().unwrap();
    let reply = upload(
        &agent,
        &[
            ("files[0].path", None, b"deep/dir/big.bin"),
            ("files[1].path", None, absolute.as_bytes()),
            ("files[0].file", Some("deep/dir/big.bin"), &big),
            ("files[1].file", Some(absolute), b"\r\n--not-a-boundary\r\n"),
        ],
        true,
    )
    .await;
    assert!(reply.status.is_success(), "{:?}", reply.body);
    assert_eq!(std::fs::read(agent.path("deep/dir/big.bin")).unwrap(), big);

    let reply = agent
        .request(
            Method::POST,
            "/files/bulk-download",
            Some("application/json"),
            json!({"paths": ["deep/dir/big.bin", "missing.txt", absolute]}).to_string(),
        )
        .await;
    assert_eq!(reply.status, 200);
    let content_type = reply.headers["content-type"].to_str().unwrap().to_string();
    assert!(content_type.starts_with("multipart/form-data; boundary="));
    let parts = parse_multipart(&content_type, &reply.body);
    assert_eq!(parts.len(), 3);
    assert_eq!(
        (parts[0].0.as_str(), parts[0].1.as_str()),
        ("file", "deep/dir/big.bin")
    );
    assert_eq!(parts[0].2, big);
    assert_eq!(
        (parts[1].0.as_str(), parts[1].1.as_str()),
        ("error", "missing.txt")
    );
    let error: serde_json::Value = serde_json::from_slice(&parts[1].2).unwrap();
    assert_eq!(error["statusCode"], 404);
    assert_eq!(error["code"], "FILE_NOT_FOUND");
    assert_eq!(error["source"], "DAYTONA_DAEMON");
    assert_eq!(parts[2].1, absolute);
    assert_eq!(parts[2].2, b"\r\n--not-a-boundary\r\n");

    let single = agent.get("/files/download?path=deep/dir/big.bin").await;
    assert_eq!(single.status, 200);
    assert_eq!(single.body.as_ref(), big.as_slice());
}

#[tokio::test]
async fn failed_upload_leaves_no_partial_file() {
    let agent = Agent::start();
    std::fs::create_dir(agent.path("target")).unwrap();
    let data = vec![7u8; 100_000];
    // The body ends in the middle of the file part: no closing boundary.
    let reply = upload(
        &agent,
        &[
            ("files[0].path", None, b"target/half.bin"),
            ("files[0].file", Some("target/half.bin"), &data),
        ],
        false,
    )
    .await;
    assert_eq!(reply.status, 400);
    assert!(reply.json()["errors"].is_array());
    let left: Vec<_> = std::fs::read_dir(agent.path("target")).unwrap().collect();
    assert!(left.is_empty(), "upload left {left:?}");
}

#[tokio::test]
async fn list_info_folder_and_delete() {
    let agent = Agent::start();
    let reply = agent
        .request(
            Method::POST,
            "/files/folder?path=dir/nested&mode=750",
            None,
            "",
        )
        .await;
    assert_eq!(reply.status, 201);
    std::fs::write(agent.path("dir/file.txt"), "12345").unwrap();

    let listing = agent.get("/files?path=dir").await;
    assert_eq!(listing.status, 200);
    let entries = listing.json();
    let entries = entries.as_array().unwrap();
    assert_eq!(entries.len(), 2);
    let file = entries.iter().find(|e| e["name"] == "file.txt").unwrap();
    assert_eq!(file["size"], 5);
    assert_eq!(file["isDir"], false);
    for key in [
        "mode",
        "modTime",
        "modifiedAt",
        "owner",
        "group",
        "permissions",
    ] {
        assert!(file[key].is_string(), "{key} missing in {file}");
    }
    let nested = entries.iter().find(|e| e["name"] == "nested").unwrap();
    assert_eq!(nested["isDir"], true);
    assert_eq!(nested["permissions"], "0750");
    assert_eq!(nested["mode"], "drwxr-x---");

    let info = agent.get("/files/info?path=dir/file.txt").await.json();
    assert_eq!(info["name"], "file.txt");
    assert_eq!(info["permissions"], "0644");

    let refused = agent.delete("/files?path=dir").await;
    assert_eq!(refused.status, 400);
    assert_eq!(agent.delete("/files?path=dir/file.txt").await.status, 204);
    assert!(!exists(&agent.path("dir/file.txt")));
    assert_eq!(
        agent.delete("/files?path=dir&recursive=true").await.status,
        204
    );
    assert!(!exists(&agent.path("dir")));
}

#[tokio::test]
async fn missing_paths_are_404_naming_the_path() {
    let agent = Agent::start();
    for uri in [
        "/files/info?path=ghost.txt",
        "/files?path=ghost-dir",
        "/files/download?path=ghost.txt",
    ] {
        let reply = agent.get(uri).await;
        assert_eq!(reply.status, 404, "{uri}");
        let body = reply.json();
        assert!(
            body["message"].as_str().unwrap().contains("ghost"),
            "{body}"
        );
        assert_eq!(body["code"], "FILE_NOT_FOUND");
    }
    let reply = agent.delete("/files?path=ghost.txt").await;
    assert_eq!(reply.status, 404);
    let reply = agent.get("/files/info").await;
    assert_eq!(
        reply.status, 400,
        "a missing required query parameter is a bad request"
    );
}

#[tokio::test]
async fn upload_v2_writes_the_file_part() {
    let agent = Agent::start();
    let (content_type, body) = multipart(&[("file", Some("x.txt"), b"v2 data")], true);
    let reply = agent
        .request(
            Method::POST,
            "/files/upload-v2?path=up/v2.txt",
            Some(&content_type),
            body,
        )
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.json()["name"], "v2.txt");
    assert_eq!(std::fs::read(agent.path("up/v2.txt")).unwrap(), b"v2 data");
}
