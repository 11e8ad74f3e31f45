//! The descriptor of a VM's TAP device, opened here (root) and handed to
//! QEMU, which runs unprivileged and could not open it itself: at launch as
//! an inherited descriptor (`-netdev tap,fd=N`), or over QMP when a warm VM
//! is plugged into its sandbox's network.
//!
//! A name cove-net made is a persistent device on the bridge: this attaches
//! to it. Any other name makes a device that lives as long as its
//! descriptors (a flush's TAP on no bridge: see `boot`'s `Identity`).
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// Opens TAP device `name` as QEMU opens one: no packet-info header, with
/// the virtio-net header (which a NIC's saved state may require).
pub(super) fn open(name: &str) -> io::Result<OwnedFd> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a network device name"),
        ));
    }
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(name.bytes()) {
        *slot = byte as libc::c_char;
    }
    request.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
    // SAFETY: TUNSETIFF reads and writes an ifreq, which outlives the call.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut request) } < 0 {
        let error = io::Error::last_os_error();
        return Err(io::Error::new(
            error.kind(),
            format!("open TAP device {name}: {error}"),
        ));
    }
    Ok(tun.into())
}
