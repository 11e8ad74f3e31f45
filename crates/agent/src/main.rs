//! `cove-agent init | serve [--socket PATH] | vm | supervise PID`: argument parsing and
//! start-up order only; everything else lives in the library.

use std::io::IsTerminal as _;

use anyhow::{bail, Context as _};
use cove_agent::listen::{self, Endpoint};
use cove_agent::{config, AppState, Settings};
use cove_protocol::{env, AgentEnv};

/// mimalloc, not musl's allocator: building the agent's router (~100 routes
/// of small allocations, the most of its start) took 1.8 ms on musl's, which
/// returns memory to the kernel at every turn, and 0.9 ms on this one; every
/// request allocates too. Built without eager arena commit
/// (`.cargo/config.toml`), so an idle agent holds 1.1 MiB (1.0 on musl's),
/// not 10 MiB of huge pages.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const USAGE: &str = "usage: cove-agent init | serve [--socket PATH] | vm | supervise PID";

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_default();
    if mode == "vm" {
        return vm_main();
    }
    if mode == "supervise" {
        let init = args.next().and_then(|pid| pid.parse().ok());
        let init = init.context("supervise needs the init's pid")?;
        std::process::exit(cove_agent::supervise::supervise(init));
    }
    let mut socket = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--socket" => socket = Some(args.next().context("--socket needs a path")?),
            _ => bail!("unknown argument {arg:?}\n{USAGE}"),
        }
    }
    let agent_env = AgentEnv::from_process()?;
    let endpoint = match (agent_env.listen_fd, socket) {
        (Some(fd), _) => Endpoint::InheritedFd(fd),
        (None, Some(path)) => Endpoint::Path(path.into()),
        (None, None) => bail!(
            "no listening socket: set {} or pass --socket",
            listen::LISTEN_FD_ENV
        ),
    };
    let mut settings = Settings::from_env(&agent_env);
    let run_as = match agent_env.user.as_deref() {
        Some(user) if !user.is_empty() => {
            let found = cove_agent::user::lookup(user)
                .map_err(|e| anyhow::anyhow!("the sandbox user {user:?}: {e}"))?;
            settings.home_dir = found.home.clone();
            // Commands start in the home, or at the root where it does not
            // exist (`nobody`'s is /nonexistent), as Docker's do.
            if agent_env.workdir.is_none() {
                settings.work_dir = if found.home.is_dir() {
                    found.home.clone()
                } else {
                    "/".into()
                };
            }
            Some(found)
        }
        _ => None,
    };
    // A container's agent keeps its state in the sandbox's /run, made here
    // while it may still write there (a VM's user agent is given its own).
    if mode == "init" && agent_env.state_dir.is_none() {
        settings.state_dir = config::sandbox_state_dir();
    }
    if let Some(user) = &run_as {
        config::prepare_state_dir(&settings.state_dir, Some((user.uid, user.gid)))
            .with_context(|| format!("making {}", settings.state_dir.display()))?;
    }
    // Still single-threaded here, which both calls below require.
    config::remove_private_env();
    match mode.as_str() {
        "init" => cove_agent::init::split_off_server().context("starting as PID 1")?,
        "serve" => {}
        _ => bail!("{USAGE}"),
    }
    if let Some(user) = &run_as {
        cove_agent::user::become_user(user)
            .map_err(|e| anyhow::anyhow!("becoming the sandbox user {}: {e}", user.name))?;
    }

    // Threads only from here on: the fork and the change of user are behind.
    // The routes first, the longest step of the start: they build while the
    // logging, the socket and the runtime are made.
    let routes = std::thread::spawn(cove_agent::routes);
    init_logging(true);
    let listener = listen::open(&endpoint).context("opening the listening socket")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        let state = AppState::new(settings).context("preparing the agent state")?;
        let sessions = state.sessions.clone();
        cove_agent::entrypoint::start(&sessions, &state.settings.entrypoint).await;
        let routes = routes
            .join()
            .map_err(|_| anyhow::anyhow!("building the routes panicked"))?;
        tracing::info!(?endpoint, "cove-agent serving");
        let served = listen::serve(listener, routes.with_state(state)).await;
        sessions.shutdown();
        served.context("serving")
    })
}

/// Logs to stderr; colours only for a terminal a person reads (a VM's
/// console is a terminal too, but ends up in a log file).
fn init_logging(colours: bool) {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(colours && std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env(env::LOG).unwrap_or_else(|_| "info".into()),
        )
        .init();
}

/// `cove-agent vm`: PID 1 of a VM, started by the initramfs. Makes the system
/// a container would get from its host, then serves over virtio-serial.
fn vm_main() -> anyhow::Result<()> {
    if let Err(failure) = cove_agent::vm::boot::prepare_system() {
        // PID 1 exiting ends the VM, which the host reports with the console.
        bail!("preparing the VM: {failure}");
    }
    let agent_env = AgentEnv::from_process()?;
    let mut settings = Settings::from_env(&agent_env);
    if agent_env.state_dir.is_none() {
        settings.state_dir = config::sandbox_state_dir();
        config::prepare_state_dir(&settings.state_dir, None)
            .with_context(|| format!("making {}", settings.state_dir.display()))?;
    }
    // A sandbox user's agent starts with the same settings (and a state
    // directory of its own).
    let user = std::sync::Arc::new(cove_agent::vm::user::UserAgent::new(agent_env));
    // Still single-threaded here, which both calls below require.
    config::remove_private_env();
    cove_agent::init::split_off_server().context("starting as PID 1")?;
    init_logging(false);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        let state = AppState::new(settings).context("preparing the agent state")?;
        let sessions = state.sessions.clone();
        let incoming = cove_agent::vm::session::listen().context("opening the host port")?;
        tracing::info!("cove-agent serving over virtio-serial");
        let app = cove_agent::vm::setup::app(cove_agent::app(state), sessions.clone(), user);
        let served = axum::serve(incoming, app).await;
        sessions.shutdown();
        served.context("serving")
    })
}
