//! The races a review of the imperative round found (issue 13), each a regression test
//! of the engine that now executes core's round state machine: tokio's paused clock and
//! event-driven fakes, no real time.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use polygw::core::breaker::{BreakerAdmit, BreakerOutcome, BreakerState};
use polygw::core::ports::{
    AcquireRequest, Admission, BreakerStore, RateLimiter, SplitMix64, StreamDelta,
};
use polygw::core::telemetry::RowKind;
use polygw::core::{BreakerSettings, GovernanceError};
use polygw::{
    ChatRequest, Commit, DeltaSink, ErrorClass, ErrorLabel, GatewayClient, ScopeSettings,
    SourceConfig, TerminalReason, UsageSource,
};
use polygw_limiter_memory::{MemoryBreakerStore, MemoryLimiter};
use polygw_testkit::clock::TokioClock;
use polygw_testkit::fakes::{FakeTransport, RecordingTelemetry, Script};
use tokio::time::Instant;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn scope(n: usize) -> ScopeSettings {
    let sources = (0..n)
        .map(|i| {
            let mut s =
                SourceConfig::new("s", i as u32, "http://127.0.0.1:9/v1", "", format!("m{i}"));
            s.priority = i as u32;
            s
        })
        .collect();
    let mut s = ScopeSettings::new("LLM", sources);
    s.retry.backoff_base = ms(10);
    s.retry.backoff_max = ms(20);
    s.hedge.budget_pct = 0;
    s
}

/// A breaker store whose `record` takes `delay` (a slow Redis round trip).
#[derive(Debug)]
struct SlowBreakers {
    inner: MemoryBreakerStore,
    delay: Duration,
}

#[async_trait]
impl BreakerStore for SlowBreakers {
    async fn admit(
        &self,
        scope: &str,
        source: &str,
        probe_lease: Duration,
    ) -> Result<BreakerAdmit, GovernanceError> {
        self.inner.admit(scope, source, probe_lease).await
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
        tokio::time::sleep(self.delay).await;
        self.inner
            .record(scope, source, outcome, epoch, probe, settings)
            .await
    }
    fn release_probe(&self, scope: &str, source: &str, epoch: u64) {
        self.inner.release_probe(scope, source, epoch)
    }
    async fn state(&self, scope: &str, source: &str) -> Result<BreakerState, GovernanceError> {
        self.inner.state(scope, source).await
    }
    async fn clock_ms(&self) -> Result<u64, GovernanceError> {
        self.inner.clock_ms().await
    }
    async fn reset(&self, scope: &str, source: &str) -> Result<(), GovernanceError> {
        self.inner.reset(scope, source).await
    }
    async fn set_drained(
        &self,
        scope: &str,
        source: &str,
        drained: bool,
    ) -> Result<(), GovernanceError> {
        self.inner.set_drained(scope, source, drained).await
    }
}

/// A limiter whose acquire for one source takes `delay`.
#[derive(Debug)]
struct SlowAdmission {
    inner: MemoryLimiter,
    slow_source: String,
    delay: Duration,
}

#[async_trait]
impl RateLimiter for SlowAdmission {
    async fn acquire<'r>(&self, req: &AcquireRequest<'r>) -> Result<Admission, GovernanceError> {
        if req.source == self.slow_source {
            tokio::time::sleep(self.delay).await;
        }
        self.inner.acquire(req).await
    }
    async fn in_flight(&self, scope: &str, source: &str) -> Result<u32, GovernanceError> {
        self.inner.in_flight(scope, source).await
    }
}

/// Records what a passthrough stream delivers, and when.
#[derive(Default)]
struct Recorder {
    commits: Mutex<Vec<Commit>>,
    chunks: Mutex<Vec<(Instant, String)>>,
}

impl DeltaSink for Recorder {
    fn committed(&self, c: &Commit) {
        self.commits.lock().unwrap().push(c.clone());
    }
    fn send(&self, d: StreamDelta) {
        self.chunks
            .lock()
            .unwrap()
            .push((Instant::now(), d.content.unwrap_or_default()));
    }
}

