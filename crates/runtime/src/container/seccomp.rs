//! The container's syscall policy: an allow-list, as data, and its translation into the
//! seccomp programs the container init installs before it execs the agent.
//!
//! The model is Docker's default profile for x86_64 (moby `profiles/seccomp/default.json`)
//! for the capabilities a container keeps (`harden`): what it allows unconditionally, what
//! it allows because a kept capability would (only `chroot`, for SYS_CHROOT), and its
//! argument rules for `clone`, `personality` and `socket`. Anything else, including a
//! syscall a future kernel adds, answers EPERM. Stricter than Docker: io_uring (its
//! operations bypass seccomp) and `clock_adjtime` stay out, as they did when this was a
//! deny-list. Syscall numbers are x86_64's; the crate builds only there (`iopl`, `open`).
//!
//! The program is written here, not by a generic compiler: a binary search over ranges of
//! syscall numbers, a dozen instructions deep, rather than one comparison per listed call
//! (seccompiler's 1570 instructions cost over a millisecond at every container start, when
//! the kernel runs the filter for every number to fill its verdict cache, and hundreds of
//! instructions for every call with an argument rule). seccompiler still installs it.
//!
//! Foreign architectures never reach the list: the first instructions kill a process whose
//! syscall comes in as another ABI (i386 `int 0x80`). x32 syscalls arrive as x86_64 with
//! bit 30 (`__X32_SYSCALL_BIT`) set in the number, above every listed number, so they get
//! EPERM too. The kernel (5.11+) caches the verdict of every syscall allowed whatever its
//! arguments.

use std::collections::BTreeMap;

use seccompiler::{sock_filter, BpfProgram};

// Syscalls missing from the `libc` crate's x86_64 table (arch/x86/entry/syscalls/syscall_64.tbl).
const SYS_IO_PGETEVENTS: i64 = 333;
const SYS_URETPROBE: i64 = 335;
const SYS_CACHESTAT: i64 = 451;
const SYS_MAP_SHADOW_STACK: i64 = 453;
const SYS_FUTEX_WAKE: i64 = 454;
const SYS_FUTEX_WAIT: i64 = 455;
const SYS_FUTEX_REQUEUE: i64 = 456;
const SYS_SETXATTRAT: i64 = 463;
const SYS_GETXATTRAT: i64 = 464;
const SYS_LISTXATTRAT: i64 = 465;
const SYS_REMOVEXATTRAT: i64 = 466;

