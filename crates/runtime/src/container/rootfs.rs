//! The container's filesystem view, built by the container init inside its own mount
//! namespace: the overlay of the image and the sandbox's writable layer, /proc, a minimal
//! /dev, read-only /sys, a /run tmpfs carrying the agent binary, then pivot_root, the
//! network's resolv.conf, and the masked and read-only /proc and /sys paths. Nothing here
//! is visible on the host, so nothing needs unmounting: the mounts die with the namespace.

use std::fs;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::unistd::{chdir, pivot_root};

use super::init_args::{CgroupView, InitArgs};
use super::layout::SandboxLayout;
use super::step::StepError;

/// The group that owns terminals in Debian-like images.
const TTY_GID: u32 = 5;

/// Where the agent binary appears inside every container.
pub(super) const AGENT_PATH: &str = "/run/cove/cove-agent";

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

fn step<T>(result: nix::Result<T>, what: impl FnOnce() -> String) -> Result<T, StepError> {
    result.map_err(super::step::sys(what))
}

fn io_step<T>(result: std::io::Result<T>, what: impl FnOnce() -> String) -> Result<T, StepError> {
    result.map_err(super::step::io(what))
}

/// The overlayfs mount options; the paths were checked for separators by the server.
pub(super) fn overlay_options(lower: &Path, upper: &Path, work: &Path) -> String {
    format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    )
}

fn mount_fs(
    fstype: &str,
    target: &Path,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), StepError> {
    step(
        mount(Some(fstype), target, Some(fstype), flags, data),
        || format!("mount {fstype} at {}", target.display()),
    )
}

