//! Bringing a VM up: a cold boot or a restore of saved memory, the agent
//! connected, and the sandbox's identity told to it.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cove_protocol::{GuestNetwork, GuestVolume, IdentityRequest};
use tokio::sync::oneshot;

use super::bridge::{self, Session};
use super::layout::VmLayout;
use super::machine::{self, Boot, Machine};
use super::running::{agent, RunningVm};
use super::saved::SavedMachine;
use super::{
    blocking, disk, qemu, reflink, remove_if_present, shares, RuntimeError, SandboxSpec, VmRuntime,
};
use crate::{NetworkLink, SandboxNetwork, TapLink, VolumeBind};

/// How long a restored VM's agent may take to reopen its port.
const RESTORE_AGENT_TIMEOUT: Duration = Duration::from_secs(30);
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
fn boot_error(
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
    /// Without a network: a TAP device that QEMU makes for itself and that
    /// is on no bridge, instead of the hub port. A NIC saved on a TAP has
    /// state that only loads on a TAP (QEMU: "saved image requires
    /// vnet_hdr"); one saved on the hub port loads on either, and is saved
    /// again as the kind it ran on.
    pub detached_tap: Option<String>,
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
            detached_tap: None,
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
            detached_tap: None,
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
        }
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
        let saved = if layout.has_memory() {
            let saved = SavedMachine::read(&layout.machine()).map_err(RuntimeError::file(
                id,
                "read",
                layout.machine(),
            ))?;
            if let Some(why) = saved.incompatibility(self.accelerator) {
                return Err(RuntimeError::start(
                    id,
                    format!("its saved memory cannot be restored: {why}"),
                ));
            }
            if !identity.volumes.is_empty() {
                return Err(RuntimeError::start(
                    id,
                    "it has volumes, and a VM with volumes boots cold: its saved memory cannot be restored",
                ));
            }
            Some(saved)
        } else {
            None
        };
        let disk_bytes = identity.disk_bytes;
        let current_disk =
            disk::qcow2_size(&layout.disk()).map_err(|source| RuntimeError::Disk {
                id: id.to_owned(),
                source,
            })?;
        if current_disk > disk_bytes {
            return Err(RuntimeError::start(
                id,
                format!("its disk is {current_disk} bytes, more than the {disk_bytes} asked for; disks cannot shrink"),
            ));
        }
        let (cpus, memory_mib, boot) = match &saved {
            Some(saved) => (
                saved.cpus,
                saved.memory_mib,
                Boot::Restore {
                    state: layout.state(),
                },
            ),
            None => {
                // A cold boot starts from zeroed memory (a sparse file).
                let ram = layout.ram();
                let prepared =
                    fs::File::create(&ram).and_then(|file| file.set_len(identity.memory_mib << 20));
                prepared.map_err(RuntimeError::file(id, "make", &ram))?;
                if current_disk < disk_bytes {
                    let (qemu_img, disk) = (self.config.qemu_img.clone(), layout.disk());
                    blocking(id, move |id| {
                        disk::resize(&qemu_img, &disk, disk_bytes).map_err(|source| {
                            RuntimeError::Disk {
                                id: id.to_owned(),
                                source,
                            }
                        })
                    })
                    .await?;
                }
                (identity.cpus, identity.memory_mib, Boot::Cold)
            }
        };
        if saved.is_none() {
            // Describes the running machine, for the saves to come.
            SavedMachine::new(self.accelerator, cpus, memory_mib)
                .write(&layout.machine())
                .map_err(RuntimeError::file(id, "write", layout.machine()))?;
        }
        // A RAM file just cloned (template, snapshot, fork) has nothing in the
        // page cache, and a restored guest faulting it in page by page is
        // slow; reading it in while QEMU starts and loads its state is not.
        let warmed = saved.as_ref().map(|_| {
            let ram = layout.ram();
            tokio::task::spawn_blocking(move || reflink::read_ahead(&ram))
        });
        // A QEMU launched here is found by this directory from now on.
        super::orphan::forget_launch(layout).map_err(RuntimeError::file(
            id,
            "remove",
            layout.launched_in(),
        ))?;
        let jail = self
            .jails
            .make(cpus, memory_mib)
            .map_err(|source| RuntimeError::Confine {
                id: id.to_owned(),
                source,
            })?;
        let shares = if identity.volumes.is_empty() {
            Vec::new()
        } else {
            let started = match self.config.virtiofsd.as_deref() {
                None => Err(RuntimeError::Unsupported {
                    id: id.to_owned(),
                    what: "volumes".to_owned(),
                    why: "here: virtiofsd was not found (scripts/vm-setup installs it)".to_owned(),
                }),
                Some(virtiofsd) => shares::start(virtiofsd, layout, &identity.volumes, &jail)
                    .await
                    .map_err(|source| RuntimeError::Shares {
                        id: id.to_owned(),
                        source,
                    }),
            };
            match started {
                Ok(shares) => shares,
                Err(error) => {
                    let _ = tokio::task::spawn_blocking(move || jail.release()).await;
                    shares::end(layout);
                    return Err(error);
                }
            }
        };
        let share_count = shares.len();
        let mut spec = self.machine_spec(layout, cpus, memory_mib, identity.nic(), saved.is_some());
        spec.shares = (0..share_count).map(shares::tag).collect();
        let began = Instant::now();
        let launched = Machine::launch(&self.config.qemu, &spec, &boot, jail, shares, exited).await;
        let machine = match launched {
            Ok(machine) => machine,
            Err(e) => {
                let mut error = boot_error(id, layout, "launch", e);
                if let (true, RuntimeError::Boot { console, .. }) = (share_count > 0, &mut error) {
                    console.push_str("; ");
                    console.push_str(&shares::logs(layout, share_count));
                }
                shares::end(layout);
                return Err(error);
            }
        };
        let launched = began.elapsed();
        if let Some(warmed) = warmed {
            if let Ok(Err(error)) = warmed.await {
                tracing::debug!(sandbox = id, %error, "could not read the RAM file ahead");
            }
        }
        let connected = async {
            let agent_timeout = if saved.is_some() {
                // From here the memory diverges from the saved state.
                remove_if_present(&layout.state()).map_err(|source| machine::MachineError::Io {
                    action: format!("remove {}", layout.state().display()),
                    source,
                })?;
                machine.resume().await?;
                // Disks become writable (active) only once the VM runs; the
                // guest is told of the new size and the agent waits for it.
                if current_disk < disk_bytes {
                    machine.resize_disk(disk_bytes).await?;
                }
                RESTORE_AGENT_TIMEOUT
            } else {
                self.config.boot_timeout
            };
            machine
                .connect_agent(&layout.chardev(), agent_timeout)
                .await
        }
        .await;
        let (session, driver) = match connected {
            Ok(connected) => connected,
            Err(error) => {
                machine.kill().await;
                shares::end(layout);
                return Err(boot_error(id, layout, "connect to its agent", error));
            }
        };
        let connected = began.elapsed();
        let mut running = RunningVm {
            machine,
            session,
            bridge: None,
            driver,
        };
        // A boot may follow a disk resize; a restore grew the disk just now or not at all.
        let grow_root = saved.is_none() || current_disk < disk_bytes;
        // A sandbox resuming its own paused memory still is who it was, and
        // its clock came with the hello: it needs no identity call.
        let own_memory = saved
            .as_ref()
            .is_some_and(|saved| saved.owner.as_deref() == Some(id));
        if !own_memory || grow_root {
            if let Err(error) = self
                .apply_identity(id, layout, &mut running, identity, grow_root)
                .await
            {
                running.machine.kill().await;
                shares::end(layout);
                return Err(boot_error(id, layout, "be told who it is", error));
            }
        }
        tracing::debug!(
            sandbox = id,
            launched_ms = launched.as_secs_f64() * 1e3,
            agent_connected_ms = connected.as_secs_f64() * 1e3,
            identity_applied_ms = began.elapsed().as_secs_f64() * 1e3,
            "vm brought up"
        );
        Ok(running)
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
