//! Bringing a VM up: a cold boot or a restore of saved memory, the agent
//! connected, and the sandbox's identity told to it.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cove_protocol::{GuestNetwork, GuestVolume, IdentityRequest};
use tokio::sync::oneshot;

use super::bridge::{self, Session};
use super::guard::StartGuard;
use super::layout::VmLayout;
use super::machine::{self, Boot, Machine};
use super::orphan::forget_launch;
use super::running::{agent, RunningVm};
use super::saved::SavedMachine;
use super::start::{decide, Plan, StartFacts, VmStart, Wanted};
use super::{
    blocking, disk, qemu, reflink, remove_if_present, shares, RuntimeError, SandboxSpec, VmRuntime,
};
use crate::{NetworkLink, SandboxNetwork, TapLink, VolumeBind};

/// How long a restored VM's agent may take to reopen its port.
pub(super) const RESTORE_AGENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the repeated identity call may take, on the second session.
const IDENTITY_RETRY_TIMEOUT: Duration = Duration::from_secs(30);

/// The end of a log, for errors.
fn log_tail(path: &Path) -> String {
    machine::log_tail(path, 600)
}

/// Why a guest was not told who it is.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("read random bytes for the guest")]
    Entropy(#[source] io::Error),
    #[error("tell the agent its identity")]
    Call(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("reconnect to the agent")]
    Reconnect(#[source] machine::MachineError),
    #[error("the agent did not answer its identity call, on two sessions (the second waited {IDENTITY_RETRY_TIMEOUT:?})")]
    Unanswered,
}

/// A step of bringing `id`'s VM up failed with `source`; the console says why.
pub(super) fn boot_error(
    id: &str,
    layout: &VmLayout,
    step: &'static str,
    source: impl std::error::Error + Send + Sync + 'static,
) -> RuntimeError {
    RuntimeError::Boot {
        id: id.to_owned(),
        step,
        console: log_tail(&layout.console()),
        source: Box::new(source),
    }
}

/// What every step of a start needs to know.
#[derive(Clone, Copy)]
struct Steps<'a> {
    id: &'a str,
    layout: &'a VmLayout,
    identity: &'a Identity,
    /// A restore of saved memory; else a cold boot.
    restore: bool,
    /// The NIC runs on a hub port, the TAP device plugged in after launch.
    hub: bool,
    plan: Plan,
}

/// A step of a start failed; made an error once the guard has ended what
/// the start began, so that the console's end is read after QEMU is gone.
enum Failure {
    Runtime(RuntimeError),
    Boot {
        step: &'static str,
        source: Box<dyn std::error::Error + Send + Sync>,
        /// How many virtiofsds ran, whose logs are added to the console's.
        shares: usize,
    },
}

impl Failure {
    fn boot(
        step: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
        shares: usize,
    ) -> Failure {
        Failure::Boot {
            step,
            source: Box::new(source),
            shares,
        }
    }

    fn into_error(self, id: &str, layout: &VmLayout) -> RuntimeError {
        match self {
            Failure::Runtime(error) => error,
            Failure::Boot {
                step,
                source,
                shares,
            } => {
                let mut console = log_tail(&layout.console());
                if shares > 0 {
                    console.push_str("; ");
                    console.push_str(&shares::logs(layout, shares));
                }
                RuntimeError::Boot {
                    id: id.to_owned(),
                    step,
                    console,
                    source,
                }
            }
        }
    }
}

/// Who a VM is, told to its agent after every boot and restore.
pub(super) struct Identity {
    pub hostname: String,
    pub env: BTreeMap<String, String>,
    pub cpus: u32,
    pub memory_mib: u64,
    pub disk_bytes: u64,
    /// The guest's NIC settings and resolv.conf; `None`: no network.
    pub network: Option<(TapLink, String)>,
    /// Volumes: each a virtio-fs share (see `shares`) the agent mounts at
    /// its target.
    pub volumes: Vec<VolumeBind>,
    /// The image's ENTRYPOINT and CMD, which the agent starts once.
    pub command: Vec<String>,
    /// Who the toolbox runs as; `None`: root.
    pub user: Option<String>,
    /// Without a network: a TAP device that QEMU makes for itself and that
    /// is on no bridge, instead of the hub port. A NIC saved on a TAP has
    /// state that only loads on a TAP (QEMU: "saved image requires
    /// vnet_hdr"); one saved on the hub port loads on either, and is saved
    /// again as the kind it ran on.
    pub detached_tap: Option<String>,
    /// Nothing waits for this machine (a warm pool's): its QEMU runs at the
    /// lowest CPU priority, so that it yields to sandboxes, until taken.
    pub background: bool,
}

