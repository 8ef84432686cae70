//! Client keys (SPEC §21.1), the facade's part: making a new key (256 bits from the
//! operating system's CSPRNG), and a call's charge against its key — the key permit
//! admitted before the call, settled when the call and every attempt of it are done with
//! the sum of their tokens and costs ([`KeyCharge`]). The records and their rules are
//! [`polygw_core::client_key`]; the limits and budgets are the governance backend's
//! ([`polygw_core::ports::RateLimiter::acquire_key`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use polygw_core::client_key::{hash_key, shown_prefix, KEY_PREFIX};
use polygw_core::key_funds::CallFunds;
use polygw_core::key_quota::{cost_nanos, settlement_nanos};
use polygw_core::ports::{KeyAcquire, KeyAdmission, KeyPermit, RateLimiter, Refusal};
use polygw_core::round::gate::{leg_funding, Funding};
use polygw_core::GovernanceError;

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
    /// A chat call's legs, funded one by one (SPEC §24.1); `None` for embedding and OCR
    /// calls (their batches settle on the admission's reservation as a whole).
    funding: Option<LegFunding>,
}

/// How a chat call's legs are reserved and topped up against the key (SPEC §24.1).
#[derive(Debug)]
pub(crate) struct LegFunding {
    /// The request's prompt estimate (what each leg's reservation prices).
    pub prompt_tokens: u64,
    /// The call's output cap: the request's own, else the one polygw sends (`send_cap`).
    pub cap: Option<u64>,
    /// The cap polygw sends because the request had none and the key has a budget.
    pub send_cap: Option<u64>,
    /// The key has a budget: legs are topped up before they launch.
    pub budgeted: bool,
    /// The scope's `KEYS__ESTIMATE_MARGIN`, percent.
    pub margin_pct: u64,
    /// Where a top-up is asked.
    pub limiter: Arc<dyn RateLimiter>,
    /// The key's budgets and its permits' lease.
    pub budget_day_nanos: Option<u64>,
    pub budget_month_nanos: Option<u64>,
    pub lease: Duration,
    pub funds: Mutex<CallFunds>,
    /// The top-ups granted (finished at 0 when the call settles on its own permit).
    pub top_ups: Mutex<Vec<KeyPermit>>,
}

/// A leg's reservation, held from its pick until its attempt is charged; released if the
/// leg never starts.
#[derive(Debug)]
pub(crate) struct LegHold {
    charge: Arc<KeyCharge>,
    nanos: u64,
    armed: bool,
}

