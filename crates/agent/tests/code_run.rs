//! `/process/code-run` through a real agent: Python on the machine's
//! `python3`, JavaScript on its `node`, charts from a Python with matplotlib
//! (`COVE_TEST_MATPLOTLIB_BIN`), runtimes the sandbox lacks, deadlines.

mod common;

use std::time::{Duration, Instant};

use common::Agent;
use serde_json::{json, Value};

async fn code_run(agent: &Agent, request: Value) -> common::Reply {
    agent.post_json("/process/code-run", request).await
}

/// A PATH whose first entry holds matplotlib's Python, or `None` (skipped).
fn matplotlib_path() -> Option<String> {
    let bin = cove_testenv::path(
        "COVE_TEST_MATPLOTLIB_BIN",
        "the bin dir of a Python with matplotlib",
    )?;
    Some(format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    ))
}

#[tokio::test]
async fn python_gets_argv_and_envs_and_answers_output_and_exit_code() {
    let agent = Agent::start();
    let reply = code_run(
        &agent,
        json!({
            "code": "import os, sys\nprint(sys.argv[1:])\nprint(os.environ['GREETING'])\nprint(os.getcwd())\nsys.exit(3)",
            "language": "python",
            "argv": ["a", "b c"],
            // A caller's variable cannot take the prelude's directory away.
            "envs": {"GREETING": "hello there", "COVE_CODE_RUN_DIR": "/nowhere"},
        }),
    )
    .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let body = reply.json();
    let expected = format!("['a', 'b c']\nhello there\n{}\n", agent.work_dir.display());
    assert_eq!(body["exitCode"], 3);
    assert_eq!(body["result"], expected);
    assert_eq!(body["artifacts"]["stdout"], expected);
    assert_eq!(body["artifacts"]["charts"], json!([]));
    assert!(body.get("timedOut").is_none());
}

#[tokio::test]
async fn python_errors_show_the_users_lines_in_order_with_output() {
    let agent = Agent::start();
    let body = code_run(
        &agent,
        json!({"code": "print('before')\ndef f():\n    raise ValueError('boom')\nf()", "language": "python"}),
    )
    .await
    .json();
    assert_eq!(body["exitCode"], 1);
    let result = body["result"].as_str().unwrap();
    assert!(result.starts_with("before\nTraceback"), "{result}");
    assert!(result.contains("line 4, in <module>\n    f()"), "{result}");
    assert!(result.contains("raise ValueError('boom')"), "{result}");
    assert!(result.ends_with("ValueError: boom\n"), "{result}");
    assert!(
        !result.contains("cove_code_run"),
        "prelude frames: {result}"
    );

    let syntax = code_run(&agent, json!({"code": "x = (", "language": "python"}))
        .await
        .json();
    assert_eq!(syntax["exitCode"], 1);
    assert!(syntax["result"].as_str().unwrap().contains("SyntaxError"));
}

#[tokio::test]
async fn each_run_is_a_fresh_process_whose_files_are_removed() {
    let agent = Agent::start();
    let first = code_run(
        &agent,
        json!({"code": "import sys\nx = 1\nprint(sys.modules['cove_code_run'].__file__)", "language": "python"}),
    )
    .await
    .json();
    let prelude = first["result"].as_str().unwrap().trim().to_owned();
    assert!(
        !std::path::Path::new(&prelude).exists(),
        "{prelude} outlived its run"
    );
    let second = code_run(
        &agent,
        json!({"code": "print('x' in globals())", "language": "python"}),
    )
    .await
    .json();
    assert_eq!(second["result"], "False\n");
}

#[tokio::test]
async fn the_deadline_kills_the_run_and_says_so() {
    let agent = Agent::start();
    let started = Instant::now();
    let body = code_run(
        &agent,
        json!({"code": "import time\nprint('begin')\ntime.sleep(30)\nprint('never')", "language": "python", "timeout": 1}),
    )
    .await
    .json();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(body["exitCode"], 124);
    assert_eq!(body["timedOut"], true);
    assert_eq!(body["result"], "begin\n");
}

#[tokio::test]
async fn languages_are_checked_and_a_missing_runtime_is_named() {
    let agent = Agent::start();
    let unknown = code_run(&agent, json!({"code": "1", "language": "cobol"})).await;
    assert_eq!(unknown.status, 400);
    assert!(unknown.json()["message"]
        .as_str()
        .unwrap()
        .contains("cobol"));

    let nothing = tempfile::tempdir().unwrap();
    let path = nothing.path().to_str().unwrap();
    for (language, program) in [
        ("python", "python3"),
        ("javascript", "node"),
        ("typescript", "tsx, ts-node or node"),
    ] {
        let reply = code_run(
            &agent,
            json!({"code": "1", "language": language, "envs": {"PATH": path}}),
        )
        .await;
        assert_eq!(reply.status, 422, "{language}: {:?}", reply.body);
        let body = reply.json();
        assert_eq!(body["code"], "UNPROCESSABLE_ENTITY");
        let message = body["message"].as_str().unwrap();
        assert!(message.contains(program), "{message}");
        assert!(message.contains(language), "{message}");
    }
}

