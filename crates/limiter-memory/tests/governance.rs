//! The memory backend against the testkit contract suites (limiter and breaker with a
//! manual clock so window and breaker tests need no real waiting; the response store),
//! plus the response cache, the response store's bounds and memory-specific behaviour.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use polygw_core::error::GovernanceError;
use polygw_core::ports::{BreakerStore, Clock, ManualClock, RateLimiter};
use polygw_core::settings::BreakerSettings;
use polygw_limiter_memory::{MemoryBreakerStore, MemoryCache, MemoryLimiter};
use polygw_testkit::breaker_contract::{self as bc, BreakerHarness};
use polygw_testkit::limiter_contract::{self as lc, LimiterHarness, Subject, WindowProbe};

/// One manual clock; every limiter and store of the harness starts at its base.
struct Mem {
    clock: Arc<ManualClock>,
    base: Instant,
    limiter: MemoryLimiter,
    breakers: MemoryBreakerStore,
}

fn harness() -> Mem {
    let base = tokio::time::Instant::now().into_std();
    let clock = Arc::new(ManualClock::new(base, 1_700_000_000_000));
    Mem {
        limiter: MemoryLimiter::new(clock.clone()),
        breakers: MemoryBreakerStore::new(clock.clone()),
        clock,
        base,
    }
}

struct Probe(MemoryLimiter);

#[async_trait]
impl WindowProbe for Probe {
    async fn source_window(
        &self,
        scope: &str,
        source: &str,
    ) -> Result<(u64, u64), GovernanceError> {
        Ok(self.0.source_window(scope, source))
    }
    async fn scope_window(&self, scope: &str) -> Result<(u64, u64), GovernanceError> {
        Ok(self.0.scope_window(scope))
    }
}

impl Mem {
    fn subject_now(&self) -> Subject {
        Subject {
            limiter: Arc::new(self.limiter.clone()),
            probe: Arc::new(Probe(self.limiter.clone())),
        }
    }
}

#[async_trait]
impl LimiterHarness for Mem {
    async fn subject(&self) -> Subject {
        self.subject_now()
    }
    async fn clients(&self, n: usize) -> Vec<Arc<dyn RateLimiter>> {
        (0..n)
            .map(|_| Arc::new(self.limiter.client()) as Arc<dyn RateLimiter>)
            .collect()
    }
    async fn windowed(&self) -> (Subject, Duration) {
        (self.subject_now(), Duration::from_secs(60))
    }
    async fn crashable(&self) -> (Arc<dyn RateLimiter>, Box<dyn Fn() + Send + Sync>) {
        let c = self.limiter.client();
        let stop = c.clone();
        (Arc::new(c), Box::new(move || stop.stop_heartbeat()))
    }
    async fn quiet(&self) -> Subject {
        let c = self.limiter.client();
        c.stop_heartbeat();
        Subject {
            limiter: Arc::new(c.clone()),
            probe: Arc::new(Probe(c)),
        }
    }
    fn manual_time(&self) -> bool {
        true
    }
    async fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }
    fn now(&self) -> Duration {
        self.clock.now() - self.base
    }
    fn margin(&self) -> Duration {
        Duration::ZERO
    }
}

#[async_trait]
impl BreakerHarness for Mem {
    async fn store(&self) -> Arc<dyn BreakerStore> {
        Arc::new(self.breakers.clone())
    }
    async fn clients(&self, n: usize) -> Vec<Arc<dyn BreakerStore>> {
        (0..n)
            .map(|_| Arc::new(self.breakers.client()) as Arc<dyn BreakerStore>)
            .collect()
    }
    async fn crashable(&self) -> (Arc<dyn BreakerStore>, Box<dyn Fn() + Send + Sync>) {
        let c = self.breakers.client();
        let stop = c.clone();
        (Arc::new(c), Box::new(move || stop.stop_heartbeat()))
    }
    async fn quiet(&self) -> Arc<dyn BreakerStore> {
        let c = self.breakers.client();
        c.stop_heartbeat();
        Arc::new(c)
    }
    fn settings(&self) -> BreakerSettings {
        BreakerSettings {
            failures: 3,
            open: Duration::from_secs(30),
            open_max: Duration::from_secs(300),
            dead: Duration::from_secs(300),
            dead_after: 2,
        }
    }
    fn manual_time(&self) -> bool {
        true
    }
    async fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }
    fn now(&self) -> Duration {
        self.clock.now() - self.base
    }
    fn margin(&self) -> Duration {
        Duration::ZERO
    }
}