impl Recorder {
    fn text(&self) -> String {
        self.chunks
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.1.clone())
            .collect()
    }
}

struct H {
    client: GatewayClient,
    fake: Arc<FakeTransport>,
    rows: Arc<RecordingTelemetry>,
}

async fn harness(
    s: ScopeSettings,
    limiter: Option<Arc<dyn RateLimiter>>,
    breakers: Option<Arc<dyn BreakerStore>>,
) -> H {
    let clock = Arc::new(TokioClock);
    let fake = FakeTransport::new(clock.clone());
    let rows = RecordingTelemetry::new();
    let limiter = limiter.unwrap_or_else(|| Arc::new(MemoryLimiter::new(clock.clone())));
    let breakers = breakers.unwrap_or_else(|| Arc::new(MemoryBreakerStore::new(clock.clone())));
    let client = GatewayClient::builder(s)
        .transport(fake.clone())
        .telemetry(rows.clone())
        .limiter(limiter)
        .breakers(breakers)
        .clock(clock)
        .rng(Arc::new(SplitMix64::new(7)))
        .build()
        .await
        .expect("client");
    H { client, fake, rows }
}

fn attempt_labels(h: &H) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = h
        .rows
        .rows()
        .into_iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .map(|r| {
            (
                r.source.as_deref().unwrap_or_default().to_string(),
                r.error.clone().unwrap_or_else(|| "ok".into()),
            )
        })
        .collect();
    v.sort();
    v
}

/// A second leg completing in the same poll that commits the first: the client gets
/// the committed leg's answer and source, never the other's end on the first's text.
#[tokio::test(start_paused = true)]
async fn passthrough_co_completion_returns_the_committed_leg() {
    for offset in [0u64, 1, 2] {
        let mut s = scope(2);
        s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(100));
        let h = harness(s, None, None).await;
        // Leg 0: one chunk and done at 300 ms; leg 1 (launched at 100 ms): the same
        // instant (offset 0) or just after.
        h.fake
            .push("s-0", Script::stream(ms(300), &[], "first answer"));
        h.fake
            .push("s-1", Script::stream(ms(200 + offset), &[], "second"));
        let sink = Arc::new(Recorder::default());
        let r = h
            .client
            .chat_streaming(ChatRequest::user("x").with_stream(true), sink.clone())
            .await
            .unwrap();
        let commits = sink.commits.lock().unwrap().clone();
        assert_eq!(commits.len(), 1, "offset {offset}");
        assert_eq!(
            sink.text(),
            r.content,
            "offset {offset}: the answer is what was streamed"
        );
        assert_eq!(
            commits[0].source, r.source,
            "offset {offset}: x-polygw-source is the winner"
        );
    }
}

/// The deadline fires while the winner is being finalized (a slow breaker store): its
/// row keeps its success and measured usage, not `hedge_cancelled`.
#[tokio::test(start_paused = true)]
async fn a_deadline_while_finalizing_keeps_the_winners_row() {
    let mut s = scope(2);
    s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(100));
    s.call_deadline = Some(ms(1000));
    let clock = Arc::new(TokioClock);
    let slow = Arc::new(SlowBreakers {
        inner: MemoryBreakerStore::new(clock),
        delay: ms(2000),
    });
    let h = harness(s, None, Some(slow)).await;
    h.fake.push("s-0", Script::ok(ms(400), "winner"));
    h.fake.push("s-1", Script::ok(ms(300), "co-winner"));
    let e = h
        .client
        .chat(ChatRequest::user("x").with_stream(true))
        .await
        .unwrap_err();
    assert_eq!(e.terminal_reason(), Some(TerminalReason::DeadlineExceeded));
    let rows: Vec<_> = h
        .rows
        .rows()
        .into_iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .collect();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert!(r.ok, "{r:?}");
        assert_eq!(r.error, None, "never hedge_cancelled: {r:?}");
        assert_eq!(r.usage_source, UsageSource::Measured);
    }
}

