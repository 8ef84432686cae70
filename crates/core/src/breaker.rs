//! The breaker, cooldown and dead-source state machine of one source (SPEC §4.4), pure
//! and on millisecond timestamps so the memory backend runs it as is and the Redis Lua
//! script mirrors it (the contract suite checks they agree).
//!
//! - `BREAKER__FAILURES` consecutive breaker-feeding failures open the breaker for
//!   `OPEN_S`; each re-open (a failed half-open probe) doubles it, up to 10×.
//! - After the open time, half-open admits one probe; its success closes the breaker.
//! - 429 sets a cooldown; 401/403/404 make the source dead for `DEAD_S`; nothing but the
//!   end of that period revives a dead source.
//!
//! **Epochs** (SPEC §14.7): every change of breaker state (a trip, a re-open, a probe
//! granted, a close) starts a new epoch. An admission carries the epoch it was admitted
//! under and its outcome counts for the breaker only in that epoch: a success of an
//! attempt admitted before a trip does not close the breaker, a failure of one admitted
//! before a close does not count against the closed breaker, a stale probe's outcome
//! neither closes, re-opens nor frees the current probe. Cooldowns (429) and dead periods
//! (401/403/404) are facts about the source and apply whatever the epoch.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{ErrorClass, RefusalReason};
use crate::settings::BreakerSettings;

/// What an attempt's end means to the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BreakerOutcome {
    /// A usable answer: closes the breaker.
    Success,
    /// A breaker-feeding failure (transient, not 429).
    Failure,
    /// A breaker-feeding failure answered quickly (within `BREAKER__OPEN_S`: a 5xx, a
    /// refused connection): it counts like [`BreakerOutcome::Failure`], but a half-open
    /// probe that fails so re-opens for `OPEN_S` again instead of doubling — a probe
    /// that costs its caller a few ms need not back off, and a recovered source is then
    /// found within `OPEN_S` of its recovery (SPEC §19.3; issue 24, item 6).
    FastFailure,
    /// Counts for nothing (rejected, invalid, cancelled, hedge loser).
    Neutral,
    /// 401/403/404: the source is out for `DEAD_S`.
    Dead,
    /// 429: cool down for this long.
    RateLimited {
        /// Cooldown length in milliseconds.
        cooldown_ms: u64,
    },
}

impl BreakerOutcome {
    /// The outcome of a failed attempt: its class's, a transient failure that took
    /// at most `BREAKER__OPEN_S` (`s.open`) being a [`BreakerOutcome::FastFailure`].
    pub fn of_failure(
        class: ErrorClass,
        cooldown: Duration,
        took: Duration,
        s: &BreakerSettings,
    ) -> Self {
        match Self::of_class(class, cooldown) {
            BreakerOutcome::Failure if took <= s.open => BreakerOutcome::FastFailure,
            o => o,
        }
    }

    /// The outcome of a failure class (`cooldown` is used for 429).
    pub fn of_class(class: ErrorClass, cooldown: Duration) -> Self {
        match class {
            ErrorClass::Transient => BreakerOutcome::Failure,
            ErrorClass::RateLimited => BreakerOutcome::RateLimited {
                cooldown_ms: crate::classify::millis(crate::classify::clamp_hint(cooldown)),
            },
            ErrorClass::Dead => BreakerOutcome::Dead,
            ErrorClass::Rejected | ErrorClass::Invalid => BreakerOutcome::Neutral,
        }
    }
}

/// The breaker's answer to "may this source be tried now?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerAdmit {
    /// Yes; `probe` when this attempt is the half-open probe.
    Allowed {
        /// This attempt is the one half-open probe.
        probe: bool,
        /// The breaker epoch the attempt is admitted under: pass it to `record`.
        epoch: u64,
    },
    /// No.
    Refused {
        /// `circuit_open`, `dead` or `cooldown`.
        reason: RefusalReason,
        /// When it may pass (ms from now).
        retry_after_ms: u64,
    },
}