/// Syscalls allowed whatever their arguments.
const ALLOWED: &[i64] = &[
    // Processes: birth, exec, death, waiting, ids, sessions, signals sent.
    libc::SYS_fork,
    libc::SYS_vfork,
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_getpid,
    libc::SYS_getppid,
    libc::SYS_gettid,
    libc::SYS_getpgid,
    libc::SYS_getpgrp,
    libc::SYS_setpgid,
    libc::SYS_getsid,
    libc::SYS_setsid,
    libc::SYS_kill,
    libc::SYS_tkill,
    libc::SYS_tgkill,
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_send_signal,
    libc::SYS_process_mrelease,
    libc::SYS_restart_syscall,
    // Credentials and capabilities: what the kept capabilities allow, the kernel checks.
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_getresuid,
    libc::SYS_getresgid,
    libc::SYS_getgroups,
    libc::SYS_setuid,
    libc::SYS_setgid,
    libc::SYS_setreuid,
    libc::SYS_setregid,
    libc::SYS_setresuid,
    libc::SYS_setresgid,
    libc::SYS_setgroups,
    libc::SYS_setfsuid,
    libc::SYS_setfsgid,
    libc::SYS_capget,
    libc::SYS_capset,
    // Process attributes, limits, scheduling; self-confinement (seccomp, landlock).
    libc::SYS_prctl,
    libc::SYS_arch_prctl,
    libc::SYS_modify_ldt,
    libc::SYS_get_thread_area,
    libc::SYS_set_thread_area,
    libc::SYS_set_tid_address,
    libc::SYS_set_robust_list,
    libc::SYS_get_robust_list,
    libc::SYS_rseq,
    libc::SYS_umask,
    libc::SYS_uname,
    libc::SYS_sysinfo,
    libc::SYS_times,
    libc::SYS_getrusage,
    libc::SYS_getrlimit,
    libc::SYS_setrlimit,
    libc::SYS_prlimit64,
    libc::SYS_getpriority,
    libc::SYS_setpriority,
    libc::SYS_ioprio_get,
    libc::SYS_ioprio_set,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_setaffinity,
    libc::SYS_sched_getattr,
    libc::SYS_sched_setattr,
    libc::SYS_sched_getparam,
    libc::SYS_sched_setparam,
    libc::SYS_sched_getscheduler,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_get_priority_max,
    libc::SYS_sched_get_priority_min,
    libc::SYS_sched_rr_get_interval,
    libc::SYS_getcpu,
    libc::SYS_seccomp,
    libc::SYS_landlock_create_ruleset,
    libc::SYS_landlock_add_rule,
    libc::SYS_landlock_restrict_self,
    // Debugging one's own processes (Docker allows these from kernel 4.8, where a traced
    // process can no longer skip its filter).
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    // Signals received.
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigpending,
    libc::SYS_rt_sigsuspend,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_sigqueueinfo,
    libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_sigaltstack,
    libc::SYS_signalfd,
    libc::SYS_signalfd4,
    libc::SYS_pause,
    // Memory.
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_mincore,
    libc::SYS_msync,
    libc::SYS_mlock,
    libc::SYS_mlock2,
    libc::SYS_mlockall,
    libc::SYS_munlock,
    libc::SYS_munlockall,
    libc::SYS_remap_file_pages,
    libc::SYS_membarrier,
    libc::SYS_memfd_create,
    libc::SYS_memfd_secret,
    libc::SYS_pkey_alloc,
    libc::SYS_pkey_free,
    libc::SYS_pkey_mprotect,
    // Threads: futexes.
    libc::SYS_futex,
    libc::SYS_futex_waitv,
    // Clocks and timers (reading; setting the clock is not here).
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_gettimeofday,
    libc::SYS_time,
    libc::SYS_adjtimex,
    libc::SYS_alarm,
    libc::SYS_getitimer,
    libc::SYS_setitimer,
    libc::SYS_timer_create,
    libc::SYS_timer_delete,
    libc::SYS_timer_getoverrun,
    libc::SYS_timer_gettime,
    libc::SYS_timer_settime,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_gettime,
    libc::SYS_timerfd_settime,
    // Descriptors and their I/O.
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_lseek,
    libc::SYS_close,
    libc::SYS_close_range,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_fcntl,
    libc::SYS_ioctl,
    libc::SYS_flock,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_sync,
    libc::SYS_syncfs,
    libc::SYS_sync_file_range,
    libc::SYS_fadvise64,
    libc::SYS_readahead,
    libc::SYS_fallocate,
    libc::SYS_ftruncate,
    libc::SYS_truncate,
    libc::SYS_sendfile,
    libc::SYS_splice,
    libc::SYS_tee,
    libc::SYS_vmsplice,
    libc::SYS_copy_file_range,
    libc::SYS_pipe,
    libc::SYS_pipe2,
    // Paths: open, stat, directories, links, modes, owners, times, xattrs. chroot is
    // Docker's for the kept SYS_CHROOT.
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_openat2,
    libc::SYS_creat,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_getcwd,
    libc::SYS_chdir,
    libc::SYS_fchdir,
    libc::SYS_chroot,
    libc::SYS_getdents,
    libc::SYS_getdents64,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rmdir,
    libc::SYS_mknod,
    libc::SYS_mknodat,
    libc::SYS_link,
    libc::SYS_linkat,
    libc::SYS_symlink,
    libc::SYS_symlinkat,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_chmod,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_chown,
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_lchown,
    libc::SYS_utime,
    libc::SYS_utimes,
    libc::SYS_utimensat,
    libc::SYS_futimesat,
    libc::SYS_setxattr,
    libc::SYS_lsetxattr,
    libc::SYS_fsetxattr,
    libc::SYS_getxattr,
    libc::SYS_lgetxattr,
    libc::SYS_fgetxattr,
    libc::SYS_listxattr,
    libc::SYS_llistxattr,
    libc::SYS_flistxattr,
    libc::SYS_removexattr,
    libc::SYS_lremovexattr,
    libc::SYS_fremovexattr,
    libc::SYS_name_to_handle_at,
    // Waiting for events.
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_select,
    libc::SYS_pselect6,
    libc::SYS_epoll_create,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_epoll_ctl_old,
    libc::SYS_epoll_wait_old,
    libc::SYS_eventfd,
    libc::SYS_eventfd2,
    libc::SYS_inotify_init,
    libc::SYS_inotify_init1,
    libc::SYS_inotify_add_watch,
    libc::SYS_inotify_rm_watch,
    libc::SYS_fanotify_mark,
    // Asynchronous I/O, the old interface (io_uring is not here).
    libc::SYS_io_setup,
    libc::SYS_io_destroy,
    libc::SYS_io_submit,
    libc::SYS_io_cancel,
    libc::SYS_io_getevents,
    SYS_IO_PGETEVENTS,
    // Sockets (`socket` itself is in ALLOWED_IF).
    libc::SYS_socketpair,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_sendmmsg,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_recvmmsg,
    libc::SYS_shutdown,
    // System V and POSIX IPC, in the sandbox's own IPC namespace.
    libc::SYS_msgget,
    libc::SYS_msgsnd,
    libc::SYS_msgrcv,
    libc::SYS_msgctl,
    libc::SYS_semget,
    libc::SYS_semop,
    libc::SYS_semtimedop,
    libc::SYS_semctl,
    libc::SYS_shmget,
    libc::SYS_shmat,
    libc::SYS_shmdt,
    libc::SYS_shmctl,
    libc::SYS_mq_open,
    libc::SYS_mq_unlink,
    libc::SYS_mq_timedsend,
    libc::SYS_mq_timedreceive,
    libc::SYS_mq_notify,
    libc::SYS_mq_getsetattr,
    // Randomness.
    libc::SYS_getrandom,
    // Newer than Docker's list, each with the rights of a call above: a newer libc tries
    // them first and falls back only on ENOSYS, so EPERM would break it (glibc 2.39's
    // fchmodat uses fchmodat2). uretprobe is only ever entered from the kernel's own
    // uretprobe trampoline.
    libc::SYS_fchmodat2,
    libc::SYS_mseal,
    SYS_URETPROBE,
    SYS_CACHESTAT,
    SYS_MAP_SHADOW_STACK,
    SYS_FUTEX_WAKE,
    SYS_FUTEX_WAIT,
    SYS_FUTEX_REQUEUE,
    SYS_SETXATTRAT,
    SYS_GETXATTRAT,
    SYS_LISTXATTRAT,
    SYS_REMOVEXATTRAT,
];

