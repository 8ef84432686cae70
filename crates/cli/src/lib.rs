//! `polygw`: the program. `demo` (the main job on embedded defaults), `mock-upstream`,
//! `chat`, `serve` (an OpenAI-compatible proxy), `report`, `keys` and `config check`.
//!
//! The program lives in this library so that the binary (`src/main.rs`) and the
//! program-from-the-outside suites of the top-level `tests/` package (which build the
//! same program as their own binary target, see `tests/Cargo.toml`) run one `run()`.

mod chat;
mod config_cmd;
mod demo;
mod demo_affinity;
mod env;
mod keys;
mod mock;
mod report;
mod serve;
mod table;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Several OpenAI-compatible LLM sources as one dependable endpoint.
#[derive(Debug, Parser)]
#[command(name = "polygw", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the built-in demonstration: simulated long-tail upstreams, the same
    /// workload with hedging off and on, a side-by-side table (no network, no config).
    Demo(demo::DemoArgs),
    /// Serve a simulated OpenAI-compatible upstream (a named profile or a JSON file).
    MockUpstream(mock::MockArgs),
    /// One chat call with the environment's configuration.
    Chat(chat::ChatArgs),
    /// An OpenAI-compatible proxy over the configured scopes.
    Serve(serve::ServeArgs),
    /// Per-source latency, stalls, hedging, errors, tokens and cost from telemetry.
    Report(report::ReportArgs),
    /// Client keys of `polygw serve` (limits, budgets, allowed scopes and models).
    Keys(keys::KeysArgs),
    /// Configuration commands.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Load and guard the environment's configuration; print it (secrets redacted)
    /// with its warnings; exit non-zero on errors.
    Check(config_cmd::CheckArgs),
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("POLYGW_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new("warn"));
    // Colour codes only on a terminal: a log file or a pipe gets plain text.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

/// The program: parse the command line, run the command, map the result to an exit code.
pub fn run() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Demo(a) => demo::run(a).await,
            Command::MockUpstream(a) => mock::run(a).await,
            Command::Chat(a) => chat::run(a).await,
            Command::Serve(a) => serve::run(a).await,
            Command::Report(a) => report::run(a).await,
            Command::Keys(a) => keys::run(a).await,
            Command::Config {
                command: ConfigCommand::Check(a),
            } => config_cmd::run(a).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
