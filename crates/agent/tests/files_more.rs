//! The rest of `/files...` through a real agent: move, permissions, name and
//! content search, replace, the inotify watch WebSocket, and streaming of a
//! 1 GiB upload and download in bounded memory.

mod common;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::time::Duration;

use bytes::Bytes;
use common::Agent;
use futures_util::{SinkExt as _, StreamExt as _};
use http_body_util::{BodyExt as _, StreamBody};
use hyper::body::Frame;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'/' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

fn assert_error(reply: &common::Reply, status: u16, names: &str) {
    assert_eq!(
        reply.status,
        status,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let body = reply.json();
    assert_eq!(body["statusCode"], status);
    let message = body["message"].as_str().unwrap();
    assert!(message.contains(names), "{message:?} should name {names:?}");
}

#[tokio::test]
async fn move_renames_and_refuses_conflicts_and_missing_paths() {
    let agent = Agent::start();
    std::fs::create_dir_all(agent.path("dir/sub")).unwrap();
    std::fs::write(agent.path("dir/sub/a.txt"), "a").unwrap();
    std::fs::write(agent.path("b.txt"), "b").unwrap();

    let reply = agent
        .request(
            Method::POST,
            "/files/move?source=dir&destination=moved",
            None,
            Bytes::new(),
        )
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(std::fs::read(agent.path("moved/sub/a.txt")).unwrap(), b"a");
    assert!(!common::exists(&agent.path("dir")));

    let reply = agent
        .request(
            Method::POST,
            "/files/move?source=b.txt&destination=moved",
            None,
            Bytes::new(),
        )
        .await;
    assert_error(&reply, 409, "moved");
    let reply = agent
        .request(
            Method::POST,
            "/files/move?source=nope.txt&destination=x",
            None,
            Bytes::new(),
        )
        .await;
    assert_error(&reply, 404, "nope.txt");
    let reply = agent
        .request(
            Method::POST,
            "/files/move?source=b.txt&destination=no/such/x",
            None,
            Bytes::new(),
        )
        .await;
    assert_error(&reply, 404, "no/such");
    let reply = agent
        .request(
            Method::POST,
            "/files/move?source=moved&destination=moved/inside",
            None,
            Bytes::new(),
        )
        .await;
    assert_error(&reply, 400, "into itself");
    let reply = agent
        .request(Method::POST, "/files/move?source=b.txt", None, Bytes::new())
        .await;
    assert_eq!(reply.status, 400);
}

#[tokio::test]
async fn permissions_set_mode_owner_and_group() {
    let agent = Agent::start();
    let file = agent.path("script.sh");
    std::fs::write(&file, "#!/bin/sh\n").unwrap();
    let reply = agent
        .request(
            Method::POST,
            "/files/permissions?path=script.sh&mode=750",
            None,
            Bytes::new(),
        )
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o7777,
        0o750
    );

    if cove_testenv::root("changing a file's owner") {
        let reply = agent
            .request(
                Method::POST,
                "/files/permissions?path=script.sh&owner=4321&group=4322",
                None,
                Bytes::new(),
            )
            .await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let metadata = std::fs::metadata(&file).unwrap();
        assert_eq!((metadata.uid(), metadata.gid()), (4321, 4322));
        let reply = agent
            .request(
                Method::POST,
                "/files/permissions?path=script.sh&owner=root",
                None,
                Bytes::new(),
            )
            .await;
        assert_eq!(reply.status, 200);
        assert_eq!(std::fs::metadata(&file).unwrap().uid(), 0);
    }

    let reply = agent
        .request(
            Method::POST,
            "/files/permissions?path=script.sh&mode=9z",
            None,
            Bytes::new(),
        )
        .await;
    assert_error(&reply, 400, "9z");
    let reply = agent
        .request(
            Method::POST,
            "/files/permissions?path=script.sh&owner=no-such-user-cove",
            None,
            Bytes::new(),
        )
        .await;
    assert_error(&reply, 400, "no-such-user-cove");
    let reply = agent
        .request(
            Method::POST,
            "/files/permissions?path=gone&mode=644",
            None,
            Bytes::new(),
        )
        .await;
    assert_error(&reply, 404, "gone");
}

fn tree(agent: &Agent) {
    for (path, text) in [
        ("proj/main.py", "import os\nprint('TODO: hello')\n"),
        ("proj/src/lib.rs", "// TODO: write\nfn main() {}\r\n"),
        ("proj/src/deep/util.py", "x = 1\n# TODO: more\n"),
        ("proj/Cargo.toml", "[package]\n"),
    ] {
        let full = agent.path(path);
        std::fs::create_dir_all(full.parent().unwrap()).unwrap();
        std::fs::write(full, text).unwrap();
    }
    std::fs::write(agent.path("proj/blob.bin"), b"TODO: \0binary").unwrap();
    std::os::unix::fs::symlink("/", agent.path("proj/root-link")).unwrap();
}

