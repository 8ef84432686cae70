//! Client keys (SPEC §21.1), the facade's part: making a new key (256 bits from the
//! operating system's CSPRNG), and a call's charge against its key — the key permit
//! admitted before the call, settled when the call and every attempt of it are done with
//! the sum of their tokens and costs ([`KeyCharge`]). The records and their rules are
//! [`polygw_core::client_key`]; the limits and budgets are the governance backend's
//! ([`polygw_core::ports::RateLimiter::acquire_key`]).

use std::sync::{Arc, Mutex};

use base64::Engine as _;
use polygw_core::client_key::{hash_key, shown_prefix, KEY_PREFIX};
use polygw_core::key_quota::settlement_nanos;
use polygw_core::ports::KeyPermit;

/// A new client key: `pgw-` and 43 characters (256 random bits, URL-safe base64), with
/// the hash and the prefix the store keeps. The key itself is shown once and never kept.
#[derive(Debug)]
pub struct NewKey {
    /// The key, to hand to the client (never stored, never logged).
    pub key: String,
    /// Its SHA-256 (what the store keeps).
    pub hash: String,
    /// Its first characters (shown in lists).
    pub prefix: String,
}

/// Makes a new key; fails only when the operating system has no randomness to give.
pub fn generate_key() -> Result<NewKey, String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness from the OS: {e}"))?;
    let key = format!(
        "{KEY_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    );
    Ok(NewKey {
        hash: hash_key(&key),
        prefix: shown_prefix(&key),
        key,
    })
}

/// A new public key id (`key_` and 12 hex digits from a UUIDv4).
pub fn new_key_id() -> String {
    let u = uuid::Uuid::new_v4().simple().to_string();
    format!("key_{}", &u[..12])
}

#[derive(Debug, Default)]
struct Spent {
    tokens: u64,
    costs: Vec<Option<f64>>,
}

/// A call's charge against its client key: the admitted key permit and what the call's
/// attempts spend. Every attempt's row adds its tokens and cost
/// ([`KeyCharge::add`]); when the last holder lets go — the call and every attempt
/// of it finished — the permit settles at the sum: the tokens, and the costs as
/// [`settlement_nanos`] sums them (an unknown cost settles at no less than the
/// reservation). Cheap to share (`Arc`).
#[derive(Debug)]
pub struct KeyCharge {
    key_id: String,
    permit: Mutex<Option<KeyPermit>>,
    spent: Mutex<Spent>,
}

impl KeyCharge {
    /// A charge over an admitted permit of key `key_id`.
    pub fn new(key_id: impl Into<String>, permit: KeyPermit) -> Arc<KeyCharge> {
        Arc::new(KeyCharge {
            key_id: key_id.into(),
            permit: Mutex::new(Some(permit)),
            spent: Mutex::new(Spent::default()),
        })
    }

    /// The charge of a key without limits or budgets: nothing to admit or settle, its id
    /// still on every row.
    pub fn unmetered(key_id: impl Into<String>) -> Arc<KeyCharge> {
        Arc::new(KeyCharge {
            key_id: key_id.into(),
            permit: Mutex::new(None),
            spent: Mutex::new(Spent::default()),
        })
    }

    /// The key's id (telemetry `client_key_id`).
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// One attempt's spend: its settled tokens and its cost (`None`: unknown).
    pub fn add(&self, tokens: u64, cost: Option<f64>) {
        let mut s = self.spent.lock().unwrap_or_else(|e| e.into_inner());
        s.tokens = s.tokens.saturating_add(tokens);
        s.costs.push(cost);
    }

    /// (tokens, nanos) the permit settles at, were the call over now.
    pub fn settlement(&self) -> (u64, u64) {
        let reserve = self
            .permit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map_or(0, KeyPermit::reserve_nanos);
        let s = self.spent.lock().unwrap_or_else(|e| e.into_inner());
        (s.tokens, settlement_nanos(reserve, s.costs.iter().copied()))
    }
}

impl Drop for KeyCharge {
    fn drop(&mut self) {
        let (tokens, nanos) = self.settlement();
        if let Some(p) = self
            .permit
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            p.finish_in_background(tokens, nanos);
        }
    }
}

/// Why a call was not admitted against its client key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyAdmitError {
    /// Over a limit or a budget (or a budget on an unpriced scope); what the call would
    /// have reserved.
    Refused {
        /// The refusal: which limit, and when it passes.
        refusal: polygw_core::ports::Refusal,
        /// The money the call would have reserved, nanos.
        reserve_nanos: u64,
        /// The tokens it would have reserved.
        est_tokens: u64,
    },
    /// The governance backend failed (fail closed).
    Backend(polygw_core::GovernanceError),
}

/// A [`KeyCharge`] in [`crate::CallOptions`] (compared by identity).
#[derive(Debug, Clone)]
pub struct KeyGrant(pub Arc<KeyCharge>);

impl PartialEq for KeyGrant {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for KeyGrant {}

#[cfg(test)]
mod tests {
    use super::*;
    use polygw_core::client_key::looks_like_key;

    #[test]
    fn new_keys_have_the_shape_and_differ() {
        let a = generate_key().unwrap();
        let b = generate_key().unwrap();
        assert!(looks_like_key(&a.key), "{}", a.key);
        assert_ne!(a.key, b.key);
        assert_eq!(a.hash, hash_key(&a.key));
        assert!(a.key.starts_with(&a.prefix));
        assert!(new_key_id().starts_with("key_"));
    }
}
