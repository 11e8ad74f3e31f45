//! Warm pauses: a paused VM whose QEMU process is kept.
//!
//! A pause stops the vCPUs, lets go of the TAP device (the NIC runs on a
//! hub port: see `Machine::plug_tap`) and freezes QEMU's cgroup, and keeps
//! the process: its guest RAM is a shared mapping of the RAM file, so the
//! kernel can write it back and drop it under pressure, and a frozen
//! process uses no CPU. A resume thaws it, plugs the sandbox's TAP device
//! in and runs the vCPUs: no new QEMU, so nothing of the guest is
//! translated again under TCG, and nothing is read back.
//!
//! A warm pause deepens into a saved one (device state written, QEMU gone:
//! `VmRuntime::pause`'s other path) after [`VmConfig::warm_pause`], when
//! the host's memory is under pressure (PSI), and at the server's shutdown.
//! Both are `paused` to the engine. A warm-paused machine's directory holds
//! a `warm-paused` marker beside its pid file: after a server crash, a new
//! server finds the frozen process by them and deepens it before anything
//! else touches the sandbox.
//!
//! Every other operation on a paused VM (a capture, a fork from it, a
//! flush) works on saved memory, so it deepens a warm pause first; a stop
//! or a start from disk flushes the guest and ends the process directly.

use std::collections::HashMap;
use std::fs;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::bridge::Bridge;
use super::layout::VmLayout;
use super::machine::Machine;
use super::orphan::orphan_pid;
use super::running::RunningVm;
use super::saved::SavedMachine;
use super::{
    boot, io_error, keep_saved_memory, save_device_state, AgentEndpoint, RuntimeError, SandboxSpec,
    Started, VmRuntime,
};

/// How often the deepener looks at the warm-paused machines and the
/// host's memory pressure.
const DEEPEN_TICK: Duration = Duration::from_secs(1);
/// Memory pressure (PSI `some avg10`, the share of the last ten seconds in
/// which some task waited for memory, in percent) above which the oldest
/// warm pause deepens, one per tick until the pressure is gone.
const PRESSURE_PERCENT: f64 = 10.0;

type Shared = Arc<tokio::sync::Mutex<RunningVm>>;

/// A machine paused warm, since when.
struct Parked {
    vm: Shared,
    since: Instant,
}

/// The machines paused warm, by sandbox.
#[derive(Default)]
pub(super) struct Parking {
    parked: Mutex<HashMap<String, Parked>>,
}

impl Parking {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Parked>> {
        self.parked.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take(&self, id: &str) -> Option<Parked> {
        self.lock().remove(id)
    }

    pub(super) fn holds(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }

    pub(super) fn count(&self) -> usize {
        self.lock().len()
    }

    /// The sandboxes paused warm longer than `age`, and the oldest one.
    fn due(&self, age: Duration) -> (Vec<String>, Option<String>) {
        let parked = self.lock();
        let due = parked
            .iter()
            .filter(|(_, p)| p.since.elapsed() >= age)
            .map(|(id, _)| id.clone())
            .collect();
        let oldest = parked
            .iter()
            .min_by_key(|(_, p)| p.since)
            .map(|(id, _)| id.clone());
        (due, oldest)
    }

    fn ids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }
}

/// PSI's `some avg10` of memory, where the kernel reports it.
fn memory_pressure() -> Option<f64> {
    let text = fs::read_to_string("/proc/pressure/memory").ok()?;
    parse_pressure(&text)
}

fn parse_pressure(text: &str) -> Option<f64> {
    let some = text.lines().find(|line| line.starts_with("some "))?;
    some.split_whitespace()
        .find_map(|field| field.strip_prefix("avg10="))?
        .parse()
        .ok()
}