fn bind(source: &Path, target: &Path, flags: MsFlags) -> Result<(), StepError> {
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

fn mkdir(path: &Path) -> Result<(), StepError> {
    io_step(fs::create_dir_all(path), || {
        format!("create {}", path.display())
    })
}

/// Builds the root, pivots into it and detaches the host's. Returns with `/` as cwd.
/// `userns` is the sandbox's user namespace (ids 0.. are host ids `args.id_base`..):
/// layers and volumes are mounted idmapped through it, and what the kernel makes
/// (tmpfs roots, device nodes, ptys) is owned by the sandbox's root, not the host's.
pub(super) fn build(args: &InitArgs, userns: &OwnedFd) -> Result<(), StepError> {
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
    // Every layer, and the sandbox's directory (its writable layer and the
    // overlay's work directory), is covered by an idmapped copy of itself, in
    // this mount namespace only: on disk owner 0 stays 0 and reads as the
    // sandbox's root.
    for layer in args.layers.iter().chain([&args.rootfs, &layout.dir]) {
        idmap_in_place(layer, userns)?;
    }
    let lower = args
        .layers
        .iter()
        .chain([&args.rootfs])
        .map(|p| p.display().to_string());
    let lower = lower.collect::<Vec<_>>().join(":");
    let options = overlay_options(Path::new(&lower), &layout.upper(), &layout.work());
    as_sandbox_root(args.id_base, || {
        mount_fs("overlay", &root, MsFlags::empty(), Some(&options))
    })?;

    let owner = Owner::of_sandbox_root(args.id_base);
    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let proc_dir = root.join("proc");
    owner.mkdir_in_root(&proc_dir)?;
    mount_fs("proc", &proc_dir, nosuid_nodev_noexec, None)?;
    let sys = root.join("sys");
    owner.mkdir_in_root(&sys)?;
    mount_fs(
        "sysfs",
        &sys,
        nosuid_nodev_noexec | MsFlags::MS_RDONLY,
        None,
    )?;
    build_cgroup(&sys.join("fs/cgroup"), &args.cgroup_views)?;
    build_dev(&root.join("dev"), owner)?;
    build_run(&root.join("run"), &args.agent_binary, owner)?;
    for volume in &args.volumes {
        mount_volume(&root, volume, userns, owner)?;
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
        etc_file(RESOLV_CONF, &network.resolv_conf, owner)?;
    }
    etc_file(HOSTS, &hosts(&args.hostname), owner)?;
    mask_paths()
}

/// The host ids of the sandbox's root, which owns what the kernel makes for it.
#[derive(Clone, Copy, Debug)]
struct Owner {
    uid: u32,
    gid: u32,
}

impl Owner {
    fn of_sandbox_root(id_base: u32) -> Self {
        Owner {
            uid: id_base,
            gid: id_base,
        }
    }

    /// tmpfs options that make its root directory the sandbox root's.
    fn tmpfs(self, options: &str) -> String {
        format!("{options},uid={},gid={}", self.uid, self.gid)
    }

    /// Runs `make`, which creates files in the sandbox's root filesystem,
    /// as the sandbox's root: through its idmapped layers host root has no
    /// id, and what it makes is owned by 0 on disk.
    fn in_root<T>(self, make: impl FnOnce() -> Result<T, StepError>) -> Result<T, StepError> {
        as_sandbox_root(self.uid, make)
    }

    fn mkdir_in_root(self, path: &Path) -> Result<(), StepError> {
        self.in_root(|| mkdir(path))
    }

    fn chown(self, path: &Path) -> Result<(), StepError> {
        io_step(
            std::os::unix::fs::lchown(path, Some(self.uid), Some(self.gid)),
            || format!("chown {}", path.display()),
        )
    }
}

/// Mounts an idmapped copy of the directory `path` over it.
fn idmap_in_place(path: &Path, userns: &OwnedFd) -> Result<(), StepError> {
    use std::os::fd::AsFd;
    let dir = io_step(crate::beneath::open_root(path), || {
        format!("open the overlay layer {}", path.display())
    })?;
    let tree = io_step(
        crate::beneath::clone_tree_mapped(dir.as_fd(), 0, Some(userns.as_fd())),
        || {
            format!(
                "make an idmapped mount of the overlay layer {}",
                path.display()
            )
        },
    )?;
    io_step(crate::beneath::attach(tree.as_fd(), dir.as_fd()), || {
        format!(
            "mount the idmapped copy of the overlay layer {}",
            path.display()
        )
    })
}

/// Runs `work` with the file-system ids of the sandbox's root (and every
/// capability still in effect). overlayfs keeps the credentials of whoever
/// mounted it and makes its work directory, whiteouts and copied-up files
/// with them, through the idmapped layers: host root has no id there, the
/// sandbox's root is 0 on disk.
fn as_sandbox_root<T>(
    id_base: u32,
    work: impl FnOnce() -> Result<T, StepError>,
) -> Result<T, StepError> {
    nix::unistd::setfsgid(nix::unistd::Gid::from_raw(id_base));
    nix::unistd::setfsuid(nix::unistd::Uid::from_raw(id_base));
    // A non-zero fsuid drops the file-system capabilities from the effective set.
    let done = super::harden::raise_effective().and_then(|()| work());
    nix::unistd::setfsuid(nix::unistd::Uid::from_raw(0));
    nix::unistd::setfsgid(nix::unistd::Gid::from_raw(0));
    let raised = super::harden::raise_effective();
    done.and_then(|value| raised.map(|()| value))
}

/// A read-only tmpfs at `/sys/fs/cgroup` holding read-only binds of the
/// sandbox's own cgroups (as Docker does): the agent reads its limits and usage
/// there, and nothing of the host's other cgroups is visible.
fn build_cgroup(dir: &Path, views: &[CgroupView]) -> Result<(), StepError> {
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
/// pivot_root, so a symlink anywhere on either side (the sandbox's own files
/// and every volume can hold any, and a sandbox sharing the volume can swap a
/// directory for one at any moment) would resolve on the host: both paths
/// are opened with [`crate::beneath`], refused at the first symlink, and the
/// mount is made between the two descriptors.
fn mount_volume(
    root: &Path,
    volume: &crate::VolumeBind,
    userns: &OwnedFd,
    owner: Owner,
) -> Result<(), StepError> {
    use crate::beneath::{self, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOSUID};
    use std::os::fd::AsFd;

    let subpath = volume.subpath.as_deref().unwrap_or(Path::new(""));
    let source = beneath::open_dir(&volume.root, subpath, Some(beneath::SHARED_DIR_MODE)).map_err(
        |source| StepError::Beneath {
            step: format!(
                "volume {} mounted at {}: subpath {}",
                volume
                    .root
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy(),
                volume.target.display(),
                subpath.display()
            ),
            source,
        },
    )?;
    let relative = volume.target.strip_prefix("/").unwrap_or(&volume.target);
    let target = owner.in_root(|| {
        beneath::open_dir(root, relative, Some(beneath::PRIVATE_DIR_MODE)).map_err(|source| {
            StepError::Beneath {
                step: format!(
                    "volume mount path {} in the sandbox",
                    volume.target.display()
                ),
                source,
            }
        })
    })?;
    let tree = beneath::clone_tree_mapped(
        source.as_fd(),
        MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        Some(userns.as_fd()),
    )
    .map_err(super::step::io(|| {
        format!(
            "copy the mount of the volume for {}",
            volume.target.display()
        )
    }))?;
    beneath::attach(tree.as_fd(), target.as_fd()).map_err(super::step::io(|| {
        format!("mount the volume at {}", volume.target.display())
    }))
}

/// The files of `/etc` cove puts over the image's (see [`etc_file`]).
const RESOLV_CONF: &str = "resolv.conf";
const HOSTS: &str = "hosts";

/// The sandbox's `/etc/hosts`, as Docker writes it: localhost, and its own
/// name, so programs that look it up (`sudo` does) find it.
fn hosts(hostname: &str) -> String {
    format!(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"
    )
}

/// Puts `content` over `/etc/<name>` (a bind mount of a file on the /run
/// tmpfs, as Docker does, so the sandbox's own layer keeps its file). For
/// resolv.conf the image's copy is never used: debootstrap copies the
/// host's, and queries to the host's resolvers would bypass cove's. Runs
/// after pivot_root, so a symlink there resolves inside the container, never
/// on the host.
fn etc_file(name: &str, content: &str, owner: Owner) -> Result<(), StepError> {
    let source = Path::new("/run/cove").join(name);
    io_step(fs::write(&source, content), || {
        format!("write {}", source.display())
    })?;
    owner.chown(&source)?;
    let target = Path::new("/etc").join(name);
    mkdir(Path::new("/etc"))?;
    let is_file = fs::symlink_metadata(&target).is_ok_and(|m| m.file_type().is_file());
    if !is_file {
        // A dangling symlink (to systemd-resolved, say) or nothing: a plain
        // file to mount on.
        match fs::remove_file(&target) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                return Err(super::step::io(|| format!("remove {}", target.display()))(
                    err,
                ))
            }
            _ => {}
        }
        owner.in_root(|| {
            io_step(fs::File::create(&target), || {
                format!("create {}", target.display())
            })
        })?;
    }
    bind(&source, &target, MsFlags::empty())
}

