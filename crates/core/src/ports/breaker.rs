//! The `BreakerStore` port: breaker, cooldown and dead-source state per source, shared
//! through the same backend as the limiter (SPEC §4.4, §14.7). Semantics:
//! [`crate::breaker`].
//!
//! An admission returns the breaker epoch it was made under; the outcome is recorded with
//! it. A half-open probe is a lease the store renews while it is held (its heartbeat,
//! SPEC §14.4) and that ends when its outcome is recorded or [`BreakerStore::release_probe`]
//! frees it — the non-blocking path for drop-time code.

use std::time::Duration;

use async_trait::async_trait;

use crate::breaker::{BreakerAdmit, BreakerOutcome, BreakerState};
use crate::error::GovernanceError;
use crate::settings::BreakerSettings;

/// Stores and applies [`BreakerState`] atomically per source.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait BreakerStore: Send + Sync + std::fmt::Debug {
    /// May the source be tried now? Grants the half-open probe: a lease of `probe_lease`,
    /// renewed by the store until its outcome is recorded or it is released. If this
    /// future is dropped before it answers, a probe it may have been granted is freed.
    async fn admit(
        &self,
        scope: &str,
        source: &str,
        probe_lease: Duration,
    ) -> Result<BreakerAdmit, GovernanceError>;

    /// Records how an attempt admitted under `epoch` ended (`probe`: it was the
    /// half-open probe; its lease ends here, whether or not the record lands).
    async fn record(
        &self,
        scope: &str,
        source: &str,
        outcome: BreakerOutcome,
        epoch: u64,
        probe: bool,
        settings: &BreakerSettings,
    ) -> Result<(), GovernanceError>;

    /// Frees the half-open probe admitted under `epoch` without an outcome (a neutral
    /// record), without blocking: for `Drop` and other paths that cannot await.
    fn release_probe(&self, scope: &str, source: &str, epoch: u64);

    /// The current state (tests, metrics, `polygw serve` health).
    async fn state(&self, scope: &str, source: &str) -> Result<BreakerState, GovernanceError>;

    /// The store's clock, in the unit of [`BreakerState`]'s times (ms; the memory store
    /// counts from its start, Redis reads its server's `TIME`): an operator's view says
    /// how long a source stays open, dead or cooling down.
    async fn clock_ms(&self) -> Result<u64, GovernanceError>;

    /// An operator's reset ([`BreakerState::reset`]): the breaker closes at once, for
    /// every process sharing the store.
    async fn reset(&self, scope: &str, source: &str) -> Result<(), GovernanceError>;

    /// Takes the source out (`drained`: every admission refuses it as `drained`) or
    /// brings it back, for every process sharing the store, until said otherwise.
    async fn set_drained(
        &self,
        scope: &str,
        source: &str,
        drained: bool,
    ) -> Result<(), GovernanceError>;

    /// Waits for background work (queued probe releases). Called on shutdown.
    async fn flush(&self) -> Result<(), GovernanceError> {
        Ok(())
    }
}

/// A breaker store that always allows and remembers nothing (governance off; tests).
#[derive(Debug, Clone, Copy, Default)]
pub struct NullBreakerStore;

#[async_trait]
impl BreakerStore for NullBreakerStore {
    async fn admit(
        &self,
        _scope: &str,
        _source: &str,
        _probe_lease: Duration,
    ) -> Result<BreakerAdmit, GovernanceError> {
        Ok(BreakerAdmit::Allowed {
            probe: false,
            epoch: 0,
        })
    }
    async fn record(
        &self,
        _scope: &str,
        _source: &str,
        _outcome: BreakerOutcome,
        _epoch: u64,
        _probe: bool,
        _settings: &BreakerSettings,
    ) -> Result<(), GovernanceError> {
        Ok(())
    }
    fn release_probe(&self, _scope: &str, _source: &str, _epoch: u64) {}
    async fn state(&self, _scope: &str, _source: &str) -> Result<BreakerState, GovernanceError> {
        Ok(BreakerState::default())
    }
    async fn clock_ms(&self) -> Result<u64, GovernanceError> {
        Ok(0)
    }
    async fn reset(&self, _scope: &str, _source: &str) -> Result<(), GovernanceError> {
        Ok(())
    }
    async fn set_drained(
        &self,
        _scope: &str,
        _source: &str,
        _drained: bool,
    ) -> Result<(), GovernanceError> {
        Err(GovernanceError::new(
            "null",
            "this client keeps no breaker state: a source cannot be drained",
        ))
    }
}
