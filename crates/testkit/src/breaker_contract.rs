//! The `BreakerStore` contract (SPEC §4.4, issue 4): cases every breaker store runs
//! through a [`BreakerHarness`], and a proptest comparing random admit / record / time
//! sequences with core's pure state machine [`BreakerState`].
//!
//! Consecutive breaker-feeding failures open the breaker for `OPEN_S`; each failed
//! half-open probe doubles it up to `OPEN_MAX_S`; half-open admits exactly one probe (a lease the
//! store renews while it is held) and its success closes the breaker; 429s set a cooldown
//! (the longer one wins); dead sources are out for `DEAD_S` and nothing else revives them;
//! outcomes count only in the epoch they were admitted under (SPEC §14.7). Manual-time harnesses are compared exactly; real-time
//! ones (Redis: the server's `TIME`) wait for real with short settings and compare hints
//! within the time the case took.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::breaker::{open_ms, BreakerAdmit, BreakerOutcome, BreakerState};
use polygw_core::error::{GovernanceError, RefusalReason};
use polygw_core::ports::BreakerStore;
use polygw_core::settings::BreakerSettings;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use crate::services::unique_name;

/// How the contract reaches one breaker store.
#[async_trait]
pub trait BreakerHarness: Send + Sync {
    /// The store. Every store and client of a harness shares one state (cases keep apart
    /// by scope); on a manual clock its timestamps are on the harness's base.
    async fn store(&self) -> Arc<dyn BreakerStore>;
    /// `n` independent clients of the same state (separate connections where there are).
    async fn clients(&self, n: usize) -> Vec<Arc<dyn BreakerStore>>;
    /// Another client of the same state whose heartbeat the returned closure stops (what
    /// a crashed process looks like).
    async fn crashable(&self) -> (Arc<dyn BreakerStore>, Box<dyn Fn() + Send + Sync>);
    /// A client whose heartbeat never renews anything (the model proptest compares it
    /// with [`BreakerState`], which renews nothing by itself).
    async fn quiet(&self) -> Arc<dyn BreakerStore>;
    /// Settings for the timed cases: short enough to wait for on real time.
    fn settings(&self) -> BreakerSettings;
    /// Whether `advance` moves a manual clock (exact) or waits.
    fn manual_time(&self) -> bool;
    /// Lets `by` pass.
    async fn advance(&self, by: Duration);
    /// Time since the harness was created, on the clock `advance` moves.
    fn now(&self) -> Duration;
    /// Slack for real-time waits and hints (zero for a manual clock).
    fn margin(&self) -> Duration;
}

fn scope() -> String {
    unique_name("BC")
}

const SRC: &str = "src";

async fn admit(b: &dyn BreakerStore, sc: &str, lease: Duration) -> BreakerAdmit {
    b.admit(sc, SRC, lease).await.expect("breaker admit")
}

/// Records an outcome admitted under the current epoch.
async fn record(
    b: &dyn BreakerStore,
    sc: &str,
    o: BreakerOutcome,
    probe: bool,
    s: &BreakerSettings,
) {
    let epoch = state(b, sc).await.epoch;
    record_in(b, sc, o, epoch, probe, s).await
}

async fn record_in(
    b: &dyn BreakerStore,
    sc: &str,
    o: BreakerOutcome,
    epoch: u64,
    probe: bool,
    s: &BreakerSettings,
) {
    b.record(sc, SRC, o, epoch, probe, s)
        .await
        .expect("breaker record")
}

/// `Some(probe)` when allowed.
fn probe_of(a: BreakerAdmit) -> Option<bool> {
    match a {
        BreakerAdmit::Allowed { probe, .. } => Some(probe),
        BreakerAdmit::Refused { .. } => None,
    }
}

/// The epoch of an admission (panics on a refusal).
fn epoch_of(a: BreakerAdmit) -> u64 {
    match a {
        BreakerAdmit::Allowed { epoch, .. } => epoch,
        BreakerAdmit::Refused { .. } => panic!("expected an admission, got {a:?}"),
    }
}

