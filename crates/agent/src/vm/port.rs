//! The guest's end of the agent's virtio-serial port (`cove.agent`), as an
//! async byte stream.
//!
//! What the port does, as seen with QEMU 10 and Linux 6.12: when the host
//! process disconnects, reads return end-of-file (after any data still
//! buffered), and `poll` reports `POLLHUP` for as long as nobody is
//! connected. Only one open of the port at a time is allowed in the guest.
//! What a restored guest sees is in `session`.
//!
//! tokio keeps a hang-up it once saw as readiness for good (a closed state
//! is final to it), but this port's hang-up ends when a host connects
//! again: a registration that saw one would report the port readable and
//! writable forever, and every read or write that would block would spin
//! (an idle VM then kept its vCPU, and the host core under it, 100% busy).
//! So a read or write that would block on a registration that saw a
//! hang-up registers the port afresh, and the new registration reports only
//! what holds now. A session must not end there: the guest learns of the
//! host's comings and goings late (control messages, handled by a kernel
//! worker), so a hang-up seen mid-session may be an old one, from before
//! this session's host connected; a session that ended silently would
//! leave its host waiting for answers. When the host has really gone,
//! reads return end of file, and that ends the session.
#![allow(unsafe_code)]

use std::fs;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

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

/// How long a write waits for a host to come back before it tries again;
/// meanwhile a fresh registration would report the hang-up at once.
const HOST_GONE_RETRY: Duration = Duration::from_millis(10);

/// An open port.
pub struct Port {
    fd: Option<AsyncFd<OwnedFd>>,
    /// A write waiting for the host to come back.
    host_gone: Option<Pin<Box<Sleep>>>,
}

/// What one try at reading or writing came to.
enum Try<T> {
    Done(io::Result<T>),
    WouldBlock,
    /// Would block, on a registration that saw a hang-up.
    Stale,
}

fn gone() -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        "the agent's port could not be registered again",
    )
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
        Ok(Port {
            fd: Some(fd),
            host_gone: None,
        })
    }

    fn registered(&self) -> io::Result<&AsyncFd<OwnedFd>> {
        self.fd.as_ref().ok_or_else(gone)
    }

    /// Registers the port with the reactor afresh, forgetting a hang-up the
    /// old registration saw.
    pub fn register_again(&mut self) -> io::Result<()> {
        let fd = self.fd.take().ok_or_else(gone)?.into_inner();
        // SAFETY: as in `open`: the AsyncFd alone owns the descriptor.
        self.fd = Some(unsafe { AsyncFd::register(fd) }?);
        Ok(())
    }

    /// Whether a host process is connected to the other end right now.
    pub fn host_connected(&self) -> io::Result<bool> {
        let mut poll = libc::pollfd {
            fd: self.registered()?.as_raw_fd(),
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
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let fd = self.registered()?;
            let mut guard = ready!(fd.poll_read_ready(cx))?;
            let stale = guard.ready().is_read_closed();
            let unfilled = buf.initialize_unfilled();
            let read = guard.try_io(|fd| {
                // SAFETY: reads into the initialised, unfilled part of `buf`.
                result(unsafe {
                    libc::read(fd.as_raw_fd(), unfilled.as_mut_ptr().cast(), unfilled.len())
                })
            });
            let outcome = match read {
                Ok(done) => Try::Done(done),
                Err(_would_block) if stale => Try::Stale,
                Err(_would_block) => Try::WouldBlock,
            };
            match outcome {
                Try::Done(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Try::Done(Err(error)) => return Poll::Ready(Err(error)),
                // A fresh registration that finds the host gone reports it
                // again, and the read then returns end of file: no spin.
                Try::Stale => {
                    tracing::debug!("the port saw a hang-up that is over; registered afresh");
                    self.register_again()?
                }
                Try::WouldBlock => continue,
            }
        }
    }
}

impl AsyncWrite for Port {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            if let Some(sleep) = self.host_gone.as_mut() {
                ready!(sleep.as_mut().poll(cx));
                self.host_gone = None;
                self.register_again()?;
            }
            let fd = self.registered()?;
            let mut guard = ready!(fd.poll_write_ready(cx))?;
            let stale = guard.ready().is_write_closed();
            let written = guard.try_io(|fd| {
                // SAFETY: writes from a valid slice, to a descriptor `fd` keeps open.
                result(unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) })
            });
            let outcome = match written {
                Ok(done) => Try::Done(done),
                Err(_would_block) if stale => Try::Stale,
                Err(_would_block) => Try::WouldBlock,
            };
            match outcome {
                Try::Done(result) => return Poll::Ready(result),
                Try::Stale if self.host_connected()? => self.register_again()?,
                // A write blocks for as long as no host is connected, and a
                // fresh registration would say so at once: wait a little.
                Try::Stale => self.host_gone = Some(Box::pin(tokio::time::sleep(HOST_GONE_RETRY))),
                Try::WouldBlock => continue,
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
