//! `GET /system/metrics`: CPU, memory and disk of the sandbox in the toolbox's
//! `SystemMetrics` shape.
//!
//! Sources, best first: the sandbox's own cgroup (v2 `cpu.stat`, `cpu.max`,
//! `memory.current`, `memory.max`, `memory.stat`; v1 `cpuacct.usage`,
//! `cpu.cfs_quota_us`, `memory.usage_in_bytes`, `memory.limit_in_bytes`),
//! found by mapping `/proc/self/cgroup` through the cgroup mounts of
//! `/proc/self/mountinfo` (a container sees only its own cgroups, bound
//! read-only at `/sys/fs/cgroup/{controller}`); otherwise the kernel-wide
//! `/proc/stat` and `/proc/meminfo`, which in a VM are the VM's own. Disk is
//! the btrfs quota group that caps a container (`referenced`,
//! `max_referenced` in the sysfs directory the runtime names,
//! [`Settings::disk_qgroup`](crate::config::Settings)), else
//! `statvfs("/")`. `cpuUsedPct` is the CPU time used over the last sample window
//! as a percentage of the CPU limit: the window runs from the previous request
//! when that was between [`MIN_WINDOW`] and [`MAX_WINDOW`] ago, otherwise the
//! request samples twice, [`MIN_WINDOW`] apart.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;
use time::OffsetDateTime;

use axum::extract::State;

use crate::error::{ApiError, Json};
use crate::AppState;

pub(super) const MIN_WINDOW: Duration = Duration::from_millis(200);
pub(super) const MAX_WINDOW: Duration = Duration::from_secs(60);

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct SystemMetrics {
    cpu_count: u32,
    cpu_used_pct: f64,
    mem_total: u64,
    mem_used: u64,
    mem_cache: u64,
    disk_total: u64,
    disk_used: u64,
    disk_free: u64,
    timestamp: String,
    timestamp_unix: i64,
}

/// CPU time used so far, and when it was read.
#[derive(Debug, Clone, Copy)]
struct CpuSample {
    at: Instant,
    used: Duration,
}

static LAST_SAMPLE: Mutex<Option<CpuSample>> = Mutex::new(None);

pub(super) async fn metrics(
    State(state): State<AppState>,
) -> Result<Json<SystemMetrics>, ApiError> {
    let source = Source::detect();
    let previous = *LAST_SAMPLE.lock().unwrap_or_else(|e| e.into_inner());
    let previous = match previous.filter(|p| window_open(p.at.elapsed())) {
        Some(sample) => sample,
        None => {
            let first = source.cpu_sample()?;
            tokio::time::sleep(MIN_WINDOW).await;
            first
        }
    };
    let now = source.cpu_sample()?;
    *LAST_SAMPLE.lock().unwrap_or_else(|e| e.into_inner()) = Some(now);
    let cpu_limit = source.cpu_limit();
    let wall = now.at.duration_since(previous.at).as_secs_f64();
    let used = now.used.saturating_sub(previous.used).as_secs_f64();
    let cpu_used_pct = if wall > 0.0 {
        (used / (wall * cpu_limit) * 100.0).clamp(0.0, 100.0)
    } else {
        0.0
    };
    let memory = source.memory()?;
    let disk = match &state.settings.disk_qgroup {
        Some(qgroup) => qgroup_disk(qgroup)?,
        None => root_disk()?,
    };
    let now = OffsetDateTime::now_utc();
    Ok(Json(SystemMetrics {
        cpu_count: cpu_limit.ceil().max(1.0) as u32,
        cpu_used_pct: (cpu_used_pct * 100.0).round() / 100.0,
        mem_total: memory.total,
        mem_used: memory.used,
        mem_cache: memory.cache,
        disk_total: disk.total,
        disk_used: disk.used,
        disk_free: disk.free,
        timestamp: now
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default(),
        timestamp_unix: now.unix_timestamp(),
    }))
}

struct Disk {
    total: u64,
    used: u64,
    free: u64,
}

