//! The process environment as polygw configuration: scope discovery and loading.

use anyhow::{bail, Result};
use polygw::core::config::{discover_scopes, load_scope};
use polygw::core::LoadedScope;
use polygw::ScopeKind;

/// Every UTF-8 variable of the process (others are skipped: discovery only).
pub fn vars() -> Vec<(String, String)> {
    polygw::process_vars(None).unwrap_or_default()
}

/// The scopes to use: those named (upper-cased), else every scope with a source key.
pub fn scopes(named: &[String]) -> Result<Vec<String>> {
    if !named.is_empty() {
        return Ok(named.iter().map(|s| s.to_uppercase()).collect());
    }
    let found = discover_scopes(vars());
    if found.is_empty() {
        bail!(
            "no scope is configured: set e.g. LLM__<PROVIDER>__0__BASE_URL, __API_KEY and __MODEL \
             (see docs/CONFIGURATION.md), or run `polygw demo`"
        );
    }
    Ok(found)
}

/// The kind a scope declares (`{S}__KIND`: chat by default; never inferred from its
/// name).
pub fn kind_of(scope: &str) -> Result<ScopeKind, polygw::ConfigError> {
    polygw::core::config::scope_kind(vars(), scope)
}

/// Loads and guards one scope from the environment.
/// A variable of the scope that is not UTF-8 is an error naming its key.
pub fn load(scope: &str, kind: ScopeKind) -> Result<LoadedScope, polygw::ConfigError> {
    load_scope(polygw::process_vars(Some(scope))?, scope, kind)
}

/// Prints configuration warnings to stderr.
pub fn print_warnings(scope: &str, warnings: &[polygw::ConfigWarning]) {
    for w in warnings {
        eprintln!("warning: {scope}: {w}");
    }
}