async fn state(b: &dyn BreakerStore, sc: &str) -> BreakerState {
    b.state(sc, SRC).await.expect("breaker state")
}

/// Expects a refusal for `reason` whose hint is `want` (exactly on a manual clock; within
/// `(want − since − margin, want]` on real time, `since` = time since the cause).
fn assert_refused(
    h: &dyn BreakerHarness,
    got: BreakerAdmit,
    reason: RefusalReason,
    want: Duration,
    since: Duration,
) {
    let BreakerAdmit::Refused {
        reason: r,
        retry_after_ms,
    } = got
    else {
        panic!("expected a {reason:?} refusal, got {got:?}");
    };
    assert_eq!(r, reason);
    let got = Duration::from_millis(retry_after_ms);
    if h.manual_time() {
        assert_eq!(got, want, "hint");
    } else {
        assert!(
            got <= want && got + since + h.margin() >= want,
            "hint {got:?} vs {want:?} ({since:?} since the cause)"
        );
    }
}

const LEASE: Duration = Duration::from_secs(60);
const ALLOWED: Option<bool> = Some(false);
const PROBE: Option<bool> = Some(true);

async fn trip(h: &dyn BreakerHarness, b: &dyn BreakerStore, sc: &str) -> Duration {
    let s = h.settings();
    for _ in 0..s.failures {
        record(b, sc, BreakerOutcome::Failure, false, &s).await;
    }
    h.now()
}

/// `FAILURES` consecutive failures open the breaker for `OPEN_S`; fewer do not.
pub async fn opens_after_consecutive_failures(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    assert_eq!(probe_of(admit(b, &sc, LEASE).await), ALLOWED);
    for _ in 1..s.failures {
        record(b, &sc, BreakerOutcome::Failure, false, &s).await;
        assert_eq!(probe_of(admit(b, &sc, LEASE).await), ALLOWED);
    }
    record(b, &sc, BreakerOutcome::Failure, false, &s).await;
    let t = h.now();
    let got = admit(b, &sc, LEASE).await;
    assert_refused(h, got, RefusalReason::CircuitOpen, s.open, h.now() - t);
    let st = state(b, &sc).await;
    assert_eq!(st.consecutive_failures, s.failures);
    assert!(st.is_tripped());
    assert_eq!(st.reopens, 0);
}

/// A success resets the consecutive count; neutral outcomes and 429s do not feed it.
pub async fn only_consecutive_feeding_failures_count(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    for _ in 1..s.failures {
        record(b, &sc, BreakerOutcome::Failure, false, &s).await;
    }
    record(b, &sc, BreakerOutcome::Success, false, &s).await;
    assert_eq!(state(b, &sc).await.consecutive_failures, 0);
    for _ in 1..s.failures {
        record(b, &sc, BreakerOutcome::Failure, false, &s).await;
        record(b, &sc, BreakerOutcome::Neutral, false, &s).await;
    }
    record(
        b,
        &sc,
        BreakerOutcome::RateLimited { cooldown_ms: 1 },
        false,
        &s,
    )
    .await;
    let st = state(b, &sc).await;
    assert_eq!(st.consecutive_failures, s.failures - 1);
    assert!(!st.is_tripped());
}

/// After the open time, half-open admits exactly one probe; its success closes the
/// breaker and forgets everything but a cooldown.
pub async fn half_open_admits_one_probe_and_success_closes(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    trip(h, b, &sc).await;
    h.advance(s.open + h.margin()).await;
    let lease = Duration::from_secs(30);
    assert_eq!(probe_of(admit(b, &sc, lease).await), PROBE);
    let t = h.now();
    let got = admit(b, &sc, lease).await;
    assert_refused(h, got, RefusalReason::CircuitOpen, lease, h.now() - t);
    record(b, &sc, BreakerOutcome::Success, true, &s).await;
    assert_eq!(probe_of(admit(b, &sc, lease).await), ALLOWED);
    let st = state(b, &sc).await;
    assert!(!st.is_tripped());
    assert_eq!(
        (st.consecutive_failures, st.reopens, st.probe_until),
        (0, 0, 0),
        "closed, nothing remembered but the epoch"
    );
}

