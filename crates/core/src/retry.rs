//! The retry loop's state (SPEC §6, §14), pure: budget with 429 refunds, the stall
//! window, and backoff. The facade's engine asks it what to do after each round and
//! each fruitless admission; the deadline is the engine's (it bounds every wait).
//!
//! - The stall window runs over rounds that make no progress (429s, waiting for a
//!   runnable source) from the first such round; a budget-consuming round resets it.
//! - Independently, the call's admission waits add up: their total never exceeds
//!   `STALL_WINDOW_S`, whatever keeps sources out (SPEC §14.2).
//! - The cooldown of a source that answered 429 (or 503) without a usable hint grows
//!   with every failed round of the call, refunded ones included, so no upstream
//!   answer can make the call retry in a tight loop (SPEC §14.1).

use std::time::{Duration, Instant};

use crate::backoff::backoff_delay;
use crate::error::{AttemptError, ErrorClass, TerminalReason};
use crate::ports::Rng;
use crate::settings::RetrySettings;

/// What to do after a failed round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundVerdict {
    /// Try another round after this backoff.
    Retry {
        /// Wait before the next round (0 after a refunded 429 round: other sources
        /// stay usable at once; the 429 source cools down).
        backoff: Duration,
    },
    /// End the call.
    Fail(TerminalReason),
}

/// Retry state of one logical call.
#[derive(Debug, Clone)]
pub struct RetryState {
    settings: RetrySettings,
    budget_used: u32,
    stall_since: Option<Instant>,
    /// Rounds that failed, refunded ones included (the cooldown's exponent).
    failed_rounds: u32,
    /// Admission waits so far, closed ones.
    waited: Duration,
    /// The admission wait in progress.
    waiting_since: Option<Instant>,
}

impl RetryState {
    /// A fresh state.
    pub fn new(settings: &RetrySettings) -> Self {
        RetryState {
            settings: settings.clone(),
            budget_used: 0,
            stall_since: None,
            failed_rounds: 0,
            waited: Duration::ZERO,
            waiting_since: None,
        }
    }

    /// The cooldown of a source that failed without a usable hint (a 429 or a 503
    /// without `Retry-After`), and the floor of any hint: the backoff cap of the rounds
    /// failed so far, refunded ones included.
    pub fn cooldown(&self) -> Duration {
        crate::backoff::backoff_cap(
            self.failed_rounds,
            self.settings.backoff_base,
            self.settings.backoff_max,
        )
    }

    /// Budget-consuming rounds so far.
    pub fn budget_used(&self) -> u32 {
        self.budget_used
    }

    /// When the current no-progress stretch began, if one is running.
    pub fn stall_since(&self) -> Option<Instant> {
        self.stall_since
    }

    /// A round (started at `round_started`) failed with `failure` (already combined
    /// for hedged rounds; `refunded` when every leg was rate-limited).
    pub fn on_round_failed(
        &mut self,
        now: Instant,
        round_started: Instant,
        failure: &AttemptError,
        refunded: bool,
        rng: &dyn Rng,
    ) -> RoundVerdict {
        self.failed_rounds = self.failed_rounds.saturating_add(1);
        if failure.class == ErrorClass::Rejected {
            return RoundVerdict::Fail(TerminalReason::Rejected);
        }
        if refunded || failure.class == ErrorClass::RateLimited {
            let since = *self.stall_since.get_or_insert(round_started);
            if now.saturating_duration_since(since) >= self.settings.stall_window {
                return RoundVerdict::Fail(TerminalReason::Stalled);
            }
            return RoundVerdict::Retry {
                backoff: Duration::ZERO,
            };
        }
        self.budget_used += 1;
        self.stall_since = None;
        if self.budget_used >= self.settings.max_attempts {
            return RoundVerdict::Fail(TerminalReason::RetryExhausted);
        }
        RoundVerdict::Retry {
            backoff: backoff_delay(
                self.budget_used - 1,
                self.settings.backoff_base,
                self.settings.backoff_max,
                rng,
            ),
        }
    }

    /// No source could be admitted at `now`: the stall window runs, and so does the
    /// call's total admission wait. Returns how long the call may still wait, or `None`
    /// when either is spent (terminal reason `stalled`).
    pub fn on_no_runnable(&mut self, now: Instant) -> Option<Duration> {
        let since = *self.stall_since.get_or_insert(now);
        let spent = now.saturating_duration_since(since);
        let waiting = *self.waiting_since.get_or_insert(now);
        let waited = self.waited + now.saturating_duration_since(waiting);
        let window = self.settings.stall_window;
        let left = window
            .saturating_sub(spent)
            .min(window.saturating_sub(waited));
        (!left.is_zero()).then_some(left)
    }