/// What an argument must be for a syscall to be allowed.
#[derive(Debug, Clone, Copy)]
enum Only {
    /// The 64-bit argument has none of the bits of `mask`.
    NoneOf { arg: u8, mask: u64 },
    /// The argument, a C `int`, is one of `values`.
    OneOf { arg: u8, values: &'static [u32] },
    /// The argument, a C `int`, is not `value`.
    Not { arg: u8, value: u32 },
}

/// Namespace flags `clone` may not carry (CLONE_NEWUSER needs no capability at all).
const CLONE_NS_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWCGROUP) as u64;

/// Syscalls allowed only with some arguments. `int` arguments compare their low 32 bits
/// only, as the kernel reads them: upper bits set cannot slip a value past the rule.
const ALLOWED_IF: &[(i64, Only)] = &[
    // New processes and threads, but no new namespaces.
    (
        libc::SYS_clone,
        Only::NoneOf {
            arg: 0,
            mask: CLONE_NS_FLAGS,
        },
    ),
    // Docker's values: PER_LINUX, PER_LINUX32, UNAME26, both, and the 0xffffffff query.
    // Not ADDR_NO_RANDOMIZE or READ_IMPLIES_EXEC.
    (
        libc::SYS_personality,
        Only::OneOf {
            arg: 0,
            values: &[0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff],
        },
    ),
    // Any address family but AF_VSOCK, which would reach the host's vsock services.
    (
        libc::SYS_socket,
        Only::Not {
            arg: 0,
            value: libc::AF_VSOCK as u32,
        },
    ),
];

/// Syscalls answered ENOSYS, so that libc falls back to an older call: `clone3` carries
/// its flags in memory seccomp cannot read, and glibc then uses `clone`, which is checked.
const NOT_IMPLEMENTED: &[i64] = &[libc::SYS_clone3];

