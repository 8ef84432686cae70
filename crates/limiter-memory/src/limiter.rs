//! [`MemoryLimiter`]: core's reference limiter model under a mutex, with permits whose
//! drop-time settlement applies directly (it is in-process, so it never blocks for long)
//! and whose leases the handle's heartbeat renews.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::error::GovernanceError;
use polygw_core::ports::{
    AcquireRequest, Admission, Clock, KeyAcquire, KeyAdmission, KeyUsage, Permit, PermitBackend,
    RateLimiter,
};
use polygw_core::window::{IdMap, WindowLimiter, WINDOW_MS};

use crate::keys::KeyStore;
use crate::{lock, Heart, Store};

/// Clock time between two compactions of the model's permit table. Nothing can be
/// forgotten before its entry leaves the window, so compacting by time alone bounds the
/// table to the acquires of the last 75 s (plus live leases) while costing O(entries)
/// only every 15 s.
const COMPACT_EVERY_MS: u64 = WINDOW_MS / 4;

/// The limiter state of a store: the model and the live leases.
#[derive(Default)]
pub(crate) struct State {
    model: WindowLimiter,
    last_compact_ms: u64,
    /// Live permits: id → (the heartbeat of the handle that granted it, lease).
    leases: IdMap<(Arc<Heart>, Duration)>,
    last_renew_ms: u64,
    /// A third of the shortest lease registered so far.
    renew_every_ms: Option<u64>,
}

impl State {
    /// Whether a lease is held (the store's ticker keeps running).
    pub(crate) fn holds_leases(&self) -> bool {
        !self.leases.is_empty()
    }

    /// How often the held leases are renewed.
    pub(crate) fn renew_every_ms(&self) -> Option<u64> {
        self.renew_every_ms
    }

    /// Brings the model to `now`: renews the leases whose handle's heartbeat beats (if a
    /// third of the shortest lease has passed since the last renewal), compacts now and
    /// then. Every operation calls it first, under the lock, with a time read under it;
    /// the store's ticker calls it while leases are held and nothing else happens.
    pub(crate) fn at(&mut self, now: u64) -> u64 {
        if let Some(every) = self.renew_every_ms {
            if now >= self.last_renew_ms.saturating_add(every) {
                for (id, (heart, lease)) in &self.leases {
                    if heart.beats() {
                        self.model.renew(now, *id, *lease);
                    }
                }
                self.last_renew_ms = now;
            }
        }
        if now.saturating_sub(self.last_compact_ms) >= COMPACT_EVERY_MS {
            self.model.compact(now);
            let model = &mut self.model;
            self.leases.retain(|id, _| model.holds(now, *id));
            self.last_compact_ms = now;
        }
        now
    }
}

/// In-process [`RateLimiter`]: RPM, TPM (reserve then settle) and concurrency per source,
/// scope-wide RPM/TPM atomically with them (SPEC §4.2, §14.3), and client keys' limits and
/// budgets (SPEC §21.1, `crate::keys`). Cheap to clone; clones share the state and the
/// heartbeat ([`MemoryLimiter::client`] makes another handle on the same state with a
/// heartbeat of its own).
#[derive(Clone)]
pub struct MemoryLimiter {
    store: Arc<Store>,
    /// Client keys: one state per process and clock, whatever the scope.
    keys: Arc<KeyStore>,
    heart: Arc<Heart>,
}

impl fmt::Debug for MemoryLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLimiter").finish_non_exhaustive()
    }
}

impl MemoryLimiter {
    /// A limiter with a state of its own on `clock` (client keys included); its windows
    /// start at the clock's current reading. (The facade shares one state per scope, and
    /// one key state per process: [`crate::shared`].)
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        let keys = KeyStore::new(clock.clone());
        Self::over(Store::new(clock), keys, Arc::new(Heart::default()))
    }

    pub(crate) fn over(store: Arc<Store>, keys: Arc<KeyStore>, heart: Arc<Heart>) -> Self {
        MemoryLimiter { store, keys, heart }
    }

    /// Another handle on the same state, with a heartbeat of its own (another client of
    /// the scope, as another process would be on a shared backend).
    pub fn client(&self) -> Self {
        Self::over(
            self.store.clone(),
            self.keys.clone(),
            Arc::new(Heart::default()),
        )
    }

    /// Stops renewing the leases of the permits this handle (and its clones) granted:
    /// what a crashed process looks like. Their slots and reservations end with their
    /// leases unless released or settled first.
    pub fn stop_heartbeat(&self) {
        self.heart.stop();
    }

    #[cfg(test)]
    pub(crate) fn same_store(&self, other: &MemoryLimiter) -> bool {
        Arc::ptr_eq(&self.store, &other.store)
    }

    /// The id of the store's lease ticker while one is registered.
    #[cfg(test)]
    pub(crate) fn ticker_id(&self) -> Option<tokio::task::Id> {
        lock(&self.store.ticker).as_ref().map(|h| h.id())
    }

    #[cfg(test)]
    pub(crate) fn same_keys(&self, other: &MemoryLimiter) -> bool {
        Arc::ptr_eq(&self.keys, &other.keys)
    }

    fn with<T>(&self, f: impl FnOnce(&mut State, u64) -> T) -> T {
        let mut st = lock(&self.store.limiter);
        let now = self.store.now_ms();
        let now = st.at(now);
        f(&mut st, now)
    }

    /// `(requests, tokens)` in a source's rolling window now (tests, metrics).
    pub fn source_window(&self, scope: &str, source: &str) -> (u64, u64) {
        self.with(|st, now| st.model.source_window(now, scope, source))
    }

    /// `(requests, tokens)` in a scope's rolling window now (tests, metrics).
    pub fn scope_window(&self, scope: &str) -> (u64, u64) {
        self.with(|st, now| st.model.scope_window(now, scope))
    }

    /// Drops every entry that left its window and every finished permit now (it also
    /// happens on its own on the first operation after every 15 s of clock time).
    pub fn compact(&self) {
        self.with(|st, now| {
            st.model.compact(now);
            let model = &mut st.model;
            st.leases.retain(|id, _| model.holds(now, *id));
            st.last_compact_ms = now;
        })
    }
}