impl Identity {
    /// A VM joins the network through a TAP device only.
    pub(super) fn of(spec: &SandboxSpec) -> Result<Identity, RuntimeError> {
        let network = match &spec.network {
            None => None,
            Some(SandboxNetwork {
                link: NetworkLink::Tap(tap),
                resolv_conf,
            }) => Some((tap.clone(), resolv_conf.clone())),
            Some(_) => {
                return Err(RuntimeError::start(
                    &spec.id,
                    "a VM's network is a TAP device, not a namespace",
                ))
            }
        };
        Ok(Identity {
            hostname: spec.hostname.clone(),
            env: spec.env.iter().cloned().collect(),
            cpus: spec.resources.cpu.max(1),
            memory_mib: spec.resources.memory_mib,
            disk_bytes: spec.resources.disk_gib << 30,
            network,
            volumes: spec.volumes.clone(),
            command: spec.command.clone(),
            user: spec.user.clone(),
            detached_tap: None,
            background: false,
        })
    }

    /// A machine of this size with no network, no volumes, no environment
    /// and nothing to start.
    pub(super) fn bare(hostname: &str, cpus: u32, memory_mib: u64, disk_bytes: u64) -> Identity {
        Identity {
            hostname: hostname.to_owned(),
            env: BTreeMap::new(),
            cpus,
            memory_mib,
            disk_bytes,
            network: None,
            volumes: Vec::new(),
            command: Vec::new(),
            user: None,
            detached_tap: None,
            background: false,
        }
    }

    /// Enough to continue a paused VM of this size for a moment, to flush
    /// its disk: bare, its NIC on the hub port or, with `tap`, on a TAP of
    /// its own on no bridge.
    pub(super) fn for_flush(
        cpus: u32,
        memory_mib: u64,
        disk_bytes: u64,
        tap: bool,
    ) -> io::Result<Identity> {
        let detached_tap = if tap {
            Some(format!("cvflush{}", bridge::random_hex(4)?))
        } else {
            None
        };
        Ok(Identity {
            detached_tap,
            ..Identity::bare("", cpus, memory_mib, disk_bytes)
        })
    }

    /// What a machine of this identity asks for, for the start's decision.
    pub(super) fn wanted(&self) -> Wanted {
        Wanted {
            cpus: self.cpus,
            memory_mib: self.memory_mib,
            disk_bytes: self.disk_bytes,
            volumes: !self.volumes.is_empty(),
        }
    }

    fn nic(&self) -> qemu::Nic {
        match &self.network {
            Some((tap, _)) => qemu::Nic::Tap {
                device: tap.device.clone(),
                mac: tap.mac,
            },
            None => match &self.detached_tap {
                Some(device) => qemu::Nic::Tap {
                    device: device.clone(),
                    mac: qemu::UNPLUGGED_MAC,
                },
                None => qemu::Nic::Unplugged,
            },
        }
    }

    async fn apply(&self, session: &Session, grow_root: bool) -> Result<(), IdentityError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        let entropy = bridge::random_hex(64).map_err(IdentityError::Entropy)?;
        let request = IdentityRequest {
            hostname: self.hostname.clone(),
            env: self.env.clone(),
            unix_time_ns: Some(now),
            entropy,
            grow_root,
            disk_bytes: Some(self.disk_bytes),
            network: self
                .network
                .as_ref()
                .map(|(tap, resolv_conf)| GuestNetwork {
                    mac: qemu::mac_text(&tap.mac),
                    address: tap.address,
                    prefix_len: tap.prefix_len,
                    gateway: tap.gateway,
                    resolv_conf: resolv_conf.clone(),
                }),
            volumes: (self.volumes.iter().enumerate())
                .map(|(index, volume)| GuestVolume {
                    tag: shares::tag(index),
                    path: volume.target.clone(),
                })
                .collect(),
            entrypoint: self.command.clone(),
            user: self.user.clone(),
        };
        agent(session)
            .identity(&request)
            .await
            .map_err(|e| IdentityError::Call(Box::new(e)))?;
        Ok(())
    }
}