/// The state of one source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BreakerState {
    /// Consecutive breaker-feeding failures since the last success.
    pub consecutive_failures: u32,
    /// Open until this time (ms); 0 = closed. After it passes: half-open.
    pub open_until: u64,
    /// Re-opens since the breaker last closed (doubles the open time).
    pub reopens: u32,
    /// A half-open probe is out until this time (its lease); 0 = none.
    pub probe_until: u64,
    /// Dead until this time (ms); 0 = alive.
    pub dead_until: u64,
    /// Cooling down after a 429 until this time (ms).
    pub cooldown_until: u64,
    /// The breaker epoch: bumped on every trip, re-open, probe grant and close.
    pub epoch: u64,
    /// Consecutive 401/403/404 answers (the source is dead at `DEAD_AFTER`); a success
    /// or a 429 (the key was accepted) resets it.
    #[serde(default)]
    pub consecutive_dead: u32,
    /// An operator took the source out (SPEC §26.3) until it is brought back.
    #[serde(default)]
    pub drained: bool,
}

impl BreakerState {
    /// Whether the breaker is open or half-open (not closed).
    pub fn is_tripped(&self) -> bool {
        self.open_until > 0
    }

    /// An operator's reset (SPEC §26.3): the breaker closed at once — failures, open,
    /// half-open, dead and cooldown periods forgotten — in a new epoch, so outcomes of
    /// attempts admitted before it count no more. A drained source stays drained.
    pub fn reset(&mut self) {
        *self = BreakerState {
            epoch: self.epoch + 1,
            drained: self.drained,
            ..BreakerState::default()
        };
    }

    /// Decides whether the source may be tried at `now`; grants the half-open probe
    /// (held until `now + probe_lease_ms` unless its outcome is recorded first).
    pub fn admit(&mut self, now: u64, probe_lease_ms: u64) -> BreakerAdmit {
        if self.drained {
            return BreakerAdmit::Refused {
                reason: RefusalReason::Drained,
                retry_after_ms: 0,
            };
        }
        if self.dead_until > now {
            return BreakerAdmit::Refused {
                reason: RefusalReason::Dead,
                retry_after_ms: self.dead_until - now,
            };
        }
        if self.cooldown_until > now {
            return BreakerAdmit::Refused {
                reason: RefusalReason::Cooldown,
                retry_after_ms: self.cooldown_until - now,
            };
        }
        if self.open_until == 0 {
            return BreakerAdmit::Allowed {
                probe: false,
                epoch: self.epoch,
            };
        }
        if self.open_until > now {
            return BreakerAdmit::Refused {
                reason: RefusalReason::CircuitOpen,
                retry_after_ms: self.open_until - now,
            };
        }
        // Half-open: one probe at a time.
        if self.probe_until > now {
            return BreakerAdmit::Refused {
                reason: RefusalReason::CircuitOpen,
                retry_after_ms: self.probe_until - now,
            };
        }
        self.probe_until = now.saturating_add(probe_lease_ms.max(1));
        self.epoch += 1;
        BreakerAdmit::Allowed {
            probe: true,
            epoch: self.epoch,
        }
    }