/// A failed probe re-opens the breaker for twice as long, then four times.
pub async fn failed_probe_doubles_open_time(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    trip(h, b, &sc).await;
    let mut wait = s.open;
    for factor in [2u32, 4] {
        h.advance(wait + h.margin()).await;
        assert_eq!(probe_of(admit(b, &sc, LEASE).await), PROBE);
        record(b, &sc, BreakerOutcome::Failure, true, &s).await;
        let t = h.now();
        let got = admit(b, &sc, LEASE).await;
        wait = s.open * factor;
        assert_refused(h, got, RefusalReason::CircuitOpen, wait, h.now() - t);
    }
    let st = state(b, &sc).await;
    assert_eq!(st.reopens, 2);
    assert_eq!(st.consecutive_failures, s.failures + 2);
}

/// The re-open time stops doubling at `OPEN_MAX_S`.
pub async fn open_time_capped_at_open_max(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    // Settings travel with each record: a shorter OPEN_S keeps the real-time wait short
    // (every checked re-open is still ≥ 2× it).
    let s = BreakerSettings {
        open: h.settings().open / 5,
        open_max: h.settings().open * 2,
        ..h.settings()
    };
    let sc = scope();
    for _ in 0..s.failures {
        record(b, &sc, BreakerOutcome::Failure, false, &s).await;
    }
    let mut wait = s.open;
    for reopens in 1..=5u32 {
        h.advance(wait + h.margin()).await;
        assert_eq!(probe_of(admit(b, &sc, LEASE).await), PROBE);
        record(b, &sc, BreakerOutcome::Failure, true, &s).await;
        let t = h.now();
        wait = Duration::from_millis(open_ms(&s, reopens));
        let got = admit(b, &sc, LEASE).await;
        assert_refused(h, got, RefusalReason::CircuitOpen, wait, h.now() - t);
    }
    assert_eq!(wait, s.open_max);
    assert_eq!(state(b, &sc).await.reopens, 5);
}

/// A probe whose outcome never comes back and whose heartbeat is silent frees the
/// half-open slot when its lease ends; a neutral outcome frees it at once.
pub async fn probe_lease_expires_and_neutral_frees(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    trip(h, b, &sc).await;
    h.advance(s.open + h.margin()).await;
    let lease = if h.manual_time() {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(1)
    };
    let silent = h.quiet().await;
    assert_eq!(probe_of(admit(silent.as_ref(), &sc, lease).await), PROBE);
    assert!(matches!(
        admit(b, &sc, lease).await,
        BreakerAdmit::Refused {
            reason: RefusalReason::CircuitOpen,
            ..
        }
    ));
    h.advance(lease + h.margin()).await;
    assert_eq!(
        probe_of(admit(b, &sc, lease).await),
        PROBE,
        "the lost probe's lease ended"
    );
    record(b, &sc, BreakerOutcome::Neutral, true, &s).await;
    assert_eq!(
        probe_of(admit(b, &sc, lease).await),
        PROBE,
        "a neutral probe frees the slot"
    );
    assert!(state(b, &sc).await.is_tripped(), "still half-open");
}

/// A cooldown from outside of any length is bounded alike in every store (SPEC §17.6):
/// never wrapped into the past, never truncated, never forever.
pub async fn a_huge_cooldown_is_bounded_alike(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    record(
        b,
        &sc,
        BreakerOutcome::RateLimited {
            cooldown_ms: u64::MAX,
        },
        false,
        &s,
    )
    .await;
    let t = h.now();
    let got = admit(b, &sc, LEASE).await;
    assert_refused(
        h,
        got,
        RefusalReason::Cooldown,
        polygw_core::classify::MAX_RETRY_HINT,
        h.now() - t,
    );
}

