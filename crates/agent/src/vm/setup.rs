//! Endpoints only a VM's agent serves, under `/cove/vm/` (a cove extension,
//! not part of Daytona's toolbox API), called by the host runtime:
//!
//! - `POST /cove/vm/identity` after every boot and every restore from saved
//!   memory: the memory of a template, a snapshot or a fork parent holds
//!   another sandbox's hostname, environment and a stale clock, and the same
//!   random state as its siblings. Body: `{"hostname", "env": {name: value},
//!   "unixTimeNs", "entropy": hex, "growRoot", "diskBytes"}`. It sets the clock, mixes in the host's
//!   entropy and reseeds the kernel's generator, sets the hostname, replaces
//!   the variables the previous call set, and with `"growRoot": true` starts
//!   growing the root filesystem to its disk (once the disk is `diskBytes`
//!   large) in the background. `"network"`: `{"mac", "address", "prefixLen",
//!   "gateway", "resolvConf"}` configures the NIC (see [`super::network`]);
//!   `null` takes it down. `"volumes"`: `[{"tag", "path"}]` mounts each
//!   virtio-fs device at its path (see [`super::volumes`]). `"entrypoint"`:
//!   the image's ENTRYPOINT and CMD, started in the `entrypoint` session
//!   unless that session exists (see [`crate::entrypoint`]). `"user"`: who
//!   toolbox requests run as; another user than root gets an agent of its
//!   own (see [`super::user`]), which starts the entrypoint. Answers `{}`.
//!   The message is `cove_protocol::IdentityRequest`, shared with the host.
//! - `POST /cove/vm/sync` before the host stops the VM: writes out every
//!   filesystem, so files survive the stop.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::routing::post;
use axum::Router;
use cove_protocol::identity::{IdentityRequest, IDENTITY_PATH, SYNC_PATH};
use serde_json::{json, Value};

use super::user::UserAgent;
use crate::error::{ApiError, Json};
use crate::session::Registry;

/// What the identity call changes besides the system: the root agent's
/// sessions (the entrypoint's, where root runs it) and the user agent.
#[derive(Clone)]
struct Vm {
    sessions: Arc<Registry>,
    user: Arc<UserAgent>,
}

/// A VM agent's whole app: `/cove/vm/*` here, as root; every other request
/// to `toolbox` (the agent's routes, as root) or to the user agent.
pub fn app(toolbox: Router, sessions: Arc<Registry>, user: Arc<UserAgent>) -> Router {
    let vm = Vm {
        sessions,
        user: user.clone(),
    };
    Router::new()
        .route(IDENTITY_PATH, post(identity))
        .route(SYNC_PATH, post(sync))
        .with_state(vm)
        .fallback(move |request: Request| {
            super::user::dispatch(toolbox.clone(), user.clone(), request)
        })
}

const HOSTS: &str = "/etc/hosts";

/// `/etc/hosts` with the machine's own name on 127.0.1.1 (Debian's habit),
/// in place of whatever name a template or fork parent left there, so
/// programs that look their host up (`sudo` does) find it.
fn own_name_in_hosts(hosts: &str, hostname: &str) -> String {
    let mut out: String = if hosts.trim().is_empty() {
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n".into()
    } else {
        hosts
            .lines()
            .filter(|line| !line.starts_with("127.0.1.1"))
            .map(|line| format!("{line}\n"))
            .collect()
    };
    out.push_str(&format!("127.0.1.1\t{hostname}\n"));
    out
}

/// The variables the last identity call set, with the values they replaced
/// (`None`: the variable did not exist), so the next call can undo them.
static APPLIED_ENV: Mutex<Vec<(String, Option<String>)>> = Mutex::new(Vec::new());

