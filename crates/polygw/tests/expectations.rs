//! Exact call expectations on the ports (SPEC §16), with mockall mocks of
//! `polygw_core::ports` behind a `GatewayClient` built through its public builder:
//! every permit settled and released exactly once on every path (success, failure,
//! hedge loss, deadline, caller drop) with the tokens of SPEC §4.3, every half-open
//! probe released exactly once (§14.7), exactly one telemetry row per attempt plus the
//! terminal / cache-hit rows of docs/TELEMETRY.md, and no governance call at all for a
//! cache hit. Timing runs on tokio's paused clock: the only delays are those the
//! wrappers below put in front of a mock (an upstream's latency, a slow backend reply).
//!
//! These tests use only the public API of `polygw` and the port traits, and assert
//! what the specification requires, not how the engine gets there.

#![allow(
    clippy::result_large_err,
    reason = "mock answers are closures returning the Transport port's Result<_, AttemptError>"
)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use polygw::core::breaker::{BreakerAdmit, BreakerOutcome, BreakerState};
use polygw::core::ports::{
    AcquireRequest, Admission, BreakerStore, ChatAttempt, FlushReport, MockBreakerStore,
    MockPermitBackend, MockRateLimiter, MockResponseCache, MockTelemetryRecorder, MockTransport,
    Permit, RateLimiter, Refusal, Transport, TransportResult,
};
use polygw::core::settings::{BreakerSettings, OnNoRunnable};
use polygw::core::telemetry::{RowKind, TelemetryRow};
use polygw::core::{GovernanceError, RefusalReason};
use polygw::{
    AttemptError, ChatRequest, ErrorClass, ErrorLabel, GatewayClient, GatewayError, LlmResponse,
    ScopeSettings, SourceConfig, TerminalReason, Usage, UsageSource,
};

const EST: u64 = 100;
const USAGE: Usage = Usage {
    prompt_tokens: 7,
    completion_tokens: 5,
    reasoning_tokens: None,
    cached_prompt_tokens: None,
    cache_write_tokens: None,
    cache_write_1h_tokens: None,
};
const MEASURED: u64 = 12;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// `n` sources `s-0…`, each reserving `EST` tokens, in priority order.
fn scope(n: usize, f: impl FnOnce(&mut ScopeSettings)) -> ScopeSettings {
    let sources = (0..n)
        .map(|i| {
            let mut s = SourceConfig::new(
                "s",
                i as u32,
                "http://127.0.0.1:9/v1",
                "",
                format!("model-{i}"),
            )
            .with_est_tokens(EST);
            s.priority = i as u32;
            s
        })
        .collect();
    let mut s = ScopeSettings::new("LLM", sources);
    s.retry.backoff_base = ms(10);
    s.retry.backoff_max = ms(50);
    f(&mut s);
    s
}

fn ok_result() -> TransportResult {
    TransportResult {
        content: "hello".into(),
        finish_reason: Some("stop".into()),
        usage: USAGE,
        usage_source: UsageSource::Measured,
        http_status: 200,
        ..Default::default()
    }
}

fn http_500() -> AttemptError {
    AttemptError::new(ErrorClass::Transient, ErrorLabel::ServerError, "HTTP 500").with_status(500)
}

// ------------------------------------------------------------------ permit ledger

/// What the backend of one permit was asked to do.
#[derive(Debug, Clone, Default)]
struct PermitLog {
    source: String,
    est: u64,
    /// Every settlement, in tokens (`settle`, `settle_and_release`, `settle_on_drop(Some)`).
    settled: Vec<u64>,
    /// Every release (`release`, `settle_and_release`, `settle_on_drop`).
    released: u32,
}

/// Every permit the mock limiter granted, with what its backend saw.
#[derive(Debug, Clone, Default)]
struct Ledger(Arc<Mutex<Vec<PermitLog>>>);

impl Ledger {
    fn permits(&self) -> Vec<PermitLog> {
        self.0.lock().unwrap().clone()
    }

    /// A mock permit backend that logs into permit `id`. Each backend operation may
    /// happen at most once (the `Permit` wrapper makes them idempotent); the ledger
    /// checks that settlement and release happened exactly once in total.
    fn backend(&self, source: &str, est: u64) -> MockPermitBackend {
        let id = {
            let mut v = self.0.lock().unwrap();
            v.push(PermitLog {
                source: source.to_string(),
                est,
                ..Default::default()
            });
            v.len() - 1
        };
        let mut b = MockPermitBackend::new();
        let log = self.0.clone();
        b.expect_settle().times(0..=1).returning(move |t| {
            log.lock().unwrap()[id].settled.push(t);
            Ok(())
        });
        let log = self.0.clone();
        b.expect_release().times(0..=1).returning(move || {
            log.lock().unwrap()[id].released += 1;
            Ok(())
        });
        let log = self.0.clone();
        b.expect_settle_and_release()
            .times(0..=1)
            .returning(move |t| {
                let mut v = log.lock().unwrap();
                v[id].settled.push(t);
                v[id].released += 1;
                Ok(())
            });
        let log = self.0.clone();
        b.expect_settle_on_drop().times(0..=1).returning(move |t| {
            let mut v = log.lock().unwrap();
            if let Some(t) = t {
                v[id].settled.push(t);
            }
            v[id].released += 1;
        });
        b
    }

