//! The `RateLimiter` contract (SPEC §4.2, issue 4): one suite of cases that every limiter
//! backend runs through a [`LimiterHarness`], plus a proptest that replays random
//! acquire / settle / release / finish / drop sequences against the backend and against
//! core's reference model [`WindowLimiter`] and compares every answer.
//!
//! The contract: never over-admit — over any rolling window admitted requests ≤ RPM,
//! reserved-or-settled tokens at admission ≤ TPM (a reservation counts until it is
//! settled, however long the call, then the settled amount for one window from the
//! settlement: SPEC §14.3), in flight ≤ MAX_CONCURRENCY, scope limits atomically with
//! the source's — and under-admission is bounded: a saturating load gets at least 95 % of
//! RPM admitted. Slots and reservations are leases renewed while their permit is alive
//! and ended within one lease once its holder is gone (SPEC §14.4).
//!
//! Time: a harness either drives a manual clock (`manual_time() == true`: every figure,
//! hints included, must equal the model's exactly) or runs on real time (Redis, whose
//! clock is the server's `TIME`): then expiry cases wait for real on a short test window
//! and only assert what is race-free — "refused right after saturating" and "admitted
//! once the window plus a margin has passed" — and hints are compared within the time
//! the case took. Every case works in a fresh, uniquely named scope.
//!
//! The client-key half of the port (SPEC §21.1) has its cases and its model proptest in
//! [`keys`], on the same harness.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::error::{GovernanceError, RefusalReason};
use polygw_core::ports::{AcquireRequest, Admission, Permit, RateLimiter, Refusal};
use polygw_core::window::{WindowLimiter, WINDOW_MS};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::services::unique_name;

pub mod keys;

/// Reads a backend's rolling windows (tests only; both backends expose these figures).
#[async_trait]
pub trait WindowProbe: Send + Sync {
    /// `(requests, tokens)` in a source's window now.
    async fn source_window(&self, scope: &str, source: &str)
        -> Result<(u64, u64), GovernanceError>;
    /// `(requests, tokens)` in a scope's window now.
    async fn scope_window(&self, scope: &str) -> Result<(u64, u64), GovernanceError>;
}

/// A limiter under test and a probe on the same state.
#[derive(Clone)]
pub struct Subject {
    /// The limiter.
    pub limiter: Arc<dyn RateLimiter>,
    /// Its windows.
    pub probe: Arc<dyn WindowProbe>,
}

impl std::fmt::Debug for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subject")
            .field("limiter", &self.limiter)
            .finish_non_exhaustive()
    }
}

/// How the contract reaches one backend.
#[async_trait]
pub trait LimiterHarness: Send + Sync {
    /// A limiter with the standard 60 s window. Every subject and client of a harness
    /// shares one backend state (cases keep apart by scope). On a manual clock the
    /// subject's time base is the harness's: it reads [`LimiterHarness::now`].
    async fn subject(&self) -> Subject;
    /// `n` independent clients sharing one backend state (separate connections where the
    /// backend has connections; the same limiter otherwise).
    async fn clients(&self, n: usize) -> Vec<Arc<dyn RateLimiter>>;
    /// A limiter whose window is short enough to wait for, and that window. A manual-time
    /// harness returns its usual limiter and 60 s.
    async fn windowed(&self) -> (Subject, Duration);
    /// Another client of the same state whose heartbeat the returned closure stops (what
    /// a crashed process looks like: its permits are never settled nor released).
    async fn crashable(&self) -> (Arc<dyn RateLimiter>, Box<dyn Fn() + Send + Sync>);
    /// A subject whose heartbeat never renews anything (the model proptest compares it
    /// with [`WindowLimiter`], which renews nothing by itself).
    async fn quiet(&self) -> Subject;
    /// Whether [`LimiterHarness::advance`] moves a manual clock (exact) or waits.
    fn manual_time(&self) -> bool;
    /// Lets `by` pass.
    async fn advance(&self, by: Duration);
    /// Time since the harness was created, on the clock `advance` moves.
    fn now(&self) -> Duration;
    /// Slack for real-time waits and hints (zero for a manual clock).
    fn margin(&self) -> Duration;
}

/// An owned [`AcquireRequest`].
#[derive(Debug, Clone)]
pub struct Req {
    /// Scope.
    pub scope: String,
    /// Source.
    pub source: String,
    /// Source RPM.
    pub rpm: u32,
    /// Source TPM.
    pub tpm: u64,
    /// Source in-flight cap.
    pub conc: u32,
    /// Scope RPM.
    pub scope_rpm: u32,
    /// Scope TPM.
    pub scope_tpm: u64,
    /// Reservation.
    pub est: u64,
    /// Lease.
    pub lease: Duration,
}

impl Req {
    /// No limits, no reservation, a 10-minute lease.
    pub fn new(scope: &str, source: &str) -> Self {
        Req {
            scope: scope.to_string(),
            source: source.to_string(),
            rpm: 0,
            tpm: 0,
            conc: 0,
            scope_rpm: 0,
            scope_tpm: 0,
            est: 0,
            lease: Duration::from_secs(600),
        }
    }

