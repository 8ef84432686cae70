//! Governance through the engine (issue 14, SPEC §14.6, §14.7, §14.11), on tokio's paused
//! clock with the fake transport: waiting calls cost the backend O(N) acquires per hint
//! (not per 50 ms) and a freed slot wakes one waiter; outcomes count only in the breaker
//! epoch they were admitted under; a half-open probe is freed when the call is dropped
//! while its admission is in flight; two clients of one scope share its memory quota.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use polygw::core::breaker::BreakerOutcome;
use polygw::core::ports::{
    AcquireRequest, Admission, BreakerStore, Clock, RateLimiter, SplitMix64,
};
use polygw::core::GovernanceError;
use polygw::{ChatRequest, GatewayClient, ScopeSettings, SourceConfig, TerminalReason};
use polygw_limiter_memory::{MemoryBreakerStore, MemoryLimiter};
use polygw_testkit::clock::TokioClock;
use polygw_testkit::fakes::{FakeTransport, RecordingTelemetry, Script};

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn scope(name: &str, n: usize) -> ScopeSettings {
    let sources = (0..n)
        .map(|i| SourceConfig::new("s", i as u32, "http://127.0.0.1:9/v1", "", "m"))
        .collect();
    let mut s = ScopeSettings::new(name, sources);
    s.retry.backoff_base = Duration::from_millis(100);
    s.retry.backoff_max = secs(1);
    s
}

/// Every acquire the engine makes, with its time and whether it was admitted.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn RateLimiter>,
    clock: Arc<dyn Clock>,
    calls: Mutex<Vec<(Instant, bool)>>,
}

impl Counting {
    fn at(&self, t: Instant) -> usize {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.0 == t)
            .count()
    }
    fn total(&self) -> usize {
        self.calls.lock().unwrap().len()
    }
}

#[async_trait]
impl RateLimiter for Counting {
    async fn acquire<'r>(&self, req: &AcquireRequest<'r>) -> Result<Admission, GovernanceError> {
        let r = self.inner.acquire(req).await?;
        let admitted = matches!(r, Admission::Admitted(_));
        self.calls
            .lock()
            .unwrap()
            .push((self.clock.now(), admitted));
        Ok(r)
    }
    async fn in_flight(&self, scope: &str, source: &str) -> Result<u32, GovernanceError> {
        self.inner.in_flight(scope, source).await
    }
}

/// SPEC §14.6: N calls waiting for the one slot of a busy source cost the limiter O(N)
/// acquires per hint (the earliest lease end), not one per 50 ms each; and each slot an
/// attempt frees wakes one waiter, not all of them.
#[tokio::test(start_paused = true)]
async fn waiting_calls_cost_o_n_acquires_and_a_freed_slot_wakes_one() {
    const N: usize = 40;
    let clock: Arc<dyn Clock> = Arc::new(TokioClock);
    let fake = FakeTransport::new(clock.clone());
    let counting = Arc::new(Counting {
        inner: Arc::new(MemoryLimiter::new(clock.clone())),
        clock: clock.clone(),
        calls: Mutex::new(vec![]),
    });
    let mut s = scope("WAIT", 1);
    s.sources[0].max_concurrency = 1;
    s.retry.stall_window = secs(600);
    fake.push("s-0", Script::ok(secs(20), "first"));
    fake.set_default("s-0", Script::ok(secs(1), "next"));
    let client = GatewayClient::builder(s)
        .transport(fake.clone())
        .telemetry(RecordingTelemetry::new())
        .limiter(counting.clone())
        .breakers(Arc::new(MemoryBreakerStore::new(clock.clone())))
        .clock(clock.clone())
        .rng(Arc::new(SplitMix64::new(3)))
        .build()
        .await
        .unwrap();
    let first = tokio::spawn({
        let c = client.clone();
        async move { c.chat(ChatRequest::user("hold")).await }
    });
    fake.wait_until(|calls| calls.len() == 1).await;
    let mut waiters = vec![];
    for i in 0..N {
        let c = client.clone();
        waiters.push(tokio::spawn(async move {
            c.chat(ChatRequest::user(format!("wait {i}"))).await
        }));
    }
    // While the slot is held for 20 s, every waiter asks once, then once per hint.
    tokio::time::sleep(secs(19)).await;
    let while_held = counting.total();
    assert!(
        while_held <= 3 * N + 1,
        "{while_held} acquires while {N} calls waited 19 s (polling every 50 ms made ~{})",
        N * 380
    );
    first.await.unwrap().unwrap();
    // The holder ended at 20 s: one waiter was woken and admitted at that instant.
    let t20 = fake
        .calls()
        .iter()
        .find_map(|c| c.ended)
        .expect("the first call ended");
    assert!(
        counting.at(t20) <= 2,
        "{} acquires at the instant one slot freed (every waiter woke)",
        counting.at(t20)
    );
    for w in waiters {
        let r = w.await.unwrap().unwrap();
        assert_eq!(r.content, "next");
    }
    // Each waiter: a first refusal, a few hint expiries over the ~60 s it waited, one
    // admission.
    let total = counting.total();
    assert!(total <= 6 * N, "{total} acquires for {N} waiting calls");
    assert_eq!(
        counting
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.1)
            .count(),
        N + 1
    );
}

