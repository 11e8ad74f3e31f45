//! The warm pool: machines of the template already continued from its
//! memory, warmed up and waiting, so that a create from an image takes one
//! instead of starting a QEMU process. Under TCG a new process translates
//! every piece of guest code afresh, which made a create's launch,
//! handshake, identity call and first command cost most of a second; a
//! waiting machine has done all of that once.
//!
//! A waiting machine runs in `{storage}/vms/warm-{random}/`, a subvolume
//! sized like the sandbox it will become, its NIC on the hub port with
//! nothing behind it. A create whose image and resources match takes one
//! (`prepare`): its directory is renamed to the sandbox's, and its QEMU
//! process, which holds its files open and its sockets bound, goes on
//! unaware. Almost: QEMU reopens the disk by its file name when it changes
//! the access it needs (read-only while it saves its state, as for a pause
//! or a fork), so the old name stays behind as a symbolic link to the new
//! one for as long as that process lives. Its pid file now sits in the
//! sandbox's directory, but its command line still names the old one, so
//! `launched-in` records that for `orphan_pid` (and for `forget_launch`,
//! which removes both once the process is gone). The `start` that follows puts the NIC on the sandbox's TAP
//! device (a second port of the same hub) and makes the identity call, as
//! after any restore. The pool is then filled again in the background.
//!
//! The pool keeps its size of machines for each fit it was asked for:
//! the one given to `keep_warm` (the server's default VM size) and, from
//! the first create that found none waiting, each other fit a create asked
//! for, up to [`MAX_FITS`] in all. A size nobody creates costs nothing; an
//! added fit whose machine cannot be made is dropped again, so that it
//! cannot hold up the refilling of the others.
//!
//! Waiting machines belong to the server process: it ends them when it
//! stops (`end_pool`), and one starting up removes those a crash left
//! (`sweep`).

use std::collections::HashMap;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, Notify};

use super::boot::{boot_error, Identity};
use super::bridge;
use super::copy::clone_saved;
use super::guard::StartGuard;
use super::layout::VmLayout;
use super::orphan::{end_orphan, orphan_pid};
use super::running::RunningVm;
use super::{blocking, template, RuntimeError, VmRuntime};
use crate::SandboxId;
use crate::SandboxSpec;

/// What names a waiting machine's directory.
const PREFIX: &str = "warm-";
/// How long a failed fill waits before it tries again.
const RETRY_AFTER: Duration = Duration::from_secs(30);
/// How many fits (image and resources) the pool keeps machines for: each
/// waiting machine holds its memory file and a QEMU process.
const MAX_FITS: usize = 4;

/// A machine that waits to become a sandbox.
pub(super) struct WarmVm {
    /// Where it runs until it is taken.
    pub dir: PathBuf,
    pub vm: RunningVm,
    pub exited: oneshot::Receiver<String>,
}

/// What a waiting machine fits: sandboxes of this image, these resources
/// and this user (whose toolbox agent already runs in it).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Fit {
    rootfs: PathBuf,
    cpu: u32,
    memory_mib: u64,
    disk_gib: u64,
    user: Option<String>,
}

impl Fit {
    fn of(spec: &SandboxSpec) -> Fit {
        Fit {
            rootfs: spec.rootfs.clone(),
            cpu: spec.resources.cpu,
            memory_mib: spec.resources.memory_mib,
            disk_gib: spec.resources.disk_gib,
            user: spec.user.clone(),
        }
    }
}

#[derive(Default)]
pub(super) struct Pool {
    waiting: Mutex<HashMap<Fit, Vec<WarmVm>>>,
    /// What the pool makes machines of, one spec per fit, in the order they
    /// were asked for; empty while the pool is off (size 0).
    wanted: Mutex<Vec<SandboxSpec>>,
    /// Taken when a machine left the pool, or a fit was added.
    taken: Notify,
    filler: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Machines taken by `prepare` whose `start` has not come yet.
    claimed: Mutex<HashMap<String, WarmVm>>,
}

