//! The breaker, cooldown and dead-source state machine of one source (SPEC §4.4), pure
//! and on millisecond timestamps so the memory backend runs it as is and the Redis Lua
//! script mirrors it (the contract suite checks they agree).
//!
//! - `BREAKER__FAILURES` consecutive breaker-feeding failures open the breaker for
//!   `OPEN_S`; each re-open (a failed half-open probe) doubles it, up to 10×.
//! - After the open time, half-open admits one probe; its success closes the breaker.
//! - 429 sets a cooldown; 401/403/404 make the source dead for `DEAD_S`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{ErrorClass, RefusalReason};
use crate::settings::BreakerSettings;

/// The largest multiple of `OPEN_S` an open period can reach.
pub const MAX_OPEN_FACTOR: u64 = 10;

/// What an attempt's end means to the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BreakerOutcome {
    /// A usable answer: closes the breaker.
    Success,
    /// A breaker-feeding failure (transient, not 429).
    Failure,
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
    /// The outcome of a failure class (`cooldown` is used for 429).
    pub fn of_class(class: ErrorClass, cooldown: Duration) -> Self {
        match class {
            ErrorClass::Transient => BreakerOutcome::Failure,
            ErrorClass::RateLimited => BreakerOutcome::RateLimited {
                cooldown_ms: cooldown.as_millis() as u64,
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
}

impl BreakerState {
    /// Whether the breaker is open or half-open (not closed).
    pub fn is_tripped(&self) -> bool {
        self.open_until > 0
    }

    /// Decides whether the source may be tried at `now`; grants the half-open probe
    /// (held until `now + probe_lease_ms` unless its outcome is recorded first).
    pub fn admit(&mut self, now: u64, probe_lease_ms: u64) -> BreakerAdmit {
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
            return BreakerAdmit::Allowed { probe: false };
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
        BreakerAdmit::Allowed { probe: true }
    }

    /// Records an attempt's end.
    pub fn record(&mut self, now: u64, outcome: BreakerOutcome, probe: bool, s: &BreakerSettings) {
        if probe {
            self.probe_until = 0;
        }
        match outcome {
            BreakerOutcome::Success => {
                *self = BreakerState {
                    dead_until: 0,
                    cooldown_until: self.cooldown_until,
                    ..BreakerState::default()
                };
            }
            BreakerOutcome::Failure => {
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                let half_open = self.open_until > 0 && self.open_until <= now;
                if probe && half_open {
                    self.reopens = self.reopens.saturating_add(1);
                    self.open_until = now + open_ms(s, self.reopens);
                } else if self.open_until == 0 && self.consecutive_failures >= s.failures {
                    self.open_until = now + open_ms(s, self.reopens);
                }
            }
            BreakerOutcome::Neutral => {}
            BreakerOutcome::Dead => {
                self.dead_until = now + s.dead.as_millis() as u64;
            }
            BreakerOutcome::RateLimited { cooldown_ms } => {
                self.cooldown_until = self.cooldown_until.max(now + cooldown_ms);
            }
        }
    }
}

/// Open time after `reopens` re-opens: `OPEN_S · min(2^reopens, 10)`.
pub fn open_ms(s: &BreakerSettings, reopens: u32) -> u64 {
    let factor = 1u64
        .checked_shl(reopens.min(20))
        .unwrap_or(MAX_OPEN_FACTOR)
        .min(MAX_OPEN_FACTOR);
    (s.open.as_millis() as u64).saturating_mul(factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> BreakerSettings {
        BreakerSettings {
            failures: 3,
            open: Duration::from_secs(30),
            dead: Duration::from_secs(300),
        }
    }

    fn allowed(a: BreakerAdmit) -> Option<bool> {
        match a {
            BreakerAdmit::Allowed { probe } => Some(probe),
            BreakerAdmit::Refused { .. } => None,
        }
    }

    #[test]
    fn opens_after_threshold_then_half_open_probe_closes() {
        let s = settings();
        let mut b = BreakerState::default();
        for t in 0..2 {
            b.record(t, BreakerOutcome::Failure, false, &s);
            assert_eq!(allowed(b.admit(t, 1000)), Some(false));
        }
        b.record(2, BreakerOutcome::Failure, false, &s);
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
        b.record(30_010, BreakerOutcome::Success, true, &s);
        assert_eq!(allowed(b.admit(30_011, 1000)), Some(false));
        assert_eq!(b, BreakerState::default());
    }

    #[test]
    fn failed_probes_double_open_time_up_to_ten_times() {
        let s = settings();
        let mut b = BreakerState::default();
        for _ in 0..3 {
            b.record(0, BreakerOutcome::Failure, false, &s);
        }
        let mut now = 30_000;
        let mut opens = vec![];
        for _ in 0..6 {
            assert_eq!(allowed(b.admit(now, 1000)), Some(true));
            b.record(now, BreakerOutcome::Failure, true, &s);
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
            b.record(0, BreakerOutcome::Failure, false, &s);
        }
        assert_eq!(allowed(b.admit(30_000, 1000)), Some(true));
        b.record(30_001, BreakerOutcome::Neutral, true, &s);
        assert_eq!(allowed(b.admit(30_002, 1000)), Some(true));
    }

    #[test]
    fn probe_lease_expires() {
        let s = settings();
        let mut b = BreakerState::default();
        for _ in 0..3 {
            b.record(0, BreakerOutcome::Failure, false, &s);
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
        b.record(6000, BreakerOutcome::Dead, false, &s);
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
        b.record(0, BreakerOutcome::Failure, false, &s);
        b.record(0, BreakerOutcome::Failure, false, &s);
        b.record(0, BreakerOutcome::Success, false, &s);
        b.record(0, BreakerOutcome::Failure, false, &s);
        assert_eq!(allowed(b.admit(1, 1)), Some(false));
        assert_eq!(b.consecutive_failures, 1);
    }
}
