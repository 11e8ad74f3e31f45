//! `cove image ...`: root filesystems on this machine.

use std::path::PathBuf;

use anyhow::Context as _;

use cove_runtime::image::ImageStore;

#[derive(clap::Subcommand, Debug)]
pub enum ImageCommand {
    /// Pull a registry image on the server into a snapshot, showing the
    /// download of each layer as a progress bar.
    Pull {
        #[command(flatten)]
        connection: crate::client::Connection,
        /// The image reference (`python:3.12-slim`, `registry:5000/team/app:v2`).
        image: String,
        /// The snapshot's name, used as `snapshot=` at create.
        #[arg(long)]
        name: String,
    },
    /// Register an OCI layout directory or a `docker save` tarball on the
    /// server's host as a snapshot (for hosts without a registry).
    Import {
        #[command(flatten)]
        connection: crate::client::Connection,
        /// The OCI layout directory or tarball (a path on the server's host).
        path: PathBuf,
        /// The snapshot's name, used as `snapshot=` at create.
        #[arg(long)]
        name: String,
    },
    /// Build the default image if needed, then print the path of its root filesystem.
    Default {
        #[arg(long, env = "COVE_IMAGES_DIR", default_value = "/var/lib/cove/images")]
        images_dir: PathBuf,
    },
}

pub async fn run(command: ImageCommand) -> anyhow::Result<()> {
    match command {
        ImageCommand::Pull {
            connection,
            image,
            name,
        } => {
            let client = crate::client::Client::from_connection(&connection)?;
            crate::pull_progress::pull(&client, &image, &name).await?;
        }
        ImageCommand::Import {
            connection,
            path,
            name,
        } => {
            let path = path
                .canonicalize()
                .with_context(|| format!("{} does not exist", path.display()))?;
            let client = crate::client::Client::from_connection(&connection)?;
            eprintln!("importing {} (unpacking its layers)", path.display());
            let body = serde_json::json!({ "name": name, "path": path });
            let snapshot = client
                .api(reqwest::Method::POST, "/snapshots/import", Some(body))
                .await?;
            println!(
                "snapshot {} ({}) is {}",
                snapshot["name"].as_str().unwrap_or("?"),
                snapshot["id"].as_str().unwrap_or("?"),
                snapshot["state"].as_str().unwrap_or("?")
            );
        }
        ImageCommand::Default { images_dir } => {
            let images = ImageStore::new(images_dir);
            if !images.default_is_built() {
                eprintln!("building the default image (Debian bookworm with python3, pip, git, curl; about a minute, once)");
            }
            let rootfs = tokio::task::spawn_blocking(move || {
                images.ensure_default(crate::serve::progress_printer())
            })
            .await??;
            println!("{}", rootfs.display());
        }
    }
    Ok(())
}
