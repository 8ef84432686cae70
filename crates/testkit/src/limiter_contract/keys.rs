//! The client-key half of the `RateLimiter` contract (SPEC §21.1, issue 26): cases every
//! backend runs through the same [`LimiterHarness`], and a proptest that replays random
//! acquire / finish / drop / background-finish / advance sequences against the backend
//! and against core's reference model [`KeyQuotas`] and compares every answer.
//!
//! The contract: a key's RPM, TPM and concurrency never over-admit (one admission per
//! client call); a budget is reserved at admission and settled at the call's cost, in the
//! UTC day and month of the settlement, exactly (integer nanos); admission refuses when
//! settled + reserved + this reservation > the budget, with the period's end as hint; a
//! dropped permit, or one whose holder crashed, settles at its reservation; keys are
//! independent of each other and of every scope.
//!
//! Time as in the parent suite: exact on a manual clock; on real time (Redis) hints are
//! compared within the time a case took, and expiry waits for real on short leases.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use polygw_core::client_key::BudgetPeriod;
use polygw_core::error::RefusalReason;
use polygw_core::key_quota::{period_end_ms, KeyQuotas, IN_FLIGHT_RETRY_MS};
use polygw_core::ports::{KeyAcquire, KeyAdmission, KeyPermit, KeyUsage, RateLimiter, Refusal};
use polygw_core::window::WINDOW_MS;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use super::{check_refusal, fail, LimiterHarness};
use crate::services::unique_name;

/// An owned [`KeyAcquire`].
#[derive(Debug, Clone)]
pub struct KeyReq {
    /// Key id.
    pub key: String,
    /// RPM.
    pub rpm: u32,
    /// TPM.
    pub tpm: u64,
    /// Calls in flight.
    pub conc: u32,
    /// Day budget, nanos.
    pub day: Option<u64>,
    /// Month budget, nanos.
    pub month: Option<u64>,
    /// Tokens reserved.
    pub est: u64,
    /// Nanos reserved.
    pub nanos: u64,
    /// Lease.
    pub lease: Duration,
    /// A top-up of a call already admitted (money only).
    pub top_up: bool,
}

impl KeyReq {
    /// A fresh, uniquely named key: no limits, no reservation, a 10-minute lease.
    pub fn new() -> Self {
        KeyReq {
            key: unique_name("KEY"),
            rpm: 0,
            tpm: 0,
            conc: 0,
            day: None,
            month: None,
            est: 0,
            nanos: 0,
            lease: Duration::from_secs(600),
            top_up: false,
        }
    }

    /// The borrowed request.
    pub fn get(&self) -> KeyAcquire<'_> {
        KeyAcquire {
            key_id: &self.key,
            rpm: self.rpm,
            tpm: self.tpm,
            max_concurrency: self.conc,
            budget_day_nanos: self.day,
            budget_month_nanos: self.month,
            est_tokens: self.est,
            reserve_nanos: self.nanos,
            lease: self.lease,
            top_up: self.top_up,
        }
    }
}

impl Default for KeyReq {
    fn default() -> Self {
        Self::new()
    }
}

async fn acquire(l: &dyn RateLimiter, r: &KeyReq) -> KeyAdmission {
    l.acquire_key(&r.get())
        .await
        .expect("the governance backend is reachable in contract cases")
}

/// Acquires and expects an admission.
pub async fn admit_key(l: &dyn RateLimiter, r: &KeyReq) -> KeyPermit {
    match acquire(l, r).await {
        KeyAdmission::Admitted(p) => p,
        KeyAdmission::Refused(f) => panic!("expected a key admission, got {f:?}"),
    }
}

/// Acquires and expects a refusal.
pub async fn refuse_key(l: &dyn RateLimiter, r: &KeyReq) -> Refusal {
    match acquire(l, r).await {
        KeyAdmission::Refused(f) => f,
        KeyAdmission::Admitted(p) => panic!("expected a key refusal, got {p:?}"),
    }
}

async fn usage(l: &dyn RateLimiter, key: &str) -> KeyUsage {
    l.key_usage(key).await.expect("key usage")
}

/// (in flight, requests, tokens, reserved, day, month): a usage without its time.
fn figures(u: &KeyUsage) -> (u32, u64, u64, u64, u64, u64) {
    (
        u.in_flight,
        u.requests,
        u.tokens,
        u.reserved_nanos,
        u.day_nanos,
        u.month_nanos,
    )
}