mod limiter_contract {
    use super::*;

    macro_rules! cases {
        ($($name:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                lc::$name(&harness()).await;
            }
        )*};
    }

    cases!(
        rpm_never_over_admitted,
        rpm_window_rolls,
        tpm_reserve_then_settle,
        tpm_window_rolls,
        concurrency_cap_and_release,
        lease_expiry_frees_the_slot,
        leases_renewed_while_held_and_end_after_a_crash,
        long_calls_hold_their_tpm_reservation,
        scope_limits_atomic_with_source,
        settle_and_release_idempotent,
        drop_settles_reservation_and_releases,
        unlimited_admits_everything,
        concurrent_acquirers_never_over_admit,
        concurrent_rpm_saturation,
        saturating_load_over_windows,
    );

    /// Random acquire/settle/release/finish/drop/advance sequences match the reference
    /// model exactly (admissions, refusal reasons and hints, in flight, windows).
    #[test]
    fn matches_reference_model() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let h = harness();
        lc::model_proptest(&rt, &h, 256);
    }
}

/// The client-key half of the limiter contract (SPEC §21.1).
mod key_contract {
    use super::*;
    use polygw_testkit::limiter_contract::keys as kc;

    macro_rules! cases {
        ($($name:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                kc::$name(&harness()).await;
            }
        )*};
    }

    cases!(
        key_rpm_never_over_admitted,
        key_rpm_window_rolls,
        key_tpm_reserve_then_settle,
        key_concurrency_cap_and_finish,
        key_budget_reserve_then_settle,
        key_top_up_holds_money_only,
        key_drop_settles_at_the_reservation,
        key_leases_renewed_while_held_and_settled_after_a_crash,
        keys_are_independent,
        key_unlimited_admits_everything,
        concurrent_key_callers_never_over_admit,
    );

    /// Random acquire/finish/drop/background/advance sequences (across days) match
    /// `KeyQuotas` exactly: admissions, refusal reasons and hints, every figure.
    #[test]
    fn matches_key_model() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let h = harness();
        kc::key_model_proptest(&rt, &h, 256);
    }
}

mod breaker_contract {
    use super::*;

    macro_rules! cases {
        ($($name:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                bc::$name(&harness()).await;
            }
        )*};
    }

    cases!(
        opens_after_consecutive_failures,
        only_consecutive_feeding_failures_count,
        half_open_admits_one_probe_and_success_closes,
        failed_probe_doubles_open_time,
        open_time_capped_at_open_max,
        probe_lease_expires_and_neutral_frees,
        cooldown_from_retry_after,
        a_huge_cooldown_is_bounded_alike,
        dead_source_out_for_dead_s,
        concurrent_half_open_grants_one_probe,
        sources_are_independent,
        outcomes_count_only_in_their_epoch,
        stale_probe_changes_nothing,
        only_the_dead_period_revives_a_dead_source,
        reset_and_drain_act_at_once_for_every_client,
        probe_renewed_while_held_and_freed_after_a_crash,
        release_probe_frees_it,
    );

    /// Random admit/record/advance sequences match `BreakerState` exactly.
    #[test]
    fn matches_reference_model() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let h = harness();
        bc::model_proptest(&rt, &h, 256);
    }
}

mod memory_specific {
    use super::*;
    use polygw_core::ports::Admission;
    use polygw_testkit::limiter_contract::Req;