/// STALL_AFTER_S < AFTER_S: the stall hedge starts at its own time.
#[tokio::test(start_paused = true)]
async fn the_stall_hedge_fires_before_a_later_first_token_timer() {
    let mut s = scope(2);
    s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(5000));
    s.hedge.stall_after = polygw_core::hedge::ThresholdSetting::Static(ms(1000));
    let h = harness(s, None, None).await;
    let t0 = Instant::now();
    h.fake
        .push("s-0", Script::stream(ms(100), &[ms(10_000)], "ab"));
    h.fake
        .push("s-1", Script::stream(ms(100), &[ms(100)], "cd"));
    let r = h
        .client
        .chat(ChatRequest::user("x").with_stream(true))
        .await
        .unwrap();
    assert_eq!(r.source, "s-1");
    let calls = h.fake.calls();
    let hedge_at = calls[1].started.duration_since(t0.into_std());
    assert_eq!(hedge_at, ms(1100), "launched 1 s after the last chunk");
}

/// A hedge admission that takes long (a slow Redis): the committed leg's chunks are
/// forwarded as they come, not after the admission answers.
#[tokio::test(start_paused = true)]
async fn legs_run_while_the_round_awaits_an_admission() {
    let mut s = scope(2);
    s.hedge.stall_after = polygw_core::hedge::ThresholdSetting::Static(ms(150));
    let clock = Arc::new(TokioClock);
    let slow = Arc::new(SlowAdmission {
        inner: MemoryLimiter::new(clock),
        slow_source: "s-1".into(),
        delay: ms(5000),
    });
    let h = harness(s, Some(slow), None).await;
    // Chunks at 100, 400 (after a stall that triggers the slow hedge pick at 250), 500.
    h.fake
        .push("s-0", Script::stream(ms(100), &[ms(300), ms(100)], "abc"));
    let sink = Arc::new(Recorder::default());
    let t0 = Instant::now();
    let r = h
        .client
        .chat_streaming(ChatRequest::user("x").with_stream(true), sink.clone())
        .await
        .unwrap();
    assert_eq!(r.content, "abc");
    let times: Vec<Duration> = sink
        .chunks
        .lock()
        .unwrap()
        .iter()
        .map(|(t, _)| t.duration_since(t0))
        .collect();
    assert_eq!(
        times,
        [ms(100), ms(400), ms(500)],
        "no chunk waited for the admission"
    );
}

/// A committed leg that fails in its commit poll: the other leg lost to the commit
/// (`hedge_cancelled`), and the stream is resumed on it by replay.
#[tokio::test(start_paused = true)]
async fn a_committed_leg_failing_in_its_commit_poll() {
    let mut s = scope(2);
    s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(100));
    let h = harness(s, None, None).await;
    h.fake.push(
        "s-0",
        Script::ChunksThenFail {
            ttft: ms(200),
            gaps: vec![],
            after_last: Duration::ZERO,
            error: polygw::AttemptError::new(ErrorClass::Transient, ErrorLabel::Truncated, "cut"),
        },
    );
    h.fake.push("s-1", Script::Hang);
    h.fake.push("s-1", Script::stream(ms(10), &[], "xyz"));
    let sink = Arc::new(Recorder::default());
    let r = h
        .client
        .chat_streaming(ChatRequest::user("x").with_stream(true), sink.clone())
        .await
        .unwrap();
    assert_eq!(r.content, "xyz");
    assert_eq!(sink.text(), "xyz", "x, then the replay's remainder yz");
    assert_eq!(
        attempt_labels(&h),
        [
            ("s-0".to_string(), "truncated".to_string()),
            ("s-1".to_string(), "hedge_cancelled".to_string()),
            ("s-1".to_string(), "ok".to_string()),
        ]
    );
}