    /// Every permit settled exactly once, with `tokens(source)`, and released once.
    fn assert_settled(&self, tokens: impl Fn(&str) -> u64) {
        let permits = self.permits();
        assert!(!permits.is_empty(), "no permit was granted");
        for p in &permits {
            assert_eq!(
                p.settled,
                vec![tokens(&p.source)],
                "permit of {} (est {}): settled exactly once with the tokens of SPEC §4.3; ledger {permits:?}",
                p.source,
                p.est
            );
            assert_eq!(
                p.released, 1,
                "permit of {}: released exactly once; ledger {permits:?}",
                p.source
            );
        }
    }
}

/// A mock limiter admitting every request with a ledger-backed permit; `acquire` is
/// expected exactly `times` times.
fn admitting_limiter(ledger: &Ledger, times: usize) -> MockRateLimiter {
    let mut l = MockRateLimiter::new();
    let ledger = ledger.clone();
    l.expect_acquire().times(times).returning(move |req| {
        let backend = ledger.backend(req.source, req.est_tokens);
        Ok(Admission::Admitted(Permit::new(
            req.est_tokens,
            Box::new(backend),
        )))
    });
    l.expect_in_flight().returning(|_, _| Ok(0));
    l.expect_flush().returning(|| Ok(()));
    l
}

// ------------------------------------------------------------------ breaker log

/// One `BreakerStore::record` call.
#[derive(Debug, Clone, PartialEq)]
struct Recorded {
    source: String,
    outcome: BreakerOutcome,
    probe: bool,
}

#[derive(Debug, Clone, Default)]
struct BreakerLog(Arc<Mutex<Vec<Recorded>>>);

impl BreakerLog {
    fn all(&self) -> Vec<Recorded> {
        self.0.lock().unwrap().clone()
    }
    fn of(&self, source: &str) -> Vec<Recorded> {
        self.all()
            .into_iter()
            .filter(|r| r.source == source)
            .collect()
    }
    fn probes_released(&self) -> usize {
        self.all().iter().filter(|r| r.probe).count()
    }
}

/// A mock breaker store: `admit` answers `admit(source)` (any number of times),
/// `record` logs.
fn breakers(
    log: &BreakerLog,
    admit: impl Fn(&str) -> BreakerAdmit + Send + 'static,
) -> MockBreakerStore {
    let mut b = MockBreakerStore::new();
    b.expect_admit()
        .returning(move |_scope, source, _lease| Ok(admit(source)));
    let rec = log.clone();
    b.expect_record().returning(
        move |_scope, source, outcome, _epoch, probe, _s: &BreakerSettings| {
            rec.0.lock().unwrap().push(Recorded {
                source: source.to_string(),
                outcome,
                probe,
            });
            Ok(())
        },
    );
    // The non-blocking release of a probe that no outcome covers: a neutral record.
    let rel = log.clone();
    b.expect_release_probe()
        .returning(move |_scope, source, _epoch| {
            rel.0.lock().unwrap().push(Recorded {
                source: source.to_string(),
                outcome: BreakerOutcome::Neutral,
                probe: true,
            });
        });
    b.expect_flush().returning(|| Ok(()));
    b.expect_state()
        .returning(|_, _| Ok(BreakerState::default()));
    b
}

fn allowed(_: &str) -> BreakerAdmit {
    BreakerAdmit::Allowed {
        probe: false,
        epoch: 0,
    }
}

fn probe(_: &str) -> BreakerAdmit {
    BreakerAdmit::Allowed {
        probe: true,
        epoch: 0,
    }
}

// ------------------------------------------------------------------ telemetry

#[derive(Debug, Clone, Default)]
struct Rows(Arc<Mutex<Vec<TelemetryRow>>>);

impl Rows {
    fn all(&self) -> Vec<TelemetryRow> {
        self.0.lock().unwrap().clone()
    }
    fn of_kind(&self, kind: RowKind) -> Vec<TelemetryRow> {
        self.all().into_iter().filter(|r| r.kind == kind).collect()
    }
    fn attempt_of(&self, source: &str) -> Vec<TelemetryRow> {
        self.of_kind(RowKind::Attempt)
            .into_iter()
            .filter(|r| r.source.as_deref() == Some(source))
            .collect()
    }
    fn labels(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .of_kind(RowKind::Attempt)
            .iter()
            .map(|r| r.error.clone().unwrap_or_else(|| "ok".into()))
            .collect();
        v.sort();
        v
    }
}

/// A mock recorder expecting exactly `times` rows (of any kind).
fn recorder(rows: &Rows, times: usize) -> MockTelemetryRecorder {
    let mut t = MockTelemetryRecorder::new();
    let rows = rows.clone();
    t.expect_record()
        .times(times)
        .returning(move |row| rows.0.lock().unwrap().push(row));
    t.expect_keeps_rows().return_const(true);
    t.expect_dropped().returning(|| 0);
    t.expect_flush().returning(|| Ok(FlushReport::default()));
    t
}

// ------------------------------------------------------------------ timing wrappers

/// An upstream's latency in front of a mock transport: the mock is asked at once (so
/// its expectations count attempts started), its answer arrives after the source's
/// delay on tokio's (paused) clock.
#[derive(Debug)]
struct Paced {
    mock: MockTransport,
    delay: HashMap<String, Duration>,
}