    /// Issue 22, item 11 (SPEC §17.7): a held lease is renewed by the store's ticker in
    /// an idle scope. With MAX_CONCURRENCY=1 and the holder still running, 31 s of no
    /// other operation (leases of 30 s) admit no second call; a 100 s call's reservation
    /// stays in the TPM window until it settles, and its settlement is counted then.
    #[tokio::test(start_paused = true)]
    async fn held_leases_are_renewed_in_an_idle_scope() {
        let l = MemoryLimiter::new(Arc::new(polygw_testkit::clock::TokioClock));
        let r = Req::new("IDLE", "a")
            .source_limits(0, 10_000, 1)
            .est(500)
            .lease(Duration::from_secs(30));
        let mut holder = lc::admit(&l, &r).await;
        tokio::time::sleep(Duration::from_secs(31)).await;
        let f = lc::refuse(&l, &r).await;
        assert_eq!(f.reason.as_str(), "concurrency", "the slot is still held");
        assert_eq!(
            l.source_window("IDLE", "a").1,
            500,
            "the reservation is held"
        );
        tokio::time::sleep(Duration::from_secs(69)).await;
        assert_eq!(l.source_window("IDLE", "a").1, 500, "100 s in, still held");
        holder.finish(900).await.unwrap();
        assert_eq!(l.source_window("IDLE", "a").1, 900, "settled at 900 tokens");
        let _next = lc::admit(&l, &r).await;
        // A crashed holder's lease still ends: the ticker renews beating handles only.
        let crashed = l.client();
        let r2 = Req::new("IDLE2", "a")
            .source_limits(0, 0, 1)
            .lease(Duration::from_secs(30));
        let p = lc::admit(&crashed, &r2).await;
        crashed.stop_heartbeat();
        tokio::time::sleep(Duration::from_secs(31)).await;
        let _again = lc::admit(&l, &r2).await;
        drop(p);
    }

    /// Drop-time settlement applies directly, also on a thread with no runtime.
    #[tokio::test]
    async fn drop_applies_directly_without_a_runtime() {
        let h = harness();
        let r = Req::new("M", "a").source_limits(0, 1000, 1).est(400);
        let p = lc::admit(&h.limiter, &r).await;
        std::thread::spawn(move || drop(p)).join().unwrap();
        // no flush needed: the settlement is already applied
        assert_eq!(h.limiter.in_flight("M", "a").await.unwrap(), 0);
        assert_eq!(h.limiter.source_window("M", "a"), (1, 400));
    }

    /// Windows empty out as time passes and compaction keeps working state bounded
    /// without changing any answer.
    #[tokio::test]
    async fn compaction_keeps_answers() {
        let h = harness();
        let r = Req::new("M", "a")
            .source_limits(5000, 0, 0)
            .scope_limits(0, 1_000_000)
            .est(3);
        for i in 0..5000u64 {
            let mut p = lc::admit(&h.limiter, &r).await;
            p.finish(i % 5).await.unwrap();
            h.clock.advance(Duration::from_millis(20)); // 50/s: ≤ 3000 per window
        }
        h.limiter.compact();
        let (reqs, _) = h.limiter.source_window("M", "a");
        assert_eq!(reqs, 2999, "entries at 40.02 s ..= 99.98 s");
        h.clock.advance(Duration::from_secs(60));
        h.limiter.compact();
        assert_eq!(h.limiter.source_window("M", "a"), (0, 0));
        assert_eq!(h.limiter.scope_window("M"), (0, 0));
        assert!(matches!(
            h.limiter.acquire(&r.get()).await.unwrap(),
            Admission::Admitted(_)
        ));
    }

    /// Clones share one state (the facade clones the limiter into every client).
    #[tokio::test]
    async fn clones_share_state() {
        let h = harness();
        let other = h.limiter.clone();
        let r = Req::new("M", "a").source_limits(1, 0, 0);
        let _p = lc::admit(&h.limiter, &r).await;
        assert_eq!(lc::refuse(&other, &r).await.reason.as_str(), "rpm");
    }

