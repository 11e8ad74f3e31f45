//! The first stage of a VM's boot, run as `/init` of the initramfs by the
//! `cove-vm-init` binary: loads the kernel modules the root disk needs (the
//! guest kernel has virtio-mmio and virtio-blk as modules), mounts the root
//! disk and hands over to the agent on it (`cove-agent vm`) as PID 1.
//!
//! The initramfs holds `/init`, the modules and `/modules/load`, the module
//! file names in load order (dependencies first), written by
//! `scripts/vm-assets`. Nothing here runs in a container.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};

/// Where the root disk is mounted before it becomes `/`.
const NEW_ROOT: &str = "/newroot";

/// A step of bringing a VM's system up that failed. Printed whole on the
/// console (nothing walks a chain there), so the cause is in the message.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("{step}: {cause}")]
    Failed {
        step: String,
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{0}")]
    Refused(String),
}

/// `step` failed with the error given to the closure.
pub(crate) fn failed<E: std::error::Error + Send + Sync + 'static>(
    step: impl Into<String>,
) -> impl FnOnce(E) -> StageError {
    let step = step.into();
    move |cause| StageError::Failed {
        step,
        cause: Box::new(cause),
    }
}
/// How long the root device may take to appear after its driver loads.
const ROOT_DEVICE_TIMEOUT: Duration = Duration::from_secs(20);

/// What the kernel command line asks of the first stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootArgs {
    /// `root=`, the block device of the root filesystem.
    pub root: PathBuf,
    /// `rootfstype=`.
    pub fstype: String,
    /// `ro` on the command line mounts the root read-only.
    pub read_only: bool,
    /// `cove.init=`, the program that becomes PID 1 on the root disk.
    pub init: PathBuf,
}

impl BootArgs {
    /// Reads the arguments this stage knows from a kernel command line; the
    /// rest belong to the kernel.
    pub fn parse(cmdline: &str) -> BootArgs {
        let mut args = BootArgs {
            root: "/dev/vda".into(),
            fstype: "ext4".into(),
            read_only: false,
            init: "/usr/local/bin/cove-agent".into(),
        };
        for word in cmdline.split_ascii_whitespace() {
            match word.split_once('=') {
                Some(("root", value)) => args.root = value.into(),
                Some(("rootfstype", value)) => args.fstype = value.into(),
                Some(("cove.init", value)) => args.init = value.into(),
                None if word == "ro" => args.read_only = true,
                None if word == "rw" => args.read_only = false,
                _ => {}
            }
        }
        args
    }
}

/// The module files of `/modules/load`, one per line, in load order.
pub fn module_list(text: &str) -> Vec<&str> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .collect()
}

/// Runs the first stage; returns only on failure, with what failed.
pub fn run() -> String {
    match boot() {
        Ok(never) => match never {},
        Err(error) => error.to_string(),
    }
}

enum Never {}

fn boot() -> Result<Never, StageError> {
    for (fstype, target) in [("devtmpfs", "/dev"), ("proc", "/proc"), ("sysfs", "/sys")] {
        let _ = fs::create_dir_all(target);
        mount(
            Some(fstype),
            target,
            Some(fstype),
            MsFlags::MS_NOSUID,
            None::<&str>,
        )
        .map_err(failed(format!("mount {fstype} at {target}")))?;
    }
    let cmdline = fs::read_to_string("/proc/cmdline").map_err(failed("read /proc/cmdline"))?;
    let args = BootArgs::parse(&cmdline);
    let list = fs::read_to_string("/modules/load").unwrap_or_default();
    for module in module_list(&list) {
        load_module(&Path::new("/modules").join(module))?;
    }
    wait_for(&args.root)?;
    fs::create_dir_all(NEW_ROOT).map_err(failed(format!("create {NEW_ROOT}")))?;
    let mut flags = MsFlags::empty();
    if args.read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(
        Some(&args.root),
        NEW_ROOT,
        Some(args.fstype.as_str()),
        flags,
        None::<&str>,
    )
    .map_err(failed(format!(
        "mount {} ({}) at {NEW_ROOT}",
        args.root.display(),
        args.fstype
    )))?;
    // The second stage mounts /proc and /sys itself; /dev moves along so the
    // console stays open across the switch.
    let _ = nix::mount::umount2("/proc", nix::mount::MntFlags::MNT_DETACH);
    let _ = nix::mount::umount2("/sys", nix::mount::MntFlags::MNT_DETACH);
    let new_dev = Path::new(NEW_ROOT).join("dev");
    let _ = fs::create_dir_all(&new_dev);
    mount(
        Some("/dev"),
        &new_dev,
        None::<&str>,
        MsFlags::MS_MOVE,
        None::<&str>,
    )
    .map_err(failed("move /dev into the root"))?;
    free_initramfs();
    switch_root(&args.init)
}

