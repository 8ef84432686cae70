//! polygw's in-process governance (SPEC §4.2, §4.4, §10, §14): a [`MemoryLimiter`]
//! (`RateLimiter`), a [`MemoryBreakerStore`] (`BreakerStore`) and a [`MemoryCache`]
//! (`ResponseCache`), for one process; and a [`MemoryResponseStore`] (`ResponseStore`,
//! SPEC §18.1), the bounded store of OpenAI Responses for a scope without a telemetry
//! database ([`shared_responses`]: one per scope and process); and a [`MemoryAffinity`]
//! (`AffinityStore`, SPEC §20.2): which source last served each prompt-cache affinity key
//! ([`shared_affinity`]: one per scope, process and clock).
//!
//! The limiter runs core's reference model [`polygw_core::window::WindowLimiter`] under a
//! mutex and the breaker store runs [`polygw_core::breaker::BreakerState`] as is, so their
//! semantics are the specification's by construction; the Redis backend mirrors the same
//! models in Lua and both run one contract suite (`polygw-testkit`). Time comes from the
//! injected [`polygw_core::ports::Clock`] as milliseconds since the component was created,
//! read inside the lock so the model never sees time go back; a `ManualClock` (or a
//! paused tokio clock) drives every window without real waiting.
//!
//! **One store per process and scope** (SPEC §14.11): [`shared`] hands out a limiter and
//! a breaker store on the state of a scope name, shared by every client of that scope in
//! the process (the facade's wiring uses it), so two clients of one scope cannot double
//! its quota. [`MemoryLimiter::new`] / [`MemoryBreakerStore::new`] make a private state.
//!
//! **Client keys** (SPEC §21.1): [`MemoryLimiter`] runs core's
//! [`polygw_core::key_quota::KeyQuotas`] too, on one key state per process and clock that
//! every scope's limiter shares (a key's limits span the scopes it calls); its leases are
//! renewed like permits'.
//!
//! **Leases and their heartbeat** (SPEC §14.4, §17.7): every live permit and half-open
//! probe is registered with the handle that granted it and renewed while that handle's
//! heartbeat runs: before any operation looks at a lease, every registered lease is
//! renewed if a third of the shortest lease has passed since the last renewal; and while
//! leases are held, a ticker task of the store (spawned on the runtime of the first
//! acquire, ended by the first tick that finds no lease, or the store gone) does the same every third
//! of the shortest lease, so a long call keeps its slot and its reservation in an idle
//! scope too. [`MemoryLimiter::stop_heartbeat`] (what a crashed process looks like) lets
//! the handle's leases end.

mod affinity;
mod breaker;
mod cache;
mod keys;
mod limiter;
mod responses;

pub use affinity::{shared_affinity, MemoryAffinity, DEFAULT_AFFINITY_CAPACITY};
pub use breaker::MemoryBreakerStore;
pub use cache::MemoryCache;
pub use limiter::MemoryLimiter;
pub use responses::{
    shared_responses, shared_responses_with, MemoryResponseStore, ResponseStoreLimits,
    ENTRY_OVERHEAD,
};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, Weak};
use std::time::Instant;

use polygw_core::ports::Clock;

/// Milliseconds elapsed on `clock` since `base` (0 if the clock reads earlier).
fn elapsed_ms(clock: &dyn Clock, base: Instant) -> u64 {
    u64::try_from(clock.now().saturating_duration_since(base).as_millis()).unwrap_or(u64::MAX)
}

/// Locks a mutex, recovering from poisoning: every critical section here leaves the
/// state consistent before it can panic, so a poisoned lock still guards valid data.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The heartbeat of one handle (one client of a store): while it beats, the leases that
/// handle granted are renewed.
#[derive(Debug, Default)]
pub(crate) struct Heart {
    stopped: AtomicBool,
}

impl Heart {
    pub(crate) fn beats(&self) -> bool {
        !self.stopped.load(Ordering::Acquire)
    }

    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
    }
}

/// The state a limiter and a breaker store of one process and scope share.
pub(crate) struct Store {
    clock: Arc<dyn Clock>,
    base: Instant,
    pub(crate) limiter: Mutex<limiter::State>,
    pub(crate) breakers: Mutex<breaker::States>,
    /// The lease ticker, while one runs.
    ticker: Mutex<Option<tokio::task::AbortHandle>>,
}

