//! The `RateLimiter` port and the [`Permit`] it grants (SPEC §4.2).
//!
//! A permit is settled (`settle(tokens)`) and released (`release()`), both idempotent.
//! Dropped without settlement (cancellation) it settles its reservation and releases
//! through [`PermitBackend::settle_on_drop`], which must not block.
//!
//! A permit's slot and reservation are a lease (`AcquireRequest::lease`) that the backend
//! renews while the permit is alive — its heartbeat (SPEC §14.4): a long call never loses
//! its slot, and a crashed process's slots and reservations end within one lease.

use std::time::Duration;

use async_trait::async_trait;

use crate::error::{GovernanceError, RefusalReason};
use crate::ports::keys::{KeyAcquire, KeyAdmission, KeyPermit, KeyUsage, NoopKeyPermit};

/// What one acquire asks for: the source's limits and the scope's, checked atomically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcquireRequest<'a> {
    /// Scope name (key namespace).
    pub scope: &'a str,
    /// Source name.
    pub source: &'a str,
    /// Source RPM (0 = unlimited).
    pub rpm: u32,
    /// Source TPM (0 = unlimited).
    pub tpm: u64,
    /// Source in-flight cap (0 = unlimited).
    pub max_concurrency: u32,
    /// Scope RPM (0 = unlimited).
    pub scope_rpm: u32,
    /// Scope TPM (0 = unlimited).
    pub scope_tpm: u64,
    /// Tokens to reserve (`effective_est_tokens()`).
    pub est_tokens: u64,
    /// The lease of the in-flight slot and the reservation: renewed by the backend while
    /// the permit is alive, it ends this long after its holder stopped (crash safety).
    pub lease: Duration,
}

/// A refusal with its hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Why.
    pub reason: RefusalReason,
    /// When the refusal could pass, when known (quota windows, cooldowns, open breakers).
    pub retry_after: Option<Duration>,
}

/// Result of an acquire.
#[derive(Debug)]
pub enum Admission {
    /// Admitted: settle and release the permit when the attempt ends.
    Admitted(Permit),
    /// Refused, with a hint.
    Refused(Refusal),
}

/// Enforces RPM, TPM and concurrency per source and per scope.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait RateLimiter: Send + Sync + std::fmt::Debug {
    /// Tries to admit one request; never waits for capacity. (The request's lifetime
    /// is named rather than elided so that mockall can mock the port: implementations
    /// write the same signature.)
    async fn acquire<'r>(&self, req: &AcquireRequest<'r>) -> Result<Admission, GovernanceError>;

    /// Current in-flight count of a source (tests, metrics).
    async fn in_flight(&self, scope: &str, source: &str) -> Result<u32, GovernanceError>;

    /// Tries to admit one client call under its key's limits and budgets (SPEC §21.1;
    /// see [`crate::ports::keys`]); never waits. One atomic operation in the key's own
    /// state, separate from the sources' and scopes' (on Redis: one script in the key's
    /// hash slot), run once per client call before its first source admission.
    ///
    /// The default fails closed — a limiter that does not govern keys admits no key
    /// blindly. Every backend implements it (memory, Redis, [`UnlimitedLimiter`]);
    /// wrappers must delegate it.
    async fn acquire_key<'r>(&self, req: &KeyAcquire<'r>) -> Result<KeyAdmission, GovernanceError> {
        Err(keys_unsupported(req.key_id))
    }

    /// A key's figures now (in flight, window, spend of the day and month). The default
    /// fails like [`RateLimiter::acquire_key`]'s.
    async fn key_usage(&self, key_id: &str) -> Result<KeyUsage, GovernanceError> {
        Err(keys_unsupported(key_id))
    }

    /// Restores a key's spend settled earlier in the current UTC day and month, for a
    /// backend whose state does not outlive its process (SPEC §24.2: a memory backend's
    /// spend survives a restart, seeded from telemetry; [`crate::key_quota::restored_spend`]).
    /// Settled spend only grows: restoring what is already counted changes nothing.
    /// Returns whether the backend took it; the default (a shared backend such as Redis,
    /// whose spend persists) takes nothing.
    async fn restore_key_spend(
        &self,
        _key_id: &str,
        _day_nanos: u64,
        _month_nanos: u64,
    ) -> Result<bool, GovernanceError> {
        Ok(false)
    }

    /// Whether the backend answers for `scope` now (readiness, SPEC §21.2): one cheap
    /// round trip to where the scope's state lives (on a Redis Cluster, the node that
    /// holds the scope's slot), bounded by the backend's operation timeout. An
    /// in-process backend is always reachable: the default is `Ok`.
    async fn ping(&self, scope: &str) -> Result<(), GovernanceError> {
        let _ = scope;
        Ok(())
    }

    /// Flushes background work (drop-time settlements). Called on shutdown.
    async fn flush(&self) -> Result<(), GovernanceError> {
        Ok(())
    }

    /// Settlements and releases this limiter could not queue since it was created (its
    /// bounded queue was full): their slots and reservations end with their leases.
    /// Exposed in `/metrics`; 0 for backends that apply them directly.
    fn settlements_dropped(&self) -> u64 {
        0
    }
}

