//! `/lsp/*` through a real agent and a real `pylsp` (Debian's
//! python3-pylsp; `scripts/setup` installs it): completions, document and
//! workspace symbols, did-open/did-close, a file changed on disk, stop
//! (the process is gone), a server that dies, the agent's end, bad input.
//! TypeScript runs only where `typescript-language-server` is on PATH.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::Agent;
use serde_json::{json, Value};

/// Whether pylsp is here; else skipped (failed under `COVE_TEST_STRICT=1`).
fn have_pylsp() -> bool {
    cove_testenv::program("pylsp", "apt-get install python3-pylsp")
}

/// An agent whose servers keep their caches to themselves: pylsp processes
/// of tests running at once, sharing jedi's cache in `~/.cache`, read each
/// other's half-written entries on a cold cache and answer no completions.
fn python_agent() -> (Agent, tempfile::TempDir) {
    let cache = tempfile::tempdir().unwrap();
    let agent = Agent::start_with(&[("XDG_CACHE_HOME", cache.path().to_str().unwrap())]);
    (agent, cache)
}

fn query_value(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The pids of the agent's children whose command is `name`.
fn children_named(parent: u32, name: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces, so from the last ')'.
        let Some((head, tail)) = stat.rsplit_once(')') else {
            continue;
        };
        let comm = head.split_once('(').map_or("", |(_, comm)| comm);
        let ppid = tail.split_whitespace().nth(1).and_then(|p| p.parse().ok());
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let runs_name = cmdline
            .split(|&b| b == 0)
            .take(2)
            .any(|arg| arg.ends_with(name.as_bytes()));
        if ppid == Some(parent) && (comm == name || runs_name) {
            found.push(pid);
        }
    }
    found
}

/// Whether `pid` has ended (gone, or a zombie nobody reaped yet).
fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, tail)| tail.trim_start().starts_with('Z')),
    }
}

fn wait_until_ended(pid: u32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if ended(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ended(pid)
}

fn labels(completions: &Value) -> Vec<String> {
    completions["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| item["label"].as_str().unwrap().to_owned())
        .collect()
}

fn symbols(answer: &Value) -> Vec<(String, i64)> {
    answer
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_owned(),
                s["kind"].as_i64().unwrap(),
            )
        })
        .collect()
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

const SHAPES_PY: &str =
    "class Greeter:\n    def greet(self):\n        return 'hi'\n\n\ndef main():\n    return Greeter()\n";

