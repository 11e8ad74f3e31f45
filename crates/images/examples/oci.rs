//! Pulls or imports one image by hand and prints the progress lines, for
//! trying the crate against a real registry or tarball:
//!
//! ```text
//! cargo run -p cove-images --example oci -- pull <cache-dir> <reference> [user:password]
//! cargo run -p cove-images --example oci -- import <cache-dir> <path> [tag]
//! ```

use std::path::Path;
use std::process::ExitCode;

use cove_images::{Credentials, ImageStore};

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [mode, cache, target, rest @ ..] = args.as_slice() else {
        eprintln!("usage: oci pull <cache-dir> <reference> [user:password] | oci import <cache-dir> <path> [tag]");
        return ExitCode::from(2);
    };
    let store = ImageStore::new(cache);
    let print = |p: &cove_images::Progress| println!("{p}");
    let result = match mode.as_str() {
        "pull" => {
            let credentials =
                rest.first()
                    .and_then(|c| c.split_once(':'))
                    .map(|(u, p)| Credentials {
                        username: u.into(),
                        password: p.into(),
                    });
            store.pull(target, credentials.as_ref(), print).await
        }
        "import" => {
            let (path, tag) = (Path::new(target).to_owned(), rest.first().cloned());
            tokio::task::spawn_blocking(move || store.import(&path, tag.as_deref(), print))
                .await
                .expect("import thread")
        }
        other => {
            eprintln!("unknown mode {other}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(image) => {
            println!("id: {}", image.id);
            println!(
                "manifest: {}",
                image.manifest_digest.as_deref().unwrap_or("-")
            );
            println!("rootfs: {}", image.rootfs.display());
            println!("size: {} bytes", image.size_bytes);
            println!("config: {:?}", image.config);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error (HTTP {}): {e}", e.http_status());
            ExitCode::FAILURE
        }
    }
}
