//! Copies of a VM's files: saved memory cloned between directories, and a
//! running VM frozen for the instant its files are cloned.

use std::fs;
use std::io;
use std::path::PathBuf;
use std::time::Instant;

use super::layout::VmLayout;
use super::running::RunningVm;
use super::saved::SavedMachine;
use super::{blocking, reflink, remove_if_present, RuntimeError, VmRuntime};

/// Forgets saved memory: the device state first, so a half-done discard never
/// looks like a usable memory.
pub(super) fn discard_memory_files(layout: &VmLayout) -> io::Result<()> {
    remove_if_present(&layout.state())?;
    remove_if_present(&layout.machine())?;
    remove_if_present(&layout.ram())
}

/// Copies saved memory and disk from one directory to another (reflinks),
/// replacing what is there; the device state last. The copy has no owner.
pub(super) fn clone_saved(from: &VmLayout, to: &VmLayout) -> io::Result<()> {
    remove_if_present(&to.state())?;
    reflink::clone_replacing(&from.disk(), &to.disk())?;
    reflink::clone_replacing(&from.ram(), &to.ram())?;
    let machine = SavedMachine {
        owner: None,
        ..SavedMachine::read(&from.machine())?
    };
    machine.write(&to.machine())?;
    reflink::clone_replacing(&from.state(), &to.state())
}

impl VmRuntime {
    /// Stops a running VM for the instant of `work` (which copies its files),
    /// then lets it run on. With `state`, the device state is saved there first.
    pub(super) async fn with_vm_frozen<T: Send + 'static>(
        &self,
        id: &str,
        vm: &RunningVm,
        state: Option<PathBuf>,
        work: impl FnOnce(&str) -> Result<T, RuntimeError> + Send + 'static,
    ) -> Result<T, RuntimeError> {
        let began = Instant::now();
        vm.machine
            .pause_vcpus()
            .await
            .map_err(RuntimeError::machine(id, "stop the vCPUs"))?;
        let saved = match &state {
            Some(path) => vm
                .machine
                .save_state(path)
                .await
                .map_err(RuntimeError::machine(id, "save the device state")),
            None => Ok(()),
        };
        let result = match saved {
            Ok(()) => blocking(id, work).await,
            Err(error) => Err(error),
        };
        let resumed = vm.machine.resume().await;
        tracing::debug!(
            sandbox = id,
            frozen_ms = began.elapsed().as_secs_f64() * 1e3,
            "vm frozen for a copy"
        );
        resumed.map_err(RuntimeError::machine(id, "continue the vCPUs"))?;
        result
    }

    /// Copies a sandbox's disk and memory into `dest` (a sandbox or capture
    /// directory): from its running VM, frozen only while the files are
    /// cloned, or from the memory it saved when paused.
    pub(super) async fn copy_memory(&self, id: &str, dest: VmLayout) -> Result<(), RuntimeError> {
        self.copy_memory_to_all(id, vec![dest]).await
    }

    /// Like `copy_memory`, into every one of `dests`, all from one instant
    /// of the sandbox. A running VM is frozen once, for one clone: the
    /// other copies are cloned from the first after the VM runs on (nothing
    /// runs on the first copy yet), so the freeze does not grow with their
    /// number. On an error some of `dests` may hold partial copies (never a
    /// device state); their owner removes them.
    pub(super) async fn copy_memory_to_all(
        &self,
        id: &str,
        dests: Vec<VmLayout>,
    ) -> Result<(), RuntimeError> {
        let source = self.layout(id);
        let Some(first) = dests.first().cloned() else {
            return Ok(());
        };
        // A warm pause's memory is in its process; a copy needs it saved.
        self.deepen(id).await?;
        let Some(vm) = self.running(id) else {
            if !source.has_memory() {
                return Err(RuntimeError::NotRunning { id: id.to_owned() });
            }
            return blocking(id, move |id| {
                for dest in &dests {
                    clone_saved(&source, dest).map_err(|source_error| RuntimeError::Io {
                        id: id.to_owned(),
                        action: format!("copy the saved memory of {}", source.dir.display()),
                        source: source_error,
                    })?;
                }
                Ok(())
            })
            .await;
        };
        let vm = vm.lock().await;
        // Written out while the VM still runs, so the clone under the freeze
        // has only what was dirtied since to flush.
        let ram = source.ram();
        blocking(id, move |id| {
            fs::File::open(&ram)
                .and_then(|file| file.sync_data())
                .map_err(RuntimeError::file(id, "flush", &ram))
        })
        .await?;
        let machine = SavedMachine {
            owner: None,
            ..SavedMachine::read(&source.machine()).map_err(RuntimeError::file(
                id,
                "read",
                source.machine(),
            ))?
        };
        let state_partial = first.dir.join("state.partial");
        let (from, to, partial) = (source.clone(), first.clone(), state_partial.clone());
        self.with_vm_frozen(id, &vm, Some(state_partial.clone()), move |id| {
            clone_files(id, &from, &to)?;
            Ok(partial)
        })
        .await
        .inspect_err(|_| {
            let _ = fs::remove_file(&state_partial);
        })?;
        drop(vm);
        let others = dests[1..].to_vec();
        let (from, partial) = (first.clone(), state_partial.clone());
        let machine_for_others = machine.clone();
        blocking(id, move |id| {
            for dest in &others {
                let began = Instant::now();
                clone_files(id, &from, dest)?;
                machine_for_others
                    .write(&dest.machine())
                    .map_err(RuntimeError::file(id, "write", dest.machine()))?;
                // The device state last: with it the copy is whole.
                reflink::clone_replacing(&partial, &dest.state()).map_err(RuntimeError::file(
                    id,
                    "clone the device state to",
                    dest.state(),
                ))?;
                tracing::debug!(
                    sandbox = id,
                    copy = %dest.dir.display(),
                    elapsed_ms = began.elapsed().as_secs_f64() * 1e3,
                    "vm copy cloned from the first"
                );
            }
            Ok(())
        })
        .await
        .inspect_err(|_| {
            let _ = fs::remove_file(&state_partial);
        })?;
        machine.write(&first.machine()).map_err(RuntimeError::file(
            id,
            "write",
            first.machine(),
        ))?;
        fs::rename(&state_partial, first.state()).map_err(RuntimeError::file(
            id,
            "move in place",
            first.state(),
        ))
    }
}

/// Clones the RAM file and the disk of `from` into `to`, whose device state
/// goes first, so the copy is never taken for a whole one meanwhile.
fn clone_files(id: &str, from: &VmLayout, to: &VmLayout) -> Result<(), RuntimeError> {
    remove_if_present(&to.state()).map_err(RuntimeError::file(id, "remove", to.state()))?;
    reflink::clone_replacing(&from.ram(), &to.ram()).map_err(RuntimeError::file(
        id,
        "clone the RAM file to",
        to.ram(),
    ))?;
    reflink::clone_replacing(&from.disk(), &to.disk()).map_err(RuntimeError::file(
        id,
        "clone the disk to",
        to.disk(),
    ))
}
