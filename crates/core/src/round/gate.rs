//! Whether a round's primary leg may launch (SPEC §25.4): the one decision of core's
//! round that every reason to hold a leg back goes through. Today that is the scope's
//! retry throttle ([`crate::retry_throttle`]); a client key's budget top-up (SPEC §24.1)
//! joins it here.
//!
//! - The first attempt of a call always launches.
//! - A retry (a round after a failed one, a continuation of a broken stream included)
//!   launches while the throttle allows retries; otherwise only as a failover to a
//!   source the call has not tried yet — admission then takes no other (a breaker that
//!   is not closed refuses it there) — and when there is none the call ends at once
//!   with its last error.

/// Which round asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundKind {
    /// The call's first round.
    First,
    /// A later round: a retry, or the continuation of a broken stream.
    Retry,
}

/// What the gate knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateAsk {
    /// The round asking.
    pub round: RoundKind,
    /// The scope's retry throttle allows a retry ([`crate::retry_throttle::RetryThrottle::allows_retry`]).
    pub throttle_allows: bool,
    /// A source the call has not tried is left (not excluded).
    pub untried_left: bool,
}

/// The gate's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Launch on any source admission picks.
    Launch,
    /// Launch only on a source the call has not tried (a failover is never throttled),
    /// without a backoff before it.
    UntriedOnly,
    /// Do not launch: retries are throttled and every source was tried.
    Throttled,
}

/// The decision (see the module's documentation).
pub fn leg_gate(ask: GateAsk) -> Gate {
    match ask.round {
        RoundKind::First => Gate::Launch,
        RoundKind::Retry if ask.throttle_allows => Gate::Launch,
        RoundKind::Retry if ask.untried_left => Gate::UntriedOnly,
        RoundKind::Retry => Gate::Throttled,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_attempt_and_a_failover_are_never_throttled() {
        for throttle_allows in [false, true] {
            for untried_left in [false, true] {
                let ask = |round| GateAsk {
                    round,
                    throttle_allows,
                    untried_left,
                };
                assert_eq!(leg_gate(ask(RoundKind::First)), Gate::Launch);
                let retry = leg_gate(ask(RoundKind::Retry));
                match (throttle_allows, untried_left) {
                    (true, _) => assert_eq!(retry, Gate::Launch),
                    (false, true) => assert_eq!(retry, Gate::UntriedOnly),
                    (false, false) => assert_eq!(retry, Gate::Throttled),
                }
            }
        }
    }
}
