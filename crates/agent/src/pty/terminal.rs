//! The kernel side of a PTY session: a pseudo-terminal pair, the shell started
//! as a session leader with the terminal as its controlling tty, window-size
//! changes, and killing everything the session started.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::{self, Read as _, Write as _};
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;
use std::process::Stdio;

use nix::fcntl::OFlag;
use nix::pty::{grantpt, posix_openpt, ptsname_r, unlockpt, PtyMaster};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::process::Child;

/// The agent's end of one pseudo-terminal and the session leader behind it.
pub struct Terminal {
    master: AsyncFd<PtyMaster>,
    /// Pid of the shell, which is also its session and process-group id.
    leader: Pid,
}

/// What to start on the terminal.
pub struct Launch<'a> {
    pub shell: &'a Path,
    pub cwd: &'a Path,
    pub envs: &'a BTreeMap<String, String>,
    pub cols: u16,
    pub rows: u16,
}

impl Terminal {
    /// Opens a pseudo-terminal of the given size and starts the shell on it.
    pub fn spawn(launch: &Launch<'_>) -> io::Result<(Self, Child)> {
        // O_CLOEXEC from the start: other threads spawn processes concurrently and
        // must not inherit either end (a stray slave fd would keep the terminal open).
        let master = posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)?;
        grantpt(&master)?;
        unlockpt(&master)?;
        let slave_path = ptsname_r(&master)?;
        set_window_size(master.as_raw_fd(), launch.cols, launch.rows)?;
        let slave: OwnedFd = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOCTTY)
            .open(&slave_path)?
            .into();
        nix::fcntl::fcntl(
            master.as_raw_fd(),
            nix::fcntl::FcntlArg::F_SETFL(OFlag::O_RDWR | OFlag::O_NONBLOCK),
        )?;

        let mut command = tokio::process::Command::new(launch.shell);
        command
            .args(["-l", "-i"])
            .current_dir(launch.cwd)
            .env("TERM", "xterm-256color")
            .envs(launch.envs)
            .stdin(Stdio::from(slave.try_clone()?))
            .stdout(Stdio::from(slave.try_clone()?))
            .stderr(Stdio::from(slave));
        // SAFETY: the closure runs in the forked child before exec and calls only
        // setsid(2) and ioctl(2), both async-signal-safe; it touches no memory
        // shared with other threads of the agent.
        unsafe {
            command.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(io::Error::last_os_error());
                }
                // fd 0 is the slave by now; make it the new session's controlling tty.
                if libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn()?;
        // The command (and with it the parent's copies of the slave) is dropped
        // here, so reading the master ends once the session's processes close it.
        drop(command);
        let leader = Pid::from_raw(child.id().map_or(0, |pid| pid as i32));
        // SAFETY: `PtyMaster` owns its descriptor, closes it only on drop and
        // always answers the same one from `as_raw_fd`, which is what
        // registering requires for the lifetime of the `AsyncFd`.
        let master = unsafe { AsyncFd::register(master) }.map_err(io::Error::from)?;
        let terminal = Self { master, leader };
        Ok((terminal, child))
    }

    /// Reads output; `Ok(0)` once no process has the terminal open any more
    /// (Linux answers EIO then).
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self
            .master
            .async_io(Interest::READABLE, |mut master| master.read(buf))
            .await
        {
            Err(e) if e.raw_os_error() == Some(libc::EIO) => Ok(0),
            other => other,
        }
    }

    /// Writes all of `data` as keyboard input.
    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let written = self
                .master
                .async_io(Interest::WRITABLE, |mut master| master.write(data))
                .await?;
            data = &data[written..];
        }
        Ok(())
    }

    pub fn resize(&self, cols: u16, rows: u16) -> io::Result<()> {
        set_window_size(self.master.get_ref().as_raw_fd(), cols, rows)
    }

    /// SIGKILLs every process of the terminal's session, the shell included.
    /// An interactive shell puts each job in its own process group, so killing
    /// the shell's group alone would leave background jobs running.
    ///
    /// The shell dies first, so it cannot fork while the session is swept; a
    /// child it forked just before (or a member forking during a sweep) shows
    /// up in the next sweep, and sweeping stops once no live member is left.
    pub fn kill_session(&self) {
        if self.leader.as_raw() <= 0 {
            return;
        }
        let _ = kill(self.leader, Signal::SIGKILL);
        for _ in 0..MAX_SWEEPS {
            let members = live_session_members(self.leader);
            if members.is_empty() {
                return;
            }
            for pid in members {
                let _ = kill(pid, Signal::SIGKILL);
            }
        }
    }
}

fn set_window_size(fd: i32, cols: u16, rows: u16) -> io::Result<()> {
    let size = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: `fd` is an open terminal descriptor owned by the caller and `size`
    // is a valid winsize that outlives the call; TIOCSWINSZ only reads it.
    if unsafe { libc::ioctl(fd, libc::TIOCSWINSZ as _, &size) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bounds the sweeps of [`Terminal::kill_session`]: each sweep kills every
/// live member, so only a fork bomb outruns it.
const MAX_SWEEPS: usize = 64;

/// Processes whose session id is `session` and that have not exited yet
/// (zombies are left to their parents), from `/proc`.
fn live_session_members(session: Pid) -> Vec<Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| live_session_of(&stat))
                == Some(session.as_raw())
        })
        .map(Pid::from_raw)
        .collect()
}

/// The session field of a `/proc/<pid>/stat` line, or `None` for a zombie
/// (or a dead process). The command name may hold spaces and parentheses, so
/// fields are counted after its last `)`.
fn live_session_of(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // state ppid pgrp session
    let mut fields = rest.split_whitespace();
    if matches!(fields.next()?, "Z" | "X" | "x") {
        return None;
    }
    fields.nth(2)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::live_session_of;

    #[test]
    fn session_field_survives_odd_command_names() {
        let stat = "42 (we (ird) name) S 1 42 40 0 -1 4194560 100";
        assert_eq!(live_session_of(stat), Some(40));
        assert_eq!(live_session_of("garbage"), None);
    }

    #[test]
    fn zombies_are_not_live_members() {
        let stat = "42 (sleep) Z 1 42 40 0 -1 4194560 100";
        assert_eq!(live_session_of(stat), None);
    }
}
