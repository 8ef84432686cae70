//! Client-key governance in one process (SPEC §21.1): core's model
//! [`polygw_core::key_quota::KeyQuotas`] under a mutex, with key permits whose leases the
//! granting handle's heartbeat renews (as for source permits) and whose drop-time
//! settlement applies directly.
//!
//! A key's state is not a scope's: one [`KeyStore`] serves every scope of the process
//! that runs on the same clock ([`shared`]), so a key calling two scopes meets one set of
//! limits. Time is Unix ms: the clock's wall reading when the store was made plus the
//! monotonic time since (a wall clock that jumps moves no window; a paused tokio clock or
//! a `ManualClock` drives days and months too).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use polygw_core::error::GovernanceError;
use polygw_core::key_quota::{valid_key_id, KeyQuotas};
use polygw_core::ports::{Clock, KeyAcquire, KeyAdmission, KeyPermit, KeyPermitBackend, KeyUsage};
use polygw_core::window::{IdMap, WINDOW_MS};

use crate::{elapsed_ms, lock, Heart};

/// Clock time between two compactions (as for the source model).
const COMPACT_EVERY_MS: u64 = WINDOW_MS / 4;

/// The key state of a process (per clock) and the live key leases.
#[derive(Default)]
struct State {
    model: KeyQuotas,
    /// Live permits: id → (the heartbeat of the handle that granted it, lease).
    leases: IdMap<(Arc<Heart>, Duration)>,
    last_renew_ms: u64,
    renew_every_ms: Option<u64>,
    last_compact_ms: u64,
}

impl State {
    /// Brings the model to `now`: renews the leases whose heartbeat beats (every third
    /// of the shortest lease), compacts now and then. Called first by every operation.
    fn at(&mut self, now: u64) -> u64 {
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

/// The key state shared by every limiter handle of a process and clock.
pub(crate) struct KeyStore {
    clock: Arc<dyn Clock>,
    base: Instant,
    base_unix_ms: u64,
    state: Mutex<State>,
    /// The lease ticker, while one runs.
    ticker: Mutex<Option<tokio::task::AbortHandle>>,
}

impl KeyStore {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Arc<KeyStore> {
        let base = clock.now();
        let base_unix_ms = u64::try_from(clock.unix_ms()).unwrap_or(0);
        Arc::new(KeyStore {
            clock,
            base,
            base_unix_ms,
            state: Mutex::new(State::default()),
            ticker: Mutex::new(None),
        })
    }

    /// Now, Unix ms (see the module doc). Read it under the state's lock.
    fn now_ms(&self) -> u64 {
        self.base_unix_ms
            .saturating_add(elapsed_ms(self.clock.as_ref(), self.base))
    }

    fn with<T>(&self, f: impl FnOnce(&mut State, u64) -> T) -> T {
        let mut st = lock(&self.state);
        let now = self.now_ms();
        let now = st.at(now);
        f(&mut st, now)
    }

    /// Starts the lease ticker unless it runs (see `crate::ensure_ticker`: it ends at the
    /// first tick that finds no lease held).
    fn ensure_ticker(self: &Arc<Self>) {
        let mut slot = lock(&self.ticker);
        if slot.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let weak = Arc::downgrade(self);
        let task = rt.spawn(async move {
            loop {
                let every = {
                    let Some(s) = weak.upgrade() else { return };
                    let every = lock(&s.state).renew_every_ms;
                    every.unwrap_or(10_000).max(1)
                };
                tokio::time::sleep(Duration::from_millis(every)).await;
                let Some(s) = weak.upgrade() else { return };
                let mut slot = lock(&s.ticker);
                let held = s.with(|st, _| !st.leases.is_empty());
                if !held {
                    *slot = None;
                    return;
                }
            }
        });
        *slot = Some(task.abort_handle());
    }

    pub(crate) async fn acquire(
        self: &Arc<Self>,
        heart: &Arc<Heart>,
        req: &KeyAcquire<'_>,
    ) -> Result<KeyAdmission, GovernanceError> {
        check(req.key_id)?;
        let admitted = self.with(|st, now| {
            let r = st.model.acquire(now, req);
            if let Ok(id) = r {
                st.leases.insert(id, (heart.clone(), req.lease));
                let third = u64::try_from(req.lease.as_millis() / 3)
                    .unwrap_or(u64::MAX)
                    .max(1);
                st.renew_every_ms = Some(st.renew_every_ms.map_or(third, |e| e.min(third)));
            }
            r
        });
        Ok(match admitted {
            Ok(id) => {
                self.ensure_ticker();
                KeyAdmission::Admitted(KeyPermit::new(
                    if req.top_up { 0 } else { req.est_tokens },
                    req.reserve_nanos,
                    Box::new(MemoryKeyPermit {
                        keys: self.clone(),
                        id,
                        finished: AtomicBool::new(false),
                    }),
                ))
            }
            Err(refusal) => KeyAdmission::Refused(refusal),
        })
    }

    pub(crate) fn restore(
        &self,
        key_id: &str,
        day_nanos: u64,
        month_nanos: u64,
    ) -> Result<(), GovernanceError> {
        check(key_id)?;
        self.with(|st, now| st.model.restore(now, key_id, day_nanos, month_nanos));
        Ok(())
    }

    pub(crate) fn usage(&self, key_id: &str) -> Result<KeyUsage, GovernanceError> {
        check(key_id)?;
        Ok(self.with(|st, now| st.model.usage(now, key_id)))
    }

    #[cfg(test)]
    pub(crate) fn remembered(&self) -> usize {
        self.with(|st, now| {
            st.model.compact(now);
            st.model.len()
        })
    }
}

fn check(key_id: &str) -> Result<(), GovernanceError> {
    if valid_key_id(key_id) {
        Ok(())
    } else {
        Err(GovernanceError::new(
            "memory",
            format!("client key id {key_id:?} cannot be governed (empty or has braces)"),
        ))
    }
}

type Registry = Mutex<HashMap<usize, Weak<KeyStore>>>;

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// The key store of this process for `clock` (`Arc` identity), made on first use: every
/// scope's limiter of the process shares it.
pub(crate) fn shared(clock: &Arc<dyn Clock>) -> Arc<KeyStore> {
    let key = Arc::as_ptr(clock) as *const () as usize;
    let mut reg = lock(&REGISTRY);
    reg.retain(|_, w| w.strong_count() > 0);
    match reg.get(&key).and_then(Weak::upgrade) {
        Some(s) => s,
        None => {
            let s = KeyStore::new(clock.clone());
            reg.insert(key, Arc::downgrade(&s));
            s
        }
    }
}

/// The backend of a memory key permit: the first finish wins, whichever path it takes.
struct MemoryKeyPermit {
    keys: Arc<KeyStore>,
    id: u64,
    finished: AtomicBool,
}

impl fmt::Debug for MemoryKeyPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryKeyPermit")
            .field("id", &self.id)
            .field("finished", &self.finished.load(Ordering::Relaxed))
            .finish()
    }
}

