//! The last steps of the container init before it becomes the agent: capabilities cut to
//! Docker's default set less NET_RAW, and the seccomp programs of
//! `seccomp`; and, in the shim, the network namespace setting that lets ping work without
//! NET_RAW. Owns no files.
#![allow(unsafe_code)]

use seccompiler::BpfProgram;

use super::step::StepError;

/// The capabilities a container keeps, by number (linux/capability.h): Docker's default
/// set without NET_RAW (13), which would let the sandbox forge packets; ping uses ICMP
/// datagram sockets instead (`allow_unprivileged_ping`).
pub(super) const KEPT_CAPS: [(u32, &str); 13] = [
    (0, "CHOWN"),
    (1, "DAC_OVERRIDE"),
    (3, "FOWNER"),
    (4, "FSETID"),
    (5, "KILL"),
    (6, "SETGID"),
    (7, "SETUID"),
    (8, "SETPCAP"),
    (10, "NET_BIND_SERVICE"),
    (18, "SYS_CHROOT"),
    (27, "MKNOD"),
    (29, "AUDIT_WRITE"),
    (31, "SETFCAP"),
];
const CAP_MKNOD: u32 = 27;

/// The capability bits to keep; MKNOD only where a device cgroup confines the nodes made.
pub(super) fn kept_caps(keep_mknod: bool) -> u64 {
    KEPT_CAPS
        .iter()
        .filter(|(cap, _)| keep_mknod || *cap != CAP_MKNOD)
        .fold(0, |mask, (cap, _)| mask | (1 << cap))
}

fn os_err(step: impl Into<String>) -> StepError {
    StepError::Io {
        step: step.into(),
        source: std::io::Error::last_os_error(),
    }
}

/// Every group may open ICMP echo sockets (`SOCK_DGRAM`, `IPPROTO_ICMP`), which is how
/// ping works without CAP_NET_RAW; a new network namespace allows none ("1 0"). Called in
/// the sandbox's network namespace: /proc/sys/net shows the namespace of the caller, and
/// the shim is root in the user namespace that owns it.
pub(super) fn allow_unprivileged_ping() -> Result<(), StepError> {
    const PING_GROUP_RANGE: &str = "/proc/sys/net/ipv4/ping_group_range";
    std::fs::write(PING_GROUP_RANGE, "0 2147483647").map_err(super::step::io(|| {
        format!("allow unprivileged ping ({PING_GROUP_RANGE})")
    }))
}

/// Cuts the bounding set, clears the ambient set and sets effective = permitted =
/// inheritable = `keep`. Root keeps exactly these across execve.
pub(super) fn drop_capabilities(keep: u64) -> Result<(), StepError> {
    for cap in 0..64u32 {
        if keep & (1 << cap) != 0 {
            continue;
        }
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) };
        if rc != 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
                break; // past the kernel's last capability
            }
            return Err(os_err(format!(
                "drop capability {cap} from the bounding set"
            )));
        }
    }
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if rc != 0 {
        return Err(os_err("clear ambient capabilities"));
    }
    capset(keep)
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Makes every permitted capability effective again (after `setfsuid` cleared
/// the file-system ones).
pub(super) fn raise_effective() -> Result<(), StepError> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: header and a two-element data array in the layout of capability v3,
    // both live across the call; the kernel fills `data`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut CapHeader,
            data.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(os_err("read capabilities"));
    }
    for half in &mut data {
        half.effective = half.permitted;
    }
    write_caps(&data, "raise capabilities")
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

fn capset(keep: u64) -> Result<(), StepError> {
    let half = |bits: u32| CapData {
        effective: bits,
        permitted: bits,
        inheritable: bits,
    };
    write_caps(
        &[half(keep as u32), half((keep >> 32) as u32)],
        "set capabilities",
    )
}

/// `capset` of this process's capabilities, both 32-bit halves.
fn write_caps(data: &[CapData; 2], step: &str) -> Result<(), StepError> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    // SAFETY: header and a two-element data array in the layout of capability v3, both
    // live across the call; the kernel only reads them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(os_err(step));
    }
    Ok(())
}

/// Installs the filters without `no_new_privs`, as Docker does, so a setuid
/// program (`sudo` for the default user) can still become the sandbox's root,
/// which holds nothing root does not already hold there: the capabilities cut
/// by [`drop_capabilities`], this filter, and the user namespace. Without
/// `no_new_privs` the kernel wants CAP_SYS_ADMIN in the caller's user
/// namespace, so this runs before the capabilities are cut; the filters allow
/// what that cut needs (`capset`, `prctl`).
pub(super) fn confine_syscalls(filters: &[BpfProgram]) -> Result<(), StepError> {
    for filter in filters {
        let len = u16::try_from(filter.len()).map_err(|_| StepError::Io {
            step: "install a seccomp filter: the program is too long".into(),
            source: std::io::ErrorKind::InvalidInput.into(),
        })?;
        let program = libc::sock_fprog {
            len,
            // seccompiler's `sock_filter` has the kernel's layout, as libc's does.
            filter: filter.as_ptr().cast::<libc::sock_filter>().cast_mut(),
        };
        // SAFETY: `program` points at `filter`, which outlives the call; the
        // kernel copies the program and writes nothing back.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0,
                &program as *const libc::sock_fprog,
            )
        };
        if rc != 0 {
            return Err(os_err("install a seccomp filter"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_caps_are_docker_s_without_net_raw() {
        let mask = kept_caps(true);
        assert_eq!(mask, 0xa804_05fb);
        assert_ne!(mask & (1 << 27), 0);
        assert_eq!(mask & (1 << 13), 0, "CAP_NET_RAW must go");
        assert_eq!(mask & (1 << 21), 0, "CAP_SYS_ADMIN must go");
        assert_eq!(kept_caps(false).count_ones(), 12);
    }
}
