//! Cgroups of container sandboxes: one group per sandbox under the configured parent,
//! with its CPU, memory and pids limits, and the means to find and kill every process in
//! it. Owns nothing but files under the cgroup mounts; it never spawns or enters a process.
//!
//! cgroup v1 (one hierarchy per controller, as on hybrid hosts) and v2 (one unified tree)
//! sit behind [`CgroupBackend`]; [`detect`] picks one by looking at the host.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::init_args::CgroupView;
use crate::Resources;

/// The scheduler period every sandbox gets; the quota is `cpu` times this.
pub(crate) const CPU_PERIOD_US: u64 = 100_000;

/// v1 controllers a sandbox must have; `cpuacct` and `devices` are joined when mounted.
const V1_REQUIRED: [&str; 4] = ["cpu", "memory", "pids", "freezer"];
const V1_OPTIONAL: [&str; 2] = ["cpuacct", "devices"];

/// Docker's default device allow-list: any node may be created (`m`), only these opened.
const V1_DEVICE_ALLOW: [&str; 10] = [
    "c *:* m",
    "b *:* m",
    "c 1:3 rwm",   // null
    "c 1:5 rwm",   // zero
    "c 1:7 rwm",   // full
    "c 1:8 rwm",   // random
    "c 1:9 rwm",   // urandom
    "c 5:0 rwm",   // tty
    "c 5:2 rwm",   // ptmx
    "c 136:* rwm", // pts
];

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cgroup controller {controller} is not mounted at {path}")]
    MissingController { controller: String, path: PathBuf },
    #[error("cannot {action} {path}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("processes of cgroup {path} did not exit within {waited:?}")]
    StillPopulated { path: PathBuf, waited: Duration },
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CgroupError + 'a {
    move |source| CgroupError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// The limits written into a sandbox's cgroup, computed from its [`Resources`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CgroupLimits {
    /// `None` means no CPU limit.
    pub cpu_quota_us: Option<u64>,
    pub cpu_period_us: u64,
    /// `None` means no memory limit.
    pub memory_bytes: Option<u64>,
    pub pids_max: u64,
}

impl CgroupLimits {
    /// Zero CPUs or zero memory means "no limit", never "nothing".
    pub(crate) fn new(resources: &Resources, pids_max: u64) -> Self {
        let cpu = u64::from(resources.cpu);
        Self {
            cpu_quota_us: (cpu > 0).then(|| cpu.saturating_mul(CPU_PERIOD_US)),
            cpu_period_us: CPU_PERIOD_US,
            memory_bytes: (resources.memory_mib > 0)
                .then(|| resources.memory_mib.saturating_mul(1024 * 1024)),
            pids_max,
        }
    }

    /// The value of v2's `cpu.max`.
    pub(crate) fn v2_cpu_max(&self) -> String {
        match self.cpu_quota_us {
            Some(quota) => format!("{quota} {}", self.cpu_period_us),
            None => format!("max {}", self.cpu_period_us),
        }
    }

    /// The value of v1's `cpu.cfs_quota_us` (-1 is unlimited).
    pub(crate) fn v1_cpu_quota(&self) -> String {
        self.cpu_quota_us
            .map_or_else(|| "-1".to_string(), |q| q.to_string())
    }
}

