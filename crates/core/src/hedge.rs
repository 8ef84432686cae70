//! Hedging decisions (SPEC §7), pure: the policy that applies to a request
//! ([`HedgePolicy`]), whether the scope's hedge budget allows an extra leg
//! ([`HedgeBudget`]), and what a round whose legs all failed counts as
//! ([`combine_failures`]). When triggers fire and which leg wins is the round state
//! machine's ([`crate::round`]).
//!
//! Triggers, per running leg, each firing at most once:
//! - first token (`HEDGE__AFTER_S`): the leg has produced no incremental chunk (plain:
//!   has not returned) `after` after its launch;
//! - stall (`HEDGE__STALL_AFTER_S`, streams only): the leg's gap since its last
//!   incremental chunk reaches `stall_after` (re-armed by its next chunk).
//!
//! A trigger launches at most one extra leg; a new extra leg needs a new trigger.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::error::{AttemptError, ErrorClass};
use crate::settings::HedgeSettings;

/// The hedge settings as they apply to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HedgePolicy {
    /// First-token trigger.
    pub after: Option<Duration>,
    /// Stall trigger (already `None` for plain requests).
    pub stall_after: Option<Duration>,
    /// Extra legs per round.
    pub max_extra: u32,
}

impl HedgePolicy {
    /// The policy for a request: the stall trigger only applies to streams, so a plain
    /// request with only `STALL_AFTER_S` set is exactly unhedged.
    pub fn for_request(h: &HedgeSettings, stream: bool) -> Self {
        HedgePolicy {
            after: h.after,
            stall_after: if stream { h.stall_after } else { None },
            max_extra: h.max_extra,
        }
    }

    /// Whether any trigger can fire.
    pub fn enabled(&self) -> bool {
        self.max_extra > 0 && (self.after.is_some() || self.stall_after.is_some())
    }
}

/// The scope's hedge budget: extra legs over the last 60 s stay under `BUDGET_PCT` % of
/// the calls over the same window, with a floor of 1 (the cap is never below one leg).
/// One-second buckets keep memory constant whatever the call rate; buckets stay in
/// time order whatever order the callers' instants come in (an instant older than the
/// newest bucket counts in the newest one).
#[derive(Debug, Clone, Default)]
pub struct HedgeBudget {
    /// (second index, calls, extra legs), oldest first, strictly increasing seconds.
    buckets: VecDeque<(u64, u64, u64)>,
    origin: Option<Instant>,
}

/// One extra leg taken from a [`HedgeBudget`]; give it back with
/// [`HedgeBudget::give_back`] when the leg is not launched after all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a ticket not launched must be given back"]
pub struct BudgetTicket {
    sec: u64,
}

const BUDGET_WINDOW_S: u64 = 60;

impl HedgeBudget {
    /// An empty budget.
    pub fn new() -> Self {
        Self::default()
    }

    fn bucket(&mut self, now: Instant) -> &mut (u64, u64, u64) {
        let origin = *self.origin.get_or_insert(now);
        let mut sec = now.saturating_duration_since(origin).as_secs();
        if let Some(&(last, _, _)) = self.buckets.back() {
            sec = sec.max(last);
        }
        while let Some(&(s, _, _)) = self.buckets.front() {
            if s + BUDGET_WINDOW_S <= sec {
                self.buckets.pop_front();
            } else {
                break;
            }
        }
        if self.buckets.back().map(|b| b.0) != Some(sec) {
            self.buckets.push_back((sec, 0, 0));
        }
        self.buckets.back_mut().expect("pushed")
    }

    /// A logical call started.
    pub fn record_call(&mut self, now: Instant) {
        self.bucket(now).1 += 1;
    }

    /// (calls, extra legs) in the window.
    pub fn totals(&mut self, now: Instant) -> (u64, u64) {
        self.bucket(now);
        self.buckets
            .iter()
            .fold((0, 0), |(c, e), b| (c + b.1, e + b.2))
    }

    /// Takes one extra leg from the budget if allowed (`pct` 0 = no cap).
    pub fn try_take(&mut self, now: Instant, pct: u32) -> Option<BudgetTicket> {
        let (calls, extras) = self.totals(now);
        if pct > 0 {
            let cap = (calls * pct as u64 / 100).max(1);
            if extras >= cap {
                return None;
            }
        }
        let b = self.bucket(now);
        b.2 += 1;
        Some(BudgetTicket { sec: b.0 })
    }

    /// Gives back a leg taken by [`HedgeBudget::try_take`] that was not launched: from
    /// the bucket it was taken from (nothing if that bucket already left the window).
    pub fn give_back(&mut self, ticket: BudgetTicket) {
        if let Some(b) = self.buckets.iter_mut().find(|b| b.0 == ticket.sec) {
            b.2 = b.2.saturating_sub(1);
        }
    }
}

/// How a round whose legs all failed counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CombinedFailure {
    /// Position in the input of the failure that represents the round.
    pub index: usize,
    /// All legs were rate-limited: the round is refunded (no budget).
    pub refunded: bool,
}

