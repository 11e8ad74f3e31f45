//! `/process/interpreter...` through a real agent and a real `python3`:
//! persistent globals, streamed output, errors, REPL-style values and rich
//! results, timeouts that interrupt the run but keep the context, contexts.

mod common;

use std::time::{Duration, Instant};

use common::Agent;
use futures_util::{SinkExt as _, StreamExt as _};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;

/// Everything one run sent back.
#[derive(Debug)]
struct Run {
    events: Vec<Value>,
    close: Option<(CloseCode, String)>,
}

impl Run {
    fn text(&self, kind: &str) -> String {
        self.events
            .iter()
            .filter(|e| e["type"] == kind)
            .map(|e| e["text"].as_str().unwrap())
            .collect()
    }

    fn stdout(&self) -> String {
        self.text("stdout")
    }

    fn stderr(&self) -> String {
        self.text("stderr")
    }

    fn error(&self) -> Option<&Value> {
        self.events.iter().find(|e| e["type"] == "error")
    }

    fn results(&self) -> Vec<&Value> {
        self.events
            .iter()
            .filter(|e| e["type"] == "result")
            .collect()
    }

    fn close_code(&self) -> Option<CloseCode> {
        self.close.as_ref().map(|(code, _)| *code)
    }
}

async fn run(agent: &Agent, request: Value) -> Run {
    let mut socket = agent.websocket("/process/interpreter/execute").await;
    socket
        .send(Message::Text(request.to_string().into()))
        .await
        .unwrap();
    let mut events = Vec::new();
    loop {
        let message = tokio::time::timeout(Duration::from_secs(30), socket.next())
            .await
            .expect("run did not end");
        match message {
            Some(Ok(Message::Text(text))) => events.push(serde_json::from_str(&text).unwrap()),
            Some(Ok(Message::Close(frame))) => {
                let close = frame.map(|f| (f.code, f.reason.to_string()));
                return Run { events, close };
            }
            Some(Ok(_)) => {}
            None | Some(Err(_)) => {
                return Run {
                    events,
                    close: None,
                }
            }
        }
    }
}

async fn code(agent: &Agent, code: &str) -> Run {
    run(agent, json!({ "code": code })).await
}

#[tokio::test]
async fn globals_persist_and_output_streams() {
    let agent = Agent::start();
    let first = code(&agent, "x = 41").await;
    assert_eq!(first.close_code(), Some(CloseCode::Normal));
    assert_eq!(first.stdout(), "");
    let second = code(
        &agent,
        "print(x + 1)\nimport sys\nprint('warn', file=sys.stderr)",
    )
    .await;
    assert_eq!(second.stdout(), "42\n");
    assert_eq!(second.stderr(), "warn\n");
    assert!(second.error().is_none(), "{:?}", second.events);
    assert_eq!(second.close_code(), Some(CloseCode::Normal));

    // Output of child processes and of C code on fds 1 and 2 is captured too.
    let children = code(
        &agent,
        "import os, subprocess\nos.system('echo from-shell')\nsubprocess.run(['sh', '-c', 'echo oops >&2'])\nos.write(1, b'raw\\n')",
    )
    .await;
    // The value of the last expression (`os.write` returns 4) is shown last.
    assert_eq!(children.stdout(), "from-shell\nraw\n4\n");
    assert_eq!(children.stderr(), "oops\n");
    let value = code(&agent, "6 * 7").await;
    assert_eq!(value.stdout(), "42\n");
    assert_eq!(value.results()[0]["text"], "42");
}

#[tokio::test]
async fn output_arrives_while_the_code_runs() {
    let agent = Agent::start();
    let mut socket = agent.websocket("/process/interpreter/execute").await;
    let request =
        json!({"code": "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')"});
    socket
        .send(Message::Text(request.to_string().into()))
        .await
        .unwrap();
    let started = Instant::now();
    let first = tokio::time::timeout(Duration::from_secs(10), socket.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "output was held back"
    );
    let event: Value = serde_json::from_str(first.to_text().unwrap()).unwrap();
    assert_eq!(event, json!({"type": "stdout", "text": "first\n"}));
}

