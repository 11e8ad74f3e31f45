//! Pre-booted templates: booting under TCG takes seconds, so a sandbox made
//! from an image continues from a machine that booted once, with its agent
//! ready, and saved its memory. One template per base disk, accelerator,
//! vCPU count and RAM size (and kernel, initramfs and device layout), in
//! `{storage}/vm-templates/{hash}/` beside the sandboxes, so copying it is a
//! reflink. Made lazily by the first `prepare` that needs it (or ahead of
//! time with `VmRuntime::warm_template`), once, under a file lock, and
//! never changed after: a finished template has a `complete` marker.
//!
//! Its disk is as large as the base; sandboxes with larger disks grow theirs
//! when they start.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use sha2::{Digest, Sha256};

use super::boot::Identity;
use super::layout::VmLayout;
use super::running::{self, RunningVm};
use super::saved::SavedMachine;
use super::{blocking, disk, RuntimeError, VmRuntime};

const COMPLETE: &str = "complete";

/// What a template was made of that stays the same when it is remade: its
/// image's root filesystem, vCPUs, RAM and accelerator (its name also
/// hashes the base disk, kernel and initramfs, which an upgrade changes). Two complete
/// templates saying the same here are the same machine, an older and a
/// newer make of it.
const MADE_OF: &str = "made-of";

/// Run in a template before its memory is saved: a program run directly
/// and one through the shell.
const WARM_UP_COMMANDS: [&str; 3] = ["true", "echo warm", "ls / > /dev/null"];

/// The template's directory name: a hash of everything its memory depends on.
fn template_name(runtime: &VmRuntime, base: &Path, cpus: u32, memory_mib: u64) -> String {
    let config = &runtime.config;
    let stamp = |path: &Path| disk::file_stamp(path).unwrap_or_default();
    // `nic=hub`: templates run on a hub port and say so in `machine.json`
    // (see `saved`); one made before it said so is remade once.
    let description = format!(
        "base={} accel={} cpus={cpus} memory={memory_mib} layout={} kernel={} initramfs={} nic=hub",
        base.display(),
        runtime.accelerator.name(),
        super::qemu::LAYOUT_VERSION,
        stamp(&config.kernel()),
        stamp(&config.initramfs()),
    );
    Sha256::digest(description.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Returns the template for these resources, making it first if needed.
pub(super) async fn ensure(
    runtime: &VmRuntime,
    id: &str,
    rootfs: &Path,
    base: &Path,
    cpus: u32,
    memory_mib: u64,
) -> Result<VmLayout, RuntimeError> {
    let templates = runtime.config.storage.root().join("vm-templates");
    let name = template_name(runtime, base, cpus, memory_mib);
    let layout = VmLayout::new(templates.join(&name));
    if layout.dir.join(COMPLETE).exists() {
        return Ok(layout);
    }
    let lock_path = templates.join(format!("{name}.lock"));
    let lock = blocking(id, move |id| {
        let file = File::create(&lock_path).map_err(RuntimeError::file(id, "open", &lock_path))?;
        Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, errno)| {
            RuntimeError::file(id, "lock", &lock_path)(std::io::Error::from(errno))
        })
    })
    .await?;
    if layout.dir.join(COMPLETE).exists() {
        return Ok(layout);
    }
    let began = std::time::Instant::now();
    let partial = VmLayout::new(templates.join(format!("{name}.partial")));
    let mut abandoned = AbandonGuard {
        partial: &partial,
        armed: true,
    };
    let made = make(runtime, id, base, &partial, cpus, memory_mib).await;
    abandoned.armed = false;
    if let Err(error) = made {
        let _ = fs::remove_dir_all(&partial.dir);
        return Err(error);
    }
    let (from, to) = (partial.dir.clone(), layout.dir.clone());
    let made_of = made_of(rootfs, cpus, memory_mib, runtime.accelerator.name());
    blocking(id, move |id| {
        finish(&from, &to, &made_of).map_err(RuntimeError::file(id, "finish", &to))
    })
    .await?;
    drop(lock);
    tracing::info!(
        template = %layout.dir.display(),
        cpus,
        memory_mib,
        elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
        "made a VM template"
    );
    Ok(layout)
}

/// Ends the QEMU of a template being made when the making is given up
/// without finishing: when the server shuts down mid-boot, its runtime drops
/// the task, and QEMU, in its own process group so that sandboxes outlive
/// the server, would run on over a half-made template (and keep the storage
/// busy).
struct AbandonGuard<'a> {
    partial: &'a VmLayout,
    armed: bool,
}

impl Drop for AbandonGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            end_qemu_of(self.partial);
        }
    }
}