impl VmRuntime {
    fn machine_spec(
        &self,
        layout: &VmLayout,
        cpus: u32,
        memory_mib: u64,
        nic: qemu::Nic,
        incoming: bool,
    ) -> qemu::MachineSpec {
        qemu::MachineSpec {
            accelerator: self.accelerator,
            tsc_khz: self.tsc_khz,
            cpus,
            memory_mib,
            firmware: self.config.firmware.clone(),
            kernel: self.config.kernel(),
            initramfs: self.config.initramfs(),
            ram_file: layout.ram(),
            disk: layout.disk(),
            console_log: layout.console(),
            qemu_log: layout.qemu_log(),
            agent_chardev: layout.chardev(),
            qmp_socket: layout.qmp(),
            pid_file: layout.pid_file(),
            nic,
            shares: Vec::new(),
            incoming,
            background: false,
        }
    }

    /// The facts a start of the machine in `layout` decides from (see
    /// `start`): with `warm`, none of its files are read.
    pub(super) fn start_facts<'a, W>(
        &self,
        id: &'a str,
        layout: &VmLayout,
        wanted: Wanted,
        warm: Option<W>,
    ) -> Result<StartFacts<'a, W>, RuntimeError> {
        let mut facts = StartFacts {
            id,
            accelerator: self.accelerator,
            warm,
            saved: None,
            disk_bytes: None,
            wanted,
        };
        if facts.warm.is_some() {
            return Ok(facts);
        }
        if layout.has_memory() {
            let saved = SavedMachine::read(&layout.machine()).map_err(RuntimeError::file(
                id,
                "read",
                layout.machine(),
            ))?;
            facts.saved = Some(saved);
        }
        if layout.disk().exists() {
            let size = disk::qcow2_size(&layout.disk()).map_err(|source| RuntimeError::Disk {
                id: id.to_owned(),
                source,
            })?;
            facts.disk_bytes = Some(size);
        }
        Ok(facts)
    }

    /// Boots or restores the machine in `layout`, connects its agent and
    /// tells it who it is. On failure nothing of the machine is left running.
    pub(super) async fn bring_up(
        &self,
        id: &str,
        layout: &VmLayout,
        identity: &Identity,
        exited: oneshot::Sender<String>,
    ) -> Result<RunningVm, RuntimeError> {
        let facts = self.start_facts::<Infallible>(id, layout, identity.wanted(), None)?;
        let (restore, plan) = match decide(facts) {
            Ok(VmStart::Warm(never)) => match never {},
            Ok(VmStart::Restore(plan)) => (true, plan),
            Ok(VmStart::Cold(plan)) => (false, plan),
            Err(refusal) => return Err(RuntimeError::start(id, refusal.reason())),
        };
        let guard = self
            .bring_up_planned(id, layout, identity, restore, plan, exited)
            .await?;
        guard
            .commit()
            .ok_or_else(|| RuntimeError::other(id, "its start ended without its agent"))
    }

    /// Carries out a decided restore (`restore`) or cold boot: the files
    /// made ready, QEMU launched, its agent connected and told who it is.
    /// Returns the guard of the running VM, for the caller to commit; on
    /// failure nothing of the machine is left running.
    pub(super) async fn bring_up_planned(
        &self,
        id: &str,
        layout: &VmLayout,
        identity: &Identity,
        restore: bool,
        plan: Plan,
        exited: oneshot::Sender<String>,
    ) -> Result<StartGuard, RuntimeError> {
        if !restore {
            self.prepare_cold_boot(id, layout, &plan).await?;
        }
        // A RAM file just cloned (template, snapshot, fork) has nothing in the
        // page cache, and a restored guest faulting it in page by page is
        // slow; reading it in while QEMU starts and loads its state is not.
        let warmed = restore.then(|| {
            let ram = layout.ram();
            tokio::task::spawn_blocking(move || reflink::read_ahead(&ram))
        });
        // A QEMU launched here is found by this directory from now on.
        forget_launch(layout).map_err(RuntimeError::file(id, "remove", layout.launched_in()))?;
        let jail = self
            .jails
            .make(plan.cpus, plan.memory_mib)
            .map_err(|source| RuntimeError::Confine {
                id: id.to_owned(),
                source,
            })?;
        let mut guard = StartGuard::jailed(layout.clone(), jail);
        // A cold boot runs on the hub, and so does memory saved on it.
        let hub = !restore || SavedMachine::read(&layout.machine()).is_ok_and(|saved| saved.hub);
        let steps = Steps {
            id,
            layout,
            identity,
            restore,
            hub,
            plan,
        };
        match self
            .launch_and_connect(&steps, &mut guard, exited, warmed)
            .await
        {
            Ok(()) => Ok(guard),
            Err(failure) => {
                guard.abort().await;
                Err(failure.into_error(id, layout))
            }
        }
    }

    /// Before a cold boot: zeroed memory (a sparse file), the disk grown,
    /// and `machine.json` describing the running machine, for the saves
    /// to come.
    async fn prepare_cold_boot(
        &self,
        id: &str,
        layout: &VmLayout,
        plan: &Plan,
    ) -> Result<(), RuntimeError> {
        let ram = layout.ram();
        let prepared = fs::File::create(&ram).and_then(|file| file.set_len(plan.memory_mib << 20));
        prepared.map_err(RuntimeError::file(id, "make", &ram))?;
        if let Some(disk_bytes) = plan.grow_disk_to {
            let (qemu_img, disk) = (self.config.qemu_img.clone(), layout.disk());
            blocking(id, move |id| {
                disk::resize(&qemu_img, &disk, disk_bytes).map_err(|source| RuntimeError::Disk {
                    id: id.to_owned(),
                    source,
                })
            })
            .await?;
        }
        SavedMachine::new(self.accelerator, plan.cpus, plan.memory_mib)
            .write(&layout.machine())
            .map_err(RuntimeError::file(id, "write", layout.machine()))
    }

    /// The steps of a start that `guard` ends if one fails: virtiofsds,
    /// QEMU, the agent's session, the identity call.
    async fn launch_and_connect(
        &self,
        steps: &Steps<'_>,
        guard: &mut StartGuard,
        exited: oneshot::Sender<String>,
        warmed: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    ) -> Result<(), Failure> {
        let Steps { id, layout, .. } = *steps;
        let shares = self.start_shares(steps, guard).await?;
        let share_count = shares.len();
        let began = Instant::now();
        let machine = self
            .launch_machine(steps, guard, shares, exited)
            .await
            .map_err(|e| Failure::boot("launch", e, share_count))?;
        guard.launched(machine);
        if let (true, Some((tap, _)), Some(machine)) =
            (steps.hub, &steps.identity.network, guard.machine())
        {
            machine
                .plug_tap(&tap.device)
                .await
                .map_err(|e| Failure::boot("plug its NIC in", e, share_count))?;
        }
        let launched = began.elapsed();
        if let Some(warmed) = warmed {
            if let Ok(Err(error)) = warmed.await {
                tracing::debug!(sandbox = id, %error, "could not read the RAM file ahead");
            }
        }
        self.connect(steps, guard)
            .await
            .map_err(|e| Failure::boot("connect to its agent", e, 0))?;
        let connected = began.elapsed();
        if let (Some(grow_root), Some(running)) = (steps.plan.identity, guard.running_mut()) {
            self.apply_identity(id, layout, running, steps.identity, grow_root)
                .await
                .map_err(|e| Failure::boot("be told who it is", e, 0))?;
        }
        tracing::debug!(
            sandbox = id,
            launched_ms = launched.as_secs_f64() * 1e3,
            agent_connected_ms = connected.as_secs_f64() * 1e3,
            identity_applied_ms = began.elapsed().as_secs_f64() * 1e3,
            "vm brought up"
        );
        Ok(())
    }

    /// Starts a virtiofsd for each volume, in the guard's jail.
    async fn start_shares(
        &self,
        steps: &Steps<'_>,
        guard: &StartGuard,
    ) -> Result<Vec<OwnedFd>, Failure> {
        let Steps {
            id,
            layout,
            identity,
            ..
        } = *steps;
        if identity.volumes.is_empty() {
            return Ok(Vec::new());
        }
        let Some(virtiofsd) = self.config.virtiofsd.as_deref() else {
            return Err(Failure::Runtime(RuntimeError::Unsupported {
                id: id.to_owned(),
                what: "volumes".to_owned(),
                why: "here: virtiofsd was not found (scripts/vm-setup installs it)".to_owned(),
            }));
        };
        let jail = guard
            .jail()
            .ok_or_else(|| Failure::Runtime(RuntimeError::other(id, "its jail is gone")))?;
        shares::start(virtiofsd, layout, &identity.volumes, jail)
            .await
            .map_err(|source| {
                Failure::Runtime(RuntimeError::Shares {
                    id: id.to_owned(),
                    source,
                })
            })
    }

    /// Launches QEMU in the guard's jail; a restore is left paused.
    async fn launch_machine(
        &self,
        steps: &Steps<'_>,
        guard: &mut StartGuard,
        shares: Vec<OwnedFd>,
        exited: oneshot::Sender<String>,
    ) -> Result<Machine, machine::MachineError> {
        let Steps {
            layout,
            identity,
            restore,
            hub,
            plan,
            ..
        } = *steps;
        let nic = match &identity.network {
            Some(_) if hub => qemu::Nic::Unplugged,
            _ => identity.nic(),
        };
        let mut spec = self.machine_spec(layout, plan.cpus, plan.memory_mib, nic, restore);
        spec.shares = (0..shares.len()).map(shares::tag).collect();
        spec.background = identity.background;
        let boot = if restore {
            Boot::Restore {
                state: layout.state(),
            }
        } else {
            Boot::Cold
        };
        let jail = guard
            .jail_for_launch()
            .ok_or_else(|| machine::MachineError::Failed("its jail is gone".to_owned()))?;
        Machine::launch(&self.config.qemu, &spec, &boot, jail, shares, exited).await
    }

    /// Connects the guard's machine to its agent: a restore is resumed first
    /// (its memory diverges from the saved state from here) and its disk
    /// grown once it runs, when it is to grow.
    async fn connect(
        &self,
        steps: &Steps<'_>,
        guard: &mut StartGuard,
    ) -> Result<(), machine::MachineError> {
        let Steps {
            layout,
            restore,
            plan,
            ..
        } = *steps;
        let machine = guard
            .machine()
            .ok_or_else(|| machine::MachineError::Failed("no machine was launched".to_owned()))?;
        let agent_timeout = if restore {
            remove_if_present(&layout.state()).map_err(|source| machine::MachineError::Io {
                action: format!("remove {}", layout.state().display()),
                source,
            })?;
            machine.resume().await?;
            // Disks become writable (active) only once the VM runs; the
            // guest is told of the new size and the agent waits for it.
            if let Some(disk_bytes) = plan.grow_disk_to {
                machine.resize_disk(disk_bytes).await?;
            }
            RESTORE_AGENT_TIMEOUT
        } else {
            self.config.boot_timeout
        };
        let (session, driver) = machine
            .connect_agent(&layout.chardev(), agent_timeout)
            .await?;
        guard.connected(session, driver);
        Ok(())
    }

    /// Tells a restored or booted guest who it is. Rarely (seen in fork
    /// children under emulation with the CPU contended) the first session
    /// after a restore answers its handshake and then nothing; the call
    /// would wait forever. So it is bounded (`identity_timeout`), and once
    /// it times out the runtime connects to the agent again (the agent
    /// tells a new session from a stale one by the handshake, as after a
    /// server restart) and repeats it: every step of it can be done twice,
    /// and the agent runs one identity call at a time, so a first call that
    /// did arrive finishes before the repeat begins.
    pub(super) async fn apply_identity(
        &self,
        id: &str,
        layout: &VmLayout,
        running: &mut RunningVm,
        identity: &Identity,
        grow_root: bool,
    ) -> Result<(), IdentityError> {
        for (attempt, bound) in [
            (1, self.config.identity_timeout),
            (2, IDENTITY_RETRY_TIMEOUT),
        ] {
            match tokio::time::timeout(bound, identity.apply(&running.session, grow_root)).await {
                Ok(result) => return result,
                Err(_) if attempt == 1 => {
                    tracing::warn!(
                        sandbox = id,
                        "the agent did not answer its identity call; connecting to it again"
                    );
                    running.driver.abort();
                    let (session, driver) = running
                        .machine
                        .connect_agent(&layout.chardev(), RESTORE_AGENT_TIMEOUT)
                        .await
                        .map_err(IdentityError::Reconnect)?;
                    running.session = session;
                    running.driver = driver;
                }
                Err(_) => break,
            }
        }
        Err(IdentityError::Unanswered)
    }

    /// Takes over a VM an earlier server process started, which still runs:
    /// QMP and the agent channel are connected again (the guest's agent
    /// tells the new session from its stale one by the same handshake as
    /// after a restore). It is the same machine: no identity call.
    pub(super) async fn take_over(
        &self,
        id: &str,
        layout: &VmLayout,
        pid: u32,
        exited: oneshot::Sender<String>,
    ) -> Result<RunningVm, RuntimeError> {
        let jail = self.jails.adopt(pid as i32);
        let machine = Machine::adopt(pid, &layout.qmp(), jail, exited)
            .await
            .map_err(RuntimeError::machine(
                id,
                format!("be taken over (qemu pid {pid})"),
            ))?;
        let (session, driver) = machine
            .connect_agent(&layout.chardev(), RESTORE_AGENT_TIMEOUT)
            .await
            .map_err(RuntimeError::machine(id, "reconnect to its agent"))?;
        Ok(RunningVm {
            machine,
            session,
            bridge: None,
            driver,
        })
    }
}