    /// Records the end of an attempt admitted under `epoch` (`probe`: it was the
    /// half-open probe). Success and failure count only when `epoch` is the current one.
    pub fn record(
        &mut self,
        now: u64,
        outcome: BreakerOutcome,
        epoch: u64,
        probe: bool,
        s: &BreakerSettings,
    ) {
        let current = epoch == self.epoch;
        if probe && current {
            self.probe_until = 0;
        }
        match outcome {
            BreakerOutcome::Success if current => {
                self.consecutive_dead = 0;
                if self.open_until > 0 {
                    self.epoch += 1;
                }
                self.consecutive_failures = 0;
                self.open_until = 0;
                self.reopens = 0;
                self.probe_until = 0;
            }
            BreakerOutcome::Failure | BreakerOutcome::FastFailure if current => {
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                let half_open = self.open_until > 0 && self.open_until <= now;
                if probe && half_open {
                    if outcome == BreakerOutcome::FastFailure {
                        self.reopens = 0;
                    } else {
                        self.reopens = self.reopens.saturating_add(1);
                    }
                    self.open_until = now + open_ms(s, self.reopens);
                    self.epoch += 1;
                } else if self.open_until == 0 && self.consecutive_failures >= s.failures {
                    self.open_until = now + open_ms(s, self.reopens);
                    self.epoch += 1;
                }
            }
            BreakerOutcome::Success => self.consecutive_dead = 0,
            BreakerOutcome::Failure | BreakerOutcome::FastFailure | BreakerOutcome::Neutral => {}
            BreakerOutcome::Dead => {
                self.consecutive_dead = self.consecutive_dead.saturating_add(1);
                if self.consecutive_dead >= s.dead_after.max(1) {
                    self.dead_until = self
                        .dead_until
                        .max(now.saturating_add(crate::classify::millis(s.dead)));
                }
            }
            BreakerOutcome::RateLimited { cooldown_ms } => {
                self.consecutive_dead = 0;
                self.cooldown_until = self.cooldown_until.max(now.saturating_add(
                    cooldown_ms.min(crate::classify::millis(crate::classify::MAX_RETRY_HINT)),
                ));
            }
        }
    }
}

impl BreakerState {
    /// The heartbeat of a half-open probe admitted under `epoch`: extends its lease to
    /// `now + lease_ms` if it is still the current probe and its lease has not ended.
    pub fn renew_probe(&mut self, now: u64, epoch: u64, lease_ms: u64) {
        if epoch == self.epoch && self.probe_until > now {
            self.probe_until = self.probe_until.max(now.saturating_add(lease_ms.max(1)));
        }
    }

    /// Whether the state is the initial one (nothing to remember).
    pub fn is_initial(&self) -> bool {
        *self == BreakerState::default()
    }
}

