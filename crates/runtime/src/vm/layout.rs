//! Where a VM sandbox keeps its files: `{storage}/vms/{id}/` (a btrfs
//! subvolume capped at the sandbox's disk plus memory) holds
//!
//! - `disk.qcow2`: the root disk, over the read-only base image;
//! - `ram`: the guest's memory, mapped shared by QEMU;
//! - `state`: device state saved with the memory (only while the VM is not
//!   running and its memory is kept), `machine.json` the machine it fits;
//! - `qmp.sock`, `serial.sock` (QEMU's end of the agent port), `agent.sock`
//!   (the runtime's: the server's toolbox proxy connects here), `qemu.pid`,
//!   `console.log` (the guest's serial console) and `qemu.log` (QEMU's own);
//! - `fs{n}.sock`, `fs{n}.log`: the virtiofsd of the n-th volume.
//!
//! The directory and everything in it is root's, mode 0700 (QEMU, which
//! runs unprivileged, gets descriptors: see `qemu`); the files QEMU writes
//! through them (`ram`, `disk.qcow2`, `console.log`) belong to its user.
//!
//! A memory capture or a template holds the same `disk.qcow2`, `ram`,
//! `state` and `machine.json`. Pure path arithmetic.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// `sun_path` is 108 bytes including the terminating NUL.
const MAX_SOCKET_PATH: usize = 107;

#[derive(Clone, Debug)]
pub(super) struct VmLayout {
    pub dir: PathBuf,
}

impl VmLayout {
    pub(super) fn new(dir: PathBuf) -> VmLayout {
        VmLayout { dir }
    }

    pub(super) fn disk(&self) -> PathBuf {
        self.dir.join("disk.qcow2")
    }
    pub(super) fn ram(&self) -> PathBuf {
        self.dir.join("ram")
    }
    pub(super) fn state(&self) -> PathBuf {
        self.dir.join("state")
    }
    pub(super) fn machine(&self) -> PathBuf {
        self.dir.join("machine.json")
    }
    pub(super) fn qmp(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }
    pub(super) fn chardev(&self) -> PathBuf {
        self.dir.join("serial.sock")
    }
    pub(super) fn agent_socket(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }
    pub(super) fn pid_file(&self) -> PathBuf {
        self.dir.join("qemu.pid")
    }
    pub(super) fn console(&self) -> PathBuf {
        self.dir.join("console.log")
    }
    /// Where the QEMU running on these files was launched, when that was
    /// another directory (a warm VM taken by a sandbox: see `pool`).
    pub(super) fn launched_in(&self) -> PathBuf {
        self.dir.join("launched-in")
    }
    /// Present while the QEMU of `qemu.pid` is paused warm: frozen, its
    /// memory only in the process (see `warm`).
    pub(super) fn warm_paused(&self) -> PathBuf {
        self.dir.join("warm-paused")
    }
    pub(super) fn qemu_log(&self) -> PathBuf {
        self.dir.join("qemu.log")
    }
    /// The vhost-user socket of the `index`th volume's virtiofsd.
    pub(super) fn share_socket(&self, index: usize) -> PathBuf {
        self.dir.join(format!("fs{index}.sock"))
    }
    pub(super) fn share_log(&self, index: usize) -> PathBuf {
        self.dir.join(format!("fs{index}.log"))
    }

    /// Whether memory is saved here: `state` is written last and removed first.
    pub(super) fn has_memory(&self) -> bool {
        self.state().exists() && self.ram().exists() && self.machine().exists()
    }

    /// Rejects a directory whose sockets the kernel could not bind.
    pub(super) fn check_socket_paths(&self) -> Result<(), crate::container::PathRefused> {
        // Volume sockets have at most two more digits than `fs0.sock`.
        for socket in [
            self.qmp(),
            self.chardev(),
            self.agent_socket(),
            self.share_socket(99),
        ] {
            let len = socket.as_os_str().as_bytes().len();
            if len > MAX_SOCKET_PATH {
                return Err(crate::container::PathRefused::SocketTooLong { path: socket, len });
            }
        }
        Ok(())
    }
}

/// The directory of a VM sandbox under the storage root.
pub(super) fn sandbox_dir(storage_root: &Path, id: &str) -> PathBuf {
    storage_root.join("vms").join(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_live_in_the_sandbox_dir() {
        let layout = VmLayout::new(sandbox_dir(Path::new("/data/storage"), "sb1"));
        assert_eq!(layout.disk(), Path::new("/data/storage/vms/sb1/disk.qcow2"));
        assert_eq!(
            layout.agent_socket(),
            Path::new("/data/storage/vms/sb1/agent.sock")
        );
        assert!(layout.check_socket_paths().is_ok());
        let long = VmLayout::new(PathBuf::from(format!("/{}", "x".repeat(100))));
        assert!(long.check_socket_paths().is_err());
    }
}
