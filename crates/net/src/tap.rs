//! TAP devices: a VM sandbox's port of the bridge. QEMU opens the device by
//! name (`-netdev tap,ifname=...`) and moves the guest's frames through it.
//!
//! The device is made persistent (`TUNSETPERSIST`), so it exists from attach
//! to detach whether or not a QEMU process has it open: a paused VM's QEMU
//! is gone while its sandbox stays attached until the pause completes, and
//! the next QEMU (a resume) opens it again. Made with one ioctl pair on
//! `/dev/net/tun`, then made a port of the bridge over rtnetlink like a veth.
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;

use crate::NetError;

/// Makes the persistent TAP device `name` (no packet-info header, with the
/// virtio-net header QEMU uses). Nothing is left when it fails.
pub(crate) fn create(name: &str) -> Result<(), NetError> {
    let at = |what: &str| format!("{what} TAP device {name}");
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(NetError::Io {
            action: at("name"),
            source: io::Error::from_raw_os_error(libc::EINVAL),
        });
    }
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(NetError::io(at("open /dev/net/tun to make")))?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(name.bytes()) {
        *slot = byte as libc::c_char;
    }
    request.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
    // SAFETY: TUNSETIFF reads an ifreq, which outlives the call.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut request) } < 0 {
        return Err(NetError::io(at("create"))(io::Error::last_os_error()));
    }
    // SAFETY: TUNSETPERSIST takes an integer argument.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
        // Closing the descriptor removes the device again.
        return Err(NetError::io(at("make persistent the"))(
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}