/// A 429 cools the source down for its Retry-After; a shorter later one does not shorten
/// it; it does not feed the breaker.
pub async fn cooldown_from_retry_after(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    let cool = s.open * 2;
    let cool_ms = cool.as_millis() as u64;
    record(
        b,
        &sc,
        BreakerOutcome::RateLimited {
            cooldown_ms: cool_ms,
        },
        false,
        &s,
    )
    .await;
    let t = h.now();
    record(
        b,
        &sc,
        BreakerOutcome::RateLimited {
            cooldown_ms: cool_ms / 4,
        },
        false,
        &s,
    )
    .await;
    let got = admit(b, &sc, LEASE).await;
    assert_refused(h, got, RefusalReason::Cooldown, cool, h.now() - t);
    let st = state(b, &sc).await;
    assert_eq!(st.consecutive_failures, 0);
    assert!(!st.is_tripped());
    h.advance(cool + h.margin()).await;
    assert_eq!(probe_of(admit(b, &sc, LEASE).await), ALLOWED);
}

/// A dead source (401/403/404 `DEAD_AFTER` times in a row) is out for `DEAD_S`, then
/// back; fewer answers in a row, or a success or a 429 between them, do not take it out
/// (SPEC §17.4).
pub async fn dead_source_out_for_dead_s(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    assert!(
        s.dead_after >= 2,
        "the harness keeps the default DEAD_AFTER"
    );
    let sc = scope();
    for _ in 1..s.dead_after {
        record(b, &sc, BreakerOutcome::Dead, false, &s).await;
    }
    assert_eq!(
        probe_of(admit(b, &sc, LEASE).await),
        ALLOWED,
        "not dead yet"
    );
    record(b, &sc, BreakerOutcome::Success, false, &s).await;
    record(b, &sc, BreakerOutcome::Dead, false, &s).await;
    assert_eq!(
        probe_of(admit(b, &sc, LEASE).await),
        ALLOWED,
        "a success restarts the count"
    );
    record(
        b,
        &sc,
        BreakerOutcome::RateLimited { cooldown_ms: 1 },
        false,
        &s,
    )
    .await;
    h.advance(Duration::from_millis(2) + h.margin()).await;
    for _ in 1..s.dead_after {
        record(b, &sc, BreakerOutcome::Dead, false, &s).await;
    }
    assert_eq!(
        probe_of(admit(b, &sc, LEASE).await),
        ALLOWED,
        "a 429 restarts it too"
    );
    record(b, &sc, BreakerOutcome::Dead, false, &s).await;
    let t = h.now();
    let got = admit(b, &sc, LEASE).await;
    assert_refused(h, got, RefusalReason::Dead, s.dead, h.now() - t);
    assert_eq!(state(b, &sc).await.consecutive_failures, 0);
    h.advance(s.dead + h.margin()).await;
    assert_eq!(probe_of(admit(b, &sc, LEASE).await), ALLOWED);
    assert_eq!(state(b, &sc).await.consecutive_failures, 0);
}