impl Drop for LegHold {
    fn drop(&mut self) {
        if self.armed {
            if let Some(f) = &self.charge.funding {
                lock(&f.funds).release(self.nanos);
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl KeyCharge {
    /// A charge over an admitted permit of key `key_id`.
    pub fn new(key_id: impl Into<String>, permit: KeyPermit) -> Arc<KeyCharge> {
        Arc::new(KeyCharge {
            key_id: key_id.into(),
            permit: Mutex::new(Some(permit)),
            spent: Mutex::new(Spent::default()),
            funding: None,
        })
    }

    /// A chat call's charge over an admitted permit, its legs funded as `funding` says.
    pub(crate) fn funded(
        key_id: impl Into<String>,
        permit: KeyPermit,
        funding: LegFunding,
    ) -> Arc<KeyCharge> {
        Arc::new(KeyCharge {
            key_id: key_id.into(),
            permit: Mutex::new(Some(permit)),
            spent: Mutex::new(Spent::default()),
            funding: Some(funding),
        })
    }

    /// The output cap polygw sends with this call (SPEC §24.1): a budgeted key's call
    /// without a cap of its own is sent the cap it reserved for; one whose remaining
    /// budget could not pay for its own cap, the smaller one it pays for.
    pub fn sent_cap(&self) -> Option<u64> {
        self.funding.as_ref().and_then(|f| f.send_cap)
    }

    /// The call's prompt estimate, output cap and margin (percent), when its legs are
    /// funded one by one.
    pub(crate) fn leg_pricing(&self) -> Option<(u64, Option<u64>, u64)> {
        self.funding
            .as_ref()
            .map(|f| (f.prompt_tokens, f.cap, f.margin_pct))
    }

    /// Reserves a leg of `nanos` before it launches (SPEC §24.1): held at once when the
    /// call's funds cover it (or the key has no budget), else after a top-up the key's
    /// backend grants. `Ok(Err(refusal))`: the top-up was refused — the leg must not
    /// launch. `Ok(Ok(None))`: the call's legs are not funded one by one.
    pub(crate) async fn fund_leg(
        self: &Arc<Self>,
        nanos: u64,
    ) -> Result<Result<Option<LegHold>, Refusal>, GovernanceError> {
        let Some(f) = &self.funding else {
            return Ok(Ok(None));
        };
        loop {
            let need = {
                let mut funds = lock(&f.funds);
                match leg_funding(&funds, nanos, f.budgeted) {
                    Funding::Covered => {
                        funds.hold(nanos);
                        return Ok(Ok(Some(LegHold {
                            charge: self.clone(),
                            nanos,
                            armed: true,
                        })));
                    }
                    Funding::TopUp(n) => n,
                }
            };
            let req = KeyAcquire {
                key_id: &self.key_id,
                rpm: 0,
                tpm: 0,
                max_concurrency: 0,
                budget_day_nanos: f.budget_day_nanos,
                budget_month_nanos: f.budget_month_nanos,
                est_tokens: 0,
                reserve_nanos: need,
                lease: f.lease,
                top_up: true,
            };
            match f.limiter.acquire_key(&req).await? {
                KeyAdmission::Admitted(p) => {
                    lock(&f.top_ups).push(p);
                    lock(&f.funds).topped_up(need);
                }
                KeyAdmission::Refused(r) => return Ok(Err(r)),
            }
        }
    }

    /// The charge of a key without limits or budgets: nothing to admit or settle, its id
    /// still on every row.
    pub fn unmetered(key_id: impl Into<String>) -> Arc<KeyCharge> {
        Arc::new(KeyCharge {
            key_id: key_id.into(),
            permit: Mutex::new(None),
            spent: Mutex::new(Spent::default()),
            funding: None,
        })
    }

    /// The key's id (telemetry `client_key_id`).
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// One attempt's spend: its settled tokens and its cost (`None`: unknown).
    pub fn add(&self, tokens: u64, cost: Option<f64>) {
        self.add_leg(tokens, cost, None);
    }

    /// One attempt's spend, with the reservation its leg held: the leg settles at its
    /// cost, or at that reservation when the cost is unknown (SPEC §24.1).
    pub(crate) fn add_leg(&self, tokens: u64, cost: Option<f64>, leg: Option<LegHold>) {
        let mut s = self.spent.lock().unwrap_or_else(|e| e.into_inner());
        s.tokens = s.tokens.saturating_add(tokens);
        s.costs.push(cost);
        drop(s);
        if let Some(f) = &self.funding {
            let cost = cost.map(cost_nanos);
            let mut funds = lock(&f.funds);
            match leg {
                Some(mut h) => {
                    h.armed = false;
                    funds.end(h.nanos, cost);
                }
                // A leg that held nothing (none does today): unknown, it settles at the
                // admission's reservation.
                None => {
                    let leg = lock(&self.permit)
                        .as_ref()
                        .map_or(0, KeyPermit::reserve_nanos);
                    funds.hold(leg);
                    funds.end(leg, cost);
                }
            }
        }
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
        let nanos = match &self.funding {
            Some(f) => lock(&f.funds).settlement(),
            None => settlement_nanos(reserve, s.costs.iter().copied()),
        };
        (s.tokens, nanos)
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
        // The call settled on its own permit: its top-ups end at 0.
        if let Some(f) = &self.funding {
            for t in lock(&f.top_ups).drain(..) {
                t.finish_in_background(0, 0);
            }
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