    /// The borrowed request.
    pub fn get(&self) -> AcquireRequest<'_> {
        AcquireRequest {
            scope: &self.scope,
            source: &self.source,
            rpm: self.rpm,
            tpm: self.tpm,
            max_concurrency: self.conc,
            scope_rpm: self.scope_rpm,
            scope_tpm: self.scope_tpm,
            est_tokens: self.est,
            lease: self.lease,
        }
    }

    /// With source limits.
    pub fn source_limits(mut self, rpm: u32, tpm: u64, conc: u32) -> Self {
        (self.rpm, self.tpm, self.conc) = (rpm, tpm, conc);
        self
    }

    /// With scope limits.
    pub fn scope_limits(mut self, rpm: u32, tpm: u64) -> Self {
        (self.scope_rpm, self.scope_tpm) = (rpm, tpm);
        self
    }

    /// With a reservation.
    pub fn est(mut self, est: u64) -> Self {
        self.est = est;
        self
    }

    /// With a lease.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// With another source.
    pub fn on(&self, source: &str) -> Self {
        Req {
            source: source.to_string(),
            ..self.clone()
        }
    }
}

async fn acquire(l: &dyn RateLimiter, r: &Req) -> Admission {
    l.acquire(&r.get())
        .await
        .expect("the governance backend is reachable in contract cases")
}

/// Acquires and expects an admission.
pub async fn admit(l: &dyn RateLimiter, r: &Req) -> Permit {
    match acquire(l, r).await {
        Admission::Admitted(p) => p,
        Admission::Refused(f) => panic!("expected an admission for {}, got {f:?}", r.source),
    }
}

/// Acquires and expects a refusal.
pub async fn refuse(l: &dyn RateLimiter, r: &Req) -> Refusal {
    match acquire(l, r).await {
        Admission::Refused(f) => f,
        Admission::Admitted(p) => panic!(
            "expected a refusal for {}, got an admission ({p:?})",
            r.source
        ),
    }
}

fn scope() -> String {
    unique_name("LC")
}

/// Asserts a hint: exactly `want` on a manual clock; within `(want − slack, want]` else.
fn assert_hint(h: &dyn LimiterHarness, got: Option<Duration>, want: Duration, slack: Duration) {
    let got = got.expect("a refusal that passes with time carries a hint");
    if h.manual_time() {
        assert_eq!(got, want, "hint");
    } else {
        assert!(
            got <= want && got + slack + h.margin() >= want,
            "hint {got:?} not within {slack:?} + margin below {want:?}"
        );
    }
}

async fn win(s: &Subject, scope: &str, source: &str) -> (u64, u64) {
    s.probe
        .source_window(scope, source)
        .await
        .expect("probe the window")
}

async fn in_flight(l: &dyn RateLimiter, scope: &str, source: &str) -> u32 {
    l.in_flight(scope, source).await.expect("in_flight")
}

// ------------------------------------------------------------------------------------
// Cases
// ------------------------------------------------------------------------------------

/// RPM: the (RPM+1)-th request in a window is refused with a hint of when the oldest
/// admission leaves it; refusals record nothing.
pub async fn rpm_never_over_admitted(h: &dyn LimiterHarness) {
    let s = h.subject().await;
    let sc = scope();
    let r = Req::new(&sc, "a").source_limits(5, 0, 0);
    let t0 = h.now();
    for _ in 0..5 {
        admit(s.limiter.as_ref(), &r).await.finish(0).await.unwrap();
    }
    for _ in 0..3 {
        let f = refuse(s.limiter.as_ref(), &r).await;
        assert_eq!(f.reason, RefusalReason::Rpm);
        assert_hint(
            h,
            f.retry_after,
            Duration::from_millis(WINDOW_MS),
            h.now() - t0,
        );
    }
    assert_eq!(win(&s, &sc, "a").await, (5, 0));
    assert_eq!(s.probe.scope_window(&sc).await.unwrap(), (5, 0));
}

/// The window rolls: once the oldest admissions are older than the window, new ones pass;
/// before that they do not.
pub async fn rpm_window_rolls(h: &dyn LimiterHarness) {
    let (s, w) = h.windowed().await;
    let sc = scope();
    let r = Req::new(&sc, "a").source_limits(3, 0, 0);
    for _ in 0..3 {
        admit(s.limiter.as_ref(), &r).await.finish(0).await.unwrap();
    }
    let f = refuse(s.limiter.as_ref(), &r).await;
    let hint = f.retry_after.expect("hint");
    assert!(
        hint <= w && !hint.is_zero(),
        "hint {hint:?} within the window {w:?}"
    );
    if h.manual_time() {
        h.advance(w - Duration::from_millis(1)).await;
        assert_eq!(
            refuse(s.limiter.as_ref(), &r).await.reason,
            RefusalReason::Rpm
        );
        h.advance(Duration::from_millis(1)).await;
    } else {
        h.advance(hint + h.margin()).await;
    }
    for _ in 0..3 {
        admit(s.limiter.as_ref(), &r).await.finish(0).await.unwrap();
    }
    assert_eq!(
        refuse(s.limiter.as_ref(), &r).await.reason,
        RefusalReason::Rpm
    );
    assert_eq!(win(&s, &sc, "a").await.0, 3);
}