/// One cgroup version's way to make, join, empty and remove a sandbox's cgroup.
pub(crate) trait CgroupBackend: Send + Sync {
    /// Makes the sandbox's cgroup (or reuses an existing one) and writes its limits.
    fn create(&self, id: &str, limits: &CgroupLimits) -> Result<(), CgroupError>;
    /// Writes the CPU, memory and pids limits of an existing cgroup.
    fn set_limits(&self, id: &str, limits: &CgroupLimits) -> Result<(), CgroupError>;
    /// Moves process `pid` into the cgroup (the slow step on v1: see `pool`).
    fn join(&self, id: &str, pid: i32) -> Result<(), CgroupError> {
        let pid = pid.to_string();
        for procs in self.procs_files(id) {
            write(&procs, &pid)?;
        }
        Ok(())
    }
    /// Whether a cgroup can be renamed (v1 can, v2 cannot).
    fn renames(&self) -> bool;
    /// Renames cgroup `from`, with its processes, to `to`, beside it.
    fn rename(&self, from: &str, to: &str) -> Result<(), CgroupError>;
    /// The names of the cgroups under the parent (sandboxes' and pools').
    fn children(&self) -> Vec<String>;
    /// The `cgroup.procs` files a process writes its pid into to join the sandbox.
    fn procs_files(&self, id: &str) -> Vec<PathBuf>;
    /// Pids of the processes in the sandbox's cgroup; empty when it does not exist.
    fn pids(&self, id: &str) -> Result<Vec<i32>, CgroupError>;
    /// Sends SIGKILL to every process in the cgroup without waiting for them to die.
    fn kill_all(&self, id: &str) -> Result<(), CgroupError>;
    /// Freezes (every process stops where it is) or thaws the sandbox; returns
    /// once the kernel reports it frozen.
    fn set_frozen(&self, id: &str, frozen: bool) -> Result<(), CgroupError>;
    /// Removes the sandbox's cgroup; nothing to do when it is gone. Fails while populated.
    fn remove(&self, id: &str) -> Result<(), CgroupError>;
    /// Whether device access is confined by the cgroup, so CAP_MKNOD is safe to keep.
    fn confines_devices(&self) -> bool;
    /// Opens one more device to the cgroup's processes (a v1 `devices.allow`
    /// rule such as `c 10:232 rwm`); nothing to do where devices are not
    /// confined.
    fn allow_device(&self, id: &str, rule: &str) -> Result<(), CgroupError>;
    /// Where the cgroup lives, for messages.
    fn describe(&self, id: &str) -> PathBuf;
    /// The sandbox's cgroup directories as the container sees them, read-only,
    /// under its `/sys/fs/cgroup`: one per v1 controller, or the v2 one at the top.
    fn views(&self, id: &str) -> Vec<CgroupView>;
}

/// Picks v2 when `root` is a unified mount (has `cgroup.controllers`), else v1.
pub(crate) fn detect(root: &Path, parent: &str) -> Box<dyn CgroupBackend> {
    if root.join("cgroup.controllers").exists() {
        Box::new(CgroupV2 {
            root: root.to_path_buf(),
            parent: parent.to_string(),
        })
    } else {
        Box::new(CgroupV1 {
            root: root.to_path_buf(),
            parent: parent.to_string(),
        })
    }
}

/// Kills everything in the cgroup and waits until it is empty, then removes it.
pub(crate) fn kill_and_remove(backend: &dyn CgroupBackend, id: &str) -> Result<(), CgroupError> {
    const DEADLINE: Duration = Duration::from_secs(10);
    let started = Instant::now();
    let mut pause = Duration::from_micros(100);
    loop {
        if backend.pids(id)?.is_empty() {
            match backend.remove(id) {
                Ok(()) => return Ok(()),
                // A process that has left cgroup.procs may still be exiting.
                Err(CgroupError::Io { ref source, .. })
                    if source.raw_os_error() == Some(libc::EBUSY) => {}
                Err(err) => return Err(err),
            }
        } else {
            backend.kill_all(id)?;
        }
        if started.elapsed() > DEADLINE {
            return Err(CgroupError::StillPopulated {
                path: backend.describe(id),
                waited: DEADLINE,
            });
        }
        // The kernel offers v1 no "empty" notification; dying processes need a moment.
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(io_err("write", path))
}

fn read_pids(path: &Path) -> Result<Vec<i32>, CgroupError> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(parse_pids(&text)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(err) => Err(io_err("read", path)(err)),
    }
}