#[async_trait]
impl Transport for Paced {
    async fn chat<'a>(&self, attempt: ChatAttempt<'a>) -> Result<TransportResult, AttemptError> {
        let out = self.mock.chat(attempt).await;
        let d = self
            .delay
            .get(&attempt.source.name)
            .copied()
            .unwrap_or_default();
        tokio::time::sleep(d).await;
        out
    }
}

/// A transport mock expecting `calls` (source, how many) and answering `answer`.
fn transport(
    calls: &[(&str, usize)],
    answer: impl Fn(&str) -> Result<TransportResult, AttemptError> + Send + Sync + 'static,
) -> MockTransport {
    let mut t = MockTransport::new();
    let answer = Arc::new(answer);
    for (source, n) in calls {
        let name = source.to_string();
        let answer = answer.clone();
        t.expect_chat()
            .withf(move |a| a.source.name == name)
            .times(*n)
            .returning(move |a| answer(&a.source.name));
    }
    t
}

fn paced(mock: MockTransport, delays: &[(&str, Duration)]) -> Arc<Paced> {
    Arc::new(Paced {
        mock,
        delay: delays.iter().map(|(s, d)| (s.to_string(), *d)).collect(),
    })
}

/// A limiter whose answers come back after `delay` (a slow Redis round trip): the
/// mock is asked at once, the reply is late.
#[derive(Debug)]
struct SlowLimiter {
    mock: MockRateLimiter,
    delay: Duration,
}

#[async_trait]
impl RateLimiter for SlowLimiter {
    async fn acquire<'r>(&self, req: &AcquireRequest<'r>) -> Result<Admission, GovernanceError> {
        let out = self.mock.acquire(req).await;
        tokio::time::sleep(self.delay).await;
        out
    }
    async fn in_flight(&self, scope: &str, source: &str) -> Result<u32, GovernanceError> {
        self.mock.in_flight(scope, source).await
    }
    async fn flush(&self) -> Result<(), GovernanceError> {
        self.mock.flush().await
    }
}

/// A breaker store whose `record` replies come back after `delay`.
#[derive(Debug)]
struct SlowRecord {
    mock: MockBreakerStore,
    delay: Duration,
}

#[async_trait]
impl BreakerStore for SlowRecord {
    async fn admit(
        &self,
        scope: &str,
        source: &str,
        probe_lease: Duration,
    ) -> Result<BreakerAdmit, GovernanceError> {
        self.mock.admit(scope, source, probe_lease).await
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
        let out = self
            .mock
            .record(scope, source, outcome, epoch, probe, settings)
            .await;
        tokio::time::sleep(self.delay).await;
        out
    }
    fn release_probe(&self, scope: &str, source: &str, epoch: u64) {
        self.mock.release_probe(scope, source, epoch)
    }
    async fn state(&self, scope: &str, source: &str) -> Result<BreakerState, GovernanceError> {
        self.mock.state(scope, source).await
    }
    async fn clock_ms(&self) -> Result<u64, GovernanceError> {
        self.mock.clock_ms().await
    }
    async fn reset(&self, scope: &str, source: &str) -> Result<(), GovernanceError> {
        self.mock.reset(scope, source).await
    }
    async fn set_drained(
        &self,
        scope: &str,
        source: &str,
        drained: bool,
    ) -> Result<(), GovernanceError> {
        self.mock.set_drained(scope, source, drained).await
    }
}

// ------------------------------------------------------------------ harness

/// The ports of one client, kept so their expectations can be verified at the end.
struct Ports {
    transport: Arc<dyn Transport>,
    limiter: Arc<dyn RateLimiter>,
    breakers: Arc<dyn BreakerStore>,
    telemetry: Arc<MockTelemetryRecorder>,
    cache: Option<Arc<MockResponseCache>>,
}

async fn client(s: ScopeSettings, p: &Ports) -> GatewayClient {
    let mut b = GatewayClient::builder(s)
        .transport(p.transport.clone())
        .limiter(p.limiter.clone())
        .breakers(p.breakers.clone())
        .telemetry(p.telemetry.clone())
        .rng(Arc::new(polygw::core::ports::SplitMix64::new(7)));
    if let Some(c) = &p.cache {
        b = b.cache(c.clone());
    }
    b.build().await.expect("client")
}

/// Lets tasks the call left behind (a probe release, say) run to the end.
async fn settle_background() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(ms(1)).await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

/// Drops the client, lets background work finish, and verifies every mock's
/// expectations (mockall's `checkpoint`): nothing may still hold a port.
async fn verify(client: GatewayClient, p: Ports) {
    drop(client);
    settle_background().await;
    let Ports {
        transport,
        limiter,
        breakers,
        telemetry,
        cache,
    } = p;
    drop((transport, limiter, breakers));
    Arc::into_inner(telemetry)
        .expect("nothing holds the telemetry recorder after the client is gone")
        .checkpoint();
    if let Some(c) = cache {
        Arc::into_inner(c)
            .expect("nothing holds the cache after the client is gone")
            .checkpoint();
    }
}

/// Verifies a transport / limiter / breaker mock held in an `Arc` by the test.
fn checkpoint<T>(held: Arc<T>, what: &str, f: impl FnOnce(T)) {
    f(Arc::into_inner(held)
        .unwrap_or_else(|| panic!("nothing holds the {what} after the client is gone")));
}

