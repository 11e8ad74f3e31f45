//! The second stage of a VM's boot: `cove-agent vm` is PID 1 on the root
//! disk and makes what a container gets from its host: /proc, /sys, /dev
//! (devtmpfs, already mounted by the first stage), /dev/pts, /dev/shm, /run,
//! the loopback interface, and a root filesystem as large as its disk.
//! `/tmp` stays on the root disk, as in a container.
#![allow(unsafe_code)]

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;

use nix::mount::{mount, MsFlags};

use super::initramfs::{failed, StageError};

/// Mounts the kernel filesystems and brings `lo` up. Errors name the step.
pub fn prepare_system() -> Result<(), StageError> {
    let common = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if !Path::new("/dev/null").exists() {
        mount_fs("devtmpfs", "/dev", MsFlags::MS_NOSUID, Some("mode=0755"))?;
    }
    mount_fs("proc", "/proc", common | MsFlags::MS_NOEXEC, None)?;
    mount_fs("sysfs", "/sys", common | MsFlags::MS_NOEXEC, None)?;
    mount_fs(
        "devpts",
        "/dev/pts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("gid=5,mode=620,ptmxmode=666"),
    )?;
    mount_fs("tmpfs", "/dev/shm", common, Some("mode=1777"))?;
    mount_fs("tmpfs", "/run", common, Some("mode=755"))?;
    for (link, target) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        if fs::symlink_metadata(link).is_err() {
            symlink(target, link).map_err(failed(format!("link {link}")))?;
        }
    }
    let tmp = Path::new("/tmp");
    fs::create_dir_all(tmp).map_err(failed("create /tmp"))?;
    fs::set_permissions(tmp, fs::Permissions::from_mode(0o1777)).map_err(failed("chmod /tmp"))?;
    nix::unistd::sethostname("sandbox").map_err(failed("set the hostname"))?;
    loopback_up().map_err(failed("bring lo up"))?;
    Ok(())
}

fn mount_fs(
    fstype: &str,
    target: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), StageError> {
    fs::create_dir_all(target).map_err(failed(format!("create {target}")))?;
    mount(Some(fstype), target, Some(fstype), flags, data)
        .map_err(failed(format!("mount {fstype} at {target}")))
}

fn loopback_up() -> io::Result<()> {
    let socket = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    // SAFETY: ifreq is plain data; zeroed is a valid value.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(b"lo\0") {
        *slot = *byte as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS fills the flags of the named interface in `request`.
    if unsafe {
        libc::ioctl(
            socket.as_raw_fd(),
            libc::SIOCGIFFLAGS as libc::Ioctl,
            &mut request,
        )
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the union member written by SIOCGIFFLAGS is the flags.
    unsafe {
        request.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    }
    // SAFETY: SIOCSIFFLAGS reads the name and flags from `request`.
    if unsafe {
        libc::ioctl(
            socket.as_raw_fd(),
            libc::SIOCSIFFLAGS as libc::Ioctl,
            &request,
        )
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `_IOW('f', 16, __u64)`: grows a mounted ext4 filesystem to a block count.
const EXT4_IOC_RESIZE_FS: libc::Ioctl = 0x4008_6610;

/// How often, 2 ms apart, the guest looks for a disk the host has just grown
/// (5 s). Counted, not timed: right after a restore from a template's memory
/// the guest's monotonic clock leaps by the time the template lay saved, and a
/// deadline on it expired before the disk had a chance to grow.
const RESIZE_NOTICE_ATTEMPTS: u32 = 2500;

/// Grows the root filesystem to fill its disk (online; the disk may have been
/// made larger than the image it started from), after waiting until the disk
/// is `expected` bytes if that is given. Returns the disk's size in bytes. A
/// filesystem already that large is left alone.
pub fn grow_root(expected: Option<u64>) -> io::Result<u64> {
    let root = fs::File::open("/")?;
    let metadata = root.metadata()?;
    let dev = std::os::unix::fs::MetadataExt::dev(&metadata);
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let size_file = format!("/sys/dev/block/{major}:{minor}/size");
    let mut attempts = 0;
    let bytes = loop {
        let sectors: u64 = fs::read_to_string(&size_file)?
            .trim()
            .parse()
            .map_err(io::Error::other)?;
        let bytes = sectors * 512;
        attempts += 1;
        if expected.is_none_or(|e| bytes >= e) || attempts >= RESIZE_NOTICE_ATTEMPTS {
            break bytes;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    let stats = nix::sys::statvfs::fstatvfs(&root)?;
    let block_size = stats.block_size().max(1);
    let blocks: u64 = bytes / block_size;
    // SAFETY: EXT4_IOC_RESIZE_FS reads one u64 block count; `root` is open.
    if unsafe { libc::ioctl(root.as_raw_fd(), EXT4_IOC_RESIZE_FS, &blocks) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(bytes)
}