/// TPM: admission reserves the estimate; settlement replaces it; an estimate above the
/// limit can never pass (no hint).
pub async fn tpm_reserve_then_settle(h: &dyn LimiterHarness) {
    let s = h.subject().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    let r = Req::new(&sc, "a").source_limits(0, 1000, 0).est(400);
    let t0 = h.now();
    let mut a = admit(l, &r).await;
    let mut b = admit(l, &r).await;
    assert_eq!(win(&s, &sc, "a").await, (2, 800));
    let f = refuse(l, &r).await;
    assert_eq!(f.reason, RefusalReason::Tpm);
    // Unsettled, a reservation counts until its lease ends and one window more.
    assert_hint(
        h,
        f.retry_after,
        r.lease + Duration::from_millis(WINDOW_MS),
        h.now() - t0,
    );
    a.finish(100).await.unwrap(); // 100 + 400
    let mut c = admit(l, &r).await; // 900
    assert_eq!(win(&s, &sc, "a").await, (3, 900));
    assert_eq!(refuse(l, &r).await.reason, RefusalReason::Tpm);
    // A settlement above the estimate may exceed the limit afterwards; later ones wait.
    b.finish(5000).await.unwrap();
    assert_eq!(win(&s, &sc, "a").await, (3, 5500));
    assert_eq!(
        refuse(l, &r.clone().est(0)).await.reason,
        RefusalReason::Tpm,
        "over the limit even a zero reservation waits"
    );
    c.finish(0).await.unwrap();
    let f = refuse(l, &r.clone().est(1001)).await;
    assert_eq!((f.reason, f.retry_after), (RefusalReason::Tpm, None));
    assert_eq!(win(&s, &sc, "a").await, (3, 5100));
}

/// After a settlement above the estimate, admissions wait until the window has rolled.
pub async fn tpm_window_rolls(h: &dyn LimiterHarness) {
    let (s, w) = h.windowed().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    let r = Req::new(&sc, "a").source_limits(0, 1000, 0).est(300);
    admit(l, &r).await.finish(2000).await.unwrap();
    let f = refuse(l, &r).await;
    assert_eq!(f.reason, RefusalReason::Tpm);
    let hint = f.retry_after.expect("hint");
    assert!(hint <= w);
    h.advance(hint + h.margin()).await;
    let mut p = admit(l, &r).await;
    assert_eq!(win(&s, &sc, "a").await, (1, 300));
    p.finish(300).await.unwrap();
}

/// Concurrency: in flight ≤ MAX_CONCURRENCY; release frees the slot; the hint is the
/// earliest lease end.
pub async fn concurrency_cap_and_release(h: &dyn LimiterHarness) {
    let s = h.subject().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    let lease = Duration::from_secs(90);
    let r = Req::new(&sc, "a").source_limits(0, 0, 2).lease(lease);
    let t0 = h.now();
    let mut a = admit(l, &r).await;
    let mut b = admit(l, &r).await;
    assert_eq!(in_flight(l, &sc, "a").await, 2);
    let f = refuse(l, &r).await;
    assert_eq!(f.reason, RefusalReason::Concurrency);
    assert_hint(h, f.retry_after, lease, h.now() - t0);
    a.settle(0).await.unwrap();
    assert_eq!(
        in_flight(l, &sc, "a").await,
        2,
        "settle alone keeps the slot"
    );
    a.release().await.unwrap();
    assert_eq!(in_flight(l, &sc, "a").await, 1);
    let mut c = admit(l, &r).await;
    assert_eq!(refuse(l, &r).await.reason, RefusalReason::Concurrency);
    b.finish(0).await.unwrap();
    c.finish(0).await.unwrap();
    assert_eq!(in_flight(l, &sc, "a").await, 0);
    assert_eq!(in_flight(l, &sc, "other").await, 0);
}

/// A permit whose holder crashed (no settle, no release, no drop, no heartbeat) stops
/// counting once its lease has ended; its reservation counts one window more.
pub async fn lease_expiry_frees_the_slot(h: &dyn LimiterHarness) {
    let s = h.subject().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    let lease = if h.manual_time() {
        Duration::from_secs(30)
    } else {
        Duration::from_secs(1)
    };
    let r = Req::new(&sc, "a")
        .source_limits(0, 0, 1)
        .est(7)
        .lease(lease);
    let (crashed, crash) = h.crashable().await;
    // A crashed process never runs its permit's drop, nor its heartbeat.
    std::mem::forget(admit(crashed.as_ref(), &r).await);
    crash();
    assert_eq!(refuse(l, &r).await.reason, RefusalReason::Concurrency);
    h.advance(lease + h.margin()).await;
    assert_eq!(in_flight(l, &sc, "a").await, 0);
    let mut p = admit(l, &r).await;
    assert_eq!(win(&s, &sc, "a").await, (2, 14), "the reservation stays");
    p.finish(7).await.unwrap();
}