pub(crate) fn parse_pids(text: &str) -> Vec<i32> {
    text.lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

/// The names of the directories in `dir`; none when it cannot be read.
fn list_dirs(dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|entry| entry.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|entry| entry.file_name().into_string().ok())
        .collect()
}

fn remove_dir(path: &Path) -> Result<(), CgroupError> {
    match fs::remove_dir(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(io_err("remove", path)(err)),
        _ => Ok(()),
    }
}

fn kill_pids(pids: &[i32]) {
    for &pid in pids {
        // A process that is already gone is what we want.
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
    }
}

/// cgroup v1: one directory per controller, `{root}/{controller}/{parent}/{id}`.
pub(crate) struct CgroupV1 {
    pub root: PathBuf,
    pub parent: String,
}

impl CgroupV1 {
    fn dir(&self, controller: &str, id: &str) -> PathBuf {
        self.root.join(controller).join(&self.parent).join(id)
    }

    /// Mounted controllers among the ones a sandbox joins.
    fn controllers(&self) -> impl Iterator<Item = &'static str> + '_ {
        V1_REQUIRED.into_iter().chain(
            V1_OPTIONAL
                .into_iter()
                .filter(|c| self.root.join(c).is_dir()),
        )
    }

    fn write_memory(&self, dir: &Path, bytes: Option<u64>) -> Result<(), CgroupError> {
        let value = bytes.map_or_else(|| "-1".to_string(), |b| b.to_string());
        let limit = dir.join("memory.limit_in_bytes");
        let memsw = dir.join("memory.memsw.limit_in_bytes");
        // memsw must stay >= limit: raising needs memsw first, lowering limit first.
        if write(&limit, &value).is_err() && memsw.exists() {
            write(&memsw, &value)?;
            write(&limit, &value)?;
        }
        if memsw.exists() {
            // Same value: no swap beyond the memory limit.
            write(&memsw, &value)?;
        }
        Ok(())
    }
}

impl CgroupBackend for CgroupV1 {
    fn create(&self, id: &str, limits: &CgroupLimits) -> Result<(), CgroupError> {
        for controller in V1_REQUIRED {
            let mount = self.root.join(controller);
            if !mount.is_dir() {
                return Err(CgroupError::MissingController {
                    controller: controller.to_string(),
                    path: mount,
                });
            }
        }
        for controller in self.controllers() {
            let dir = self.dir(controller, id);
            fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
        }
        self.set_limits(id, limits)?;
        write(&self.dir("freezer", id).join("freezer.state"), "THAWED")?;
        if self.root.join("devices").is_dir() {
            let devices = self.dir("devices", id);
            write(&devices.join("devices.deny"), "a")?;
            for rule in V1_DEVICE_ALLOW {
                write(&devices.join("devices.allow"), rule)?;
            }
        }
        Ok(())
    }

    fn set_limits(&self, id: &str, limits: &CgroupLimits) -> Result<(), CgroupError> {
        let cpu = self.dir("cpu", id);
        write(
            &cpu.join("cpu.cfs_period_us"),
            &limits.cpu_period_us.to_string(),
        )?;
        write(&cpu.join("cpu.cfs_quota_us"), &limits.v1_cpu_quota())?;
        self.write_memory(&self.dir("memory", id), limits.memory_bytes)?;
        write(
            &self.dir("pids", id).join("pids.max"),
            &limits.pids_max.to_string(),
        )
    }

    fn renames(&self) -> bool {
        true
    }

    fn rename(&self, from: &str, to: &str) -> Result<(), CgroupError> {
        for controller in self.controllers() {
            let source = self.dir(controller, from);
            fs::rename(&source, self.dir(controller, to)).map_err(io_err("rename", &source))?;
        }
        Ok(())
    }

    fn children(&self) -> Vec<String> {
        list_dirs(&self.root.join("pids").join(&self.parent))
    }