fn build_dev(dev: &Path, owner: Owner) -> Result<(), StepError> {
    owner.mkdir_in_root(dev)?;
    mount_fs(
        "tmpfs",
        dev,
        MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME,
        Some(&owner.tmpfs("mode=755,size=65536k")),
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
        owner.chown(&path)?;
    }
    let pts = dev.join("pts");
    mkdir(&pts)?;
    mount_fs(
        "devpts",
        &pts,
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        // Terminals belong to the sandbox's group 5 (tty), as in any image.
        Some(&format!(
            "newinstance,ptmxmode=0666,mode=0620,gid={}",
            owner.gid + TTY_GID
        )),
    )?;
    let shm = dev.join("shm");
    mkdir(&shm)?;
    mount_fs(
        "tmpfs",
        &shm,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(&owner.tmpfs("mode=1777,size=65536k")),
    )?;
    for (name, target) in DEV_LINKS {
        let link = dev.join(name);
        io_step(symlink(target, &link), || {
            format!("link {} to {target}", link.display())
        })?;
    }
    Ok(())
}

fn build_run(run: &Path, agent_binary: &Path, owner: Owner) -> Result<(), StepError> {
    owner.mkdir_in_root(run)?;
    mount_fs(
        "tmpfs",
        run,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&owner.tmpfs("mode=755")),
    )?;
    let agent = run.join(AGENT_PATH.trim_start_matches("/run/"));
    mkdir(agent.parent().unwrap_or(run))?;
    owner.chown(agent.parent().unwrap_or(run))?;
    io_step(fs::File::create(&agent), || {
        format!("create {}", agent.display())
    })?;
    bind(
        agent_binary,
        &agent,
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
    )
}

fn mask_paths() -> Result<(), StepError> {
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
