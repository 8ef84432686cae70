//! The `auto` threshold in force from the first call (SPEC §25.1, §25.2), pure: a
//! source starts from priors (`HEDGE__AFTER_PRIOR_S`, `HEDGE__STALL_PRIOR_S`), moves to
//! its learned quantile ([`crate::hedge::thresholds`]) as evidence grows ([`blend`],
//! [`learned_weight`]), and its learned value never changes by more than [`MAX_CHANGE`]
//! per `HEDGE__WINDOW_S` ([`Steady`]). The first-token prior of one request grows with its
//! prompt and its reasoning effort ([`request_prior_factor`]): a 100k-token prompt or a
//! high-effort reasoning call is not slow at 15 s.
//!
//! Invariants (property-tested below):
//! - the prior's weight never grows with evidence, and is 0 from
//!   [`FULL_EVIDENCE`] × `HEDGE__MIN_SAMPLES` legs on (today's learned thresholds then
//!   apply unchanged);
//! - the blend lies between the prior and the learned value, and moves toward the
//!   learned value as evidence grows;
//! - over any interval of length `d`, a [`Steady`] threshold changes by at most
//!   `MAX_CHANGE^(d / window)` (so at most ×1.5 within a window); the engine holds each
//!   source's learned value steady, and blends the prior in by the evidence, which moves
//!   the blend by a sliver per leg (DECISIONS 169).

use std::time::{Duration, Instant};

use serde::Serialize;

/// Default `HEDGE__AFTER_PRIOR_S`: the first-token threshold of a source without
/// evidence.
pub const DEFAULT_AFTER_PRIOR: Duration = Duration::from_secs(15);

/// Default `HEDGE__STALL_PRIOR_S`: the stall threshold of a source without evidence.
pub const DEFAULT_STALL_PRIOR: Duration = Duration::from_secs(10);

/// The evidence, in multiples of `HEDGE__MIN_SAMPLES`, from which the prior has no
/// weight left (DECISIONS 169).
pub const FULL_EVIDENCE: u64 = 4;

/// The largest factor by which a threshold in force may change within one
/// `HEDGE__WINDOW_S` (SPEC §25.2).
pub const MAX_CHANGE: f64 = 1.5;

/// Prompt tokens a provider reads per second before its first token, for the
/// first-token prior: a 100k-token prompt adds 20 s (DECISIONS 169).
pub const PREFILL_TOKENS_PER_S: u64 = 5_000;

/// The priors of a scope (`None`: that trigger has no prior, as before Revision 4:
/// no `auto` hedge until there is evidence).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Priors {
    /// First-token prior (`HEDGE__AFTER_PRIOR_S`).
    #[serde(with = "crate::durations::opt_secs")]
    pub after: Option<Duration>,
    /// Stall prior (`HEDGE__STALL_PRIOR_S`).
    #[serde(with = "crate::durations::opt_secs")]
    pub stall: Option<Duration>,
}

impl Default for Priors {
    fn default() -> Self {
        Priors {
            after: Some(DEFAULT_AFTER_PRIOR),
            stall: Some(DEFAULT_STALL_PRIOR),
        }
    }
}

/// The weight of the learned value in the blend, 0..=1, from the evidence of the
/// distribution it was read from: 0 without a learned value, then `evidence ÷
/// (FULL_EVIDENCE × min_samples)`, 1 from there on. Never decreasing in `evidence`.
pub fn learned_weight(learned: bool, evidence: u64, min_samples: u64) -> f64 {
    if !learned {
        return 0.0;
    }
    let full = FULL_EVIDENCE.saturating_mul(min_samples.max(1));
    if evidence >= full {
        1.0
    } else {
        evidence as f64 / full as f64
    }
}

/// The blend of a prior and a learned threshold, geometric (thresholds are scales:
/// halfway between 2 s and 8 s is 4 s): `prior^(1−w) × learned^w` for the learned
/// weight `w` ([`learned_weight`]). Without a prior the learned value alone (or none);
/// without a learned value the prior alone.
pub fn blend(prior: Option<Duration>, learned: Option<Duration>, w: f64) -> Option<Duration> {
    match (prior, learned) {
        (None, l) => l,
        (p, None) => p,
        (Some(p), Some(l)) => {
            let w = if w.is_nan() { 0.0 } else { w.clamp(0.0, 1.0) };
            if w >= 1.0 {
                return Some(l);
            }
            if w <= 0.0 {
                return Some(p);
            }
            let (p, l) = (secs(p), secs(l));
            Some(from_secs(p.powf(1.0 - w) * l.powf(w)))
        }
    }
}