fn assert_hint(h: &dyn LimiterHarness, got: Option<Duration>, want: Duration, slack: Duration) {
    let got = got.expect("a refusal that passes with time carries a hint");
    if h.manual_time() {
        assert_eq!(got, want, "hint");
    } else {
        assert!(
            got <= want + h.margin() && got + slack + h.margin() >= want,
            "hint {got:?} not within {slack:?} + margin of {want:?}"
        );
    }
}

// ------------------------------------------------------------------------------------
// Cases
// ------------------------------------------------------------------------------------

/// Key RPM: the (RPM+1)-th client call in a window is refused with the window's hint; a
/// refusal records nothing.
pub async fn key_rpm_never_over_admitted(h: &dyn LimiterHarness) {
    let l = h.subject().await.limiter;
    let r = KeyReq {
        rpm: 3,
        ..KeyReq::new()
    };
    let t0 = h.now();
    for _ in 0..3 {
        admit_key(l.as_ref(), &r).await.finish(0, 0).await.unwrap();
    }
    for _ in 0..2 {
        let f = refuse_key(l.as_ref(), &r).await;
        assert_eq!(f.reason, RefusalReason::KeyRpm);
        assert_hint(
            h,
            f.retry_after,
            Duration::from_millis(WINDOW_MS),
            h.now() - t0,
        );
    }
    assert_eq!(
        figures(&usage(l.as_ref(), &r.key).await),
        (0, 3, 0, 0, 0, 0)
    );
}

/// The key's window rolls like a source's.
pub async fn key_rpm_window_rolls(h: &dyn LimiterHarness) {
    let (s, w) = h.windowed().await;
    let l = s.limiter.as_ref();
    let r = KeyReq {
        rpm: 2,
        ..KeyReq::new()
    };
    for _ in 0..2 {
        admit_key(l, &r).await.finish(0, 0).await.unwrap();
    }
    let hint = refuse_key(l, &r).await.retry_after.expect("hint");
    assert!(hint <= w && !hint.is_zero(), "hint {hint:?} within {w:?}");
    if h.manual_time() {
        h.advance(w - Duration::from_millis(1)).await;
        assert_eq!(refuse_key(l, &r).await.reason, RefusalReason::KeyRpm);
        h.advance(Duration::from_millis(1)).await;
    } else {
        h.advance(hint + h.margin()).await;
    }
    admit_key(l, &r).await.finish(0, 0).await.unwrap();
}

/// Key TPM: admission reserves the estimate; finishing replaces it by the call's tokens;
/// an estimate above the limit never passes (no hint).
pub async fn key_tpm_reserve_then_settle(h: &dyn LimiterHarness) {
    let l = h.subject().await.limiter;
    let l = l.as_ref();
    let r = KeyReq {
        tpm: 1000,
        est: 400,
        ..KeyReq::new()
    };
    let mut a = admit_key(l, &r).await;
    let mut b = admit_key(l, &r).await;
    assert_eq!(refuse_key(l, &r).await.reason, RefusalReason::KeyTpm);
    a.finish(100, 0).await.unwrap();
    assert_eq!(usage(l, &r.key).await.tokens, 500);
    let mut c = admit_key(l, &r).await;
    let f = refuse_key(
        l,
        &KeyReq {
            est: 1001,
            ..r.clone()
        },
    )
    .await;
    assert_eq!((f.reason, f.retry_after), (RefusalReason::KeyTpm, None));
    b.finish(400, 0).await.unwrap();
    c.finish(0, 0).await.unwrap();
    assert_eq!(usage(l, &r.key).await.tokens, 500);
}

/// Key concurrency: calls in flight ≤ the cap; a finish frees the slot; the hint is the
/// earliest lease end.
pub async fn key_concurrency_cap_and_finish(h: &dyn LimiterHarness) {
    let l = h.subject().await.limiter;
    let l = l.as_ref();
    let r = KeyReq {
        conc: 2,
        lease: Duration::from_secs(30),
        ..KeyReq::new()
    };
    let t0 = h.now();
    let mut a = admit_key(l, &r).await;
    let _b = admit_key(l, &r).await;
    let f = refuse_key(l, &r).await;
    assert_eq!(f.reason, RefusalReason::KeyConcurrency);
    assert_hint(h, f.retry_after, r.lease, h.now() - t0);
    assert_eq!(usage(l, &r.key).await.in_flight, 2);
    a.finish(0, 0).await.unwrap();
    a.finish(0, 0).await.unwrap();
    assert_eq!(usage(l, &r.key).await.in_flight, 1);
    admit_key(l, &r).await.finish(0, 0).await.unwrap();
}