/// SPEC §14.4: a permit held past several lease lengths keeps its slot (its heartbeat
/// renews the lease); once its holder crashes (heartbeat stopped) the slot frees within
/// one lease.
pub async fn leases_renewed_while_held_and_end_after_a_crash(h: &dyn LimiterHarness) {
    let s = h.subject().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    let lease = if h.manual_time() {
        Duration::from_secs(30)
    } else {
        Duration::from_secs(1)
    };
    let r = Req::new(&sc, "a")
        .source_limits(0, 0, 1)
        .est(5)
        .lease(lease);
    let mut p = admit(l, &r).await;
    for _ in 0..7 {
        h.advance(lease / 2).await;
        assert_eq!(
            refuse(l, &r).await.reason,
            RefusalReason::Concurrency,
            "the slot is held"
        );
        assert_eq!(in_flight(l, &sc, "a").await, 1);
    }
    p.finish(5).await.unwrap();
    assert_eq!(in_flight(l, &sc, "a").await, 0);

    let (crashed, crash) = h.crashable().await;
    let held = admit(crashed.as_ref(), &r).await;
    h.advance(lease / 2).await;
    std::mem::forget(held);
    crash();
    assert_eq!(refuse(l, &r).await.reason, RefusalReason::Concurrency);
    h.advance(lease + h.margin()).await;
    assert_eq!(
        in_flight(l, &sc, "a").await,
        0,
        "a crashed holder's slot ends with its lease"
    );
    admit(l, &r).await.finish(0).await.unwrap();
}

/// SPEC §14.3: TPM 60 000 and calls of 20 000 tokens lasting 65 s (longer than the
/// window, time scaled to the harness's window): callers take every admission they can,
/// each call settles its 20 000 tokens when it ends. At every admission the tokens of the
/// calls in flight plus those settled within the last window plus the new reservation
/// never exceed the limit (counting by admission time, as before, admitted a fourth call
/// 60 s in), and the limit is reached (the check is not vacuous).
pub async fn long_calls_hold_their_tpm_reservation(h: &dyn LimiterHarness) {
    const TPM: u64 = 60_000;
    const CALL: u64 = 20_000;
    let (s, w) = h.windowed().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    let scale = |secs: u64| w * secs as u32 / 60;
    let duration = scale(65);
    let r = Req::new(&sc, "a")
        .source_limits(0, TPM, 0)
        .est(CALL)
        .lease(w / 2);
    let tick = w / 30;
    let start = h.now();
    let mut running: Vec<(Duration, Permit)> = vec![];
    let mut settled: Vec<Duration> = vec![];
    let mut admitted = 0usize;
    while h.now() - start < scale(250) {
        let now = h.now();
        let (done, still): (Vec<_>, Vec<_>) = running
            .into_iter()
            .partition(|(at, _)| now - *at >= duration);
        running = still;
        for (_, mut p) in done {
            p.finish(CALL).await.unwrap();
            settled.push(h.now());
        }
        loop {
            match acquire(l, &r).await {
                Admission::Admitted(p) => {
                    let at = h.now();
                    // Settled within the last window, as the client saw it (real time: the
                    // server recorded the settlement up to a margin earlier).
                    let recent =
                        settled.iter().filter(|t| **t + w > at + h.margin()).count() as u64;
                    let used = (running.len() as u64 + recent) * CALL;
                    assert!(
                        used + CALL <= TPM,
                        "over-admitted at {:?}: {} in flight, {recent} settled within the window",
                        at - start,
                        running.len()
                    );
                    running.push((at, p));
                    admitted += 1;
                }
                Admission::Refused(f) => {
                    assert_eq!(f.reason, RefusalReason::Tpm);
                    break;
                }
            }
        }
        h.advance(tick).await;
    }
    for (_, mut p) in running {
        p.finish(CALL).await.unwrap();
    }
    // Three slots, each cycling every 65 s + 60 s: admissions at ~0 and ~125 s in 250 s.
    assert!(admitted >= 6, "only {admitted} calls admitted");
}

