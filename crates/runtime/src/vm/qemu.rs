//! QEMU's command line for one VM, and the choice of accelerator. Pure: the
//! host facts come in as values, so every rule here is unit-tested.
//!
//! The machine is `microvm` with qboot and a PVH kernel booted directly, one
//! virtio-blk root disk, one virtio-serial port for the agent, a virtio-rng,
//! one virtio-net NIC (on the sandbox's TAP device, or on a QEMU hub port
//! with nothing else on it when the sandbox has no network: the device set,
//! which saved memory depends on, is the same either way),
//! and the guest RAM in a file mapped shared (`memory-backend-file` with the
//! id `microvm.ram`, which microvm requires), so that saving a VM writes only
//! its device state (`x-ignore-shared`) and the RAM file is its memory. A
//! restore must see exactly the devices the save saw: [`LAYOUT_VERSION`]
//! names this set and is recorded with every saved memory.
//!
//! QEMU runs as an unprivileged user (see `confine`) and cannot reach the
//! sandbox's directory, which is root's: everything of it (RAM file, disk,
//! console log, QMP and agent sockets, the TAP device, virtiofsd
//! connections) comes as an inherited descriptor ([`Descriptors`]), files by
//! `/proc/self/fd/N`. It is started with `-sandbox`, QEMU's seccomp filter,
//! refusing obsolete calls, privilege changes, spawning and resource
//! control.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Changes whenever the device set or its order changes, which makes memory
/// saved before unusable.
pub(super) const LAYOUT_VERSION: u32 = 2;
/// The id QEMU gives the agent's serial port; `VSERPORT_CHANGE` events name it.
pub(super) const AGENT_PORT_ID: &str = "coveport";
/// The name the guest sees for the agent's port.
pub(super) const AGENT_PORT_NAME: &str = "cove.agent";
/// The QMP device id of the root disk, for `block_resize`.
pub(super) const ROOT_DRIVE: &str = "root";
/// The MAC of a NIC with no network behind it; a networked guest is given
/// its own by its agent (a restored NIC keeps the MAC of the saved one).
pub(super) const UNPLUGGED_MAC: [u8; 6] = [0x02, 0x76, 0, 0, 0, 0];

/// What the guest's NIC is plugged into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Nic {
    /// A hub port with no other port: frames go nowhere.
    Unplugged,
    /// The sandbox's TAP device, a port of cove's bridge.
    Tap { device: String, mac: [u8; 6] },
}

/// `aa:bb:cc:dd:ee:ff`.
pub(super) fn mac_text(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// How a VM executes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accelerator {
    Kvm,
    Tcg,
}

impl Accelerator {
    pub fn name(self) -> &'static str {
        match self {
            Accelerator::Kvm => "kvm",
            Accelerator::Tcg => "tcg",
        }
    }

    pub fn from_name(name: &str) -> Option<Accelerator> {
        match name {
            "kvm" => Some(Accelerator::Kvm),
            "tcg" => Some(Accelerator::Tcg),
            _ => None,
        }
    }
}

/// What the host offers, as [`detect_accelerator`] needs it.
#[derive(Clone, Debug, Default)]
pub struct HostFacts {
    /// `/proc/cpuinfo`.
    pub cpuinfo: String,
    /// Whether the `kvm_pvm` module is loaded: its KVM runs only guests built
    /// for PVM, and stock kernels fail under it.
    pub kvm_pvm_loaded: bool,
    /// Whether `/dev/kvm` opens for reading and writing.
    pub kvm_device_opens: bool,
}

impl HostFacts {
    /// Reads the facts of this host.
    pub fn read() -> HostFacts {
        HostFacts {
            cpuinfo: std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default(),
            kvm_pvm_loaded: Path::new("/sys/module/kvm_pvm").exists(),
            kvm_device_opens: std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/kvm")
                .is_ok(),
        }
    }

    /// The CPU's TSC frequency in kHz, from the first `cpu MHz` line.
    pub fn tsc_khz(&self) -> Option<u64> {
        let line = self.cpuinfo.lines().find(|l| l.starts_with("cpu MHz"))?;
        let mhz: f64 = line.split(':').nth(1)?.trim().parse().ok()?;
        (mhz > 0.0).then(|| (mhz * 1000.0).round() as u64)
    }
}