/// Budgets: a reservation counts at once; settlement replaces it by the cost exactly;
/// admission refuses when settled + reserved + this > the budget, naming the period whose
/// end is the hint (the month when it is the one exhausted); a reservation above the
/// budget itself never passes.
pub async fn key_budget_reserve_then_settle(h: &dyn LimiterHarness) {
    let l = h.subject().await.limiter;
    let l = l.as_ref();
    let r = KeyReq {
        day: Some(10_000),
        month: Some(25_000),
        nanos: 4_000,
        ..KeyReq::new()
    };
    let t0 = h.now();
    let mut a = admit_key(l, &r).await;
    let mut b = admit_key(l, &r).await;
    let u = usage(l, &r.key).await;
    assert_eq!(figures(&u), (2, 2, 0, 8_000, 8_000, 8_000));
    // Held only by the calls in flight: a short hint (SPEC §24.2).
    let f = refuse_key(l, &r).await;
    assert_eq!(f.reason, RefusalReason::KeyBudgetDay);
    assert_eq!(
        f.retry_after,
        Some(Duration::from_millis(IN_FLIGHT_RETRY_MS))
    );
    // settled below the reservation: room at once, exactly
    a.finish(10, 1_234).await.unwrap();
    let u = usage(l, &r.key).await;
    assert_eq!(
        (u.reserved_nanos, u.day_nanos, u.month_nanos),
        (4_000, 5_234, 5_234)
    );
    let mut c = admit_key(l, &r).await;
    b.finish(0, 4_000).await.unwrap();
    c.finish(0, 3_000).await.unwrap();
    let u = usage(l, &r.key).await;
    assert_eq!(u.day_nanos, 8_234);
    // Spent for the day: the day's end.
    let f = refuse_key(l, &r).await;
    assert_eq!(f.reason, RefusalReason::KeyBudgetDay);
    let day_end = period_end_ms(BudgetPeriod::Day, u.now_unix_ms) - u.now_unix_ms;
    assert_hint(
        h,
        f.retry_after,
        Duration::from_millis(day_end),
        h.now() - t0,
    );
    let f = refuse_key(
        l,
        &KeyReq {
            nanos: 10_001,
            ..r.clone()
        },
    )
    .await;
    assert_eq!(
        (f.reason, f.retry_after),
        (RefusalReason::KeyBudgetDay, None)
    );
    // the month's budget, when it binds, is the reason named
    let m = KeyReq {
        day: Some(10_000),
        month: Some(5_000),
        nanos: 3_000,
        ..KeyReq::new()
    };
    admit_key(l, &m).await.finish(0, 3_000).await.unwrap();
    let u = usage(l, &m.key).await;
    let f = refuse_key(l, &m).await;
    assert_eq!(f.reason, RefusalReason::KeyBudgetMonth);
    let month_end = period_end_ms(BudgetPeriod::Month, u.now_unix_ms) - u.now_unix_ms;
    assert_hint(
        h,
        f.retry_after,
        Duration::from_millis(month_end),
        h.now() - t0,
    );
    // a key without budget is not refused for money
    let free = KeyReq {
        nanos: 1 << 40,
        ..KeyReq::new()
    };
    admit_key(l, &free).await.finish(0, 1 << 41).await.unwrap();
    assert_eq!(usage(l, &free.key).await.day_nanos, 1 << 41);
}