/// The root filesystem's size and use.
fn root_disk() -> Result<Disk, ApiError> {
    let disk =
        nix::sys::statvfs::statvfs("/").map_err(|e| ApiError::internal("statvfs /", e.into()))?;
    let fragment = disk.fragment_size();
    Ok(Disk {
        total: disk.blocks() * fragment,
        used: (disk.blocks() - disk.blocks_free()) * fragment,
        free: disk.blocks_available() * fragment,
    })
}

/// The sandbox's quota group: everything its layers reference, against its
/// limit. Capped by the filesystem's own free space when that is smaller
/// (the storage image is shared and may fill before the quota does).
fn qgroup_disk(dir: &Path) -> Result<Disk, ApiError> {
    let used = number(&read(&dir.join("referenced"))?).unwrap_or(0);
    let limit = number(&read(&dir.join("max_referenced"))?).filter(|l| *l > 0);
    let root = root_disk()?;
    let total = limit.unwrap_or(root.total);
    let free = total.saturating_sub(used).min(root.free);
    Ok(Disk { total, used, free })
}

struct Memory {
    total: u64,
    used: u64,
    cache: u64,
}

/// Where the numbers come from.
enum Source {
    V2(PathBuf),
    V1 {
        cpu: PathBuf,
        cpuacct: PathBuf,
        memory: PathBuf,
    },
    Kernel,
}

impl Source {
    fn detect() -> Self {
        let (Ok(membership), Ok(mountinfo)) = (
            std::fs::read_to_string("/proc/self/cgroup"),
            std::fs::read_to_string("/proc/self/mountinfo"),
        ) else {
            return Self::Kernel;
        };
        let mounts = cgroup_mounts(&mountinfo);
        let locate = |controller: &str| cgroup_dir(&membership, &mounts, controller);
        if let Some(dir) = locate("") {
            if dir.join("cpu.stat").is_file() && dir.join("memory.current").is_file() {
                return Self::V2(dir);
            }
        }
        match (locate("cpu"), locate("cpuacct"), locate("memory")) {
            (Some(cpu), Some(cpuacct), Some(memory))
                if cpuacct.join("cpuacct.usage").is_file()
                    && memory.join("memory.usage_in_bytes").is_file() =>
            {
                Self::V1 {
                    cpu,
                    cpuacct,
                    memory,
                }
            }
            _ => Self::Kernel,
        }
    }

    fn cpu_sample(&self) -> Result<CpuSample, ApiError> {
        let used = match self {
            Self::V2(dir) => {
                let stat = read(&dir.join("cpu.stat"))?;
                Duration::from_micros(stat_value(&stat, "usage_usec").unwrap_or(0))
            }
            Self::V1 { cpuacct, .. } => {
                Duration::from_nanos(number(&read(&cpuacct.join("cpuacct.usage"))?).unwrap_or(0))
            }
            Self::Kernel => kernel_cpu_time(&read(Path::new("/proc/stat"))?),
        };
        Ok(CpuSample {
            at: Instant::now(),
            used,
        })
    }

    /// CPUs the sandbox may use: its quota, else the CPUs it may run on.
    fn cpu_limit(&self) -> f64 {
        let quota = match self {
            Self::V2(dir) => std::fs::read_to_string(dir.join("cpu.max"))
                .ok()
                .and_then(|text| {
                    let mut fields = text.split_whitespace();
                    let quota: f64 = fields.next()?.parse().ok()?;
                    let period: f64 = fields.next()?.parse().ok()?;
                    Some(quota / period)
                }),
            Self::V1 { cpu, .. } => {
                let read = |name: &str| -> Option<f64> {
                    std::fs::read_to_string(cpu.join(name))
                        .ok()?
                        .trim()
                        .parse()
                        .ok()
                };
                match (read("cpu.cfs_quota_us"), read("cpu.cfs_period_us")) {
                    (Some(quota), Some(period)) if quota > 0.0 && period > 0.0 => {
                        Some(quota / period)
                    }
                    _ => None,
                }
            }
            Self::Kernel => None,
        };
        let online = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        quota.map_or(online, |quota| quota.min(online))
    }