#[tokio::test]
async fn errors_carry_name_value_and_a_user_traceback() {
    let agent = Agent::start();
    let failed = code(&agent, "def f():\n    return 1 / 0\nprint('before')\nf()").await;
    assert_eq!(failed.stdout(), "before\n");
    let error = failed.error().expect("no error event");
    assert_eq!(error["name"], "ZeroDivisionError");
    assert_eq!(error["value"], "division by zero");
    let traceback = error["traceback"].as_str().unwrap();
    assert!(traceback.contains("return 1 / 0"), "{traceback}");
    assert!(!traceback.contains("driver"), "{traceback}");
    // An error ends the run normally: the SDK reads it from the error event.
    assert_eq!(failed.close_code(), Some(CloseCode::Normal));

    let syntax = code(&agent, "def broken(:\n    pass").await;
    assert_eq!(syntax.error().unwrap()["name"], "SyntaxError");
    // sys.exit() ends the run, not the context.
    code(&agent, "kept = 'yes'").await;
    let exited = code(&agent, "import sys\nsys.exit(3)").await;
    assert!(exited.error().is_none());
    assert_eq!(code(&agent, "print(kept)").await.stdout(), "yes\n");
}

#[tokio::test]
async fn rich_results_carry_html_and_text() {
    let agent = Agent::start();
    let rich = code(
        &agent,
        "class Table:\n    def _repr_html_(self):\n        return '<table></table>'\n    def __repr__(self):\n        return 'Table()'\nTable()",
    )
    .await;
    let results = rich.results();
    assert_eq!(results.len(), 1, "{:?}", rich.events);
    assert_eq!(results[0]["html"], "<table></table>");
    assert_eq!(results[0]["text"], "Table()");
    assert_eq!(rich.stdout(), "Table()\n");
    // None is not displayed, as in the REPL.
    assert!(code(&agent, "None").await.results().is_empty());
}

#[tokio::test]
async fn matplotlib_figures_come_back_as_png() {
    // A Python with matplotlib: scripts/setup puts one in the conformance venv and
    // scripts/test names its bin dir here; CI must run this test for real.
    let Some(bin) = cove_testenv::path(
        "COVE_TEST_MATPLOTLIB_BIN",
        "the bin dir of a Python with matplotlib",
    ) else {
        return;
    };
    let bin = bin.display();
    let path = format!("{bin}:{}", std::env::var("PATH").unwrap_or_default());
    let agent = Agent::start_with(&[("PATH", &path)]);
    let plotted = code(
        &agent,
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()",
    )
    .await;
    let png = plotted
        .results()
        .iter()
        .find_map(|r| r["png"].as_str())
        .expect("no png result")
        .to_string();
    assert!(png.starts_with("iVBORw0KGgo"), "not a PNG: {}", &png[..20]);
    assert_eq!(plotted.results().len(), 1, "one figure, shown once");
    assert_eq!(
        plotted.stderr(),
        "",
        "plt.show() on the Agg backend stays quiet"
    );
}

#[tokio::test]
async fn timeout_interrupts_the_run_but_keeps_the_context() {
    let agent = Agent::start();
    code(&agent, "survivor = 'still here'").await;
    let started = Instant::now();
    let stuck = run(
        &agent,
        json!({"code": "import time\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.05)", "timeout": 1}),
    )
    .await;
    assert_eq!(stuck.close_code(), Some(CloseCode::from(4008)));
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(stuck.stdout(), "looping\n");
    assert_eq!(
        code(&agent, "print(survivor)").await.stdout(),
        "still here\n"
    );

    // A child process that ignores nothing dies with the interrupt as well.
    let sleeping = run(
        &agent,
        json!({"code": "import os\nos.system('sleep 30')\nafter = 1", "timeout": 1}),
    )
    .await;
    assert_eq!(sleeping.close_code(), Some(CloseCode::from(4008)));
    assert_eq!(
        code(&agent, "print(survivor)").await.stdout(),
        "still here\n"
    );
}