impl MemoryKeyPermit {
    fn apply(&self, tokens: u64, cost_nanos: u64) {
        if self.finished.swap(true, Ordering::AcqRel) {
            return;
        }
        self.keys.with(|st, now| {
            st.model.finish(now, self.id, tokens, cost_nanos);
            st.leases.remove(&self.id);
        });
    }
}

#[async_trait]
impl KeyPermitBackend for MemoryKeyPermit {
    async fn finish(&self, tokens: u64, cost_nanos: u64) -> Result<(), GovernanceError> {
        self.apply(tokens, cost_nanos);
        Ok(())
    }

    fn finish_on_drop(&self, tokens: u64, cost_nanos: u64) {
        self.apply(tokens, cost_nanos);
    }
}

impl Drop for MemoryKeyPermit {
    fn drop(&mut self) {
        if self.finished.load(Ordering::Acquire) {
            return;
        }
        // Never finished (forgotten): its lease is no longer renewed and ends.
        lock(&self.keys.state).leases.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use polygw_core::ports::ManualClock;
    use polygw_testkit::clock::TokioClock;

    fn req(key_id: &str) -> KeyAcquire<'_> {
        KeyAcquire {
            key_id,
            rpm: 0,
            tpm: 0,
            max_concurrency: 1,
            budget_day_nanos: Some(1_000),
            budget_month_nanos: None,
            est_tokens: 10,
            reserve_nanos: 100,
            lease: Duration::from_secs(30),
            top_up: false,
        }
    }

    /// SPEC §14.4 for keys: a held key lease is renewed by the store's ticker while
    /// nothing else happens (a 100 s call in an idle process keeps its slot and its
    /// reservation); once finished, the ticker ends at its next tick.
    #[tokio::test(start_paused = true)]
    async fn held_key_leases_are_renewed_while_idle() {
        let keys = KeyStore::new(Arc::new(TokioClock));
        let heart = Arc::new(Heart::default());
        let KeyAdmission::Admitted(mut p) = keys.acquire(&heart, &req("k")).await.unwrap() else {
            panic!("admitted")
        };
        tokio::time::sleep(Duration::from_secs(100)).await;
        let u = keys.usage("k").unwrap();
        assert_eq!((u.in_flight, u.reserved_nanos), (1, 100));
        let KeyAdmission::Refused(r) = keys.acquire(&heart, &req("k")).await.unwrap() else {
            panic!("refused")
        };
        assert_eq!(r.reason, polygw_core::error::RefusalReason::KeyConcurrency);
        p.finish(10, 40).await.unwrap();
        // It ends at its next tick (a third of the lease) that finds no lease.
        tokio::time::sleep(Duration::from_millis(10_001)).await;
        tokio::task::yield_now().await;
        assert!(
            lock(&keys.ticker).is_none(),
            "no lease left at its tick: the ticker is gone"
        );
        assert_eq!(keys.usage("k").unwrap().day_nanos, 40);
    }

    /// What the store keeps does not grow with the keys served: keys whose spend left
    /// its day and month are forgotten.
    #[test]
    fn finished_keys_are_forgotten_once_their_periods_end() {
        let clock = Arc::new(ManualClock::new(
            tokio::time::Instant::now().into_std(),
            1_706_745_540_000, // 2024-01-31T23:59:00Z
        ));
        let keys = KeyStore::new(clock.clone());
        let heart = Arc::new(Heart::default());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        for i in 0..1_000 {
            let id = format!("k{i}");
            rt.block_on(async {
                let KeyAdmission::Admitted(mut p) = keys.acquire(&heart, &req(&id)).await.unwrap()
                else {
                    panic!("admitted")
                };
                p.finish(10, 7).await.unwrap();
            });
        }
        assert_eq!(keys.remembered(), 1_000);
        clock.advance(Duration::from_secs(61));
        assert_eq!(
            keys.remembered(),
            0,
            "a new day and month: nothing counts any more"
        );
        assert!(lock(&keys.state).leases.is_empty());
    }
}