/// A top-up (SPEC §24.1: an extra leg's money) is checked against the budgets only and
/// holds money only: no request, no tokens, no concurrency slot — a key at its RPM and
/// concurrency still tops up its calls in flight. It settles like a permit: finished at
/// its cost (0: the call settled on its first permit), at its reservation when dropped.
pub async fn key_top_up_holds_money_only(h: &dyn LimiterHarness) {
    let l = h.subject().await.limiter;
    let l = l.as_ref();
    let r = KeyReq {
        rpm: 1,
        tpm: 100,
        conc: 1,
        day: Some(10_000),
        est: 100,
        nanos: 4_000,
        ..KeyReq::new()
    };
    let mut call = admit_key(l, &r).await;
    assert_eq!(
        refuse_key(l, &r).await.reason,
        RefusalReason::KeyConcurrency
    );
    let up = KeyReq {
        nanos: 5_000,
        top_up: true,
        ..r.clone()
    };
    let mut a = admit_key(l, &up).await;
    let u = usage(l, &r.key).await;
    assert_eq!(figures(&u), (1, 1, 100, 9_000, 9_000, 9_000));
    // The budget binds a top-up as it binds a call: 9 000 + 5 000 > 10 000.
    let f = refuse_key(l, &up).await;
    assert_eq!(f.reason, RefusalReason::KeyBudgetDay);
    let small = KeyReq {
        nanos: 1_000,
        ..up.clone()
    };
    let b = admit_key(l, &small).await;
    assert_eq!(usage(l, &r.key).await.reserved_nanos, 10_000);
    // The call settles its legs on its own permit; its top-ups end at 0.
    call.finish(100, 6_000).await.unwrap();
    a.finish(0, 0).await.unwrap();
    let u = usage(l, &r.key).await;
    assert_eq!(
        (u.in_flight, u.reserved_nanos, u.day_nanos),
        (0, 1_000, 7_000)
    );
    // A top-up dropped unfinished settles at its reservation.
    drop(b);
    l.flush().await.unwrap();
    let u = usage(l, &r.key).await;
    assert_eq!((u.in_flight, u.reserved_nanos, u.day_nanos), (0, 0, 7_000));
    // Its concurrency slot was never taken: the next call waits only for the RPM.
    assert_eq!(refuse_key(l, &r).await.reason, RefusalReason::KeyRpm);
}

/// A permit dropped unfinished settles at its reservation (tokens and money) and frees
/// its slot (through the non-blocking path; `flush` waits for it); `finish` is idempotent
/// and a finish in the background counts like one.
pub async fn key_drop_settles_at_the_reservation(h: &dyn LimiterHarness) {
    let l = h.subject().await.limiter;
    let l = l.as_ref();
    let r = KeyReq {
        conc: 1,
        est: 70,
        nanos: 9_000,
        ..KeyReq::new()
    };
    drop(admit_key(l, &r).await);
    l.flush().await.unwrap();
    assert_eq!(
        figures(&usage(l, &r.key).await),
        (0, 1, 70, 0, 9_000, 9_000)
    );
    let mut p = admit_key(l, &r).await;
    p.finish(5, 100).await.unwrap();
    p.finish(50, 1_000).await.unwrap();
    drop(p);
    l.flush().await.unwrap();
    admit_key(l, &r).await.finish_in_background(1, 1);
    l.flush().await.unwrap();
    assert_eq!(
        figures(&usage(l, &r.key).await),
        (0, 3, 76, 0, 9_101, 9_101)
    );
}

/// SPEC §14.4 for keys: a call held past several lease lengths keeps its slot and its
/// reservation (the heartbeat renews them); once its holder crashes the slot frees within
/// one lease and its reservation is settled at its reservation (the money was probably
/// spent).
pub async fn key_leases_renewed_while_held_and_settled_after_a_crash(h: &dyn LimiterHarness) {
    let l = h.subject().await.limiter;
    let l = l.as_ref();
    let lease = if h.manual_time() {
        Duration::from_secs(30)
    } else {
        Duration::from_secs(1)
    };
    let r = KeyReq {
        conc: 1,
        day: Some(1_000_000),
        nanos: 2_500,
        est: 9,
        lease,
        ..KeyReq::new()
    };
    let mut p = admit_key(l, &r).await;
    for _ in 0..5 {
        h.advance(lease / 2).await;
        assert_eq!(
            refuse_key(l, &r).await.reason,
            RefusalReason::KeyConcurrency
        );
        assert_eq!(usage(l, &r.key).await.reserved_nanos, 2_500);
    }
    p.finish(9, 1_000).await.unwrap();
    assert_eq!(usage(l, &r.key).await.day_nanos, 1_000);

    let (crashed, crash) = h.crashable().await;
    let held = admit_key(crashed.as_ref(), &r).await;
    std::mem::forget(held);
    crash();
    assert_eq!(
        refuse_key(l, &r).await.reason,
        RefusalReason::KeyConcurrency
    );
    h.advance(lease + h.margin()).await;
    let u = usage(l, &r.key).await;
    assert_eq!(
        (u.in_flight, u.reserved_nanos, u.day_nanos),
        (0, 0, 3_500),
        "a crashed holder's reservation is settled at its reservation when its lease ends"
    );
    admit_key(l, &r).await.finish(0, 0).await.unwrap();
}