/// Open time after `reopens` re-opens: `OPEN_S · 2^reopens`, at most `OPEN_MAX_S`
/// (never less than `OPEN_S`).
pub fn open_ms(s: &BreakerSettings, reopens: u32) -> u64 {
    let open = crate::classify::millis(s.open);
    let max = crate::classify::millis(s.open_max).max(open);
    let factor = 1u64.checked_shl(reopens.min(40)).unwrap_or(u64::MAX);
    open.saturating_mul(factor).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> BreakerSettings {
        BreakerSettings {
            failures: 3,
            open: Duration::from_secs(30),
            open_max: Duration::from_secs(300),
            dead: Duration::from_secs(300),
            dead_after: 1,
        }
    }

    fn allowed(a: BreakerAdmit) -> Option<bool> {
        match a {
            BreakerAdmit::Allowed { probe, .. } => Some(probe),
            BreakerAdmit::Refused { .. } => None,
        }
    }

    #[test]
    fn opens_after_threshold_then_half_open_probe_closes() {
        let s = settings();
        let mut b = BreakerState::default();
        for t in 0..2 {
            b.record(t, BreakerOutcome::Failure, b.epoch, false, &s);
            assert_eq!(allowed(b.admit(t, 1000)), Some(false));
        }
        b.record(2, BreakerOutcome::Failure, b.epoch, false, &s);
        assert_eq!(
            b.admit(3, 1000),
            BreakerAdmit::Refused {
                reason: RefusalReason::CircuitOpen,
                retry_after_ms: 29_999
            }
        );
        // half-open: exactly one probe
        assert_eq!(allowed(b.admit(30_002, 1000)), Some(true));
        assert!(allowed(b.admit(30_003, 1000)).is_none());
        b.record(30_010, BreakerOutcome::Success, b.epoch, true, &s);
        assert_eq!(allowed(b.admit(30_011, 1000)), Some(false));
        // closed, nothing remembered but the epoch (trip, probe, close)
        assert_eq!(
            b,
            BreakerState {
                epoch: 3,
                ..BreakerState::default()
            }
        );
    }

    /// The defaults (SPEC §19.3): 2 s, doubling per failed probe, up to 30 s.
    #[test]
    fn default_open_times_grow_from_two_seconds_to_thirty() {
        let s = BreakerSettings::default();
        let got: Vec<u64> = (0..7).map(|r| open_ms(&s, r) / 1000).collect();
        assert_eq!(got, [2, 4, 8, 16, 30, 30, 30]);
        // OPEN_S above OPEN_MAX_S: never shorter than OPEN_S.
        let long = BreakerSettings {
            open: Duration::from_secs(60),
            ..s
        };
        assert_eq!(open_ms(&long, 3), 60_000);
        assert_eq!(open_ms(&s, u32::MAX), 30_000, "no overflow");
    }

    /// SPEC §17.4: one transient 401 does not take a source out; `DEAD_AFTER` in a row
    /// do; a success or a 429 (the key was accepted) starts the count again.
    #[test]
    fn a_source_is_dead_after_dead_after_answers_in_a_row() {
        let s = BreakerSettings::default();
        let mut b = BreakerState::default();
        b.record(0, BreakerOutcome::Dead, b.epoch, false, &s);
        assert_eq!(
            allowed(b.admit(1, 1000)),
            Some(false),
            "one 401 is not dead"
        );
        b.record(2, BreakerOutcome::Success, b.epoch, false, &s);
        b.record(3, BreakerOutcome::Dead, b.epoch, false, &s);
        assert_eq!(
            allowed(b.admit(4, 1000)),
            Some(false),
            "the count restarted"
        );
        b.record(
            5,
            BreakerOutcome::RateLimited { cooldown_ms: 1 },
            b.epoch,
            false,
            &s,
        );
        b.record(10, BreakerOutcome::Dead, b.epoch, false, &s);
        assert_eq!(
            allowed(b.admit(11, 1000)),
            Some(false),
            "a 429 restarts it too"
        );
        b.record(12, BreakerOutcome::Dead, b.epoch, false, &s);
        assert_eq!(
            b.admit(12, 1000),
            BreakerAdmit::Refused {
                reason: RefusalReason::Dead,
                retry_after_ms: 300_000
            }
        );
    }

    /// SPEC §17.6: a cooldown of any length from outside never wraps: it is bounded.
    #[test]
    fn a_huge_cooldown_is_bounded_not_wrapped() {
        let s = settings();
        let mut b = BreakerState::default();
        let huge = BreakerOutcome::of_class(ErrorClass::RateLimited, Duration::MAX);
        b.record(u64::MAX / 2, huge, b.epoch, false, &s);
        b.record(
            1000,
            BreakerOutcome::RateLimited {
                cooldown_ms: u64::MAX,
            },
            b.epoch,
            false,
            &s,
        );
        match b.admit(1000, 1) {
            BreakerAdmit::Refused {
                reason: RefusalReason::Cooldown,
                retry_after_ms,
            } => {
                assert!(retry_after_ms >= crate::classify::millis(crate::classify::MAX_RETRY_HINT))
            }
            other => panic!("{other:?}"),
        }
        let mut b = BreakerState::default();
        b.record(
            1000,
            BreakerOutcome::RateLimited {
                cooldown_ms: u64::MAX,
            },
            b.epoch,
            false,
            &s,
        );
        assert_eq!(
            b.admit(1000, 1),
            BreakerAdmit::Refused {
                reason: RefusalReason::Cooldown,
                retry_after_ms: crate::classify::millis(crate::classify::MAX_RETRY_HINT)
            }
        );
    }

    #[test]
    fn a_probe_that_fails_fast_does_not_back_off() {
        let s = BreakerSettings {
            failures: 1,
            open: Duration::from_secs(2),
            open_max: Duration::from_secs(30),
            ..BreakerSettings::default()
        };
        let mut b = BreakerState::default();
        let ep = |b: &BreakerState| b.epoch;
        b.record(0, BreakerOutcome::Failure, ep(&b), false, &s);
        assert_eq!(b.open_until, 2_000);
        // Slow failed probes double the open time; a fast one goes back to OPEN_S.
        let mut now = 2_000;
        for want in [4_000, 8_000] {
            let BreakerAdmit::Allowed { probe: true, epoch } = b.admit(now, 1_000) else {
                panic!("probe");
            };
            b.record(now, BreakerOutcome::Failure, epoch, true, &s);
            assert_eq!(b.open_until - now, want);
            now = b.open_until;
        }
        let BreakerAdmit::Allowed { probe: true, epoch } = b.admit(now, 1_000) else {
            panic!("probe");
        };
        b.record(now, BreakerOutcome::FastFailure, epoch, true, &s);
        assert_eq!(b.open_until - now, 2_000, "back to OPEN_S");
        assert_eq!(b.reopens, 0);
        // As a failure outside a probe it counts like any other.
        assert_eq!(
            BreakerOutcome::of_failure(
                ErrorClass::Transient,
                Duration::ZERO,
                Duration::from_millis(5),
                &s
            ),
            BreakerOutcome::FastFailure
        );
        assert_eq!(
            BreakerOutcome::of_failure(
                ErrorClass::Transient,
                Duration::ZERO,
                Duration::from_secs(3),
                &s
            ),
            BreakerOutcome::Failure
        );
    }

    #[test]
    fn failed_probes_double_open_time_up_to_open_max() {
        let s = settings();
        let mut b = BreakerState::default();
        for _ in 0..3 {
            b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        }
        let mut now = 30_000;
        let mut opens = vec![];
        for _ in 0..6 {
            assert_eq!(allowed(b.admit(now, 1000)), Some(true));
            b.record(now, BreakerOutcome::Failure, b.epoch, true, &s);
            opens.push((b.open_until - now) / 1000);
            now = b.open_until;
        }
        assert_eq!(opens, [60, 120, 240, 300, 300, 300]);
    }

    #[test]
    fn neutral_probe_frees_the_probe_slot() {
        let s = settings();
        let mut b = BreakerState::default();
        for _ in 0..3 {
            b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        }
        assert_eq!(allowed(b.admit(30_000, 1000)), Some(true));
        b.record(30_001, BreakerOutcome::Neutral, b.epoch, true, &s);
        assert_eq!(allowed(b.admit(30_002, 1000)), Some(true));
    }

    #[test]
    fn probe_lease_expires() {
        let s = settings();
        let mut b = BreakerState::default();
        for _ in 0..3 {
            b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        }
        assert_eq!(allowed(b.admit(30_000, 1000)), Some(true));
        assert!(allowed(b.admit(30_999, 1000)).is_none());
        assert_eq!(allowed(b.admit(31_000, 1000)), Some(true));
    }

    #[test]
    fn cooldown_and_dead() {
        let s = settings();
        let mut b = BreakerState::default();
        b.record(
            0,
            BreakerOutcome::RateLimited { cooldown_ms: 5000 },
            b.epoch,
            false,
            &s,
        );
        assert_eq!(
            b.admit(1000, 1),
            BreakerAdmit::Refused {
                reason: RefusalReason::Cooldown,
                retry_after_ms: 4000
            }
        );
        assert_eq!(allowed(b.admit(5000, 1)), Some(false));
        assert_eq!(b.consecutive_failures, 0, "429 does not feed the breaker");
        b.record(6000, BreakerOutcome::Dead, b.epoch, false, &s);
        assert_eq!(
            b.admit(6000, 1),
            BreakerAdmit::Refused {
                reason: RefusalReason::Dead,
                retry_after_ms: 300_000
            }
        );
        assert_eq!(allowed(b.admit(306_000, 1)), Some(false));
    }

    #[test]
    fn outcome_of_class() {
        let d = Duration::from_millis(1500);
        assert_eq!(
            BreakerOutcome::of_class(ErrorClass::Transient, d),
            BreakerOutcome::Failure
        );
        assert_eq!(
            BreakerOutcome::of_class(ErrorClass::RateLimited, d),
            BreakerOutcome::RateLimited { cooldown_ms: 1500 }
        );
        assert_eq!(
            BreakerOutcome::of_class(ErrorClass::Dead, d),
            BreakerOutcome::Dead
        );
        assert_eq!(
            BreakerOutcome::of_class(ErrorClass::Rejected, d),
            BreakerOutcome::Neutral
        );
        assert_eq!(
            BreakerOutcome::of_class(ErrorClass::Invalid, d),
            BreakerOutcome::Neutral
        );
    }

    #[test]
    fn success_resets_consecutive_count() {
        let s = settings();
        let mut b = BreakerState::default();
        b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        b.record(0, BreakerOutcome::Success, b.epoch, false, &s);
        b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        assert_eq!(allowed(b.admit(1, 1)), Some(false));
        assert_eq!(b.consecutive_failures, 1);
    }

    fn epoch(a: BreakerAdmit) -> u64 {
        match a {
            BreakerAdmit::Allowed { epoch, .. } => epoch,
            BreakerAdmit::Refused { .. } => panic!("refused: {a:?}"),
        }
    }

    /// SPEC §14.7: a success of an attempt admitted before a trip does not close the
    /// breaker; a stale failure does not count against a breaker closed since.
    #[test]
    fn outcomes_count_only_in_their_epoch() {
        let s = settings();
        let mut b = BreakerState::default();
        let before = epoch(b.admit(0, 1000));
        for _ in 0..3 {
            b.record(1, BreakerOutcome::Failure, b.epoch, false, &s);
        }
        assert!(b.is_tripped());
        b.record(2, BreakerOutcome::Success, before, false, &s);
        assert!(
            b.is_tripped(),
            "a success from before the trip does not close it"
        );
        assert!(allowed(b.admit(3, 1000)).is_none());
        // the probe closes it
        let probe = epoch(b.admit(30_001, 1000));
        b.record(30_002, BreakerOutcome::Success, probe, true, &s);
        assert!(!b.is_tripped());
        // failures of attempts admitted before the close do not count
        for _ in 0..5 {
            b.record(30_003, BreakerOutcome::Failure, before, false, &s);
        }
        assert_eq!(b.consecutive_failures, 0);
        assert_eq!(allowed(b.admit(30_004, 1000)), Some(false));
    }

    /// A stale probe (its lease ended, another was granted) neither closes the breaker
    /// nor frees the current probe.
    #[test]
    fn a_stale_probe_changes_nothing() {
        let s = settings();
        let mut b = BreakerState::default();
        for _ in 0..3 {
            b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        }
        let old = epoch(b.admit(30_000, 1000));
        let new = epoch(b.admit(31_000, 1000));
        assert!(new > old);
        b.record(31_001, BreakerOutcome::Neutral, old, true, &s);
        assert!(
            allowed(b.admit(31_002, 1000)).is_none(),
            "the new probe is out"
        );
        b.record(31_003, BreakerOutcome::Success, old, true, &s);
        assert!(b.is_tripped());
        b.record(31_004, BreakerOutcome::Failure, old, true, &s);
        assert_eq!(b.reopens, 0);
        b.record(31_005, BreakerOutcome::Neutral, new, true, &s);
        assert_eq!(allowed(b.admit(31_006, 1000)), Some(true));
    }

    /// Nothing but the dead period ending revives a dead source (a success in flight
    /// when the key was revoked used to bring it back at once).
    #[test]
    fn only_time_revives_a_dead_source() {
        let s = settings();
        let mut b = BreakerState::default();
        let e = epoch(b.admit(0, 1000));
        b.record(10, BreakerOutcome::Dead, e, false, &s);
        b.record(20, BreakerOutcome::Success, e, false, &s);
        assert_eq!(
            b.admit(30, 1000),
            BreakerAdmit::Refused {
                reason: RefusalReason::Dead,
                retry_after_ms: 300_000 - 20
            }
        );
        assert_eq!(allowed(b.admit(300_010, 1000)), Some(false));
    }

    #[test]
    fn probe_heartbeat_keeps_the_probe() {
        let s = settings();
        let mut b = BreakerState::default();
        for _ in 0..3 {
            b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        }
        let p = epoch(b.admit(30_000, 1000));
        for t in (30_500..35_000).step_by(500) {
            b.renew_probe(t, p, 1000);
            assert!(allowed(b.admit(t + 1, 1000)).is_none());
        }
        // its heartbeat stopped: the lease ends, and a late renewal does not revive it
        b.renew_probe(36_000, p, 1000);
        assert_eq!(allowed(b.admit(36_001, 1000)), Some(true));
    }

    /// A failed probe re-opens the breaker under a new epoch, above the probe's: nothing
    /// admitted before — the probe included — counts any more (the epoch never goes
    /// back, or an old attempt's success would close a breaker that just re-opened).
    #[test]
    fn a_reopen_moves_the_epoch_on() {
        let s = settings();
        let mut b = BreakerState::default();
        for _ in 0..3 {
            b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        }
        let tripped = b.epoch;
        let probe = epoch(b.admit(30_000, 1000));
        assert_eq!(probe, tripped + 1);
        b.record(30_010, BreakerOutcome::Failure, probe, true, &s);
        assert_eq!(b.epoch, probe + 1, "re-opened under a new epoch");
        for stale in [tripped, probe] {
            b.record(30_020, BreakerOutcome::Success, stale, false, &s);
            assert!(
                b.is_tripped(),
                "a success under epoch {stale} closes nothing"
            );
        }
    }

    /// A success while the breaker is closed does not move the epoch: the other attempts
    /// admitted meanwhile still count.
    #[test]
    fn a_success_while_closed_keeps_the_epoch() {
        let s = settings();
        let mut b = BreakerState::default();
        let one = epoch(b.admit(0, 1000));
        let two = epoch(b.admit(0, 1000));
        b.record(1, BreakerOutcome::Success, one, false, &s);
        assert_eq!(b.epoch, one);
        b.record(2, BreakerOutcome::Failure, two, false, &s);
        assert_eq!(
            b.consecutive_failures, 1,
            "the other attempt's failure counts"
        );
    }

    /// While a probe is out, another caller is told when its lease ends.
    #[test]
    fn a_refusal_behind_a_probe_says_when_its_lease_ends() {
        let s = settings();
        let mut b = BreakerState::default();
        for _ in 0..3 {
            b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        }
        assert_eq!(allowed(b.admit(30_000, 1_000)), Some(true));
        assert_eq!(
            b.admit(30_400, 1_000),
            BreakerAdmit::Refused {
                reason: RefusalReason::CircuitOpen,
                retry_after_ms: 600
            }
        );
    }

    /// A heartbeat extends a lease that has not ended, and not one that ended this very
    /// millisecond.
    #[test]
    fn a_heartbeat_renews_only_a_lease_still_running() {
        let s = settings();
        let mut b = BreakerState::default();
        for _ in 0..3 {
            b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        }
        let p = epoch(b.admit(30_000, 1_000));
        b.renew_probe(30_999, p, 1_000);
        assert_eq!(
            b.probe_until, 31_999,
            "renewed a millisecond before its end"
        );
        b.renew_probe(31_999, p, 1_000);
        assert_eq!(b.probe_until, 31_999, "not at its end");
    }

    /// Only the default state is initial (a store may forget it).
    #[test]
    fn only_the_default_state_is_initial() {
        let s = settings();
        let mut b = BreakerState::default();
        assert!(b.is_initial());
        b.record(0, BreakerOutcome::Failure, b.epoch, false, &s);
        assert!(!b.is_initial());
        b.record(1, BreakerOutcome::Success, b.epoch, false, &s);
        assert!(b.is_initial(), "a success forgets the failure");
        b.record(
            2,
            BreakerOutcome::RateLimited { cooldown_ms: 10 },
            b.epoch,
            false,
            &s,
        );
        assert!(!b.is_initial());
    }
}
