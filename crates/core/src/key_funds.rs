//! A call's money against its client key's budget (SPEC §24.1), as pure arithmetic: what
//! each leg reserves, when a leg needs a top-up before it launches, and what the call
//! settles. The engine only executes it: it asks [`CallFunds::shortfall`] (through
//! [`crate::round::gate::leg_funding`]) before each leg, tops up through the key's
//! governance backend (a money-only key permit, `KeyAcquire::top_up`), and reports each
//! leg's end.
//!
//! - **A leg's reservation** is its largest possible cost at its source's prices: the
//!   prompt estimate plus a margin ([`ESTIMATE_MARGIN_PCT`]) at the dearest input-side
//!   price (cache writes included), plus the call's output cap at the output price
//!   ([`leg_reserve_nanos`]).
//! - **The call's funds** start at the admission's reservation (at the scope's dearest
//!   prices, so its first leg is always covered) and grow by each top-up the backend
//!   grants. A leg launches only when the funds cover the legs held, the legs ended and
//!   it; otherwise the shortfall is topped up first, and a refused top-up means the leg
//!   is not launched.
//! - **Settlement**: each ended leg at its cost, or at its reservation when its cost is
//!   unknown (SPEC §20.4's upper bound); a leg still held at the end at its reservation.
//!
//! The invariant (property-tested below, with core's key model): when each leg's known
//! cost is at most its reservation, a call settles at most its funds, and so the spend
//! settled in a period never exceeds the budget, whatever the interleaving of calls,
//! legs, top-ups and settlements.

use crate::key_quota::{output_estimate, ScopePrices};
use crate::source::SourceConfig;

/// The default margin on the prompt estimate in a reservation, percent
/// (`KEYS__ESTIMATE_MARGIN` = 0.25, SPEC §24.1).
pub const ESTIMATE_MARGIN_PCT: u64 = 25;

/// The default `KEYS__MIN_OUTPUT_TOKENS`: the smallest cap a call's output is shrunk to
/// when its key's remaining budget cannot pay for more.
pub const MIN_OUTPUT_TOKENS: u64 = 1024;

/// The output cap a budgeted key's call without a cap of its own reserves and is sent,
/// when no source of the scope sets `MAX_OUTPUT_TOKENS`.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u64 = 4096;

/// A scope's client-key money settings (`KEYS__*`, SPEC §24.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct KeySettings {
    /// `KEYS__ESTIMATE_MARGIN`, in percent: the margin on the prompt estimate.
    pub estimate_margin_pct: u64,
    /// `KEYS__MIN_OUTPUT_TOKENS`: a call that cannot pay for the smaller of its own cap
    /// and this is refused; above it, its cap shrinks to what the budget can pay.
    pub min_output_tokens: u64,
}

impl Default for KeySettings {
    fn default() -> Self {
        KeySettings {
            estimate_margin_pct: ESTIMATE_MARGIN_PCT,
            min_output_tokens: MIN_OUTPUT_TOKENS,
        }
    }
}

/// The prompt tokens a reservation prices: the estimate plus `margin_pct` percent,
/// rounded up.
pub fn with_margin(prompt_tokens: u64, margin_pct: u64) -> u64 {
    prompt_tokens
        .saturating_mul(100u64.saturating_add(margin_pct))
        .div_ceil(100)
}

/// The largest output cap a remaining budget of `remaining_nanos` pays for, after the
/// prompt (`prompt_tokens` with its margin) at `prices` (SPEC §24.1); `None` when it is
/// below `floor` (the smaller of the call's own cap and `KEYS__MIN_OUTPUT_TOKENS`: the
/// call is refused) or the prices cannot price it. Never above `wanted`.
pub fn shrunk_cap(
    remaining_nanos: u64,
    prompt_tokens: u64,
    margin_pct: u64,
    prices: &ScopePrices,
    wanted: u64,
    floor: u64,
) -> Option<u64> {
    let prompt = with_margin(prompt_tokens, margin_pct);
    // ⌈(prompt × in + cap × out) / 10⁶⌉ ≤ remaining  ⇔  cap × out ≤ remaining × 10⁶ −
    // prompt × in (the reservation rounds the sum once, as `reserve_nanos` does).
    let in_part = match (prompt, prices.input) {
        (0, _) => 0,
        (p, Some(price)) => u128::from(p) * u128::from(price),
        (_, None) => return None,
    };
    let left = (u128::from(remaining_nanos) * 1_000_000).checked_sub(in_part)?;
    let cap = match prices.output {
        Some(0) | None => wanted,
        Some(p) => u64::try_from(left / u128::from(p))
            .unwrap_or(u64::MAX)
            .min(wanted),
    };
    // A per-call price is a floor the cap cannot lower.
    let fits = prices
        .reserve_nanos(with_margin(prompt_tokens, margin_pct), cap)
        .is_some_and(|n| n <= remaining_nanos);
    (cap >= floor.min(wanted) && fits).then_some(cap)
}