/// Starts the store's lease ticker unless it runs (or no tokio runtime is current: then
/// the lazy renewal inside operations is what renews). The task holds the store weakly
/// and ends at the first tick that finds no lease held, or the store gone: it outlives
/// the last lease by at most one tick (a third of the shortest lease). It is not aborted
/// when the last lease goes: with one call at a time that was a task spawned and
/// aborted per call, two wake-ups of another worker thread each time (issue 27,
/// DECISIONS 158).
pub(crate) fn ensure_ticker(store: &Arc<Store>) {
    let mut slot = lock(&store.ticker);
    if slot.as_ref().is_some_and(|h| !h.is_finished()) {
        return;
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let weak = Arc::downgrade(store);
    let task = rt.spawn(async move {
        loop {
            let every = {
                let Some(s) = weak.upgrade() else { return };
                let l = lock(&s.limiter).renew_every_ms();
                let b = lock(&s.breakers).renew_every_ms();
                l.into_iter().chain(b).min().unwrap_or(10_000).max(1)
            };
            tokio::time::sleep(std::time::Duration::from_millis(every)).await;
            let Some(s) = weak.upgrade() else { return };
            // Under the slot's lock: an acquire registers its lease before it looks at
            // the slot, so either this sees the lease or that acquire starts a ticker.
            let mut slot = lock(&s.ticker);
            let held = {
                let mut l = lock(&s.limiter);
                let now = s.now_ms();
                l.at(now);
                let mut b = lock(&s.breakers);
                b.at(now);
                l.holds_leases() || b.holds_leases()
            };
            if !held {
                *slot = None;
                return;
            }
        }
    });
    *slot = Some(task.abort_handle());
}

impl Store {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Arc<Store> {
        let base = clock.now();
        Arc::new(Store {
            clock,
            base,
            limiter: Mutex::new(limiter::State::default()),
            breakers: Mutex::new(breaker::States::default()),
            ticker: Mutex::new(None),
        })
    }

    /// Now, in ms since the store was created. Read it while holding the lock of the state
    /// it is applied to, so concurrent operations apply their times in order.
    pub(crate) fn now_ms(&self) -> u64 {
        elapsed_ms(self.clock.as_ref(), self.base)
    }
}

type Registry = Mutex<HashMap<(String, usize), Weak<Store>>>;

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// A limiter and a breaker store on the process-wide state of scope `scope` (SPEC §14.11):
/// every client of that scope in this process shares its windows, slots and breakers; and
/// every scope of the process on the same clock shares one client-key state (SPEC §21.1:
/// a key's limits span the scopes it calls).
/// The state lives while some handle or permit of it does. Clients are told apart by
/// their clock as well (`Arc` identity: clients built with the same clock share): a
/// state is only ever driven by one clock. Each call returns handles with their own
/// heartbeat ([`MemoryLimiter::stop_heartbeat`]).
pub fn shared(scope: &str, clock: Arc<dyn Clock>) -> (MemoryLimiter, MemoryBreakerStore) {
    let key = (scope.to_string(), Arc::as_ptr(&clock) as *const () as usize);
    let store = {
        let mut reg = lock(&REGISTRY);
        reg.retain(|_, w| w.strong_count() > 0);
        match reg.get(&key).and_then(Weak::upgrade) {
            Some(s) => s,
            None => {
                let s = Store::new(clock.clone());
                reg.insert(key, Arc::downgrade(&s));
                s
            }
        }
    };
    let keys = keys::shared(&clock);
    let heart = Arc::new(Heart::default());
    (
        MemoryLimiter::over(store.clone(), keys, heart.clone()),
        MemoryBreakerStore::over(store, heart),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use polygw_core::ports::ManualClock;

    /// Any instant will do for a manual clock's base (clippy forbids `Instant::now`).
    fn tokio_free_now() -> Instant {
        tokio::time::Instant::now().into_std()
    }

    /// SPEC §21.1: a key's state spans the scopes of a process on one clock.
    #[test]
    fn one_key_state_per_process_and_clock() {
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(tokio_free_now(), 0));
        let (a, _) = shared("KREG_A", clock.clone());
        let (b, _) = shared("KREG_B", clock.clone());
        assert!(a.same_keys(&b) && a.same_keys(&a.client()));
        let other: Arc<dyn Clock> = Arc::new(ManualClock::new(tokio_free_now(), 0));
        let (c, _) = shared("KREG_A", other.clone());
        assert!(!a.same_keys(&c));
        assert!(!MemoryLimiter::new(clock).same_keys(&a));
    }

    #[test]
    fn one_store_per_scope_and_clock() {
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(tokio_free_now(), 0));
        let (a, _) = shared("REG_A", clock.clone());
        let (b, _) = shared("REG_A", clock.clone());
        let (c, _) = shared("REG_B", clock.clone());
        assert!(a.same_store(&b));
        assert!(!a.same_store(&c));
        let other: Arc<dyn Clock> = Arc::new(ManualClock::new(tokio_free_now(), 0));
        let (d, _) = shared("REG_A", other);
        assert!(!a.same_store(&d));
        drop((a, b));
        let (e, _) = shared("REG_A", clock.clone());
        let (f, _) = shared("REG_A", clock);
        assert!(e.same_store(&f));
    }

    /// Issue 27: the lease ticker is not spawned and aborted per call. Calls one after
    /// another (the last lease gone between them) share one ticker; it ends at the first
    /// tick that finds no lease, a third of the lease after the last one went.
    #[tokio::test(start_paused = true)]
    async fn one_ticker_serves_calls_one_after_another_and_ends_a_tick_after_the_last() {
        use polygw_testkit::limiter_contract::{self as lc, Req};
        use std::time::Duration;
        let l = MemoryLimiter::new(Arc::new(polygw_testkit::clock::TokioClock));
        let r = Req::new("TICK", "a")
            .source_limits(0, 0, 1)
            .lease(Duration::from_secs(30));
        let alive = || {
            tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks()
        };
        let mut first = lc::admit(&l, &r).await;
        let ticker = l.ticker_id();
        assert!(ticker.is_some(), "a held lease starts the ticker");
        first.finish(10).await.unwrap();
        tokio::task::yield_now().await;
        assert_eq!(
            alive(),
            1,
            "the last lease gone: the ticker is left to its tick"
        );
        let mut second = lc::admit(&l, &r).await;
        assert_eq!(
            l.ticker_id(),
            ticker,
            "the next call's lease is renewed by the same ticker"
        );
        second.finish(10).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10_001)).await;
        tokio::task::yield_now().await;
        assert!(l.ticker_id().is_none(), "no lease at its tick: it ended");
        assert_eq!(
            alive(),
            0,
            "no task outlives the leases by more than a tick"
        );
    }
}