/// Blends both thresholds of a leg with their priors ([`blend`], by the weights
/// `prior_bp` [`crate::latency::ScopeLatency::learned_among`] set), within the
/// trigger's bounds. Configured and `off` thresholds are left as they are.
pub fn blend_priors(t: &mut crate::hedge::Thresholds, auto: &crate::settings::HedgeSettings) {
    use crate::hedge::ThresholdOrigin as O;
    for (t, prior, bounds) in [
        (&mut t.after, auto.priors.after, auto.after_bounds),
        (&mut t.stall_after, auto.priors.stall, auto.stall_bounds),
    ] {
        if !matches!(t.origin, O::Source | O::Pooled | O::Prior) || prior.is_none() {
            continue;
        }
        let w = 1.0 - f64::from(t.prior_bp) / 10_000.0;
        t.value = blend(prior, t.value, w).map(|d| bounds.apply(d));
    }
}

/// How much longer than the scope's first-token prior one request's is: its prompt's
/// reading time ([`PREFILL_TOKENS_PER_S`]) added to the prior, times a factor for its
/// reasoning effort (none/minimal 1, low 1.5, medium 2, high 3, xhigh/max 4; unknown
/// values as medium). ≥ 1.
pub fn request_prior_factor(prior: Duration, prompt_tokens: u64, effort: Option<&str>) -> f64 {
    let base = secs(prior);
    if base <= 0.0 {
        return 1.0;
    }
    let reading = prompt_tokens as f64 / PREFILL_TOKENS_PER_S as f64;
    let effort = match effort.map(str::to_ascii_lowercase).as_deref() {
        None | Some("none") | Some("minimal") => 1.0,
        Some("low") => 1.5,
        Some("medium") => 2.0,
        Some("high") => 3.0,
        Some("xhigh") | Some("max") => 4.0,
        Some(_) => 2.0,
    };
    ((base + reading) / base * effort).max(1.0)
}

/// A threshold in force for one request: the source's (stabilized) threshold `base`,
/// whose prior part weighs `prior_weight` (1 − [`learned_weight`]), with that part
/// scaled by the request's `factor` ([`request_prior_factor`]): `base × factor^prior_weight`.
pub fn for_request(base: Duration, prior_weight: f64, factor: f64) -> Duration {
    let w = if prior_weight.is_nan() {
        0.0
    } else {
        prior_weight.clamp(0.0, 1.0)
    };
    if w == 0.0 || factor <= 1.0 || factor.is_nan() {
        return base;
    }
    from_secs(secs(base) * factor.powf(w))
}

/// A threshold in force as it last was (SPEC §25.2): the next one is the target moved at
/// most `MAX_CHANGE^(elapsed / window)` from it, so it changes by at most ×1.5 within
/// any window, however the evidence swings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Steady {
    /// When it was set.
    pub at: Instant,
    /// Its value.
    pub value: Duration,
}

impl Steady {
    /// The threshold in force at `now` for a `target` (the blend the evidence asks
    /// for), from `prev` (none: the target as it is), and the state to keep. A clock
    /// that went back allows no change.
    pub fn next(prev: Option<Steady>, target: Duration, now: Instant, window: Duration) -> Steady {
        let Some(prev) = prev else {
            return Steady {
                at: now,
                value: target,
            };
        };
        let elapsed = now.saturating_duration_since(prev.at);
        let (lo, hi) = allowed(prev.value, elapsed, window);
        // Every reading restarts the allowance from the value it leaves: the allowances
        // multiply, so over any interval the moves compound to at most
        // `MAX_CHANGE^(interval / window)` (a value held at its limit still moves on as
        // the window passes, one reading at a time).
        Steady {
            at: now.max(prev.at),
            value: target.clamp(lo, hi),
        }
    }
}