#[tokio::test]
async fn python_completes_lists_symbols_and_stops() {
    if !have_pylsp() {
        return;
    }
    let (agent, _cache) = python_agent();
    write(&agent.path("proj/main.py"), "import os\nos.pa");
    write(&agent.path("proj/shapes.py"), SHAPES_PY);
    // A relative project is the work dir's, as the SDK documents.
    let server = json!({"languageId": "python", "pathToProject": "proj"});
    let reply = agent.post_json("/lsp/start", server.clone()).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let pids = children_named(agent.pid(), "pylsp");
    assert_eq!(pids.len(), 1, "one pylsp: {pids:?}");
    let pid = pids[0];
    // Starting again keeps the running server.
    let reply = agent.post_json("/lsp/start", server.clone()).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(children_named(agent.pid(), "pylsp"), [pid]);

    // The SDK's uri: "file://" + a path relative to the project.
    let document =
        json!({"languageId": "python", "pathToProject": "proj", "uri": "file://main.py"});
    let reply = agent.post_json("/lsp/did-open", document.clone()).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let completion = |line: u32, character: u32| {
        json!({"languageId": "python", "pathToProject": "proj", "uri": "file://main.py",
               "position": {"line": line, "character": character}})
    };
    let reply = agent.post_json("/lsp/completions", completion(1, 5)).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let list = reply.json();
    assert_eq!(list["isIncomplete"], false);
    assert!(labels(&list).contains(&"path".to_owned()), "{list}");
    for item in list["items"].as_array().unwrap() {
        let documentation = &item["documentation"];
        assert!(
            documentation.is_null() || documentation["value"].is_string(),
            "documentation is MarkupContent for the SDK: {item}"
        );
    }

    // The file changed on disk: the server is given the new text.
    write(&agent.path("proj/main.py"), "import sys\nsys.pla");
    let reply = agent.post_json("/lsp/completions", completion(1, 7)).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert!(labels(&reply.json()).contains(&"platform".to_owned()));
    let reply = agent.post_json("/lsp/did-close", document.clone()).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);

    // An absolute uri, of a file never opened.
    let shapes = agent.path("proj/shapes.py");
    let uri = format!("file://{}", shapes.display());
    let project = agent.path("proj");
    let reply = agent
        .get(&format!(
            "/lsp/document-symbols?languageId=python&pathToProject={}&uri={}",
            query_value(&project.to_string_lossy()),
            query_value(&uri)
        ))
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let answer = reply.json();
    let found = symbols(&answer);
    assert!(found.contains(&("Greeter".into(), 5)), "{answer}");
    assert!(found.contains(&("main".into(), 12)), "{answer}");
    for symbol in answer.as_array().unwrap() {
        assert_eq!(symbol["location"]["uri"], uri.as_str());
        assert!(symbol["location"]["range"]["start"]["line"].is_u64());
    }

    let reply = agent
        .get("/lsp/workspacesymbols?query=Greeter&languageId=python&pathToProject=proj")
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert!(reply.json().is_array());

    let reply = agent.post_json("/lsp/stop", server.clone()).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert!(ended(pid), "pylsp {pid} still runs after stop");
    // Nothing runs for it now.
    let reply = agent.post_json("/lsp/completions", completion(1, 5)).await;
    assert_eq!(reply.status, 400, "{:?}", reply.body);
    assert!(reply.json()["message"]
        .as_str()
        .unwrap()
        .contains("lsp/start"));
    let reply = agent.post_json("/lsp/stop", server).await;
    assert_eq!(reply.status, 400, "{:?}", reply.body);
}