/// Keys are independent of each other and of every scope: a key's admission touches no
/// source window, a source's none of a key's.
pub async fn keys_are_independent(h: &dyn LimiterHarness) {
    let s = h.subject().await;
    let l = s.limiter.as_ref();
    let a = KeyReq {
        rpm: 1,
        conc: 1,
        ..KeyReq::new()
    };
    let b = KeyReq {
        rpm: 1,
        conc: 1,
        ..KeyReq::new()
    };
    let pa = admit_key(l, &a).await;
    let pb = admit_key(l, &b).await;
    assert_eq!(
        refuse_key(l, &a).await.reason,
        RefusalReason::KeyConcurrency
    );
    let sc = unique_name("KSC");
    let src = super::Req::new(&sc, "x").source_limits(1, 0, 1);
    super::admit(l, &src).await.finish(0).await.unwrap();
    assert_eq!(s.probe.scope_window(&sc).await.unwrap(), (1, 0));
    drop((pa, pb));
    l.flush().await.unwrap();
    assert_eq!(usage(l, &a.key).await.requests, 1);
    assert_eq!(usage(l, &b.key).await.requests, 1);
}

/// No limits: everything is admitted; an unknown key reads as zeros.
pub async fn key_unlimited_admits_everything(h: &dyn LimiterHarness) {
    let l = h.subject().await.limiter;
    let r = KeyReq {
        est: 1 << 30,
        nanos: 1 << 40,
        ..KeyReq::new()
    };
    let mut held = vec![];
    for _ in 0..50 {
        held.push(admit_key(l.as_ref(), &r).await);
    }
    assert_eq!(usage(l.as_ref(), &r.key).await.in_flight, 50);
    for mut p in held {
        p.finish(0, 0).await.unwrap();
    }
    assert_eq!(
        figures(&usage(l.as_ref(), &unique_name("NOBODY")).await),
        (0, 0, 0, 0, 0, 0)
    );
}