    fn memory(&self) -> Result<Memory, ApiError> {
        let meminfo = read(Path::new("/proc/meminfo"))?;
        let kernel_total = meminfo_bytes(&meminfo, "MemTotal").unwrap_or(0);
        let (usage, limit, cache) = match self {
            Self::V2(dir) => (
                number(&read(&dir.join("memory.current"))?).unwrap_or(0),
                std::fs::read_to_string(dir.join("memory.max"))
                    .ok()
                    .and_then(|t| number(&t)),
                stat_value(&read(&dir.join("memory.stat"))?, "file").unwrap_or(0),
            ),
            Self::V1 { memory, .. } => {
                let stat = read(&memory.join("memory.stat"))?;
                (
                    number(&read(&memory.join("memory.usage_in_bytes"))?).unwrap_or(0),
                    std::fs::read_to_string(memory.join("memory.limit_in_bytes"))
                        .ok()
                        .and_then(|t| number(&t)),
                    stat_value(&stat, "total_cache")
                        .or_else(|| stat_value(&stat, "cache"))
                        .unwrap_or(0),
                )
            }
            Self::Kernel => {
                let available = meminfo_bytes(&meminfo, "MemAvailable").unwrap_or(0);
                let cache = meminfo_bytes(&meminfo, "Cached").unwrap_or(0)
                    + meminfo_bytes(&meminfo, "Buffers").unwrap_or(0);
                return Ok(Memory {
                    total: kernel_total,
                    used: kernel_total.saturating_sub(available),
                    cache,
                });
            }
        };
        // "No limit" reads as `max` (v2) or a page-rounded i64::MAX (v1).
        let total = limit.filter(|l| *l < kernel_total).unwrap_or(kernel_total);
        Ok(Memory {
            total,
            used: usage.saturating_sub(cache),
            cache,
        })
    }
}

fn read(path: &Path) -> Result<String, ApiError> {
    std::fs::read_to_string(path).map_err(|e| ApiError::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

fn number(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// A cgroup filesystem mount: `root` is the cgroup directory that appears at
/// `point` (not `/` for a bind of one cgroup, as in a container).
#[derive(Debug, PartialEq)]
struct CgroupMount {
    root: PathBuf,
    point: PathBuf,
    /// The v1 controllers of the hierarchy; empty for cgroup2.
    controllers: Vec<String>,
    v2: bool,
}

/// The cgroup mounts of a `/proc/self/mountinfo`.
fn cgroup_mounts(mountinfo: &str) -> Vec<CgroupMount> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mut left = left.split(' ');
            let root = unescape(left.nth(3)?);
            let point = unescape(left.next()?);
            let mut right = right.split(' ');
            let fstype = right.next()?;
            let options = right.nth(1).unwrap_or_default();
            let v2 = match fstype {
                "cgroup2" => true,
                "cgroup" => false,
                _ => return None,
            };
            let controllers = if v2 {
                Vec::new()
            } else {
                options.split(',').map(str::to_owned).collect()
            };
            Some(CgroupMount {
                root: root.into(),
                point: point.into(),
                controllers,
                v2,
            })
        })
        .collect()
}

/// mountinfo writes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let code = rest
            .get(at + 1..at + 4)
            .and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(byte) => {
                out.push(char::from(byte));
                rest = &rest[at + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Where this process's cgroup of `controller` (`""`: the v2 hierarchy) is
/// visible: its path in `/proc/self/cgroup`, made relative to the root of a
/// mount of that hierarchy and joined under its mount point.
fn cgroup_dir(membership: &str, mounts: &[CgroupMount], controller: &str) -> Option<PathBuf> {
    let path = Path::new(cgroup_path(membership, controller)?);
    mounts
        .iter()
        .filter(|m| {
            if controller.is_empty() {
                m.v2
            } else {
                !m.v2 && m.controllers.iter().any(|c| c == controller)
            }
        })
        .find_map(|m| {
            let dir = m.point.join(path.strip_prefix(&m.root).ok()?);
            dir.is_dir().then_some(dir)
        })
}

/// The cgroup path of `controller` in `/proc/self/cgroup` (`""` is the v2
/// unified hierarchy), absolute as the kernel writes it.
fn cgroup_path<'a>(membership: &'a str, controller: &str) -> Option<&'a str> {
    membership.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let matches = if controller.is_empty() {
            controllers.is_empty()
        } else {
            controllers.split(',').any(|c| c == controller)
        };
        matches.then_some(path)
    })
}

