//! The `BreakerStore` port: breaker, cooldown and dead-source state per source, shared
//! through the same backend as the limiter (SPEC §4.4). Semantics: [`crate::breaker`].

use std::time::Duration;

use async_trait::async_trait;

use crate::breaker::{BreakerAdmit, BreakerOutcome, BreakerState};
use crate::error::GovernanceError;
use crate::settings::BreakerSettings;

/// Stores and applies [`BreakerState`] atomically per source.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait BreakerStore: Send + Sync + std::fmt::Debug {
    /// May the source be tried now? Grants the half-open probe (held for `probe_lease`
    /// unless its outcome is recorded first).
    async fn admit(
        &self,
        scope: &str,
        source: &str,
        probe_lease: Duration,
    ) -> Result<BreakerAdmit, GovernanceError>;

    /// Records how an attempt ended (`probe`: it was the half-open probe).
    async fn record(
        &self,
        scope: &str,
        source: &str,
        outcome: BreakerOutcome,
        probe: bool,
        settings: &BreakerSettings,
    ) -> Result<(), GovernanceError>;

    /// The current state (tests, metrics, `polygw serve` health).
    async fn state(&self, scope: &str, source: &str) -> Result<BreakerState, GovernanceError>;
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
        Ok(BreakerAdmit::Allowed { probe: false })
    }
    async fn record(
        &self,
        _scope: &str,
        _source: &str,
        _outcome: BreakerOutcome,
        _probe: bool,
        _settings: &BreakerSettings,
    ) -> Result<(), GovernanceError> {
        Ok(())
    }
    async fn state(&self, _scope: &str, _source: &str) -> Result<BreakerState, GovernanceError> {
        Ok(BreakerState::default())
    }
}