    /// A source was admitted at `now`: the admission wait in progress (if any) ends.
    pub fn on_admitted(&mut self, now: Instant) {
        if let Some(since) = self.waiting_since.take() {
            self.waited += now.saturating_duration_since(since);
        }
    }

    /// The call's admission waits so far.
    pub fn waited(&self, now: Instant) -> Duration {
        self.waited
            + self
                .waiting_since
                .map_or(Duration::ZERO, |s| now.saturating_duration_since(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorLabel;
    use crate::ports::SplitMix64;
    use proptest::prelude::*;

    fn t0() -> Instant {
        #[allow(clippy::disallowed_methods)]
        Instant::now()
    }

    fn settings(max: u32, window_s: u64) -> RetrySettings {
        RetrySettings {
            max_attempts: max,
            stall_window: Duration::from_secs(window_s),
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_secs(1),
            ..Default::default()
        }
    }

    fn e(class: ErrorClass) -> AttemptError {
        let label = match class {
            ErrorClass::RateLimited => ErrorLabel::RateLimited,
            ErrorClass::Rejected => ErrorLabel::Rejected,
            ErrorClass::Dead => ErrorLabel::Dead,
            ErrorClass::Invalid => ErrorLabel::Invalid,
            ErrorClass::Transient => ErrorLabel::ServerError,
        };
        AttemptError::new(class, label, "x")
    }

    #[test]
    fn budget_counts_consuming_rounds() {
        let rng = SplitMix64::new(1);
        let s = t0();
        let mut r = RetryState::new(&settings(3, 60));
        for class in [ErrorClass::Transient, ErrorClass::Dead] {
            match r.on_round_failed(s, s, &e(class), false, &rng) {
                RoundVerdict::Retry { backoff } => assert!(backoff <= Duration::from_secs(1)),
                v => panic!("{v:?}"),
            }
        }
        assert_eq!(r.budget_used(), 2, "two consuming rounds so far");
        assert_eq!(
            r.on_round_failed(s, s, &e(ErrorClass::Invalid), false, &rng),
            RoundVerdict::Fail(TerminalReason::RetryExhausted)
        );
        assert_eq!(r.budget_used(), 3);
    }

    #[test]
    fn a_rate_limited_round_is_refunded_even_when_not_flagged_and_starts_the_stall_window() {
        let rng = SplitMix64::new(1);
        let s = t0();
        let later = s + Duration::from_secs(1);
        let mut r = RetryState::new(&settings(1, 10));
        assert_eq!(r.stall_since(), None);
        // A 429 round counts as refunded by its class alone.
        assert_eq!(
            r.on_round_failed(later, s, &e(ErrorClass::RateLimited), false, &rng),
            RoundVerdict::Retry {
                backoff: Duration::ZERO
            }
        );
        assert_eq!(r.budget_used(), 0);
        assert_eq!(r.stall_since(), Some(s), "the stretch began with the round");
    }

    /// The largest draw: every backoff at its cap.
    #[derive(Debug)]
    struct Top;
    impl crate::ports::Rng for Top {
        fn next_u64(&self) -> u64 {
            u64::MAX
        }
    }

    #[test]
    fn the_kth_consuming_round_backs_off_within_the_kth_cap() {
        let s = t0();
        let mut r = RetryState::new(&settings(4, 60));
        // Base 100 ms: the first retry waits up to 100 ms, the second up to 200 ms, the
        // third up to 400 ms — each at its cap (to the nanosecond) with the largest draw.
        for cap_ms in [100u64, 200, 400] {
            match r.on_round_failed(s, s, &e(ErrorClass::Transient), false, &Top) {
                RoundVerdict::Retry { backoff } => {
                    let cap = Duration::from_millis(cap_ms);
                    assert!(
                        backoff <= cap && backoff > cap.mul_f64(0.99),
                        "{backoff:?} for {cap:?}"
                    );
                }
                v => panic!("{v:?}"),
            }
        }
    }

    #[test]
    fn rejected_is_terminal_at_once() {
        let rng = SplitMix64::new(1);
        let s = t0();
        let mut r = RetryState::new(&settings(3, 60));
        assert_eq!(
            r.on_round_failed(s, s, &e(ErrorClass::Rejected), false, &rng),
            RoundVerdict::Fail(TerminalReason::Rejected)
        );
    }

    #[test]
    fn rate_limited_rounds_are_refunded_until_the_stall_window() {
        let rng = SplitMix64::new(1);
        let s = t0();
        let mut r = RetryState::new(&settings(1, 10));
        for i in 0..5 {
            let now = s + Duration::from_secs(i * 2);
            assert_eq!(
                r.on_round_failed(now, now, &e(ErrorClass::RateLimited), true, &rng),
                RoundVerdict::Retry {
                    backoff: Duration::ZERO
                },
                "round {i}"
            );
        }
        assert_eq!(r.budget_used(), 0);
        let now = s + Duration::from_secs(10);
        assert_eq!(
            r.on_round_failed(now, now, &e(ErrorClass::RateLimited), true, &rng),
            RoundVerdict::Fail(TerminalReason::Stalled)
        );
    }

    #[test]
    fn a_consuming_round_resets_the_stall_window() {
        let rng = SplitMix64::new(1);
        let s = t0();
        let mut r = RetryState::new(&settings(5, 10));
        r.on_round_failed(s, s, &e(ErrorClass::RateLimited), true, &rng);
        let t = s + Duration::from_secs(9);
        r.on_round_failed(t, t, &e(ErrorClass::Transient), false, &rng);
        assert_eq!(r.stall_since(), None);
        let t2 = s + Duration::from_secs(12);
        assert!(matches!(
            r.on_round_failed(t2, t2, &e(ErrorClass::RateLimited), true, &rng),
            RoundVerdict::Retry { .. }
        ));
    }

    /// SPEC §14.2: admission waits add up over the call, even across budget-consuming
    /// rounds that reset the no-progress window.
    #[test]
    fn admission_waits_add_up_to_at_most_the_window() {
        let rng = SplitMix64::new(1);
        let s = t0();
        let mut r = RetryState::new(&settings(10, 10));
        assert_eq!(r.on_no_runnable(s), Some(Duration::from_secs(10)));
        let t = s + Duration::from_secs(6);
        r.on_admitted(t);
        r.on_round_failed(t, t, &e(ErrorClass::Transient), false, &rng);
        // The no-progress window restarted, but 6 s of waiting are spent.
        let t2 = t + Duration::from_secs(1);
        assert_eq!(r.on_no_runnable(t2), Some(Duration::from_secs(4)));
        assert_eq!(r.on_no_runnable(t2 + Duration::from_secs(4)), None);
        assert_eq!(
            r.waited(t2 + Duration::from_secs(4)),
            Duration::from_secs(10)
        );
    }

    /// SPEC §14.1: the fallback cooldown grows with refunded rounds too.
    #[test]
    fn the_cooldown_grows_with_every_failed_round() {
        let rng = SplitMix64::new(1);
        let s = t0();
        let mut r = RetryState::new(&settings(2, 3600));
        let mut seen = vec![r.cooldown()];
        for _ in 0..5 {
            r.on_round_failed(s, s, &e(ErrorClass::RateLimited), true, &rng);
            seen.push(r.cooldown());
        }
        let ms: Vec<u128> = seen.iter().map(|d| d.as_millis()).collect();
        assert_eq!(ms, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(r.budget_used(), 0, "still refunded");
    }

    #[test]
    fn no_runnable_waits_share_the_stall_window() {
        let s = t0();
        let mut r = RetryState::new(&settings(3, 10));
        assert_eq!(r.on_no_runnable(s), Some(Duration::from_secs(10)));
        assert_eq!(
            r.on_no_runnable(s + Duration::from_secs(4)),
            Some(Duration::from_secs(6))
        );
        assert_eq!(r.on_no_runnable(s + Duration::from_secs(10)), None);
    }

    proptest! {
        /// The call ends after at most MAX_ATTEMPTS consuming rounds, whatever the mix.
        #[test]
        fn budget_is_never_exceeded(max in 1u32..8, classes in proptest::collection::vec(0u8..5, 1..40)) {
            let rng = SplitMix64::new(9);
            let s = t0();
            let mut r = RetryState::new(&settings(max, 3600));
            let mut consuming = 0;
            for c in classes {
                let class = [ErrorClass::Transient, ErrorClass::RateLimited, ErrorClass::Dead, ErrorClass::Invalid, ErrorClass::Transient][c as usize];
                let refunded = class == ErrorClass::RateLimited;
                if !refunded { consuming += 1; }
                match r.on_round_failed(s, s, &e(class), refunded, &rng) {
                    RoundVerdict::Fail(reason) => {
                        prop_assert_eq!(reason, TerminalReason::RetryExhausted);
                        prop_assert_eq!(consuming, max);
                        break;
                    }
                    RoundVerdict::Retry { .. } => prop_assert!(consuming < max),
                }
            }
        }
    }
}