#[tokio::test]
async fn a_server_that_dies_is_reported_and_can_be_started_again() {
    if !have_pylsp() {
        return;
    }
    let (agent, _cache) = python_agent();
    write(&agent.path("p/a.py"), "import os\nos.pa");
    let server = json!({"languageId": "python", "pathToProject": "p"});
    assert_eq!(
        agent.post_json("/lsp/start", server.clone()).await.status,
        200
    );
    let [pid] = children_named(agent.pid(), "pylsp")[..] else {
        panic!("no single pylsp");
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(wait_until_ended(pid, Duration::from_secs(5)));
    let request = json!({"languageId": "python", "pathToProject": "p", "uri": "file://a.py",
                         "position": {"line": 1, "character": 5}});
    let asked = Instant::now();
    let reply = agent.post_json("/lsp/completions", request.clone()).await;
    assert!(asked.elapsed() < Duration::from_secs(5), "not hung on");
    assert_eq!(reply.status, 502, "{:?}", reply.body);
    let message = reply.json()["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("has stopped") && message.contains("start it again"),
        "{message}"
    );

    assert_eq!(agent.post_json("/lsp/start", server).await.status, 200);
    let reply = agent.post_json("/lsp/completions", request).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert!(labels(&reply.json()).contains(&"path".to_owned()));
}

#[tokio::test]
async fn servers_end_with_the_agent() {
    if !have_pylsp() {
        return;
    }
    let (agent, _cache) = python_agent();
    std::fs::create_dir(agent.path("p")).unwrap();
    let server = json!({"languageId": "python", "pathToProject": "p"});
    assert_eq!(agent.post_json("/lsp/start", server).await.status, 200);
    let [pid] = children_named(agent.pid(), "pylsp")[..] else {
        panic!("no single pylsp");
    };
    drop(agent);
    assert!(
        wait_until_ended(pid, Duration::from_secs(5)),
        "pylsp {pid} outlived the agent"
    );
}

#[tokio::test]
async fn bad_input_is_answered_400_with_what_to_do() {
    let agent = Agent::start();
    std::fs::create_dir(agent.path("p")).unwrap();
    let cases = [
        (
            "/lsp/start",
            json!({"languageId": "rust", "pathToProject": "p"}),
            "python, typescript, javascript",
        ),
        (
            "/lsp/start",
            json!({"languageId": "python", "pathToProject": ""}),
            "pathToProject is empty",
        ),
        (
            "/lsp/start",
            json!({"languageId": "python"}),
            "pathToProject is empty",
        ),
        (
            "/lsp/start",
            json!({"languageId": "python", "pathToProject": "/no/such/dir"}),
            "not a directory",
        ),
        (
            "/lsp/did-open",
            json!({"languageId": "python", "pathToProject": "p", "uri": "file://a.py"}),
            "call lsp/start first",
        ),
        (
            "/lsp/did-open",
            json!({"languageId": "python", "pathToProject": "p", "uri": "a.py"}),
            "not a file:// URI",
        ),
        (
            "/lsp/completions",
            json!({"languageId": "python", "pathToProject": "p", "uri": "file://a.py",
                   "position": {"line": 0, "character": 0}}),
            "call lsp/start first",
        ),
        (
            "/lsp/completions",
            json!({"languageId": "python", "pathToProject": "p", "uri": "file://a.py"}),
            "position",
        ),
        (
            "/lsp/stop",
            json!({"languageId": "python", "pathToProject": "p"}),
            "call lsp/start first",
        ),
    ];
    for (path, body, says) in cases {
        let reply = agent.post_json(path, body.clone()).await;
        assert_eq!(reply.status, 400, "{path} {body}: {:?}", reply.body);
        let answer = reply.json();
        let message = answer["message"].as_str().unwrap();
        assert!(message.contains(says), "{path} {body}: {message}");
        assert_eq!(answer["source"], "DAYTONA_DAEMON");
    }
    for query in [
        "/lsp/document-symbols?languageId=python&pathToProject=p&uri=file://a.py",
        "/lsp/workspacesymbols?query=x&languageId=python&pathToProject=p",
        "/lsp/workspacesymbols?query=x&languageId=cobol&pathToProject=p",
    ] {
        let reply = agent.get(query).await;
        assert_eq!(reply.status, 400, "{query}: {:?}", reply.body);
    }
}

#[tokio::test]
async fn typescript_completes_and_lists_hierarchical_symbols() {
    let path = std::env::var_os("PATH").unwrap_or_default();
    if !std::env::split_paths(&path).any(|dir| dir.join("typescript-language-server").is_file()) {
        // Not a host tool cove's setup installs (the default image carries
        // it): skipped even under COVE_TEST_STRICT, but loudly.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr().lock(),
            "skipped: typescript-language-server is not on PATH (npm install -g typescript-language-server typescript)"
        );
        return;
    }
    let agent = Agent::start();
    write(
        &agent.path("ts/index.ts"),
        "class Greeter {\n  greet(): string { return 'hi'; }\n}\nfunction main() {}\nconst s = 'x';\ns.\n",
    );
    let server = json!({"languageId": "typescript", "pathToProject": "ts"});
    let reply = agent.post_json("/lsp/start", server.clone()).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let document =
        json!({"languageId": "typescript", "pathToProject": "ts", "uri": "file://index.ts"});
    assert_eq!(agent.post_json("/lsp/did-open", document).await.status, 200);
    let reply = agent
        .post_json(
            "/lsp/completions",
            json!({"languageId": "typescript", "pathToProject": "ts", "uri": "file://index.ts",
                   "position": {"line": 5, "character": 2},
                   "context": {"triggerKind": 2, "triggerCharacter": "."}}),
        )
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert!(labels(&reply.json()).contains(&"toUpperCase".to_owned()));

    let reply = agent
        .get("/lsp/document-symbols?languageId=typescript&pathToProject=ts&uri=file://index.ts")
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let answer = reply.json();
    let found = symbols(&answer);
    assert!(found.contains(&("Greeter".into(), 5)), "{answer}");
    assert!(
        found.contains(&("greet".into(), 6)),
        "children are flattened: {answer}"
    );
    assert!(found.contains(&("main".into(), 12)), "{answer}");

    let reply = agent
        .get("/lsp/workspacesymbols?query=Greeter&languageId=typescript&pathToProject=ts")
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert!(symbols(&reply.json())
        .iter()
        .any(|(name, _)| name == "Greeter"));
    assert_eq!(agent.post_json("/lsp/stop", server).await.status, 200);
}