#[tokio::test]
async fn search_matches_names_at_any_depth_or_relative_paths() {
    let agent = Agent::start();
    tree(&agent);
    let root = agent.path("proj");
    let files = |reply: common::Reply| -> Vec<String> {
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let body = reply.json();
        body["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                let path = std::path::Path::new(f.as_str().unwrap());
                path.strip_prefix(&root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    };
    let found = files(agent.get("/files/search?path=proj&pattern=*.py").await);
    assert_eq!(found, ["main.py", "src/deep/util.py"]);
    let found = files(
        agent
            .get(&format!(
                "/files/search?path={}&pattern={}",
                encode(root.to_str().unwrap()),
                encode("src/**/*.{rs,py}")
            ))
            .await,
    );
    assert_eq!(found, ["src/deep/util.py", "src/lib.rs"]);
    let found = files(agent.get("/files/search?path=proj&pattern=src").await);
    assert_eq!(found, ["src"], "directories match too");
    assert_error(
        &agent.get("/files/search?path=proj&pattern=%5B").await,
        400,
        "[",
    );
    assert_error(
        &agent.get("/files/search?path=nowhere&pattern=*").await,
        404,
        "nowhere",
    );
    assert_eq!(agent.get("/files/search?path=proj").await.status, 400);
}

#[tokio::test]
async fn find_reports_lines_of_text_files_only() {
    let agent = Agent::start();
    tree(&agent);
    let reply = agent.get("/files/find?path=proj&pattern=TODO%3A").await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let root = agent.path("proj");
    let expected = json!([
        {"file": root.join("main.py"), "line": 2, "content": "print('TODO: hello')"},
        {"file": root.join("src/deep/util.py"), "line": 2, "content": "# TODO: more"},
        {"file": root.join("src/lib.rs"), "line": 1, "content": "// TODO: write"},
    ]);
    assert_eq!(reply.json(), expected);
    // A single file is searched too.
    let reply = agent
        .get("/files/find?path=proj/src/lib.rs&pattern=fn")
        .await;
    assert_eq!(reply.json()[0]["line"], 2);
    assert_eq!(reply.json()[0]["content"], "fn main() {}");
    assert_error(
        &agent.get("/files/find?path=nowhere&pattern=x").await,
        404,
        "nowhere",
    );
}

#[tokio::test]
async fn replace_reports_per_file_and_keeps_modes() {
    let agent = Agent::start();
    let file = agent.path("conf.ini");
    std::fs::write(&file, "host=old\nbackup=old-old\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::write(agent.path("untouched.txt"), "nothing here").unwrap();
    let before = std::fs::metadata(agent.path("untouched.txt"))
        .unwrap()
        .ino();
    let reply = agent
        .post_json(
            "/files/replace",
            json!({"files": ["conf.ini", "untouched.txt", "missing.txt"], "pattern": "old", "newValue": "new.example"}),
        )
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let results = reply.json();
    assert_eq!(results[0], json!({"file": "conf.ini", "success": true}));
    assert_eq!(
        results[1],
        json!({"file": "untouched.txt", "success": true})
    );
    assert_eq!(results[2]["success"], false);
    assert!(results[2]["error"]
        .as_str()
        .unwrap()
        .contains("missing.txt"));
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "host=new.example\nbackup=new.example-new.example\n"
    );
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o7777,
        0o640
    );
    assert_eq!(
        std::fs::metadata(agent.path("untouched.txt"))
            .unwrap()
            .ino(),
        before
    );
    let leftovers: Vec<_> = std::fs::read_dir(&agent.work_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("cove-replace"))
        .collect();
    assert!(leftovers.is_empty());
    let reply = agent
        .post_json(
            "/files/replace",
            json!({"files": ["conf.ini"], "pattern": "", "newValue": "x"}),
        )
        .await;
    assert_eq!(reply.status, 400);
}

async fn next_event(
    socket: &mut tokio_tungstenite::WebSocketStream<tokio::net::UnixStream>,
) -> Value {
    loop {
        let message = tokio::time::timeout(Duration::from_secs(5), socket.next())
            .await
            .expect("an event within 5 s")
            .expect("socket open")
            .unwrap();
        if let Message::Text(text) = message {
            return serde_json::from_str(&text).unwrap();
        }
    }
}

/// Reads events until one satisfies `wanted`, returning it.
async fn event_where(
    socket: &mut tokio_tungstenite::WebSocketStream<tokio::net::UnixStream>,
    wanted: impl Fn(&Value) -> bool,
) -> Value {
    loop {
        let event = next_event(socket).await;
        if wanted(&event) {
            return event;
        }
    }
}

#[tokio::test]
async fn watch_streams_create_modify_rename_delete_recursively() {
    let agent = Agent::start();
    let root = agent.path("watched");
    std::fs::create_dir_all(root.join("existing")).unwrap();
    let mut socket = agent
        .websocket(&format!(
            "/files/watch?path={}&recursive=true",
            encode(root.to_str().unwrap())
        ))
        .await;
    let path = |p: &str| root.join(p).to_string_lossy().into_owned();

    std::fs::write(root.join("a.txt"), "1").unwrap();
    let event = next_event(&mut socket).await;
    assert_eq!(
        event,
        json!({"type": "create", "path": path("a.txt"), "isDir": false})
    );
    let event = event_where(&mut socket, |e| e["type"] == "modify").await;
    assert_eq!(event["path"], path("a.txt"));

    std::fs::rename(root.join("a.txt"), root.join("existing/b.txt")).unwrap();
    let event = event_where(&mut socket, |e| e["type"] != "modify").await;
    assert_eq!(
        event,
        json!({"type": "rename", "path": path("existing/b.txt"), "oldPath": path("a.txt"), "isDir": false})
    );

    // A new directory is watched at once, and what lands in it is reported.
    std::fs::create_dir(root.join("new")).unwrap();
    std::fs::write(root.join("new/inner.txt"), "x").unwrap();
    let event = next_event(&mut socket).await;
    assert_eq!(
        event,
        json!({"type": "create", "path": path("new"), "isDir": true})
    );
    event_where(&mut socket, |e| e["path"] == path("new/inner.txt")).await;

    std::fs::remove_file(root.join("existing/b.txt")).unwrap();
    let event = event_where(&mut socket, |e| e["type"] == "delete").await;
    assert_eq!(
        event,
        json!({"type": "delete", "path": path("existing/b.txt"), "isDir": false})
    );

    // Moving out of the tree is a delete once no pair arrives.
    std::fs::rename(root.join("new"), agent.path("outside")).unwrap();
    let event = event_where(&mut socket, |e| e["type"] == "delete").await;
    assert_eq!(
        event,
        json!({"type": "delete", "path": path("new"), "isDir": true})
    );

    // The watched path itself going away ends the stream with 1000.
    std::fs::remove_dir_all(&root).unwrap();
    let mut closed = None;
    while let Ok(Some(message)) = tokio::time::timeout(Duration::from_secs(5), socket.next()).await
    {
        if let Ok(Message::Close(frame)) = message {
            closed = frame;
            break;
        }
    }
    assert_eq!(u16::from(closed.expect("close frame").code), 1000);
}

#[tokio::test]
async fn watch_of_a_missing_path_is_404_and_a_client_close_ends_it() {
    let agent = Agent::start();
    assert_error(
        &agent.get("/files/watch?path=nowhere").await,
        404,
        "nowhere",
    );
    assert_error(&agent.get("/files/watch?path=.").await, 400, "WebSocket");
    let mut socket = agent.websocket("/files/watch?path=.").await;
    socket.close(None).await.unwrap();
    // The agent answers the close and drops the watch.
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(message)) = socket.next().await {
            if message.is_close() {
                break;
            }
        }
    })
    .await;
    assert!(end.is_ok());
    let _ = socket.send(Message::Text("late".into())).await;
}

