//! Settlement (SPEC §4.3): how many tokens an attempt's reservation settles to, for
//! every outcome. The limiter replaces the reservation (`effective_est_tokens`) by it.

use crate::error::{AttemptError, ErrorClass};
use crate::response::{Usage, UsageSource};

/// How an attempt ended, as far as settlement cares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttemptOutcome<'a> {
    /// A usable answer.
    Success {
        /// Its usage.
        usage: &'a Usage,
        /// Where the usage came from.
        source: UsageSource,
    },
    /// A classified failure.
    Failed(&'a AttemptError),
    /// Hedge loser, caller drop, deadline.
    Cancelled,
}

/// The settlement decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// Settle this many tokens.
    Tokens(u64),
}

impl Settlement {
    /// The token count.
    pub fn tokens(self) -> u64 {
        match self {
            Settlement::Tokens(n) => n,
        }
    }
}

/// SPEC §4.3, one row per arm. `est` is the attempt's `effective_est_tokens()`.
pub fn settle(outcome: AttemptOutcome<'_>, est: u64) -> Settlement {
    Settlement::Tokens(match outcome {
        AttemptOutcome::Success { usage, source } => match source {
            UsageSource::Measured | UsageSource::Estimated => usage.total(),
            // A source that never sends usage must still be metered.
            UsageSource::Unavailable => est,
        },
        AttemptOutcome::Failed(e) => match e.class {
            // The tokens may have been billed upstream.
            ErrorClass::Transient | ErrorClass::RateLimited => est,
            ErrorClass::Invalid => match (e.usage, e.usage_source) {
                (Some(u), UsageSource::Measured | UsageSource::Estimated) => u.total(),
                _ => 0,
            },
            ErrorClass::Rejected | ErrorClass::Dead => 0,
        },
        AttemptOutcome::Cancelled => est,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorLabel;

    #[test]
    fn settlement_table() {
        let u = Usage::new(300, 200);
        let none = Usage::default();
        let est = 100;
        let err = |class, label| AttemptError::new(class, label, "x");
        let timeout = err(ErrorClass::Transient, ErrorLabel::Timeout);
        let server = err(ErrorClass::Transient, ErrorLabel::ServerError);
        let connect = err(ErrorClass::Transient, ErrorLabel::Connect);
        let truncated = err(ErrorClass::Transient, ErrorLabel::Truncated);
        let limited = err(ErrorClass::RateLimited, ErrorLabel::RateLimited);
        let invalid_measured =
            err(ErrorClass::Invalid, ErrorLabel::Invalid).with_usage(u, UsageSource::Measured);
        let invalid = err(ErrorClass::Invalid, ErrorLabel::Invalid);
        let rejected = err(ErrorClass::Rejected, ErrorLabel::Rejected);
        let dead = err(ErrorClass::Dead, ErrorLabel::Dead);
        let rows: Vec<(&str, AttemptOutcome<'_>, u64)> = vec![
            (
                "success measured",
                AttemptOutcome::Success {
                    usage: &u,
                    source: UsageSource::Measured,
                },
                500,
            ),
            (
                "success estimated",
                AttemptOutcome::Success {
                    usage: &u,
                    source: UsageSource::Estimated,
                },
                500,
            ),
            (
                "success unavailable",
                AttemptOutcome::Success {
                    usage: &none,
                    source: UsageSource::Unavailable,
                },
                est,
            ),
            ("timeout", AttemptOutcome::Failed(&timeout), est),
            ("5xx", AttemptOutcome::Failed(&server), est),
            ("connect", AttemptOutcome::Failed(&connect), est),
            ("truncated", AttemptOutcome::Failed(&truncated), est),
            ("429", AttemptOutcome::Failed(&limited), est),
            (
                "invalid with measured usage",
                AttemptOutcome::Failed(&invalid_measured),
                500,
            ),
            ("invalid without usage", AttemptOutcome::Failed(&invalid), 0),
            ("rejected", AttemptOutcome::Failed(&rejected), 0),
            ("dead", AttemptOutcome::Failed(&dead), 0),
            ("cancelled", AttemptOutcome::Cancelled, est),
        ];
        for (name, outcome, want) in rows {
            assert_eq!(settle(outcome, est).tokens(), want, "{name}");
        }
    }
}