/// Dropping a passthrough call mid-stream: every leg is `cancelled` (never
/// `hedge_cancelled`), decided by the round's state machine from the drop.
#[tokio::test(start_paused = true)]
async fn a_dropped_call_labels_every_leg_cancelled() {
    let mut s = scope(2);
    s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(100));
    let h = harness(s, None, None).await;
    h.fake.push("s-0", Script::Hang);
    h.fake.push("s-1", Script::Hang);
    let sink = Arc::new(Recorder::default());
    let r = tokio::time::timeout(
        ms(500),
        h.client
            .chat_streaming(ChatRequest::user("x").with_stream(true), sink),
    )
    .await;
    assert!(r.is_err());
    assert_eq!(
        attempt_labels(&h),
        [
            ("s-0".to_string(), "cancelled".to_string()),
            ("s-1".to_string(), "cancelled".to_string()),
        ]
    );
}

/// A chunk the transport hands over while its leg stays pending reaches the caller at
/// once: the round sees the event its own poll queued (it does not wake its own task
/// for it, see `EventQueue`), without waiting for the leg to end or another wake.
#[tokio::test(start_paused = true)]
async fn a_chunk_queued_during_the_rounds_own_poll_is_delivered_at_once() {
    use futures_util::StreamExt;
    let h = harness(scope(1), None, None).await;
    let fail = polygw::core::AttemptError::new(
        polygw::core::ErrorClass::Transient,
        polygw::core::ErrorLabel::Timeout,
        "late",
    );
    // One chunk at 10 ms, then nothing for an hour (then a failure).
    h.fake.push(
        "s-0",
        Script::ChunksThenFail {
            ttft: ms(10),
            gaps: vec![],
            after_last: Duration::from_secs(3600),
            error: fail,
        },
    );
    let start = Instant::now();
    let mut st = h.client.chat_stream(ChatRequest::user("x"));
    let first_text = loop {
        match st.next().await {
            Some(Ok(polygw::ChatEvent::Delta(d))) if d.is_incremental() => break start.elapsed(),
            Some(Ok(_)) => continue,
            other => panic!("no chunk before the end: {other:?}"),
        }
    };
    assert!(
        first_text < ms(100),
        "the chunk reached the caller after {first_text:?}, not at 10 ms"
    );
}

/// An attempt no provider billed (a connect failure), dropped while its decided outcome
/// is being recorded (a slow breaker store; the caller gives up): the call's key settles
/// what its row charges (0, SPEC §24.2), as when the attempt finishes — not its
/// reservation (the chaos suite found the two paths disagreeing under Redis).
#[tokio::test(start_paused = true)]
async fn an_unbilled_attempt_dropped_while_finishing_charges_its_key_nothing() {
    use polygw::core::client_key::{ClientKey, KeyLimits};
    let mut s = scope(1);
    s.sources[0] = s.sources[0].clone().with_prices(1.0, 2.0);
    let clock = Arc::new(TokioClock);
    let slow = Arc::new(SlowBreakers {
        inner: MemoryBreakerStore::new(clock),
        delay: ms(2000),
    });
    let h = harness(s, None, Some(slow)).await;
    h.fake.push(
        "s-0",
        Script::fail(ms(10), ErrorClass::Transient, ErrorLabel::Connect),
    );
    let key = ClientKey {
        id: "key_race".into(),
        name: "race".into(),
        hash: "0".repeat(64),
        prefix: "pgw-race".into(),
        scopes: vec![],
        models: vec![],
        limits: KeyLimits {
            budget_day_nanos: Some(1_000_000_000),
            ..KeyLimits::default()
        },
        created_at_ms: 0,
        updated_at_ms: 0,
        revoked_at_ms: None,
    };
    let req = ChatRequest::user("x");
    let charge = h.client.admit_key(&key, &req).await.expect("admitted");
    let options = polygw::CallOptions::default().with_client_key(charge);
    let call = h.client.chat_with(req, options);
    assert!(
        tokio::time::timeout(ms(500), call).await.is_err(),
        "the call is still finishing its attempt when the caller gives up"
    );
    // The settlement goes through the background; let it run.
    tokio::time::sleep(ms(10)).await;
    let rows = h.rows.rows();
    let att: Vec<_> = rows.iter().filter(|r| r.kind == RowKind::Attempt).collect();
    assert_eq!(att.len(), 1, "{rows:?}");
    assert_eq!(att[0].error.as_deref(), Some("connect"));
    assert_eq!(polygw::core::telemetry::key_cost(att[0]), Some(0.0));
    let u = h.client.key_usage("key_race").await.unwrap();
    assert_eq!((u.in_flight, u.reserved_nanos), (0, 0));
    assert_eq!(
        u.day_nanos, 0,
        "the key was charged for an unbilled attempt"
    );
}