struct Breakers {
    client: GatewayClient,
    fake: Arc<FakeTransport>,
    breakers: Arc<MemoryBreakerStore>,
}

async fn breakers(f: impl FnOnce(&mut ScopeSettings)) -> Breakers {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock);
    let fake = FakeTransport::new(clock.clone());
    let breakers = Arc::new(MemoryBreakerStore::new(clock.clone()));
    let mut s = scope("EPOCH", 1);
    s.breaker.failures = 1;
    s.retry.on_no_runnable = polygw::core::OnNoRunnable::Fail;
    f(&mut s);
    let client = GatewayClient::builder(s)
        .transport(fake.clone())
        .telemetry(RecordingTelemetry::new())
        .limiter(Arc::new(MemoryLimiter::new(clock.clone())))
        .breakers(breakers.clone())
        .clock(clock)
        .rng(Arc::new(SplitMix64::new(5)))
        .build()
        .await
        .unwrap();
    Breakers {
        client,
        fake,
        breakers,
    }
}

/// SPEC §14.7: a success of an attempt admitted before the breaker tripped does not
/// close it.
#[tokio::test(start_paused = true)]
async fn a_success_admitted_before_a_trip_does_not_close_the_breaker() {
    // Open longer than the slow success takes (the default 2 s would be half-open by
    // then: the refused call would be the probe).
    let h = breakers(|s| s.breaker.open = secs(30)).await;
    h.fake.push("s-0", Script::ok(secs(5), "slow success"));
    h.fake
        .push("s-0", Script::http(Duration::from_millis(10), 500));
    let slow = tokio::spawn({
        let c = h.client.clone();
        async move { c.chat(ChatRequest::user("slow")).await }
    });
    h.fake.wait_until(|calls| calls.len() == 1).await;
    let failing = h.client.chat(ChatRequest::user("fails")).await;
    assert!(failing.is_err());
    assert!(h.breakers.state("EPOCH", "s-0").await.unwrap().is_tripped());
    assert_eq!(slow.await.unwrap().unwrap().content, "slow success");
    assert!(
        h.breakers.state("EPOCH", "s-0").await.unwrap().is_tripped(),
        "the success from before the trip closed the breaker"
    );
    let e = h
        .client
        .chat(ChatRequest::user("refused"))
        .await
        .unwrap_err();
    assert_eq!(
        e.terminal_reason(),
        Some(TerminalReason::NoRunnableSource),
        "{e}"
    );
}