fn terminal_reason(e: &GatewayError) -> Option<TerminalReason> {
    e.terminal_reason()
}

// ------------------------------------------------------------------ success, failure

/// A success settles its permit once with the measured usage, closes the breaker
/// once, and writes exactly one `ok` attempt row.
#[tokio::test(start_paused = true)]
async fn a_success_settles_once_with_its_usage_and_writes_one_row() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let t = paced(
        transport(&[("s-0", 1)], |_| Ok(ok_result())),
        &[("s-0", ms(200))],
    );
    let l = Arc::new(admitting_limiter(&ledger, 1));
    let b = Arc::new(breakers(&log, allowed));
    let p = Ports {
        transport: t.clone(),
        limiter: l.clone(),
        breakers: b.clone(),
        telemetry: Arc::new(recorder(&rows, 1)),
        cache: None,
    };
    let c = client(scope(1, |_| {}), &p).await;
    let r = c.chat(ChatRequest::user("hi")).await.expect("answer");
    assert_eq!(r.content, "hello");
    assert_eq!(r.call_stats.attempts, 1);

    ledger.assert_settled(|_| MEASURED);
    assert_eq!(
        log.all(),
        vec![Recorded {
            source: "s-0".into(),
            outcome: BreakerOutcome::Success,
            probe: false
        }],
        "one breaker outcome, a success"
    );
    let attempt = rows.of_kind(RowKind::Attempt);
    assert_eq!(attempt.len(), 1, "one row per attempt: {attempt:?}");
    assert!(attempt[0].ok);
    assert_eq!(attempt[0].prompt_tokens, Some(USAGE.prompt_tokens));
    assert_eq!(attempt[0].usage_source, UsageSource::Measured);
    assert!(rows.of_kind(RowKind::TerminalFailure).is_empty());

    verify(c, p).await;
    checkpoint(t, "transport", |t| {
        let mut m = t.mock;
        m.checkpoint()
    });
    checkpoint(l, "limiter", |mut m| m.checkpoint());
    checkpoint(b, "breaker store", |mut m| m.checkpoint());
}

/// A transient failure settles its reservation (est) and feeds the breaker once; the
/// retry on the next source settles its measured usage; one row per attempt and no
/// terminal row (the call succeeded).
#[tokio::test(start_paused = true)]
async fn a_failure_then_a_retry_settle_each_permit_once() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let t = paced(
        transport(&[("s-0", 1), ("s-1", 1)], |s| {
            if s == "s-0" {
                Err(http_500())
            } else {
                Ok(ok_result())
            }
        }),
        &[("s-0", ms(50)), ("s-1", ms(100))],
    );
    let l = Arc::new(admitting_limiter(&ledger, 2));
    let b = Arc::new(breakers(&log, allowed));
    let p = Ports {
        transport: t.clone(),
        limiter: l.clone(),
        breakers: b.clone(),
        telemetry: Arc::new(recorder(&rows, 2)),
        cache: None,
    };
    let c = client(scope(2, |_| {}), &p).await;
    let r = c.chat(ChatRequest::user("hi")).await.expect("answer");
    assert_eq!(r.source, "s-1");
    assert_eq!(r.call_stats.attempts, 2);

    ledger.assert_settled(|s| if s == "s-0" { EST } else { MEASURED });
    let outcomes: Vec<BreakerOutcome> = log.of("s-0").iter().map(|r| r.outcome).collect();
    assert_eq!(
        outcomes,
        [BreakerOutcome::FastFailure],
        "s-0 fed the breaker once (a failure within BREAKER__OPEN_S)"
    );
    let outcomes: Vec<BreakerOutcome> = log.of("s-1").iter().map(|r| r.outcome).collect();
    assert_eq!(outcomes, [BreakerOutcome::Success]);
    assert_eq!(rows.labels(), ["ok", "server_error"]);
    assert!(rows.of_kind(RowKind::TerminalFailure).is_empty());

    verify(c, p).await;
    checkpoint(t, "transport", |t| {
        let mut m = t.mock;
        m.checkpoint()
    });
    checkpoint(l, "limiter", |mut m| m.checkpoint());
}

/// A rejected request settles 0, is no breaker failure, and the failed call writes
/// its attempt row and exactly one `terminal_failure` row (`rejected`).
#[tokio::test(start_paused = true)]
async fn a_rejection_settles_zero_and_writes_one_terminal_row() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let rejected = || {
        AttemptError::new(ErrorClass::Rejected, ErrorLabel::Rejected, "HTTP 400").with_status(400)
    };
    let t = paced(transport(&[("s-0", 1)], move |_| Err(rejected())), &[]);
    let l = Arc::new(admitting_limiter(&ledger, 1));
    let p = Ports {
        transport: t.clone(),
        limiter: l.clone(),
        breakers: Arc::new(breakers(&log, allowed)),
        telemetry: Arc::new(recorder(&rows, 2)),
        cache: None,
    };
    let c = client(scope(2, |_| {}), &p).await;
    let e = c.chat(ChatRequest::user("hi")).await.unwrap_err();
    assert_eq!(terminal_reason(&e), Some(TerminalReason::Rejected));

    ledger.assert_settled(|_| 0);
    assert!(
        log.all()
            .iter()
            .all(|r| r.outcome == BreakerOutcome::Neutral),
        "a rejection feeds no breaker: {:?}",
        log.all()
    );
    assert!(log.all().len() <= 1, "at most one outcome per attempt");
    assert_eq!(rows.labels(), ["rejected"]);
    let terminal = rows.of_kind(RowKind::TerminalFailure);
    assert_eq!(terminal.len(), 1, "one terminal row per failed call");
    assert_eq!(terminal[0].error.as_deref(), Some("rejected"));

    verify(c, p).await;
    checkpoint(t, "transport", |t| {
        let mut m = t.mock;
        m.checkpoint()
    });
    checkpoint(l, "limiter", |mut m| m.checkpoint());
}