/// Many concurrent callers on several independent clients (separate connections: as
/// separate processes would be) on one key: admitted ≤ RPM, in flight ≤ the cap, and the
/// day's spend never above the budget when every call costs at most its reservation —
/// while the budget is reached (the check is not vacuous).
pub async fn concurrent_key_callers_never_over_admit(h: &dyn LimiterHarness) {
    const CLIENTS: usize = 3;
    const TASKS_PER_CLIENT: usize = 5;
    const RPM: u32 = 40;
    const CONC: u32 = 4;
    const BUDGET: u64 = 100_000;
    let clients = h.clients(CLIENTS).await;
    let r = KeyReq {
        rpm: RPM,
        conc: CONC,
        day: Some(BUDGET),
        est: 10,
        nanos: 7_000,
        ..KeyReq::new()
    };
    let admitted = Arc::new(AtomicU64::new(0));
    let holding = Arc::new(AtomicU64::new(0));
    let peak = Arc::new(AtomicU64::new(0));
    let spent = Arc::new(AtomicU64::new(0));
    let mut tasks = vec![];
    for (ci, c) in clients.iter().enumerate() {
        for t in 0..TASKS_PER_CLIENT {
            let (c, r) = (c.clone(), r.clone());
            let (admitted, holding, peak, spent) = (
                admitted.clone(),
                holding.clone(),
                peak.clone(),
                spent.clone(),
            );
            // costs between 3/7 and all of the reservation
            let cost = 3_000 + 1_000 * ((ci * TASKS_PER_CLIENT + t) as u64 % 5);
            tasks.push(tokio::spawn(async move {
                let mut refusals = 0;
                for _ in 0..5_000 {
                    match c.acquire_key(&r.get()).await.expect("acquire_key") {
                        KeyAdmission::Admitted(mut p) => {
                            admitted.fetch_add(1, Ordering::SeqCst);
                            let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                            peak.fetch_max(now, Ordering::SeqCst);
                            tokio::task::yield_now().await;
                            holding.fetch_sub(1, Ordering::SeqCst);
                            p.finish(10, cost).await.expect("finish");
                            spent.fetch_add(cost, Ordering::SeqCst);
                        }
                        KeyAdmission::Refused(f) => match f.reason {
                            RefusalReason::KeyConcurrency => tokio::task::yield_now().await,
                            RefusalReason::KeyRpm | RefusalReason::KeyBudgetDay => {
                                refusals += 1;
                                if refusals > 3 {
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
        t.await.expect("caller task");
    }
    let l = h.subject().await.limiter;
    let u = usage(l.as_ref(), &r.key).await;
    let n = admitted.load(Ordering::SeqCst);
    assert!(n <= u64::from(RPM), "{n} admitted, RPM {RPM}");
    assert_eq!(u.requests, n);
    assert!(peak.load(Ordering::SeqCst) <= u64::from(CONC));
    assert_eq!(u.day_nanos, spent.load(Ordering::SeqCst), "settled exactly");
    assert!(u.day_nanos <= BUDGET, "spent {} over {BUDGET}", u.day_nanos);
    // A budget refusal came with at most CONC reservations of 7 000 in flight, which then
    // settled at 3 000 or more: the budget was reached to within that.
    assert!(
        u.day_nanos + (u64::from(CONC) + 1) * 7_000 > BUDGET || n == u64::from(RPM),
        "neither the budget nor the RPM was reached: spent {}, {n} admitted",
        u.day_nanos
    );
}

// ------------------------------------------------------------------------------------
// Reference-model proptest
// ------------------------------------------------------------------------------------

/// The limits one proptest case runs under (both keys have the same).
#[derive(Debug, Clone, Copy)]
pub struct KeyModelLimits {
    /// RPM.
    pub rpm: u32,
    /// TPM.
    pub tpm: u64,
    /// Cap.
    pub conc: u32,
    /// Day budget.
    pub day: Option<u64>,
    /// Month budget.
    pub month: Option<u64>,
    /// Lease, ms.
    pub lease_ms: u64,
}

/// One step of a random sequence.
#[derive(Debug, Clone)]
pub enum KeyModelOp {
    /// Acquire on key `key % 2`.
    Acquire {
        /// Key index.
        key: usize,
        /// A top-up (money only).
        top_up: bool,
        /// Tokens reserved.
        est: u64,
        /// Nanos reserved.
        nanos: u64,
    },
    /// `KeyPermit::finish` on a held permit.
    Finish {
        /// Which held permit.
        pick: usize,
        /// Tokens.
        tokens: u64,
        /// Cost.
        cost: u64,
    },
    /// Drop the permit (settles at its reservation), then `flush`.
    Drop {
        /// Which held permit.
        pick: usize,
    },
    /// `KeyPermit::finish_in_background`, then `flush`.
    Background {
        /// Which held permit.
        pick: usize,
        /// Tokens.
        tokens: u64,
        /// Cost.
        cost: u64,
    },
    /// Let time pass (manual-time harnesses only).
    Advance {
        /// Milliseconds.
        ms: u64,
    },
}

fn key_limits(short_leases: bool) -> impl Strategy<Value = KeyModelLimits> {
    let opt = |lo: u64, hi: u64| prop_oneof![1 => Just(None), 3 => (lo..hi).prop_map(Some)];
    let lease = if short_leases {
        (1_000u64..120_000).boxed()
    } else {
        Just(600_000u64).boxed()
    };
    (
        prop_oneof![Just(0u32), 1u32..8],
        prop_oneof![Just(0u64), 300u64..2_000],
        prop_oneof![Just(0u32), 1u32..4],
        opt(2_000, 12_000),
        opt(4_000, 30_000),
        lease,
    )
        .prop_map(|(rpm, tpm, conc, day, month, lease_ms)| KeyModelLimits {
            rpm,
            tpm,
            conc,
            day,
            month,
            lease_ms,
        })
}

fn key_ops(advance: bool, len: usize) -> impl Strategy<Value = Vec<KeyModelOp>> {
    let small = if advance { 30_000u64 } else { 0 };
    // now and then hours: days end within a case
    let big = if advance { 6 * 3_600_000u64 } else { 0 };
    let op = prop_oneof![
        6 => (0usize..2, 0u64..500, 0u64..4_000, proptest::bool::weighted(0.25))
            .prop_map(|(key, est, nanos, top_up)| KeyModelOp::Acquire { key, est, nanos, top_up }),
        3 => (0usize..16, 0u64..900, 0u64..5_000)
            .prop_map(|(pick, tokens, cost)| KeyModelOp::Finish { pick, tokens, cost }),
        1 => (0usize..16).prop_map(|pick| KeyModelOp::Drop { pick }),
        1 => (0usize..16, 0u64..900, 0u64..5_000)
            .prop_map(|(pick, tokens, cost)| KeyModelOp::Background { pick, tokens, cost }),
        2 => prop_oneof![8 => 0..=small, 1 => 0..=big].prop_map(|ms| KeyModelOp::Advance { ms }),
    ];
    proptest::collection::vec(op, 1..len)
}

/// Runs one op sequence against a fresh pair of keys on a quiet subject (no heartbeat:
/// the model renews nothing) and the reference model, comparing every admission, refusal
/// (reason and hint) and both keys' figures after every step. Manual time: the model's
/// clock is the backend's (read once from `key_usage`, then moved with the harness);
/// real time: it stands still, and hints are compared within the time the case took.
pub async fn matches_key_model(
    h: &dyn LimiterHarness,
    limits: KeyModelLimits,
    ops: &[KeyModelOp],
) -> Result<(), TestCaseError> {
    let s = h.quiet().await;
    let l = s.limiter.as_ref();
    let keys = [unique_name("KM"), unique_name("KM")];
    let start = h.now();
    let unix0 = l.key_usage(&keys[0]).await.map_err(fail)?.now_unix_ms;
    let clock = |h: &dyn LimiterHarness| {
        if h.manual_time() {
            unix0 + (h.now() - start).as_millis() as u64
        } else {
            unix0
        }
    };
    let mut model = KeyQuotas::new();
    let mut held: Vec<(KeyPermit, u64)> = vec![];
    for op in ops {
        let now = clock(h);
        match *op {
            KeyModelOp::Acquire {
                key,
                est,
                nanos,
                top_up,
            } => {
                let r = KeyReq {
                    key: keys[key % 2].clone(),
                    rpm: limits.rpm,
                    tpm: limits.tpm,
                    conc: limits.conc,
                    day: limits.day,
                    month: limits.month,
                    est,
                    nanos,
                    lease: Duration::from_millis(limits.lease_ms),
                    top_up,
                };
                let want = model.acquire(now, &r.get());
                let got = l.acquire_key(&r.get()).await.map_err(fail)?;
                match (got, want) {
                    (KeyAdmission::Admitted(p), Ok(id)) => held.push((p, id)),
                    (KeyAdmission::Refused(g), Err(w)) => check_refusal(h, g, w, h.now() - start)?,
                    (g, w) => prop_assert!(false, "backend {:?} vs model {:?}", g, w),
                }
            }
            KeyModelOp::Finish { pick, tokens, cost } if !held.is_empty() => {
                let (mut p, id) = held.remove(pick % held.len());
                p.finish(tokens, cost).await.map_err(fail)?;
                model.finish(now, id, tokens, cost);
            }
            KeyModelOp::Drop { pick } if !held.is_empty() => {
                let (p, id) = held.remove(pick % held.len());
                model.finish(now, id, p.est_tokens(), p.reserve_nanos());
                drop(p);
                l.flush().await.map_err(fail)?;
            }
            KeyModelOp::Background { pick, tokens, cost } if !held.is_empty() => {
                let (p, id) = held.remove(pick % held.len());
                model.finish(now, id, tokens, cost);
                p.finish_in_background(tokens, cost);
                l.flush().await.map_err(fail)?;
            }
            KeyModelOp::Advance { ms } if h.manual_time() => {
                h.advance(Duration::from_millis(ms)).await;
            }
            _ => continue,
        }
        let now = clock(h);
        for k in &keys {
            let got = l.key_usage(k).await.map_err(fail)?;
            let want = model.usage(now, k);
            prop_assert_eq!(figures(&got), figures(&want), "figures of {}", k);
            if h.manual_time() {
                prop_assert_eq!(got.now_unix_ms, want.now_unix_ms);
            }
        }
    }
    // Leave nothing in flight.
    for (mut p, _) in held {
        p.finish(0, 0).await.map_err(fail)?;
    }
    Ok(())
}

/// Runs [`matches_key_model`] over `cases` random cases on `rt` (the harness must have
/// been created on `rt`).
pub fn key_model_proptest(rt: &tokio::runtime::Runtime, h: &dyn LimiterHarness, cases: u32) {
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let manual = h.manual_time();
    let strategy = (key_limits(manual), key_ops(manual, 60));
    let result = runner.run(&strategy, |(limits, ops)| {
        rt.block_on(matches_key_model(h, limits, &ops))
    });
    if let Err(e) = result {
        panic!("key governance differs from the reference model: {e}");
    }
}