/// Scope-wide limits apply atomically with the source's: a refusal by either records
/// nothing anywhere.
pub async fn scope_limits_atomic_with_source(h: &dyn LimiterHarness) {
    let s = h.subject().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    // scope RPM across sources
    let r = Req::new(&sc, "a").scope_limits(2, 0);
    admit(l, &r).await.finish(0).await.unwrap();
    admit(l, &r.on("b")).await.finish(0).await.unwrap();
    let f = refuse(l, &r.on("c")).await;
    assert_eq!(f.reason, RefusalReason::ScopeRpm);
    assert!(f.retry_after.is_some());
    assert_eq!(
        win(&s, &sc, "c").await,
        (0, 0),
        "a scope refusal records nothing"
    );

    // scope TPM: the refused reservation is counted neither in the scope nor the source
    let sc = scope();
    let r = Req::new(&sc, "a").scope_limits(0, 1000).est(600);
    let mut a = admit(l, &r).await;
    assert_eq!(refuse(l, &r.on("b")).await.reason, RefusalReason::ScopeTpm);
    let small = r.on("b").source_limits(0, 400, 0).est(400);
    let mut b = admit(l, &small).await;
    assert_eq!(s.probe.scope_window(&sc).await.unwrap(), (2, 1000));
    assert_eq!(win(&s, &sc, "b").await, (1, 400));
    // settling in the source settles in the scope too
    a.finish(100).await.unwrap();
    assert_eq!(s.probe.scope_window(&sc).await.unwrap(), (2, 500));
    let mut c = admit(l, &r.on("c").est(500)).await;
    b.finish(400).await.unwrap();
    c.finish(500).await.unwrap();

    // a source refusal does not touch the scope window
    let sc = scope();
    let r = Req::new(&sc, "a")
        .source_limits(1, 0, 0)
        .scope_limits(10, 0);
    admit(l, &r).await.finish(0).await.unwrap();
    assert_eq!(refuse(l, &r).await.reason, RefusalReason::Rpm);
    assert_eq!(s.probe.scope_window(&sc).await.unwrap(), (1, 0));
}

/// Settle and release are idempotent; only the first settlement counts.
pub async fn settle_and_release_idempotent(h: &dyn LimiterHarness) {
    let s = h.subject().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    let r = Req::new(&sc, "a").source_limits(0, 1000, 3).est(500);
    let mut p = admit(l, &r).await;
    p.settle(100).await.unwrap();
    p.settle(900).await.unwrap();
    p.release().await.unwrap();
    p.release().await.unwrap();
    p.finish(700).await.unwrap();
    assert!(p.is_settled() && p.is_released());
    drop(p);
    l.flush().await.unwrap();
    assert_eq!(win(&s, &sc, "a").await, (1, 100));
    assert_eq!(in_flight(l, &sc, "a").await, 0);
    let q = admit(l, &r).await;
    let mut q2 = admit(l, &r.clone().est(400)).await;
    assert_eq!(
        refuse(l, &r.clone().est(1)).await.reason,
        RefusalReason::Tpm
    );
    q2.finish(0).await.unwrap();
    drop(q);
    l.flush().await.unwrap();
    assert_eq!(win(&s, &sc, "a").await, (3, 600));
}

/// A permit dropped unsettled settles its reservation and releases its slot (through the
/// backend's non-blocking path; `flush` waits for it).
pub async fn drop_settles_reservation_and_releases(h: &dyn LimiterHarness) {
    let s = h.subject().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    let r = Req::new(&sc, "a").source_limits(0, 500, 1).est(300);
    let p = admit(l, &r).await;
    drop(p);
    l.flush().await.unwrap();
    assert_eq!(in_flight(l, &sc, "a").await, 0);
    assert_eq!(win(&s, &sc, "a").await, (1, 300), "the reservation is kept");
    assert_eq!(refuse(l, &r).await.reason, RefusalReason::Tpm);
    // settled but unreleased, then dropped: release only
    let mut p = admit(l, &r.clone().est(200)).await;
    p.settle(50).await.unwrap();
    drop(p);
    l.flush().await.unwrap();
    assert_eq!(in_flight(l, &sc, "a").await, 0);
    assert_eq!(win(&s, &sc, "a").await, (2, 350));
    // handed to the background with a figure
    let p = admit(l, &r.clone().est(100)).await;
    p.finish_in_background(10);
    l.flush().await.unwrap();
    assert_eq!(in_flight(l, &sc, "a").await, 0);
    assert_eq!(win(&s, &sc, "a").await, (3, 360));
}

/// No limits: everything is admitted and nothing is refused.
pub async fn unlimited_admits_everything(h: &dyn LimiterHarness) {
    let s = h.subject().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    let r = Req::new(&sc, "a").est(1_000_000);
    let mut held = vec![];
    for _ in 0..50 {
        held.push(admit(l, &r).await);
    }
    assert_eq!(in_flight(l, &sc, "a").await, 50);
    for mut p in held {
        p.finish(1).await.unwrap();
    }
    assert_eq!(in_flight(l, &sc, "a").await, 0);
    assert_eq!(win(&s, &sc, "a").await, (50, 50));
}