/// SPEC §7: any non-429 failure takes precedence (counts budget once); all 429 →
/// refunded; the same class → the primary's. Input: (leg index, error), any order.
pub fn combine_failures(failures: &[(usize, &AttemptError)]) -> Option<CombinedFailure> {
    let earliest = |pred: &dyn Fn(&AttemptError) -> bool| {
        failures
            .iter()
            .enumerate()
            .filter(|(_, (_, e))| pred(e))
            .min_by_key(|(_, (leg, _))| *leg)
            .map(|(i, _)| i)
    };
    if let Some(i) = earliest(&|e| e.class != ErrorClass::RateLimited) {
        return Some(CombinedFailure {
            index: i,
            refunded: false,
        });
    }
    earliest(&|_| true).map(|i| CombinedFailure {
        index: i,
        refunded: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorLabel;
    use proptest::prelude::*;

    fn t0() -> Instant {
        #[allow(clippy::disallowed_methods)]
        Instant::now()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn plain_request_with_only_stall_is_unhedged() {
        let h = HedgeSettings {
            stall_after: Some(ms(100)),
            ..Default::default()
        };
        let p = HedgePolicy::for_request(&h, false);
        assert!(!p.enabled());
        assert!(HedgePolicy::for_request(&h, true).enabled());
    }

    #[test]
    fn budget_floor_and_percentage() {
        let s = t0();
        let mut b = HedgeBudget::new();
        b.record_call(s);
        assert!(b.try_take(s, 20).is_some(), "floor of one");
        assert!(b.try_take(s, 20).is_none());
        for _ in 0..9 {
            b.record_call(s);
        }
        // 10 calls × 20 % = 2
        assert!(b.try_take(s, 20).is_some());
        assert!(b.try_take(s, 20).is_none());
        // the window slides
        assert!(b.try_take(s + Duration::from_secs(61), 20).is_some());
        assert!(
            b.try_take(s, 0).is_some() && b.try_take(s, 0).is_some(),
            "0 = no cap"
        );
    }

    /// A leg given back later than it was taken returns to its own bucket (it used to
    /// decrement the current bucket, and the taken slot stayed used for 60 s).
    #[test]
    fn give_back_returns_the_leg_to_its_bucket() {
        let s = t0();
        let mut b = HedgeBudget::new();
        for _ in 0..10 {
            b.record_call(s);
        }
        let t = b.try_take(s, 10).expect("1 of 10 calls");
        assert!(b.try_take(s + Duration::from_secs(5), 10).is_none());
        b.give_back(t);
        assert_eq!(b.totals(s + Duration::from_secs(5)), (10, 0));
        assert!(b.try_take(s + Duration::from_secs(5), 10).is_some());
    }

    /// Instants older than the newest bucket never create a bucket out of order (a
    /// call counted at its start after later calls: it used to be counted twice once
    /// the older bucket was evicted late).
    #[test]
    fn out_of_order_instants_keep_buckets_in_order() {
        let s = t0();
        let mut b = HedgeBudget::new();
        b.record_call(s + Duration::from_secs(10));
        b.record_call(s + Duration::from_secs(3));
        b.record_call(s + Duration::from_secs(12));
        let secs: Vec<u64> = b.buckets.iter().map(|x| x.0).collect();
        assert!(secs.windows(2).all(|w| w[0] < w[1]), "{secs:?}");
        assert_eq!(b.totals(s + Duration::from_secs(12)), (3, 0));
        assert_eq!(b.totals(s + Duration::from_secs(71)), (1, 0));
    }

    fn err(class: ErrorClass) -> AttemptError {
        let label = match class {
            ErrorClass::RateLimited => ErrorLabel::RateLimited,
            ErrorClass::Transient => ErrorLabel::ServerError,
            ErrorClass::Dead => ErrorLabel::Dead,
            ErrorClass::Invalid => ErrorLabel::Invalid,
            ErrorClass::Rejected => ErrorLabel::Rejected,
        };
        AttemptError::new(class, label, "x")
    }

    #[test]
    fn combined_failure_table() {
        use ErrorClass::*;
        let rl = err(RateLimited);
        let tr = err(Transient);
        let dead = err(Dead);
        // (failures in completion order, expected leg, refunded)
        type Row<'a> = (Vec<(usize, &'a AttemptError)>, usize, bool);
        let rows: Vec<Row<'_>> = vec![
            (vec![(0, &tr), (1, &tr)], 0, false),
            (vec![(1, &tr), (0, &tr)], 0, false),
            (vec![(0, &rl), (1, &rl)], 0, true),
            (vec![(0, &rl), (1, &tr)], 1, false),
            (vec![(1, &dead), (0, &rl), (2, &tr)], 1, false),
            (vec![(0, &tr), (1, &dead)], 0, false),
        ];
        for (failures, leg, refunded) in rows {
            let c = combine_failures(&failures).unwrap();
            assert_eq!(
                (failures[c.index].0, c.refunded),
                (leg, refunded),
                "{failures:?}"
            );
        }
        assert_eq!(combine_failures(&[]), None);
    }

    proptest! {
        /// The combined failure is refunded iff every leg was rate-limited, and is
        /// otherwise the earliest-launched non-429 leg.
        #[test]
        fn combination_rules(classes in proptest::collection::vec(0u8..5, 1..5), order_seed: u64) {
            use ErrorClass::*;
            let all = [RateLimited, Transient, Dead, Invalid, Rejected];
            let errs: Vec<AttemptError> = classes.iter().map(|c| err(all[*c as usize])).collect();
            let mut legs: Vec<(usize, &AttemptError)> = errs.iter().enumerate().collect();
            // completion order is arbitrary
            let n = legs.len();
            for i in 0..n {
                let j = ((order_seed >> (i % 60)) as usize).wrapping_add(i) % n;
                legs.swap(i, j);
            }
            let c = combine_failures(&legs).unwrap();
            let every_429 = errs.iter().all(|e| e.class == RateLimited);
            prop_assert_eq!(c.refunded, every_429);
            let chosen = legs[c.index].0;
            if every_429 {
                prop_assert_eq!(chosen, 0);
            } else {
                let first_non_429 = errs.iter().position(|e| e.class != RateLimited).unwrap();
                prop_assert_eq!(chosen, first_non_429);
            }
        }
    }
}