/// A client key whose budget holds the call's own reservation and nothing more:
/// admitted, its first leg runs, but the hedge leg's top-up is refused, so the hedge is
/// not launched and the call goes on without it (SPEC §24.1).
#[tokio::test(start_paused = true)]
async fn a_hedge_the_keys_budget_cannot_fund_is_not_launched() {
    let mut s = scope(2);
    for src in &mut s.sources {
        *src = src.clone().with_prices(1.0, 2.0);
    }
    s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(100));
    s.hedge.budget_pct = 100;
    let h = harness(s.clone(), None, None).await;
    h.fake.push("s-0", Script::ok(ms(400), "slow but fine"));
    h.fake.push("s-1", Script::ok(ms(10), "fast"));
    let req = ChatRequest::user("x");
    let admission = admission_nanos(&req, &s);
    let key = budget_key("key_tight", admission);
    let charge = h.client.admit_key(&key, &req).await.expect("admitted");
    let r = h
        .client
        .chat_with(req, polygw::CallOptions::default().with_client_key(charge))
        .await
        .unwrap();
    assert_eq!(r.content, "slow but fine");
    assert_eq!(h.fake.calls_to("s-1"), 0, "the hedge was launched");
    tokio::time::sleep(ms(10)).await;
    let u = h.client.key_usage("key_tight").await.unwrap();
    let cost: u64 = h
        .rows
        .rows()
        .iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .map(|r| polygw::core::key_quota::cost_nanos(r.cost.unwrap()))
        .sum();
    assert_eq!((u.reserved_nanos, u.day_nanos), (0, cost));
}

/// A hedge the budget can fund is topped up before it launches; the leg that lost
/// (cancelled, its usage unknown) settles at its own reservation, the winner at its cost,
/// and the top-up is released (SPEC §24.1).
#[tokio::test(start_paused = true)]
async fn a_funded_hedge_settles_each_leg_at_its_cost_or_its_reservation() {
    let mut s = scope(2);
    s.sources[0] = s.sources[0].clone().with_prices(1.0, 2.0);
    s.sources[1] = s.sources[1].clone().with_prices(0.5, 1.0);
    s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(100));
    s.hedge.budget_pct = 100;
    let h = harness(s.clone(), None, None).await;
    h.fake.push("s-0", Script::ok(ms(400), "slow"));
    h.fake.push("s-1", Script::ok(ms(10), "fast"));
    let req = ChatRequest::user("x");
    let prompt = polygw::core::resume::estimate_prompt_tokens(&req);
    let cap = Some(polygw::core::key_funds::default_cap(&s.sources));
    let key = budget_key("key_roomy", 1_000_000_000);
    let charge = h.client.admit_key(&key, &req).await.expect("admitted");
    let r = h
        .client
        .chat_with(req, polygw::CallOptions::default().with_client_key(charge))
        .await
        .unwrap();
    assert_eq!(r.content, "fast");
    tokio::time::sleep(ms(10)).await;
    let rows: Vec<_> = h
        .rows
        .rows()
        .into_iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let lost = rows.iter().find(|r| !r.ok).unwrap();
    assert_eq!(lost.source.as_deref(), Some("s-0"));
    assert_eq!(lost.cost, None, "{lost:?}");
    let won = rows.iter().find(|r| r.ok).unwrap();
    let leg0 =
        polygw::core::key_funds::leg_reserve_nanos(prompt, cap, 25, &s.sources[0], &s.sources, 0);
    let u = h.client.key_usage("key_roomy").await.unwrap();
    assert_eq!(u.reserved_nanos, 0);
    assert_eq!(
        u.day_nanos,
        leg0 + polygw::core::key_quota::cost_nanos(won.cost.unwrap())
    );
}