/// SPEC §26.3, an operator's actions: a reset closes an open (or dead) breaker at once,
/// for every client of the store, in a new epoch (an outcome admitted before it counts
/// no more); a drained source is refused as `drained` by every client until it is
/// brought back, and a reset leaves it drained.
pub async fn reset_and_drain_act_at_once_for_every_client(h: &dyn BreakerHarness) {
    let clients = h.clients(2).await;
    let (a, b) = (clients[0].as_ref(), clients[1].as_ref());
    let s = h.settings();
    let sc = scope();
    let before = state(a, &sc).await.epoch;
    for _ in 0..s.failures {
        record(a, &sc, BreakerOutcome::Failure, false, &s).await;
    }
    assert!(probe_of(admit(b, &sc, LEASE).await).is_none(), "open");
    // The store's clock is the unit of its times: the breaker is open for OPEN_S from it.
    let now = b.clock_ms().await.expect("clock");
    let open = state(a, &sc).await.open_until;
    assert!(
        open > now && open - now <= s.open.as_millis() as u64 + 1,
        "open until {open}, now {now}"
    );
    let stale = state(a, &sc).await.epoch;
    a.reset(&sc, SRC).await.expect("reset");
    let st = state(b, &sc).await;
    assert!(!st.is_tripped() && st.consecutive_failures == 0, "{st:?}");
    assert!(st.epoch > stale && stale >= before, "a new epoch: {st:?}");
    assert_eq!(
        probe_of(admit(b, &sc, LEASE).await),
        ALLOWED,
        "closed at once"
    );
    // A failure admitted before the reset does not count against the new epoch.
    for _ in 0..s.failures {
        record_in(a, &sc, BreakerOutcome::Failure, stale, false, &s).await;
    }
    assert_eq!(
        probe_of(admit(b, &sc, LEASE).await),
        ALLOWED,
        "stale outcomes"
    );
    // Dead, then reset: alive.
    for _ in 0..s.dead_after {
        record(a, &sc, BreakerOutcome::Dead, false, &s).await;
    }
    assert!(probe_of(admit(b, &sc, LEASE).await).is_none(), "dead");
    b.reset(&sc, SRC).await.expect("reset");
    assert_eq!(probe_of(admit(a, &sc, LEASE).await), ALLOWED, "revived");
    // Drained: refused everywhere, a reset keeps it so, bringing it back ends it.
    a.set_drained(&sc, SRC, true).await.expect("drain");
    for c in [a, b] {
        match admit(c, &sc, LEASE).await {
            BreakerAdmit::Refused { reason, .. } => assert_eq!(reason, RefusalReason::Drained),
            other => panic!("drained: {other:?}"),
        }
    }
    assert!(state(b, &sc).await.drained);
    b.reset(&sc, SRC).await.expect("reset");
    assert!(
        probe_of(admit(a, &sc, LEASE).await).is_none(),
        "still drained"
    );
    b.set_drained(&sc, SRC, false).await.expect("undrain");
    assert!(!state(a, &sc).await.drained);
    assert_eq!(probe_of(admit(a, &sc, LEASE).await), ALLOWED, "back");
    // Another source of the scope was never touched.
    assert_eq!(
        probe_of(a.admit(&sc, "other", LEASE).await.expect("admit")),
        ALLOWED
    );
}