    /// SPEC §14.11: the limiters and breaker stores `shared` hands out for one scope (as
    /// the facade builds one per client) share one state: two clients of a scope cannot
    /// double its quota, and a breaker tripped through one is open for the other.
    #[tokio::test]
    async fn two_clients_of_one_scope_share_quota_and_breakers() {
        let clock: Arc<dyn Clock> =
            Arc::new(ManualClock::new(tokio::time::Instant::now().into_std(), 0));
        let scope = polygw_testkit::services::unique_name("SHARED");
        let (l1, b1) = polygw_limiter_memory::shared(&scope, clock.clone());
        let (l2, b2) = polygw_limiter_memory::shared(&scope, clock.clone());
        let r = Req::new(&scope, "a")
            .source_limits(3, 0, 2)
            .scope_limits(0, 0);
        let _p1 = lc::admit(&l1, &r).await;
        let _p2 = lc::admit(&l2, &r).await;
        assert_eq!(lc::refuse(&l1, &r).await.reason.as_str(), "concurrency");
        assert_eq!(lc::refuse(&l2, &r).await.reason.as_str(), "concurrency");
        assert_eq!(l1.in_flight(&scope, "a").await.unwrap(), 2);
        let s = BreakerSettings {
            failures: 1,
            ..BreakerSettings::default()
        };
        b1.record(
            &scope,
            "a",
            polygw_core::breaker::BreakerOutcome::Failure,
            0,
            false,
            &s,
        )
        .await
        .unwrap();
        assert!(b2.state(&scope, "a").await.unwrap().is_tripped());
        // another scope name has its own state
        let (l3, _) = polygw_limiter_memory::shared(&format!("{scope}_X"), clock);
        let r3 = Req::new(&format!("{scope}_X"), "a").source_limits(3, 0, 2);
        let _p3 = lc::admit(&l3, &r3).await;
        let _p4 = lc::admit(&l3, &r3).await;
    }

    /// SPEC §14.11 bullet / issue 14: the clock is read inside the lock. Threads acquire,
    /// settle and release through a clock that jumps on every read; time as the model
    /// sees it never goes back, so no hint underflows (a panic in debug builds) and no
    /// window is over-admitted.
    #[test]
    fn concurrent_acquirers_with_a_jumping_clock() {
        #[derive(Debug)]
        struct Jumping {
            base: Instant,
            ticks: std::sync::atomic::AtomicU64,
        }
        impl Clock for Jumping {
            fn now(&self) -> Instant {
                // 700 ms per read: the window turns over every ~86 reads.
                let n = self.ticks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                self.base + Duration::from_millis(700 * n)
            }
            fn unix_ms(&self) -> i64 {
                0
            }
        }
        let clock = Arc::new(Jumping {
            base: tokio::time::Instant::now().into_std(),
            ticks: Default::default(),
        });
        let l = MemoryLimiter::new(clock);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let l = l.clone();
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .build()
                        .unwrap();
                    let r = Req::new("JUMP", "a")
                        .source_limits(7, 900, 3)
                        .scope_limits(9, 1200)
                        .est(100 + t * 10);
                    let mut held = vec![];
                    for i in 0..3000u64 {
                        match rt.block_on(l.acquire(&r.get())).unwrap() {
                            Admission::Admitted(p) => held.push(p),
                            Admission::Refused(f) => {
                                assert!(f.retry_after.is_some(), "{f:?}");
                            }
                        }
                        if held.len() > 2 || i % 3 == 0 {
                            if let Some(mut p) = held.pop() {
                                rt.block_on(p.finish(i % 400)).unwrap();
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("no panic in any thread");
        }
        let (reqs, _) = l.source_window("JUMP", "a");
        assert!(reqs <= 7);
        assert!(rt.block_on(l.in_flight("JUMP", "a")).unwrap() <= 3);
    }
}

mod cache {
    use super::*;
    use polygw_core::ports::ResponseCache;
    use polygw_core::response::LlmResponse;

    fn resp(content: &str) -> LlmResponse {
        LlmResponse {
            content: content.to_string(),
            ..LlmResponse::default()
        }
    }

    fn cache(capacity: usize) -> (MemoryCache, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(tokio::time::Instant::now().into_std(), 0));
        (MemoryCache::new(capacity, clock.clone()), clock)
    }

    const TTL: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn stores_and_expires_by_ttl() {
        let (c, clock) = cache(10);
        assert_eq!(c.get("k").await.unwrap(), None);
        c.put("k", &resp("a"), TTL).await.unwrap();
        assert_eq!(c.get("k").await.unwrap(), Some(resp("a")));
        clock.advance(TTL - Duration::from_millis(1));
        assert_eq!(c.get("k").await.unwrap(), Some(resp("a")));
        clock.advance(Duration::from_millis(1));
        assert_eq!(c.get("k").await.unwrap(), None);
        assert!(c.is_empty(), "an expired entry is dropped when looked up");
    }

    #[tokio::test]
    async fn bounded_with_lru_eviction() {
        let (c, _clock) = cache(3);
        for k in ["a", "b", "c"] {
            c.put(k, &resp(k), TTL).await.unwrap();
        }
        assert!(c.get("a").await.unwrap().is_some()); // a is now the most recent
        c.put("d", &resp("d"), TTL).await.unwrap(); // evicts b
        assert_eq!(c.len(), 3);
        assert_eq!(c.get("b").await.unwrap(), None);
        for k in ["a", "c", "d"] {
            assert_eq!(c.get(k).await.unwrap(), Some(resp(k)), "{k}");
        }
        for i in 0..1000 {
            c.put(&format!("x{i}"), &resp("x"), TTL).await.unwrap();
        }
        assert_eq!(c.len(), 3);
    }

    #[tokio::test]
    async fn expired_entries_go_before_live_ones() {
        let (c, clock) = cache(2);
        c.put("short", &resp("s"), Duration::from_secs(1))
            .await
            .unwrap();
        c.put("long", &resp("l"), TTL).await.unwrap();
        clock.advance(Duration::from_secs(2));
        c.put("new", &resp("n"), TTL).await.unwrap();
        assert_eq!(c.get("long").await.unwrap(), Some(resp("l")));
        assert_eq!(c.get("new").await.unwrap(), Some(resp("n")));
        assert_eq!(c.get("short").await.unwrap(), None);
    }

    #[tokio::test]
    async fn an_entry_evicted_as_least_recent_leaves_no_expiry_behind() {
        let (c, clock) = cache(2);
        c.put("a", &resp("a1"), Duration::from_secs(1))
            .await
            .unwrap();
        c.put("b", &resp("b"), TTL).await.unwrap();
        c.put("c", &resp("c"), TTL).await.unwrap(); // evicts a (least recent)
        assert_eq!(c.get("a").await.unwrap(), None);
        c.put("a", &resp("a2"), TTL).await.unwrap(); // evicts b
        clock.advance(Duration::from_secs(2)); // the first a's expiry has passed
        c.put("d", &resp("d"), TTL).await.unwrap(); // evicts c, not the new a
        assert_eq!(c.get("a").await.unwrap(), Some(resp("a2")));
        assert_eq!(c.get("d").await.unwrap(), Some(resp("d")));
        assert_eq!(c.get("c").await.unwrap(), None);
        assert_eq!(c.len(), 2);
    }

    #[tokio::test]
    async fn overwrite_replaces_value_and_ttl() {
        let (c, clock) = cache(2);
        c.put("k", &resp("old"), Duration::from_secs(1))
            .await
            .unwrap();
        c.put("k", &resp("new"), TTL).await.unwrap();
        clock.advance(Duration::from_secs(5));
        assert_eq!(c.get("k").await.unwrap(), Some(resp("new")));
        assert_eq!(c.len(), 1);
    }

    #[tokio::test]
    async fn zero_capacity_or_ttl_stores_nothing() {
        let (c, _) = cache(0);
        c.put("k", &resp("a"), TTL).await.unwrap();
        assert_eq!(c.get("k").await.unwrap(), None);
        let (c, _) = cache(5);
        c.put("k", &resp("a"), Duration::ZERO).await.unwrap();
        assert_eq!(c.get("k").await.unwrap(), None);
        assert!(
            c.put("k", &resp("a"), Duration::MAX).await.is_err(),
            "an unrepresentable TTL is a cache error, never a panic"
        );
    }
}

mod store_contract {
    use std::sync::Arc;

