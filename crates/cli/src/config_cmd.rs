//! `polygw config check`: load and guard the environment's configuration, print the
//! resolved settings (secrets redacted) and the warnings; non-zero exit on errors.

use std::process::ExitCode;

use anyhow::Result;

use crate::env;

/// Arguments of `polygw config check`.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// Scopes to check (default: every scope configured).
    #[arg(long)]
    pub scope: Vec<String>,
}

pub async fn run(args: CheckArgs) -> Result<ExitCode> {
    let scopes = match env::scopes(&args.scope) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    let mut failed = 0;
    for scope in &scopes {
        let kind = match env::kind_of(scope) {
            Ok(k) => k,
            Err(e) => {
                failed += 1;
                println!("# scope {scope}: invalid");
                println!("error: {e}");
                continue;
            }
        };
        match env::load(scope, kind) {
            Ok(loaded) => {
                println!("# scope {scope} ({}): ok", kind.operation());
                println!(
                    "{}",
                    polygw::core::hedge::describe(
                        &loaded.settings.hedge,
                        kind == polygw::ScopeKind::Chat,
                        loaded.settings.sources.len()
                    )
                );
                println!("{}", serde_json::to_string_pretty(&loaded.settings)?);
                for w in &loaded.warnings {
                    println!("warning: {w}");
                }
            }
            Err(e) => {
                failed += 1;
                println!("# scope {scope} ({}): invalid", kind.operation());
                for one in e.all() {
                    println!("error: {one}");
                }
            }
        }
    }
    if failed > 0 {
        eprintln!(
            "{failed} of {} scope(s) have configuration errors",
            scopes.len()
        );
        Ok(ExitCode::from(2))
    } else {
        Ok(ExitCode::SUCCESS)
    }
}
