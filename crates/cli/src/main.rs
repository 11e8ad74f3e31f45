//! The `cove` binary: glue only. It parses arguments, builds the pieces and hands
//! over to the library crates.

mod admin_cmd;
mod agent_binary;
mod bench;
mod client;
mod descriptors;
mod image_cmd;
mod pull_progress;
mod runner_cmd;
mod runner_images;
mod runner_service;
mod sandbox_cmd;
mod serve;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cove",
    version,
    about = "Sandboxes for AI agents, with a Daytona-compatible API"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the server: API, toolbox proxy, timers.
    Serve(Box<serve::ServeArgs>),
    /// Run this machine as a runner of a control plane on another: check in
    /// with the runner's token and report this host every few seconds.
    Runner(Box<runner_cmd::RunnerArgs>),
    /// Manage sandboxes on a running server.
    #[command(subcommand)]
    Sandbox(sandbox_cmd::SandboxCommand),
    /// Manage images on this machine.
    #[command(subcommand)]
    Image(image_cmd::ImageCommand),
    /// Operator actions on a running server.
    #[command(subcommand)]
    Admin(admin_cmd::AdminCommand),
    /// Measure a scenario and print median, p95 and p99.
    Bench(bench::BenchArgs),
}

fn main() -> std::process::ExitCode {
    // A container's setup runs in this same binary, before any thread exists.
    if std::env::args().nth(1).as_deref() == Some("__container-init") {
        cove_runtime::container::container_init_main();
    }
    let cli = Cli::parse();
    // Every TLS client in the process (registry pulls, S3 archives, HTTPS
    // API URLs) uses ring, the one provider built in.
    let _ = rustls::crypto::ring::default_provider().install_default();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("COVE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => serve::run(*args).await,
            Command::Sandbox(command) => sandbox_cmd::run(command).await,
            Command::Bench(args) => bench::run(args).await,
            Command::Admin(command) => admin_cmd::run(command).await,
            Command::Runner(args) => runner_cmd::run(*args).await,
            Command::Image(command) => image_cmd::run(command).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