fn keys_unsupported(key_id: &str) -> GovernanceError {
    GovernanceError::new(
        "limiter",
        format!("this limiter does not govern client keys (key {key_id:?}): refused"),
    )
}

/// The backend side of a permit.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait PermitBackend: Send + Sync + std::fmt::Debug {
    /// Replaces the reservation by `tokens`.
    async fn settle(&self, tokens: u64) -> Result<(), GovernanceError>;
    /// Frees the in-flight slot.
    async fn release(&self) -> Result<(), GovernanceError>;
    /// Both, in one backend operation where possible.
    async fn settle_and_release(&self, tokens: u64) -> Result<(), GovernanceError> {
        self.settle(tokens).await?;
        self.release().await
    }
    /// Non-blocking: settle `tokens` (if `Some`) and release. Used from `Drop`.
    fn settle_on_drop(&self, tokens: Option<u64>);
}

/// An admission. Settle then release (or [`Permit::finish`]); dropping it unsettled
/// settles its reservation (`est`) and releases — the tokens may have been billed.
#[derive(Debug)]
pub struct Permit {
    backend: Box<dyn PermitBackend>,
    est: u64,
    settled: bool,
    released: bool,
}

impl Permit {
    /// A permit over a backend handle, holding a reservation of `est` tokens.
    pub fn new(est: u64, backend: Box<dyn PermitBackend>) -> Self {
        Permit {
            backend,
            est,
            settled: false,
            released: false,
        }
    }

    /// The reservation.
    pub fn est_tokens(&self) -> u64 {
        self.est
    }

    /// Whether `settle` has completed.
    pub fn is_settled(&self) -> bool {
        self.settled
    }

    /// Whether `release` has completed.
    pub fn is_released(&self) -> bool {
        self.released
    }

    /// Replaces the reservation by `tokens`. Idempotent: only the first call counts.
    pub async fn settle(&mut self, tokens: u64) -> Result<(), GovernanceError> {
        if self.settled {
            return Ok(());
        }
        self.backend.settle(tokens).await?;
        self.settled = true;
        Ok(())
    }

    /// Frees the in-flight slot. Idempotent.
    pub async fn release(&mut self) -> Result<(), GovernanceError> {
        if self.released {
            return Ok(());
        }
        self.backend.release().await?;
        self.released = true;
        Ok(())
    }

    /// Settles and releases (one backend operation where possible). Idempotent.
    pub async fn finish(&mut self, tokens: u64) -> Result<(), GovernanceError> {
        match (self.settled, self.released) {
            (true, true) => Ok(()),
            (true, false) => self.release().await,
            (false, _) => {
                self.backend.settle_and_release(tokens).await?;
                self.settled = true;
                self.released = true;
                Ok(())
            }
        }
    }

    /// Hands settlement to the backend's non-blocking path now (used when awaiting
    /// is not possible or the backend failed): settles `tokens` and releases.
    pub fn finish_in_background(mut self, tokens: u64) {
        if !self.settled {
            self.backend.settle_on_drop(Some(tokens));
        } else if !self.released {
            self.backend.settle_on_drop(None);
        }
        self.settled = true;
        self.released = true;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.settled {
            self.backend.settle_on_drop(Some(self.est));
        } else if !self.released {
            self.backend.settle_on_drop(None);
        }
    }
}

/// A limiter that admits everything (governance off; tests).
#[derive(Debug, Clone, Copy, Default)]
pub struct UnlimitedLimiter;

#[derive(Debug)]
struct NoopPermit;

