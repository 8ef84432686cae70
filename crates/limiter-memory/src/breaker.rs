//! [`MemoryBreakerStore`]: core's breaker state machine per (scope, source), in-process,
//! with half-open probes renewed by the granting handle's heartbeat.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::breaker::{BreakerAdmit, BreakerOutcome, BreakerState};
use polygw_core::error::GovernanceError;
use polygw_core::ports::{BreakerStore, Clock};
use polygw_core::settings::BreakerSettings;

use crate::{lock, Heart, Store};

type Key = (String, String);

/// Breaker states by scope, then source: looked up with borrowed names, so an admission
/// or a record allocates nothing once its source has a state.
type ByScope = HashMap<String, HashMap<String, BreakerState>>;

fn get_mut<'a>(states: &'a mut ByScope, scope: &str, source: &str) -> Option<&'a mut BreakerState> {
    states.get_mut(scope)?.get_mut(source)
}

fn get_or_default<'a>(states: &'a mut ByScope, scope: &str, source: &str) -> &'a mut BreakerState {
    if !states.contains_key(scope) {
        states.insert(scope.to_string(), HashMap::new());
    }
    let by_source = states.get_mut(scope).expect("inserted above");
    if !by_source.contains_key(source) {
        by_source.insert(source.to_string(), BreakerState::default());
    }
    by_source.get_mut(source).expect("inserted above")
}

/// The breaker states of a store and the live probes.
#[derive(Default)]
pub(crate) struct States {
    states: ByScope,
    /// Live probes: (source, epoch) → (the granting handle's heartbeat, lease ms).
    probes: HashMap<(Key, u64), (Arc<Heart>, u64)>,
    last_renew_ms: u64,
    renew_every_ms: Option<u64>,
}

impl States {
    /// Whether a probe lease is held (the store's ticker keeps running).
    pub(crate) fn holds_leases(&self) -> bool {
        !self.probes.is_empty()
    }

    /// How often the held probes are renewed.
    pub(crate) fn renew_every_ms(&self) -> Option<u64> {
        self.renew_every_ms
    }

    pub(crate) fn at(&mut self, now: u64) -> u64 {
        if let Some(every) = self.renew_every_ms {
            if now >= self.last_renew_ms.saturating_add(every) {
                let states = &mut self.states;
                self.probes.retain(|(key, epoch), (heart, lease)| {
                    let Some(st) = get_mut(states, &key.0, &key.1) else {
                        return false;
                    };
                    if heart.beats() {
                        st.renew_probe(now, *epoch, *lease);
                    }
                    // Forget probes that are over (recorded elsewhere, or their lease ended).
                    st.epoch == *epoch && st.probe_until > now
                });
                self.last_renew_ms = now;
            }
        }
        now
    }
}

/// In-process [`BreakerStore`] running [`BreakerState`] as is (SPEC §4.4, §14.7).
/// Timestamps in [`BreakerStore::state`] are milliseconds since the store was created.
/// Cheap to clone; clones share the state and the heartbeat.
#[derive(Clone)]
pub struct MemoryBreakerStore {
    store: Arc<Store>,
    heart: Arc<Heart>,
}

impl fmt::Debug for MemoryBreakerStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBreakerStore").finish_non_exhaustive()
    }
}

impl MemoryBreakerStore {
    /// A store with a state of its own on `clock`. (The facade shares one state per
    /// scope: [`crate::shared`].)
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self::over(Store::new(clock), Arc::new(Heart::default()))
    }

    pub(crate) fn over(store: Arc<Store>, heart: Arc<Heart>) -> Self {
        MemoryBreakerStore { store, heart }
    }

    /// Another handle on the same state, with a heartbeat of its own.
    pub fn client(&self) -> Self {
        Self::over(self.store.clone(), Arc::new(Heart::default()))
    }

    /// Stops renewing the probes this handle granted (a crashed process): they end with
    /// their leases unless recorded or released first.
    pub fn stop_heartbeat(&self) {
        self.heart.stop();
    }

    fn with<T>(&self, f: impl FnOnce(&mut States, u64) -> T) -> T {
        let mut st = lock(&self.store.breakers);
        let now = self.store.now_ms();
        let now = st.at(now);
        f(&mut st, now)
    }
}

fn key(scope: &str, source: &str) -> Key {
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
        let lease_ms = u64::try_from(probe_lease.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let a = self.with(|st, now| {
            // A source that never failed needs no entry: its default state always admits.
            let Some(state) = get_mut(&mut st.states, scope, source) else {
                return BreakerState::default().admit(now, lease_ms);
            };
            let a = state.admit(now, lease_ms);
            if let BreakerAdmit::Allowed { probe: true, epoch } = a {
                st.probes
                    .insert((key(scope, source), epoch), (self.heart.clone(), lease_ms));
                let third = (lease_ms / 3).max(1);
                st.renew_every_ms = Some(st.renew_every_ms.map_or(third, |e| e.min(third)));
            }
            a
        });
        if let BreakerAdmit::Allowed { probe: true, .. } = a {
            crate::ensure_ticker(&self.store);
        }
        Ok(a)
    }

    async fn record(
        &self,
        scope: &str,
        source: &str,
        outcome: BreakerOutcome,
        epoch: u64,
        probe: bool,
        settings: &BreakerSettings,
    ) -> Result<(), GovernanceError> {
        self.with(|st, now| {
            if probe {
                st.probes.remove(&(key(scope, source), epoch));
            }
            get_or_default(&mut st.states, scope, source)
                .record(now, outcome, epoch, probe, settings);
        });
        Ok(())
    }

    fn release_probe(&self, scope: &str, source: &str, epoch: u64) {
        self.with(|st, now| {
            st.probes.remove(&(key(scope, source), epoch));
            if let Some(state) = get_mut(&mut st.states, scope, source) {
                state.record(
                    now,
                    BreakerOutcome::Neutral,
                    epoch,
                    true,
                    &BreakerSettings::default(),
                );
            }
        });
    }

    async fn state(&self, scope: &str, source: &str) -> Result<BreakerState, GovernanceError> {
        Ok(self.with(|st, _| {
            get_mut(&mut st.states, scope, source)
                .copied()
                .unwrap_or_default()
        }))
    }

    async fn clock_ms(&self) -> Result<u64, GovernanceError> {
        Ok(self.with(|_, now| now))
    }

    async fn reset(&self, scope: &str, source: &str) -> Result<(), GovernanceError> {
        self.with(|st, _| {
            // The probe of the epoch that ends is no longer renewed.
            st.probes.retain(|(k, _), _| k.0 != scope || k.1 != source);
            get_or_default(&mut st.states, scope, source).reset();
        });
        Ok(())
    }

    async fn set_drained(
        &self,
        scope: &str,
        source: &str,
        drained: bool,
    ) -> Result<(), GovernanceError> {
        self.with(|st, _| get_or_default(&mut st.states, scope, source).drained = drained);
        Ok(())
    }
}
