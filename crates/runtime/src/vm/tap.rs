//! The descriptor of a VM's TAP device, opened here (root) and handed to
//! QEMU, which runs unprivileged and could not open it itself: at launch as
//! an inherited descriptor (`-netdev tap,fd=N`), or over QMP when a warm VM
//! is plugged into its sandbox's network.
//!
//! A name cove-net made is a persistent device on the bridge: this attaches
//! to it. Any other name makes a device that lives as long as its
//! descriptors (a flush's TAP on no bridge: see `boot`'s `Identity`).
//!
//! A device without multi-queue takes one attached descriptor at a time;
//! another open fails with EBUSY while one is open anywhere. The server
//! forks children (QEMU, virtiofsd) from any thread, and a child holds a
//! copy of every descriptor the server had open at its fork until its
//! `exec` closes it; between the two it joins its jail's cgroups, which
//! takes milliseconds, more under load. So a device cove-net opened an
//! instant to make it, or this module opened an instant to hand it over,
//! may still be held by such a child for a moment: [`open`] waits
//! [`BUSY_TIMEOUT`] for it to let go before it reports the device busy.
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// How long a busy device may take to be let go by a child between its
/// fork and its exec (a live QEMU that holds it never lets go).
const BUSY_TIMEOUT: Duration = Duration::from_secs(3);
/// How often a busy device is tried again.
const BUSY_RETRY: Duration = Duration::from_millis(10);

/// Opens TAP device `name` as QEMU opens one (see [`open_once`]); while it
/// is busy, tries again for up to [`BUSY_TIMEOUT`] (see the module's text).
pub(super) async fn open(name: &str) -> io::Result<OwnedFd> {
    let began = Instant::now();
    loop {
        let error = match open_once(name) {
            Ok(tap) => {
                if began.elapsed() > BUSY_RETRY {
                    tracing::debug!(
                        device = name,
                        waited_ms = began.elapsed().as_secs_f64() * 1e3,
                        "a TAP device was busy for a moment"
                    );
                }
                return Ok(tap);
            }
            Err(error) => error,
        };
        let busy = error.raw_os_error() == Some(libc::EBUSY);
        if busy && began.elapsed() < BUSY_TIMEOUT {
            tokio::time::sleep(BUSY_RETRY).await;
            continue;
        }
        let why = if busy {
            format!("; still busy after {BUSY_TIMEOUT:?}: a live process (a QEMU?) holds it")
        } else {
            String::new()
        };
        return Err(io::Error::new(
            error.kind(),
            format!("open TAP device {name}: {error}{why}"),
        ));
    }
}

/// Opens TAP device `name` as QEMU opens one: no packet-info header, with
/// the virtio-net header (which a NIC's saved state may require). One try;
/// the error is the kernel's, its errno kept.
fn open_once(name: &str) -> io::Result<OwnedFd> {
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
        return Err(io::Error::last_os_error());
    }
    Ok(tun.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// Makes `fd`'s device persistent (`on`) or not, as cove-net does.
    fn set_persistent(fd: &OwnedFd, on: bool) {
        // SAFETY: TUNSETPERSIST takes an integer argument.
        let done =
            unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETPERSIST, libc::c_ulong::from(on)) };
        assert_eq!(done, 0, "{}", io::Error::last_os_error());
    }

    /// Deletes a test's persistent device however the test ends.
    struct Device(String);

    impl Drop for Device {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["link", "delete", &self.0])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }

    /// The flake of `test_a_create_takes_a_waiting_vm_of_the_warm_pool`:
    /// cove-net made the sandbox's device (its descriptor open for an
    /// instant) while another thread forked a warm VM's QEMU, whose child
    /// held the copy until its exec; the sandbox's launch then found the
    /// device busy.
    #[test]
    fn a_device_a_forked_child_holds_until_its_exec_is_waited_for() {
        if !cove_testenv::root("opening TAP devices") {
            return;
        }
        let device = Device(format!(
            "cvbusy{}",
            super::super::bridge::random_hex(3).unwrap()
        ));
        let made = open_once(&device.0).expect("make a TAP device");
        set_persistent(&made, true);
        // Another thread forks while `made` is open; its child lingers
        // before its exec as one joining its cgroups does.
        let forking = std::thread::spawn(|| {
            let mut command = std::process::Command::new("true");
            // SAFETY: nanosleep is async-signal-safe; its argument outlives it.
            unsafe {
                command.pre_exec(|| {
                    let pause = libc::timespec {
                        tv_sec: 0,
                        tv_nsec: 400_000_000,
                    };
                    libc::nanosleep(&pause, std::ptr::null_mut());
                    Ok(())
                });
            }
            command.status().expect("run a child")
        });
        std::thread::sleep(Duration::from_millis(100));
        drop(made);
        assert_eq!(
            open_once(&device.0).unwrap_err().raw_os_error(),
            Some(libc::EBUSY),
            "the child's copy keeps the device attached"
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let opened = runtime.block_on(open(&device.0));
        assert!(forking.join().unwrap().success());
        opened.expect("the device is let go at the child's exec");
    }

    #[test]
    fn a_name_the_kernel_cannot_take_is_refused() {
        assert_eq!(
            open_once("").unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            open_once("a-name-far-too-long").unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }
}