/// The cap sent with a budgeted key's call that has none (SPEC §24.1): the smallest
/// `MAX_OUTPUT_TOKENS` of the scope's sources (every source accepts it), each unset one
/// counting as [`DEFAULT_MAX_OUTPUT_TOKENS`].
pub fn default_cap(sources: &[SourceConfig]) -> u64 {
    sources
        .iter()
        .map(|s| s.max_output_tokens.unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS))
        .min()
        .unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS)
}

/// One leg's reservation on `source`, nanos: `prompt_tokens` with `margin_pct` at the
/// source's dearest input-side price plus `cap` (else the source's output estimate) at
/// its output price. A source whose prices cannot price the leg reserves what the
/// scope's dearest prices would (`sources`), else 0 (a scope without prices: no budget
/// can be set on it).
pub fn leg_reserve_nanos(
    prompt_tokens: u64,
    cap: Option<u64>,
    margin_pct: u64,
    source: &SourceConfig,
    sources: &[SourceConfig],
    scope_tpm: u64,
) -> u64 {
    let prompt = with_margin(prompt_tokens, margin_pct);
    let own = output_estimate(cap, std::slice::from_ref(source), scope_tpm);
    ScopePrices::highest([source])
        .reserve_nanos(prompt, own)
        .or_else(|| {
            ScopePrices::highest(sources)
                .reserve_nanos(prompt, output_estimate(cap, sources, scope_tpm))
        })
        .unwrap_or(0)
}

/// A call's money, nanos (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallFunds {
    /// The admission's reservation plus every top-up granted.
    reserved: u64,
    /// Σ reservations of the legs launched and not ended.
    held: u64,
    /// Σ settlements of the legs ended.
    charged: u64,
}

impl CallFunds {
    /// Funds of a call admitted with `reserved` nanos.
    pub fn new(reserved: u64) -> Self {
        CallFunds {
            reserved,
            held: 0,
            charged: 0,
        }
    }

    /// What must be topped up before a leg reserving `leg` launches (0: covered).
    pub fn shortfall(&self, leg: u64) -> u64 {
        self.held
            .saturating_add(self.charged)
            .saturating_add(leg)
            .saturating_sub(self.reserved)
    }

    /// A top-up of `nanos` was granted.
    pub fn topped_up(&mut self, nanos: u64) {
        self.reserved = self.reserved.saturating_add(nanos);
    }

    /// Holds `leg` for a leg that launches (the caller checked [`Self::shortfall`], or
    /// the key has no budget to keep).
    pub fn hold(&mut self, leg: u64) {
        self.held = self.held.saturating_add(leg);
    }

    /// A held leg never started (its pick failed): nothing is charged.
    pub fn release(&mut self, leg: u64) {
        self.held = self.held.saturating_sub(leg);
    }

    /// A held leg ended: it settles at `cost` when known, else at its reservation.
    pub fn end(&mut self, leg: u64, cost: Option<u64>) {
        self.held = self.held.saturating_sub(leg);
        self.charged = self.charged.saturating_add(cost.unwrap_or(leg));
    }

    /// What the call settles now: its ended legs, and any leg still held at its
    /// reservation.
    pub fn settlement(&self) -> u64 {
        self.charged.saturating_add(self.held)
    }

    /// The admission's reservation plus the top-ups.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }
}

/// What a call whose legs ended as `legs` — each `(its cost, its reservation)` — settles:
/// Σ cost, a leg of unknown cost at its reservation (what [`CallFunds`] computes; for
/// checks that rebuild it from telemetry rows).
pub fn settle_legs(legs: impl IntoIterator<Item = (Option<u64>, u64)>) -> u64 {
    legs.into_iter()
        .fold(0u64, |s, (cost, leg)| s.saturating_add(cost.unwrap_or(leg)))
}

#[cfg(test)]
mod tests;