/// Nothing but the dead period ending revives a dead source: a success in flight when
/// the key was revoked (401) does not bring it back.
#[tokio::test(start_paused = true)]
async fn a_success_in_flight_does_not_revive_a_dead_source() {
    let h = breakers(|s| {
        s.breaker.dead = secs(300);
        s.breaker.dead_after = 1;
    })
    .await;
    h.fake.push("s-0", Script::ok(secs(5), "slow success"));
    h.fake
        .push("s-0", Script::http(Duration::from_millis(10), 401));
    let slow = tokio::spawn({
        let c = h.client.clone();
        async move { c.chat(ChatRequest::user("slow")).await }
    });
    h.fake.wait_until(|calls| calls.len() == 1).await;
    assert!(h.client.chat(ChatRequest::user("revoked")).await.is_err());
    slow.await.unwrap().unwrap();
    tokio::time::sleep(secs(2)).await;
    let st = h.breakers.state("EPOCH", "s-0").await.unwrap();
    assert!(st.dead_until > 0, "dead");
    assert!(h
        .client
        .chat(ChatRequest::user("still dead"))
        .await
        .is_err());
    assert_eq!(
        h.fake.calls_to("s-0"),
        2,
        "no request reached the dead source"
    );
}

/// A limiter whose acquire never answers (a Redis round trip that hangs).
#[derive(Debug)]
struct Hanging;

#[async_trait]
impl RateLimiter for Hanging {
    async fn acquire<'r>(&self, _req: &AcquireRequest<'r>) -> Result<Admission, GovernanceError> {
        std::future::pending().await
    }
    async fn in_flight(&self, _scope: &str, _source: &str) -> Result<u32, GovernanceError> {
        Ok(0)
    }
}

/// SPEC §14.7: a half-open probe is released on every path — here the caller drops the
/// call while its admission (the limiter's round trip) is in flight. The probe used to
/// stay out until its lease ended, the source refused as `circuit_open` meanwhile.
#[tokio::test(start_paused = true)]
async fn a_probe_is_freed_when_the_call_is_dropped_during_admission() {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock);
    let breakers = Arc::new(MemoryBreakerStore::new(clock.clone()));
    let mut s = scope("PROBE", 1);
    s.breaker.failures = 1;
    s.breaker.open = secs(10);
    let client = GatewayClient::builder(s.clone())
        .transport(FakeTransport::new(clock.clone()))
        .telemetry(RecordingTelemetry::new())
        .limiter(Arc::new(Hanging))
        .breakers(breakers.clone())
        .clock(clock)
        .build()
        .await
        .unwrap();
    breakers
        .record(
            "PROBE",
            "s-0",
            BreakerOutcome::Failure,
            0,
            false,
            &s.breaker,
        )
        .await
        .unwrap();
    tokio::time::sleep(secs(11)).await;
    let dropped = tokio::time::timeout(
        secs(1),
        client.chat(ChatRequest::user("hangs in admission")),
    )
    .await;
    assert!(dropped.is_err(), "the call was still in admission");
    let st = breakers.state("PROBE", "s-0").await.unwrap();
    assert_eq!(st.epoch, 2, "the dropped call had been granted the probe");
    assert_eq!(st.probe_until, 0, "the probe is free again");
    match breakers.admit("PROBE", "s-0", secs(30)).await.unwrap() {
        polygw::core::breaker::BreakerAdmit::Allowed { probe, .. } => assert!(probe),
        other => panic!("the probe leaked: {other:?}"),
    }
}

/// SPEC §14.11: two clients of one scope in one process share its memory quota (the
/// wiring's per-process store); each used to get the full quota.
#[tokio::test]
async fn two_clients_of_one_scope_share_its_quota() {
    let name = polygw_testkit::services::unique_name("TWO").to_uppercase();
    let mut s = scope(&name, 1);
    s.sources[0].rpm = 2;
    s.retry.on_no_runnable = polygw::core::OnNoRunnable::Fail;
    let build = || async {
        GatewayClient::builder(s.clone())
            .transport(FakeTransport::new(Arc::new(TokioClock)))
            .telemetry(RecordingTelemetry::new())
            .build()
            .await
            .unwrap()
    };
    let a = build().await;
    let b = build().await;
    a.chat(ChatRequest::user("1")).await.unwrap();
    b.chat(ChatRequest::user("2")).await.unwrap();
    for c in [&a, &b] {
        let e = c.chat(ChatRequest::user("3")).await.unwrap_err();
        assert_eq!(
            e.terminal_reason(),
            Some(TerminalReason::NoRunnableSource),
            "{e}"
        );
    }
}
