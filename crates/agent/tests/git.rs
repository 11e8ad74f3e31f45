//! `/git/*` through a real agent and the real `git` binary, against bare
//! repositories on a temp dir (never the network): clone (branch, commit,
//! credentials over a local HTTP server), status, add, commit, branches,
//! checkout, push and pull between two clones, history, reset, restore,
//! remotes, config, credentials, and the mapped `GIT_*` errors.

mod common;

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{exists, Agent};
use hyper::Method;
use serde_json::{json, Value};

/// An agent whose HOME (and so `--global` git config) is a throw-away dir.
struct Fixture {
    agent: Agent,
    home: tempfile::TempDir,
    remotes: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Self {
        let home = tempfile::tempdir().unwrap();
        let agent = Agent::start_with(&[
            ("HOME", home.path().to_str().unwrap()),
            ("GIT_CONFIG_NOSYSTEM", "1"),
        ]);
        Self {
            agent,
            home,
            remotes: tempfile::tempdir().unwrap(),
        }
    }

    /// A bare repository with `main` (two commits) and `dev` (one more).
    fn bare_remote(&self) -> (PathBuf, Vec<String>) {
        let bare = self.remotes.path().join("remote.git");
        let seed = self.remotes.path().join("seed");
        git(
            self.remotes.path(),
            &["init", "-q", "--bare", "-b", "main", "remote.git"],
        );
        git(self.remotes.path(), &["init", "-q", "-b", "main", "seed"]);
        std::fs::write(seed.join("README.md"), "hello\n").unwrap();
        git(&seed, &["add", "."]);
        git(&seed, &["commit", "-q", "-m", "first"]);
        std::fs::write(seed.join("README.md"), "hello again\n").unwrap();
        git(&seed, &["commit", "-q", "-am", "second"]);
        git(&seed, &["switch", "-q", "-c", "dev"]);
        std::fs::write(seed.join("dev.txt"), "dev\n").unwrap();
        git(&seed, &["add", "."]);
        git(&seed, &["commit", "-q", "-m", "on dev"]);
        git(&seed, &["remote", "add", "origin", bare.to_str().unwrap()]);
        git(&seed, &["push", "-q", "origin", "main", "dev"]);
        let commits = git(&seed, &["log", "--format=%H", "main"])
            .lines()
            .map(str::to_string)
            .collect();
        (bare, commits)
    }

    async fn post(&self, uri: &str, body: Value) -> common::Reply {
        self.agent.post_json(uri, body).await
    }

