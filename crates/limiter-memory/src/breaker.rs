//! [`MemoryBreakerStore`]: core's breaker state machine per (scope, source), in-process.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use polygw_core::breaker::{BreakerAdmit, BreakerOutcome, BreakerState};
use polygw_core::error::GovernanceError;
use polygw_core::ports::{BreakerStore, Clock};
use polygw_core::settings::BreakerSettings;

use crate::{elapsed_ms, lock};

/// In-process [`BreakerStore`] running [`BreakerState`] as is (SPEC §4.4). Timestamps in
/// [`BreakerStore::state`] are milliseconds since the store was created. Cheap to clone.
#[derive(Clone)]
pub struct MemoryBreakerStore {
    inner: Arc<Inner>,
}

struct Inner {
    clock: Arc<dyn Clock>,
    base: Instant,
    states: Mutex<HashMap<(String, String), BreakerState>>,
}

impl fmt::Debug for MemoryBreakerStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBreakerStore").finish_non_exhaustive()
    }
}

impl MemoryBreakerStore {
    /// A store on `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        let base = clock.now();
        MemoryBreakerStore {
            inner: Arc::new(Inner {
                clock,
                base,
                states: Mutex::new(HashMap::new()),
            }),
        }
    }

    fn now_ms(&self) -> u64 {
        elapsed_ms(self.inner.clock.as_ref(), self.inner.base)
    }
}

fn key(scope: &str, source: &str) -> (String, String) {
    (scope.to_string(), source.to_string())
}

#[async_trait]
impl BreakerStore for MemoryBreakerStore {
    async fn admit(
        &self,
        scope: &str,
        source: &str,
        probe_lease: Duration,
    ) -> Result<BreakerAdmit, GovernanceError> {
        let now = self.now_ms();
        let lease_ms = u64::try_from(probe_lease.as_millis()).unwrap_or(u64::MAX);
        let mut states = lock(&self.inner.states);
        // A source that never failed needs no entry: its default state always admits.
        match states.get_mut(&key(scope, source)) {
            Some(st) => Ok(st.admit(now, lease_ms)),
            None => Ok(BreakerState::default().admit(now, lease_ms)),
        }
    }

    async fn record(
        &self,
        scope: &str,
        source: &str,
        outcome: BreakerOutcome,
        probe: bool,
        settings: &BreakerSettings,
    ) -> Result<(), GovernanceError> {
        let now = self.now_ms();
        let mut states = lock(&self.inner.states);
        let st = states.entry(key(scope, source)).or_default();
        st.record(now, outcome, probe, settings);
        Ok(())
    }

    async fn state(&self, scope: &str, source: &str) -> Result<BreakerState, GovernanceError> {
        Ok(lock(&self.inner.states)
            .get(&key(scope, source))
            .copied()
            .unwrap_or_default())
    }
}