/// What the admission of `req` reserves on scope `s` without a cap of its own (the
/// default cap, the default margin).
fn admission_nanos(req: &ChatRequest, s: &ScopeSettings) -> u64 {
    polygw::core::key_quota::key_reservation(
        polygw::core::resume::estimate_prompt_tokens(req),
        Some(polygw::core::key_funds::default_cap(&s.sources)),
        25,
        &s.sources,
        0,
    )
    .nanos
    .expect("a priced scope")
}

fn budget_key(id: &str, day_nanos: u64) -> polygw::core::client_key::ClientKey {
    use polygw::core::client_key::{ClientKey, KeyLimits};
    ClientKey {
        id: id.into(),
        name: id.into(),
        hash: "0".repeat(64),
        prefix: "pgw-test".into(),
        scopes: vec![],
        models: vec![],
        limits: KeyLimits {
            budget_day_nanos: Some(day_nanos),
            ..KeyLimits::default()
        },
        created_at_ms: 0,
        updated_at_ms: 0,
        revoked_at_ms: None,
    }
}

/// A retry the key's budget cannot fund (SPEC §24.1): the first attempt timed out, so it
/// may have been billed and settles at its reservation, which is all the budget holds;
/// the retry's top-up is refused, so no second attempt is made and the call ends naming
/// the budget. The key settles exactly that one reservation.
#[tokio::test(start_paused = true)]
async fn a_retry_the_keys_budget_cannot_fund_is_not_made() {
    let mut s = scope(1);
    s.sources[0] = s.sources[0].clone().with_prices(1.0, 2.0);
    let h = harness(s.clone(), None, None).await;
    h.fake.push(
        "s-0",
        Script::fail(ms(10), ErrorClass::Transient, ErrorLabel::Timeout),
    );
    h.fake.set_default("s-0", Script::ok(ms(10), "too late"));
    let req = ChatRequest::user("x");
    let admission = admission_nanos(&req, &s);
    let key = budget_key("key_retry", admission);
    let charge = h.client.admit_key(&key, &req).await.expect("admitted");
    let e = h
        .client
        .chat_with(req, polygw::CallOptions::default().with_client_key(charge))
        .await
        .unwrap_err();
    assert_eq!(h.fake.calls_to("s-0"), 1, "the retry was made: {e}");
    assert!(e.to_string().contains("key_budget_day"), "{e}");
    tokio::time::sleep(ms(10)).await;
    let u = h.client.key_usage("key_retry").await.unwrap();
    assert_eq!((u.reserved_nanos, u.day_nanos), (0, admission));
}

/// Wall time that moves with tokio's paused clock from a chosen instant (for tests that
/// cross a UTC day's end).
#[derive(Debug)]
struct PausedUnixClock {
    start: Instant,
    unix_ms: i64,
}

impl polygw::core::ports::Clock for PausedUnixClock {
    fn now(&self) -> std::time::Instant {
        Instant::now().into_std()
    }
    fn unix_ms(&self) -> i64 {
        self.unix_ms + (Instant::now() - self.start).as_millis() as i64
    }
}