// ------------------------------------------------------------------ hedging

fn hedged(s: &mut ScopeSettings) {
    s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(100));
    s.hedge.max_extra = 1;
    s.hedge.budget_pct = 0;
}

/// The hedge leg wins; the primary loses: its permit settles the reservation (est)
/// exactly once, it is no breaker failure, and its row says `hedge_cancelled`.
#[tokio::test(start_paused = true)]
async fn a_hedge_loser_settles_its_reservation_once_and_is_no_breaker_failure() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let t = paced(
        transport(&[("s-0", 1), ("s-1", 1)], |_| Ok(ok_result())),
        &[("s-0", ms(1000)), ("s-1", ms(200))],
    );
    let l = Arc::new(admitting_limiter(&ledger, 2));
    let p = Ports {
        transport: t.clone(),
        limiter: l.clone(),
        breakers: Arc::new(breakers(&log, allowed)),
        telemetry: Arc::new(recorder(&rows, 2)),
        cache: None,
    };
    let c = client(scope(2, hedged), &p).await;
    let r = c.chat(ChatRequest::user("hi")).await.expect("answer");
    assert_eq!(r.source, "s-1");
    assert!(r.call_stats.hedge_won);
    assert_eq!((r.call_stats.attempts, r.call_stats.hedges), (2, 1));
    settle_background().await;

    ledger.assert_settled(|s| if s == "s-0" { EST } else { MEASURED });
    assert!(
        log.of("s-0")
            .iter()
            .all(|r| r.outcome == BreakerOutcome::Neutral),
        "a hedge loser is slow, not dead: {:?}",
        log.all()
    );
    assert!(log.of("s-0").len() <= 1);
    let loser = rows.attempt_of("s-0");
    assert_eq!(loser.len(), 1);
    assert_eq!(loser[0].error.as_deref(), Some("hedge_cancelled"));
    let winner = rows.attempt_of("s-1");
    assert_eq!(winner.len(), 1);
    assert!(winner[0].ok && winner[0].is_hedge);

    verify(c, p).await;
    checkpoint(t, "transport", |t| {
        let mut m = t.mock;
        m.checkpoint()
    });
    checkpoint(l, "limiter", |mut m| m.checkpoint());
}

/// Issue 22, item 6: the governance backend fails the hedge leg's admission. No leg
/// is admitted blindly, and the running primary is not cut: it answers, its row is
/// `ok` (nothing says `cancelled`), its permit settles once with its usage.
#[tokio::test(start_paused = true)]
async fn a_backend_error_on_the_hedge_admission_cuts_nothing() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let t = paced(
        transport(&[("s-0", 1)], |_| Ok(ok_result())),
        &[("s-0", ms(1000))],
    );
    let mut l = MockRateLimiter::new();
    let granted = Arc::new(Mutex::new(0u32));
    let l_ledger = ledger.clone();
    l.expect_acquire().times(2).returning(move |req| {
        let mut n = granted.lock().unwrap();
        *n += 1;
        if *n == 1 {
            let backend = l_ledger.backend(req.source, req.est_tokens);
            Ok(Admission::Admitted(Permit::new(
                req.est_tokens,
                Box::new(backend),
            )))
        } else {
            Err(GovernanceError::new("redis", "connection refused"))
        }
    });
    l.expect_in_flight().returning(|_, _| Ok(0));
    l.expect_flush().returning(|| Ok(()));
    let l = Arc::new(l);
    let p = Ports {
        transport: t.clone(),
        limiter: l.clone(),
        breakers: Arc::new(breakers(&log, allowed)),
        telemetry: Arc::new(recorder(&rows, 1)),
        cache: None,
    };
    let c = client(scope(2, hedged), &p).await;
    let r = c
        .chat(ChatRequest::user("hi"))
        .await
        .expect("the primary answers");
    assert_eq!(r.source, "s-0");
    assert_eq!((r.call_stats.attempts, r.call_stats.hedges), (1, 0));
    settle_background().await;
    ledger.assert_settled(|_| MEASURED);
    let primary = rows.attempt_of("s-0");
    assert_eq!(primary.len(), 1);
    assert!(primary[0].ok, "{:?}", primary[0].error);
    verify(c, p).await;
    checkpoint(l, "limiter", |mut m| m.checkpoint());
}

