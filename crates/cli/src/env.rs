//! The process environment as polygw configuration: scope discovery and loading.

use anyhow::{bail, Result};
use polygw::core::config::{discover_scopes, load_scope};
use polygw::core::LoadedScope;
use polygw::ScopeKind;

/// Every variable of the process.
pub fn vars() -> Vec<(String, String)> {
    std::env::vars().collect()
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
pub fn load(scope: &str, kind: ScopeKind) -> Result<LoadedScope, polygw::ConfigError> {
    load_scope(vars(), scope, kind)
}

/// Prints configuration warnings to stderr.
pub fn print_warnings(scope: &str, warnings: &[polygw::ConfigWarning]) {
    for w in warnings {
        eprintln!("warning: {scope}: {w}");
    }
}