#[async_trait]
impl PermitBackend for NoopPermit {
    async fn settle(&self, _tokens: u64) -> Result<(), GovernanceError> {
        Ok(())
    }
    async fn release(&self) -> Result<(), GovernanceError> {
        Ok(())
    }
    fn settle_on_drop(&self, _tokens: Option<u64>) {}
}

#[async_trait]
impl RateLimiter for UnlimitedLimiter {
    async fn acquire<'r>(&self, req: &AcquireRequest<'r>) -> Result<Admission, GovernanceError> {
        Ok(Admission::Admitted(Permit::new(
            req.est_tokens,
            Box::new(NoopPermit),
        )))
    }
    async fn in_flight(&self, _scope: &str, _source: &str) -> Result<u32, GovernanceError> {
        Ok(0)
    }
    async fn acquire_key<'r>(&self, req: &KeyAcquire<'r>) -> Result<KeyAdmission, GovernanceError> {
        Ok(KeyAdmission::Admitted(KeyPermit::new(
            req.est_tokens,
            req.reserve_nanos,
            Box::new(NoopKeyPermit),
        )))
    }
    async fn key_usage(&self, _key_id: &str) -> Result<KeyUsage, GovernanceError> {
        Ok(KeyUsage::default())
    }
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
    impl PermitBackend for Rec {
        async fn settle(&self, tokens: u64) -> Result<(), GovernanceError> {
            self.0 .0.lock().unwrap().push(format!("settle {tokens}"));
            Ok(())
        }
        async fn release(&self) -> Result<(), GovernanceError> {
            self.0 .0.lock().unwrap().push("release".into());
            Ok(())
        }
        fn settle_on_drop(&self, tokens: Option<u64>) {
            self.0 .0.lock().unwrap().push(format!("drop {tokens:?}"));
        }
    }

    #[test]
    fn settle_and_release_are_idempotent() {
        let log = Arc::new(Log::default());
        let mut p = Permit::new(10, Box::new(Rec(log.clone())));
        block_on(p.settle(5)).unwrap();
        block_on(p.settle(7)).unwrap();
        block_on(p.release()).unwrap();
        block_on(p.release()).unwrap();
        drop(p);
        assert_eq!(*log.0.lock().unwrap(), ["settle 5", "release"]);
    }

    #[test]
    fn drop_unsettled_settles_est() {
        let log = Arc::new(Log::default());
        drop(Permit::new(10, Box::new(Rec(log.clone()))));
        let mut p = Permit::new(10, Box::new(Rec(log.clone())));
        block_on(p.settle(3)).unwrap();
        drop(p);
        assert_eq!(
            *log.0.lock().unwrap(),
            ["drop Some(10)", "settle 3", "drop None"]
        );
    }

    /// A limiter that does not implement key governance refuses to admit keys (fails
    /// closed); the unlimited limiter admits them.
    #[test]
    fn key_admission_fails_closed_unless_implemented() {
        #[derive(Debug)]
        struct Bare;
        #[async_trait]
        impl RateLimiter for Bare {
            async fn acquire<'r>(
                &self,
                _req: &AcquireRequest<'r>,
            ) -> Result<Admission, GovernanceError> {
                unreachable!()
            }
            async fn in_flight(&self, _: &str, _: &str) -> Result<u32, GovernanceError> {
                Ok(0)
            }
        }
        let req = KeyAcquire {
            key_id: "k1",
            rpm: 1,
            tpm: 0,
            max_concurrency: 0,
            budget_day_nanos: None,
            budget_month_nanos: None,
            est_tokens: 3,
            reserve_nanos: 4,
            lease: std::time::Duration::from_secs(1),
            top_up: false,
        };
        let e = block_on(Bare.acquire_key(&req)).unwrap_err();
        assert!(e.message.contains("does not govern client keys"), "{e}");
        assert!(block_on(Bare.key_usage("k1")).is_err());
        match block_on(UnlimitedLimiter.acquire_key(&req)).unwrap() {
            KeyAdmission::Admitted(p) => assert_eq!((p.est_tokens(), p.reserve_nanos()), (3, 4)),
            KeyAdmission::Refused(r) => panic!("{r:?}"),
        }
    }

    #[test]
    fn finish_is_one_operation_and_idempotent() {
        let log = Arc::new(Log::default());
        let mut p = Permit::new(10, Box::new(Rec(log.clone())));
        block_on(p.finish(4)).unwrap();
        block_on(p.finish(9)).unwrap();
        drop(p);
        assert_eq!(*log.0.lock().unwrap(), ["settle 4", "release"]);
    }
}
