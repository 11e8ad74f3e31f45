//! `cove admin ...`: operator actions on a running server.

use reqwest::Method;
use serde_json::Value;

use crate::client::{Client, Connection};

#[derive(clap::Subcommand, Debug)]
pub(crate) enum AdminCommand {
    /// Reclaim the capacity of spot sandboxes: persistent VMs are paused, the
    /// others deleted. Prints what was done.
    Reclaim {
        #[command(flatten)]
        connection: Connection,
    },
    /// Print an organization's bill for a calendar month: a line per
    /// sandbox and snapshot, the credits and the total.
    Bill {
        /// The organization (a single server has one, `cove`).
        #[arg(long, default_value = "cove")]
        org: String,
        /// The month, `YYYY-MM` (UTC); the current one by default.
        #[arg(long)]
        month: Option<String>,
        /// Print the bill as the API answers it, one JSON object.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        connection: Connection,
    },
    /// List the runners sandboxes run on, with what is allocated on each
    /// and how its host is loaded.
    Runners {
        /// Print the runners as the API answers, one JSON array.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        connection: Connection,
    },
    /// Register a runner on another machine. Prints its id and its token,
    /// which is shown this once: start `cove runner` there with it.
    AddRunner {
        /// A name for people: letters, digits, '.', '_' or '-'.
        name: String,
        /// A word to find it by (repeat for more).
        #[arg(long = "tag")]
        tags: Vec<String>,
        #[command(flatten)]
        connection: Connection,
    },
    /// Delete a runner that holds no sandbox; its token stops working and
    /// its `cove runner` ends at its next report.
    RemoveRunner {
        /// The runner's id (`cove admin runners` lists them).
        runner: String,
        /// Its machine is gone for good: delete it although it holds
        /// sandboxes (it must have stopped reporting). They show `error`,
        /// saying their files went with it, until they are deleted.
        #[arg(long)]
        lost: bool,
        #[command(flatten)]
        connection: Connection,
    },
    /// Drain a runner before taking it down: no new sandbox goes to it,
    /// those it holds stay. `--undo` lets new sandboxes go to it again.
    Drain {
        /// The runner's id (`cove admin runners` lists them).
        runner: String,
        #[arg(long)]
        undo: bool,
        #[command(flatten)]
        connection: Connection,
    },
}

pub(crate) async fn run(command: AdminCommand) -> anyhow::Result<()> {
    match command {
        AdminCommand::Reclaim { connection } => {
            let client = Client::from_connection(&connection)?;
            let done = client.api(Method::POST, "/admin/reclaim", None).await?;
            let items = done.as_array().cloned().unwrap_or_default();
            if items.is_empty() {
                println!("no spot sandbox to reclaim");
            }
            for item in items {
                println!(
                    "{} {}",
                    item["id"].as_str().unwrap_or("?"),
                    item["action"].as_str().unwrap_or("?")
                );
            }
        }
        AdminCommand::Bill {
            org,
            month,
            json,
            connection,
        } => {
            let client = Client::from_connection(&connection)?;
            let mut path = format!("/organizations/{}/bill", encode(&org));
            if let Some(month) = month {
                path.push_str(&format!("?month={}", encode(&month)));
            }
            let bill = client.api(Method::GET, &path, None).await?;
            if json {
                println!("{bill}");
            } else {
                print!("{}", bill_table(&org, &bill));
            }
        }
        AdminCommand::Runners { json, connection } => {
            let client = Client::from_connection(&connection)?;
            let runners = client.api(Method::GET, "/runners", None).await?;
            if json {
                println!("{runners}");
            } else {
                print!("{}", runners_table(&runners));
            }
        }
        AdminCommand::AddRunner {
            name,
            tags,
            connection,
        } => {
            let client = Client::from_connection(&connection)?;
            let body = serde_json::json!({ "name": name, "tags": tags });
            let made = client.api(Method::POST, "/runners", Some(body)).await?;
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            println!("runner {name} registered: {}", text(&made["id"]));
            println!("its token, shown this once: {}", text(&made["apiKey"]));
            println!(
                "on its machine: COVE_RUNNER_TOKEN=<token> cove runner --control {} --data-dir DIR",
                connection.url
            );
        }
        AdminCommand::RemoveRunner {
            runner,
            lost,
            connection,
        } => {
            let client = Client::from_connection(&connection)?;
            let mut path = format!("/runners/{}", encode(&runner));
            if lost {
                path.push_str("?lost=true");
            }
            client.api(Method::DELETE, &path, None).await?;
            match lost {
                true => println!(
                    "runner {runner} deleted as lost; its sandboxes show error until deleted"
                ),
                false => println!("runner {runner} deleted"),
            }
        }
        AdminCommand::Drain {
            runner,
            undo,
            connection,
        } => {
            let client = Client::from_connection(&connection)?;
            let path = format!("/runners/{}/draining", encode(&runner));
            let body = serde_json::json!({ "draining": !undo });
            let done = client.api(Method::PATCH, &path, Some(body)).await?;
            let what = if done["draining"].as_bool() == Some(true) {
                "draining: no new sandbox goes to it"
            } else {
                "not draining: new sandboxes may go to it"
            };
            println!(
                "runner {} ({}) {what}; it holds {} sandboxes",
                done["name"].as_str().unwrap_or("?"),
                done["id"].as_str().unwrap_or("?"),
                done["sandboxes"].as_i64().unwrap_or(0)
            );
        }
    }
    Ok(())
}