impl VmRuntime {
    /// Pauses `vm` warm (see the module's text) if this runtime keeps warm
    /// pauses and its NIC can let go of its TAP device. Gives the machine
    /// back when it cannot (`Err`), stopped or running, for a saved pause.
    pub(super) async fn park(
        &self,
        id: &str,
        layout: &VmLayout,
        shared: Shared,
    ) -> Result<(), Shared> {
        if self.config.warm_pause.is_none() {
            return Err(shared);
        }
        let on_hub = SavedMachine::read(&layout.machine()).is_ok_and(|saved| saved.hub);
        if !on_hub {
            return Err(shared);
        }
        let mut vm = shared.lock().await;
        let began = Instant::now();
        let mut steps = [0.0; 3];
        let mut mark = |step: usize| steps[step] = began.elapsed().as_secs_f64() * 1e3;
        let parked = async {
            vm.machine.pause_vcpus().await?;
            mark(0);
            vm.machine.unplug_tap().await?;
            mark(1);
            vm.machine.freeze().await?;
            mark(2);
            fs::write(layout.warm_paused(), b"").map_err(|source| {
                super::machine::MachineError::Io {
                    action: format!("write {}", layout.warm_paused().display()),
                    source,
                }
            })
        }
        .await;
        tracing::debug!(
            sandbox = id,
            stopped_ms = steps[0],
            unplugged_ms = steps[1],
            frozen_ms = steps[2],
            "warm pause steps"
        );
        match parked {
            Ok(()) => {
                vm.bridge.take();
                // The engine no longer watches a paused machine.
                vm.machine.forget_exit();
                drop(vm);
                let since = Instant::now();
                let parked = Parked { vm: shared, since };
                self.parking.lock().insert(id.to_owned(), parked);
                Ok(())
            }
            Err(error) => {
                tracing::warn!(sandbox = id, %error, "a warm pause failed; saving the memory instead");
                let _ = vm.machine.thaw().await;
                drop(vm);
                Err(shared)
            }
        }
    }

    /// Starts a warm-paused VM again for `spec`, if it is one: thawed, on
    /// the sandbox's TAP device, its vCPUs running, and connected to its
    /// agent afresh (the handshake sets the guest's clock, which stood
    /// still). `None`: not paused warm. On failure the machine is ended.
    pub(super) async fn unpark(&self, spec: &SandboxSpec) -> Option<Result<Started, RuntimeError>> {
        let id = spec.id.as_str();
        let Parked { vm: shared, since } = self.parking.take(id)?;
        let began = Instant::now();
        let layout = self.layout(id);
        let mut vm = shared.lock().await;
        if let Some(how) = vm.machine.exited() {
            // Its memory went with it (the OOM killer, an operator's
            // kill): it starts from its disk.
            tracing::warn!(sandbox = id, %how, "the QEMU of a warm pause ended; it starts from its disk");
            let _ = super::remove_if_present(&layout.warm_paused());
            return None;
        }
        let resumed = self.continue_parked(spec, &layout, &mut vm).await;
        let _ = super::remove_if_present(&layout.warm_paused());
        Some(match resumed {
            Ok(exited) => {
                drop(vm);
                self.running
                    .lock()
                    .expect("running map lock")
                    .insert(id.to_owned(), shared);
                tracing::info!(
                    sandbox = id,
                    paused_s = since.elapsed().as_secs(),
                    elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
                    "vm resumed warm"
                );
                Ok(Started {
                    agent: AgentEndpoint::Unix(layout.agent_socket()),
                    exited,
                    accelerator: Some(self.accelerator.name()),
                })
            }
            Err(error) => {
                vm.machine.kill().await;
                Err(error)
            }
        })
    }