    fn procs_files(&self, id: &str) -> Vec<PathBuf> {
        self.controllers()
            .map(|c| self.dir(c, id).join("cgroup.procs"))
            .collect()
    }

    fn pids(&self, id: &str) -> Result<Vec<i32>, CgroupError> {
        read_pids(&self.dir("pids", id).join("cgroup.procs"))
    }

    fn kill_all(&self, id: &str) -> Result<(), CgroupError> {
        let freezer = self.dir("freezer", id);
        let state = freezer.join("freezer.state");
        if !state.exists() {
            kill_pids(&self.pids(id)?);
            return Ok(());
        }
        // Frozen, nobody can fork between reading the list and the kill.
        write(&state, "FROZEN")?;
        let deadline = Instant::now() + Duration::from_millis(500);
        while fs::read_to_string(&state)
            .map(|s| s.trim() == "FREEZING")
            .unwrap_or(false)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_micros(100));
        }
        kill_pids(&read_pids(&freezer.join("cgroup.procs"))?);
        write(&state, "THAWED")
    }

    fn set_frozen(&self, id: &str, frozen: bool) -> Result<(), CgroupError> {
        let state = self.dir("freezer", id).join("freezer.state");
        write(&state, if frozen { "FROZEN" } else { "THAWED" })?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while frozen
            && fs::read_to_string(&state)
                .map(|s| s.trim() == "FREEZING")
                .unwrap_or(false)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    fn remove(&self, id: &str) -> Result<(), CgroupError> {
        for controller in self.controllers() {
            remove_dir(&self.dir(controller, id))?;
        }
        Ok(())
    }

    fn confines_devices(&self) -> bool {
        self.root.join("devices").is_dir()
    }

    fn allow_device(&self, id: &str, rule: &str) -> Result<(), CgroupError> {
        if !self.confines_devices() {
            return Ok(());
        }
        write(&self.dir("devices", id).join("devices.allow"), rule)
    }

    fn describe(&self, id: &str) -> PathBuf {
        self.dir("pids", id)
    }

    fn views(&self, id: &str) -> Vec<CgroupView> {
        self.controllers()
            .map(|controller| CgroupView {
                host: self.dir(controller, id),
                target: controller.to_owned(),
            })
            .collect()
    }
}

/// cgroup v2: one directory, `{root}/{parent}/{id}`.
pub(crate) struct CgroupV2 {
    pub root: PathBuf,
    pub parent: String,
}

impl CgroupV2 {
    fn dir(&self, id: &str) -> PathBuf {
        self.root.join(&self.parent).join(id)
    }
}

impl CgroupBackend for CgroupV2 {
    fn create(&self, id: &str, limits: &CgroupLimits) -> Result<(), CgroupError> {
        let parent = self.root.join(&self.parent);
        fs::create_dir_all(&parent).map_err(io_err("create", &parent))?;
        for level in [&self.root, &parent] {
            write(&level.join("cgroup.subtree_control"), "+cpu +memory +pids")?;
        }
        let dir = self.dir(id);
        fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
        self.set_limits(id, limits)
    }

    fn set_limits(&self, id: &str, limits: &CgroupLimits) -> Result<(), CgroupError> {
        let dir = self.dir(id);
        write(&dir.join("cpu.max"), &limits.v2_cpu_max())?;
        let memory = limits
            .memory_bytes
            .map_or_else(|| "max".to_string(), |b| b.to_string());
        write(&dir.join("memory.max"), &memory)?;
        let swap = dir.join("memory.swap.max");
        if swap.exists() {
            write(&swap, "0")?;
        }
        write(&dir.join("pids.max"), &limits.pids_max.to_string())?;
        Ok(())
    }

    fn renames(&self) -> bool {
        false
    }

    fn rename(&self, from: &str, _to: &str) -> Result<(), CgroupError> {
        Err(CgroupError::Io {
            action: "rename",
            path: self.dir(from),
            source: io::Error::from(io::ErrorKind::Unsupported),
        })
    }

