//! `cove image ...`: root filesystems on this machine.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

use cove_images::ImageStore;

#[derive(clap::Subcommand, Debug)]
pub(crate) enum ImageCommand {
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
    /// Register an OCI layout directory or a `docker save` tarball as a
    /// snapshot (for hosts without a registry). The server reads images
    /// only from its import directory: a path elsewhere is hard-linked
    /// (or copied) into it for the import and removed after.
    Import {
        #[command(flatten)]
        connection: crate::client::Connection,
        /// The OCI layout directory or tarball, on the server's host.
        path: PathBuf,
        /// The server's import directory (its `serve --import-dir`).
        #[arg(long, env = "COVE_IMPORT_DIR", default_value = "/var/lib/cove/import")]
        import_dir: PathBuf,
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

pub(crate) async fn run(command: ImageCommand) -> anyhow::Result<()> {
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
            import_dir,
            name,
        } => {
            let path = path
                .canonicalize()
                .with_context(|| format!("{} does not exist", path.display()))?;
            let import_dir = import_dir.canonicalize().with_context(|| {
                format!(
                    "the server's import directory {} does not exist (is the server on this \
                     machine? give its --import-dir)",
                    import_dir.display()
                )
            })?;
            let client = crate::client::Client::from_connection(&connection)?;
            let staged = Staged::new(&path, &import_dir)?;
            eprintln!("importing {} (unpacking its layers)", path.display());
            let body = serde_json::json!({ "name": name, "path": staged.relative });
            let snapshot = client
                .api(reqwest::Method::POST, "/snapshots/import", Some(body))
                .await;
            drop(staged);
            let snapshot = snapshot?;
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
                eprintln!("building the default image (Debian bookworm with python3, git, curl, a desktop and language servers; a few minutes, once)");
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

/// An import source inside the server's import directory: the path itself
/// when it is there already, else a hard-linked (or, across filesystems,
/// copied; `std::fs::copy` reflinks where the filesystem can) stand-in,
/// removed when this is dropped.
struct Staged {
    /// Relative to the import directory, as the server wants it.
    relative: PathBuf,
    /// What to remove afterwards.
    made: Option<PathBuf>,
}

impl Staged {
    fn new(path: &Path, import_dir: &Path) -> anyhow::Result<Staged> {
        if let Ok(inside) = path.strip_prefix(import_dir) {
            return Ok(Staged {
                relative: inside.to_owned(),
                made: None,
            });
        }
        let base = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "image".into());
        let relative = PathBuf::from(format!(".cove-image-import-{}-{base}", std::process::id()));
        let dest = import_dir.join(&relative);
        let staged = Staged {
            relative,
            made: Some(dest.clone()),
        };
        link_or_copy(path, &dest).with_context(|| {
            format!(
                "putting {} into the server's import directory {} (run this as a user who may \
                 write there, or put the image there yourself)",
                path.display(),
                import_dir.display()
            )
        })?;
        Ok(staged)
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let Some(made) = &self.made else { return };
        let removed = if made.is_dir() {
            std::fs::remove_dir_all(made)
        } else {
            std::fs::remove_file(made)
        };
        if let Err(error) = removed {
            if error.kind() != std::io::ErrorKind::NotFound {
                eprintln!("warning: could not remove {}: {error}", made.display());
            }
        }
    }
}

/// Hard-links `from` (a file, or a directory's files, recursively) at `to`,
/// copying what cannot be linked. Symbolic links are refused: the server
/// would refuse them too.
fn link_or_copy(from: &Path, to: &Path) -> anyhow::Result<()> {
    let meta = std::fs::symlink_metadata(from)?;
    if meta.is_dir() {
        std::fs::create_dir(to).with_context(|| format!("create {}", to.display()))?;
        for entry in std::fs::read_dir(from)? {
            let entry = entry?;
            link_or_copy(&entry.path(), &to.join(entry.file_name()))?;
        }
        Ok(())
    } else if meta.is_file() {
        if std::fs::hard_link(from, to).is_err() {
            std::fs::copy(from, to).with_context(|| format!("copy to {}", to.display()))?;
        }
        Ok(())
    } else {
        anyhow::bail!(
            "{} is a symbolic link or special file, which an import does not follow",
            from.display()
        )
    }
}
