//! A server of the benchmark's own: `cove serve` as a child process on a
//! temporary data directory, removed (storage unmounted) when done. It runs
//! beside any other cove server on the host: it shares the images directory
//! (builds are locked there, so the default image is built once) and takes a
//! bridge, address range, routing table and id pool no other server holds.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use reqwest::Method;

use super::neighbours::Slot;
use crate::client::Client;

const KEY: &str = "cove-bench-key";
/// The first start may build the default image.
const READY_TIMEOUT: Duration = Duration::from_secs(600);

pub(super) struct OwnServer {
    child: tokio::process::Child,
    url: String,
    dir: tempfile::TempDir,
}

impl OwnServer {
    pub(super) async fn start(images_dir: &Path, extra_args: &[&str]) -> anyhow::Result<OwnServer> {
        let slot = Slot::free()?;
        // Short: sandbox sockets live under it and a socket path has 107 bytes.
        let dir = tempfile::Builder::new().prefix("cvb").tempdir_in("/tmp")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let log = std::fs::File::create(dir.path().join("server.log"))?;
        let child = tokio::process::Command::new(std::env::current_exe()?)
            .arg("serve")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .arg("--images-dir")
            .arg(images_dir)
            .args(["--api-key", KEY, "--storage-size-gib", "16"])
            // Any free port: the net scenario runs two of these at once.
            .args(["--ssh-listen", "127.0.0.1:0"])
            .args(slot.args())
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("start the benchmark's server")?;
        let mut server = OwnServer {
            child,
            url: format!("http://127.0.0.1:{port}/api"),
            dir,
        };
        let client = server.client();
        let started = Instant::now();
        loop {
            if client.api(Method::GET, "/sandbox", None).await.is_ok() {
                return Ok(server);
            }
            if let Some(status) = server.child.try_wait()? {
                let log = std::fs::read_to_string(server.dir.path().join("server.log"))?;
                server.cleanup();
                bail!("the benchmark's server exited ({status}):\n{log}");
            }
            if started.elapsed() > READY_TIMEOUT {
                server.cleanup();
                bail!("the benchmark's server did not answer within {READY_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(super) fn client(&self) -> Client {
        Client::new(&self.url, KEY)
    }

    /// Where the server keeps its sandboxes' storage (a VM's files are in
    /// `vms/{id}/`).
    pub(super) fn storage_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("data").join("storage")
    }

    /// The server's peak resident memory so far (VmHWM), in MiB.
    pub(super) fn peak_rss_mb(&self) -> Option<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()?)).ok()?;
        peak_rss_mb(&status)
    }

    /// Ends the server and removes everything it made on the host.
    pub(super) async fn stop(mut self) -> anyhow::Result<()> {
        // SIGTERM first: the server removes its sandbox network (bridge,
        // firewall tables, routes) on the way out.
        if let Some(pid) = self.child.id() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        if tokio::time::timeout(Duration::from_secs(20), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
        }
        self.cleanup();
        Ok(())
    }

    fn cleanup(&mut self) {
        let storage = self.dir.path().join("data").join("storage");
        let mounted = std::fs::read_to_string("/proc/self/mountinfo")
            .is_ok_and(|m| m.lines().any(|l| l.split(' ').nth(4) == storage.to_str()));
        if !mounted {
            return;
        }
        // The last sandbox's processes may still be exiting after a delete
        // answered; they hold the mount for a moment.
        for _ in 0..50 {
            let unmounted = std::process::Command::new("umount")
                .arg(&storage)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if unmounted {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("warning: could not unmount {}", storage.display());
    }
}

/// VmHWM of a `/proc/<pid>/status` text, in MiB.
pub(super) fn peak_rss_mb(status: &str) -> Option<f64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_vmhwm() {
        let status = "Name:\tcove\nVmPeak:\t  9000 kB\nVmHWM:\t    2048 kB\n";
        assert_eq!(super::peak_rss_mb(status), Some(2.0));
        assert_eq!(super::peak_rss_mb("Name: x\n"), None);
    }
}
