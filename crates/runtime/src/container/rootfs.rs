//! The container's filesystem view, built by the container init inside its own mount
//! namespace: the overlay of the image and the sandbox's writable layer, /proc, a minimal
//! /dev, read-only /sys, a /run tmpfs carrying the agent binary, then pivot_root, the
//! network's resolv.conf, and the masked and read-only /proc and /sys paths. Nothing here
//! is visible on the host, so nothing needs unmounting: the mounts die with the namespace.

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::unistd::{chdir, pivot_root};

use super::init_args::{CgroupView, InitArgs};
use super::layout::SandboxLayout;

/// Where the agent binary appears inside every container.
pub const AGENT_PATH: &str = "/run/cove/cove-agent";

/// Character devices of /dev: name, major, minor.
const DEVICES: [(&str, u64, u64); 6] = [
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

const DEV_LINKS: [(&str, &str); 5] = [
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
    ("ptmx", "pts/ptmx"),
];

/// Files hidden behind /dev/null (Docker's masked files).
const MASKED_FILES: [&str; 6] = [
    "/proc/kcore",
    "/proc/keys",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/latency_stats",
];
/// Directories hidden behind an empty read-only tmpfs.
const MASKED_DIRS: [&str; 5] = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];
const READ_ONLY: [&str; 5] = [
    "/proc/sys",
    "/proc/sysrq-trigger",
    "/proc/irq",
    "/proc/bus",
    "/proc/fs",
];

fn step<T>(result: nix::Result<T>, what: impl FnOnce() -> String) -> Result<T, String> {
    result.map_err(|errno| format!("{}: {}", what(), errno.desc()))
}

fn io_step<T>(result: std::io::Result<T>, what: impl FnOnce() -> String) -> Result<T, String> {
    result.map_err(|err| format!("{}: {err}", what()))
}

/// The overlayfs mount options; the paths were checked for separators by the server.
pub fn overlay_options(lower: &Path, upper: &Path, work: &Path) -> String {
    format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    )
}

fn mount_fs(fstype: &str, target: &Path, flags: MsFlags, data: Option<&str>) -> Result<(), String> {
    step(
        mount(Some(fstype), target, Some(fstype), flags, data),
        || format!("mount {fstype} at {}", target.display()),
    )
}

fn bind(source: &Path, target: &Path, flags: MsFlags) -> Result<(), String> {
    step(
        mount(
            Some(source),
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        ),
        || format!("bind {} at {}", source.display(), target.display()),
    )?;
    if flags.is_empty() {
        return Ok(());
    }
    step(
        mount(
            None::<&str>,
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | flags,
            None::<&str>,
        ),
        || format!("remount {} with {flags:?}", target.display()),
    )
}

fn mkdir(path: &Path) -> Result<(), String> {
    io_step(fs::create_dir_all(path), || {
        format!("create {}", path.display())
    })
}

/// Builds the root, pivots into it and detaches the host's. Returns with `/` as cwd.
pub fn build(args: &InitArgs) -> Result<(), String> {
    let layout = SandboxLayout {
        dir: args.sandbox_dir.clone(),
    };
    let root = layout.rootfs();
    // Mount events must not propagate back to the host's shared mounts.
    step(
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        ),
        || "make / private".to_string(),
    )?;
    let lower = args
        .layers
        .iter()
        .chain([&args.rootfs])
        .map(|p| p.display().to_string());
    let lower = lower.collect::<Vec<_>>().join(":");
    let options = overlay_options(Path::new(&lower), &layout.upper(), &layout.work());
    mount_fs("overlay", &root, MsFlags::empty(), Some(&options))?;

    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let proc_dir = root.join("proc");
    mkdir(&proc_dir)?;
    mount_fs("proc", &proc_dir, nosuid_nodev_noexec, None)?;
    let sys = root.join("sys");
    mkdir(&sys)?;
    mount_fs(
        "sysfs",
        &sys,
        nosuid_nodev_noexec | MsFlags::MS_RDONLY,
        None,
    )?;
    build_cgroup(&sys.join("fs/cgroup"), &args.cgroup_views)?;
    build_dev(&root.join("dev"))?;
    build_run(&root.join("run"), &args.agent_binary)?;
    for volume in &args.volumes {
        mount_volume(&root, volume)?;
    }

    step(nix::unistd::sethostname(&args.hostname), || {
        format!("set hostname {:?}", args.hostname)
    })?;
    if args.network.is_none() {
        super::loopback::loopback_up()?;
    }

    // pivot_root(".", ".") stacks the old root on the new one; detaching it leaves the
    // container with nothing of the host's tree.
    step(chdir(&root), || format!("enter {}", root.display()))?;
    step(pivot_root(".", "."), || {
        format!("pivot_root into {}", root.display())
    })?;
    step(umount2(".", MntFlags::MNT_DETACH), || {
        "detach the host root".to_string()
    })?;
    step(chdir("/"), || "enter /".to_string())?;
    if let Some(network) = &args.network {
        resolv_conf(&network.resolv_conf)?;
    }
    mask_paths()
}

/// A read-only tmpfs at `/sys/fs/cgroup` holding read-only binds of the
/// sandbox's own cgroups (as Docker does): the agent reads its limits and usage
/// there, and nothing of the host's other cgroups is visible.
fn build_cgroup(dir: &Path, views: &[CgroupView]) -> Result<(), String> {
    if views.is_empty() {
        return Ok(());
    }
    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount_fs("tmpfs", dir, nosuid_nodev_noexec, Some("mode=755,size=64k"))?;
    for view in views {
        let target = dir.join(&view.target);
        mkdir(&target)?;
        bind(
            &view.host,
            &target,
            nosuid_nodev_noexec | MsFlags::MS_RDONLY,
        )?;
    }
    step(
        mount(
            None::<&str>,
            dir,
            None::<&str>,
            MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | nosuid_nodev_noexec,
            Some("mode=755,size=64k"),
        ),
        || format!("remount {} read-only", dir.display()),
    )
}

