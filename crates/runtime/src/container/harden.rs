//! The last steps of the container init before it becomes the agent: capabilities cut to
//! Docker's default set, no_new_privs, and a seccomp filter refusing the syscalls Docker's
//! default profile refuses. Runs in the forked container init only; owns no files.
#![allow(unsafe_code)]

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Docker's default capabilities, by number (linux/capability.h).
pub const DEFAULT_CAPS: [(u32, &str); 14] = [
    (0, "CHOWN"),
    (1, "DAC_OVERRIDE"),
    (3, "FOWNER"),
    (4, "FSETID"),
    (5, "KILL"),
    (6, "SETGID"),
    (7, "SETUID"),
    (8, "SETPCAP"),
    (10, "NET_BIND_SERVICE"),
    (13, "NET_RAW"),
    (18, "SYS_CHROOT"),
    (27, "MKNOD"),
    (29, "AUDIT_WRITE"),
    (31, "SETFCAP"),
];
const CAP_MKNOD: u32 = 27;

/// The capability bits to keep; MKNOD only where a device cgroup confines the nodes made.
pub fn kept_caps(keep_mknod: bool) -> u64 {
    DEFAULT_CAPS
        .iter()
        .filter(|(cap, _)| keep_mknod || *cap != CAP_MKNOD)
        .fold(0, |mask, (cap, _)| mask | (1 << cap))
}

/// Syscalls answered with EPERM: kernel modules and kexec, bpf and perf, keyrings,
/// mounts and namespaces, raw I/O ports, clocks, swap, accounting, quotas, reboot, the
/// new mount API and io_uring (which bypasses seccomp for the operations it performs).
const DENIED: &[i64] = &[
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_open_by_handle_at,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_lookup_dcookie,
    libc::SYS_vhangup,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_mount_setattr,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
];

/// Namespace flags `clone` may not carry (CLONE_NEWUSER needs no capability at all).
const CLONE_NS_FLAGS: [u64; 7] = [
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWCGROUP as u64,
];

fn arch() -> Result<TargetArch, String> {
    TargetArch::try_from(std::env::consts::ARCH).map_err(|err| format!("seccomp: {err}"))
}

/// The filters to install, in order: EPERM for the denied syscalls and for `clone` with a
/// namespace flag; ENOSYS for `clone3`, whose flags live in memory seccomp cannot read,
/// so that libc falls back to `clone`.
pub fn seccomp_filters() -> Result<Vec<BpfProgram>, String> {
    let arch = arch()?;
    let mut denied: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|&nr| (nr, Vec::new())).collect();
    let clone_rules = CLONE_NS_FLAGS
        .iter()
        .map(|&flag| {
            let cond = SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(flag),
                flag,
            )?;
            SeccompRule::new(vec![cond])
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| format!("seccomp clone rule: {err}"))?;
    denied.insert(libc::SYS_clone, clone_rules);
    let eperm = SeccompFilter::new(
        denied,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|err| format!("seccomp filter: {err}"))?;
    let enosys = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(|err| format!("seccomp filter: {err}"))?;
    [eperm, enosys]
        .into_iter()
        .map(|filter| BpfProgram::try_from(filter).map_err(|err| format!("seccomp compile: {err}")))
        .collect()
}

fn os_err(step: &str) -> String {
    format!("{step}: {}", std::io::Error::last_os_error())
}

/// Cuts the bounding set, clears the ambient set and sets effective = permitted =
/// inheritable = `keep`. Root keeps exactly these across execve.
pub fn drop_capabilities(keep: u64) -> Result<(), String> {
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
            return Err(os_err(&format!(
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
pub fn raise_effective() -> Result<(), String> {
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
    // SAFETY: as above; the kernel only reads them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(os_err("raise capabilities"));
    }
    Ok(())
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

fn capset(keep: u64) -> Result<(), String> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let half = |bits: u32| CapData {
        effective: bits,
        permitted: bits,
        inheritable: bits,
    };
    let data = [half(keep as u32), half((keep >> 32) as u32)];
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
        return Err(os_err("set capabilities"));
    }
    Ok(())
}

/// Sets no_new_privs and installs the filters (seccompiler sets no_new_privs itself too).
pub fn confine_syscalls(filters: &[BpfProgram]) -> Result<(), String> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(os_err("set no_new_privs"));
    }
    for filter in filters {
        seccompiler::apply_filter(filter)
            .map_err(|err| format!("install seccomp filter: {err}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_caps_match_docker() {
        let mask = kept_caps(true);
        assert_eq!(mask.count_ones(), 14);
        assert_ne!(mask & (1 << 27), 0);
        assert_eq!(mask & (1 << 21), 0, "CAP_SYS_ADMIN must go");
        assert_eq!(kept_caps(false).count_ones(), 13);
    }

    #[test]
    fn seccomp_filters_build() {
        let filters = seccomp_filters().unwrap();
        assert_eq!(filters.len(), 2);
        assert!(filters.iter().all(|f| !f.is_empty()));
    }
}
