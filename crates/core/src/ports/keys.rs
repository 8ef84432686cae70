//! The client-key half of the [`RateLimiter`](super::RateLimiter) port (SPEC §21.1,
//! issue 26): a key's RPM / TPM / concurrency limits and its spend budgets per UTC day and
//! month, admitted once per client call as reserve-then-settle.
//!
//! The call's caller (the proxy) runs, in order:
//! 1. [`crate::key_quota::key_reservation`] — the call's token estimate and its cost
//!    reservation in nano-units from the scope's prices (a key with a budget on a scope
//!    without prices is refused there, `key_budget_unpriced`);
//! 2. [`RateLimiter::acquire_key`](super::RateLimiter::acquire_key) once, before the
//!    call's first source admission: one atomic operation in the key's own state (on
//!    Redis one script in the key's hash slot), so the key is never checked twice and
//!    never with a scope's keys;
//! 3. the call (every attempt, hedge leg and resume under the one key permit);
//! 4. [`KeyPermit::finish`] with the tokens of all the call's attempts and its cost
//!    ([`crate::key_quota::settlement_nanos`] of its rows' costs).
//!
//! A permit dropped unfinished (the client went away, a panic) settles at its reservation
//! through [`KeyPermitBackend::finish_on_drop`], which must not block. Its in-flight slot
//! and its reservations are a lease (`KeyAcquire::lease`) that the backend's heartbeat
//! renews while the permit is alive, exactly like a source permit's (SPEC §14.4); a
//! crashed holder's reservation is taken as settled at its reservation when the lease
//! ends (the tokens and the money were probably spent).

use std::time::Duration;

use async_trait::async_trait;

use crate::error::GovernanceError;
use crate::ports::limiter::Refusal;

/// What one key admission asks for. Rate fields: 0 = unlimited; budgets: `None` = none.
/// Money is in integer nano-units of the prices' currency (1.00 = 1 000 000 000).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyAcquire<'a> {
    /// The key's id (its state's name; on Redis the hash tag of its keys: no braces,
    /// not empty).
    pub key_id: &'a str,
    /// Client requests per rolling 60 s (0 = unlimited).
    pub rpm: u32,
    /// Tokens per rolling 60 s, all the call's attempts together (0 = unlimited).
    pub tpm: u64,
    /// Client calls in flight (0 = unlimited).
    pub max_concurrency: u32,
    /// Spend per UTC day, nanos.
    pub budget_day_nanos: Option<u64>,
    /// Spend per UTC month, nanos.
    pub budget_month_nanos: Option<u64>,
    /// Tokens reserved in the key's TPM window ([`crate::key_quota::KeyReservation::tokens`]).
    pub est_tokens: u64,
    /// Money reserved against the budgets ([`crate::key_quota::KeyReservation::reserve_nanos`]).
    pub reserve_nanos: u64,
    /// The lease of the in-flight slot and the reservations, renewed while the permit
    /// lives (use the longest lease of the call's sources: the call outlives each attempt).
    pub lease: Duration,
    /// A top-up of a call already admitted (SPEC §24.1: an extra leg's money, reserved
    /// before it launches): only the budgets are checked, and the permit holds money
    /// only — no request in the RPM window, no tokens, no concurrency slot (`rpm`, `tpm`,
    /// `max_concurrency` and `est_tokens` are ignored). It settles and ends like any
    /// permit: finished at 0 when the call settles on its first permit, at its
    /// reservation when dropped or when its lease ends.
    pub top_up: bool,
}

/// Result of a key admission.
#[derive(Debug)]
pub enum KeyAdmission {
    /// Admitted: finish the permit when the call ends.
    Admitted(KeyPermit),
    /// Refused (`key_rpm`, `key_tpm`, `key_concurrency`, `key_budget_day`,
    /// `key_budget_month`), with the earliest time it can pass when known: the window's
    /// expiry, the earliest lease end, the budget period's end.
    Refused(Refusal),
}

/// A key's figures now (`polygw report`, `polygw keys list`, tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KeyUsage {
    /// The backend's time of the reading, ms since the Unix epoch (Redis: the server's):
    /// with [`crate::key_quota::Period::end_ms`] it says when each period resets.
    pub now_unix_ms: u64,
    /// Calls in flight (leases that have not ended).
    pub in_flight: u32,
    /// Requests in the rolling 60 s window.
    pub requests: u64,
    /// Tokens in the rolling 60 s window (reserved or settled).
    pub tokens: u64,
    /// Money reserved by the calls in flight (counted in `day_nanos` and `month_nanos`).
    pub reserved_nanos: u64,
    /// Spend of the current UTC day: settled in it, plus `reserved_nanos`.
    pub day_nanos: u64,
    /// Spend of the current UTC month: settled in it, plus `reserved_nanos`.
    pub month_nanos: u64,
}

