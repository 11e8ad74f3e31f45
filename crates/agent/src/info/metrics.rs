//! `GET /system/metrics`: CPU, memory and disk of the sandbox in the toolbox's
//! `SystemMetrics` shape.
//!
//! Sources, best first: the sandbox's own cgroup (v2 `cpu.stat`, `cpu.max`,
//! `memory.current`, `memory.max`, `memory.stat`; v1 `cpuacct.usage`,
//! `cpu.cfs_quota_us`, `memory.usage_in_bytes`, `memory.limit_in_bytes`), found
//! through `/proc/self/cgroup` under `/sys/fs/cgroup` when that is mounted;
//! otherwise the kernel-wide `/proc/stat` and `/proc/meminfo`. Disk is
//! `statvfs("/")`. `cpuUsedPct` is the CPU time used over the last sample window
//! as a percentage of the CPU limit: the window runs from the previous request
//! when that was between [`MIN_WINDOW`] and [`MAX_WINDOW`] ago, otherwise the
//! request samples twice, [`MIN_WINDOW`] apart.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;
use time::OffsetDateTime;

use crate::error::{ApiError, Json};

pub const MIN_WINDOW: Duration = Duration::from_millis(200);
pub const MAX_WINDOW: Duration = Duration::from_secs(60);

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SystemMetrics {
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

pub async fn metrics() -> Result<Json<SystemMetrics>, ApiError> {
    let source = Source::detect();
    let previous = *LAST_SAMPLE.lock().unwrap_or_else(|e| e.into_inner());
    let previous = match previous {
        Some(sample) if (MIN_WINDOW..=MAX_WINDOW).contains(&sample.at.elapsed()) => sample,
        _ => {
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
    let disk =
        nix::sys::statvfs::statvfs("/").map_err(|e| ApiError::internal("statvfs /", e.into()))?;
    let fragment = disk.fragment_size();
    let disk_total = disk.blocks() * fragment;
    let disk_free = disk.blocks_available() * fragment;
    let disk_used = (disk.blocks() - disk.blocks_free()) * fragment;
    let now = OffsetDateTime::now_utc();
    Ok(Json(SystemMetrics {
        cpu_count: cpu_limit.ceil().max(1.0) as u32,
        cpu_used_pct: (cpu_used_pct * 100.0).round() / 100.0,
        mem_total: memory.total,
        mem_used: memory.used,
        mem_cache: memory.cache,
        disk_total,
        disk_used,
        disk_free,
        timestamp: now
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default(),
        timestamp_unix: now.unix_timestamp(),
    }))
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
        let Ok(membership) = std::fs::read_to_string("/proc/self/cgroup") else {
            return Self::Kernel;
        };
        let root = Path::new(CGROUP_ROOT);
        if let Some(dir) = cgroup_path(&membership, "") {
            let dir = root.join(dir);
            if dir.join("cpu.stat").is_file() && dir.join("memory.current").is_file() {
                return Self::V2(dir);
            }
        }
        let v1 = |controller: &str| {
            let dir = root
                .join(controller)
                .join(cgroup_path(&membership, controller)?);
            dir.is_dir().then_some(dir)
        };
        match (v1("cpu"), v1("cpuacct"), v1("memory")) {
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

/// The cgroup path of `controller` in `/proc/self/cgroup` (`""` is the v2
/// unified hierarchy), relative, so it can be joined under the mount.
fn cgroup_path<'a>(membership: &'a str, controller: &str) -> Option<&'a str> {
    membership.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let matches = if controller.is_empty() {
            controllers.is_empty()
        } else {
            controllers.split(',').any(|c| c == controller)
        };
        matches.then(|| path.trim_start_matches('/'))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_paths_of_v1_and_v2() {
        let membership = "12:cpu,cpuacct:/cove/sb1\n4:memory:/cove/sb1\n0::/cove/sb2\n";
        assert_eq!(cgroup_path(membership, "cpuacct"), Some("cove/sb1"));
        assert_eq!(cgroup_path(membership, "memory"), Some("cove/sb1"));
        assert_eq!(cgroup_path(membership, ""), Some("cove/sb2"));
        assert_eq!(cgroup_path(membership, "pids"), None);
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