/// Held while an identity call is applied: the host repeats a call that
/// went unanswered on a new session, and the repeat must not run beside the
/// first (both would start the entrypoint, or configure the NIC at once).
static APPLYING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn identity(State(vm): State<Vm>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let request: IdentityRequest =
        serde_json::from_slice(&body).map_err(|e| ApiError::InvalidBody(e.to_string()))?;
    // In a task of its own: a call whose session died is not cut short
    // half-way, and the repeat waits for it to end.
    tokio::spawn(async move {
        let _applying = APPLYING.lock().await;
        apply_identity(&vm, request).await
    })
    .await
    .map_err(|e| ApiError::internal("apply the identity", io::Error::other(e)))?
}

async fn apply_identity(vm: &Vm, request: IdentityRequest) -> Result<Json<Value>, ApiError> {
    check_env(&request.env)?;
    let entropy = decode_hex(&request.entropy)
        .ok_or_else(|| ApiError::BadRequest("entropy must be hex digits".into()))?;
    if let Some(ns) = request.unix_time_ns {
        set_clock(ns).map_err(|e| ApiError::internal("set the clock", e))?;
    }
    if !entropy.is_empty() {
        add_entropy(&entropy).map_err(|e| ApiError::internal("seed the random generator", e))?;
    }
    nix::unistd::sethostname(&request.hostname)
        .map_err(|e| ApiError::BadRequest(format!("hostname {:?}: {e}", request.hostname)))?;
    let hosts = own_name_in_hosts(
        &std::fs::read_to_string(HOSTS).unwrap_or_default(),
        &request.hostname,
    );
    std::fs::write(HOSTS, hosts).map_err(|e| ApiError::internal("write /etc/hosts", e))?;
    let env_changes = replace_env(&request.env);
    let network = request.network;
    tokio::task::spawn_blocking(move || super::network::configure(network.as_ref()))
        .await
        .map_err(|e| ApiError::internal("configure the network", io::Error::other(e)))?
        .map_err(|e| ApiError::internal("configure the network", e))?;
    let volumes = request.volumes;
    tokio::task::spawn_blocking(move || super::volumes::mount_all(&volumes))
        .await
        .map_err(|e| ApiError::internal("mount the volumes", io::Error::other(e)))?
        .map_err(|e| ApiError::internal("mount the volumes", e))?;
    let user = request.user.as_deref();
    vm.user
        .become_user(user, &env_changes, &request.entrypoint)
        .await?;
    if super::user::is_root(user) && vm.sessions.get(crate::entrypoint::SESSION).is_err() {
        crate::entrypoint::start(&vm.sessions, &request.entrypoint).await;
    }
    if request.grow_root {
        // In the background: growing ends with a journal flush that takes a
        // good part of a second under emulation, and nothing needs to wait
        // for the extra space. A failure is only logged: the sandbox runs on
        // with the smaller filesystem.
        let expected = request.disk_bytes;
        tokio::task::spawn_blocking(move || match super::boot::grow_root(expected) {
            Ok(bytes) => tracing::info!(disk_bytes = bytes, "root filesystem fills its disk"),
            Err(error) => tracing::warn!(%error, "could not grow the root filesystem"),
        });
    }
    Ok(Json(json!({})))
}

async fn sync() -> Result<Json<Value>, ApiError> {
    tokio::task::spawn_blocking(nix::unistd::sync)
        .await
        .map_err(|e| ApiError::internal("sync", io::Error::other(e)))?;
    Ok(Json(json!({})))
}

fn check_env(env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    for (name, value) in env {
        if name.is_empty() || name.contains(['=', '\0']) || value.contains('\0') {
            return Err(ApiError::BadRequest(format!(
                "invalid environment variable {name:?}"
            )));
        }
    }
    Ok(())
}

/// Undoes the previous call's variables, then sets `env`, remembering what
/// each one replaced; answers the names either call touched. std serialises
/// environment access behind one lock and the agent reads its environment
/// only through std, so this is sound while other threads run (as in
/// `POST /env`).
fn replace_env(env: &BTreeMap<String, String>) -> Vec<String> {
    let mut applied = APPLIED_ENV.lock().unwrap_or_else(|p| p.into_inner());
    let mut touched: Vec<String> = applied.iter().map(|(name, _)| name.clone()).collect();
    touched.extend(env.keys().cloned());
    touched.sort();
    touched.dedup();
    for (name, previous) in applied.drain(..).rev() {
        match previous {
            Some(value) => std::env::set_var(&name, value),
            None => std::env::remove_var(&name),
        }
    }
    for (name, value) in env {
        let previous = std::env::var(name).ok();
        std::env::set_var(name, value);
        applied.push((name.clone(), previous));
    }
    touched
}