/// `AUDIT_ARCH_X86_64`: the only ABI whose calls reach the list.
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
/// Offsets in `struct seccomp_data`: the number, the ABI, then six 64-bit arguments.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const DATA_ARGS: u32 = 16;
// Classic BPF opcodes and seccomp return values.
const LD_W_ABS: u16 = 0x20;
const JMP_JA: u16 = 0x05;
const JMP_JEQ_K: u16 = 0x15;
const JMP_JGE_K: u16 = 0x35;
const JMP_JSET_K: u16 = 0x45;
const RET_K: u16 = 0x06;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;
const RET_ALLOW: u32 = 0x7fff_0000;

/// What a syscall number gets.
#[derive(Clone, Copy, Debug)]
enum Verdict {
    Allow,
    Refuse,
    NotImplemented,
    Only(Only),
}

impl Verdict {
    /// Whether two neighbouring numbers can share one range of the search.
    fn merges_with(self, other: Verdict) -> bool {
        matches!(
            (self, other),
            (Verdict::Allow, Verdict::Allow)
                | (Verdict::Refuse, Verdict::Refuse)
                | (Verdict::NotImplemented, Verdict::NotImplemented)
        )
    }
}

/// The number line cut into ranges of one verdict: each `(first, verdict)`
/// holds up to the next one's first; the last runs to the end (so every
/// number above the table, x32's included, is refused).
fn ranges() -> Vec<(u32, Verdict)> {
    let mut table: BTreeMap<u32, Verdict> = BTreeMap::new();
    for &nr in ALLOWED {
        table.insert(nr as u32, Verdict::Allow);
    }
    for &nr in NOT_IMPLEMENTED {
        table.insert(nr as u32, Verdict::NotImplemented);
    }
    for &(nr, only) in ALLOWED_IF {
        table.insert(nr as u32, Verdict::Only(only));
    }
    let end = table.keys().next_back().map_or(0, |last| last + 1);
    let mut ranges: Vec<(u32, Verdict)> = Vec::new();
    for nr in 0..=end {
        let verdict = table.get(&nr).copied().unwrap_or(Verdict::Refuse);
        match ranges.last() {
            Some(&(_, last)) if last.merges_with(verdict) => {}
            _ => ranges.push((nr, verdict)),
        }
    }
    ranges
}

