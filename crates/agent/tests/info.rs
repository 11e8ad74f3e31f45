//! `/port`, `/port/{port}/in-use`, `/system/metrics` and `/env` through a real agent.

mod common;

use common::Agent;
use serde_json::json;

#[tokio::test]
async fn ports_list_listening_sockets_only() {
    let agent = Agent::start();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let reply = agent.get("/port").await;
    assert_eq!(reply.status, 200);
    let ports: Vec<u64> = reply.json()["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_u64().unwrap())
        .collect();
    assert!(ports.contains(&u64::from(port)), "{port} not in {ports:?}");
    assert!(ports.windows(2).all(|w| w[0] < w[1]), "sorted and unique");

    let reply = agent.get(&format!("/port/{port}/in-use")).await;
    assert_eq!(reply.json(), json!({"isInUse": true}));
    drop(listener);
    let reply = agent.get(&format!("/port/{port}/in-use")).await;
    assert_eq!(reply.json(), json!({"isInUse": false}));
    let reply = agent.get("/port/notaport/in-use").await;
    assert_eq!(reply.status, 400);
    assert!(reply.json()["message"]
        .as_str()
        .unwrap()
        .contains("notaport"));
    assert_eq!(agent.get("/port/70000/in-use").await.status, 400);
}

#[tokio::test]
async fn metrics_report_cpu_memory_and_disk() {
    let agent = Agent::start();
    let reply = agent.get("/system/metrics").await;
    assert_eq!(reply.status, 200);
    let body = reply.json();
    assert!(body["cpuCount"].as_u64().unwrap() >= 1);
    let pct = body["cpuUsedPct"].as_f64().unwrap();
    assert!((0.0..=100.0).contains(&pct));
    let (total, used) = (
        body["memTotal"].as_u64().unwrap(),
        body["memUsed"].as_u64().unwrap(),
    );
    assert!(total > 0 && used <= total, "{body}");
    let disk_total = body["diskTotal"].as_u64().unwrap();
    assert!(disk_total > 0 && body["diskUsed"].as_u64().unwrap() <= disk_total);
    assert!(body["diskFree"].as_u64().unwrap() <= disk_total);
    assert!(body["timestampUnix"].as_i64().unwrap() > 1_700_000_000);
    assert!(body["timestamp"].as_str().unwrap().ends_with('Z'));
    // A second request within the window (which one counts is a unit test
    // of `window_open`) answers too.
    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    assert_eq!(agent.get("/system/metrics").await.status, 200);
}

#[tokio::test]
async fn env_updates_reach_new_processes() {
    let agent = Agent::start();
    let run = |command: &'static str| {
        let agent = &agent;
        async move {
            agent
                .post_json("/process/execute", json!({"command": command}))
                .await
                .json()["result"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    let reply = agent
        .post_json(
            "/env",
            json!({"set": {"AGENT_TEST_A": "one", "SECRET_X": "placeholder:1"}}),
        )
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(
        run("echo \"$AGENT_TEST_A $SECRET_X\"").await,
        "one placeholder:1\n"
    );
    let reply = agent
        .post_json(
            "/env",
            json!({"set": {"AGENT_TEST_B": "two"}, "unset": ["AGENT_TEST_A"], "unsetValuePrefix": "placeholder:"}),
        )
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        run("echo \"${AGENT_TEST_A-unset} ${SECRET_X-unset} $AGENT_TEST_B\"").await,
        "unset unset two\n"
    );
    let reply = agent.post_json("/env", json!({"set": {"A=B": "x"}})).await;
    assert_eq!(reply.status, 400);
    assert!(reply.json()["message"].as_str().unwrap().contains("A=B"));
}