/// The backend side of a key permit.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait KeyPermitBackend: Send + Sync + std::fmt::Debug {
    /// Settles (the reservation becomes `tokens` and `cost_nanos`) and releases the slot,
    /// in one backend operation. Idempotent on the backend: only the first one counts.
    async fn finish(&self, tokens: u64, cost_nanos: u64) -> Result<(), GovernanceError>;
    /// Non-blocking [`KeyPermitBackend::finish`] (from `Drop`, or when awaiting is not
    /// possible or the backend failed).
    fn finish_on_drop(&self, tokens: u64, cost_nanos: u64);
}

/// A key admission. [`KeyPermit::finish`] it when the call ends; dropped unfinished it
/// settles at its reservation (`est_tokens`, `reserve_nanos`).
#[derive(Debug)]
pub struct KeyPermit {
    backend: Box<dyn KeyPermitBackend>,
    est_tokens: u64,
    reserve_nanos: u64,
    finished: bool,
}

impl KeyPermit {
    /// A permit over a backend handle, holding the given reservations.
    pub fn new(est_tokens: u64, reserve_nanos: u64, backend: Box<dyn KeyPermitBackend>) -> Self {
        KeyPermit {
            backend,
            est_tokens,
            reserve_nanos,
            finished: false,
        }
    }

    /// The tokens reserved.
    pub fn est_tokens(&self) -> u64 {
        self.est_tokens
    }

    /// The money reserved, nanos.
    pub fn reserve_nanos(&self) -> u64 {
        self.reserve_nanos
    }

    /// Whether `finish` has completed.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Settles the call — its reservations become `tokens` (all its attempts) and
    /// `cost_nanos` — and frees its slot. Idempotent: only the first call counts. On an
    /// error nothing is marked: call [`KeyPermit::finish_in_background`] (or drop it,
    /// which settles at the reservation).
    pub async fn finish(&mut self, tokens: u64, cost_nanos: u64) -> Result<(), GovernanceError> {
        if self.finished {
            return Ok(());
        }
        self.backend.finish(tokens, cost_nanos).await?;
        self.finished = true;
        Ok(())
    }

    /// Hands the settlement to the backend's non-blocking path now.
    pub fn finish_in_background(mut self, tokens: u64, cost_nanos: u64) {
        if !self.finished {
            self.backend.finish_on_drop(tokens, cost_nanos);
        }
        self.finished = true;
    }
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        if !self.finished {
            self.backend
                .finish_on_drop(self.est_tokens, self.reserve_nanos);
        }
    }
}

/// The permit of a key admitted by a limiter that governs nothing
/// ([`super::UnlimitedLimiter`]).
#[derive(Debug)]
pub(crate) struct NoopKeyPermit;

#[async_trait]
impl KeyPermitBackend for NoopKeyPermit {
    async fn finish(&self, _tokens: u64, _cost_nanos: u64) -> Result<(), GovernanceError> {
        Ok(())
    }
    fn finish_on_drop(&self, _tokens: u64, _cost_nanos: u64) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::block_on;
    use std::sync::{Arc, Mutex};

    #[derive(Debug, Default)]
    struct Log(Mutex<Vec<String>>);

    #[derive(Debug)]
    struct Rec(Arc<Log>);

    #[async_trait]
    impl KeyPermitBackend for Rec {
        async fn finish(&self, tokens: u64, cost: u64) -> Result<(), GovernanceError> {
            self.0
                 .0
                .lock()
                .unwrap()
                .push(format!("finish {tokens} {cost}"));
            Ok(())
        }
        fn finish_on_drop(&self, tokens: u64, cost: u64) {
            self.0
                 .0
                .lock()
                .unwrap()
                .push(format!("drop {tokens} {cost}"));
        }
    }

    #[test]
    fn finish_is_idempotent_and_drop_settles_the_reservation() {
        let log = Arc::new(Log::default());
        let mut p = KeyPermit::new(100, 7_000, Box::new(Rec(log.clone())));
        assert_eq!((p.est_tokens(), p.reserve_nanos()), (100, 7_000));
        block_on(p.finish(40, 2_500)).unwrap();
        block_on(p.finish(90, 9_000)).unwrap();
        assert!(p.is_finished());
        drop(p);
        drop(KeyPermit::new(100, 7_000, Box::new(Rec(log.clone()))));
        KeyPermit::new(5, 6, Box::new(Rec(log.clone()))).finish_in_background(1, 2);
        assert_eq!(
            *log.0.lock().unwrap(),
            ["finish 40 2500", "drop 100 7000", "drop 1 2"]
        );
    }

    #[test]
    fn a_failed_finish_leaves_the_permit_to_settle_on_drop() {
        let mut b = MockKeyPermitBackend::new();
        b.expect_finish()
            .times(1)
            .returning(|_, _| Err(GovernanceError::new("redis", "down")));
        b.expect_finish_on_drop()
            .withf(|t, c| (*t, *c) == (10, 20))
            .times(1)
            .return_const(());
        let mut p = KeyPermit::new(10, 20, Box::new(b));
        assert!(block_on(p.finish(1, 1)).is_err());
        assert!(!p.is_finished());
    }
}