/// Sets the wall clock (a restored guest's stopped when it was saved).
pub fn set_clock(unix_ns: u64) -> io::Result<()> {
    let time = libc::timespec {
        tv_sec: (unix_ns / 1_000_000_000) as _,
        tv_nsec: (unix_ns % 1_000_000_000) as _,
    };
    // SAFETY: clock_settime reads one timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &time) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `_IOW('R', 0x03, int[2])`.
const RNDADDENTROPY: libc::Ioctl = 0x4008_5203;
/// `_IO('R', 0x07)`.
const RNDRESEEDCRNG: libc::Ioctl = 0x5207;

/// Credits the host's random bytes to the kernel's pool and reseeds its
/// generator at once, so restored siblings stop sharing random output.
fn add_entropy(bytes: &[u8]) -> io::Result<()> {
    let random = File::options().write(true).open("/dev/urandom")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    // SAFETY: RNDADDENTROPY reads a rand_pool_info whose buf_size bytes follow it.
    if unsafe { libc::ioctl(random.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(random.as_raw_fd(), RNDRESEEDCRNG) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_file_names_this_machine_once() {
        let fresh = own_name_in_hosts("", "box-a");
        assert!(fresh.contains("127.0.0.1\tlocalhost\n"));
        assert!(fresh.ends_with("127.0.1.1\tbox-a\n"));
        let renamed = own_name_in_hosts(&fresh, "box-b");
        assert!(!renamed.contains("box-a"));
        assert_eq!(renamed.matches("127.0.1.1").count(), 1);
        assert!(renamed.contains("127.0.0.1\tlocalhost\n"));
    }

    #[test]
    fn hex_decodes_or_refuses() {
        assert_eq!(decode_hex("00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(decode_hex(""), Some(vec![]));
        assert_eq!(decode_hex("abc"), None);
        assert_eq!(decode_hex("zz"), None);
    }

    #[test]
    fn a_new_identity_undoes_the_previous_variables() {
        let base = "COVE_TEST_VM_BASE_VAR";
        std::env::set_var(base, "base");
        let first: BTreeMap<_, _> = [
            (base.to_owned(), "first".to_owned()),
            ("COVE_TEST_VM_ONLY_FIRST".to_owned(), "1".to_owned()),
        ]
        .into();
        replace_env(&first);
        assert_eq!(std::env::var(base).unwrap(), "first");
        assert_eq!(std::env::var("COVE_TEST_VM_ONLY_FIRST").unwrap(), "1");
        let second: BTreeMap<_, _> = [("COVE_TEST_VM_SECOND".to_owned(), "2".to_owned())].into();
        // Every name either call set, for a user agent to pick up.
        assert_eq!(
            replace_env(&second),
            [base, "COVE_TEST_VM_ONLY_FIRST", "COVE_TEST_VM_SECOND"]
        );
        assert_eq!(std::env::var(base).unwrap(), "base");
        assert!(std::env::var("COVE_TEST_VM_ONLY_FIRST").is_err());
        assert_eq!(std::env::var("COVE_TEST_VM_SECOND").unwrap(), "2");
        replace_env(&BTreeMap::new());
        assert!(std::env::var("COVE_TEST_VM_SECOND").is_err());
        std::env::remove_var(base);
    }

    #[test]
    fn bad_variable_names_are_refused() {
        let bad: BTreeMap<_, _> = [("A=B".to_owned(), "x".to_owned())].into();
        assert!(check_env(&bad).is_err());
        let good: BTreeMap<_, _> = [("A".to_owned(), "x y".to_owned())].into();
        assert!(check_env(&good).is_ok());
    }
}
