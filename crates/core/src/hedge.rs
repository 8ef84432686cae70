//! Hedging decisions (SPEC §7), pure: when a round launches an extra leg
//! ([`HedgeWindow`]), whether the scope's hedge budget allows it ([`HedgeBudget`]),
//! which leg wins ([`pick_winner`]) and what a round whose legs all failed counts as
//! ([`combine_failures`]).
//!
//! Triggers, per running leg, each firing at most once:
//! - first token (`HEDGE__AFTER_S`): the leg has produced no incremental chunk (plain:
//!   has not returned) `after` after its launch;
//! - stall (`HEDGE__STALL_AFTER_S`, streams only): the leg's gap since its last
//!   incremental chunk reaches `stall_after` (re-armed by its next chunk).
//!
//! A trigger launches at most one extra leg; a new extra leg needs a new trigger. The
//! engine sleeps on relative durations until the next trigger is due.

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

#[derive(Debug, Clone, Copy)]
struct LegWatch {
    launched_at: Instant,
    last_chunk: Option<Instant>,
    chunks: u32,
    running: bool,
    first_token_fired: bool,
    /// The chunk count at which this leg's stall trigger last fired.
    stall_fired_at: Option<u32>,
}

/// What the round should do about hedging now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HedgeStep {
    /// A trigger fired: try to launch one extra leg now.
    Launch,
    /// Nothing is due; look again at this instant (or on the next event).
    Wait(Instant),
    /// No trigger can fire until something happens (a chunk arrives).
    Idle,
    /// No extra leg will ever be launched in this round.
    Stop,
}

/// The hedge state of one round.
#[derive(Debug, Clone)]
pub struct HedgeWindow {
    policy: HedgePolicy,
    legs: Vec<LegWatch>,
    extras: u32,
    committed: bool,
}

impl HedgeWindow {
    /// A round whose primary leg launched at `primary_at`.
    pub fn new(policy: HedgePolicy, primary_at: Instant) -> Self {
        let mut w = HedgeWindow {
            policy,
            legs: Vec::new(),
            extras: 0,
            committed: false,
        };
        w.push_leg(primary_at);
        w
    }

    fn push_leg(&mut self, at: Instant) -> usize {
        self.legs.push(LegWatch {
            launched_at: at,
            last_chunk: None,
            chunks: 0,
            running: true,
            first_token_fired: false,
            stall_fired_at: None,
        });
        self.legs.len() - 1
    }

    /// An extra leg was launched at `at`; returns its leg index.
    pub fn on_extra_launched(&mut self, at: Instant) -> usize {
        self.extras += 1;
        self.push_leg(at)
    }

    /// Extra legs launched so far in this round.
    pub fn extras(&self) -> u32 {
        self.extras
    }

    /// Leg `leg` produced an incremental chunk at `at`.
    pub fn on_chunk(&mut self, leg: usize, at: Instant) {
        if let Some(l) = self.legs.get_mut(leg) {
            l.chunks = l.chunks.saturating_add(1);
            l.last_chunk = Some(l.last_chunk.map_or(at, |p| p.max(at)));
        }
    }

    /// Leg `leg` ended (success, failure or cancellation).
    pub fn on_leg_finished(&mut self, leg: usize) {
        if let Some(l) = self.legs.get_mut(leg) {
            l.running = false;
        }
    }

    /// Passthrough commit: a leg's content is on the wire; no new leg from now on.
    pub fn commit(&mut self) {
        self.committed = true;
    }