/// The agent's pid, found by the socket path on its command line.
fn agent_pid(agent: &Agent) -> u32 {
    let socket = agent.work_dir.parent().unwrap().join("agent.sock");
    let socket = socket.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(&socket))
                .unwrap_or(false)
        })
        .expect("agent process")
}

fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test]
async fn a_gibibyte_streams_up_and_down_in_bounded_memory() {
    const CHUNK: usize = 1 << 20;
    const CHUNKS: usize = 1024;
    let agent = Agent::start();
    let pid = agent_pid(&agent);
    let socket = agent.work_dir.parent().unwrap().join("agent.sock");
    let chunk = Bytes::from((0..CHUNK).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    let boundary = "cove-gib-boundary";
    let head = Bytes::from(format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.bin\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n"
    ));
    let tail = Bytes::from(format!("\r\n--{boundary}--\r\n"));
    let frames = futures_util::stream::iter(
        std::iter::once(head)
            .chain(std::iter::repeat_n(chunk.clone(), CHUNKS))
            .chain(std::iter::once(tail))
            .map(|b| Ok::<_, std::convert::Infallible>(Frame::data(b))),
    );
    let stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let request = Request::post("/files/upload-v2?path=big.bin")
        .header("host", "agent")
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(StreamBody::new(frames))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, 200, "{body:?}");
    assert_eq!(
        std::fs::metadata(agent.path("big.bin")).unwrap().len(),
        (CHUNK * CHUNKS) as u64
    );

    let stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let request = Request::get("/files/download?path=big.bin")
        .header("host", "agent")
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let (mut received, mut position_ok) = (0usize, true);
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            // Checking every byte in a debug build takes a minute; the first
            // and last of each frame catch a lost, doubled or shifted chunk.
            let expected = |i: usize| ((received + i) % CHUNK % 251) as u8;
            let last = data.len().saturating_sub(1);
            position_ok &=
                data.is_empty() || (data[0] == expected(0) && data[last] == expected(last));
            received += data.len();
        }
    }
    assert_eq!(received, CHUNK * CHUNKS);
    assert!(
        position_ok,
        "downloaded bytes differ from the uploaded ones"
    );
    let peak = peak_rss_kib(pid);
    assert!(
        peak < 64 * 1024,
        "agent peak RSS {peak} KiB is not under 64 MiB"
    );
    eprintln!("agent peak RSS after 1 GiB up and down: {peak} KiB");
}
