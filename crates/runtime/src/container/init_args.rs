//! The one message from the server to a container shim's init: everything it needs, as
//! one JSON document sent on the shim's stdin, a Unix socket, with the sandbox's user
//! namespace and console log attached as descriptors (`<cove> __container-init`; never
//! in its argv, which every host user can read in `ps`, and which holds the sandbox's
//! environment), plus the lines the shim answers on its stdout: `waiting <pid>` once its
//! init waits for a sandbox, `ready <pid> <steps>` once the agent runs. Both ends are
//! our own binary, so the format is private.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The first argument that selects the shim in the `cove` binary.
pub(super) const SUBCOMMAND: &str = "__container-init";

/// Environment the agent gets under whatever the sandbox spec adds. Without
/// `COVE_WORKDIR` the agent starts commands in its user's home.
const BASE_ENV: [(&str, &str); 3] = [
    ("HOME", "/root"),
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("TERM", "xterm"),
];

/// Names the inherited listening socket; set by the container init, never by the spec.
pub(super) use cove_protocol::env::LISTEN_FD as LISTEN_FD_ENV;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct InitArgs {
    pub id: String,
    pub hostname: String,
    /// The read-only lower layer.
    pub rootfs: PathBuf,
    /// Read-only layers over `rootfs`, topmost first.
    #[serde(default)]
    pub layers: Vec<PathBuf>,
    /// `{state_dir}/{id}`.
    pub sandbox_dir: PathBuf,
    pub agent_binary: PathBuf,
    /// The sandbox's cgroups, bound read-only under the container's
    /// `/sys/fs/cgroup` so the agent reports its own limits and usage.
    #[serde(default)]
    pub cgroup_views: Vec<CgroupView>,
    /// The agent's environment, without the listen fd.
    pub env: Vec<(String, String)>,
    /// Keep CAP_MKNOD only where the cgroup confines device access.
    pub keep_mknod: bool,
    /// The network namespace to join; without one the container gets a new,
    /// empty one with only `lo`.
    #[serde(default)]
    pub network: Option<InitNetwork>,
    /// Volumes bind-mounted into the root.
    #[serde(default)]
    pub volumes: Vec<crate::VolumeBind>,
    /// The first host id of the sandbox's user namespace range (its uid and gid 0).
    pub id_base: u32,
}

/// One cgroup directory of the sandbox and where it appears inside.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CgroupView {
    /// The host directory (`/sys/fs/cgroup/memory/cove/{id}`).
    pub host: PathBuf,
    /// Its path under the container's `/sys/fs/cgroup` (`memory`; empty for v2).
    pub target: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct InitNetwork {
    /// A network namespace file to `setns` into.
    pub netns: PathBuf,
    /// Bind-mounted over the container's `/etc/resolv.conf`.
    pub resolv_conf: String,
}

impl InitArgs {
    pub(super) fn encode(&self) -> String {
        serde_json::to_string(self).expect("init args are plain data")
    }

    /// Reads the document the server wrote to the shim's stdin.
    pub(super) fn decode(json: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(json)
    }
}

/// The agent's environment: the base, then the spec's variables (which win), minus the
/// listen fd variable, which only the container init may set.
pub(super) fn agent_env(spec: &crate::SandboxSpec) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = BASE_ENV
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    // The image's settings are the agent's (`COVE_*` never reach a sandbox
    // process); a spec's own variables cannot override them.
    let image = cove_protocol::AgentEnv {
        workdir: spec.workdir.clone(),
        user: spec.user.clone(),
        entrypoint: spec.command.clone(),
        ..Default::default()
    }
    .to_env();
    for (key, value) in spec
        .env
        .iter()
        .filter(|(k, _)| {
            cove_protocol::env::IMAGE_SETTINGS
                .iter()
                .all(|name| k != name)
        })
        .chain(&image)
    {
        if key == LISTEN_FD_ENV || key.is_empty() || key.contains('=') || key.contains('\0') {
            continue;
        }
        match env.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1.clone_from(value),
            None => env.push((key.clone(), value.clone())),
        }
    }
    env
}

/// A line from the shim that is no report.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum UnreadableReport {
    #[error("bad pid in shim report {line:?}")]
    BadPid { line: String },
    #[error("unexpected shim report {line:?}")]
    Unexpected { line: String },
}

/// What the shim answers on its stdout, one line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum ShimReport {
    /// The container init was forked (host pid) and waits, in no cgroup of a
    /// sandbox yet, for its settings.
    Waiting {
        init_pid: i32,
    },
    /// The agent was exec'd; the host pid of the container's init.
    Ready {
        init_pid: i32,
        /// The shim's own steps and their times (`name=1.23ms ...`), for the
        /// server's debug log.
        steps: String,
    },
    Error(String),
}

impl ShimReport {
    pub(super) fn to_line(&self) -> String {
        match self {
            Self::Waiting { init_pid } => format!("waiting {init_pid}\n"),
            Self::Ready { init_pid, steps } => {
                format!("ready {init_pid} {}\n", steps.replace('\n', " "))
            }
            // One line: the server reads exactly one.
            Self::Error(message) => format!("error {}\n", message.replace('\n', " ")),
        }
    }