/// The range a threshold `from` may move to after `elapsed`: `[from ÷ r, from × r]` with
/// `r = MAX_CHANGE^(elapsed / window)`, rounded inward to whole nanoseconds.
pub fn allowed(from: Duration, elapsed: Duration, window: Duration) -> (Duration, Duration) {
    if window.is_zero() {
        return (Duration::ZERO, Duration::MAX);
    }
    let r = MAX_CHANGE.powf(secs(elapsed) / secs(window));
    if !r.is_finite() {
        return (Duration::ZERO, Duration::MAX);
    }
    let f = from.as_nanos() as f64;
    let lo = (f / r).ceil();
    let hi = (f * r).floor();
    let nanos = |x: f64| -> Duration {
        if x >= u64::MAX as f64 {
            Duration::from_nanos(u64::MAX)
        } else {
            Duration::from_nanos(x.max(0.0) as u64)
        }
    };
    (nanos(lo).min(from), nanos(hi).max(from))
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn from_secs(s: f64) -> Duration {
    if !s.is_finite() || s <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(x: f64) -> Duration {
        Duration::from_secs_f64(x)
    }

    #[test]
    fn without_evidence_the_prior_alone_and_with_full_evidence_the_learned_value_alone() {
        assert_eq!(learned_weight(false, 10_000, 50), 0.0);
        assert_eq!(learned_weight(true, 0, 50), 0.0);
        assert_eq!(learned_weight(true, 50, 50), 0.25);
        assert_eq!(learned_weight(true, 100, 50), 0.5);
        assert_eq!(learned_weight(true, 200, 50), 1.0);
        assert_eq!(learned_weight(true, 5_000, 50), 1.0);
        assert_eq!(blend(Some(s(10.0)), None, 0.7), Some(s(10.0)));
        assert_eq!(blend(None, Some(s(3.0)), 0.0), Some(s(3.0)));
        assert_eq!(blend(None, None, 0.5), None);
        assert_eq!(blend(Some(s(10.0)), Some(s(3.0)), 1.0), Some(s(3.0)));
        assert_eq!(blend(Some(s(10.0)), Some(s(3.0)), 0.0), Some(s(10.0)));
        // Geometric: halfway between 2 s and 8 s is 4 s.
        let mid = blend(Some(s(2.0)), Some(s(8.0)), 0.5).unwrap();
        assert!((mid.as_secs_f64() - 4.0).abs() < 1e-6, "{mid:?}");
    }

    #[test]
    fn a_long_prompt_or_a_high_effort_is_not_slow_at_the_plain_prior() {
        let p = DEFAULT_AFTER_PRIOR;
        assert_eq!(request_prior_factor(p, 0, None), 1.0);
        // 100k tokens read at 5k/s: 15 s + 20 s.
        let f = request_prior_factor(p, 100_000, None);
        assert!((f - 35.0 / 15.0).abs() < 1e-9, "{f}");
        assert_eq!(request_prior_factor(p, 0, Some("high")), 3.0);
        assert_eq!(request_prior_factor(p, 0, Some("HIGH")), 3.0);
        assert_eq!(request_prior_factor(p, 0, Some("minimal")), 1.0);
        assert_eq!(request_prior_factor(p, 0, Some("something-new")), 2.0);
        // Prior alone: scaled fully; learned alone: not at all.
        assert_eq!(for_request(s(15.0), 1.0, 3.0), s(45.0));
        assert_eq!(for_request(s(4.0), 0.0, 3.0), s(4.0));
        let half = for_request(s(10.0), 0.5, 4.0);
        assert!((half.as_secs_f64() - 20.0).abs() < 1e-6, "{half:?}");
    }

    #[test]
    fn a_steady_threshold_moves_at_most_one_and_a_half_times_per_window() {
        #[allow(clippy::disallowed_methods)]
        let t0 = Instant::now();
        let w = s(600.0);
        let a = Steady::next(None, s(10.0), t0, w);
        assert_eq!(a.value, s(10.0));
        // A target 4× lower, one window later: down by 1.5 only.
        let b = Steady::next(Some(a), s(2.5), t0 + w, w);
        assert!(
            (b.value.as_secs_f64() - 10.0 / 1.5).abs() < 1e-6,
            "{:?}",
            b.value
        );
        // At once again: no further move.
        let c = Steady::next(Some(b), s(2.5), t0 + w, w);
        assert_eq!(c.value, b.value);
        // Within reach (×1.05 needs 72 s of a 600 s window): the target itself.
        let d = Steady::next(Some(c), s(7.0), t0 + w + s(120.0), w);
        assert_eq!(d.value, s(7.0));
        // A reading every second while held at the limit still accrues the allowance.
        let mut st = Steady::next(None, s(10.0), t0, w);
        for k in 1..=600u64 {
            st = Steady::next(Some(st), s(100.0), t0 + Duration::from_secs(k), w);
        }
        assert!(
            (st.value.as_secs_f64() - 15.0).abs() < 1e-3,
            "{:?}",
            st.value
        );
    }

    proptest! {
        /// The prior's influence decreases as evidence grows: the learned weight never
        /// falls with more evidence, and the blend never moves away from the learned
        /// value.
        #[test]
        fn the_prior_weighs_less_as_evidence_grows(
            prior_ms in 1u64..120_000,
            learned_ms in 1u64..120_000,
            n in 0u64..2_000,
            more in 0u64..2_000,
            min_samples in 1u64..200,
        ) {
            let (p, l) = (Duration::from_millis(prior_ms), Duration::from_millis(learned_ms));
            let w1 = learned_weight(true, n, min_samples);
            let w2 = learned_weight(true, n + more, min_samples);
            prop_assert!(w2 >= w1);
            let b1 = blend(Some(p), Some(l), w1).unwrap();
            let b2 = blend(Some(p), Some(l), w2).unwrap();
            let dist = |b: Duration| (b.as_secs_f64().ln() - l.as_secs_f64().ln()).abs();
            prop_assert!(dist(b2) <= dist(b1) + 1e-9, "{b1:?} then {b2:?} for learned {l:?}");
            // Between the two.
            let (lo, hi) = (p.min(l), p.max(l));
            prop_assert!(b1 + Duration::from_micros(1) >= lo && b1 <= hi + Duration::from_micros(1));
            if n + more >= FULL_EVIDENCE * min_samples {
                prop_assert_eq!(b2, l);
            }
        }

        /// The passage from the prior to the learned value follows the evidence one
        /// leg at a time (DECISIONS 169): one more leg moves the blend by at most
        /// `(max ÷ min)^(1 ÷ (FULL_EVIDENCE × min_samples))` — never a swing from one
        /// call to the next.
        #[test]
        fn one_leg_moves_the_blend_by_a_sliver(
            prior_ms in 1u64..120_000,
            learned_ms in 1u64..120_000,
            n in 0u64..1_000,
            min_samples in 1u64..200,
        ) {
            let (p, l) = (Duration::from_millis(prior_ms), Duration::from_millis(learned_ms));
            let at = |n| blend(Some(p), Some(l), learned_weight(n >= min_samples, n, min_samples)).unwrap();
            let (a, b) = (at(n).as_secs_f64(), at(n + 1).as_secs_f64());
            let ratio = a.max(b) / a.min(b);
            let span = p.as_secs_f64().max(l.as_secs_f64()) / p.as_secs_f64().min(l.as_secs_f64());
            let full = (FULL_EVIDENCE * min_samples) as f64;
            // The step where the learned value first counts weighs min_samples legs.
            let legs = if n + 1 == min_samples { min_samples as f64 } else { 1.0 };
            // Each blend is a Duration, rounded to the nanosecond: up to 1 ns of the
            // ratio's slack is rounding, not movement.
            let rounding = 1e-9 / a.min(b);
            prop_assert!(
                ratio <= span.powf(legs / full) * (1.0 + 1e-9) + rounding,
                "{a} → {b}: ×{ratio}"
            );
        }

        /// SPEC §25.2: whatever the targets and the times they come at, a steady
        /// threshold changes over any interval `d` by at most `1.5^(d / window)`.
        #[test]
        fn a_steady_threshold_never_moves_faster_than_allowed(
            start_ms in 1u64..100_000,
            steps in proptest::collection::vec((0u64..120_000, 1u64..200_000), 1..60),
            window_s in 10u64..1_000,
        ) {
            #[allow(clippy::disallowed_methods)]
            let t0 = Instant::now();
            let w = Duration::from_secs(window_s);
            let mut at = t0;
            let mut st = Steady::next(None, Duration::from_millis(start_ms), t0, w);
            let mut seen = vec![(t0, st.value)];
            for (dt, target) in steps {
                at += Duration::from_millis(dt);
                st = Steady::next(Some(st), Duration::from_millis(target), at, w);
                seen.push((at, st.value));
            }
            for (i, &(ti, vi)) in seen.iter().enumerate() {
                for &(tj, vj) in &seen[i + 1..] {
                    let r = MAX_CHANGE.powf((tj - ti).as_secs_f64() / w.as_secs_f64());
                    let ratio = vj.as_secs_f64().max(vi.as_secs_f64()) / vj.as_secs_f64().min(vi.as_secs_f64());
                    prop_assert!(ratio <= r * (1.0 + 1e-9) + 1e-9, "{vi:?} → {vj:?} in {:?}: ×{ratio} > ×{r}", tj - ti);
                }
            }
        }
    }
}
