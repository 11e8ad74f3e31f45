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