    async fn continue_parked(
        &self,
        spec: &SandboxSpec,
        layout: &VmLayout,
        vm: &mut RunningVm,
    ) -> Result<oneshot::Receiver<String>, RuntimeError> {
        let id = spec.id.as_str();
        let identity = boot::Identity::of(spec)?;
        let step = |what: &'static str| RuntimeError::machine(id, what);
        let began = Instant::now();
        vm.machine.thaw().await.map_err(step("thaw"))?;
        let thawed = began.elapsed();
        if let Some((tap, _)) = &identity.network {
            vm.machine
                .plug_tap(&tap.device)
                .await
                .map_err(step("plug its NIC in"))?;
        }
        let plugged = began.elapsed();
        vm.machine.resume().await.map_err(step("run its vCPUs"))?;
        vm.driver.abort();
        let (session, driver) = vm
            .machine
            .connect_agent(&layout.chardev(), boot::RESTORE_AGENT_TIMEOUT)
            .await
            .map_err(step("reconnect to its agent"))?;
        vm.session = session;
        vm.driver = driver;
        let connected = began.elapsed();
        let bridge = Bridge::serve(&layout.agent_socket(), vm.session.clone()).map_err(
            io_error(id, format!("serve {}", layout.agent_socket().display())),
        )?;
        vm.bridge = Some(bridge);
        tracing::debug!(
            sandbox = id,
            thawed_ms = thawed.as_secs_f64() * 1e3,
            plugged_ms = plugged.as_secs_f64() * 1e3,
            agent_connected_ms = connected.as_secs_f64() * 1e3,
            "warm resume steps"
        );
        Ok(vm.machine.renew_exit())
    }

    /// Deepens `id`'s warm pause into a saved one, if it is paused warm
    /// (here, or frozen by an earlier server: found by its marker). Every
    /// operation on a paused VM's saved memory calls this first.
    pub(super) async fn deepen(&self, id: &str) -> Result<(), RuntimeError> {
        let layout = self.layout(id);
        if let Some(Parked { vm: shared, since }) = self.parking.take(id) {
            let began = Instant::now();
            let mut vm = shared.lock().await;
            if let Some(how) = vm.machine.exited() {
                tracing::warn!(sandbox = id, %how, "the QEMU of a warm pause ended; it starts from its disk");
                return super::remove_if_present(&layout.warm_paused())
                    .map_err(RuntimeError::file(id, "remove", layout.warm_paused()));
            }
            vm.bridge.take();
            let saved = async {
                vm.machine.thaw().await?;
                save_device_state(&vm.machine, &layout).await
            }
            .await;
            let partial = match saved {
                Ok(partial) => partial,
                Err(error) => {
                    // Frozen again and kept: its memory is still only in
                    // the process.
                    let _ = vm.machine.freeze().await;
                    drop(vm);
                    let parked = Parked { vm: shared, since };
                    self.parking.lock().insert(id.to_owned(), parked);
                    return Err(
                        RuntimeError::machine(id, "save the memory of a warm pause")(error),
                    );
                }
            };
            keep_saved_memory(
                id,
                &vm.machine,
                &layout,
                &partial,
                Some(id.to_owned()),
                false,
            )
            .await?;
            let _ = super::remove_if_present(&layout.warm_paused());
            tracing::info!(
                sandbox = id,
                warm_for_s = since.elapsed().as_secs(),
                elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
                "a warm pause deepened"
            );
            return Ok(());
        }
        if !layout.warm_paused().exists() {
            return Ok(());
        }
        self.deepen_orphan(id, &layout).await
    }

    /// Deepens the warm pause of a QEMU process an earlier server froze.
    /// One that is gone took its memory with it: the sandbox starts from
    /// its disk next time.
    async fn deepen_orphan(&self, id: &str, layout: &VmLayout) -> Result<(), RuntimeError> {
        let Some(pid) = orphan_pid(layout) else {
            tracing::warn!(
                sandbox = id,
                "its warm-paused QEMU ended while no server ran; it starts from its disk"
            );
            return super::remove_if_present(&layout.warm_paused()).map_err(RuntimeError::file(
                id,
                "remove",
                layout.warm_paused(),
            ));
        };
        let (exited, _) = oneshot::channel();
        let jail = self.jails.adopt(pid);
        let machine = Machine::adopt(pid as u32, &layout.qmp(), jail, exited)
            .await
            .map_err(RuntimeError::machine(
                id,
                format!("be taken over to save its memory (qemu pid {pid})"),
            ))?;
        let partial = match save_device_state(&machine, layout).await {
            Ok(partial) => partial,
            Err(error) => {
                machine.kill().await;
                let _ = super::remove_if_present(&layout.warm_paused());
                return Err(RuntimeError::machine(
                    id,
                    "save the memory of a warm pause an earlier server kept",
                )(error));
            }
        };
        keep_saved_memory(id, &machine, layout, &partial, Some(id.to_owned()), false).await?;
        super::remove_if_present(&layout.warm_paused()).map_err(RuntimeError::file(
            id,
            "remove",
            layout.warm_paused(),
        ))?;
        tracing::info!(sandbox = id, %pid, "saved the memory of a warm pause an earlier server kept");
        Ok(())
    }