    /// Evaluates the triggers at `now`. A due trigger is consumed and returns
    /// [`HedgeStep::Launch`] (the caller launches one leg, or silently skips it).
    pub fn poll(&mut self, now: Instant) -> HedgeStep {
        if self.committed || !self.policy.enabled() || self.extras >= self.policy.max_extra {
            return HedgeStep::Stop;
        }
        let mut earliest: Option<Instant> = None;
        for l in self.legs.iter_mut().filter(|l| l.running) {
            if let (Some(after), 0, false) = (self.policy.after, l.chunks, l.first_token_fired) {
                let due = l.launched_at + after;
                if due <= now {
                    l.first_token_fired = true;
                    return HedgeStep::Launch;
                }
                earliest = Some(earliest.map_or(due, |e: Instant| e.min(due)));
            }
            if let (Some(stall), Some(last)) = (self.policy.stall_after, l.last_chunk) {
                if l.stall_fired_at != Some(l.chunks) {
                    let due = last + stall;
                    if due <= now {
                        l.stall_fired_at = Some(l.chunks);
                        return HedgeStep::Launch;
                    }
                    earliest = Some(earliest.map_or(due, |e: Instant| e.min(due)));
                }
            }
        }
        match earliest {
            Some(t) => HedgeStep::Wait(t),
            None => HedgeStep::Idle,
        }
    }
}

/// The scope's hedge budget: extra legs over the last 60 s stay under `BUDGET_PCT` % of
/// the calls over the same window, with a floor of 1 (the cap is never below one leg).
/// One-second buckets keep memory constant whatever the call rate.
#[derive(Debug, Clone, Default)]
pub struct HedgeBudget {
    /// (second index, calls, extra legs), oldest first.
    buckets: VecDeque<(u64, u64, u64)>,
    origin: Option<Instant>,
}

const BUDGET_WINDOW_S: u64 = 60;

impl HedgeBudget {
    /// An empty budget.
    pub fn new() -> Self {
        Self::default()
    }

