//! The guest's end of the agent's virtio-serial port (`cove.agent`), as an
//! async byte stream.
//!
//! What the port does, as seen with QEMU 10 and Linux 6.12: when the host
//! process disconnects, reads return end-of-file (after any data still
//! buffered), and `poll` reports `POLLHUP` for as long as nobody is
//! connected. Only one open of the port at a time is allowed in the guest.
//! What a restored guest sees is in `session`.
#![allow(unsafe_code)]

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The name the host gives the port (`-device virtserialport,name=...`).
pub const PORT_NAME: &str = "cove.agent";

/// The device node of the port called `name`. Without udev there are no
/// `/dev/virtio-ports/` links, so the name is looked up in sysfs.
pub fn find(sys_class: &Path, dev: &Path, name: &str) -> io::Result<PathBuf> {
    for entry in fs::read_dir(sys_class)? {
        let entry = entry?;
        let Ok(found) = fs::read_to_string(entry.path().join("name")) else {
            continue;
        };
        if found.trim_end() == name {
            return Ok(dev.join(entry.file_name()));
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!(
            "no virtio-serial port named {name} in {}",
            sys_class.display()
        ),
    ))
}

/// An open port.
pub struct Port {
    fd: AsyncFd<OwnedFd>,
}

impl Port {
    pub fn open(path: &Path) -> io::Result<Port> {
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)?;
        // SAFETY: the OwnedFd moves into the AsyncFd, which alone owns it and
        // keeps it open until it is dropped.
        let fd = unsafe { AsyncFd::register(OwnedFd::from(file)) }?;
        Ok(Port { fd })
    }

    /// Whether a host process is connected to the other end right now.
    pub fn host_connected(&self) -> io::Result<bool> {
        let mut poll = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN | libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        if unsafe { libc::poll(&mut poll, 1, 0) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(poll.revents & libc::POLLHUP == 0)
    }
}

fn result(n: isize) -> io::Result<usize> {
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl AsyncRead for Port {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let read = guard.try_io(|fd| {
                // SAFETY: reads into the initialised, unfilled part of `buf`.
                result(unsafe {
                    libc::read(fd.as_raw_fd(), unfilled.as_mut_ptr().cast(), unfilled.len())
                })
            });
            match read {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(error)) => return Poll::Ready(Err(error)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for Port {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            // SAFETY: writes from a valid slice.
            let written = guard.try_io(|fd| {
                result(unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) })
            });
            match written {
                Ok(result) => return Poll::Ready(result),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_is_found_by_its_name() {
        let sys = tempfile::tempdir().unwrap();
        for (port, name) in [
            ("vport0p0", "org.qemu.guest_agent.0"),
            ("vport0p1", PORT_NAME),
        ] {
            fs::create_dir(sys.path().join(port)).unwrap();
            fs::write(sys.path().join(port).join("name"), format!("{name}\n")).unwrap();
        }
        fs::create_dir(sys.path().join("vport0p2")).unwrap();
        let found = find(sys.path(), Path::new("/dev"), PORT_NAME).unwrap();
        assert_eq!(found, Path::new("/dev/vport0p1"));
        assert!(find(sys.path(), Path::new("/dev"), "other").is_err());
    }
}