#[tokio::test]
async fn a_run_that_swallows_the_interrupt_is_killed() {
    let agent = Agent::start();
    code(&agent, "lost = 1").await;
    let stubborn = run(
        &agent,
        json!({"code": "import time\nwhile True:\n    try:\n        time.sleep(0.05)\n    except KeyboardInterrupt:\n        pass", "timeout": 1}),
    )
    .await;
    assert_eq!(stubborn.close_code(), Some(CloseCode::from(4008)));
    assert_eq!(stubborn.error().unwrap()["name"], "TimeoutError");
    // The context lives on, restarted empty.
    let after = code(&agent, "print('lost' in globals())").await;
    assert_eq!(after.stdout(), "False\n");
}

#[tokio::test]
async fn run_envs_apply_to_that_run_only() {
    let agent = Agent::start();
    let with = run(
        &agent,
        json!({"code": "import os\nprint(os.environ['COLOR'])", "envs": {"COLOR": "blue"}}),
    )
    .await;
    assert_eq!(with.stdout(), "blue\n");
    let without = code(&agent, "import os\nprint(os.environ.get('COLOR'))").await;
    assert_eq!(without.stdout(), "None\n");
}

#[tokio::test]
async fn contexts_are_isolated_and_have_their_own_cwd() {
    let agent = Agent::start();
    let dir = agent.path("project");
    std::fs::create_dir(&dir).unwrap();
    let created = agent
        .post_json("/process/interpreter/context", json!({"cwd": "project"}))
        .await;
    assert_eq!(created.status, 200, "{:?}", created.body);
    let context = created.json();
    for field in ["id", "active", "createdAt", "cwd", "language"] {
        assert!(context.get(field).is_some(), "missing {field} in {context}");
    }
    assert_eq!(context["cwd"], dir.to_str().unwrap());
    assert_eq!(context["language"], "python");
    assert_eq!(context["active"], true);
    let id = context["id"].as_str().unwrap().to_string();

    code(&agent, "secret = 'default'").await;
    let inside = run(
        &agent,
        json!({"code": "import os\nprint(os.getcwd())\nprint('secret' in globals())", "contextId": id}),
    )
    .await;
    assert_eq!(inside.stdout(), format!("{}\nFalse\n", dir.display()));

    let listed = agent.get("/process/interpreter/context").await.json();
    let ids: Vec<_> = listed["contexts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [id.as_str()], "the default context is not listed");

    let deleted = agent
        .delete(&format!("/process/interpreter/context/{id}"))
        .await;
    assert_eq!(deleted.status, 200);
    let again = agent
        .delete(&format!("/process/interpreter/context/{id}"))
        .await;
    assert_eq!(again.status, 404);
    let gone = run(&agent, json!({"code": "1", "contextId": id})).await;
    assert_eq!(gone.close_code(), Some(CloseCode::Policy));
    assert_eq!(
        agent
            .delete("/process/interpreter/context/default")
            .await
            .status,
        400
    );
    let bad_cwd = agent
        .post_json(
            "/process/interpreter/context",
            json!({"cwd": "/no/such/dir"}),
        )
        .await;
    assert_eq!(bad_cwd.status, 400);
    let bad_language = agent
        .post_json("/process/interpreter/context", json!({"language": "cobol"}))
        .await;
    assert_eq!(bad_language.status, 400);
}

#[tokio::test]
async fn a_dead_interpreter_is_reported_and_restarted() {
    let agent = Agent::start();
    let died = code(&agent, "import os\nos._exit(3)").await;
    let error = died.error().expect("no error event");
    assert_eq!(error["name"], "InterpreterExited");
    assert!(error["value"].as_str().unwrap().contains("code 3"));
    assert_eq!(code(&agent, "print('back')").await.stdout(), "back\n");
}