/// Many concurrent admits from several clients in half-open: exactly one probe.
pub async fn concurrent_half_open_grants_one_probe(h: &dyn BreakerHarness) {
    let clients = h.clients(3).await;
    let s = h.settings();
    let sc = scope();
    trip(h, clients[0].as_ref(), &sc).await;
    h.advance(s.open + h.margin()).await;
    let probes = Arc::new(AtomicU64::new(0));
    let mut tasks = vec![];
    for i in 0..24 {
        let c = clients[i % clients.len()].clone();
        let (sc, probes) = (sc.clone(), probes.clone());
        tasks.push(tokio::spawn(async move {
            match c.admit(&sc, SRC, LEASE).await.expect("admit") {
                BreakerAdmit::Allowed { probe: true, .. } => {
                    probes.fetch_add(1, Ordering::SeqCst);
                }
                BreakerAdmit::Allowed { probe: false, .. } => {
                    panic!("half-open admitted a non-probe")
                }
                BreakerAdmit::Refused { reason, .. } => {
                    assert_eq!(reason, RefusalReason::CircuitOpen)
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(probes.load(Ordering::SeqCst), 1);
}

/// Sources are independent: tripping one leaves the others (and other scopes) closed.
pub async fn sources_are_independent(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let sc = scope();
    trip(h, b, &sc).await;
    assert_eq!(
        probe_of(b.admit(&sc, "other", LEASE).await.unwrap()),
        ALLOWED,
        "another source"
    );
    assert_eq!(
        probe_of(b.admit(&scope(), SRC, LEASE).await.unwrap()),
        ALLOWED,
        "another scope"
    );
    assert_eq!(
        b.state(&sc, "other").await.unwrap(),
        BreakerState::default()
    );
}

/// SPEC §14.7: a success of an attempt admitted before a trip does not close the
/// breaker; failures of attempts admitted before a close do not count against it.
pub async fn outcomes_count_only_in_their_epoch(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    let before = epoch_of(admit(b, &sc, LEASE).await);
    trip(h, b, &sc).await;
    record_in(b, &sc, BreakerOutcome::Success, before, false, &s).await;
    assert!(
        state(b, &sc).await.is_tripped(),
        "a stale success closed the breaker"
    );
    assert!(matches!(
        admit(b, &sc, LEASE).await,
        BreakerAdmit::Refused {
            reason: RefusalReason::CircuitOpen,
            ..
        }
    ));
    h.advance(s.open + h.margin()).await;
    let a = admit(b, &sc, LEASE).await;
    assert_eq!(probe_of(a), PROBE);
    record_in(b, &sc, BreakerOutcome::Success, epoch_of(a), true, &s).await;
    assert!(!state(b, &sc).await.is_tripped(), "the probe closes it");
    for _ in 0..s.failures {
        record_in(b, &sc, BreakerOutcome::Failure, before, false, &s).await;
    }
    assert_eq!(state(b, &sc).await.consecutive_failures, 0);
    assert_eq!(probe_of(admit(b, &sc, LEASE).await), ALLOWED);
}

/// A stale probe's outcome (its epoch is over) neither closes the breaker nor frees the
/// current probe.
pub async fn stale_probe_changes_nothing(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    trip(h, b, &sc).await;
    h.advance(s.open + h.margin()).await;
    let short = if h.manual_time() {
        Duration::from_secs(5)
    } else {
        Duration::from_millis(500)
    };
    let q = h.quiet().await;
    let old = epoch_of(admit(q.as_ref(), &sc, short).await);
    h.advance(short + h.margin()).await;
    let new = epoch_of(admit(b, &sc, LEASE).await);
    assert!(new > old);
    record_in(b, &sc, BreakerOutcome::Success, old, true, &s).await;
    record_in(b, &sc, BreakerOutcome::Neutral, old, true, &s).await;
    assert!(state(b, &sc).await.is_tripped());
    assert_eq!(
        probe_of(admit(b, &sc, LEASE).await),
        None,
        "the new probe is out"
    );
    record_in(b, &sc, BreakerOutcome::Neutral, new, true, &s).await;
    assert_eq!(probe_of(admit(b, &sc, LEASE).await), PROBE);
}

/// Nothing but the end of the dead period revives a dead source: a success in flight
/// when the key was revoked does not.
pub async fn only_the_dead_period_revives_a_dead_source(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    let e = epoch_of(admit(b, &sc, LEASE).await);
    for _ in 0..s.dead_after {
        record_in(b, &sc, BreakerOutcome::Dead, e, false, &s).await;
    }
    let t = h.now();
    record_in(b, &sc, BreakerOutcome::Success, e, false, &s).await;
    let got = admit(b, &sc, LEASE).await;
    assert_refused(h, got, RefusalReason::Dead, s.dead, h.now() - t);
    h.advance(s.dead + h.margin()).await;
    assert_eq!(probe_of(admit(b, &sc, LEASE).await), ALLOWED);
}

/// SPEC §14.4: a half-open probe held past several lease lengths stays the only probe
/// (its heartbeat renews it); a crashed holder's probe frees within one lease.
pub async fn probe_renewed_while_held_and_freed_after_a_crash(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    let lease = if h.manual_time() {
        Duration::from_secs(30)
    } else {
        Duration::from_secs(1)
    };
    trip(h, b, &sc).await;
    h.advance(s.open + h.margin()).await;
    let p = admit(b, &sc, lease).await;
    assert_eq!(probe_of(p), PROBE);
    for _ in 0..7 {
        h.advance(lease / 2).await;
        assert_eq!(
            probe_of(admit(b, &sc, lease).await),
            None,
            "the probe is held"
        );
    }
    record_in(b, &sc, BreakerOutcome::Neutral, epoch_of(p), true, &s).await;
    let (crashed, crash) = h.crashable().await;
    assert_eq!(probe_of(admit(crashed.as_ref(), &sc, lease).await), PROBE);
    crash();
    assert_eq!(probe_of(admit(b, &sc, lease).await), None);
    h.advance(lease + h.margin()).await;
    assert_eq!(
        probe_of(admit(b, &sc, lease).await),
        PROBE,
        "the crashed holder's probe ended with its lease"
    );
}

/// `release_probe` (the non-blocking path of drop-time code) frees the probe of its
/// epoch, and only that one.
pub async fn release_probe_frees_it(h: &dyn BreakerHarness) {
    let b = h.store().await;
    let b = b.as_ref();
    let s = h.settings();
    let sc = scope();
    trip(h, b, &sc).await;
    h.advance(s.open + h.margin()).await;
    let first = epoch_of(admit(b, &sc, LEASE).await);
    b.release_probe(&sc, SRC, first);
    b.flush().await.expect("flush");
    let second = epoch_of(admit(b, &sc, LEASE).await);
    assert!(second > first);
    b.release_probe(&sc, SRC, first);
    b.flush().await.expect("flush");
    assert_eq!(
        probe_of(admit(b, &sc, LEASE).await),
        None,
        "a stale release frees nothing"
    );
    b.release_probe(&sc, SRC, second);
    b.flush().await.expect("flush");
    assert_eq!(probe_of(admit(b, &sc, LEASE).await), PROBE);
}

// ------------------------------------------------------------------------------------
// Reference-model proptest
// ------------------------------------------------------------------------------------

/// One step of a random breaker sequence.
#[derive(Debug, Clone)]
pub enum BreakerOp {
    /// `admit` with this probe lease (ms).
    Admit(u64),
    /// `record` (`probe`: pass the probe flag) under the current epoch minus `stale`
    /// (0: current).
    Record(BreakerOutcome, bool, u64),
    /// Let time pass (manual-time harnesses only).
    Advance(u64),
}

/// Settings for a case: short times on a manual clock, long ones on real time (so nothing
/// expires while a case runs).
pub fn settings_strategy(manual: bool) -> impl Strategy<Value = BreakerSettings> {
    let (open, dead) = if manual {
        ((1u64..20_000).boxed(), (1u64..60_000).boxed())
    } else {
        ((60_000u64..120_000).boxed(), (300_000u64..600_000).boxed())
    };
    (1u32..5, open, 1u64..20, dead, 1u32..4).prop_map(
        |(failures, open, max_factor, dead, dead_after)| BreakerSettings {
            failures,
            open: Duration::from_millis(open),
            open_max: Duration::from_millis(open * max_factor),
            dead: Duration::from_millis(dead),
            dead_after,
        },
    )
}

/// Random breaker op sequences.
pub fn breaker_ops_strategy(manual: bool, len: usize) -> impl Strategy<Value = Vec<BreakerOp>> {
    let cool = if manual {
        (0u64..30_000).boxed()
    } else {
        (60_000u64..120_000).boxed()
    };
    let lease = if manual {
        (1u64..10_000).boxed()
    } else {
        (60_000u64..120_000).boxed()
    };
    let outcome = prop_oneof![
        2 => Just(BreakerOutcome::Failure),
        2 => Just(BreakerOutcome::FastFailure),
        2 => Just(BreakerOutcome::Success),
        1 => Just(BreakerOutcome::Neutral),
        1 => Just(BreakerOutcome::Dead),
        1 => cool.prop_map(|cooldown_ms| BreakerOutcome::RateLimited { cooldown_ms }),
    ];
    let max_adv = if manual { 40_000u64 } else { 0 };
    let op = prop_oneof![
        3 => lease.prop_map(BreakerOp::Admit),
        4 => (outcome, any::<bool>(), prop_oneof![3 => Just(0u64), 1 => 1u64..3])
            .prop_map(|(o, p, stale)| BreakerOp::Record(o, p, stale)),
        2 => (0..=max_adv).prop_map(BreakerOp::Advance),
    ];
    proptest::collection::vec(op, 1..len)
}

fn fail(e: GovernanceError) -> TestCaseError {
    TestCaseError::fail(format!("backend error: {e}"))
}

/// Runs one sequence against the store and [`BreakerState`], comparing every admit and
/// the state after every step (exactly on a manual clock; on real time the model's clock
/// stands still, nothing expires during a case, hints are compared within the time the
/// case took and timestamps by whether they are set).
pub async fn matches_model(
    h: &dyn BreakerHarness,
    settings: BreakerSettings,
    ops: &[BreakerOp],
) -> Result<(), TestCaseError> {
    let b = h.quiet().await;
    let b = b.as_ref();
    let sc = scope();
    let manual = h.manual_time();
    let start = h.now();
    let mut now = if manual {
        h.now().as_millis() as u64
    } else {
        0
    };
    let mut model = BreakerState::default();
    for op in ops {
        match *op {
            BreakerOp::Admit(lease_ms) => {
                let want = model.admit(now, lease_ms);
                let got = b
                    .admit(&sc, SRC, Duration::from_millis(lease_ms))
                    .await
                    .map_err(fail)?;
                match (got, want) {
                    (g, w) if manual => prop_assert_eq!(g, w),
                    (
                        BreakerAdmit::Allowed {
                            probe: g,
                            epoch: ge,
                        },
                        BreakerAdmit::Allowed {
                            probe: w,
                            epoch: we,
                        },
                    ) => {
                        prop_assert_eq!(g, w);
                        prop_assert_eq!(ge, we);
                    }
                    (
                        BreakerAdmit::Refused {
                            reason: gr,
                            retry_after_ms: g,
                        },
                        BreakerAdmit::Refused {
                            reason: wr,
                            retry_after_ms: w,
                        },
                    ) => {
                        prop_assert_eq!(gr, wr);
                        let elapsed = (h.now() - start).as_millis() as u64 + 2;
                        prop_assert!(g <= w && g + elapsed >= w, "hint {} vs {}", g, w);
                    }
                    (g, w) => prop_assert!(false, "store {:?} vs model {:?}", g, w),
                }
            }
            BreakerOp::Record(outcome, probe, stale) => {
                let epoch = model.epoch.saturating_sub(stale);
                model.record(now, outcome, epoch, probe, &settings);
                b.record(&sc, SRC, outcome, epoch, probe, &settings)
                    .await
                    .map_err(fail)?;
            }
            BreakerOp::Advance(ms) if manual => {
                h.advance(Duration::from_millis(ms)).await;
                now += ms;
            }
            BreakerOp::Advance(_) => continue,
        }
        let got = b.state(&sc, SRC).await.map_err(fail)?;
        if manual {
            prop_assert_eq!(got, model);
        } else {
            prop_assert_eq!(got.consecutive_failures, model.consecutive_failures);
            prop_assert_eq!(got.reopens, model.reopens);
            prop_assert_eq!(got.epoch, model.epoch);
            prop_assert_eq!(got.open_until > 0, model.open_until > 0, "open");
            prop_assert_eq!(got.probe_until > 0, model.probe_until > 0, "probe");
            prop_assert_eq!(got.dead_until > 0, model.dead_until > 0, "dead");
            prop_assert_eq!(got.cooldown_until > 0, model.cooldown_until > 0, "cooldown");
        }
    }
    Ok(())
}

/// Runs [`matches_model`] over `cases` random cases on `rt` (the harness must have been
/// created on `rt`).
pub fn model_proptest(rt: &tokio::runtime::Runtime, h: &dyn BreakerHarness, cases: u32) {
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let manual = h.manual_time();
    let strategy = (settings_strategy(manual), breaker_ops_strategy(manual, 60));
    let result = runner.run(&strategy, |(settings, ops)| {
        rt.block_on(matches_model(h, settings, &ops))
    });
    if let Err(e) = result {
        panic!("breaker store differs from the reference model: {e}");
    }
}