/// Binds a volume's directory at its path under `root`. Runs before
/// pivot_root, so a symlink on the way (the sandbox's own files can hold
/// any) would resolve on the host: the path is made, or walked, one plain
/// directory at a time and refused at the first symlink.
fn mount_volume(root: &Path, volume: &crate::VolumeBind) -> Result<(), String> {
    let mut target = root.to_path_buf();
    for part in volume.target.components() {
        let std::path::Component::Normal(part) = part else {
            continue;
        };
        target.push(part);
        match fs::symlink_metadata(&target) {
            Ok(meta) if meta.file_type().is_symlink() => {
                return Err(format!(
                    "volume mount path {} passes through a symlink in the sandbox",
                    volume.target.display()
                ))
            }
            Ok(meta) if !meta.is_dir() => {
                return Err(format!(
                    "volume mount path {}: {} is not a directory",
                    volume.target.display(),
                    target.strip_prefix(root).unwrap_or(&target).display()
                ))
            }
            Ok(_) => {}
            Err(_) => io_step(fs::create_dir(&target), || {
                format!("create {}", target.display())
            })?,
        }
    }
    bind(
        &volume.source,
        &target,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
    )
}

/// Where the sandbox's resolv.conf lives, on the /run tmpfs.
const RESOLV_CONF_SOURCE: &str = "/run/cove/resolv.conf";

/// Puts the network's resolv.conf over `/etc/resolv.conf` (a bind mount, as
/// Docker does, so the sandbox's own layer keeps its file). The image's copy
/// is never used: debootstrap copies the host's, and queries to the host's
/// resolvers would bypass cove's. Runs after pivot_root, so a symlink there
/// resolves inside the container, never on the host.
fn resolv_conf(content: &str) -> Result<(), String> {
    let source = Path::new(RESOLV_CONF_SOURCE);
    io_step(fs::write(source, content), || {
        format!("write {}", source.display())
    })?;
    let target = Path::new("/etc/resolv.conf");
    mkdir(Path::new("/etc"))?;
    let is_file = fs::symlink_metadata(target).is_ok_and(|m| m.file_type().is_file());
    if !is_file {
        // A dangling symlink (to systemd-resolved, say) or nothing: a plain
        // file to mount on.
        match fs::remove_file(target) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                return Err(format!("remove {}: {err}", target.display()))
            }
            _ => {}
        }
        io_step(fs::File::create(target), || {
            format!("create {}", target.display())
        })?;
    }
    bind(source, target, MsFlags::empty())
}

fn build_dev(dev: &Path) -> Result<(), String> {
    mkdir(dev)?;
    mount_fs(
        "tmpfs",
        dev,
        MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME,
        Some("mode=755,size=65536k"),
    )?;
    for (name, major, minor) in DEVICES {
        let path = dev.join(name);
        step(
            mknod(
                &path,
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o666),
                makedev(major, minor),
            ),
            || format!("create device {}", path.display()),
        )?;
        // mknod honours the umask; the nodes must be usable by everyone.
        io_step(
            fs::set_permissions(&path, fs::Permissions::from_mode(0o666)),
            || format!("chmod {}", path.display()),
        )?;
    }
    let pts = dev.join("pts");
    mkdir(&pts)?;
    mount_fs(
        "devpts",
        &pts,
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
    )?;
    let shm = dev.join("shm");
    mkdir(&shm)?;
    mount_fs(
        "tmpfs",
        &shm,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=1777,size=65536k"),
    )?;
    for (name, target) in DEV_LINKS {
        let link = dev.join(name);
        io_step(symlink(target, &link), || {
            format!("link {} to {target}", link.display())
        })?;
    }
    Ok(())
}

fn build_run(run: &Path, agent_binary: &Path) -> Result<(), String> {
    mkdir(run)?;
    mount_fs(
        "tmpfs",
        run,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=755"),
    )?;
    let agent = run.join(AGENT_PATH.trim_start_matches("/run/"));
    mkdir(agent.parent().unwrap_or(run))?;
    io_step(fs::File::create(&agent), || {
        format!("create {}", agent.display())
    })?;
    bind(
        agent_binary,
        &agent,
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
    )
}

fn mask_paths() -> Result<(), String> {
    for file in MASKED_FILES
        .map(Path::new)
        .into_iter()
        .filter(|p| p.exists())
    {
        bind(Path::new("/dev/null"), file, MsFlags::empty())?;
    }
    for dir in MASKED_DIRS
        .map(Path::new)
        .into_iter()
        .filter(|p| p.is_dir())
    {
        mount_fs("tmpfs", dir, MsFlags::MS_RDONLY, Some("size=0"))?;
    }
    let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    for path in READ_ONLY.map(Path::new).into_iter().filter(|p| p.exists()) {
        bind(path, path, flags)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_options_name_all_three_layers() {
        let options = overlay_options(
            Path::new("/img"),
            Path::new("/s/upper"),
            Path::new("/s/work"),
        );
        assert_eq!(options, "lowerdir=/img,upperdir=/s/upper,workdir=/s/work");
    }

    #[test]
    fn agent_lands_under_run() {
        let run = Path::new("/x/run");
        assert_eq!(
            run.join(AGENT_PATH.trim_start_matches("/run/")),
            Path::new("/x/run/cove/cove-agent")
        );
    }
}