/// SIGKILLs the QEMU whose pid file is in `layout`, if it runs on it.
fn end_qemu_of(layout: &VmLayout) {
    if let Some(pid) = super::orphan::orphan_pid(layout) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Boots a machine in `partial`, waits for its agent and saves it.
async fn make(
    runtime: &VmRuntime,
    id: &str,
    base: &Path,
    partial: &VmLayout,
    cpus: u32,
    memory_mib: u64,
) -> Result<(), RuntimeError> {
    if partial.dir.exists() {
        // Left by a server that ended mid-boot; we hold the lock, so any QEMU
        // still on it is nobody's.
        end_qemu_of(partial);
        fs::remove_dir_all(&partial.dir).map_err(RuntimeError::file(id, "remove", &partial.dir))?;
    }
    fs::create_dir_all(&partial.dir).map_err(RuntimeError::file(id, "create", &partial.dir))?;
    super::reflink::set_nocow(&partial.dir).map_err(RuntimeError::file(
        id,
        "make nocow",
        &partial.dir,
    ))?;
    partial
        .check_socket_paths()
        .map_err(|refused| RuntimeError::other(id, refused.to_string()))?;
    let base_bytes = fs::metadata(base)
        .map_err(RuntimeError::file(id, "read", base))?
        .len();
    let (qemu_img, base_owned, disk_path) = (
        runtime.config.qemu_img.clone(),
        base.to_owned(),
        partial.disk(),
    );
    blocking(id, move |id| {
        disk::create_overlay(&qemu_img, &base_owned, &disk_path, base_bytes).map_err(|source| {
            RuntimeError::Disk {
                id: id.to_owned(),
                source,
            }
        })
    })
    .await?;
    let identity = Identity::bare("sandbox", cpus, memory_mib, base_bytes);
    let (exited, _) = tokio::sync::oneshot::channel();
    let mut vm = runtime
        .bring_up(id, partial, &identity, exited)
        .await
        .map_err(|source| RuntimeError::Preboot {
            id: id.to_owned(),
            step: "booted as a template",
            source: Box::new(source),
        })?;
    // Every sandbox continues from this memory: what a first command needs
    // (the programs in the guest's page cache, the agent's paths to run
    // them) is done once here rather than in each of them.
    warm_up(&vm).await;
    let saved = async {
        // What the boot wrote reaches the disk, not only the guest's cache.
        let _ = running::agent(&vm.session).sync().await;
        vm.machine.pause_vcpus().await?;
        vm.machine.save_state(&partial.state()).await
    }
    .await;
    vm.bridge.take();
    vm.machine.quit().await;
    saved.map_err(RuntimeError::machine(id, "save a template"))?;
    SavedMachine::read(&partial.machine()).map_err(RuntimeError::file(
        id,
        "read",
        partial.machine(),
    ))?;
    Ok(())
}

/// Runs [`WARM_UP_COMMANDS`] in a machine; one that fails is only logged.
pub(super) async fn warm_up(vm: &RunningVm) {
    let agent = running::agent(&vm.session);
    for command in WARM_UP_COMMANDS {
        let request = cove_protocol::ExecuteRequest::new(command);
        if let Err(error) = agent.execute(&request).await {
            tracing::debug!(%error, command, "warming a machine up");
        }
    }
}

/// The [`MADE_OF`] line of a template.
fn made_of(rootfs: &Path, cpus: u32, memory_mib: u64, accelerator: &str) -> String {
    format!(
        "rootfs={} cpus={cpus} memory={memory_mib} accel={accelerator}\n",
        rootfs.display()
    )
}

/// Keeps only the files a copy needs, says what the template was made of,
/// and moves it in place.
fn finish(partial: &Path, dir: &Path, made_of: &str) -> std::io::Result<()> {
    for name in ["qmp.sock", "serial.sock", "agent.sock", "qemu.pid"] {
        let _ = fs::remove_file(partial.join(name));
    }
    fs::write(partial.join(MADE_OF), made_of)?;
    File::create(partial.join(COMPLETE))?;
    if dir.exists() {
        fs::remove_dir_all(dir)?;
    }
    fs::rename(partial, dir)
}

/// Deletes each complete template of `templates` that a newer one (by its
/// `complete` marker) was made of the same as ([`MADE_OF`]): an upgrade's
/// new agent, kernel or initramfs makes a template anew, and the old one,
/// which no sandbox needs once copied, would otherwise keep its RAM file
/// and its base disk (which it links) for good. Run as a server starts,
/// before any template is used; the newest stays even when it is the old
/// one, so a server keeps at most one superseded template of each machine
/// until its next start (one more for each change of the agent file while
/// it runs). A template from before `made-of` is kept. Each goes by a
/// rename out of the way first, so one half deleted never looks complete;
/// a failure is logged and leaves the rest. Answers how many went.
pub(super) fn sweep_superseded(templates: &Path) -> usize {
    match superseded(templates) {
        Ok(superseded) => superseded
            .iter()
            .filter(|dir| match delete_template(dir) {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(template = %dir.display(), %error, "cannot delete a VM template a newer one replaced");
                    false
                }
            })
            .count(),
        Err(error) => {
            tracing::warn!(dir = %templates.display(), %error, "cannot list the VM templates");
            0
        }
    }
}

