//! `cove image ...`: root filesystems on this machine.

use std::path::PathBuf;

use cove_runtime::image::ImageStore;

#[derive(clap::Subcommand, Debug)]
pub enum ImageCommand {
    /// Build the default image if needed, then print the path of its root filesystem.
    Default {
        #[arg(long, env = "COVE_IMAGES_DIR", default_value = "/var/lib/cove/images")]
        images_dir: PathBuf,
    },
}

pub async fn run(command: ImageCommand) -> anyhow::Result<()> {
    match command {
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