/// KVM where the CPU has hardware virtualisation, `kvm_pvm` is not in the
/// way, and `/dev/kvm` opens; software emulation (TCG) elsewhere.
pub fn detect_accelerator(facts: &HostFacts) -> Accelerator {
    choose_accelerator(facts).0
}

/// The accelerator [`detect_accelerator`] picks, and why, in words for the
/// log and `GET /api/config`.
pub fn choose_accelerator(facts: &HostFacts) -> (Accelerator, &'static str) {
    let hardware = facts
        .cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    if !hardware {
        (
            Accelerator::Tcg,
            "the CPU offers no hardware virtualisation (no vmx or svm in /proc/cpuinfo)",
        )
    } else if facts.kvm_pvm_loaded {
        (
            Accelerator::Tcg,
            "kvm_pvm is loaded: its KVM runs only guests built for PVM, and stock kernels fail under it",
        )
    } else if !facts.kvm_device_opens {
        (
            Accelerator::Tcg,
            "/dev/kvm cannot be opened for reading and writing",
        )
    } else {
        (
            Accelerator::Kvm,
            "the CPU has hardware virtualisation and /dev/kvm opens",
        )
    }
}

/// Everything one QEMU process is started with.
#[derive(Clone, Debug)]
pub(super) struct MachineSpec {
    pub accelerator: Accelerator,
    /// For TCG: the host's TSC frequency, which the guest must be told or it
    /// may hang calibrating its timer.
    pub tsc_khz: Option<u64>,
    pub cpus: u32,
    pub memory_mib: u64,
    pub firmware: PathBuf,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub ram_file: PathBuf,
    pub disk: PathBuf,
    pub console_log: PathBuf,
    /// QEMU's own messages (its stderr).
    pub qemu_log: PathBuf,
    pub agent_chardev: PathBuf,
    pub qmp_socket: PathBuf,
    pub pid_file: PathBuf,
    pub nic: Nic,
    /// Volumes: the tags of the virtio-fs devices the guest mounts them by,
    /// each served by a virtiofsd. QEMU cannot save a machine with one, so
    /// only cold boots have them.
    pub shares: Vec<String>,
    /// Wait for `migrate-incoming` instead of booting.
    pub incoming: bool,
    /// Run at the lowest CPU priority (nice 19): a machine nothing waits for.
    pub background: bool,
}

/// The numbers of the descriptors QEMU inherits (see the module's text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Descriptors {
    /// The RAM file, read and write.
    pub ram: i32,
    /// The root disk (qcow2), read and write.
    pub disk: i32,
    /// The console log, for appending.
    pub console: i32,
    /// A listening socket, bound at `qmp_socket`.
    pub qmp: i32,
    /// A listening socket, bound at `agent_chardev`.
    pub agent: i32,
    /// The TAP device, when the NIC is on one.
    pub tap: Option<i32>,
    /// A socket connected to each share's virtiofsd, in `shares`' order.
    pub shares: Vec<i32>,
}

/// The `-sandbox` argument: QEMU's own seccomp filter.
pub(super) const SANDBOX: &str =
    "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// A value inside a QEMU option list, where a comma is written twice.
fn option_value(text: &str) -> String {
    text.replace(',', ",,")
}

/// The guest kernel's command line.
pub(super) fn kernel_cmdline(spec: &MachineSpec) -> String {
    let mut words = vec![
        "console=ttyS0".to_owned(),
        "quiet".into(),
        "loglevel=4".into(),
        // Any kernel panic (including PID 1 exiting) resets the machine, and
        // QEMU exits on reset (-no-reboot): the runtime sees the VM end.
        "panic=-1".into(),
        "reboot=t".into(),
        "root=/dev/vda".into(),
        "rootfstype=ext4".into(),
        "rw".into(),
        "8250.nr_uarts=1".into(),
        // The only user of the guest is the sandbox, root inside it: guest
        // speculation mitigations would guard the guest kernel from its only
        // user, and cost most under emulation.
        "mitigations=off".into(),
        "random.trust_cpu=on".into(),
        "cryptomgr.notests".into(),
    ];
    if spec.accelerator == Accelerator::Tcg {
        if let Some(khz) = spec.tsc_khz {
            words.push(format!("tsc_early_khz={khz}"));
        }
        words.push("no_timer_check".into());
    }
    words.join(" ")
}