/// Renames `dir` out of the way, then deletes it and its lock file.
fn delete_template(dir: &Path) -> std::io::Result<()> {
    tracing::info!(template = %dir.display(), "deleting a VM template a newer one replaced");
    let doomed = dir.with_extension(DELETING);
    fs::rename(dir, &doomed)?;
    let _ = fs::remove_file(dir.with_extension("lock"));
    fs::remove_dir_all(&doomed)
}

/// The extension of a template being deleted.
const DELETING: &str = "deleting";

/// The complete templates of `templates` a newer one of the same
/// [`MADE_OF`] replaced; what an earlier deletion left half done is
/// deleted here.
fn superseded(templates: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut newest: std::collections::HashMap<String, (std::time::SystemTime, PathBuf)> =
        std::collections::HashMap::new();
    let mut superseded = Vec::new();
    for entry in fs::read_dir(templates)? {
        let dir = entry?.path();
        if dir.extension().is_some_and(|e| e == DELETING) {
            let _ = fs::remove_dir_all(&dir);
            continue;
        }
        if !dir.is_dir() || dir.extension().is_some() {
            continue;
        }
        let (Ok(made_of), Ok(complete)) = (
            read_small(&dir.join(MADE_OF)),
            fs::symlink_metadata(dir.join(COMPLETE)).and_then(|m| m.modified()),
        ) else {
            continue;
        };
        match newest.get_mut(&made_of) {
            Some(kept) if kept.0 >= complete => superseded.push(dir),
            Some(kept) => superseded.push(std::mem::replace(kept, (complete, dir)).1),
            None => {
                newest.insert(made_of, (complete, dir));
            }
        }
    }
    Ok(superseded)
}

/// A template's `made-of`: a regular file, not followed through a link,
/// of at most 4 KiB.
fn read_small(path: &Path) -> std::io::Result<String> {
    crate::beneath::read_regular(path, 4096)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    fn template(templates: &Path, name: &str, made_of: Option<&str>, age_s: u64) -> PathBuf {
        let dir = templates.join(name);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("ram"), b"memory").unwrap();
        if let Some(made_of) = made_of {
            fs::write(dir.join(MADE_OF), made_of).unwrap();
        }
        let complete = File::create(dir.join(COMPLETE)).unwrap();
        complete
            .set_modified(SystemTime::now() - Duration::from_secs(age_s))
            .unwrap();
        File::create(templates.join(format!("{name}.lock"))).unwrap();
        dir
    }

    #[test]
    fn only_the_newest_make_of_each_machine_is_kept() {
        let templates = tempfile::tempdir().unwrap();
        let root = templates.path();
        let small = made_of(Path::new("/images/a/rootfs"), 1, 1024, "tcg");
        let large = made_of(Path::new("/images/a/rootfs"), 2, 4096, "tcg");
        let on_kvm = made_of(Path::new("/images/a/rootfs"), 1, 1024, "kvm");
        let oldest = template(root, "aaaa", Some(&small), 300);
        let newest = template(root, "bbbb", Some(&small), 10);
        let older = template(root, "cccc", Some(&small), 200);
        let other = template(root, "dddd", Some(&large), 500);
        let before_made_of = template(root, "eeee", None, 900);
        let other_accelerator = template(root, "gggg", Some(&on_kvm), 900);
        // What a deletion cut short left.
        fs::create_dir_all(root.join("hhhh.deleting/ram")).unwrap();
        // Being made (no marker yet), and one half-made by a server that died.
        fs::create_dir_all(root.join("ffff")).unwrap();
        fs::write(root.join("ffff").join(MADE_OF), &small).unwrap();
        fs::create_dir_all(root.join("bbbb.partial")).unwrap();

        assert_eq!(sweep_superseded(root), 2);
        assert!(!oldest.exists() && !older.exists());
        assert!(!root.join("aaaa.lock").exists() && !root.join("cccc.lock").exists());
        assert!(!root.join("hhhh.deleting").exists());
        assert!(!root.join("aaaa.deleting").exists());
        for kept in [&newest, &other, &before_made_of, &other_accelerator] {
            assert!(kept.join("ram").exists(), "{}", kept.display());
        }
        assert!(root.join("bbbb.lock").exists());
        assert!(root.join("ffff").exists() && root.join("bbbb.partial").exists());
        // Nothing more goes the next time.
        assert_eq!(sweep_superseded(root), 0);
    }

    #[test]
    fn a_made_of_is_read_only_from_a_small_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        fs::write(&target, "rootfs=/x cpus=1 memory=1\n").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(read_small(&link).is_err());
        assert!(read_small(dir.path()).is_err());
        fs::write(&target, "x".repeat(10_000)).unwrap();
        assert_eq!(read_small(&target).unwrap().len(), 4096);
    }
}