/// Loads one module file; a module already present is fine.
fn load_module(path: &Path) -> Result<(), StageError> {
    let file = File::open(path).map_err(failed(format!("open {}", path.display())))?;
    let params = CString::default();
    // SAFETY: finit_module reads the module from an open fd and a
    // NUL-terminated parameter string; both outlive the call.
    let result = unsafe {
        libc::syscall(
            libc::SYS_finit_module,
            file.as_raw_fd(),
            params.as_ptr(),
            0 as libc::c_int,
        )
    };
    if result != 0 {
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EEXIST) {
            return Err(failed(format!("load module {}", path.display()))(error));
        }
    }
    Ok(())
}

/// Waits until the driver has made the device node.
fn wait_for(device: &Path) -> Result<(), StageError> {
    let began = Instant::now();
    while !device.exists() {
        if began.elapsed() > ROOT_DEVICE_TIMEOUT {
            return Err(StageError::Refused(format!(
                "root device {} did not appear within {ROOT_DEVICE_TIMEOUT:?}",
                device.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// Deletes the initramfs's files: its memory is not needed after the switch.
fn free_initramfs() {
    let _ = fs::remove_file("/init");
    let _ = fs::remove_dir_all("/modules");
}

/// Makes the mounted root `/` and execs its init as `<init> vm`.
fn switch_root(init: &Path) -> Result<Never, StageError> {
    std::env::set_current_dir(NEW_ROOT).map_err(failed(format!("chdir {NEW_ROOT}")))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(failed(format!("move {NEW_ROOT} to /")))?;
    nix::unistd::chroot(".").map_err(failed("chroot into the root disk"))?;
    std::env::set_current_dir("/").map_err(failed("chdir /"))?;
    let program = CString::new(init.as_os_str().as_encoded_bytes())
        .map_err(|_| StageError::Refused(format!("init path {} contains NUL", init.display())))?;
    let argv = [program.clone(), CString::from(c"vm")];
    let env = [
        CString::from(c"HOME=/root"),
        CString::from(c"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
        CString::from(c"TERM=xterm"),
    ];
    let error = nix::unistd::execve(&program, &argv, &env).unwrap_err();
    Err(failed(format!("exec {}", init.display()))(error))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_overrides_the_defaults() {
        let args = BootArgs::parse("console=ttyS0 root=/dev/vdb rootfstype=xfs ro quiet");
        assert_eq!(args.root, Path::new("/dev/vdb"));
        assert_eq!(args.fstype, "xfs");
        assert!(args.read_only);
        assert_eq!(args.init, Path::new("/usr/local/bin/cove-agent"));
        let defaults = BootArgs::parse("quiet cove.init=/sbin/agent");
        assert_eq!(defaults.root, Path::new("/dev/vda"));
        assert!(!defaults.read_only);
        assert_eq!(defaults.init, Path::new("/sbin/agent"));
    }

    #[test]
    fn the_module_list_skips_blanks_and_comments() {
        let text = "# load order\nvirtio_mmio.ko\n\n  virtio_blk.ko \n";
        assert_eq!(module_list(text), ["virtio_mmio.ko", "virtio_blk.ko"]);
    }
}