    async fn ok(&self, uri: &str, body: Value) -> common::Reply {
        let reply = self.post(uri, body.clone()).await;
        assert!(
            reply.status.is_success(),
            "{uri} {body}: {} {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        );
        reply
    }

    async fn status(&self, path: &str) -> Value {
        let reply = self.agent.get(&format!("/git/status?path={path}")).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        reply.json()
    }
}

/// Host git with a fixed identity and no user or system config.
fn git(dir: &Path, args: &[&str]) -> String {
    let output = Command::new("git")
        .current_dir(dir)
        .args(["-c", "user.name=Seed", "-c", "user.email=seed@example.com"])
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

fn assert_error(reply: &common::Reply, status: u16, code: &str) -> String {
    assert_eq!(
        reply.status.as_u16(),
        status,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let body = reply.json();
    assert_eq!(body["code"], code, "{body}");
    assert_eq!(body["source"], "DAYTONA_DAEMON");
    body["message"].as_str().unwrap().to_string()
}

fn files(status: &Value) -> Vec<(String, String, String)> {
    status["fileStatus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["name"].as_str().unwrap().to_string(),
                f["staging"].as_str().unwrap().to_string(),
                f["worktree"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[tokio::test]
async fn commit_push_and_pull_between_two_clones() {
    let fx = Fixture::new();
    let (bare, _) = fx.bare_remote();
    let url = bare.to_str().unwrap();
    fx.ok("/git/clone", json!({"url": url, "path": "one"}))
        .await;
    fx.ok(
        "/git/clone",
        json!({"url": format!("file://{url}"), "path": "two"}),
    )
    .await;

    let status = fx.status("one").await;
    assert_eq!(status["currentBranch"], "main");
    assert_eq!(status["upstream"], "origin/main");
    assert_eq!(status["branchPublished"], true);
    assert_eq!(status["detached"], false);
    assert_eq!(
        (status["ahead"].as_u64(), status["behind"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(files(&status).is_empty());

    std::fs::write(fx.agent.path("one/README.md"), "changed\n").unwrap();
    std::fs::create_dir(fx.agent.path("one/sub")).unwrap();
    std::fs::write(fx.agent.path("one/sub/new file.txt"), "new\n").unwrap();
    let unstaged = files(&fx.status("one").await);
    assert_eq!(
        unstaged,
        [
            ("README.md".into(), "Unmodified".into(), "Modified".into()),
            (
                "sub/new file.txt".into(),
                "Untracked".into(),
                "Untracked".into()
            ),
        ]
    );

    fx.ok("/git/add", json!({"path": "one", "files": ["."]}))
        .await;
    let staged = files(&fx.status("one").await);
    assert_eq!(
        staged,
        [
            ("README.md".into(), "Modified".into(), "Unmodified".into()),
            (
                "sub/new file.txt".into(),
                "Added".into(),
                "Unmodified".into()
            ),
        ]
    );

    let reply = fx
        .ok(
            "/git/commit",
            json!({"path": "one", "message": "change things", "author": "Ann", "email": "ann@example.com"}),
        )
        .await;
    let hash = reply.json()["hash"].as_str().unwrap().to_string();
    assert_eq!(hash.len(), 40);
    let one = fx.agent.path("one");
    assert_eq!(git(&one, &["rev-parse", "HEAD"]).trim(), hash);
    assert_eq!(
        git(&one, &["log", "-1", "--format=%an <%ae> %cn"]).trim(),
        "Ann <ann@example.com> Ann"
    );
    let status = fx.status("one").await;
    assert_eq!(status["ahead"], 1);
    assert!(files(&status).is_empty());

    // Nothing staged and no allow_empty: git refuses; with it, an empty commit.
    let reply = fx
        .post(
            "/git/commit",
            json!({"path": "one", "message": "empty", "author": "Ann", "email": "ann@example.com"}),
        )
        .await;
    assert!(assert_error(&reply, 400, "BAD_REQUEST").contains("nothing to commit"));
    let empty = fx
        .ok(
            "/git/commit",
            json!({"path": "one", "message": "empty", "author": "Ann", "email": "ann@example.com", "allow_empty": true}),
        )
        .await;
    let empty = empty.json()["hash"].as_str().unwrap().to_string();

    fx.ok("/git/push", json!({"path": "one"})).await;
    assert_eq!(git(&bare, &["rev-parse", "main"]).trim(), empty);
    assert_eq!(fx.status("one").await["ahead"], 0);

    fx.ok("/git/pull", json!({"path": "two"})).await;
    assert_eq!(
        std::fs::read_to_string(fx.agent.path("two/sub/new file.txt")).unwrap(),
        "new\n"
    );
    let history = fx.agent.get("/git/history?path=two").await.json();
    assert_eq!(history[0]["hash"], empty.as_str());
    assert_eq!(history[1]["hash"], hash.as_str());
    assert_eq!(history[1]["message"], "change things");
    assert_eq!(history[1]["author"], "Ann");
    assert_eq!(history[1]["email"], "ann@example.com");
    assert!(history[1]["timestamp"].as_str().unwrap().contains('T'));
    assert_eq!(history.as_array().unwrap().len(), 4);
}

#[tokio::test]
async fn rejected_push_merge_conflict_and_dirty_checkout_have_git_codes() {
    let fx = Fixture::new();
    let (bare, _) = fx.bare_remote();
    let url = bare.to_str().unwrap();
    for path in ["one", "two"] {
        fx.ok("/git/clone", json!({"url": url, "path": path})).await;
    }
    let commit = |path: &'static str, text: &'static str| {
        let fx = &fx;
        async move {
            std::fs::write(fx.agent.path(&format!("{path}/README.md")), text).unwrap();
            fx.ok("/git/add", json!({"path": path, "files": ["README.md"]}))
                .await;
            fx.ok(
                "/git/commit",
                json!({"path": path, "message": text, "author": "A", "email": "a@x"}),
            )
            .await;
        }
    };
    commit("one", "from one\n").await;
    commit("two", "from two\n").await;
    fx.ok("/git/push", json!({"path": "one"})).await;

    let reply = fx.post("/git/push", json!({"path": "two"})).await;
    assert!(assert_error(&reply, 409, "GIT_PUSH_REJECTED").contains("rejected"));

    fx.ok(
        "/git/config",
        json!({"key": "user.name", "value": "Two", "scope": "local", "path": "two"}),
    )
    .await;
    fx.ok(
        "/git/config",
        json!({"key": "user.email", "value": "two@x", "scope": "local", "path": "two"}),
    )
    .await;
    let reply = fx.post("/git/pull", json!({"path": "two"})).await;
    assert!(assert_error(&reply, 409, "GIT_MERGE_CONFLICT").contains("README.md"));
    assert_eq!(files(&fx.status("two").await)[0].1, "Updated but unmerged");

    // A dirty worktree blocks a checkout that would overwrite it.
    std::fs::write(fx.agent.path("one/README.md"), "dirty\n").unwrap();
    let reply = fx
        .post("/git/checkout", json!({"path": "one", "branch": "dev"}))
        .await;
    assert_error(&reply, 409, "GIT_DIRTY_WORKTREE");
}

#[tokio::test]
async fn clone_a_branch_a_commit_and_failures() {
    let fx = Fixture::new();
    let (bare, commits) = fx.bare_remote();
    let url = bare.to_str().unwrap();

    fx.ok(
        "/git/clone",
        json!({"url": url, "path": "deep/dev", "branch": "dev"}),
    )
    .await;
    let status = fx.status("deep/dev").await;
    assert_eq!(status["currentBranch"], "dev");
    assert!(exists(&fx.agent.path("deep/dev/dev.txt")));

    let first = &commits[1];
    fx.ok(
        "/git/clone",
        json!({"url": url, "path": "old", "commit_id": &first[..10]}),
    )
    .await;
    let status = fx.status("old").await;
    assert_eq!(status["detached"], true);
    assert_eq!(status["currentBranch"], "HEAD");
    assert_eq!(
        git(&fx.agent.path("old"), &["rev-parse", "HEAD"]).trim(),
        first
    );
    assert_eq!(
        std::fs::read_to_string(fx.agent.path("old/README.md")).unwrap(),
        "hello\n"
    );

    let reply = fx
        .post(
            "/git/clone",
            json!({"url": url, "path": "nocommit", "commit_id": "0123456789abcdef"}),
        )
        .await;
    assert!(assert_error(&reply, 404, "NOT_FOUND").contains("0123456789abcdef"));
    assert!(
        !exists(&fx.agent.path("nocommit")),
        "a failed clone leaves nothing"
    );

    let missing = fx.remotes.path().join("missing.git");
    let missing = missing.to_str().unwrap();
    let reply = fx
        .post("/git/clone", json!({"url": missing, "path": "m"}))
        .await;
    let message = assert_error(&reply, 404, "GIT_REPO_NOT_FOUND");
    assert!(message.contains(missing), "{message}");
    let reply = fx
        .post(
            "/git/clone",
            json!({"url": url, "path": "m", "branch": "nope"}),
        )
        .await;
    assert!(assert_error(&reply, 404, "GIT_BRANCH_NOT_FOUND").contains("nope"));
    let reply = fx
        .post("/git/clone", json!({"url": url, "path": "old"}))
        .await;
    assert_error(&reply, 409, "CONFLICT");
    let reply = fx
        .post(
            "/git/clone",
            json!({"url": "http://127.0.0.1:1/x.git", "path": "h"}),
        )
        .await;
    assert_error(&reply, 502, "GIT_TRANSPORT_FAILED");

    // Paths: missing is a 404 naming it; a plain directory is no repository.
    let reply = fx.agent.get("/git/status?path=nowhere").await;
    assert!(assert_error(&reply, 404, "FILE_NOT_FOUND").contains("nowhere"));
    std::fs::create_dir(fx.agent.path("plain")).unwrap();
    let reply = fx.agent.get("/git/status?path=plain").await;
    assert_error(&reply, 404, "GIT_REPO_NOT_FOUND");
    let reply = fx.post("/git/clone", json!({"url": url})).await;
    assert_error(&reply, 400, "INVALID_REQUEST_BODY");
}

#[tokio::test]
async fn branches_create_switch_checkout_and_delete() {
    let fx = Fixture::new();
    let (bare, _) = fx.bare_remote();
    fx.ok(
        "/git/clone",
        json!({"url": bare.to_str().unwrap(), "path": "r"}),
    )
    .await;
    let list = fx.agent.get("/git/branches?path=r").await.json();
    assert_eq!(list, json!({"branches": ["main"], "current": "main"}));

    let reply = fx
        .post("/git/branches", json!({"path": "r", "name": "feature"}))
        .await;
    assert_eq!(reply.status, 201);
    let list = fx.agent.get("/git/branches?path=r").await.json();
    assert_eq!(
        list,
        json!({"branches": ["feature", "main"], "current": "feature"})
    );
    let reply = fx
        .post("/git/branches", json!({"path": "r", "name": "main"}))
        .await;
    assert_error(&reply, 409, "GIT_BRANCH_EXISTS");

    fx.ok("/git/checkout", json!({"path": "r", "branch": "main"}))
        .await;
    assert_eq!(fx.status("r").await["currentBranch"], "main");
    // A branch only the remote has gets a local tracking branch.
    fx.ok("/git/checkout", json!({"path": "r", "branch": "dev"}))
        .await;
    let status = fx.status("r").await;
    assert_eq!(
        (
            status["currentBranch"].as_str(),
            status["upstream"].as_str()
        ),
        (Some("dev"), Some("origin/dev"))
    );
    let reply = fx
        .post("/git/checkout", json!({"path": "r", "branch": "nope"}))
        .await;
    assert_error(&reply, 404, "GIT_BRANCH_NOT_FOUND");

    let reply = fx
        .agent
        .request(
            Method::DELETE,
            "/git/branches",
            Some("application/json"),
            json!({"path": "r", "name": "feature"}).to_string(),
        )
        .await;
    assert_eq!(reply.status, 204);
    let list = fx.agent.get("/git/branches?path=r").await.json();
    assert_eq!(list["branches"], json!(["dev", "main"]));
    let reply = fx
        .agent
        .request(
            Method::DELETE,
            "/git/branches",
            Some("application/json"),
            json!({"path": "r", "name": "feature"}).to_string(),
        )
        .await;
    assert_error(&reply, 404, "GIT_BRANCH_NOT_FOUND");

    // Push a new branch with set_upstream, then it is published.
    fx.post("/git/branches", json!({"path": "r", "name": "topic"}))
        .await;
    assert_eq!(fx.status("r").await["branchPublished"], false);
    fx.ok(
        "/git/push",
        json!({"path": "r", "branch": "topic", "set_upstream": true}),
    )
    .await;
    let status = fx.status("r").await;
    assert_eq!(
        (
            status["branchPublished"].as_bool(),
            status["upstream"].as_str()
        ),
        (Some(true), Some("origin/topic"))
    );
    assert!(!git(&bare, &["rev-parse", "topic"]).is_empty());
}

#[tokio::test]
async fn init_history_reset_and_restore() {
    let fx = Fixture::new();
    let reply = fx
        .post(
            "/git/init",
            json!({"path": "fresh", "initial_branch": "trunk"}),
        )
        .await;
    assert_eq!(reply.status, 201);
    let status = fx.status("fresh").await;
    assert_eq!(status["currentBranch"], "trunk");
    assert_eq!(
        fx.agent.get("/git/history?path=fresh").await.json(),
        json!([])
    );
    let reply = fx
        .post("/git/init", json!({"path": "bare.git", "bare": true}))
        .await;
    assert_eq!(reply.status, 201);
    assert_eq!(
        git(
            &fx.agent.path("bare.git"),
            &["rev-parse", "--is-bare-repository"]
        )
        .trim(),
        "true"
    );

    let write = |text: &str| std::fs::write(fx.agent.path("fresh/a.txt"), text).unwrap();
    let commit = |message: &'static str| {
        let fx = &fx;
        async move {
            fx.ok("/git/add", json!({"path": "fresh", "files": ["a.txt"]}))
                .await;
            fx.ok(
                "/git/commit",
                json!({"path": "fresh", "message": message, "author": "A", "email": "a@x"}),
            )
            .await
            .json()["hash"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    write("one\n");
    let first = commit("one").await;
    write("two\n");
    commit("two\n\nwith a body").await;
    let history = fx.agent.get("/git/history?path=fresh").await.json();
    assert_eq!(history[0]["message"], "two\n\nwith a body");
    assert_eq!(history[1]["hash"], first.as_str());

    // restore: worktree from the index, the index from HEAD, a file from a revision.
    write("scratch\n");
    fx.ok("/git/restore", json!({"path": "fresh", "files": ["a.txt"]}))
        .await;
    assert_eq!(
        std::fs::read_to_string(fx.agent.path("fresh/a.txt")).unwrap(),
        "two\n"
    );
    write("staged\n");
    fx.ok("/git/add", json!({"path": "fresh", "files": ["a.txt"]}))
        .await;
    fx.ok(
        "/git/restore",
        json!({"path": "fresh", "files": ["a.txt"], "staged": true}),
    )
    .await;
    assert_eq!(files(&fx.status("fresh").await)[0].1, "Unmodified");
    assert_eq!(
        std::fs::read_to_string(fx.agent.path("fresh/a.txt")).unwrap(),
        "staged\n"
    );
    fx.ok(
        "/git/restore",
        json!({"path": "fresh", "files": ["a.txt"], "source": first, "worktree": true}),
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(fx.agent.path("fresh/a.txt")).unwrap(),
        "one\n"
    );
    let reply = fx
        .post(
            "/git/restore",
            json!({"path": "fresh", "files": ["nofile"]}),
        )
        .await;
    assert_error(&reply, 404, "NOT_FOUND");

    // reset: a staged file unstaged by path, soft to the parent, hard back.
    fx.ok("/git/add", json!({"path": "fresh", "files": ["a.txt"]}))
        .await;
    fx.ok("/git/reset", json!({"path": "fresh", "files": ["a.txt"]}))
        .await;
    assert_eq!(files(&fx.status("fresh").await)[0].1, "Unmodified");
    fx.ok("/git/reset", json!({"path": "fresh", "mode": "hard"}))
        .await;
    assert!(files(&fx.status("fresh").await).is_empty());
    fx.ok(
        "/git/reset",
        json!({"path": "fresh", "mode": "soft", "target": "HEAD~1"}),
    )
    .await;
    assert_eq!(
        git(&fx.agent.path("fresh"), &["rev-parse", "HEAD"]).trim(),
        first
    );
    assert_eq!(files(&fx.status("fresh").await)[0].1, "Modified");
    fx.ok(
        "/git/reset",
        json!({"path": "fresh", "mode": "hard", "target": first}),
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(fx.agent.path("fresh/a.txt")).unwrap(),
        "one\n"
    );
    let reply = fx
        .post("/git/reset", json!({"path": "fresh", "mode": "sideways"}))
        .await;
    assert_error(&reply, 400, "BAD_REQUEST");
    let reply = fx
        .post("/git/reset", json!({"path": "fresh", "target": "HEAD~9"}))
        .await;
    assert_error(&reply, 404, "NOT_FOUND");
}

#[tokio::test]
async fn remotes_and_config() {
    let fx = Fixture::new();
    let (bare, _) = fx.bare_remote();
    let url = bare.to_str().unwrap();
    fx.ok("/git/clone", json!({"url": url, "path": "r"})).await;
    let remotes = fx.agent.get("/git/remotes?path=r").await.json();
    assert_eq!(
        remotes,
        json!({"remotes": [{"name": "origin", "url": url}]})
    );

    let reply = fx
        .post(
            "/git/remotes",
            json!({"path": "r", "name": "upstream", "url": url, "fetch": true}),
        )
        .await;
    assert_eq!(reply.status, 201);
    assert!(!git(&fx.agent.path("r"), &["rev-parse", "upstream/dev"]).is_empty());
    let reply = fx
        .post(
            "/git/remotes",
            json!({"path": "r", "name": "upstream", "url": "/elsewhere"}),
        )
        .await;
    assert_error(&reply, 409, "CONFLICT");
    fx.ok(
        "/git/remotes",
        json!({"path": "r", "name": "upstream", "url": "/elsewhere", "overwrite": true}),
    )
    .await;
    let remotes = fx.agent.get("/git/remotes?path=r").await.json();
    assert_eq!(
        remotes["remotes"][1],
        json!({"name": "upstream", "url": "/elsewhere"})
    );

    // Global config lands in the agent's HOME; unset keys are null.
    let get = |query: &'static str| fx.agent.get(query);
    assert_eq!(
        get("/git/config?key=core.editor").await.json(),
        json!({"value": null})
    );
    fx.ok(
        "/git/config",
        json!({"key": "core.editor", "value": "nano -w"}),
    )
    .await;
    assert_eq!(
        get("/git/config?key=core.editor").await.json(),
        json!({"value": "nano -w"})
    );
    let global = std::fs::read_to_string(fx.home.path().join(".gitconfig")).unwrap();
    assert!(global.contains("nano -w"), "{global}");

    fx.ok(
        "/git/config/user",
        json!({"name": "Local Lu", "email": "lu@x", "scope": "local", "path": "r"}),
    )
    .await;
    assert_eq!(
        get("/git/config?key=user.name&scope=local&path=r")
            .await
            .json(),
        json!({"value": "Local Lu"})
    );
    assert_eq!(
        get("/git/config?key=user.name").await.json(),
        json!({"value": null})
    );
    fx.ok(
        "/git/config/user",
        json!({"name": "Global Gil", "email": "gil@x"}),
    )
    .await;
    assert_eq!(
        get("/git/config?key=user.email&scope=global").await.json(),
        json!({"value": "gil@x"})
    );

    let reply = get("/git/config?key=user.name&scope=local").await;
    assert_error(&reply, 400, "BAD_REQUEST");
    let reply = get("/git/config?key=user.name&scope=galaxy").await;
    assert_error(&reply, 400, "BAD_REQUEST");
    let reply = fx
        .post("/git/config", json!({"key": "nosection", "value": "x"}))
        .await;
    assert_error(&reply, 400, "BAD_REQUEST");
}

const USER: &str = "alice";
const PASSWORD: &str = "s3cret-token";
/// `Basic base64("alice:s3cret-token")`.
const AUTHORIZATION: &str = "Basic YWxpY2U6czNjcmV0LXRva2Vu";

/// Serves `root` as git's dumb HTTP protocol (static files) behind Basic
/// auth, on 127.0.0.1; returns the base URL. The thread lives as long as the
/// test process.
fn serve_dumb_http(root: PathBuf) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request_line = String::new();
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            let mut authorized = false;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some((name, value)) = line.split_once(':') {
                    if name.eq_ignore_ascii_case("authorization") && value.trim() == AUTHORIZATION {
                        authorized = true;
                    }
                }
            }
            let target = request_line.split(' ').nth(1).unwrap_or("/");
            let path = target.split('?').next().unwrap().trim_start_matches('/');
            let file = root.join(path);
            let response = if !authorized {
                b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"git\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec()
            } else if let Ok(mut opened) = std::fs::File::open(&file) {
                let mut body = Vec::new();
                opened.read_to_end(&mut body).unwrap_or(0);
                let mut response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                )
                .into_bytes();
                response.extend(body);
                response
            } else {
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec()
            };
            let _ = stream.write_all(&response);
        }
    });
    format!("http://127.0.0.1:{port}")
}

#[tokio::test]
async fn credentials_authenticate_without_being_stored_or_leaked() {
    let fx = Fixture::new();
    let (bare, commits) = fx.bare_remote();
    git(&bare, &["update-server-info"]);
    let base = serve_dumb_http(fx.remotes.path().to_path_buf());
    let url = format!("{base}/remote.git");

    let reply = fx
        .post("/git/clone", json!({"url": url, "path": "anon"}))
        .await;
    assert_error(&reply, 401, "GIT_AUTH_FAILED");
    let reply = fx
        .post(
            "/git/clone",
            json!({"url": url, "path": "wrong", "username": USER, "password": "nope-nope"}),
        )
        .await;
    let message = assert_error(&reply, 401, "GIT_AUTH_FAILED");
    assert!(!message.contains("nope-nope"), "{message}");

    fx.ok(
        "/git/clone",
        json!({"url": url, "path": "r", "username": USER, "password": PASSWORD}),
    )
    .await;
    assert_eq!(
        git(&fx.agent.path("r"), &["rev-parse", "HEAD"]).trim(),
        commits[0]
    );
    let config = std::fs::read_to_string(fx.agent.path("r/.git/config")).unwrap();
    assert!(
        !config.contains(PASSWORD) && !config.contains(USER),
        "{config}"
    );
    assert!(!exists(&fx.home.path().join(".git-credentials")));
    fx.ok(
        "/git/pull",
        json!({"path": "r", "username": USER, "password": PASSWORD}),
    )
    .await;
    let reply = fx.post("/git/pull", json!({"path": "r"})).await;
    assert_error(&reply, 401, "GIT_AUTH_FAILED");

    // Persisted credentials: later operations need none.
    let host = base.trim_start_matches("http://");
    fx.ok(
        "/git/credentials",
        json!({"username": USER, "password": PASSWORD, "host": host, "protocol": "http"}),
    )
    .await;
    let stored = std::fs::read_to_string(fx.home.path().join(".git-credentials")).unwrap();
    // The store helper URL-encodes the port's colon.
    assert!(
        stored.starts_with(&format!("http://{USER}:{PASSWORD}@127.0.0.1")),
        "{stored}"
    );
    fx.ok("/git/clone", json!({"url": url, "path": "later"}))
        .await;
    fx.ok("/git/pull", json!({"path": "r"})).await;
}