fn statement(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// Emits a binary search over `ranges` (the number loaded): each level one
/// comparison, so a call costs a handful of instructions and the kernel's
/// per-syscall verdict cache is computed in microseconds at install.
fn emit_search(ranges: &[(u32, Verdict)], out: &mut BpfProgram) {
    if let [(_, verdict)] = ranges {
        emit_verdict(*verdict, out);
        return;
    }
    let middle = ranges.len() / 2;
    // At or above the middle range's first number: the long jump to the
    // upper half (jump offsets of a comparison are only 8 bits); below it,
    // skip that jump and fall into the lower half.
    out.push(jump(JMP_JGE_K, ranges[middle].0, 0, 1));
    let long_jump = out.len();
    out.push(statement(JMP_JA, 0));
    emit_search(&ranges[..middle], out);
    out[long_jump].k = (out.len() - long_jump - 1) as u32;
    emit_search(&ranges[middle..], out);
}

/// The low 32-bit word of argument `arg`, then its high one (x86_64 is little-endian).
fn arg_low(arg: u8) -> u32 {
    DATA_ARGS + 8 * u32::from(arg)
}

fn emit_verdict(verdict: Verdict, out: &mut BpfProgram) {
    let refuse = RET_ERRNO | libc::EPERM as u32;
    match verdict {
        Verdict::Allow => out.push(statement(RET_K, RET_ALLOW)),
        Verdict::Refuse => out.push(statement(RET_K, refuse)),
        Verdict::NotImplemented => out.push(statement(RET_K, RET_ERRNO | libc::ENOSYS as u32)),
        Verdict::Only(Only::NoneOf { arg, mask }) => out.extend([
            statement(LD_W_ABS, arg_low(arg)),
            jump(JMP_JSET_K, mask as u32, 3, 0),
            statement(LD_W_ABS, arg_low(arg) + 4),
            jump(JMP_JSET_K, (mask >> 32) as u32, 1, 0),
            statement(RET_K, RET_ALLOW),
            statement(RET_K, refuse),
        ]),
        Verdict::Only(Only::OneOf { arg, values }) => {
            // An `int`: its low word only, as the kernel reads it.
            out.push(statement(LD_W_ABS, arg_low(arg)));
            let count = values.len();
            for (at, &value) in values.iter().enumerate() {
                // To the RET ALLOW after the RET EPERM that follows the last test.
                out.push(jump(JMP_JEQ_K, value, (count - at) as u8, 0));
            }
            out.push(statement(RET_K, refuse));
            out.push(statement(RET_K, RET_ALLOW));
        }
        Verdict::Only(Only::Not { arg, value }) => out.extend([
            statement(LD_W_ABS, arg_low(arg)),
            jump(JMP_JEQ_K, value, 1, 0),
            statement(RET_K, RET_ALLOW),
            statement(RET_K, refuse),
        ]),
    }
}

/// The program to install: a call of another ABI kills the process (i386's
/// `int 0x80` numbers mean other calls); an x86_64 one is looked up in the
/// ranges; anything unlisted answers EPERM.
pub(super) fn seccomp_filters() -> Result<Vec<BpfProgram>, super::step::StepError> {
    let mut program = vec![
        statement(LD_W_ABS, DATA_ARCH),
        jump(JMP_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        statement(RET_K, RET_KILL_PROCESS),
        statement(LD_W_ABS, DATA_NR),
    ];
    emit_search(&ranges(), &mut program);
    // BPF_MAXINSNS.
    if program.len() > 4096 {
        return Err(super::step::StepError::Refused(format!(
            "seccomp program of {} instructions is over the kernel's 4096",
            program.len()
        )));
    }
    Ok(vec![program])
}

#[cfg(test)]
mod tests {
    use super::*;

    const AUDIT_ARCH_I386: u32 = 0x4000_0003;
    const X32_SYSCALL_BIT: i64 = 0x4000_0000;
    const EPERM: u32 = RET_ERRNO | libc::EPERM as u32;
    const ENOSYS: u32 = RET_ERRNO | libc::ENOSYS as u32;

    /// What the deny-list this replaced refused; each must stay refused.
    const ONCE_DENIED: &[i64] = &[
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

    /// Refused by Docker's profile without the capabilities a sandbox lacks, and by this one.
    const ALSO_DENIED: &[i64] = &[
        libc::SYS_syslog,
        libc::SYS_kcmp,
        libc::SYS_pidfd_getfd,
        libc::SYS_process_madvise,
        libc::SYS_fanotify_init,
        libc::SYS_quotactl_fd,
        libc::SYS_sethostname,
        libc::SYS_setdomainname,
        libc::SYS_mbind,
        libc::SYS_set_mempolicy,
        libc::SYS_get_mempolicy,
        libc::SYS_uselib,
        libc::SYS_ustat,
        libc::SYS_sysfs,
        libc::SYS__sysctl,
        457, // statmount
        458, // listmount
        467, // open_tree_attr
    ];

    /// A classic BPF interpreter for the instructions this module emits, over one
    /// `struct seccomp_data` (nr, arch, instruction pointer, six arguments).
    fn run(program: &BpfProgram, nr: i64, arch: u32, args: [u64; 6]) -> u32 {
        let mut data = vec![nr as u32, arch, 0, 0];
        for arg in args {
            data.extend([arg as u32, (arg >> 32) as u32]);
        }
        let (mut acc, mut pc) = (0u32, 0usize);
        loop {
            let insn = &program[pc];
            pc += 1;
            match insn.code {
                0x20 => acc = data[insn.k as usize / 4], // LD W ABS
                0x54 => acc &= insn.k,                   // ALU AND K
                0x05 => pc += insn.k as usize,           // JA
                0x15 | 0x25 | 0x35 | 0x45 => {
                    let taken = match insn.code {
                        0x15 => acc == insn.k,
                        0x25 => acc > insn.k,
                        0x35 => acc >= insn.k,
                        _ => acc & insn.k != 0,
                    };
                    pc += usize::from(if taken { insn.jt } else { insn.jf });
                }
                0x06 => return insn.k, // RET K
                code => panic!("unexpected BPF opcode {code:#x}"),
            }
        }
    }

    /// The kernel's verdict over all filters: the most restrictive action wins.
    fn verdict_with(nr: i64, arch: u32, args: [u64; 6]) -> u32 {
        let filters = seccomp_filters().unwrap();
        filters
            .iter()
            .rev()
            .map(|program| run(program, nr, arch, args))
            .min_by_key(|&ret| (ret & 0xffff_0000) as i32)
            .unwrap()
    }

    fn verdict(nr: i64, arg0: u64) -> u32 {
        verdict_with(nr, AUDIT_ARCH_X86_64, [arg0, 0, 0, 0, 0, 0])
    }

    #[test]
    fn the_program_is_a_short_search() {
        let programs = seccomp_filters().unwrap();
        assert_eq!(programs.len(), 1);
        // seccompiler's linear program of the same list was 1570 long.
        assert!(
            programs[0].len() < 600,
            "{} instructions",
            programs[0].len()
        );
    }

    #[test]
    fn everything_listed_is_allowed() {
        for &nr in ALLOWED {
            assert_eq!(verdict(nr, 0), RET_ALLOW, "syscall {nr}");
        }
    }

    #[test]
    fn the_default_is_eperm_for_unknown_and_future_syscalls() {
        let listed: Vec<i64> = ALLOWED
            .iter()
            .chain(NOT_IMPLEMENTED)
            .copied()
            .chain(ALLOWED_IF.iter().map(|(nr, _)| *nr))
            .collect();
        for nr in (0..1024).filter(|nr| !listed.contains(nr)) {
            assert_eq!(verdict(nr, 0), EPERM, "syscall {nr}");
        }
        assert_eq!(verdict(u32::MAX.into(), 0), EPERM);
    }

    #[test]
    fn the_old_deny_list_and_docker_s_capability_gated_calls_stay_refused() {
        for &nr in ONCE_DENIED.iter().chain(ALSO_DENIED) {
            assert!(!ALLOWED.contains(&nr), "syscall {nr} is in the allow-list");
            assert_eq!(verdict(nr, 0), EPERM, "syscall {nr}");
        }
    }

    #[test]
    fn x32_and_foreign_architectures_are_refused() {
        for &nr in ALLOWED {
            assert_eq!(verdict(nr | X32_SYSCALL_BIT, 0), EPERM, "x32 syscall {nr}");
        }
        let i386_getpid = 20;
        assert_eq!(
            verdict_with(i386_getpid, AUDIT_ARCH_I386, [0; 6]),
            RET_KILL_PROCESS
        );
    }

    #[test]
    fn clone_without_namespaces_and_clone3_for_a_fallback() {
        let thread =
            (libc::CLONE_VM | libc::CLONE_FS | libc::CLONE_FILES | libc::CLONE_THREAD) as u64;
        assert_eq!(verdict(libc::SYS_clone, libc::SIGCHLD as u64), RET_ALLOW);
        assert_eq!(verdict(libc::SYS_clone, thread), RET_ALLOW);
        for bit in 0..64 {
            let flag = 1u64 << bit;
            if CLONE_NS_FLAGS & flag != 0 {
                assert_eq!(verdict(libc::SYS_clone, flag | thread), EPERM, "{flag:#x}");
            }
        }
        assert_eq!(verdict(libc::SYS_clone3, 0), ENOSYS);
    }

    #[test]
    fn personality_takes_only_docker_s_values() {
        for value in [0u64, 8, 0x2_0000, 0x2_0008, 0xffff_ffff] {
            assert_eq!(
                verdict(libc::SYS_personality, value),
                RET_ALLOW,
                "{value:#x}"
            );
        }
        let addr_no_randomize = 0x004_0000;
        let read_implies_exec = 0x040_0000;
        for value in [addr_no_randomize, read_implies_exec, 1] {
            assert_eq!(verdict(libc::SYS_personality, value), EPERM, "{value:#x}");
        }
    }

    #[test]
    fn sockets_of_every_family_but_vsock() {
        let vsock = libc::AF_VSOCK as u64;
        for family in [
            libc::AF_UNIX,
            libc::AF_INET,
            libc::AF_INET6,
            libc::AF_NETLINK,
        ] {
            assert_eq!(verdict(libc::SYS_socket, family as u64), RET_ALLOW);
        }
        assert_eq!(verdict(libc::SYS_socket, vsock), EPERM);
        // The kernel truncates the int: upper bits must not hide AF_VSOCK.
        assert_eq!(verdict(libc::SYS_socket, vsock | 1 << 32), EPERM);
    }
}