/// Both legs answer in the same instant; the deadline passes while the round is
/// still recording their outcomes (a slow breaker backend). Neither leg may be
/// labelled `hedge_cancelled` (SPEC §7, §13.6: none on deadline or caller drop), and
/// the legs that completed keep their measured usage: row and settlement.
#[tokio::test(start_paused = true)]
async fn a_deadline_while_co_completing_legs_are_finalized_keeps_the_winner() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let t = paced(
        transport(&[("s-0", 1), ("s-1", 1)], |_| Ok(ok_result())),
        // s-0 from 0 ms, s-1 from the hedge trigger at 100 ms: both answer at 300 ms.
        &[("s-0", ms(300)), ("s-1", ms(200))],
    );
    let l = Arc::new(admitting_limiter(&ledger, 2));
    let b = Arc::new(SlowRecord {
        mock: breakers(&log, allowed),
        delay: ms(100),
    });
    let p = Ports {
        transport: t.clone(),
        limiter: l.clone(),
        breakers: b,
        telemetry: Arc::new(recorder(&rows, 3)),
        cache: None,
    };
    let c = client(
        scope(2, |s| {
            hedged(s);
            s.call_deadline = Some(ms(350));
        }),
        &p,
    )
    .await;
    let _ = c.chat(ChatRequest::user("hi")).await;
    settle_background().await;

    let attempts = rows.of_kind(RowKind::Attempt);
    assert_eq!(attempts.len(), 2, "one row per attempt: {attempts:?}");
    assert!(
        attempts
            .iter()
            .all(|r| r.error.as_deref() != Some("hedge_cancelled")),
        "no hedge_cancelled on a deadline: {:?}",
        rows.labels()
    );
    for source in ["s-0", "s-1"] {
        let row = &rows.attempt_of(source)[0];
        assert!(
            row.ok && row.usage_source == UsageSource::Measured,
            "{source} answered before the deadline: its row keeps its usage: {row:?}"
        );
        assert_eq!(row.prompt_tokens, Some(USAGE.prompt_tokens));
    }
    ledger.assert_settled(|_| MEASURED);

    verify(c, p).await;
    checkpoint(t, "transport", |t| {
        let mut m = t.mock;
        m.checkpoint()
    });
}

// ------------------------------------------------------------------ deadline, drop

/// The deadline cuts both legs of a hedged round: each permit settles est once,
/// each row says `deadline` (never `hedge_cancelled`), and the failed call has one
/// `terminal_failure` row (`deadline_exceeded`).
#[tokio::test(start_paused = true)]
async fn a_deadline_settles_every_leg_once() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let t = paced(
        transport(&[("s-0", 1), ("s-1", 1)], |_| Ok(ok_result())),
        &[("s-0", ms(10_000)), ("s-1", ms(10_000))],
    );
    let l = Arc::new(admitting_limiter(&ledger, 2));
    let p = Ports {
        transport: t.clone(),
        limiter: l.clone(),
        breakers: Arc::new(breakers(&log, allowed)),
        telemetry: Arc::new(recorder(&rows, 3)),
        cache: None,
    };
    let c = client(
        scope(2, |s| {
            hedged(s);
            s.call_deadline = Some(ms(500));
        }),
        &p,
    )
    .await;
    let e = c.chat(ChatRequest::user("hi")).await.unwrap_err();
    assert_eq!(terminal_reason(&e), Some(TerminalReason::DeadlineExceeded));
    settle_background().await;

    ledger.assert_settled(|_| EST);
    assert_eq!(ledger.permits().len(), 2);
    assert!(
        log.all()
            .iter()
            .all(|r| r.outcome == BreakerOutcome::Neutral),
        "a deadline is no breaker failure: {:?}",
        log.all()
    );
    assert_eq!(rows.labels(), ["deadline", "deadline"]);
    let terminal = rows.of_kind(RowKind::TerminalFailure);
    assert_eq!(terminal.len(), 1);
    assert_eq!(terminal[0].error.as_deref(), Some("deadline_exceeded"));

    verify(c, p).await;
    checkpoint(t, "transport", |t| {
        let mut m = t.mock;
        m.checkpoint()
    });
    checkpoint(l, "limiter", |mut m| m.checkpoint());
}

/// The caller drops a hedged call mid-flight: each permit settles est once, each
/// attempt still writes its one row (`cancelled`, never `hedge_cancelled`), and a
/// dropped call writes no terminal row.
#[tokio::test(start_paused = true)]
async fn a_dropped_call_settles_every_leg_once() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let t = paced(
        transport(&[("s-0", 1), ("s-1", 1)], |_| Ok(ok_result())),
        &[("s-0", ms(10_000)), ("s-1", ms(10_000))],
    );
    let l = Arc::new(admitting_limiter(&ledger, 2));
    let p = Ports {
        transport: t.clone(),
        limiter: l.clone(),
        breakers: Arc::new(breakers(&log, allowed)),
        telemetry: Arc::new(recorder(&rows, 2)),
        cache: None,
    };
    let c = client(scope(2, hedged), &p).await;
    let r = tokio::time::timeout(ms(400), c.chat(ChatRequest::user("hi"))).await;
    assert!(r.is_err(), "the caller gave up first");
    settle_background().await;

    ledger.assert_settled(|_| EST);
    assert_eq!(ledger.permits().len(), 2);
    assert!(log
        .all()
        .iter()
        .all(|r| r.outcome == BreakerOutcome::Neutral));
    assert_eq!(rows.labels(), ["cancelled", "cancelled"]);
    assert!(rows.of_kind(RowKind::TerminalFailure).is_empty());

    verify(c, p).await;
    checkpoint(t, "transport", |t| {
        let mut m = t.mock;
        m.checkpoint()
    });
    checkpoint(l, "limiter", |mut m| m.checkpoint());
}

