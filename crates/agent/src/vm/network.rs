//! The guest's side of a VM sandbox's network: its NIC (the one virtio-net
//! device, `eth0`) gets the MAC, address and default route the host chose,
//! and `/etc/resolv.conf` names cove's resolver. Done with the classic
//! interface and route ioctls, so it needs nothing from the image (no `ip`).
//!
//! It runs after every boot and every restore of someone else's memory: a
//! guest restored from a template, a snapshot or a fork parent starts with
//! that machine's settings, MAC included, and two guests with one MAC on the
//! bridge would take each other's frames.
//!
//! The link is never taken down here. Right after a restore QEMU announces
//! the restored NIC (a config change), and the guest kernel (6.12's
//! virtio_net) handles that in a work item that takes RTNL; taking the link
//! down holds RTNL and waits for that same work item, so a down at that
//! moment hangs the guest's networking for good (seen in fork children: the
//! agent's identity call never answered). The MAC changes while the link is
//! up instead (virtio-net allows that), and a sandbox without a network
//! loses its address and default route rather than its link.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::fs;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// What the host sends in the identity call's `network` (the contract is
/// cove-protocol's).
pub use cove_protocol::GuestNetwork;

const RTF_UP: u16 = 0x0001;
const RTF_GATEWAY: u16 = 0x0002;

/// `struct rtentry` of `<net/route.h>` (libc defines it for musl only).
#[repr(C)]
struct RouteEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

/// The MAC in `aa:bb:cc:dd:ee:ff` form.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next()?;
        if part.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    // A multicast MAC (low bit of the first byte) cannot be a NIC's.
    (parts.next().is_none() && mac[0] & 1 == 0).then_some(mac)
}

/// The netmask of a prefix length (at most 32).
pub fn netmask(prefix_len: u8) -> Ipv4Addr {
    let bits = u32::MAX
        .checked_shl(32 - u32::from(prefix_len.min(32)))
        .unwrap_or(0);
    Ipv4Addr::from(bits)
}

fn sockaddr_of(address: Ipv4Addr) -> libc::sockaddr {
    let inet = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(address).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16 bytes of plain data.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(inet) }
}

/// The guest's NIC: the first interface that is not loopback.
fn nic_name() -> io::Result<String> {
    let mut names: Vec<String> = fs::read_dir("/sys/class/net")?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name != "lo")
        .collect();
    names.sort();
    names
        .into_iter()
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "the VM has no network interface"))
}

struct Interface {
    socket: OwnedFd,
    name: String,
}

impl Interface {
    fn open(name: String) -> io::Result<Interface> {
        // SAFETY: plain socket(2); the descriptor is owned from here.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a new descriptor nothing else owns.
        let socket = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Interface { socket, name })
    }

    fn request(&self) -> libc::ifreq {
        // SAFETY: ifreq is plain data; all-zero is valid.
        let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
        for (slot, byte) in request.ifr_name.iter_mut().zip(self.name.bytes()) {
            *slot = byte as libc::c_char;
        }
        request
    }

    fn ioctl(&self, what: &str, op: libc::c_ulong, request: &mut libc::ifreq) -> io::Result<()> {
        // SAFETY: every op used here reads or writes one ifreq.
        // The request type is `int` on musl and `unsigned long` on glibc.
        if unsafe {
            libc::ioctl(
                self.socket.as_raw_fd(),
                op as libc::Ioctl,
                request as *mut libc::ifreq,
            )
        } < 0
        {
            let error = io::Error::last_os_error();
            return Err(io::Error::new(
                error.kind(),
                format!("{what} of {}: {error}", self.name),
            ));
        }
        Ok(())
    }

    /// Sets the link up, unless it is already.
    fn bring_up(&self) -> io::Result<()> {
        let mut request = self.request();
        self.ioctl("read the flags", libc::SIOCGIFFLAGS, &mut request)?;
        // SAFETY: SIOCGIFFLAGS filled the flags member.
        let flags = unsafe { request.ifr_ifru.ifru_flags };
        let up = libc::IFF_UP as libc::c_short;
        if flags & up != 0 {
            return Ok(());
        }
        request.ifr_ifru.ifru_flags = flags | up;
        self.ioctl("set the flags", libc::SIOCSIFFLAGS, &mut request)
    }

    fn set_mac(&self, mac: [u8; 6]) -> io::Result<()> {
        let mut request = self.request();
        // SAFETY: sockaddr is plain data.
        let mut hardware: libc::sockaddr = unsafe { std::mem::zeroed() };
        hardware.sa_family = libc::ARPHRD_ETHER;
        for (slot, byte) in hardware.sa_data.iter_mut().zip(mac) {
            *slot = byte as libc::c_char;
        }
        request.ifr_ifru.ifru_hwaddr = hardware;
        self.ioctl("set the MAC", libc::SIOCSIFHWADDR, &mut request)
    }

    fn set_address(&self, address: Ipv4Addr, mask: Ipv4Addr) -> io::Result<()> {
        let mut request = self.request();
        request.ifr_ifru.ifru_addr = sockaddr_of(address);
        self.ioctl("set the address", libc::SIOCSIFADDR, &mut request)?;
        let mut request = self.request();
        request.ifr_ifru.ifru_netmask = sockaddr_of(mask);
        self.ioctl("set the netmask", libc::SIOCSIFNETMASK, &mut request)
    }

    fn remove_address(&self) -> io::Result<()> {
        let mut request = self.request();
        // Setting 0.0.0.0 removes the address (there may be none).
        request.ifr_ifru.ifru_addr = sockaddr_of(Ipv4Addr::UNSPECIFIED);
        self.ioctl("remove the address", libc::SIOCSIFADDR, &mut request)
    }

    /// `SIOCADDRT` or `SIOCDELRT` of the default route; `Ok(false)` when
    /// there is nothing to do (it exists already, or there is none).
    fn route(&self, op: libc::c_ulong, route: &mut RouteEntry) -> io::Result<bool> {
        // SAFETY: both ops read one rtentry, whose device name outlives the call.
        let result = unsafe {
            libc::ioctl(
                self.socket.as_raw_fd(),
                op as libc::Ioctl,
                route as *mut RouteEntry,
            )
        };
        if result == 0 {
            return Ok(true);
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EEXIST) | Some(libc::ESRCH) => Ok(false),
            _ => Err(error),
        }
    }

    /// Removes every default route of this interface (a restored guest
    /// keeps the one its memory had).
    fn remove_default_routes(&self) -> io::Result<()> {
        let device = self.device_name()?;
        let mut route = default_route(Ipv4Addr::UNSPECIFIED, RTF_UP, &device);
        while self
            .route(libc::SIOCDELRT, &mut route)
            .map_err(|e| io::Error::new(e.kind(), format!("remove the default route: {e}")))?
        {
        }
        Ok(())
    }

    fn add_default_route(&self, gateway: Ipv4Addr) -> io::Result<()> {
        let device = self.device_name()?;
        let mut route = default_route(gateway, RTF_UP | RTF_GATEWAY, &device);
        self.route(libc::SIOCADDRT, &mut route).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("add the default route via {gateway}: {e}"),
            )
        })?;
        Ok(())
    }

    fn device_name(&self) -> io::Result<CString> {
        CString::new(self.name.clone()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    }
}

