//! `cove admin ...`: operator actions on a running server.

use reqwest::Method;

use crate::client::{Client, Connection};

#[derive(clap::Subcommand, Debug)]
pub(crate) enum AdminCommand {
    /// Reclaim the capacity of spot sandboxes: persistent VMs are paused, the
    /// others deleted. Prints what was done.
    Reclaim {
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
    }
    Ok(())
}
