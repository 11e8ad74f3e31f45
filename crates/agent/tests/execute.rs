//! `/process/execute` and the informational endpoints, through a real agent.

mod common;

use std::time::{Duration, Instant};

use common::Agent;
use serde_json::json;

#[tokio::test]
async fn version_and_directories() {
    let agent = Agent::start();
    let version = agent.get("/version").await;
    assert_eq!(version.status, 200);
    assert_eq!(version.json()["version"], env!("CARGO_PKG_VERSION"));
    let work_dir = agent.get("/work-dir").await.json();
    assert_eq!(work_dir["dir"], agent.work_dir.to_str().unwrap());
    assert!(agent.get("/user-home-dir").await.json()["dir"].is_string());
}

#[tokio::test]
async fn execute_reports_exit_code_and_ordered_output() {
    let agent = Agent::start();
    let reply = agent
        .post_json(
            "/process/execute",
            json!({"command": "echo out; echo err >&2; echo out2; exit 3"}),
        )
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.json(),
        json!({"exitCode": 3, "result": "out\nerr\nout2\n"})
    );
}

#[tokio::test]
async fn execute_runs_in_work_dir_or_cwd_with_envs() {
    let agent = Agent::start();
    std::fs::create_dir(agent.path("sub")).unwrap();
    let default = agent
        .post_json("/process/execute", json!({"command": "pwd"}))
        .await
        .json();
    assert_eq!(default["result"], format!("{}\n", agent.work_dir.display()));
    let relative = agent
        .post_json(
            "/process/execute",
            json!({"command": "pwd; echo $GREETING", "cwd": "sub", "envs": {"GREETING": "hello there"}}),
        )
        .await
        .json();
    assert_eq!(
        relative["result"],
        format!("{}\nhello there\n", agent.path("sub").display())
    );
}

#[tokio::test]
async fn execute_hides_agent_private_variables() {
    let agent = Agent::start();
    let reply = agent
        .post_json(
            "/process/execute",
            json!({"command": "env | grep -c '^COVE_' || true"}),
        )
        .await
        .json();
    assert_eq!(reply["result"], "0\n");
}

#[tokio::test]
async fn execute_timeout_kills_the_process_group() {
    let agent = Agent::start();
    let marker = agent.path("survived");
    let command = format!(
        "echo started; (sleep 3; touch {}) & sleep 30",
        marker.display()
    );
    let started = Instant::now();
    let reply = agent
        .post_json(
            "/process/execute",
            json!({"command": command, "timeout": 1}),
        )
        .await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(reply.status, 200);
    let body = reply.json();
    assert_eq!(body["timedOut"], true);
    assert_ne!(body["exitCode"], 0);
    assert_eq!(body["result"], "started\n");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !marker.exists(),
        "a process of the group outlived the timeout"
    );
}

#[tokio::test]
async fn execute_returns_when_its_command_exits_and_leaves_the_background_running() {
    let agent = Agent::start();
    let pid_file = agent.path("background.pid");
    // The background process holds the output pipe open for 30 s.
    let command = format!(
        "echo early; (sleep 0.2; echo late; echo $(exec sh -c 'echo $PPID') > {}; exec sleep 30) &",
        pid_file.display()
    );
    let started = Instant::now();
    let reply = agent
        .post_json(
            "/process/execute",
            json!({"command": command, "timeout": 20}),
        )
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "held until the deadline: {:?}",
        started.elapsed()
    );
    let body = reply.json();
    assert_eq!(body, json!({"exitCode": 0, "result": "early\nlate\n"}));
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the background process was killed"
    );
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

#[tokio::test]
async fn a_background_process_may_write_after_the_answer() {
    let agent = Agent::start();
    let marker = agent.path("wrote-later");
    // Written after the answer: a closed pipe would kill the subshell
    // (SIGPIPE) before it touches the marker.
    let command = format!(
        "(sleep 2; echo after; echo more >&2; touch {}) &",
        marker.display()
    );
    let reply = agent
        .post_json("/process/execute", json!({"command": command}))
        .await;
    assert_eq!(reply.json(), json!({"exitCode": 0, "result": ""}));
    for _ in 0..100 {
        if marker.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(marker.exists(), "the background process died writing");
}

#[tokio::test]
async fn commands_whose_output_closes_with_them_are_not_held() {
    let agent = Agent::start();
    let started = Instant::now();
    for _ in 0..5 {
        let reply = agent
            .post_json(
                "/process/execute",
                json!({"command": "echo hi; echo there"}),
            )
            .await;
        assert_eq!(reply.json()["result"], "hi\nthere\n");
    }
    // Five runs held for the exit grace (1 s each) would take 5 s.
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn execute_with_missing_cwd_is_404_naming_it() {
    let agent = Agent::start();
    let reply = agent
        .post_json(
            "/process/execute",
            json!({"command": "true", "cwd": "/no/such/dir"}),
        )
        .await;
    assert_eq!(reply.status, 404);
    let body = reply.json();
    assert!(body["message"].as_str().unwrap().contains("/no/such/dir"));
    assert_eq!(body["code"], "FILE_NOT_FOUND");
    assert_eq!(body["source"], "DAYTONA_DAEMON");
}

#[tokio::test]
async fn malformed_request_is_400_and_unknown_route_404() {
    let agent = Agent::start();
    let reply = agent
        .post_json("/process/execute", json!({"cmd": "true"}))
        .await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.json()["statusCode"], 400);
    let reply = agent.get("/no/such/route").await;
    assert_eq!(reply.status, 404);
    assert_eq!(reply.json()["statusCode"], 404);
}