/// Many concurrent acquirers (and, where the backend has connections, several independent
/// clients as separate processes would be) on one scope: admitted ≤ RPM, reserved tokens
/// ≤ TPM, in flight ≤ the cap — and a saturating load gets ≥ 95 % of RPM (here: all of it,
/// since everything happens inside one window).
pub async fn concurrent_acquirers_never_over_admit(h: &dyn LimiterHarness) {
    const CLIENTS: usize = 4;
    const TASKS_PER_CLIENT: usize = 6;
    const RPM: u32 = 15;
    const CONC: u32 = 5;
    const MAX: u64 = 40;
    const SCOPE_TPM: u64 = MAX * 100;
    let clients = h.clients(CLIENTS).await;
    let sc = scope();
    let admitted = Arc::new(AtomicU64::new(0));
    let holding: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let peak: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let mut tasks = vec![];
    for (ci, c) in clients.iter().enumerate() {
        for t in 0..TASKS_PER_CLIENT {
            let c = c.clone();
            let (admitted, holding, peak) = (admitted.clone(), holding.clone(), peak.clone());
            let src = (ci * TASKS_PER_CLIENT + t) % 2;
            // source 0: RPM + cap; source 1: cap; the scope: TPM over both.
            let r = Req::new(&sc, ["a", "b"][src])
                .source_limits(if src == 0 { RPM } else { 0 }, 0, CONC)
                .scope_limits(0, SCOPE_TPM)
                .est(100);
            tasks.push(tokio::spawn(async move {
                let mut done = 0u32;
                for _ in 0..5_000 {
                    match c.acquire(&r.get()).await.expect("acquire") {
                        Admission::Admitted(mut p) => {
                            admitted.fetch_add(1, Ordering::SeqCst);
                            // A lower bound of the true in-flight count: raised after the
                            // admission, lowered before the release.
                            let now = holding[src].fetch_add(1, Ordering::SeqCst) + 1;
                            peak[src].fetch_max(now, Ordering::SeqCst);
                            tokio::task::yield_now().await;
                            holding[src].fetch_sub(1, Ordering::SeqCst);
                            p.finish(100).await.expect("finish");
                        }
                        Admission::Refused(f) => match f.reason {
                            RefusalReason::Concurrency => tokio::task::yield_now().await,
                            RefusalReason::Rpm | RefusalReason::ScopeTpm => {
                                done += 1;
                                if done > 3 {
                                    break;
                                }
                                tokio::task::yield_now().await;
                            }
                            other => panic!("unexpected refusal {other:?}"),
                        },
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("acquirer task");
    }
    let total = admitted.load(Ordering::SeqCst);
    let s = h.subject().await;
    let (a_req, _) = win(&s, &sc, "a").await;
    let (scope_req, scope_tok) = s.probe.scope_window(&sc).await.unwrap();
    assert_eq!(
        scope_req, total,
        "every admission is in the scope window once"
    );
    assert!(a_req <= RPM as u64, "rpm over-admitted: {a_req} > {RPM}");
    assert!(
        scope_tok <= SCOPE_TPM,
        "scope tpm over-admitted: {scope_tok}"
    );
    assert!(
        total * 100 >= MAX * 95,
        "a saturating load must get ≥ 95 % of the scope TPM's worth ({MAX}): {total}"
    );
    for (i, p) in peak.iter().enumerate() {
        let p = p.load(Ordering::SeqCst);
        assert!(p <= CONC as u64, "source {i}: {p} in flight > {CONC}");
    }
    for c in &clients {
        assert_eq!(in_flight(c.as_ref(), &sc, "a").await, 0);
        assert_eq!(in_flight(c.as_ref(), &sc, "b").await, 0);
    }
}

/// RPM alone under many concurrent acquirers from several clients: exactly RPM admitted
/// within one window (never more; ≥ 95 %).
pub async fn concurrent_rpm_saturation(h: &dyn LimiterHarness) {
    const RPM: u32 = 100;
    let clients = h.clients(3).await;
    let sc = scope();
    let r = Req::new(&sc, "a")
        .source_limits(RPM, 0, 0)
        .scope_limits(RPM * 2, 0);
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = vec![];
    for i in 0..24 {
        let c = clients[i % clients.len()].clone();
        let (r, admitted) = (r.clone(), admitted.clone());
        tasks.push(tokio::spawn(async move {
            let mut refusals = 0;
            while refusals < 3 {
                match c.acquire(&r.get()).await.expect("acquire") {
                    Admission::Admitted(mut p) => {
                        admitted.fetch_add(1, Ordering::SeqCst);
                        p.finish(0).await.expect("finish");
                    }
                    Admission::Refused(f) => {
                        assert_eq!(f.reason, RefusalReason::Rpm);
                        refusals += 1;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let total = admitted.load(Ordering::SeqCst);
    assert!(total <= RPM as u64, "over-admitted: {total} > {RPM}");
    assert!(
        total * 100 >= RPM as u64 * 95,
        "under-admitted: {total} < 95 % of {RPM}"
    );
}

/// A saturating load over more than two windows: in every rolling window admissions ≤
/// RPM, and over the run at least 95 % of what the windows allow is admitted.
pub async fn saturating_load_over_windows(h: &dyn LimiterHarness) {
    const RPM: u32 = 20;
    let (s, w) = h.windowed().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    let r = Req::new(&sc, "a").source_limits(RPM, 0, 0);
    let step = w / 40;
    let start = h.now();
    let run = w * 2 + w / 2;
    let mut times: Vec<Duration> = vec![];
    while h.now() - start < run {
        loop {
            match acquire(l, &r).await {
                Admission::Admitted(mut p) => {
                    times.push(h.now());
                    p.finish(0).await.unwrap();
                }
                Admission::Refused(f) => {
                    assert_eq!(f.reason, RefusalReason::Rpm);
                    break;
                }
            }
        }
        h.advance(step).await;
    }
    // Never over-admit: any RPM+1 admissions span at least a window (less the slack of
    // reading a client clock after the server decided).
    let slack = h.margin();
    for pair in times.windows(RPM as usize + 1) {
        let span = pair[RPM as usize] - pair[0];
        assert!(
            span + slack >= w,
            "{} admissions within {span:?} < window {w:?}",
            RPM + 1
        );
    }
    // Bounded under-admission: the run covers three window starts (0, ~w, ~2w).
    let allowed = 3 * RPM as usize;
    assert!(
        times.len() * 100 >= allowed * 95 && times.len() <= allowed,
        "admitted {} of {allowed}",
        times.len()
    );
}

// ------------------------------------------------------------------------------------
// Reference-model proptest
// ------------------------------------------------------------------------------------

/// The limits one proptest case runs under (every source has the same).
#[derive(Debug, Clone, Copy)]
pub struct ModelLimits {
    /// Source RPM.
    pub rpm: u32,
    /// Source TPM.
    pub tpm: u64,
    /// Source cap.
    pub conc: u32,
    /// Scope RPM.
    pub scope_rpm: u32,
    /// Scope TPM.
    pub scope_tpm: u64,
    /// Lease, ms.
    pub lease_ms: u64,
}

/// One step of a random sequence.
#[derive(Debug, Clone)]
pub enum ModelOp {
    /// Acquire on source `source % 3` reserving `est`.
    Acquire {
        /// Source index.
        source: usize,
        /// Reservation.
        est: u64,
    },
    /// `Permit::settle` on a held permit.
    Settle {
        /// Which held permit.
        pick: usize,
        /// Tokens.
        tokens: u64,
    },
    /// `Permit::release`.
    Release {
        /// Which held permit.
        pick: usize,
    },
    /// `Permit::finish`.
    Finish {
        /// Which held permit.
        pick: usize,
        /// Tokens.
        tokens: u64,
    },
    /// Drop the permit (drop-time settlement), then `flush`.
    Drop {
        /// Which held permit.
        pick: usize,
    },
    /// `Permit::finish_in_background`, then `flush`.
    Background {
        /// Which held permit.
        pick: usize,
        /// Tokens.
        tokens: u64,
    },
    /// Let time pass (manual-time harnesses only).
    Advance {
        /// Milliseconds.
        ms: u64,
    },
}

/// Limits for a case: any of them may be off; `lease_ms` is long unless `short_leases`.
pub fn limits_strategy(short_leases: bool) -> impl Strategy<Value = ModelLimits> {
    let opt_u32 = |hi: u32| prop_oneof![1 => Just(0u32), 3 => 1..hi];
    let opt_u64 = |lo: u64, hi: u64| prop_oneof![1 => Just(0u64), 3 => lo..hi];
    let lease = if short_leases {
        (1_000u64..120_000).boxed()
    } else {
        Just(600_000u64).boxed()
    };
    (
        opt_u32(8),
        opt_u64(200, 2_000),
        opt_u32(4),
        opt_u32(14),
        opt_u64(300, 3_000),
        lease,
    )
        .prop_map(
            |(rpm, tpm, conc, scope_rpm, scope_tpm, lease_ms)| ModelLimits {
                rpm,
                tpm,
                conc,
                scope_rpm,
                scope_tpm,
                lease_ms,
            },
        )
}

/// Random op sequences; `Advance` only when `advance` (manual time).
pub fn ops_strategy(advance: bool, len: usize) -> impl Strategy<Value = Vec<ModelOp>> {
    let max_adv = if advance { 30_000u64 } else { 0 };
    let op = prop_oneof![
        6 => (0usize..3, 0u64..500).prop_map(|(source, est)| ModelOp::Acquire { source, est }),
        2 => (0usize..16, 0u64..900).prop_map(|(pick, tokens)| ModelOp::Settle { pick, tokens }),
        2 => (0usize..16).prop_map(|pick| ModelOp::Release { pick }),
        2 => (0usize..16, 0u64..900).prop_map(|(pick, tokens)| ModelOp::Finish { pick, tokens }),
        1 => (0usize..16).prop_map(|pick| ModelOp::Drop { pick }),
        1 => (0usize..16, 0u64..900).prop_map(|(pick, tokens)| ModelOp::Background { pick, tokens }),
        2 => (0..=max_adv).prop_map(|ms| ModelOp::Advance { ms }),
    ];
    proptest::collection::vec(op, 1..len)
}

struct Held {
    permit: Permit,
    id: u64,
    settled: bool,
    released: bool,
}

const SOURCES: [&str; 3] = ["a", "b", "c"];

fn check_refusal(
    h: &dyn LimiterHarness,
    got: Refusal,
    want: Refusal,
    elapsed: Duration,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.reason, want.reason);
    if h.manual_time() {
        prop_assert_eq!(got.retry_after, want.retry_after);
    } else {
        match (got.retry_after, want.retry_after) {
            (None, None) => {}
            (Some(g), Some(w)) => prop_assert!(
                g <= w && g + elapsed + Duration::from_millis(2) >= w,
                "hint {:?} vs model {:?} (case took {:?})",
                g,
                w,
                elapsed
            ),
            (g, w) => prop_assert!(false, "hint {:?} vs model {:?}", g, w),
        }
    }
    Ok(())
}

/// Runs one op sequence against a fresh subject and the reference model, comparing every
/// admission, refusal (reason and hint), in-flight count and window after every step.
/// Manual time: the model's clock is the harness's; real time: the model's clock stands
/// still (no case lasts near a window or a lease) and hints are compared within the time
/// the case took.
pub async fn matches_model(
    h: &dyn LimiterHarness,
    limits: ModelLimits,
    ops: &[ModelOp],
) -> Result<(), TestCaseError> {
    let s = h.quiet().await;
    let l = s.limiter.as_ref();
    let sc = scope();
    let start = h.now();
    let mut model = WindowLimiter::new();
    // Manual time: the subject's clock reads `h.now()` (it shares the harness's base);
    // real time: the model's clock stands still.
    let mut now = if h.manual_time() {
        h.now().as_millis() as u64
    } else {
        0
    };
    let mut held: Vec<Held> = vec![];
    for op in ops {
        match *op {
            ModelOp::Acquire { source, est } => {
                let r = Req::new(&sc, SOURCES[source % SOURCES.len()])
                    .source_limits(limits.rpm, limits.tpm, limits.conc)
                    .scope_limits(limits.scope_rpm, limits.scope_tpm)
                    .est(est)
                    .lease(Duration::from_millis(limits.lease_ms));
                let want = model.acquire(now, &r.get());
                let got = l.acquire(&r.get()).await.map_err(fail)?;
                match (got, want) {
                    (Admission::Admitted(permit), Ok(id)) => held.push(Held {
                        permit,
                        id,
                        settled: false,
                        released: false,
                    }),
                    (Admission::Refused(g), Err(w)) => check_refusal(h, g, w, h.now() - start)?,
                    (g, w) => prop_assert!(false, "backend {:?} vs model {:?}", g, w),
                }
            }
            ModelOp::Settle { pick, tokens } if !held.is_empty() => {
                let x = pick % held.len();
                let e = &mut held[x];
                e.permit.settle(tokens).await.map_err(fail)?;
                if !e.settled {
                    model.settle(now, e.id, tokens);
                    e.settled = true;
                }
            }
            ModelOp::Release { pick } if !held.is_empty() => {
                let x = pick % held.len();
                let e = &mut held[x];
                e.permit.release().await.map_err(fail)?;
                model.release(e.id);
                e.released = true;
            }
            ModelOp::Finish { pick, tokens } if !held.is_empty() => {
                let x = pick % held.len();
                let e = &mut held[x];
                e.permit.finish(tokens).await.map_err(fail)?;
                if !e.settled {
                    model.settle(now, e.id, tokens);
                }
                model.release(e.id);
                (e.settled, e.released) = (true, true);
            }
            ModelOp::Drop { pick } if !held.is_empty() => {
                let e = held.remove(pick % held.len());
                if !e.settled {
                    model.settle(now, e.id, e.permit.est_tokens());
                }
                model.release(e.id);
                drop(e.permit);
                l.flush().await.map_err(fail)?;
            }
            ModelOp::Background { pick, tokens } if !held.is_empty() => {
                let e = held.remove(pick % held.len());
                if !e.settled {
                    model.settle(now, e.id, tokens);
                }
                model.release(e.id);
                e.permit.finish_in_background(tokens);
                l.flush().await.map_err(fail)?;
            }
            ModelOp::Advance { ms } if h.manual_time() => {
                h.advance(Duration::from_millis(ms)).await;
                now += ms;
            }
            _ => continue,
        }
        for src in SOURCES {
            let got = l.in_flight(&sc, src).await.map_err(fail)?;
            prop_assert_eq!(got, model.in_flight(now, &sc, src), "in flight of {}", src);
            let got = s.probe.source_window(&sc, src).await.map_err(fail)?;
            prop_assert_eq!(got, model.source_window(now, &sc, src), "window of {}", src);
        }
        let got = s.probe.scope_window(&sc).await.map_err(fail)?;
        prop_assert_eq!(got, model.scope_window(now, &sc), "scope window");
    }
    // Leave nothing in flight for the next case.
    for mut e in held {
        e.permit.finish(0).await.map_err(fail)?;
    }
    Ok(())
}

fn fail(e: GovernanceError) -> TestCaseError {
    TestCaseError::fail(format!("backend error: {e}"))
}

/// Runs [`matches_model`] over `cases` random cases on `rt` (a plain `#[test]` calls this;
/// the harness must have been created on `rt`).
pub fn model_proptest(rt: &tokio::runtime::Runtime, h: &dyn LimiterHarness, cases: u32) {
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let manual = h.manual_time();
    let strategy = (limits_strategy(manual), ops_strategy(manual, 80));
    let result = runner.run(&strategy, |(limits, ops)| {
        rt.block_on(matches_model(h, limits, &ops))
    });
    if let Err(e) = result {
        panic!("limiter differs from the reference model: {e}");
    }
}
