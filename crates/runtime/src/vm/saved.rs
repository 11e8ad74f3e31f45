//! `machine.json`: the machine a saved memory belongs to. A restore must run
//! the same device layout, accelerator, vCPU count and RAM size as the save,
//! whatever the sandbox's spec says now.

use std::fs;
use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::qemu::{Accelerator, LAYOUT_VERSION};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct SavedMachine {
    pub layout: u32,
    pub accelerator: String,
    pub cpus: u32,
    pub memory_mib: u64,
    /// The sandbox whose pause saved this memory, which alone may continue
    /// from it without being told its identity again. A copy (template,
    /// snapshot, fork) has none: its memory holds another sandbox's name
    /// and environment, and random state that a sibling shares.
    #[serde(default)]
    pub owner: Option<String>,
    /// Whether the disk holds everything the guest had written when its
    /// memory was saved. A pause saves the memory without flushing the
    /// guest's page cache first (that flush was most of a pause), so before
    /// such memory is dropped, or the disk is copied without it, the VM
    /// runs once more to flush (`VmRuntime::flush_paused_disk`). Memory
    /// saved before this existed was flushed.
    #[serde(default = "flushed")]
    pub disk_current: bool,
    /// Whether the NIC runs on a QEMU hub port, its TAP device plugged into
    /// the hub while it runs (see `Machine::plug_tap`): such a machine can
    /// let go of its TAP device and keep running, as a warm pause does, and
    /// its saved state loads on any NIC backend. Memory saved before this
    /// existed may have run on its TAP device directly, whose state loads
    /// only on a TAP; it is restored as it was saved.
    #[serde(default)]
    pub hub: bool,
}

fn flushed() -> bool {
    true
}

impl SavedMachine {
    pub(super) fn new(accelerator: Accelerator, cpus: u32, memory_mib: u64) -> SavedMachine {
        SavedMachine {
            layout: LAYOUT_VERSION,
            accelerator: accelerator.name().to_owned(),
            cpus,
            memory_mib,
            owner: None,
            disk_current: true,
            hub: true,
        }
    }

    pub(super) fn read(path: &Path) -> io::Result<SavedMachine> {
        let text = fs::read(path)?;
        serde_json::from_slice(&text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    pub(super) fn write(&self, path: &Path) -> io::Result<()> {
        let text = serde_json::to_vec(self).map_err(io::Error::other)?;
        fs::write(path, text)
    }

    /// Why this memory cannot be restored here, if it cannot.
    pub(super) fn incompatibility(&self, accelerator: Accelerator) -> Option<String> {
        if self.layout != LAYOUT_VERSION {
            return Some(format!(
                "it was saved with device layout {} and this runtime has {LAYOUT_VERSION}",
                self.layout
            ));
        }
        if self.accelerator != accelerator.name() {
            return Some(format!(
                "it was saved under {} and this host runs {}",
                self.accelerator,
                accelerator.name()
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_save_fits_only_its_layout_and_accelerator() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("machine.json");
        let saved = SavedMachine::new(Accelerator::Tcg, 2, 512);
        saved.write(&path).unwrap();
        let read = SavedMachine::read(&path).unwrap();
        assert_eq!(read, saved);
        assert_eq!(read.incompatibility(Accelerator::Tcg), None);
        assert!(read
            .incompatibility(Accelerator::Kvm)
            .unwrap()
            .contains("under tcg"));
        let old = SavedMachine {
            layout: LAYOUT_VERSION + 1,
            ..saved
        };
        assert!(old.incompatibility(Accelerator::Tcg).is_some());
    }

    #[test]
    fn memory_saved_before_the_flag_existed_had_its_disk_flushed() {
        let old: SavedMachine = serde_json::from_str(
            r#"{"layout":2,"accelerator":"tcg","cpus":1,"memory_mib":256,"owner":"a"}"#,
        )
        .unwrap();
        assert!(old.disk_current);
        assert!(!old.hub, "it may have run on its TAP device");
    }
}
