//! The one owner of what a start has begun, until it has succeeded: the
//! VM's jail (cgroup and host ids), the virtiofsds in it and their
//! sockets, the QEMU process (which holds the TAP device's descriptor)
//! and its agent session. A start either [`StartGuard::commit`]s, handing
//! the running VM on, or [`StartGuard::abort`]s at its one failure point,
//! which kills QEMU and waits until it is gone (so nothing holds the TAP
//! device any more), releases the jail (which ends what is left in it, the
//! virtiofsds) and removes the virtiofsds' sockets.
//!
//! Dropped without either (a start whose task was cancelled), it does
//! what it can without waiting: SIGKILLs QEMU (its exit watcher releases
//! the jail), releases a jail no QEMU runs in on a thread of its own, and
//! removes the sockets.

use super::confine::Jail;
use super::layout::VmLayout;
use super::machine::{self, Machine};
use super::running::RunningVm;
use super::shares;

/// What a start has begun; see the module's text.
pub(super) struct StartGuard {
    layout: VmLayout,
    /// The jail, while no QEMU was launched in it (a launched machine's
    /// exit releases it; so does a launch that fails).
    jail: Option<Jail>,
    /// QEMU, launched and not yet connected to its agent.
    machine: Option<Machine>,
    /// QEMU connected to its agent.
    running: Option<RunningVm>,
    /// Until a commit or an abort: what is held is ended on drop.
    armed: bool,
}

impl StartGuard {
    /// Guards a start that has made `jail` for the VM in `layout`.
    pub(super) fn jailed(layout: VmLayout, jail: Jail) -> StartGuard {
        StartGuard {
            layout,
            jail: Some(jail),
            machine: None,
            running: None,
            armed: true,
        }
    }

    /// Guards the start of a VM that already runs (a warm VM being taken).
    pub(super) fn running(layout: VmLayout, vm: RunningVm) -> StartGuard {
        StartGuard {
            layout,
            jail: None,
            machine: None,
            running: Some(vm),
            armed: true,
        }
    }

    /// The jail, for virtiofsds to start in.
    pub(super) fn jail(&self) -> Option<&Jail> {
        self.jail.as_ref()
    }

    /// Hands the jail to a launch: from here the launch, and then the
    /// machine's exit, releases it.
    pub(super) fn jail_for_launch(&mut self) -> Option<Jail> {
        self.jail.take()
    }

    /// Keeps QEMU, launched.
    pub(super) fn launched(&mut self, machine: Machine) {
        self.machine = Some(machine);
    }

    /// QEMU, launched (connected or not).
    pub(super) fn machine(&self) -> Option<&Machine> {
        match &self.running {
            Some(vm) => Some(&vm.machine),
            None => self.machine.as_ref(),
        }
    }

    /// Keeps the machine with its agent's session and the task driving it.
    /// Nothing happens without a launched machine.
    pub(super) fn connected(
        &mut self,
        session: super::bridge::Session,
        driver: tokio::task::JoinHandle<()>,
    ) {
        if let Some(machine) = self.machine.take() {
            self.running = Some(RunningVm {
                machine,
                session,
                bridge: None,
                driver,
            });
        }
    }

    /// The VM connected to its agent.
    pub(super) fn running_mut(&mut self) -> Option<&mut RunningVm> {
        self.running.as_mut()
    }

    /// The start succeeded: the running VM, no longer guarded. `None` if
    /// it never connected (a bug of the caller; the guard then ends it as
    /// on drop).
    pub(super) fn commit(mut self) -> Option<RunningVm> {
        let running = self.running.take();
        self.armed = running.is_none();
        running
    }

    /// The start failed: ends everything it began and waits for it.
    pub(super) async fn abort(mut self) {
        if let Some(vm) = self.running.take() {
            vm.machine.kill().await;
        }
        if let Some(machine) = self.machine.take() {
            machine.kill().await;
        }
        if let Some(jail) = self.jail.take() {
            machine::release(jail).await;
        }
        shares::end(&self.layout);
        // Cancelled before this, the drop ends what is left.
        self.armed = false;
    }
}

impl Drop for StartGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let running = self.running.as_ref().map(|vm| &vm.machine);
        if let Some(machine) = running.or(self.machine.as_ref()) {
            // Not once it is gone: its pid may be another process's by now.
            if machine.exited().is_none() {
                machine::kill_pid(machine.pid);
            }
        }
        if let Some(jail) = self.jail.take() {
            // Releasing waits for the cgroup's processes to die.
            std::thread::spawn(move || jail.release());
        }
        shares::end(&self.layout);
    }
}