/// Runners as a table: a row each, what is allocated of what its host has.
fn runners_table(runners: &Value) -> String {
    let text = |v: &Value| v.as_str().unwrap_or("").to_owned();
    let int = |v: &Value| v.as_i64().unwrap_or(0);
    let mut out = format!(
        "{:<36} {:<16} {:<12} {:<11} {:>7} {:>9} {:>9} {:>8} {:>6}\n",
        "ID", "NAME", "STATE", "SCHEDULING", "CPU", "MEM GiB", "DISK GiB", "STARTED", "LOAD%"
    );
    for runner in runners.as_array().into_iter().flatten() {
        let scheduling = if runner["draining"].as_bool() == Some(true) {
            "draining"
        } else if runner["unschedulable"].as_bool() == Some(true) {
            "off"
        } else {
            "on"
        };
        let of = |allocated: &str, total: &str| {
            format!("{}/{}", int(&runner[allocated]), int(&runner[total]))
        };
        out.push_str(&format!(
            "{:<36} {:<16} {:<12} {:<11} {:>7} {:>9} {:>9} {:>8} {:>6.1}\n",
            text(&runner["id"]),
            text(&runner["name"]),
            text(&runner["state"]),
            scheduling,
            of("currentAllocatedCpu", "cpu"),
            of("currentAllocatedMemoryGiB", "memory"),
            of("currentAllocatedDiskGiB", "disk"),
            int(&runner["currentStartedSandboxes"]),
            runner["currentCpuUsagePercentage"].as_f64().unwrap_or(0.0),
        ));
    }
    out
}

fn encode(part: &str) -> String {
    form_urlencoded::byte_serialize(part.as_bytes()).collect()
}

/// A bill as a table: a row per line, then the credits and the total.
fn bill_table(org: &str, bill: &Value) -> String {
    let text = |v: &Value| v.as_str().unwrap_or("").to_owned();
    let number = |v: &Value| v.as_f64().unwrap_or(0.0);
    let currency = text(&bill["currency"]);
    let mut out = format!(
        "bill of {org}, {} to {} ({currency})\n{:<38} {:<24} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
        text(&bill["from"]),
        text(&bill["to"]),
        "SANDBOX / SNAPSHOT",
        "NAME",
        "vCPU-h",
        "MEM GB-h",
        "DISK GB-h",
        "SNAP GB-mo",
        "AMOUNT"
    );
    for line in bill["lines"].as_array().into_iter().flatten() {
        let id = match (line["sandboxId"].as_str(), line["snapshotId"].as_str()) {
            (Some(id), _) => id.to_owned(),
            (None, Some(id)) => format!("snapshot {id}"),
            (None, None) => "-".to_owned(),
        };
        out.push_str(&format!(
            "{id:<38} {:<24} {:>10.4} {:>10.4} {:>10.4} {:>10.4} {:>10.4}\n",
            text(&line["name"]),
            number(&line["vcpuHours"]),
            number(&line["memoryGbHours"]),
            number(&line["diskGbHours"]),
            number(&line["snapshotGbMonths"]),
            number(&line["amount"]),
        ));
    }
    out.push_str(&format!(
        "credits {:>.4} {currency}\ntotal   {:>.4} {currency}\n",
        number(&bill["credits"]),
        number(&bill["total"])
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runners_print_a_row_each_with_allocated_of_total() {
        let runners = serde_json::json!([
            {"id": "r-1", "name": "node-a", "state": "ready", "draining": true,
             "unschedulable": false, "cpu": 8, "memory": 32, "disk": 200,
             "currentAllocatedCpu": 3, "currentAllocatedMemoryGiB": 6,
             "currentAllocatedDiskGiB": 9, "currentStartedSandboxes": 3,
             "currentCpuUsagePercentage": 12.5},
            {"id": "r-2", "name": "node-b", "state": "unresponsive", "draining": false,
             "unschedulable": true}
        ]);
        let table = runners_table(&runners);
        let rows: Vec<Vec<&str>> = table
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(rows.len(), 3, "{table}");
        assert_eq!(rows[0][0], "ID");
        assert_eq!(
            rows[1],
            ["r-1", "node-a", "ready", "draining", "3/8", "6/32", "9/200", "3", "12.5"]
        );
        assert_eq!(rows[2][..4], ["r-2", "node-b", "unresponsive", "off"]);
    }

    #[test]
    fn a_bill_prints_a_row_per_line_then_credits_and_total() {
        let bill = serde_json::json!({
            "from": "2026-12-01T00:00:00Z", "to": "2027-01-01T00:00:00Z", "currency": "USD",
            "lines": [
                {"sandboxId": "sb-1", "snapshotId": null, "name": "web", "vcpuHours": 2.0,
                 "memoryGbHours": 4.0, "diskGbHours": 30.0, "snapshotGbMonths": 0.0, "amount": 0.1},
                {"sandboxId": null, "snapshotId": "s-1", "name": "base", "vcpuHours": 0.0,
                 "memoryGbHours": 0.0, "diskGbHours": 0.0, "snapshotGbMonths": 12.0, "amount": 0.6}
            ],
            "credits": 3.0, "total": 0.0
        });
        let table = bill_table("cove", &bill);
        let rows: Vec<&str> = table.lines().collect();
        assert_eq!(rows.len(), 6, "{table}");
        assert!(rows[0].contains("2026-12-01T00:00:00Z to 2027-01-01T00:00:00Z (USD)"));
        assert!(
            rows[2].starts_with("sb-1") && rows[2].contains("web") && rows[2].contains("2.0000")
        );
        assert!(rows[3].starts_with("snapshot s-1") && rows[3].contains("12.0000"));
        assert_eq!(rows[4], "credits 3.0000 USD");
        assert_eq!(rows[5], "total   0.0000 USD");
    }
}