impl Pool {
    fn waiting_for(&self, fit: &Fit) -> usize {
        self.waiting
            .lock()
            .expect("pool lock")
            .get(fit)
            .map_or(0, Vec::len)
    }

    fn take(&self, fit: &Fit) -> Option<WarmVm> {
        let warm = self
            .waiting
            .lock()
            .expect("pool lock")
            .get_mut(fit)
            .and_then(Vec::pop);
        if warm.is_some() {
            self.taken.notify_one();
        }
        warm
    }

    /// The first fit with fewer than `size` machines waiting.
    fn short_of(&self, size: usize) -> Option<SandboxSpec> {
        let wanted = self.wanted.lock().expect("pool lock").clone();
        wanted
            .into_iter()
            .find(|spec| self.waiting_for(&Fit::of(spec)) < size)
    }

    /// Asks for machines like `spec` from now on, unless the pool is off,
    /// has them already, or keeps [`MAX_FITS`] fits.
    fn want(&self, spec: &SandboxSpec) {
        let mut wanted = self.wanted.lock().expect("pool lock");
        let fit = Fit::of(spec);
        if wanted.is_empty() || wanted.len() >= MAX_FITS || wanted.iter().any(|w| Fit::of(w) == fit)
        {
            return;
        }
        wanted.push(neutral(spec));
        drop(wanted);
        self.taken.notify_one();
    }

    /// Stops keeping machines of `fit`, unless it is the first fit (the one
    /// the pool was started with). Whether it did.
    fn give_up(&self, fit: &Fit) -> bool {
        let mut wanted = self.wanted.lock().expect("pool lock");
        match wanted.iter().position(|spec| Fit::of(spec) == *fit) {
            Some(at) if at > 0 => {
                wanted.remove(at);
                true
            }
            _ => false,
        }
    }

    /// How many machines wait, and how many a `prepare` took and its
    /// `start` has not come for yet.
    pub(super) fn counts(&self) -> (usize, usize) {
        let waiting = self
            .waiting
            .lock()
            .expect("pool lock")
            .values()
            .map(Vec::len)
            .sum();
        let claimed = self.claimed.lock().expect("pool lock").len();
        (waiting, claimed)
    }

    /// The machine `prepare` took for sandbox `id`.
    pub(super) fn claimed(&self, id: &str) -> Option<WarmVm> {
        self.claimed.lock().expect("pool lock").remove(id)
    }
}

/// Whether a create of `spec` may take a waiting machine: only one that
/// would continue from the template anyway (templates on, no snapshot
/// layers, no volumes) into a `fresh` directory (none yet, its sockets
/// bindable). Which machine fits is then [`Fit`]'s to say.
fn may_take_warm(templates: bool, spec: &SandboxSpec, fresh: bool) -> bool {
    templates && spec.layers.is_empty() && spec.volumes.is_empty() && fresh
}

/// What a waiting machine is made from: `spec`'s image, resources and
/// user, and nothing else of the sandbox that asked (its identity comes
/// when one is taken). The user's toolbox agent is started in the waiting
/// machine: a new process is most of a start under TCG.
fn neutral(spec: &SandboxSpec) -> SandboxSpec {
    // Its id is replaced by the waiting machine's own (`make_warm`).
    SandboxSpec {
        user: spec.user.clone(),
        ..SandboxSpec::bare(
            spec.id.clone(),
            "sandbox",
            spec.rootfs.clone(),
            spec.resources,
        )
    }
}