    /// Ends a warm-paused machine whose memory is about to be dropped (a
    /// stop, a start from disk): it runs for a moment, off the network, for
    /// its agent to flush what the guest holds in its page cache. Whether
    /// it was paused warm.
    pub(super) async fn end_parked(&self, id: &str) -> bool {
        let Some(Parked { vm: shared, .. }) = self.parking.take(id) else {
            return false;
        };
        let vm = shared.lock().await;
        let layout = self.layout(id);
        let flushed = async {
            vm.machine.thaw().await.ok()?;
            vm.machine.resume().await.ok()?;
            vm.flush_guest_disks().await.then_some(())
        }
        .await;
        if flushed.is_none() {
            tracing::warn!(
                sandbox = id,
                "the agent of a warm-paused VM did not flush its disks before it ended"
            );
        }
        vm.machine.quit().await;
        let _ = super::remove_if_present(&layout.warm_paused());
        true
    }

    /// Kills a warm-paused machine (a delete). Whether it was one.
    pub(super) async fn kill_parked(&self, id: &str) -> bool {
        let Some(Parked { vm: shared, .. }) = self.parking.take(id) else {
            return false;
        };
        shared.lock().await.machine.kill().await;
        true
    }

    /// Deepens the warm pauses an earlier server left (found by their
    /// markers), before the engine looks at any sandbox.
    pub async fn recover_warm_paused(&self) {
        let dir = self.config.storage.root().join("vms");
        let Ok(entries) = fs::read_dir(&dir) else {
            return;
        };
        for entry in entries.flatten() {
            let Some(id) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if !VmLayout::new(entry.path()).warm_paused().exists() {
                continue;
            }
            if let Err(error) = self.deepen(&id).await {
                tracing::warn!(sandbox = id, error = %error, "deepening a warm pause left by an earlier server");
            }
        }
    }

    /// Deepens every warm pause (a server's shutdown: the next server
    /// starts from saved memory).
    pub async fn deepen_all(&self) {
        for id in self.parking.ids() {
            if let Err(error) = self.deepen(&id).await {
                tracing::warn!(sandbox = id, error = %error, "deepening a warm pause at shutdown");
            }
        }
    }

    /// Deepens warm pauses as they come due, or under memory pressure, for
    /// as long as the runtime lives.
    pub fn keep_deepening(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let runtime = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(DEEPEN_TICK).await;
                let Some(runtime) = runtime.upgrade() else {
                    return;
                };
                let Some(age) = runtime.config.warm_pause else {
                    return;
                };
                let (mut due, oldest) = runtime.parking.due(age);
                let pressed = memory_pressure().is_some_and(|avg10| avg10 > PRESSURE_PERCENT);
                if due.is_empty() && pressed {
                    due.extend(oldest);
                }
                for id in due {
                    if let Err(error) = runtime.deepen(&id).await {
                        tracing::warn!(sandbox = id, error = %error, "deepening a warm pause");
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pressure_is_read_from_the_some_line() {
        let text = "some avg10=12.50 avg60=3.00 avg300=0.50 total=123\n\
                    full avg10=1.00 avg60=0.00 avg300=0.00 total=5\n";
        assert_eq!(parse_pressure(text), Some(12.5));
        assert_eq!(parse_pressure("full avg10=1.00\n"), None);
        assert_eq!(parse_pressure(""), None);
    }
}