/// A UTC day's end under load (SPEC §24.1, §24.2): 32 clients keep calling with one key
/// from 30 s before midnight to 60 s after, each call 2.5 s long, so calls admitted
/// before midnight settle after it. Each day's settled spend stays within the day's
/// budget (a reservation made yesterday still counts today until it settles), what the
/// key settled is what the upstream billed, and both days' budgets are used (a gateway
/// that refuses everything across the boundary does not pass).
#[tokio::test(start_paused = true)]
async fn a_days_end_under_load_settles_each_day_within_its_budget() {
    // 2026-12-07T00:00:00Z, 30 s ahead.
    let midnight = 1_796_601_600_000_i64;
    let clock = Arc::new(PausedUnixClock {
        start: Instant::now(),
        unix_ms: midnight - 30_000,
    });
    let mut s = scope(1);
    s.sources[0] = s.sources[0].clone().with_prices(1.0, 2.0);
    let fake = FakeTransport::new(clock.clone());
    let rows = RecordingTelemetry::new();
    let limiter = Arc::new(MemoryLimiter::new(clock.clone()));
    let client = GatewayClient::builder(s)
        .transport(fake.clone())
        .telemetry(rows.clone())
        .limiter(limiter)
        .breakers(Arc::new(MemoryBreakerStore::new(clock.clone())))
        .clock(clock.clone())
        .rng(Arc::new(SplitMix64::new(7)))
        .build()
        .await
        .expect("client");
    fake.set_default("s-0", Script::ok(ms(2_500), "twenty chars of text"));
    // One call bills 10 prompt and 20 completion tokens: 50 000 nanos. The day's budget
    // pays 400 of them: a little more than the clients make in day one's last 30 s (so
    // calls are in flight at midnight and settle in day two), far less than in day
    // two's first 60 s (where the budget binds).
    let budget = 20_000_000;
    let key = budget_key("key_midnight", budget);
    let mut tasks = Vec::new();
    for i in 0..32u64 {
        let (client, key) = (client.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(ms(i * 97)).await;
            let mut billed = 0u32;
            let end = tokio::time::Instant::now() + ms(90_000 - i * 97);
            while tokio::time::Instant::now() < end {
                let req = ChatRequest::user("x").with_max_tokens(20);
                match client.admit_key(&key, &req).await {
                    Ok(charge) => {
                        client
                            .chat_with(req, polygw::CallOptions::default().with_client_key(charge))
                            .await
                            .expect("an admitted call is answered");
                        billed += 1;
                    }
                    Err(_) => tokio::time::sleep(ms(250)).await,
                }
            }
            billed
        }));
    }
    // The day's spend just before midnight.
    tokio::time::sleep(ms(30_000 - 1)).await;
    let before = client.key_usage("key_midnight").await.unwrap();
    assert_eq!(before.now_unix_ms, (midnight - 1) as u64);
    let mut calls = 0;
    for t in tasks {
        calls += t.await.unwrap();
    }
    tokio::time::sleep(ms(100)).await;
    let after = client.key_usage("key_midnight").await.unwrap();
    let billed: u64 = rows
        .rows()
        .iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .map(|r| polygw::core::key_quota::cost_nanos(r.cost.expect("billed")))
        .sum();
    let per_call = 50_000;
    assert_eq!(billed, calls as u64 * per_call);
    // Day one: what had settled by 23:59:59.999 (a usage's day figure is settled +
    // reserved); the calls then in flight settled in day two, and the two days' sum is
    // what the upstream billed.
    assert!(before.in_flight > 0, "no call crossed midnight: {before:?}");
    let day_one = before.day_nanos - before.reserved_nanos;
    assert_eq!(day_one + after.day_nanos, billed, "{before:?} {after:?}");
    assert!(day_one <= budget, "day one settled {day_one} of {budget}");
    assert!(
        after.day_nanos <= budget,
        "day two settled {} of {budget}",
        after.day_nanos
    );
    assert!(day_one >= budget / 2, "day one used {day_one} of {budget}");
    assert_eq!(
        after.day_nanos, budget,
        "day two's budget binds, used whole"
    );
    assert_eq!((after.in_flight, after.reserved_nanos), (0, 0));
    eprintln!(
        "{calls} calls: day one settled {day_one}, day two {} (budget {budget} each)",
        after.day_nanos
    );
}