    use async_trait::async_trait;
    use polygw_core::ports::ResponseStore;
    use polygw_limiter_memory::MemoryResponseStore;
    use polygw_testkit::store_contract::{self as sc, StoreHarness};

    /// One store of default bounds per case, reached through two handles.
    struct Mem(Arc<MemoryResponseStore>);

    #[async_trait]
    impl StoreHarness for Mem {
        async fn store(&self) -> Arc<dyn ResponseStore> {
            self.0.clone()
        }
    }

    macro_rules! cases {
        ($($name:ident),* $(,)?) => {$(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                sc::$name(&Mem(Arc::new(MemoryResponseStore::default()))).await;
            }
        )*};
    }

    cases!(
        put_get_round_trip,
        another_scopes_id_is_invisible,
        expired_entries_are_never_returned,
        delete_returns_true_then_false,
        put_replaces,
        large_values_round_trip,
        many_entries,
        concurrent_clients,
        chains_link_turns_and_renew_them,
        an_owner_is_bounded_and_never_evicts_another,
    );

    #[test]
    fn every_case_runs_here() {
        let here = include_str!("governance.rs");
        for case in sc::CASES {
            assert!(here.contains(&format!("        {case},\n")), "{case}");
        }
    }
}

mod response_store {
    use std::sync::Arc;