#[tokio::test]
async fn javascript_runs_on_node_with_argv_and_envs() {
    if !cove_testenv::program("node", "apt-get install nodejs") {
        return;
    }
    let agent = Agent::start();
    let body = code_run(
        &agent,
        json!({
            "code": "console.log(process.argv.slice(2).join('|'));\nconsole.error(process.env.GREETING);\nprocess.exit(4);",
            "language": "javascript",
            "argv": ["a", "b c"],
            "envs": {"GREETING": "hi"},
        }),
    )
    .await
    .json();
    assert_eq!(body["exitCode"], 4, "{body}");
    assert_eq!(body["result"], "a|b c\nhi\n");
    assert_eq!(body["artifacts"]["charts"], json!([]));
}

#[tokio::test]
async fn matplotlib_figures_come_back_as_typed_charts() {
    let Some(path) = matplotlib_path() else {
        return;
    };
    let agent = Agent::start_with(&[("PATH", &path)]);
    let code = "\
import matplotlib.pyplot as plt
print('plotting')
plt.figure()
plt.plot([0, 1, 2], [0, 1, 4], label='squares')
plt.title('Growth')
plt.xlabel('x')
plt.ylabel('y')
plt.show()
plt.close()
fig, ax = plt.subplots()
ax.bar(['apples', 'pears'], [3, 5.5])
ax.set_title('Fruit')
print('done')
";
    let body = code_run(&agent, json!({"code": code, "language": "python"}))
        .await
        .json();
    assert_eq!(body["exitCode"], 0, "{body}");
    // Nothing of the charts in the program's output, and no warning.
    assert_eq!(body["result"], "plotting\ndone\n");
    let charts = body["artifacts"]["charts"].as_array().unwrap();
    assert_eq!(charts.len(), 2, "one shown, one left open: {charts:?}");
    let line = &charts[0];
    assert_eq!(line["type"], "line");
    assert_eq!(line["title"], "Growth");
    assert_eq!(
        (&line["x_label"], &line["y_label"]),
        (&json!("x"), &json!("y"))
    );
    assert_eq!(line["x_scale"], "linear");
    assert!(!line["x_ticks"].as_array().unwrap().is_empty());
    assert_eq!(
        line["x_ticks"].as_array().unwrap().len(),
        line["x_tick_labels"].as_array().unwrap().len()
    );
    assert_eq!(
        line["elements"],
        json!([{"label": "squares", "points": [[0.0, 0.0], [1.0, 1.0], [2.0, 4.0]]}])
    );
    assert!(line["png"].as_str().unwrap().starts_with("iVBORw0KGgo"));
    let bar = &charts[1];
    assert_eq!(bar["type"], "bar");
    assert_eq!(bar["title"], "Fruit");
    assert_eq!(
        bar["elements"],
        json!([
            {"label": "apples", "group": "", "value": "3"},
            {"label": "pears", "group": "", "value": "5.5"},
        ])
    );
}

#[tokio::test]
async fn a_program_cannot_jam_the_side_channel() {
    let Some(path) = matplotlib_path() else {
        return;
    };
    let agent = Agent::start_with(&[("PATH", &path)]);
    // The program swaps the charts file for a FIFO nobody writes, then plots.
    let code = "\
import os, sys
import matplotlib.pyplot as plt
run_dir = os.path.dirname(sys.modules['cove_code_run'].__file__)
os.mkfifo(os.path.join(run_dir, 'charts.jsonl'))
print('ok')
";
    let started = Instant::now();
    let body = code_run(
        &agent,
        json!({"code": code, "language": "python", "timeout": 20}),
    )
    .await
    .json();
    assert!(started.elapsed() < Duration::from_secs(15));
    assert_eq!(body["result"], "ok\n");
    assert_eq!(body["artifacts"]["charts"], json!([]));

    // Garbage lines are dropped; the agent still answers the next run.
    let code = "\
import os, sys
run_dir = os.path.dirname(sys.modules['cove_code_run'].__file__)
with open(os.path.join(run_dir, 'charts.jsonl'), 'w') as f:
    f.write('{\"type\": 5}\\nnot json\\n{\"type\":\"line\",\"elements\":[{\"points\":[[1,\"x\"]]}]}\\n')
";
    let body = code_run(&agent, json!({"code": code, "language": "python"}))
        .await
        .json();
    assert_eq!(body["exitCode"], 0, "{body}");
    assert_eq!(body["artifacts"]["charts"], json!([]));
}
