//! Retry throttling per scope, as gRPC does it (SPEC §25.4), pure: client libraries and
//! agents retry on their own (the official SDKs twice, Claude Code up to ten times,
//! Codex five reconnects), so retries inside polygw must not multiply an outage.
//!
//! A bucket starts full at `RETRY__THROTTLE_MAX` tokens (default 10), loses 1 per
//! failed attempt, gains `RETRY__THROTTLE_RATIO` (default 0.2) per successful one, and
//! allows a retry only while it is above half. Which leg may launch — the first attempt
//! of a call and a failover to a source the call has not tried are never throttled — is
//! [`crate::round::leg_gate`]'s, the one decision of whether a leg launches.
//!
//! What counts as a failed attempt: a failure of the source (5xx, connect, timeout, a
//! cut or broken stream, an unusable answer, a dead key). Not counted: a rejection of
//! the request's content (the client's, not the source's), a 429 (the source's own flow
//! control, answered with its hint: §14.1, §15), and a cancelled leg (a hedge loser is
//! slow, not failing). DECISIONS 170.
//!
//! Exact: tokens are counted in thousandths, as gRPC specifies.

use crate::error::{AttemptError, ErrorClass};

/// Default `RETRY__THROTTLE_MAX`.
pub const DEFAULT_MAX_TOKENS: u32 = 10;

/// Default `RETRY__THROTTLE_RATIO`.
pub const DEFAULT_RATIO: f64 = 0.2;

/// Thousandths of a token.
const MILLI: u64 = 1000;

/// `{S}__RETRY__THROTTLE_*`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ThrottleSettings {
    /// `RETRY__THROTTLE_MAX`: the bucket's size, in tokens (0: no throttling).
    pub max_tokens: u32,
    /// `RETRY__THROTTLE_RATIO`: tokens a successful attempt gives back.
    pub ratio: f64,
}

impl Default for ThrottleSettings {
    fn default() -> Self {
        ThrottleSettings {
            max_tokens: DEFAULT_MAX_TOKENS,
            ratio: DEFAULT_RATIO,
        }
    }
}

/// One line saying how a scope throttles its retries (`polygw config check`).
pub fn describe(s: &ThrottleSettings) -> String {
    if s.max_tokens == 0 {
        return "retries: not throttled (RETRY__THROTTLE_MAX=0)".to_string();
    }
    format!(
        "retries: throttled per scope — a bucket of {} tokens, −1 per failed attempt, +{} per success; \
         a retry goes while it is above {}, a failover to an untried source always",
        s.max_tokens,
        s.ratio,
        f64::from(s.max_tokens) / 2.0
    )
}

/// A scope's retry throttle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryThrottle {
    /// The bucket's size, thousandths (0: retries are never throttled).
    max: u64,
    /// A success's refill, thousandths.
    ratio: u64,
    /// The level, thousandths (`0..=max`).
    level: u64,
}

impl RetryThrottle {
    /// A full bucket.
    pub fn new(s: ThrottleSettings) -> Self {
        let max = u64::from(s.max_tokens) * MILLI;
        let ratio = if s.ratio.is_finite() && s.ratio > 0.0 {
            (s.ratio * MILLI as f64).round().min(max as f64) as u64
        } else {
            0
        };
        RetryThrottle {
            max,
            ratio,
            level: max,
        }
    }

    /// An attempt ended with `outcome` (`Ok`: it succeeded); cancelled legs are not
    /// reported.
    pub fn on_attempt(&mut self, outcome: Result<(), &AttemptError>) {
        match outcome {
            Ok(()) => self.level = (self.level + self.ratio).min(self.max),
            Err(e) if counts_as_failure(e) => self.level = self.level.saturating_sub(MILLI),
            Err(_) => {}
        }
    }

    /// Whether a retry may go: the bucket is above half (always, without a bucket).
    pub fn allows_retry(&self) -> bool {
        self.max == 0 || self.level * 2 > self.max
    }

    /// The level, in tokens (for `/metrics` and the trace).
    pub fn tokens(&self) -> f64 {
        self.level as f64 / MILLI as f64
    }
}

