//! `cove sandbox ...`: manage sandboxes of a running server.

use anyhow::Context;
use reqwest::Method;
use serde_json::{json, Value};

use crate::client::{Client, Connection};

#[derive(clap::Subcommand, Debug)]
pub(crate) enum SandboxCommand {
    /// Create a sandbox and print it.
    Create {
        #[command(flatten)]
        connection: Connection,
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        snapshot: Option<String>,
        #[arg(long)]
        cpu: Option<i64>,
        /// Memory in GiB.
        #[arg(long)]
        memory: Option<i64>,
        /// Disk in GiB.
        #[arg(long)]
        disk: Option<i64>,
        /// A label as KEY=VALUE; repeat for more.
        #[arg(long = "label")]
        labels: Vec<String>,
        /// An environment variable as KEY=VALUE; repeat for more.
        #[arg(long = "env")]
        env: Vec<String>,
        /// Delete the sandbox as soon as it stops.
        #[arg(long)]
        ephemeral: bool,
        #[arg(long)]
        json: bool,
    },
    /// List sandboxes.
    List {
        #[command(flatten)]
        connection: Connection,
        #[arg(long)]
        json: bool,
    },
    /// Show one sandbox.
    Get {
        #[command(flatten)]
        connection: Connection,
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Start a stopped sandbox.
    Start {
        #[command(flatten)]
        connection: Connection,
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Stop a sandbox, keeping its filesystem.
    Stop {
        #[command(flatten)]
        connection: Connection,
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Pause a VM sandbox: its memory goes to disk, its processes continue at resume.
    Pause {
        #[command(flatten)]
        connection: Connection,
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Resume a paused VM sandbox from its memory.
    Resume {
        #[command(flatten)]
        connection: Connection,
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Fork a running VM sandbox (disk and memory) into a new sandbox.
    Fork {
        #[command(flatten)]
        connection: Connection,
        id: String,
        /// Name of the new sandbox.
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Delete a sandbox and everything it holds.
    Delete {
        #[command(flatten)]
        connection: Connection,
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Run a command in a sandbox and print its output; exits with its exit code.
    Exec {
        #[command(flatten)]
        connection: Connection,
        id: String,
        /// Seconds before the command is killed.
        #[arg(long)]
        timeout: Option<u64>,
        #[arg(long)]
        json: bool,
        #[arg(trailing_var_arg = true, required = true)]
        command: Vec<String>,
    },
}

fn pairs(items: &[String], what: &str) -> anyhow::Result<Value> {
    let mut map = serde_json::Map::new();
    for item in items {
        let (k, v) = item
            .split_once('=')
            .with_context(|| format!("{what} {item:?} is not KEY=VALUE"))?;
        map.insert(k.to_owned(), Value::String(v.to_owned()));
    }
    Ok(Value::Object(map))
}

const COLUMNS: [(&str, &str); 6] = [
    ("ID", "id"),
    ("NAME", "name"),
    ("STATE", "state"),
    ("SNAPSHOT", "snapshot"),
    ("CPU", "cpu"),
    ("MEMORY", "memory"),
];

fn cell(sandbox: &Value, key: &str) -> String {
    match &sandbox[key] {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

fn print_table(sandboxes: &[Value]) {
    let rows: Vec<Vec<String>> = sandboxes
        .iter()
        .map(|s| COLUMNS.iter().map(|(_, key)| cell(s, key)).collect())
        .collect();
    let widths: Vec<usize> = COLUMNS
        .iter()
        .enumerate()
        .map(|(i, (title, _))| {
            rows.iter()
                .map(|r| r[i].len())
                .max()
                .unwrap_or(0)
                .max(title.len())
        })
        .collect();
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}", w = *w))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(COLUMNS.iter().map(|(title, _)| title.to_string()).collect());
    for row in rows {
        line(row);
    }
}

fn show(sandbox: &Value, json: bool) {
    if json {
        println!("{sandbox}");
    } else {
        print_table(std::slice::from_ref(sandbox));
    }
}

/// A call whose answer is one sandbox, shown as a table row or JSON.
async fn one_sandbox(
    connection: &Connection,
    method: Method,
    path: &str,
    json: bool,
) -> anyhow::Result<()> {
    let client = Client::from_connection(connection)?;
    show(&client.api(method, path, None).await?, json);
    Ok(())
}

pub(crate) async fn run(command: SandboxCommand) -> anyhow::Result<()> {
    match command {
        SandboxCommand::Create {
            connection,
            name,
            snapshot,
            cpu,
            memory,
            disk,
            labels,
            env,
            ephemeral,
            json,
        } => {
            let client = Client::from_connection(&connection)?;
            let mut body =
                json!({ "labels": pairs(&labels, "label")?, "env": pairs(&env, "env")? });
            for (key, value) in [
                ("name", json!(name)),
                ("snapshot", json!(snapshot)),
                ("cpu", json!(cpu)),
                ("memory", json!(memory)),
                ("disk", json!(disk)),
            ] {
                if !value.is_null() {
                    body[key] = value;
                }
            }
            if ephemeral {
                body["autoDeleteInterval"] = json!(0);
            }
            show(
                &client.api(Method::POST, "/sandbox", Some(body)).await?,
                json,
            );
        }
        SandboxCommand::List { connection, json } => {
            let client = Client::from_connection(&connection)?;
            let mut all = Vec::new();
            let mut cursor: Option<String> = None;
            loop {
                let path = match &cursor {
                    Some(c) => format!("/sandbox?cursor={c}"),
                    None => "/sandbox".to_owned(),
                };
                let page = client.api(Method::GET, &path, None).await?;
                all.extend(page["items"].as_array().cloned().unwrap_or_default());
                match page["nextCursor"].as_str() {
                    Some(next) if !next.is_empty() => cursor = Some(next.to_owned()),
                    _ => break,
                }
            }
            if json {
                println!("{}", Value::Array(all));
            } else {
                print_table(&all);
            }
        }
        SandboxCommand::Get {
            connection,
            id,
            json,
        } => one_sandbox(&connection, Method::GET, &format!("/sandbox/{id}"), json).await?,
        SandboxCommand::Start {
            connection,
            id,
            json,
        } => {
            one_sandbox(
                &connection,
                Method::POST,
                &format!("/sandbox/{id}/start"),
                json,
            )
            .await?
        }
        SandboxCommand::Pause {
            connection,
            id,
            json,
        } => one_sandbox(&connection, Method::POST, &format!("/vms/{id}/pause"), json).await?,
        SandboxCommand::Resume {
            connection,
            id,
            json,
        } => {
            one_sandbox(
                &connection,
                Method::POST,
                &format!("/vms/{id}/resume"),
                json,
            )
            .await?
        }
        SandboxCommand::Fork {
            connection,
            id,
            name,
            json,
        } => {
            let client = Client::from_connection(&connection)?;
            let body = json!({ "name": name });
            let path = format!("/sandbox/{id}/fork");
            show(&client.api(Method::POST, &path, Some(body)).await?, json);
        }
        SandboxCommand::Stop {
            connection,
            id,
            json,
        } => {
            one_sandbox(
                &connection,
                Method::POST,
                &format!("/sandbox/{id}/stop"),
                json,
            )
            .await?
        }
        SandboxCommand::Delete {
            connection,
            id,
            json,
        } => one_sandbox(&connection, Method::DELETE, &format!("/sandbox/{id}"), json).await?,
        SandboxCommand::Exec {
            connection,
            id,
            timeout,
            json,
            command,
        } => {
            let client = Client::from_connection(&connection)?;
            let sandbox = client
                .api(Method::GET, &format!("/sandbox/{id}"), None)
                .await?;
            let mut body = json!({ "command": command.join(" ") });
            if let Some(timeout) = timeout {
                body["timeout"] = json!(timeout);
            }
            let result = client
                .toolbox(&sandbox, Method::POST, "/process/execute", body)
                .await?;
            if json {
                println!("{result}");
            } else {
                print!("{}", result["result"].as_str().unwrap_or_default());
            }
            let code = result["exitCode"].as_i64().unwrap_or(0);
            if code != 0 {
                std::process::exit(i32::try_from(code).unwrap_or(1).clamp(1, 255));
            }
        }
    }
    Ok(())
}
