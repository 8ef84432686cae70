//! Key layout. Everything of one scope shares the `{S}` hash tag (one cluster slot):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `polygw:{S}:source:<name>:win` | zset | permit id → admitted at (ms): requests (RPM) |
//! | `polygw:{S}:source:<name>:inflight` | zset | permit id → lease end (ms): slots |
//! | `polygw:{S}:source:<name>:breaker` | hash | breaker state (see `lua/breaker_admit.lua`) |
//! | `polygw:{S}:source:<name>:drained` | string | present while an operator has the source out (SPEC §26.3); no expiry |
//! | `polygw:{S}:scope:win` | zset | permit id → admitted at (ms) |
//! | `polygw:{S}:scope:ledger` | zset | every token entry of the scope and its sources, by expiry (see `lua/acquire.lua`) |
//! | `polygw:{S}:scope:totals` | hash | the ledger's totals (scope, per source), the keys' deadlines, when to prune next |
//! | `polygw:{S}:aff:<digest>` | string | the source that last served a prompt-cache affinity key; `PX` = `AFFINITY__TTL_S` (see `affinity.rs`) |
//!
//! A client key's keys share the key id's own hash tag (`{K}`: one cluster slot, apart
//! from every scope's), so a key admission is one script of its own (SPEC §21.1):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `polygw:key:{K}:win` | zset | permit id → admitted at (ms): the key's requests (RPM) |
//! | `polygw:key:{K}:inflight` | zset | `<id>\|<nanos>` → lease end: calls in flight and their money reservations |
//! | `polygw:key:{K}:ledger` | zset | token entries (TPM), as a scope's ledger without the source part |
//! | `polygw:key:{K}:state` | hash | token and reserved totals, the day's and month's spend, deadlines (see `lua/key_lib.lua`) |
//!
//! The ledger and its totals replaced the `…:tokens` hashes and `…:reserved` /
//! `…:settled` sets of each source and of the scope (two keys instead of eight: fewer
//! Redis calls per script); those older keys are never read and expire by their TTL.

use polygw_core::error::GovernanceError;

use crate::BACKEND;

/// The keys one acquire or settlement touches, and the source's name (part of its ledger
/// entries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SourceKeys {
    pub source: String,
    pub win: String,
    pub inflight: String,
    pub scope_win: String,
    pub ledger: String,
    pub totals: String,
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
            source: source.to_string(),
            win: format!("{p}:source:{source}:win"),
            inflight: format!("{p}:source:{source}:inflight"),
            scope_win: format!("{p}:scope:win"),
            ledger: format!("{p}:scope:ledger"),
            totals: format!("{p}:scope:totals"),
        })
    }
}

/// The affinity key of a session (SPEC §20.2): `key` is a digest (hex), checked so that
/// nothing a client sent can reach a key name.
pub(crate) fn affinity(scope: &str, key: &str) -> Result<String, GovernanceError> {
    if key.is_empty() || key.len() > 64 || !key.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(GovernanceError::new(
            BACKEND,
            format!("affinity key {key:?} is not a digest (1 to 64 letters and digits)"),
        ));
    }
    Ok(format!("{}:aff:{key}", prefix(scope)?))
}

/// The breaker hash of a source.
pub(crate) fn breaker(scope: &str, source: &str) -> Result<String, GovernanceError> {
    Ok(format!("{}:source:{source}:breaker", prefix(scope)?))
}

/// The drain flag of a source (present: drained).
pub(crate) fn drained(scope: &str, source: &str) -> Result<String, GovernanceError> {
    Ok(format!("{}:source:{source}:drained", prefix(scope)?))
}

/// A scope's keys: requests, ledger, totals.
pub(crate) fn scope_keys(scope: &str) -> Result<[String; 3], GovernanceError> {
    let p = prefix(scope)?;
    Ok([
        format!("{p}:scope:win"),
        format!("{p}:scope:ledger"),
        format!("{p}:scope:totals"),
    ])
}

/// A client key's keys (see the table above).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyKeys {
    pub win: String,
    pub inflight: String,
    pub ledger: String,
    pub state: String,
}

impl KeyKeys {
    pub(crate) fn new(key_id: &str) -> Result<Self, GovernanceError> {
        if !polygw_core::key_quota::valid_key_id(key_id) {
            return Err(GovernanceError::new(
                BACKEND,
                format!("client key id {key_id:?} cannot be used in a key (empty or has braces)"),
            ));
        }
        let p = format!("polygw:key:{{{key_id}}}");
        Ok(KeyKeys {
            win: format!("{p}:win"),
            inflight: format!("{p}:inflight"),
            ledger: format!("{p}:ledger"),
            state: format!("{p}:state"),
        })
    }

    /// In the order the key scripts declare them (`lua/key_lib.lua`).
    pub(crate) fn all(&self) -> [&String; 4] {
        [&self.win, &self.inflight, &self.ledger, &self.state]
    }
}