    use polygw_core::ports::ResponseStore;
    use polygw_limiter_memory::{
        shared_responses, shared_responses_with, MemoryResponseStore, ResponseStoreLimits,
    };
    use polygw_testkit::store_contract::{entry, DAY_MS, T0, UNBOUNDED};
    use serde_json::json;

    fn store(max_entries: usize, max_bytes: u64) -> MemoryResponseStore {
        MemoryResponseStore::new(ResponseStoreLimits {
            max_entries,
            max_bytes,
        })
    }

    #[test]
    fn defaults_are_documented() {
        let l = ResponseStoreLimits::default();
        assert_eq!((l.max_entries, l.max_bytes), (100_000, 256 << 20));
        assert_eq!(MemoryResponseStore::default().limits(), l);
    }

    #[tokio::test]
    async fn the_oldest_entries_leave_first_when_the_count_is_reached() {
        let s = store(3, u64::MAX);
        for i in 0..3 {
            s.put(entry("S", &format!("r{i}"), "x"), UNBOUNDED)
                .await
                .unwrap();
        }
        // Replacing r0 makes it the newest: r1 is now the oldest.
        s.put(entry("S", "r0", "again"), UNBOUNDED).await.unwrap();
        s.put(entry("S", "r3", "x"), UNBOUNDED).await.unwrap();
        assert_eq!(s.len(), 3);
        assert!(s.get("S", "r1", T0).await.unwrap().is_none());
        for id in ["r0", "r2", "r3"] {
            assert!(s.get("S", id, T0).await.unwrap().is_some(), "{id}");
        }
    }

    #[tokio::test]
    async fn bytes_are_bounded_and_accounted_exactly() {
        let one = {
            let s = MemoryResponseStore::default();
            s.put(entry("S", "r0", "x"), UNBOUNDED).await.unwrap();
            s.bytes()
        };
        let s = store(1000, one * 3 + one / 2);
        for i in 0..10 {
            s.put(entry("S", &format!("r{i}"), "x"), UNBOUNDED)
                .await
                .unwrap();
            assert!(s.bytes() <= one * 3 + one / 2);
        }
        assert_eq!(s.len(), 3);
        assert_eq!(s.bytes(), 3 * one);
        for i in 7..10 {
            assert!(s.get("S", &format!("r{i}"), T0).await.unwrap().is_some());
        }
        // Deleting and replacing keep the count exact.
        assert!(s.delete("S", "r9").await.unwrap());
        assert_eq!(s.bytes(), 2 * one);
        s.put(entry("S", "r8", "x"), UNBOUNDED).await.unwrap();
        assert_eq!((s.len(), s.bytes()), (2, 2 * one));
        s.delete("S", "r8").await.unwrap();
        s.delete("S", "r7").await.unwrap();
        assert_eq!((s.len(), s.bytes()), (0, 0));
    }

    #[tokio::test]
    async fn an_entry_larger_than_the_bound_is_refused_and_evicts_nothing() {
        let s = store(10, 4096);
        s.put(entry("S", "small", "x"), UNBOUNDED).await.unwrap();
        let mut big = entry("S", "big", "x");
        big.response = json!({"text": "y".repeat(5000)});
        let e = s.put(big, UNBOUNDED).await.unwrap_err().0;
        assert!(e.contains("does not fit"), "{e}");
        assert!(s.get("S", "small", T0).await.unwrap().is_some());
        assert!(s.get("S", "big", T0).await.unwrap().is_none());
        let none = store(0, u64::MAX);
        assert!(none.put(entry("S", "r", "x"), UNBOUNDED).await.is_err());
        assert!(none.is_empty());
    }

