//! Whether a leg may launch: the decisions of core's round that hold a leg back, in one
//! place — the scope's retry throttle (SPEC §25.4, [`leg_gate`], for a round's primary)
//! and a client key's budget (SPEC §24.1, [`leg_funding`], for every leg: the first, a
//! hedge, a resume, a retry; a leg whose top-up is refused is not launched).
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

/// What a client key's budget asks before a leg launches (SPEC §24.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Funding {
    /// The call's funds cover it (or the key has no budget to keep): launch.
    Covered,
    /// Top up this many nanos first; if the key refuses, the leg is not launched.
    TopUp(u64),
}

/// Whether a leg reserving `leg_nanos` is covered by the call's `funds`, for a key that
/// has a budget (`budgeted`) or not ([`crate::key_funds`]).
pub fn leg_funding(funds: &crate::key_funds::CallFunds, leg_nanos: u64, budgeted: bool) -> Funding {
    match funds.shortfall(leg_nanos) {
        n if n > 0 && budgeted => Funding::TopUp(n),
        _ => Funding::Covered,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leg_beyond_the_calls_funds_is_topped_up_only_under_a_budget() {
        let mut f = crate::key_funds::CallFunds::new(100);
        assert_eq!(leg_funding(&f, 100, true), Funding::Covered);
        f.hold(60);
        assert_eq!(leg_funding(&f, 100, true), Funding::TopUp(60));
        assert_eq!(leg_funding(&f, 100, false), Funding::Covered);
    }

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
