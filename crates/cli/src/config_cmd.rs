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
    let mut routing: Vec<(String, Vec<String>)> = Vec::new();
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
                if kind == polygw::ScopeKind::Chat {
                    println!(
                        "{}",
                        polygw::core::retry_throttle::describe(&loaded.settings.retry.throttle)
                    );
                }
                for src in &loaded.settings.sources {
                    println!(
                        "source {}: API {}, auth {}, POST {}",
                        src.name,
                        src.api.as_str(),
                        match src.effective_auth() {
                            polygw::core::source::SourceAuth::XApiKey => "x-api-key",
                            polygw::core::source::SourceAuth::Bearer => "bearer",
                            polygw::core::source::SourceAuth::Client =>
                                "the client's own credential",
                        },
                        polygw::core::secret::redact_url(&src.request_url())
                    );
                }
                println!("{}", serde_json::to_string_pretty(&loaded.settings)?);
                routing.push((scope.clone(), loaded.settings.model_aliases.clone()));
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
    for line in model_routing(&routing) {
        println!("{line}");
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

/// How `polygw serve` routes a request's `model` to these scopes (SPEC §18.3): a scope's
/// name or an exact alias first (case-insensitive), then the longest `*` pattern; with
/// the overlaps that decide otherwise than a reader might expect.
fn model_routing(scopes: &[(String, Vec<String>)]) -> Vec<String> {
    let mut out = vec![
        "# model routing (polygw serve): a scope's name or exact alias first, then the longest matching pattern".to_string(),
    ];
    let exact = |name: &str, aliases: &[String]| {
        std::iter::once(name.to_ascii_lowercase())
            .chain(
                aliases
                    .iter()
                    .filter(|a| !a.contains('*'))
                    .map(|a| a.to_ascii_lowercase()),
            )
            .collect::<Vec<_>>()
    };
    for (name, aliases) in scopes {
        out.push(format!("  {} → {name}", exact(name, aliases).join(", ")));
        for g in aliases.iter().filter(|a| a.contains('*')) {
            out.push(format!("  {g} (pattern) → {name}"));
        }
    }
    for (name, aliases) in scopes {
        for g in aliases.iter().filter(|a| a.contains('*')) {
            for (other, other_aliases) in scopes.iter().filter(|(o, _)| o != name) {
                for e in exact(other, other_aliases) {
                    if polygw_serve::glob_matches(g, &e) {
                        out.push(format!(
                            "  note: pattern {g} of {name} also matches {e}, which goes to {other} (exact names win)"
                        ));
                    }
                }
                for og in other_aliases.iter().filter(|a| a.contains('*')) {
                    if og.len() == g.len() && og.eq_ignore_ascii_case(g) {
                        out.push(format!(
                            "  warning: pattern {g} is given by {name} and by {other}: one of them is never reached"
                        ));
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_shows_exact_names_patterns_and_overlaps() {
        let s = vec![
            (
                "LLM".to_string(),
                vec!["gpt-4o".to_string(), "claude-*".to_string()],
            ),
            (
                "CLAUDE".to_string(),
                vec!["claude-3".to_string(), "Claude-*".to_string()],
            ),
        ];
        let lines = model_routing(&s).join("\n");
        assert!(lines.contains("llm, gpt-4o → LLM"), "{lines}");
        assert!(lines.contains("claude-* (pattern) → LLM"), "{lines}");
        assert!(
            lines.contains("pattern claude-* of LLM also matches claude-3, which goes to CLAUDE"),
            "{lines}"
        );
        assert!(
            lines.contains("warning: pattern claude-* is given by LLM and by CLAUDE"),
            "{lines}"
        );
    }
}