    /// The whole store's bound never evicts one owner's entries for another's: the put
    /// that only another owner's entries could make room for is refused, and an owner
    /// over its share makes room from its own.
    #[tokio::test]
    async fn the_store_bound_never_evicts_another_owners_entries() {
        let one = {
            let s = MemoryResponseStore::default();
            s.put(entry("A", "r0", "x"), UNBOUNDED).await.unwrap();
            s.bytes()
        };
        let s = store(1000, one * 4);
        for i in 0..4 {
            s.put(entry("A", &format!("r{i}"), "x"), UNBOUNDED)
                .await
                .unwrap();
        }
        let e = s.put(entry("B", "r0", "x"), UNBOUNDED).await.unwrap_err().0;
        assert!(e.contains("no key's responses are evicted"), "{e}");
        assert_eq!((s.owner_bytes("A"), s.owner_bytes("B")), (4 * one, 0));
        // A makes room from its own: its oldest leaves.
        s.put(entry("A", "r4", "x"), UNBOUNDED).await.unwrap();
        assert!(s.get("A", "r0", T0).await.unwrap().is_none());
        assert_eq!(s.len(), 4);
        // Once A deletes, B stores; A's next put then evicts A's own, not B's.
        assert!(s.delete("A", "r1").await.unwrap());
        s.put(entry("B", "r0", "x"), UNBOUNDED).await.unwrap();
        s.put(entry("A", "r5", "x"), UNBOUNDED).await.unwrap();
        assert!(s.get("B", "r0", T0).await.unwrap().is_some());
        assert_eq!((s.owner_bytes("A"), s.owner_bytes("B")), (3 * one, one));
        // The entry count bounds the same way.
        let s = store(2, u64::MAX);
        s.put(entry("A", "r0", "x"), UNBOUNDED).await.unwrap();
        s.put(entry("A", "r1", "x"), UNBOUNDED).await.unwrap();
        assert!(s.put(entry("B", "r0", "x"), UNBOUNDED).await.is_err());
        s.put(entry("A", "r2", "x"), UNBOUNDED).await.unwrap();
        assert_eq!(s.len(), 2);
    }

    #[tokio::test]
    async fn expired_entries_are_purged_lazily_and_go_before_live_ones() {
        let s = store(3, u64::MAX);
        for i in 0..3 {
            let mut r = entry("S", &format!("short{i}"), "x");
            r.expires_at_ms = T0 + 100 + i;
            s.put(r, UNBOUNDED).await.unwrap();
        }
        assert_eq!(s.len(), 3);
        // A get at a later time purges what expired by then.
        assert!(s.get("S", "other", T0 + 101).await.unwrap().is_none());
        assert_eq!(s.len(), 1);
        // A put purges at its created_at: the expired entry goes, no live one is evicted.
        let mut live = entry("S", "live0", "x");
        live.created_at_ms = T0 + 1_000;
        s.put(live, UNBOUNDED).await.unwrap();
        assert_eq!(s.len(), 1);
        s.put(entry("S", "live1", "x"), UNBOUNDED).await.unwrap();
        s.put(entry("S", "live2", "x"), UNBOUNDED).await.unwrap();
        s.put(entry("S", "live3", "x"), UNBOUNDED).await.unwrap();
        assert_eq!(s.len(), 3);
        assert!(s.get("S", "live0", T0 + 2_000).await.unwrap().is_none());
        assert!(s
            .get("S", "live3", T0 + DAY_MS - 1)
            .await
            .unwrap()
            .is_some());
        assert!(s.get("S", "live3", T0 + DAY_MS).await.unwrap().is_none());
        assert!(s.is_empty());
        assert_eq!(s.bytes(), 0);
    }

    #[tokio::test]
    async fn one_shared_store_per_scope_while_it_lives() {
        let a = shared_responses("RS_SHARED_A");
        let b = shared_responses("RS_SHARED_A");
        let c = shared_responses("RS_SHARED_B");
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        a.put(entry("RS_SHARED_A", "r", "x"), UNBOUNDED)
            .await
            .unwrap();
        assert!(b.get("RS_SHARED_A", "r", T0).await.unwrap().is_some());
        // The first creation's bounds hold; once every handle is gone, a new store.
        let small = ResponseStoreLimits {
            max_entries: 1,
            max_bytes: 1 << 20,
        };
        assert_eq!(
            shared_responses_with("RS_SHARED_A", small).limits(),
            a.limits()
        );
        drop((a, b));
        let d = shared_responses_with("RS_SHARED_A", small);
        assert_eq!(d.limits(), small);
        assert!(d.is_empty());
        // Usable as the port.
        let _port: Arc<dyn ResponseStore> = d;
    }
}
