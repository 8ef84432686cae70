//! `polygw mock-upstream`: serves the simulator (`polygw-mock-upstream`) on an address,
//! with a named profile or a JSON profile file (docs/MOCK_UPSTREAM.md).

use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use polygw_mock_upstream::{MockConfig, MockUpstream, Profile, PROFILE_NAMES};

/// Arguments of `polygw mock-upstream`.
#[derive(Debug, clap::Args)]
pub struct MockArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8090")]
    pub listen: SocketAddr,
    /// A profile name (fast, long-tail, flaky, stall, …) or a JSON profile file.
    #[arg(long, default_value = "long-tail")]
    pub profile: String,
    /// Time scale of a named profile (1.0 = the real seconds of the reference workload).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Seed of a named profile (the same seed replays the same behaviors).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Require `Authorization: Bearer <KEY>` (else 401).
    #[arg(long, env = "POLYGW_MOCK_KEY", hide_env_values = true)]
    pub require_key: Option<String>,
}

/// A profile from a name or a file path.
pub fn profile(spec: &str, time_scale: f64, seed: u64) -> Result<Profile> {
    if Path::new(spec).is_file() {
        return Profile::from_file(spec).map_err(|e| anyhow::anyhow!("--profile {spec}: {e}"));
    }
    if !time_scale.is_finite() || time_scale <= 0.0 {
        anyhow::bail!("--time-scale {time_scale}: expected a finite number > 0");
    }
    Profile::named(spec, time_scale, seed).map_err(|e| {
        anyhow::anyhow!(
            "--profile {spec}: {e} (names: {}; or a path to a JSON profile file)",
            PROFILE_NAMES.join(", ")
        )
    })
}

/// Waits for Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

pub async fn run(args: MockArgs) -> Result<ExitCode> {
    let profile = profile(&args.profile, args.time_scale, args.seed)?;
    // A profile file may also set the simulated prefix cache and the prices billed.
    let settings = polygw_mock_upstream::MockSettings::from_profile_arg(&args.profile)
        .map_err(|e| anyhow::anyhow!("--profile {}: {e}", args.profile))?;
    let name = profile.name.clone();
    let mock = MockUpstream::start(MockConfig {
        addr: args.listen,
        require_key: args.require_key.clone(),
        ..MockConfig::with_profile(profile).with_settings(settings)
    })
    .await
    .with_context(|| format!("listening on {}", args.listen))?;
    println!(
        "mock upstream on {} (profile {name}{}); Ctrl-C to stop",
        mock.base_url(),
        if args.require_key.is_some() {
            ", bearer key required"
        } else {
            ""
        }
    );
    shutdown_signal().await;
    let served = mock.requests().len();
    mock.shutdown().await;
    println!("mock upstream stopped after {served} request(s)");
    Ok(ExitCode::SUCCESS)
}