#[async_trait]
impl RateLimiter for MemoryLimiter {
    async fn acquire<'r>(&self, req: &AcquireRequest<'r>) -> Result<Admission, GovernanceError> {
        let admitted = self.with(|st, now| {
            let r = st.model.acquire(now, req);
            if let Ok(id) = r {
                st.leases.insert(id, (self.heart.clone(), req.lease));
                let third = u64::try_from(req.lease.as_millis() / 3)
                    .unwrap_or(u64::MAX)
                    .max(1);
                st.renew_every_ms = Some(st.renew_every_ms.map_or(third, |e| e.min(third)));
            }
            r
        });
        Ok(match admitted {
            Ok(id) => Admission::Admitted({
                crate::ensure_ticker(&self.store);
                Permit::new(
                    req.est_tokens,
                    Box::new(MemoryPermit {
                        store: self.store.clone(),
                        id,
                        settled: AtomicBool::new(false),
                        released: AtomicBool::new(false),
                    }),
                )
            }),
            Err(refusal) => Admission::Refused(refusal),
        })
    }

    async fn in_flight(&self, scope: &str, source: &str) -> Result<u32, GovernanceError> {
        Ok(self.with(|st, now| st.model.in_flight(now, scope, source)))
    }

    async fn acquire_key<'r>(&self, req: &KeyAcquire<'r>) -> Result<KeyAdmission, GovernanceError> {
        self.keys.acquire(&self.heart, req).await
    }

    async fn key_usage(&self, key_id: &str) -> Result<KeyUsage, GovernanceError> {
        self.keys.usage(key_id)
    }
    async fn restore_key_spend(
        &self,
        key_id: &str,
        day_nanos: u64,
        month_nanos: u64,
    ) -> Result<bool, GovernanceError> {
        self.keys.restore(key_id, day_nanos, month_nanos)?;
        Ok(true)
    }
}

/// The backend of a memory permit. The first settlement wins (as in the Redis backend),
/// whichever path it takes; release is idempotent in the model. Settled and released,
/// the permit's lease is no longer renewed.
struct MemoryPermit {
    store: Arc<Store>,
    id: u64,
    settled: AtomicBool,
    released: AtomicBool,
}

impl fmt::Debug for MemoryPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPermit")
            .field("id", &self.id)
            .field("settled", &self.settled.load(Ordering::Relaxed))
            .field("released", &self.released.load(Ordering::Relaxed))
            .finish()
    }
}

impl MemoryPermit {
    fn apply(&self, tokens: Option<u64>, release: bool) {
        let settle = tokens.filter(|_| !self.settled.swap(true, Ordering::AcqRel));
        let release = release && !self.released.swap(true, Ordering::AcqRel);
        if settle.is_none() && !release {
            return;
        }
        let mut st = lock(&self.store.limiter);
        let now = self.store.now_ms();
        let now = st.at(now);
        if let Some(t) = settle {
            st.model.settle(now, self.id, t);
        }
        if release {
            st.model.release(self.id);
        }
        if self.settled.load(Ordering::Acquire) && self.released.load(Ordering::Acquire) {
            st.leases.remove(&self.id);
        }
    }
}

#[async_trait]
impl PermitBackend for MemoryPermit {
    async fn settle(&self, tokens: u64) -> Result<(), GovernanceError> {
        self.apply(Some(tokens), false);
        Ok(())
    }

    async fn release(&self) -> Result<(), GovernanceError> {
        self.apply(None, true);
        Ok(())
    }

    async fn settle_and_release(&self, tokens: u64) -> Result<(), GovernanceError> {
        self.apply(Some(tokens), true);
        Ok(())
    }

    fn settle_on_drop(&self, tokens: Option<u64>) {
        self.apply(tokens, true);
    }
}

impl Drop for MemoryPermit {
    fn drop(&mut self) {
        // A permit settled and released is gone from the leases already (no lock taken
        // on the hot path); whatever is left stops being renewed with its holder.
        if self.settled.load(Ordering::Acquire) && self.released.load(Ordering::Acquire) {
            return;
        }
        lock(&self.store.limiter).leases.remove(&self.id);
    }
}