    pub(super) fn parse(line: &str) -> Result<Self, UnreadableReport> {
        let line = line.trim_end_matches('\n');
        if let Some(pid) = line.strip_prefix("waiting ") {
            let init_pid = pid.parse().map_err(|_| UnreadableReport::BadPid {
                line: line.to_owned(),
            })?;
            return Ok(Self::Waiting { init_pid });
        }
        if let Some(rest) = line.strip_prefix("ready ") {
            let (pid, steps) = rest.split_once(' ').unwrap_or((rest, ""));
            let init_pid = pid.parse().map_err(|_| UnreadableReport::BadPid {
                line: line.to_owned(),
            })?;
            return Ok(Self::Ready {
                init_pid,
                steps: steps.to_owned(),
            });
        }
        if let Some(message) = line.strip_prefix("error ") {
            return Ok(Self::Error(message.to_string()));
        }
        Err(UnreadableReport::Unexpected {
            line: line.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> InitArgs {
        InitArgs {
            id: "sb1".into(),
            hostname: "box".into(),
            rootfs: "/images/debian".into(),
            layers: vec!["/snap/a/upper".into()],
            sandbox_dir: "/var/lib/cove/sb1".into(),
            agent_binary: "/usr/lib/cove/cove-agent".into(),
            cgroup_views: vec![CgroupView {
                host: "/sys/fs/cgroup/memory/cove/sb1".into(),
                target: "memory".into(),
            }],
            env: vec![("A".into(), "b c\n".into())],
            keep_mknod: true,
            network: Some(InitNetwork {
                netns: "/var/lib/cove/net/netns/sb1".into(),
                resolv_conf: "nameserver 10.77.0.1\n".into(),
            }),
            volumes: vec![crate::VolumeBind {
                root: "/var/lib/cove/storage/volumes/v1".into(),
                subpath: Some("work/a".into()),
                target: "/data".into(),
            }],
            id_base: 2_000_065_536,
        }
    }

    #[test]
    fn args_round_trip() {
        let args = sample();
        let json = args.encode();
        assert_eq!(InitArgs::decode(json.as_bytes()).unwrap(), args);
        let bad = super::super::step::StepError::Settings(InitArgs::decode(b"{").unwrap_err());
        assert!(bad.report().starts_with("bad init arguments: "), "{bad}");
    }

    #[test]
    fn spec_env_overrides_base_but_not_the_listen_fd() {
        let mut spec = crate::SandboxSpec {
            id: crate::SandboxId::parse("a").unwrap(),
            hostname: "a".into(),
            rootfs: "/".into(),
            layers: vec![],
            resources: crate::Resources {
                cpu: 1,
                memory_mib: 1,
                disk_gib: 1,
            },
            env: vec![
                ("PATH".into(), "/bin".into()),
                ("FOO".into(), "1".into()),
                (LISTEN_FD_ENV.into(), "9".into()),
                ("A=B".into(), "x".into()),
                ("COVE_USER".into(), "root".into()),
                ("COVE_ENTRYPOINT".into(), "[\"evil\"]".into()),
            ],
            network: None,
            volumes: vec![],
            workdir: None,
            user: None,
            command: Vec::new(),
        };
        let env = agent_env(&spec);
        assert!(env
            .iter()
            .all(|(k, _)| cove_protocol::env::IMAGE_SETTINGS.iter().all(|n| k != n)));
        spec.workdir = Some("/app".into());
        spec.user = Some("nobody".into());
        spec.command = vec!["nginx".into(), "-g".into(), "daemon off;".into()];
        let env = agent_env(&spec);
        assert!(env.contains(&(
            "COVE_ENTRYPOINT".into(),
            r#"["nginx","-g","daemon off;"]"#.into()
        )));
        assert!(env.contains(&("COVE_WORKDIR".into(), "/app".into())));
        assert!(env.contains(&("COVE_USER".into(), "nobody".into())));
        assert!(env.contains(&("PATH".into(), "/bin".into())));
        assert!(env.contains(&("HOME".into(), "/root".into())));
        assert!(env.contains(&("FOO".into(), "1".into())));
        assert!(env.iter().all(|(k, _)| k != LISTEN_FD_ENV && k != "A=B"));
    }

    #[test]
    fn reports_round_trip_as_one_line() {
        for report in [
            ShimReport::Ready {
                init_pid: 42,
                steps: "fork=0.10ms exec=1.00ms".into(),
            },
            ShimReport::Ready {
                init_pid: 42,
                steps: String::new(),
            },
            ShimReport::Waiting { init_pid: 7 },
            ShimReport::Error("mount: EPERM".into()),
        ] {
            assert_eq!(ShimReport::parse(&report.to_line()).unwrap(), report);
        }
        assert_eq!(ShimReport::Error("a\nb".into()).to_line(), "error a b\n");
        assert!(ShimReport::parse("hello").is_err());
    }
}