/// The `-name` argument, which names the QMP socket the process serves:
/// how a QEMU process is recognised as the one of a sandbox from its
/// command line.
pub(super) fn name_argument(qmp_socket: &Path) -> String {
    option_value(&format!("cove:{}", qmp_socket.display()))
}

/// A descriptor as a path QEMU opens.
fn fd_path(fd: i32) -> String {
    format!("/proc/self/fd/{fd}")
}

/// QEMU's arguments (without the program): the machine, then its devices,
/// then the control socket.
pub(super) fn arguments(spec: &MachineSpec, fds: &Descriptors) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    machine_arguments(&mut args, spec, fds);
    device_arguments(&mut args, fds);
    nic_and_share_arguments(&mut args, spec, fds);
    push(
        &mut args,
        &[
            "-chardev",
            &format!("socket,id=qmp,fd={},server=on,wait=off", fds.qmp),
            "-mon",
            "chardev=qmp,mode=control",
        ],
    );
    if spec.incoming {
        // Paused after the state loads, so the runtime can adjust the disk
        // and connect before the guest runs.
        push(&mut args, &["-incoming", "defer", "-S"]);
    }
    args
}

fn push(args: &mut Vec<OsString>, parts: &[&str]) {
    args.extend(parts.iter().map(OsString::from));
}