impl VmRuntime {
    /// Keeps `size` machines that fit sandboxes like `spec` (its image and
    /// resources) waiting, and as many of each other fit a create asks for
    /// (see the module's text), from now until [`VmRuntime::end_pool`].
    /// First removes what an earlier server process left.
    pub fn keep_warm(self: &Arc<Self>, spec: SandboxSpec, size: usize) {
        let runtime = Arc::clone(self);
        let task = tokio::spawn(async move {
            runtime.sweep().await;
            if size == 0 {
                return;
            }
            *runtime.pool.wanted.lock().expect("pool lock") = vec![neutral(&spec)];
            loop {
                let Some(spec) = runtime.pool.short_of(size) else {
                    runtime.pool.taken.notified().await;
                    continue;
                };
                let fit = Fit::of(&spec);
                match runtime.make_warm(&spec).await {
                    Ok(warm) => {
                        tracing::info!(
                            machine = %warm.dir.display(),
                            cpu = fit.cpu,
                            memory_mib = fit.memory_mib,
                            "a warm VM waits"
                        );
                        runtime
                            .pool
                            .waiting
                            .lock()
                            .expect("pool lock")
                            .entry(fit)
                            .or_default()
                            .push(warm);
                    }
                    // A fit a create added is given up, so that it cannot keep
                    // the others waiting; a later create that misses adds it again.
                    Err(error) if runtime.pool.give_up(&fit) => {
                        tracing::warn!(%error, "could not make a warm VM; no longer keeping its size");
                    }
                    Err(error) => {
                        tracing::warn!(%error, "could not make a warm VM; trying again later");
                        tokio::time::sleep(RETRY_AFTER).await;
                    }
                }
            }
        });
        if let Some(old) = self.pool.filler.lock().expect("pool lock").replace(task) {
            old.abort();
        }
    }

    /// Ends every waiting machine (and one being made) and removes it.
    pub async fn end_pool(&self) {
        self.pool.wanted.lock().expect("pool lock").clear();
        let filler = self.pool.filler.lock().expect("pool lock").take();
        if let Some(filler) = filler {
            filler.abort();
            let _ = filler.await;
        }
        let waiting: Vec<WarmVm> = self
            .pool
            .waiting
            .lock()
            .expect("pool lock")
            .drain()
            .flat_map(|(_, machines)| machines)
            .collect();
        for warm in waiting {
            warm.vm.machine.kill().await;
        }
        self.sweep().await;
    }