/// Whether a failed attempt drains the bucket (see the module's documentation).
pub fn counts_as_failure(e: &AttemptError) -> bool {
    match e.class {
        ErrorClass::Transient | ErrorClass::Invalid | ErrorClass::Dead => true,
        ErrorClass::RateLimited | ErrorClass::Rejected => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorLabel;
    use proptest::prelude::*;

    fn err(class: ErrorClass) -> AttemptError {
        AttemptError::new(class, ErrorLabel::ServerError, "x")
    }

    #[test]
    fn the_bucket_follows_grpc() {
        let mut t = RetryThrottle::new(ThrottleSettings::default());
        assert!(t.allows_retry());
        // 10 → 5: not above half.
        for _ in 0..5 {
            t.on_attempt(Err(&err(ErrorClass::Transient)));
        }
        assert_eq!(t.tokens(), 5.0);
        assert!(!t.allows_retry());
        // One success: 5.2 > 5.
        t.on_attempt(Ok(()));
        assert!(t.allows_retry());
        assert_eq!(t.tokens(), 5.2);
        t.on_attempt(Err(&err(ErrorClass::Transient)));
        assert!(!t.allows_retry());
        // Never above the top, never below 0.
        for _ in 0..100 {
            t.on_attempt(Ok(()));
        }
        assert_eq!(t.tokens(), 10.0);
        for _ in 0..100 {
            t.on_attempt(Err(&err(ErrorClass::Dead)));
        }
        assert_eq!(t.tokens(), 0.0);
    }

    #[test]
    fn config_check_says_how_retries_are_throttled() {
        assert_eq!(
            describe(&ThrottleSettings::default()),
            "retries: throttled per scope — a bucket of 10 tokens, −1 per failed attempt, +0.2 per success; \
             a retry goes while it is above 5, a failover to an untried source always"
        );
        assert!(describe(&ThrottleSettings {
            max_tokens: 0,
            ratio: 0.2
        })
        .contains("not throttled"));
    }

    #[test]
    fn rejections_and_rate_limits_do_not_drain_it() {
        let mut t = RetryThrottle::new(ThrottleSettings::default());
        for _ in 0..50 {
            t.on_attempt(Err(&err(ErrorClass::Rejected)));
            t.on_attempt(Err(&err(ErrorClass::RateLimited)));
        }
        assert_eq!(t.tokens(), 10.0);
        t.on_attempt(Err(&err(ErrorClass::Invalid)));
        assert_eq!(t.tokens(), 9.0);
    }

    #[test]
    fn without_a_bucket_retries_are_never_throttled() {
        let mut t = RetryThrottle::new(ThrottleSettings {
            max_tokens: 0,
            ratio: 0.2,
        });
        for _ in 0..20 {
            t.on_attempt(Err(&err(ErrorClass::Transient)));
        }
        assert!(t.allows_retry());
    }

    proptest! {
        /// The level stays within the bucket, and a retry is allowed exactly while it is
        /// above half: after `f` failures and `s` successes in any order from full, the
        /// level is at least `max − f` and at most `max`.
        #[test]
        fn the_level_is_bounded_and_the_rule_is_above_half(
            max in 1u32..50,
            ratio_milli in 1u32..2_000,
            outcomes in proptest::collection::vec(any::<bool>(), 0..200),
        ) {
            let mut t = RetryThrottle::new(ThrottleSettings { max_tokens: max, ratio: f64::from(ratio_milli) / 1000.0 });
            let mut fails = 0u32;
            for ok in outcomes {
                if ok {
                    t.on_attempt(Ok(()));
                } else {
                    fails += 1;
                    t.on_attempt(Err(&err(ErrorClass::Transient)));
                }
                prop_assert!(t.tokens() <= f64::from(max) + 1e-9);
                prop_assert!(t.tokens() >= 0.0);
                prop_assert!(t.tokens() + 1e-9 >= f64::from(max.saturating_sub(fails)));
                prop_assert_eq!(t.allows_retry(), t.tokens() > f64::from(max) / 2.0);
            }
        }
    }
}