    fn children(&self) -> Vec<String> {
        list_dirs(&self.root.join(&self.parent))
    }

    fn procs_files(&self, id: &str) -> Vec<PathBuf> {
        vec![self.dir(id).join("cgroup.procs")]
    }

    fn views(&self, id: &str) -> Vec<CgroupView> {
        vec![CgroupView {
            host: self.dir(id),
            target: String::new(),
        }]
    }

    fn pids(&self, id: &str) -> Result<Vec<i32>, CgroupError> {
        read_pids(&self.dir(id).join("cgroup.procs"))
    }

    fn kill_all(&self, id: &str) -> Result<(), CgroupError> {
        let dir = self.dir(id);
        let kill = dir.join("cgroup.kill");
        if kill.exists() {
            // Since Linux 5.14: atomic, races with fork are the kernel's problem.
            return write(&kill, "1");
        }
        let freeze = dir.join("cgroup.freeze");
        write(&freeze, "1")?;
        kill_pids(&self.pids(id)?);
        write(&freeze, "0")
    }

    fn set_frozen(&self, id: &str, frozen: bool) -> Result<(), CgroupError> {
        let dir = self.dir(id);
        write(&dir.join("cgroup.freeze"), if frozen { "1" } else { "0" })?;
        let deadline = Instant::now() + Duration::from_secs(5);
        let settled = |events: String| events.lines().any(|l| l == "frozen 1") == frozen;
        while !fs::read_to_string(dir.join("cgroup.events"))
            .map(settled)
            .unwrap_or(true)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    fn remove(&self, id: &str) -> Result<(), CgroupError> {
        remove_dir(&self.dir(id))
    }

    fn confines_devices(&self) -> bool {
        // v2 confines devices only with a BPF program, which cove does not load.
        false
    }

    fn allow_device(&self, _id: &str, _rule: &str) -> Result<(), CgroupError> {
        Ok(())
    }

    fn describe(&self, id: &str) -> PathBuf {
        self.dir(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resources(cpu: u32, memory_mib: u64) -> Resources {
        Resources {
            cpu,
            memory_mib,
            disk_gib: 1,
        }
    }

    #[test]
    fn limits_scale_cpu_by_period_and_memory_by_mib() {
        let limits = CgroupLimits::new(&resources(2, 256), 4096);
        assert_eq!(limits.cpu_quota_us, Some(200_000));
        assert_eq!(limits.cpu_period_us, 100_000);
        assert_eq!(limits.memory_bytes, Some(256 * 1024 * 1024));
        assert_eq!(limits.v2_cpu_max(), "200000 100000");
        assert_eq!(limits.v1_cpu_quota(), "200000");
    }

    #[test]
    fn zero_means_unlimited() {
        let limits = CgroupLimits::new(&resources(0, 0), 10);
        assert_eq!(limits.v2_cpu_max(), "max 100000");
        assert_eq!(limits.v1_cpu_quota(), "-1");
        assert_eq!(limits.memory_bytes, None);
    }

    #[test]
    fn parses_procs_ignoring_noise() {
        assert_eq!(parse_pids("12\n 7\n\nx\n"), vec![12, 7]);
    }

    fn read(path: PathBuf) -> String {
        fs::read_to_string(path).unwrap()
    }

    #[test]
    fn v1_writes_limits_into_each_controller() {
        let root = tempfile::tempdir().unwrap();
        for c in ["cpu", "memory", "pids", "freezer", "devices"] {
            fs::create_dir(root.path().join(c)).unwrap();
        }
        let backend = detect(root.path(), "cove");
        backend
            .create("sb1", &CgroupLimits::new(&resources(1, 512), 99))
            .unwrap();
        let dir = |c: &str| root.path().join(c).join("cove/sb1");
        assert_eq!(read(dir("cpu").join("cpu.cfs_quota_us")), "100000");
        assert_eq!(
            read(dir("memory").join("memory.limit_in_bytes")),
            "536870912"
        );
        assert_eq!(read(dir("pids").join("pids.max")), "99");
        assert_eq!(read(dir("freezer").join("freezer.state")), "THAWED");
        assert!(backend.confines_devices());
        let files = backend.procs_files("sb1");
        assert_eq!(files.len(), 5);
        assert!(files.contains(&dir("devices").join("cgroup.procs")));
        assert!(backend.pids("sb1").unwrap().is_empty());
    }

    #[test]
    fn v1_renames_a_pool_cgroup_in_every_controller_and_rewrites_its_limits() {
        let root = tempfile::tempdir().unwrap();
        for c in ["cpu", "memory", "pids", "freezer", "devices"] {
            fs::create_dir(root.path().join(c)).unwrap();
        }
        let backend = detect(root.path(), "cove");
        assert!(backend.renames());
        backend
            .create("pool@1.0", &CgroupLimits::new(&resources(0, 0), 99))
            .unwrap();
        assert_eq!(backend.children(), ["pool@1.0"]);
        backend.rename("pool@1.0", "sb1").unwrap();
        backend
            .set_limits("sb1", &CgroupLimits::new(&resources(2, 256), 99))
            .unwrap();
        assert_eq!(backend.children(), ["sb1"]);
        let dir = |c: &str| root.path().join(c).join("cove/sb1");
        assert_eq!(read(dir("cpu").join("cpu.cfs_quota_us")), "200000");
        assert_eq!(
            read(dir("memory").join("memory.limit_in_bytes")),
            "268435456"
        );
        for c in ["cpu", "memory", "pids", "freezer", "devices"] {
            assert!(!root.path().join(c).join("cove/pool@1.0").exists(), "{c}");
        }
    }

    #[test]
    fn v2_cannot_rename_so_it_keeps_no_pool() {
        let root = tempfile::tempdir().unwrap();
        fs::write(root.path().join("cgroup.controllers"), "cpu memory pids").unwrap();
        let backend = detect(root.path(), "cove");
        assert!(!backend.renames());
        assert!(backend.rename("a", "b").is_err());
    }

    #[test]
    fn v1_requires_the_core_controllers() {
        let root = tempfile::tempdir().unwrap();
        let err = detect(root.path(), "cove")
            .create("sb1", &CgroupLimits::new(&resources(1, 1), 1))
            .unwrap_err();
        assert!(err.to_string().contains("controller cpu"), "{err}");
    }

    #[test]
    fn v2_is_detected_and_writes_one_directory() {
        let root = tempfile::tempdir().unwrap();
        fs::write(root.path().join("cgroup.controllers"), "cpu memory pids").unwrap();
        let backend = detect(root.path(), "cove");
        backend
            .create("sb1", &CgroupLimits::new(&resources(2, 1), 7))
            .unwrap();
        let dir = root.path().join("cove/sb1");
        assert_eq!(read(dir.join("cpu.max")), "200000 100000");
        assert_eq!(read(dir.join("memory.max")), "1048576");
        assert_eq!(read(dir.join("pids.max")), "7");
        assert_eq!(
            read(root.path().join("cove/cgroup.subtree_control")),
            "+cpu +memory +pids"
        );
        assert_eq!(backend.procs_files("sb1"), vec![dir.join("cgroup.procs")]);
        assert!(!backend.confines_devices());
    }

    #[test]
    fn removing_a_missing_cgroup_is_fine() {
        let root = tempfile::tempdir().unwrap();
        for c in ["cpu", "memory", "pids", "freezer"] {
            fs::create_dir(root.path().join(c)).unwrap();
        }
        let backend = detect(root.path(), "cove");
        backend.remove("nope").unwrap();
        kill_and_remove(backend.as_ref(), "nope").unwrap();
    }
}