/// The machine: its name, sandboxing, accelerator, CPUs, memory (the RAM
/// file), firmware, kernel and command line.
fn machine_arguments(args: &mut Vec<OsString>, spec: &MachineSpec, fds: &Descriptors) {
    let mut push = |parts: &[&str]| push(args, parts);
    let path = |p: &Path| p.to_string_lossy().into_owned();
    let (accel, cpu) = match spec.accelerator {
        Accelerator::Kvm => ("kvm", "host"),
        Accelerator::Tcg => ("tcg,thread=multi", "max"),
    };
    push(&["-name", &name_argument(&spec.qmp_socket)]);
    push(&["-sandbox", SANDBOX]);
    push(&[
        "-machine",
        "microvm,pit=off,pic=off,rtc=on,isa-serial=on,acpi=on,memory-backend=microvm.ram",
    ]);
    push(&["-accel", accel, "-cpu", cpu]);
    push(&["-smp", &spec.cpus.to_string()]);
    push(&["-m", &format!("{}M", spec.memory_mib)]);
    push(&[
        "-object",
        &format!(
            "memory-backend-file,id=microvm.ram,size={}M,mem-path={},share=on",
            spec.memory_mib,
            fd_path(fds.ram)
        ),
    ]);
    push(&["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]);
    push(&["-bios", &path(&spec.firmware)]);
    push(&["-kernel", &path(&spec.kernel)]);
    push(&["-initrd", &path(&spec.initramfs)]);
    push(&["-append", &kernel_cmdline(spec)]);
}

/// The console, the root disk, the agent's port and the RNG.
fn device_arguments(args: &mut Vec<OsString>, fds: &Descriptors) {
    let mut push = |parts: &[&str]| push(args, parts);
    push(&[
        "-chardev",
        &format!("file,id=console,path={},append=on", fd_path(fds.console)),
        "-serial",
        "chardev:console",
    ]);
    push(&[
        "-drive",
        &format!(
            "id={ROOT_DRIVE},file={},format=qcow2,if=none,discard=unmap",
            fd_path(fds.disk)
        ),
        "-device",
        &format!("virtio-blk-device,drive={ROOT_DRIVE}"),
    ]);
    push(&["-device", "virtio-serial-device,max_ports=2"]);
    push(&[
        "-chardev",
        &format!("socket,id=agent,fd={},server=on,wait=off", fds.agent),
        "-device",
        &format!("virtserialport,id={AGENT_PORT_ID},chardev=agent,name={AGENT_PORT_NAME}"),
    ]);
    push(&["-device", "virtio-rng-device"]);
}

/// The NIC (on its TAP device, or on a hub port that leads nowhere) and a
/// virtio-fs device for each share.
fn nic_and_share_arguments(args: &mut Vec<OsString>, spec: &MachineSpec, fds: &Descriptors) {
    let mut push = |parts: &[&str]| push(args, parts);
    let (netdev, mac) = match &spec.nic {
        Nic::Unplugged => ("hubport,id=net0,hubid=0".to_owned(), UNPLUGGED_MAC),
        // No vhost: it would need /dev/vhost-net and adds nothing under TCG.
        // The runtime opened the TAP device; `fds.tap` is it.
        Nic::Tap { mac, .. } => (
            format!("tap,id=net0,fd={},vhost=off", fds.tap.unwrap_or(-1)),
            *mac,
        ),
    };
    push(&[
        "-netdev",
        &netdev,
        "-device",
        &format!("virtio-net-device,netdev=net0,mac={}", mac_text(&mac)),
    ]);
    // vhost-user needs the guest's memory shared with virtiofsd, which the
    // RAM file (share=on) already is.
    for (index, (tag, fd)) in spec.shares.iter().zip(&fds.shares).enumerate() {
        push(&[
            "-chardev",
            &format!("socket,id=share{index},fd={fd}"),
            "-device",
            &format!(
                "vhost-user-fs-device,chardev=share{index},tag={}",
                option_value(tag)
            ),
        ]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(flags: &str, pvm: bool, opens: bool) -> HostFacts {
        HostFacts {
            cpuinfo: format!("processor\t: 0\ncpu MHz\t\t: 2595.124\nflags\t\t: fpu {flags} sse\n"),
            kvm_pvm_loaded: pvm,
            kvm_device_opens: opens,
        }
    }

    #[test]
    fn kvm_needs_hardware_support_no_pvm_and_the_device() {
        assert_eq!(
            detect_accelerator(&facts("vmx", false, true)),
            Accelerator::Kvm
        );
        assert_eq!(
            detect_accelerator(&facts("svm", false, true)),
            Accelerator::Kvm
        );
        assert_eq!(
            detect_accelerator(&facts("svm", true, true)),
            Accelerator::Tcg
        );
        assert_eq!(
            detect_accelerator(&facts("svm", false, false)),
            Accelerator::Tcg
        );
        assert_eq!(
            detect_accelerator(&facts("hypervisor", false, true)),
            Accelerator::Tcg
        );
        // Each choice says why.
        assert!(choose_accelerator(&facts("svm", true, true))
            .1
            .contains("kvm_pvm"));
        assert!(choose_accelerator(&facts("svm", false, false))
            .1
            .contains("/dev/kvm"));
        assert!(choose_accelerator(&facts("hypervisor", false, true))
            .1
            .contains("vmx or svm"));
        assert!(choose_accelerator(&facts("vmx", false, true))
            .1
            .contains("hardware"));
    }

    #[test]
    fn the_tsc_frequency_comes_from_cpuinfo() {
        assert_eq!(facts("", false, false).tsc_khz(), Some(2_595_124));
        assert_eq!(HostFacts::default().tsc_khz(), None);
    }

    fn spec(accelerator: Accelerator, incoming: bool) -> MachineSpec {
        let p = |s: &str| PathBuf::from(format!("/s/{s}"));
        MachineSpec {
            accelerator,
            tsc_khz: Some(2_000_000),
            cpus: 2,
            memory_mib: 512,
            firmware: "/usr/share/qemu/qboot.rom".into(),
            kernel: "/assets/vmlinux".into(),
            initramfs: "/assets/initramfs.cpio".into(),
            ram_file: p("ram"),
            disk: p("disk.qcow2"),
            console_log: p("console.log"),
            qemu_log: p("qemu.log"),
            agent_chardev: p("serial.sock"),
            qmp_socket: p("qmp.sock"),
            pid_file: p("qemu.pid"),
            nic: Nic::Unplugged,
            shares: Vec::new(),
            incoming,
            background: false,
        }
    }

    fn fds() -> Descriptors {
        Descriptors {
            ram: 11,
            disk: 12,
            console: 13,
            qmp: 14,
            agent: 15,
            tap: Some(16),
            shares: vec![20, 21],
        }
    }

    fn joined(spec: &MachineSpec) -> String {
        arguments(spec, &fds())
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn tcg_guests_get_the_timer_settings() {
        let line = kernel_cmdline(&spec(Accelerator::Tcg, false));
        assert!(line.contains("tsc_early_khz=2000000"), "{line}");
        assert!(line.contains("no_timer_check"), "{line}");
        let line = kernel_cmdline(&spec(Accelerator::Kvm, false));
        assert!(!line.contains("tsc_early_khz"), "{line}");
    }

    #[test]
    fn ram_is_a_shared_file_named_for_microvm() {
        let args = joined(&spec(Accelerator::Tcg, false));
        assert!(args.contains("memory-backend=microvm.ram"), "{args}");
        assert!(
            args.contains(
                "memory-backend-file,id=microvm.ram,size=512M,mem-path=/proc/self/fd/11,share=on"
            ),
            "{args}"
        );
        assert!(args.contains("-accel tcg,thread=multi -cpu max"), "{args}");
        assert!(args.contains("-smp 2 -m 512M"), "{args}");
        assert!(!args.contains("-incoming"), "{args}");
    }

    #[test]
    fn the_sandbox_directory_is_reached_only_through_descriptors() {
        let args = arguments(&spec(Accelerator::Tcg, false), &fds());
        let text: Vec<String> = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let name = text.iter().position(|a| a == "-name").unwrap();
        assert_eq!(text[name + 1], "cove:/s/qmp.sock");
        for (at, arg) in text.iter().enumerate() {
            assert!(at == name + 1 || !arg.contains("/s/"), "{arg}");
        }
        let joined = text.join(" ");
        assert!(joined.contains(&format!("-sandbox {SANDBOX}")), "{joined}");
        assert!(
            joined.contains("file=/proc/self/fd/12,format=qcow2"),
            "{joined}"
        );
        assert!(
            joined.contains("file,id=console,path=/proc/self/fd/13,append=on"),
            "{joined}"
        );
        assert!(
            joined.contains(
                "-chardev socket,id=qmp,fd=14,server=on,wait=off -mon chardev=qmp,mode=control"
            ),
            "{joined}"
        );
        assert!(
            joined.contains("socket,id=agent,fd=15,server=on,wait=off"),
            "{joined}"
        );
        assert!(!joined.contains("-pidfile"), "{joined}");
        assert_eq!(
            name_argument(Path::new("/a,b/qmp.sock")),
            "cove:/a,,b/qmp.sock"
        );
    }

    #[test]
    fn the_nic_is_always_there_and_on_the_tap_when_networked() {
        let mut machine = spec(Accelerator::Tcg, false);
        let args = joined(&machine);
        assert!(args.contains("-netdev hubport,id=net0,hubid=0"), "{args}");
        assert!(
            args.contains("virtio-net-device,netdev=net0,mac=02:76:00:00:00:00"),
            "{args}"
        );
        machine.nic = Nic::Tap {
            device: "cove0v1f".into(),
            mac: [2, 0x76, 10, 77, 0, 9],
        };
        let args = joined(&machine);
        assert!(
            args.contains("-netdev tap,id=net0,fd=16,vhost=off"),
            "{args}"
        );
        assert!(!args.contains("cove0v1f"), "{args}");
        assert!(args.contains("mac=02:76:0a:4d:00:09"), "{args}");
    }

    #[test]
    fn each_share_is_a_virtio_fs_device_with_commas_escaped() {
        let mut machine = spec(Accelerator::Tcg, false);
        assert!(!joined(&machine).contains("vhost-user-fs"));
        machine.shares = vec!["cove-vol0".into(), "a,b".into()];
        let args = joined(&machine);
        assert!(
            args.contains(
                "-chardev socket,id=share0,fd=20 \
                 -device vhost-user-fs-device,chardev=share0,tag=cove-vol0"
            ),
            "{args}"
        );
        assert!(args.contains("chardev=share1,tag=a,,b "), "{args}");
    }

    #[test]
    fn a_restore_waits_for_its_state_and_keeps_the_devices() {
        let boot = arguments(&spec(Accelerator::Kvm, false), &fds());
        let restore = arguments(&spec(Accelerator::Kvm, true), &fds());
        assert_eq!(&restore[..boot.len()], &boot[..]);
        assert_eq!(&restore[boot.len()..], ["-incoming", "defer", "-S"]);
        assert!(joined(&spec(Accelerator::Kvm, true)).contains("-accel kvm -cpu host"));
    }
}