    /// Removes the directories of waiting machines, ending their QEMU
    /// processes: a crashed server's, or one this server gave up.
    async fn sweep(&self) {
        let vms = self.config.storage.root().join("vms");
        let Ok(entries) = fs::read_dir(&vms) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            if !name.as_bytes().starts_with(PREFIX.as_bytes()) {
                continue;
            }
            let path = entry.path();
            if path.is_symlink() {
                // The old name of a warm VM a sandbox took: kept while that
                // process runs (its sandbox's `launched-in` names it).
                let target = VmLayout::new(path.clone());
                let in_use = fs::read(target.launched_in())
                    .is_ok_and(|launched| launched == path.as_os_str().as_bytes());
                if !in_use {
                    let _ = fs::remove_file(&path);
                }
                continue;
            }
            let layout = VmLayout::new(path);
            if let Some(pid) = orphan_pid(&layout) {
                end_orphan(&self.jails, pid, false).await;
            }
            if let Err(error) = self.remove_dir("-", &layout.dir).await {
                tracing::warn!(dir = %layout.dir.display(), %error, "removing a warm VM");
            }
        }
    }

    /// A machine of `spec` (one of `wanted`) continued from the template,
    /// told a bare identity and run through the template's warm-up commands
    /// again, in this process.
    async fn make_warm(&self, spec: &SandboxSpec) -> Result<WarmVm, RuntimeError> {
        let id = format!(
            "{PREFIX}{}",
            bridge::random_hex(6).map_err(|source| RuntimeError::Io {
                id: "-".to_owned(),
                action: "read random bytes for a warm VM's name".to_owned(),
                source,
            })?
        );
        // `spec` is already `neutral`: no network, volumes or command.
        let spec = SandboxSpec {
            id: SandboxId::parse(&id).map_err(|_| RuntimeError::InvalidId { id: id.clone() })?,
            ..spec.clone()
        };
        let made = async {
            let layout = self.make_dir(&spec)?;
            let template = self.template_for(&spec).await?;
            let to = layout.clone();
            blocking(&id, move |id| {
                clone_saved(&template, &to).map_err(RuntimeError::file(
                    id,
                    "copy the template",
                    &template.dir,
                ))
            })
            .await?;
            let identity = Identity {
                user: spec.user.clone(),
                // Nothing waits for it: it yields the CPU to sandboxes.
                background: true,
                ..Identity::bare(
                    "sandbox",
                    spec.resources.cpu.max(1),
                    spec.resources.memory_mib,
                    spec.resources.disk_gib << 30,
                )
            };
            let (exited_tx, exited) = oneshot::channel();
            let vm = self.bring_up(&id, &layout, &identity, exited_tx).await?;
            template::warm_up(&vm).await;
            Ok(WarmVm {
                dir: layout.dir,
                vm,
                exited,
            })
        }
        .await;
        if made.is_err() {
            let layout = self.layout(&id);
            if let Some(pid) = orphan_pid(&layout) {
                end_orphan(&self.jails, pid, false).await;
            }
            let _ = self.remove_dir(&id, &layout.dir).await;
        }
        made
    }

    /// Takes a waiting machine for the sandbox of `spec`, if one fits: its
    /// directory becomes the sandbox's. Whether one did.
    pub(super) async fn claim_warm(&self, spec: &SandboxSpec) -> bool {
        let id = spec.id.as_str();
        let layout = self.layout(id);
        let fresh = !layout.dir.exists() && layout.check_socket_paths().is_ok();
        if !may_take_warm(self.config.templates, spec, fresh) {
            return false;
        }
        let fit = Fit::of(spec);
        while let Some(warm) = self.pool.take(&fit) {
            if warm.vm.machine.exited().is_some() {
                let _ = self.remove_dir(id, &warm.dir).await;
                continue;
            }
            let (from, to, name) = (warm.dir.clone(), layout.dir.clone(), id.to_owned());
            let moved = blocking(id, move |id| {
                // Written first: from the rename on, the process is found by it.
                fs::write(
                    VmLayout::new(from.clone()).launched_in(),
                    from.as_os_str().as_bytes(),
                )
                .and_then(|()| fs::rename(&from, &to))
                .map_err(RuntimeError::file(id, "move a warm VM to", &to))?;
                std::os::unix::fs::symlink(&name, &from).map_err(RuntimeError::file(
                    id,
                    "link to its new name",
                    &from,
                ))
            })
            .await;
            match moved {
                Ok(()) => {
                    self.pool
                        .claimed
                        .lock()
                        .expect("pool lock")
                        .insert(id.to_owned(), warm);
                    return true;
                }
                Err(error) => {
                    tracing::warn!(sandbox = id, %error, "could not take a warm VM");
                    warm.vm.machine.kill().await;
                    for dir in [&warm.dir, &layout.dir] {
                        if dir.is_symlink() {
                            let _ = fs::remove_file(dir);
                        }
                        let _ = self.remove_dir(id, dir).await;
                    }
                    return false;
                }
            }
        }
        self.pool.want(spec);
        false
    }

    /// Makes the machine `claim_warm` took the sandbox of `spec`: its NIC on
    /// the sandbox's TAP device, its identity told. Returns the guard of the
    /// running VM, for the caller to commit; on failure the VM is ended.
    pub(super) async fn start_warm(
        &self,
        spec: &SandboxSpec,
        warm: WarmVm,
    ) -> Result<(StartGuard, oneshot::Receiver<String>), RuntimeError> {
        let layout = self.layout(&spec.id);
        let WarmVm { vm, exited, .. } = warm;
        let mut guard = StartGuard::running(layout.clone(), vm);
        match self.hand_over(spec, &layout, &mut guard).await {
            Ok(()) => Ok((guard, exited)),
            Err(error) => {
                guard.abort().await;
                Err(error)
            }
        }
    }

    /// Plugs the NIC of the guard's warm VM into the sandbox's TAP device
    /// and tells it who it is.
    async fn hand_over(
        &self,
        spec: &SandboxSpec,
        layout: &VmLayout,
        guard: &mut StartGuard,
    ) -> Result<(), RuntimeError> {
        let id = spec.id.as_str();
        let identity = Identity::of(spec)?;
        let vm = guard
            .running_mut()
            .ok_or_else(|| RuntimeError::other(id, "the warm VM is gone"))?;
        vm.machine.set_background(false);
        if let Some((tap, _)) = &identity.network {
            vm.machine
                .plug_tap(&tap.device)
                .await
                .map_err(RuntimeError::machine(id, "plug its NIC in"))?;
        }
        self.apply_identity(id, layout, vm, &identity, false)
            .await
            .map_err(|source| boot_error(id, layout, "be told who it is", source))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sized(memory_mib: u64) -> SandboxSpec {
        let resources = crate::Resources {
            cpu: 1,
            memory_mib,
            disk_gib: 3,
        };
        SandboxSpec {
            env: vec![("A".into(), "1".into())],
            ..SandboxSpec::bare(
                crate::SandboxId::parse("s").unwrap(),
                "someone",
                "/images/debian".into(),
                resources,
            )
        }
    }

    fn wanted(pool: &Pool) -> Vec<u64> {
        let wanted = pool.wanted.lock().unwrap();
        wanted.iter().map(|s| s.resources.memory_mib).collect()
    }

    #[test]
    fn only_a_fresh_create_from_the_template_takes_a_waiting_machine() {
        let spec = sized(1024);
        assert!(may_take_warm(true, &spec, true));
        assert!(!may_take_warm(false, &spec, true), "templates off");
        assert!(!may_take_warm(true, &spec, false), "its directory exists");
        let layered = SandboxSpec {
            layers: vec!["/snapshots/s1".into()],
            ..sized(1024)
        };
        assert!(!may_take_warm(true, &layered, true), "a snapshot's layers");
        let with_volume = SandboxSpec {
            volumes: vec![crate::VolumeBind {
                root: "/volumes/v".into(),
                subpath: None,
                target: "/data".into(),
            }],
            ..sized(1024)
        };
        assert!(!may_take_warm(true, &with_volume, true), "volumes");
    }

    #[test]
    fn a_waiting_machine_fits_only_its_image_and_resources() {
        let pool = Pool::default();
        assert!(pool.take(&Fit::of(&sized(1024))).is_none(), "an empty pool");
        assert_eq!(Fit::of(&sized(1024)), Fit::of(&neutral(&sized(1024))));
        assert_ne!(Fit::of(&sized(1024)), Fit::of(&sized(256)));
        let other_image = SandboxSpec {
            rootfs: "/images/alpine".into(),
            ..sized(1024)
        };
        assert_ne!(Fit::of(&sized(1024)), Fit::of(&other_image));
    }

    #[test]
    fn fits_are_added_by_misses_and_given_up_on_failure_except_the_first() {
        let pool = Pool::default();
        // Off (size 0): a miss adds nothing.
        pool.want(&sized(256));
        assert!(wanted(&pool).is_empty());

        *pool.wanted.lock().unwrap() = vec![neutral(&sized(1024))];
        for memory_mib in [256, 256, 1024, 2048, 4096, 8192] {
            pool.want(&sized(memory_mib));
        }
        assert_eq!(wanted(&pool), [1024, 256, 2048, 4096]);
        // What waits is made of no sandbox's identity.
        assert!(pool.wanted.lock().unwrap()[1].env.is_empty());
        assert_eq!(pool.short_of(1).unwrap().resources.memory_mib, 1024);

        assert!(pool.give_up(&Fit::of(&sized(2048))));
        assert!(!pool.give_up(&Fit::of(&sized(1024))));
        assert!(!pool.give_up(&Fit::of(&sized(8192))));
        assert_eq!(wanted(&pool), [1024, 256, 4096]);
    }
}