// ------------------------------------------------------------------ half-open probes

/// A half-open probe that succeeds is released exactly once, by its success.
#[tokio::test(start_paused = true)]
async fn a_probe_that_succeeds_is_released_once() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let t = paced(
        transport(&[("s-0", 1)], |_| Ok(ok_result())),
        &[("s-0", ms(100))],
    );
    let p = Ports {
        transport: t,
        limiter: Arc::new(admitting_limiter(&ledger, 1)),
        breakers: Arc::new(breakers(&log, probe)),
        telemetry: Arc::new(recorder(&rows, 1)),
        cache: None,
    };
    let c = client(scope(1, |_| {}), &p).await;
    c.chat(ChatRequest::user("hi")).await.expect("answer");
    settle_background().await;
    assert_eq!(
        log.all(),
        vec![Recorded {
            source: "s-0".into(),
            outcome: BreakerOutcome::Success,
            probe: true
        }]
    );
    ledger.assert_settled(|_| MEASURED);
    verify(c, p).await;
}

/// A half-open probe that fails is released exactly once, as a failure.
#[tokio::test(start_paused = true)]
async fn a_probe_that_fails_is_released_once() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let t = paced(
        transport(&[("s-0", 1)], |_| Err(http_500())),
        &[("s-0", ms(100))],
    );
    let p = Ports {
        transport: t,
        limiter: Arc::new(admitting_limiter(&ledger, 1)),
        breakers: Arc::new(breakers(&log, probe)),
        telemetry: Arc::new(recorder(&rows, 2)),
        cache: None,
    };
    let c = client(
        scope(1, |s| {
            s.retry.max_attempts = 1;
        }),
        &p,
    )
    .await;
    let e = c.chat(ChatRequest::user("hi")).await.unwrap_err();
    assert_eq!(terminal_reason(&e), Some(TerminalReason::RetryExhausted));
    settle_background().await;
    assert_eq!(
        log.all(),
        vec![Recorded {
            source: "s-0".into(),
            outcome: BreakerOutcome::FastFailure,
            probe: true
        }]
    );
    ledger.assert_settled(|_| EST);
    assert_eq!(rows.labels(), ["server_error"]);
    assert_eq!(rows.of_kind(RowKind::TerminalFailure).len(), 1);
    verify(c, p).await;
}

/// A half-open probe whose caller drops the call mid-attempt is released exactly once
/// (neutral: a slow probe is not a failure).
#[tokio::test(start_paused = true)]
async fn a_probe_dropped_mid_attempt_is_released_once() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let t = paced(
        transport(&[("s-0", 1)], |_| Ok(ok_result())),
        &[("s-0", ms(10_000))],
    );
    let p = Ports {
        transport: t,
        limiter: Arc::new(admitting_limiter(&ledger, 1)),
        breakers: Arc::new(breakers(&log, probe)),
        telemetry: Arc::new(recorder(&rows, 1)),
        cache: None,
    };
    let c = client(scope(1, |_| {}), &p).await;
    let r = tokio::time::timeout(ms(100), c.chat(ChatRequest::user("hi"))).await;
    assert!(r.is_err());
    settle_background().await;
    assert_eq!(
        log.all(),
        vec![Recorded {
            source: "s-0".into(),
            outcome: BreakerOutcome::Neutral,
            probe: true
        }],
        "the probe is released once, neutral"
    );
    ledger.assert_settled(|_| EST);
    assert_eq!(rows.labels(), ["cancelled"]);
    verify(c, p).await;
}

/// A half-open probe granted to a source the limiter then refuses is released
/// exactly once, and the call fails `no_runnable_source` (RETRY__ON_NO_RUNNABLE=fail).
#[tokio::test(start_paused = true)]
async fn a_probe_whose_source_the_limiter_refuses_is_released_once() {
    let log = BreakerLog::default();
    let rows = Rows::default();
    let mut l = MockRateLimiter::new();
    l.expect_acquire().times(1).returning(|_| {
        Ok(Admission::Refused(Refusal {
            reason: RefusalReason::Rpm,
            retry_after: Some(ms(1000)),
        }))
    });
    let p = Ports {
        transport: paced(transport(&[], |_| Ok(ok_result())), &[]),
        limiter: Arc::new(l),
        breakers: Arc::new(breakers(&log, probe)),
        telemetry: Arc::new(recorder(&rows, 1)),
        cache: None,
    };
    let c = client(
        scope(1, |s| s.retry.on_no_runnable = OnNoRunnable::Fail),
        &p,
    )
    .await;
    let e = c.chat(ChatRequest::user("hi")).await.unwrap_err();
    assert_eq!(terminal_reason(&e), Some(TerminalReason::NoRunnableSource));
    settle_background().await;
    assert_eq!(log.probes_released(), 1, "{:?}", log.all());
    assert!(log
        .all()
        .iter()
        .all(|r| r.outcome == BreakerOutcome::Neutral));
    assert!(
        rows.of_kind(RowKind::Attempt).is_empty(),
        "no attempt was made"
    );
    assert_eq!(rows.of_kind(RowKind::TerminalFailure).len(), 1);
    verify(c, p).await;
}