/// `key value` lines of `cpu.stat` and `memory.stat`.
fn stat_value(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|line| {
        let (name, value) = line.split_once(' ')?;
        (name == key).then(|| value.trim().parse().ok()).flatten()
    })
}

fn meminfo_bytes(meminfo: &str, key: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        let kib: u64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(kib * 1024)
    })
}

/// Busy CPU time of the whole machine from the `cpu` line of `/proc/stat`
/// (user, nice, system, irq, softirq, steal; in USER_HZ ticks, 100 a second on
/// Linux).
fn kernel_cpu_time(stat: &str) -> Duration {
    let ticks: u64 = stat
        .lines()
        .find(|line| line.starts_with("cpu "))
        .map(|line| {
            line.split_whitespace()
                .skip(1)
                .enumerate()
                .filter(|(index, _)| matches!(index, 0 | 1 | 2 | 5 | 6 | 7))
                .filter_map(|(_, value)| value.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

/// Whether a sample taken `age` ago can start this request's window, so it
/// answers at once instead of sampling twice.
fn window_open(age: Duration) -> bool {
    (MIN_WINDOW..=MAX_WINDOW).contains(&age)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recent_sample_starts_the_window() {
        assert!(!window_open(Duration::from_millis(10)));
        assert!(window_open(MIN_WINDOW));
        assert!(window_open(Duration::from_secs(5)));
        assert!(!window_open(MAX_WINDOW + Duration::from_millis(1)));
    }

    #[test]
    fn cgroup_paths_of_v1_and_v2() {
        let membership = "12:cpu,cpuacct:/cove/sb1\n4:memory:/cove/sb1\n0::/cove/sb2\n";
        assert_eq!(cgroup_path(membership, "cpuacct"), Some("/cove/sb1"));
        assert_eq!(cgroup_path(membership, "memory"), Some("/cove/sb1"));
        assert_eq!(cgroup_path(membership, ""), Some("/cove/sb2"));
        assert_eq!(cgroup_path(membership, "pids"), None);
    }

    #[test]
    fn cgroup_mounts_of_a_container_and_a_host() {
        let mountinfo = "\
30 25 0:26 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
31 25 0:27 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu,cpuacct
32 25 0:28 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate
90 80 0:26 /cove/sb1 /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory
91 80 0:5 / /my\\040dir rw - tmpfs tmpfs rw
";
        let mounts = cgroup_mounts(mountinfo);
        assert_eq!(mounts.len(), 4);
        assert_eq!(
            mounts[1].controllers,
            vec!["rw".to_string(), "cpu".into(), "cpuacct".into()]
        );
        assert!(mounts[2].v2);
        assert_eq!(mounts[3].root, Path::new("/cove/sb1"));
        assert_eq!(unescape("/my\\040dir"), "/my dir");
        // A bind of the sandbox's own cgroup maps its path to the mount point.
        let bound = &mounts[3];
        let relative = Path::new("/cove/sb1").strip_prefix(&bound.root).unwrap();
        assert_eq!(
            bound.point.join(relative),
            Path::new("/sys/fs/cgroup/memory")
        );
    }

    #[test]
    fn kernel_numbers_parse() {
        assert_eq!(
            kernel_cpu_time("cpu  100 5 50 1000 20 1 2 3 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n"),
            Duration::from_millis((100 + 5 + 50 + 1 + 2 + 3) * 10)
        );
        let meminfo =
            "MemTotal:       24683520 kB\nMemFree:        1000 kB\nMemAvailable:   2000 kB\n";
        assert_eq!(meminfo_bytes(meminfo, "MemTotal"), Some(24683520 * 1024));
        assert_eq!(meminfo_bytes(meminfo, "MemFree"), Some(1000 * 1024));
        assert_eq!(
            stat_value("usage_usec 1234\nuser_usec 1000\n", "usage_usec"),
            Some(1234)
        );
        assert_eq!(
            stat_value("cache 5\ntotal_cache 7\n", "total_cache"),
            Some(7)
        );
    }
}
