//! Key layout. Everything of one scope shares the `{SCOPE}` hash tag (one cluster slot):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `polygw:{S}:source:<name>:win` | zset | permit id → admitted at (ms) |
//! | `polygw:{S}:source:<name>:tok` | hash | permit id → tokens; `sum`; `s:<id>` settled mark |
//! | `polygw:{S}:source:<name>:inflight` | zset | permit id → lease end (ms) |
//! | `polygw:{S}:source:<name>:breaker` | hash | breaker state (see `lua/breaker_admit.lua`) |
//! | `polygw:{S}:scope:win` | zset | permit id → admitted at (ms) |
//! | `polygw:{S}:scope:tok` | hash | permit id → tokens; `sum` |

use polygw_core::error::GovernanceError;

use crate::BACKEND;

/// The keys one acquire or settlement touches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SourceKeys {
    pub win: String,
    pub tok: String,
    pub inflight: String,
    pub scope_win: String,
    pub scope_tok: String,
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
            tok: format!("{p}:source:{source}:tok"),
            inflight: format!("{p}:source:{source}:inflight"),
            scope_win: format!("{p}:scope:win"),
            scope_tok: format!("{p}:scope:tok"),
        })
    }
}

/// The breaker hash of a source.
pub(crate) fn breaker(scope: &str, source: &str) -> Result<String, GovernanceError> {
    Ok(format!("{}:source:{source}:breaker", prefix(scope)?))
}

/// A scope's window keys.
pub(crate) fn scope_window(scope: &str) -> Result<(String, String), GovernanceError> {
    let p = prefix(scope)?;
    Ok((format!("{p}:scope:win"), format!("{p}:scope:tok")))
}