/// A default route of `device` via `gateway` (`0.0.0.0`: any gateway).
fn default_route(gateway: Ipv4Addr, flags: u16, device: &CString) -> RouteEntry {
    RouteEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_of(Ipv4Addr::UNSPECIFIED),
        rt_gateway: sockaddr_of(gateway),
        rt_genmask: sockaddr_of(Ipv4Addr::UNSPECIFIED),
        rt_flags: flags,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        rt_dev: device.as_ptr() as *mut libc::c_char,
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    }
}

fn write_sysctl(path: &str, value: &str) {
    if let Err(error) = fs::write(path, value) {
        tracing::debug!(path, %error, "sysctl not written");
    }
}

/// Replaces `/etc/resolv.conf` (a file or a dangling link an image brought)
/// by writing a new file beside it and renaming it over.
fn write_resolv_conf(root: &Path, content: &str) -> io::Result<()> {
    let etc = root.join("etc");
    fs::create_dir_all(&etc)?;
    let partial = etc.join(".resolv.conf.cove");
    fs::write(&partial, content)?;
    fs::rename(&partial, etc.join("resolv.conf"))
}

/// Gives the NIC the host's settings, or takes its address and default
/// route away when `network` is `None` (a sandbox without a network
/// restored from one that had it). The link is left up either way (see the
/// module's documentation).
pub fn configure(network: Option<&GuestNetwork>) -> io::Result<()> {
    let interface = Interface::open(nic_name()?)?;
    let name = interface.name.clone();
    // cove polices IPv4 only: the guest must have no IPv6 path at all.
    write_sysctl(&format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1");
    let Some(network) = network else {
        interface.remove_default_routes()?;
        return interface.remove_address();
    };
    let mac = parse_mac(&network.mac).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{:?} is not a unicast MAC", network.mac),
        )
    })?;
    if network.prefix_len == 0 || network.prefix_len > 30 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("prefix length {} is out of range", network.prefix_len),
        ));
    }
    // Announce the new MAC and address (when the MAC changes, or the link
    // comes up), so the gateway's ARP cache follows at once. The address
    // goes first, so the announcement carries the new one.
    write_sysctl(&format!("/proc/sys/net/ipv4/conf/{name}/arp_notify"), "1");
    interface.remove_default_routes()?;
    interface.set_address(network.address, netmask(network.prefix_len))?;
    interface.set_mac(mac)?;
    interface.bring_up()?;
    interface.add_default_route(network.gateway)?;
    write_resolv_conf(Path::new("/"), &network.resolv_conf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_parse_only_when_unicast_and_whole() {
        assert_eq!(
            parse_mac("02:76:0a:4d:00:09"),
            Some([2, 0x76, 10, 77, 0, 9])
        );
        for bad in [
            "",
            "02:76:0a:4d:00",
            "02:76:0a:4d:00:09:01",
            "03:00:00:00:00:00",
            "2:76:0a:4d:00:09",
            "zz:00:00:00:00:00",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
    }

    #[test]
    fn netmasks_follow_the_prefix() {
        assert_eq!(netmask(16), Ipv4Addr::new(255, 255, 0, 0));
        assert_eq!(netmask(24), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(netmask(0), Ipv4Addr::UNSPECIFIED);
        assert_eq!(netmask(32), Ipv4Addr::BROADCAST);
    }

    #[test]
    fn resolv_conf_replaces_a_dangling_link() {
        let root = tempfile::tempdir().unwrap();
        fs::create_dir(root.path().join("etc")).unwrap();
        std::os::unix::fs::symlink("/run/nowhere", root.path().join("etc/resolv.conf")).unwrap();
        write_resolv_conf(root.path(), "nameserver 10.77.0.1\n").unwrap();
        let path = root.path().join("etc/resolv.conf");
        assert!(!path.symlink_metadata().unwrap().file_type().is_symlink());
        assert_eq!(fs::read_to_string(path).unwrap(), "nameserver 10.77.0.1\n");
    }
}
