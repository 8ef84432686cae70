//! Key layout. Everything of one scope shares the `{SCOPE}` hash tag (one cluster slot):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `polygw:{S}:source:<name>:win` | zset | permit id → admitted at (ms): requests (RPM) |
//! | `polygw:{S}:source:<name>:inflight` | zset | permit id → lease end (ms): slots |
//! | `polygw:{S}:source:<name>:tokens` | hash | permit id → tokens; `sum` (TPM) |
//! | `polygw:{S}:source:<name>:reserved` | zset | permit id → lease end: unsettled reservations |
//! | `polygw:{S}:source:<name>:settled` | zset | permit id → settled at: settlements |
//! | `polygw:{S}:source:<name>:breaker` | hash | breaker state (see `lua/breaker_admit.lua`) |
//! | `polygw:{S}:scope:win` | zset | permit id → admitted at (ms) |
//! | `polygw:{S}:scope:{tokens,reserved,settled}` | hash, zsets | as the source's |
//!
//! The token keys are new with §14.3 (reservations held until settled); the keys of the
//! earlier layout (`…:tok`) are never read and expire by their TTL.

use polygw_core::error::GovernanceError;

use crate::BACKEND;

/// The keys one acquire or settlement touches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SourceKeys {
    pub win: String,
    pub inflight: String,
    pub tokens: String,
    pub reserved: String,
    pub settled: String,
    pub scope_win: String,
    pub scope_tokens: String,
    pub scope_reserved: String,
    pub scope_settled: String,
}

fn prefix(scope: &str) -> Result<String, GovernanceError> {
    // A brace in the scope would break the hash tag (and so atomicity on a cluster).
    if scope.is_empty() || scope.contains(['{', '}']) {
        return Err(GovernanceError::new(
            BACKEND,
            format!("scope name {scope:?} cannot be used in a key (empty or has braces)"),
        ));
    }
    Ok(format!("polygw:{{{scope}}}"))
}

impl SourceKeys {
    pub(crate) fn new(scope: &str, source: &str) -> Result<Self, GovernanceError> {
        let p = prefix(scope)?;
        Ok(SourceKeys {
            win: format!("{p}:source:{source}:win"),
            inflight: format!("{p}:source:{source}:inflight"),
            tokens: format!("{p}:source:{source}:tokens"),
            reserved: format!("{p}:source:{source}:reserved"),
            settled: format!("{p}:source:{source}:settled"),
            scope_win: format!("{p}:scope:win"),
            scope_tokens: format!("{p}:scope:tokens"),
            scope_reserved: format!("{p}:scope:reserved"),
            scope_settled: format!("{p}:scope:settled"),
        })
    }
}

/// The breaker hash of a source.
pub(crate) fn breaker(scope: &str, source: &str) -> Result<String, GovernanceError> {
    Ok(format!("{}:source:{source}:breaker", prefix(scope)?))
}

/// A scope's window keys: requests, tokens, reservations, settlements.
pub(crate) fn scope_window(scope: &str) -> Result<[String; 4], GovernanceError> {
    let p = prefix(scope)?;
    Ok([
        format!("{p}:scope:win"),
        format!("{p}:scope:tokens"),
        format!("{p}:scope:reserved"),
        format!("{p}:scope:settled"),
    ])
}