/// The caller drops the call while the limiter's reply for a half-open probe is in
/// flight (SPEC §14.7): the probe is released exactly once (neutral), and the permit
/// the late reply carried settles its reservation once. No attempt was made: no row.
#[tokio::test(start_paused = true)]
async fn a_probe_is_released_when_the_caller_drops_during_admission() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let l = Arc::new(SlowLimiter {
        mock: admitting_limiter(&ledger, 1),
        delay: ms(1000),
    });
    let p = Ports {
        transport: paced(transport(&[], |_| Ok(ok_result())), &[]),
        limiter: l,
        breakers: Arc::new(breakers(&log, probe)),
        telemetry: Arc::new(recorder(&rows, 0)),
        cache: None,
    };
    let c = client(scope(1, |_| {}), &p).await;
    let r = tokio::time::timeout(ms(100), c.chat(ChatRequest::user("hi"))).await;
    assert!(r.is_err(), "the caller gave up during admission");
    settle_background().await;

    assert_eq!(
        log.all(),
        vec![Recorded {
            source: "s-0".into(),
            outcome: BreakerOutcome::Neutral,
            probe: true
        }],
        "the half-open probe is released exactly once"
    );
    ledger.assert_settled(|_| EST);
    assert!(
        rows.all().is_empty(),
        "no attempt, no row: {:?}",
        rows.all()
    );
    verify(c, p).await;
}

// ------------------------------------------------------------------ cache

fn cached_response() -> LlmResponse {
    LlmResponse {
        content: "from the cache".into(),
        finish_reason: Some("stop".into()),
        model: "model-0".into(),
        source: "s-0".into(),
        usage: USAGE,
        usage_source: UsageSource::Measured,
        ..Default::default()
    }
}

/// A cache hit asks nothing of the limiter, the breaker store or the transport, and
/// writes exactly one `cache_hit` row (cost 0.0) and no attempt row.
#[tokio::test(start_paused = true)]
async fn a_cache_hit_makes_no_governance_call() {
    let rows = Rows::default();
    let mut l = MockRateLimiter::new();
    l.expect_acquire().never();
    l.expect_in_flight().returning(|_, _| Ok(0));
    let mut b = MockBreakerStore::new();
    b.expect_admit().never();
    b.expect_record().never();
    let mut t = MockTransport::new();
    t.expect_chat().never();
    let mut cache = MockResponseCache::new();
    cache
        .expect_get()
        .times(1)
        .returning(|_| Ok(Some(cached_response())));
    cache.expect_put().never();
    let (l, b) = (Arc::new(l), Arc::new(b));
    let t = Arc::new(Paced {
        mock: t,
        delay: HashMap::new(),
    });
    let p = Ports {
        transport: t.clone(),
        limiter: l.clone(),
        breakers: b.clone(),
        telemetry: Arc::new(recorder(&rows, 1)),
        cache: Some(Arc::new(cache)),
    };
    let c = client(scope(1, |s| s.cache.ttl = Some(ms(60_000))), &p).await;
    let r = c.chat(ChatRequest::user("hi")).await.expect("answer");
    assert_eq!(r.content, "from the cache");
    assert!(r.call_stats.cache_hit);
    assert_eq!(r.call_stats.attempts, 0);

    let hits = rows.of_kind(RowKind::CacheHit);
    assert_eq!(hits.len(), 1, "one cache_hit row");
    assert_eq!(hits[0].cost, Some(0.0));
    assert!(rows.of_kind(RowKind::Attempt).is_empty());

    verify(c, p).await;
    checkpoint(l, "limiter", |mut m| m.checkpoint());
    checkpoint(b, "breaker store", |mut m| m.checkpoint());
    checkpoint(t, "transport", |t| {
        let mut m = t.mock;
        m.checkpoint()
    });
}

/// A miss goes upstream once and stores the answer once, under the key it looked up.
#[tokio::test(start_paused = true)]
async fn a_cache_miss_stores_the_answer_once() {
    let ledger = Ledger::default();
    let log = BreakerLog::default();
    let rows = Rows::default();
    let looked_up: Arc<Mutex<Option<String>>> = Arc::default();
    let mut cache = MockResponseCache::new();
    let k = looked_up.clone();
    cache.expect_get().times(1).returning(move |key| {
        *k.lock().unwrap() = Some(key.to_string());
        Ok(None)
    });
    let k = looked_up.clone();
    cache
        .expect_put()
        .withf(move |key, r, _ttl| {
            k.lock().unwrap().as_deref() == Some(key) && r.content == "hello"
        })
        .times(1)
        .returning(|_, _, _| Ok(()));
    let p = Ports {
        transport: paced(transport(&[("s-0", 1)], |_| Ok(ok_result())), &[]),
        limiter: Arc::new(admitting_limiter(&ledger, 1)),
        breakers: Arc::new(breakers(&log, allowed)),
        telemetry: Arc::new(recorder(&rows, 1)),
        cache: Some(Arc::new(cache)),
    };
    let c = client(scope(1, |s| s.cache.ttl = Some(ms(60_000))), &p).await;
    let r = c.chat(ChatRequest::user("hi")).await.expect("answer");
    assert!(!r.call_stats.cache_hit);
    ledger.assert_settled(|_| MEASURED);
    assert_eq!(rows.labels(), ["ok"]);
    verify(c, p).await;
}