    fn bucket(&mut self, now: Instant) -> &mut (u64, u64, u64) {
        let origin = *self.origin.get_or_insert(now);
        let sec = now.saturating_duration_since(origin).as_secs();
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
    pub fn try_take(&mut self, now: Instant, pct: u32) -> bool {
        let (calls, extras) = self.totals(now);
        if pct > 0 {
            let cap = (calls * pct as u64 / 100).max(1);
            if extras >= cap {
                return false;
            }
        }
        self.bucket(now).2 += 1;
        true
    }

    /// Gives back a leg taken by [`HedgeBudget::try_take`] that could not be admitted.
    pub fn give_back(&mut self, now: Instant) {
        let b = self.bucket(now);
        b.2 = b.2.saturating_sub(1);
    }
}

/// The winner among legs that completed successfully at the same instant: the
/// earliest launched (lowest leg index).
pub fn pick_winner(successful_legs: &[usize]) -> Option<usize> {
    successful_legs.iter().copied().min()
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

    fn policy(after: Option<u64>, stall: Option<u64>, max: u32) -> HedgePolicy {
        HedgePolicy {
            after: after.map(ms),
            stall_after: stall.map(ms),
            max_extra: max,
        }
    }

    #[test]
    fn plain_request_with_only_stall_is_unhedged() {
        let h = HedgeSettings {
            stall_after: Some(ms(100)),
            ..Default::default()
        };
        let p = HedgePolicy::for_request(&h, false);
        assert!(!p.enabled());
        let mut w = HedgeWindow::new(p, t0());
        assert_eq!(w.poll(t0() + ms(10_000)), HedgeStep::Stop);
        assert!(HedgePolicy::for_request(&h, true).enabled());
    }

    #[test]
    fn first_token_trigger_fires_once_after_threshold() {
        let s = t0();
        let mut w = HedgeWindow::new(policy(Some(100), None, 1), s);
        assert_eq!(w.poll(s + ms(50)), HedgeStep::Wait(s + ms(100)));
        assert_eq!(w.poll(s + ms(100)), HedgeStep::Launch);
        // the trigger is consumed even if the leg could not be admitted
        assert_eq!(w.poll(s + ms(150)), HedgeStep::Idle);
    }

    #[test]
    fn first_token_never_fires_after_a_chunk() {
        let s = t0();
        let mut w = HedgeWindow::new(policy(Some(100), None, 1), s);
        w.on_chunk(0, s + ms(20));
        assert_eq!(w.poll(s + ms(500)), HedgeStep::Idle);
    }

    #[test]
    fn stall_trigger_rearms_on_each_chunk() {
        let s = t0();
        let mut w = HedgeWindow::new(policy(None, Some(100), 3), s);
        assert_eq!(
            w.poll(s + ms(1000)),
            HedgeStep::Idle,
            "no chunk yet: no stall"
        );
        w.on_chunk(0, s + ms(1000));
        assert_eq!(w.poll(s + ms(1050)), HedgeStep::Wait(s + ms(1100)));
        assert_eq!(w.poll(s + ms(1100)), HedgeStep::Launch);
        w.on_extra_launched(s + ms(1100));
        assert_eq!(
            w.poll(s + ms(1150)),
            HedgeStep::Idle,
            "same silence fires once"
        );
        w.on_chunk(0, s + ms(1200));
        assert_eq!(w.poll(s + ms(1300)), HedgeStep::Launch);
    }

    #[test]
    fn ladder_of_extra_legs_needs_new_triggers_and_stops_at_max() {
        let s = t0();
        let mut w = HedgeWindow::new(policy(Some(100), None, 2), s);
        assert_eq!(w.poll(s + ms(100)), HedgeStep::Launch);
        let l1 = w.on_extra_launched(s + ms(100));
        assert_eq!(l1, 1);
        // the new leg's own first-token timer is the next trigger
        assert_eq!(w.poll(s + ms(150)), HedgeStep::Wait(s + ms(200)));
        assert_eq!(w.poll(s + ms(200)), HedgeStep::Launch);
        w.on_extra_launched(s + ms(200));
        assert_eq!(w.poll(s + ms(10_000)), HedgeStep::Stop);
    }

    #[test]
    fn finished_legs_do_not_trigger_and_commit_stops() {
        let s = t0();
        let mut w = HedgeWindow::new(policy(Some(100), Some(100), 3), s);
        w.on_leg_finished(0);
        assert_eq!(w.poll(s + ms(500)), HedgeStep::Idle);
        let mut w = HedgeWindow::new(policy(Some(100), None, 3), s);
        w.commit();
        assert_eq!(w.poll(s + ms(500)), HedgeStep::Stop);
    }

    #[test]
    fn budget_floor_and_percentage() {
        let s = t0();
        let mut b = HedgeBudget::new();
        b.record_call(s);
        assert!(b.try_take(s, 20), "floor of one");
        assert!(!b.try_take(s, 20));
        for _ in 0..9 {
            b.record_call(s);
        }
        // 10 calls × 20 % = 2
        assert!(b.try_take(s, 20));
        assert!(!b.try_take(s, 20));
        // the window slides
        assert!(b.try_take(s + Duration::from_secs(61), 20));
        assert!(b.try_take(s, 0) && b.try_take(s, 0), "0 = no cap");
    }

    #[test]
    fn winner_is_earliest_launched() {
        assert_eq!(pick_winner(&[2, 0, 1]), Some(0));
        assert_eq!(pick_winner(&[]), None);
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

        /// Never more than `max_extra` launches; every launch consumes a distinct trigger.
        #[test]
        fn launches_are_bounded(
            max in 1u32..4,
            after in proptest::option::of(10u64..200),
            stall in proptest::option::of(10u64..200),
            events in proptest::collection::vec((0u64..100, 0usize..4, any::<bool>()), 0..80),
        ) {
            let s = t0();
            let mut w = HedgeWindow::new(HedgePolicy { after: after.map(ms), stall_after: stall.map(ms), max_extra: max }, s);
            let mut now = s;
            let mut launches = 0;
            for (dt, leg, chunk) in events {
                now += ms(dt);
                if chunk { w.on_chunk(leg, now); }
                while let HedgeStep::Launch = w.poll(now) {
                    launches += 1;
                    w.on_extra_launched(now);
                    prop_assert!(launches <= max);
                }
                match w.poll(now) {
                    HedgeStep::Wait(t) => prop_assert!(t > now),
                    HedgeStep::Launch => prop_assert!(false, "launch right after the loop"),
                    _ => {}
                }
            }
            prop_assert!(w.extras() <= max);
        }
    }
}
