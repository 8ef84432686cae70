//! Hedging decisions (SPEC §7, §19), pure: the policy that applies to a request
//! ([`HedgePolicy`]), the thresholds in force (`off`, static or `auto` from the live
//! distributions of [`crate::latency`]: [`threshold_in_force`], over [`HedgeSettings`]), whether
//! the scope's hedge budget allows an extra leg ([`HedgeBudget`], a token bucket with a
//! burst), and what a round whose legs all failed counts as ([`combine_failures`]). When
//! triggers fire and which leg wins is the round state machine's ([`crate::round`]).
//!
//! Triggers, per running leg, each firing at most once:
//! - first token (`HEDGE__AFTER_S`): the leg has produced no incremental chunk (plain:
//!   has not returned) `after` after its launch;
//! - stall (`HEDGE__STALL_AFTER_S`, streams only): the leg's gap since its last
//!   incremental chunk reaches `stall_after` (re-armed by its next chunk).
//!
//! A trigger launches at most one extra leg; a new extra leg needs a new trigger.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{AttemptError, ErrorClass};
use crate::latency::{LatencySketch, LatencySnapshot, Tail};
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
    /// The policy of a request's static thresholds (`auto` ones are per source: see
    /// [`HedgePolicy::with_thresholds`]): the stall trigger only applies to streams, so a
    /// plain request with only `STALL_AFTER_S` set is exactly unhedged.
    pub fn for_request(h: &HedgeSettings, stream: bool) -> Self {
        HedgePolicy {
            after: h.after.static_value(),
            stall_after: if stream {
                h.stall_after.static_value()
            } else {
                None
            },
            max_extra: h.max_extra,
        }
    }

    /// The policy for a request from the thresholds in force for its leg (see
    /// [`crate::latency::ScopeLatency::thresholds`]): the stall trigger only for streams.
    pub fn with_thresholds(t: &Thresholds, max_extra: u32, stream: bool) -> Self {
        HedgePolicy {
            after: t.after.value,
            stall_after: if stream { t.stall_after.value } else { None },
            max_extra,
        }
    }

    /// Whether any trigger can fire.
    pub fn enabled(&self) -> bool {
        self.max_extra > 0 && (self.after.is_some() || self.stall_after.is_some())
    }
}

/// Default `HEDGE__BUDGET_PCT` for a scope that hedges by default (SPEC §19.3).
pub const DEFAULT_BUDGET_PCT: u32 = 10;

/// Default `HEDGE__BURST`: extra legs a quiet scope can spend back to back.
pub const DEFAULT_BURST: u32 = 3;

/// Default `HEDGE__MIN_SAMPLES`.
pub const DEFAULT_MIN_SAMPLES: u64 = 50;

/// Default bounds of the `auto` first-token threshold: 0.5 s to 60 s.
pub const DEFAULT_AFTER_BOUNDS: Bounds = Bounds {
    min: Duration::from_millis(500),
    max: Duration::from_secs(60),
};

/// Default bounds of the `auto` stall threshold: 1 s to 60 s (an ordinary gap between
/// chunks is tens of ms; a hedge earlier than 1 s into a gap rarely beats the wait).
pub const DEFAULT_STALL_BOUNDS: Bounds = Bounds {
    min: Duration::from_secs(1),
    max: Duration::from_secs(60),
};

/// `HEDGE__AFTER_S` / `HEDGE__STALL_AFTER_S` (SPEC §19.1): off, a static threshold, or
/// `auto` (from the live distributions). Serializes as `"off"`, seconds, or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThresholdSetting {
    /// The trigger never fires.
    Off,
    /// A configured threshold: wins over the distributions.
    Static(Duration),
    /// The quantile the budget allows ([`auto_threshold`]).
    #[default]
    Auto,
}

impl ThresholdSetting {
    /// The configured threshold of a `Static` setting.
    pub fn static_value(self) -> Option<Duration> {
        match self {
            ThresholdSetting::Static(d) => Some(d),
            _ => None,
        }
    }
}

impl Serialize for ThresholdSetting {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ThresholdSetting::Off => s.serialize_str("off"),
            ThresholdSetting::Static(d) => s.serialize_f64(d.as_secs_f64()),
            ThresholdSetting::Auto => s.serialize_str("auto"),
        }
    }
}

/// Bounds of an `auto` threshold (`HEDGE__MIN_S` / `HEDGE__MAX_S`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Bounds {
    /// Never earlier than this.
    #[serde(with = "crate::durations::secs")]
    pub min: Duration,
    /// Never later than this (wins if below `min`).
    #[serde(with = "crate::durations::secs")]
    pub max: Duration,
}

impl Bounds {
    /// `d` within the bounds.
    pub fn apply(&self, d: Duration) -> Duration {
        d.max(self.min).min(self.max)
    }
}

/// The hedge settings a scope runs with (SPEC §19.3): `auto` is off where it cannot
/// fire — a scope that is not a chat scope, or one with a single source (no other
/// source to take a leg). A static threshold stays (with one source it hedges to the
/// same source again).
pub fn effective(mut h: HedgeSettings, chat: bool, sources: usize) -> HedgeSettings {
    if !chat || sources < 2 {
        for t in [&mut h.after, &mut h.stall_after] {
            if *t == ThresholdSetting::Auto {
                *t = ThresholdSetting::Off;
            }
        }
    }
    h
}

/// One line saying how a scope hedges (`polygw config check`, the startup log).
pub fn describe(h: &HedgeSettings, chat: bool, sources: usize) -> String {
    let e = effective(*h, chat, sources);
    let show = |t: ThresholdSetting| match t {
        ThresholdSetting::Off => "off".to_string(),
        ThresholdSetting::Auto => "auto".to_string(),
        ThresholdSetting::Static(d) => format!("{} s", d.as_secs_f64()),
    };
    if !e.enabled() {
        let why = if !chat {
            "hedging is chat-only"
        } else if sources < 2 && h.uses_auto() {
            "auto needs a second source"
        } else {
            "HEDGE__AFTER_S and HEDGE__STALL_AFTER_S are off"
        };
        return format!("hedging: off ({why})");
    }
    let budget = if e.budget_pct == 0 {
        "no budget cap".to_string()
    } else {
        format!(
            "budget {} % of calls, burst {}, banks {} s of calls",
            e.budget_pct,
            e.burst,
            e.bank.as_secs_f64()
        )
    };
    let auto = if e.uses_auto() {
        let prior = |p: Option<std::time::Duration>| {
            p.map_or("none".to_string(), |d| format!("{} s", d.as_secs_f64()))
        };
        format!(
            "; auto from each upstream's last {} s once it has {} samples (the scope's pool before), \
             starting from priors (first token {} for streams, stall {}) that give way over {} legs, \
             first token within {}–{} s, stalls within {}–{} s",
            e.window.as_secs(),
            e.min_samples,
            prior(e.priors.after),
            prior(e.priors.stall),
            crate::threshold::FULL_EVIDENCE.saturating_mul(e.min_samples),
            e.after_bounds.min.as_secs_f64(),
            e.after_bounds.max.as_secs_f64(),
            e.stall_bounds.min.as_secs_f64(),
            e.stall_bounds.max.as_secs_f64()
        )
    } else {
        String::new()
    };
    format!(
        "hedging: first token {}, stalls {}, up to {} extra leg(s), {budget}{auto}",
        show(e.after),
        show(e.stall_after),
        e.max_extra
    )
}

/// Where a threshold in force comes from (for the decision trace, SPEC §19.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ThresholdOrigin {
    /// The trigger is off.
    Off,
    /// A static threshold from the configuration.
    Configured,
    /// `auto`, from the source's own distribution.
    Source,
    /// `auto`, from the scope's pooled distribution (the source has too few samples).
    Pooled,
    /// `auto`, but not even the pool has enough samples yet: no hedge.
    NotYet,
    /// `auto`, from the prior alone (`HEDGE__AFTER_PRIOR_S` / `HEDGE__STALL_PRIOR_S`):
    /// no distribution has enough samples yet (SPEC §25.1).
    Prior,
}

/// A threshold in force and its origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ThresholdInForce {
    /// The threshold (`None`: the trigger does not fire).
    #[serde(rename = "ms", serialize_with = "opt_ms")]
    pub value: Option<Duration>,
    /// Where it comes from.
    pub origin: ThresholdOrigin,
    /// The prior's weight in the value, basis points (0: none; 10 000: the prior alone;
    /// see [`crate::threshold`]).
    #[serde(skip_serializing_if = "is_zero")]
    pub prior_bp: u16,
}

fn is_zero(x: &u16) -> bool {
    *x == 0
}

fn opt_ms<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&(d.as_millis() as u64)),
        None => s.serialize_none(),
    }
}

/// Both thresholds in force for a leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Thresholds {
    /// First-token threshold.
    pub after: ThresholdInForce,
    /// Stall threshold.
    pub stall_after: ThresholdInForce,
}

/// The `auto` threshold of one distribution: the quantile at which about `budget_pct` %
/// of legs trigger, within `bounds`; `None` for an empty sketch.
///
/// A leg triggers once per sample above the threshold, so with `g` samples per leg
/// ([`LatencySketch::samples_per_leg`]: 1 for TTFT; for gaps 1 as the engine records
/// them — each streamed leg's longest — and below 1 when some legs had no gap) the
/// quantile is `1 − (budget_pct / 100) / g`: about `BUDGET_PCT` % of legs trigger.
/// `budget_pct` 0 gives the largest value seen (then `bounds.max` caps it).
pub fn auto_threshold(sketch: &LatencySketch, budget_pct: u32, bounds: Bounds) -> Option<Duration> {
    auto_threshold_bp(sketch, budget_pct.saturating_mul(100), bounds)
}

/// [`auto_threshold`] for a budget in basis points (hundredths of a percent).
pub fn auto_threshold_bp(
    sketch: &LatencySketch,
    budget_bp: u32,
    bounds: Bounds,
) -> Option<Duration> {
    let share = f64::from(budget_bp) / 10_000.0 / sketch.samples_per_leg();
    sketch.quantile(1.0 - share).map(|d| bounds.apply(d))
}

/// The threshold in force (SPEC §19.1): a configured one wins; `auto` uses the source's
/// distribution once it has `min_samples` ([`LatencySketch::evidence`]), else the scope's
/// pooled one once that has as many, else none (no hedge yet).
pub fn threshold_in_force(
    setting: ThresholdSetting,
    source: &LatencySketch,
    pool: &LatencySketch,
    budget_bp: u32,
    bounds: Bounds,
    min_samples: u64,
) -> ThresholdInForce {
    let (value, origin) = match setting {
        ThresholdSetting::Off => (None, ThresholdOrigin::Off),
        ThresholdSetting::Static(d) => (Some(d), ThresholdOrigin::Configured),
        ThresholdSetting::Auto => {
            let from = |s: &LatencySketch, origin| {
                (s.evidence() >= min_samples)
                    .then(|| auto_threshold_bp(s, budget_bp, bounds))
                    .flatten()
                    .map(|d| (Some(d), origin))
            };
            from(source, ThresholdOrigin::Source)
                .or_else(|| from(pool, ThresholdOrigin::Pooled))
                .unwrap_or((None, ThresholdOrigin::NotYet))
        }
    };
    ThresholdInForce {
        value,
        origin,
        prior_bp: 0,
    }
}

/// How much of its expected saving an `auto` threshold gives up to spend less: from the
/// threshold the budget allows, [`knee`] moves to the latest one that saves at most this
/// share less.
pub const KNEE_SLACK: f64 = 0.03;

/// The deciles of a first-token distribution: the new leg's own wait `Y` in a saving
/// `E[(X − T − Y)⁺]` (ten points; none without a distribution).
fn deciles(ttft: Option<&LatencySketch>) -> Vec<Duration> {
    let qs: Vec<f64> = (0..10).map(|i| (f64::from(i) + 0.5) / 10.0).collect();
    ttft.map(|t| t.quantiles(&qs)).unwrap_or_default()
}

/// The waiting a trigger at `t` saves per sample of a distribution (its
/// [`LatencySketch::tail`]), ms: `E[(X − t − Y)⁺]` over the points `y` of the new leg's
/// own wait (`Y` = 0 without them).
fn saving(tail: &Tail, t: Duration, y: &[Duration]) -> f64 {
    if y.is_empty() {
        return tail.excess_ms(t);
    }
    let e: f64 = y.iter().map(|&y| tail.excess_ms(t + y)).sum();
    e / y.len() as f64
}

/// The cheapest threshold worth as much as `t` (SPEC §19.1, DECISIONS 162): the latest
/// threshold in `t..=max` whose saving (`E[(X − T − Y)⁺]`, `y` the new leg's own wait)
/// is at least `1 − KNEE_SLACK` of `t`'s. Where the distribution is flat above `t` — a
/// gap between short pauses and long stalls, say — firing later rescues the same
/// samples and spends less (a threshold in the short pauses' tail fires on pauses that
/// end before the new leg could help); where it is steep it moves by a fraction of a
/// second. Never below `t`, never above `max`; found to within 0.5 % (a sketch's bins
/// are 1 % wide).
pub fn knee(sk: &LatencySketch, t: Duration, y: &[Duration], max: Duration) -> Duration {
    if t >= max {
        return t;
    }
    let tail = sk.tail();
    let want = saving(&tail, t, y) * (1.0 - KNEE_SLACK);
    if want <= 0.0 {
        return t;
    }
    if saving(&tail, max, y) >= want {
        return max;
    }
    // saving(lo) ≥ want > saving(hi); the saving falls as the threshold rises.
    let (mut lo, mut hi) = (t, max);
    while (hi - lo) * 200 > lo.max(Duration::from_millis(1)) {
        let mid = lo + (hi - lo) / 2;
        if saving(&tail, mid, y) >= want {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Duration::from_millis(lo.as_millis() as u64).max(t)
}

/// How many more legs than the budget's threshold an [`earlier`] one may fire on: at
/// most `1 + EARLIER_SPEND` times as many, and never below the quantile of
/// `1 + EARLIER_SPEND` times the share. With the aim at 80 % of the budget while the
/// bucket drains ([`aim_bp`]), `0.8 × 1.2` < 1: an earlier threshold never spends the
/// bucket faster than it refills.
pub const EARLIER_SPEND: f64 = 0.2;

/// The earliest threshold worth its extra legs (SPEC §19.1, DECISIONS 166): from `t`,
/// the threshold the budget allows, an earlier `T` fires on more legs (`P(X > T)`
/// instead of `P(X > t)`) and saves more waiting (`E[(X − T − Y)⁺]`). `T` is taken when
/// what it adds is worth its legs at the rate of `t`'s own — the saving less `λ` per
/// leg, `λ` = `t`'s saving per leg it fires on — is highest and more than
/// [`KNEE_SLACK`] of `t`'s saving (what the knee gives up the other way), among thresholds firing on
/// at most `1 + EARLIER_SPEND` times `t`'s legs, never below `floor` (the caller's: the
/// quantile of `1 + EARLIER_SPEND` times the share, within the bounds).
///
/// Where `t` sits on a flat stretch of the distribution (nothing between short pauses
/// and long stalls), a share of legs a little below the stalls' own puts the quantile
/// tens of seconds into the stalls: one more leg in twenty brings the threshold back to
/// the stalls' start, and every stall is rescued that much sooner. On a smooth tail the
/// legs an earlier threshold adds are worth less than the average leg at `t` (they end
/// sooner), and `t` stays. Never above `t`; `t` itself when nothing is worth more.
pub fn earlier(sk: &LatencySketch, t: Duration, y: &[Duration], floor: Duration) -> Duration {
    let tail = sk.tail();
    let fires = tail.survival(t);
    let saves = saving(&tail, t, y);
    if fires <= 0.0 || saves <= 0.0 || t <= floor {
        return t;
    }
    let rate = saves / fires;
    let most = fires * (1.0 + EARLIER_SPEND);
    // Between two values that carry mass the legs fired on stay the same and the saving
    // falls: each value (ms) is the best threshold of its step.
    let (lo, hi) = (floor.as_secs_f64() * 1000.0, t.as_secs_f64() * 1000.0);
    let mut best = (0.0f64, t);
    let points: Vec<f64> = tail.points().filter(|&v| v >= lo && v < hi).collect();
    for &v in points.iter().rev() {
        let at = Duration::from_millis(v.ceil() as u64).max(floor);
        let f = tail.survival(at);
        if f > most {
            break;
        }
        let gain = (saving(&tail, at, y) - saves) - rate * (f - fires);
        // Worth moving for: more than the knee gives up the other way.
        if gain > best.0.max(saves * KNEE_SLACK) {
            best = (gain, at);
        }
    }
    best.1
}

/// An `auto` threshold from a distribution and the share of legs it may fire on (basis
/// points): the quantile that share allows ([`auto_threshold_bp`]), moved
/// [`earlier`] back across a flat stretch, then to the [`knee`]. It stays within the
/// quantiles of `1 + EARLIER_SPEND` times the share and of half the share (the knee
/// trades at most half of the legs: on a sparse tail the saving's last mass sits at the
/// highest value seen, a lower bound, and the knee would chase it), within `bounds`;
/// `None` for an empty distribution. The quantile is monotone in the share; this is
/// too wherever the windows of two shares do not overlap (one share at least
/// `2 × (1 + EARLIER_SPEND)` times the other) — closer shares may pick either way
/// inside their windows (DECISIONS 166).
pub fn auto_in_force(
    sk: &LatencySketch,
    share_bp: u32,
    y: &[Duration],
    bounds: Bounds,
) -> Option<Duration> {
    let t = auto_threshold_bp(sk, share_bp, bounds)?;
    let wider = (f64::from(share_bp) * (1.0 + EARLIER_SPEND)).round() as u32;
    let floor = auto_threshold_bp(sk, wider, bounds).unwrap_or(bounds.min);
    let limit = auto_threshold_bp(sk, share_bp / 2, bounds).unwrap_or(bounds.max);
    Some(knee(sk, earlier(sk, t, y, floor), y, limit))
}

/// How many parts of the budget [`split_budget`] weighs (steps of a tenth).
pub const SPLIT_STEPS: u32 = 10;

/// The distribution an `auto` threshold is read from: the source's once it has
/// `min_samples`, else the pool's once that has as many, else none.
fn evidence_of<'a>(
    source: &'a LatencySketch,
    pool: &'a LatencySketch,
    min_samples: u64,
) -> Option<&'a LatencySketch> {
    [source, pool]
        .into_iter()
        .find(|s| s.evidence() >= min_samples && !s.is_empty())
}

/// How both `auto` triggers share the budget (basis points each; they add up to
/// `budget_bp`): the split, among [`SPLIT_STEPS`] + 1 candidates, that saves the most
/// expected waiting per call. A trigger at threshold `T` saves about `E[(X − T − Y)⁺]`
/// per sample `X` it fires on — the wait beyond `T`, less `Y`, the new leg's own first
/// token (a resume leg, too, must reach its first token), drawn from the first-token
/// distribution — times the samples per call (gaps: [`LatencySketch::samples_per_leg`]). So a workload whose tail is long
/// stalls gives the stall trigger the budget, one whose tail is slow first tokens gives
/// it to the first-token trigger, and a mixed one splits it. Among splits that save as
/// much (within 1 ms), the one that gives the most to the trigger saving more; without
/// evidence for both, or with nothing to save, half each.
///
/// Pure: the same sketches give the same split, whatever order they were merged in.
pub fn split_budget(
    auto: &HedgeSettings,
    ttft: Option<&LatencySketch>,
    gap: Option<&LatencySketch>,
    budget_bp: u32,
) -> (u32, u32) {
    let half = budget_bp / 2;
    let even = (budget_bp - half, half);
    let (Some(ttft), Some(gap)) = (ttft, gap) else {
        return even;
    };
    if budget_bp == 0 {
        return (0, 0);
    }
    // The new leg's own first token, by its deciles (the saving is `E[(X − T − Y)⁺]`
    // over independent `X` and `Y`: ten points of `Y` are enough for a split in tenths).
    let y = deciles(Some(ttft));
    let saved = |sk: &LatencySketch, bp: u32, bounds: Bounds| -> f64 {
        if bp == 0 || y.is_empty() {
            return 0.0;
        }
        let Some(t) = auto_threshold_bp(sk, bp, bounds) else {
            return 0.0;
        };
        saving(&sk.tail(), t, &y) * sk.samples_per_leg()
    };
    // (saving, first-token part, its saving, the stall part's saving) per candidate.
    let candidates: Vec<(f64, u32, f64, f64)> = (0..=SPLIT_STEPS)
        .map(|k| {
            let ft = (u64::from(budget_bp) * u64::from(k) / u64::from(SPLIT_STEPS)) as u32;
            let (a, b) = (
                saved(ttft, ft, auto.after_bounds),
                saved(gap, budget_bp - ft, auto.stall_bounds),
            );
            (a + b, ft, a, b)
        })
        .collect();
    let top = candidates.iter().map(|c| c.0).fold(0.0f64, f64::max);
    if top <= 0.0 {
        return even;
    }
    // Within a millisecond of the best, the split that gives the most to the trigger
    // that saves more (a threshold held at its bound saves no more with a bigger part,
    // and a part that saves nothing would only spend the shared bucket).
    let tied = candidates.iter().filter(|c| c.0 >= top - 1.0);
    let stall_saves_more = candidates
        .iter()
        .find(|c| c.0 >= top - 1.0)
        .is_some_and(|c| c.3 >= c.2);
    let pick = if stall_saves_more {
        tied.min_by_key(|c| c.1)
    } else {
        tied.max_by_key(|c| c.1)
    };
    pick.map_or(even, |c| (c.1, budget_bp - c.1))
}

/// The share of legs a trigger may fire on so that a round's extra legs stay within
/// `budget_bp` (basis points of calls): a leg launched by a trigger can itself trigger
/// the next (up to `max_extra` per round), so a per-leg share `p` costs about
/// `p + p² + … + p^max_extra` extra legs per call. The `p` that spends exactly the
/// budget, in basis points (bisection; monotone in the budget, never above it).
pub fn trigger_share_bp(budget_bp: u32, max_extra: u32) -> u32 {
    if budget_bp == 0 || max_extra <= 1 {
        return budget_bp;
    }
    let b = f64::from(budget_bp) / 10_000.0;
    let cost = |p: f64| (1..=max_extra).map(|k| p.powi(k as i32)).sum::<f64>();
    let (mut lo, mut hi) = (0.0f64, b.min(1.0));
    for _ in 0..50 {
        let mid = (lo + hi) / 2.0;
        if cost(mid) <= b {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    ((lo * 10_000.0).floor() as u32).min(budget_bp)
}

/// The share of calls the `auto` thresholds aim at, basis points, from the budget's and
/// how full its bucket is (`fill`: level ÷ capacity, 0..=1; DECISIONS 163): the whole
/// budget while the bucket is at least half full, down to 80 % of it as the bucket
/// empties. Aimed at exactly the budget, the triggers spend as fast as the calls refill
/// the bucket — a random walk that spends long stretches empty, and the triggers that
/// find it empty are the slow calls; a bucket that drains raises the thresholds until
/// the triggers spend less than the refill, so it stays off empty. Monotone in both.
pub fn aim_bp(budget_bp: u32, fill: f64) -> u32 {
    let fill = if fill.is_nan() {
        1.0
    } else {
        fill.clamp(0.0, 1.0)
    };
    let share = if fill >= 0.5 { 1.0 } else { 0.8 + 0.4 * fill };
    ((f64::from(budget_bp) * share).floor() as u32).min(budget_bp)
}

/// Both thresholds in force for a leg on a source, from its two distributions (`ttft`,
/// `gap`) and the scope's pool (see [`crate::latency::ScopeLatency::thresholds`]), for
/// a share of calls of `budget_bp` basis points.
pub fn thresholds(
    auto: &HedgeSettings,
    ttft: &LatencySketch,
    gap: &LatencySketch,
    pool: &LatencySnapshot,
    budget_bp: u32,
) -> Thresholds {
    // The triggers share the budget: with both `auto`, each gets the part of the share
    // of calls the budget allows where it saves the most waiting (`split_budget`), so
    // together they stay within it (a shared bucket drained by the first-token trigger
    // alone would leave stalls unrescued, and an even split starves the trigger that
    // carries the tail).
    let (after_bp, stall_bp) = match (auto.after, auto.stall_after) {
        (ThresholdSetting::Auto, ThresholdSetting::Auto) => split_budget(
            auto,
            evidence_of(ttft, &pool.ttft, auto.min_samples),
            evidence_of(gap, &pool.gap, auto.min_samples),
            budget_bp,
        ),
        _ => (budget_bp, budget_bp),
    };
    let (after_bp, stall_bp) = (
        trigger_share_bp(after_bp, auto.max_extra),
        trigger_share_bp(stall_bp, auto.max_extra),
    );
    // Each `auto` threshold, read from the distribution it came from, then moves
    // `earlier` and to the `knee` (`auto_in_force`); `Y` is the new leg's first token.
    let y = deciles(evidence_of(ttft, &pool.ttft, auto.min_samples));
    let cheapest = |mut t: ThresholdInForce,
                    own: &LatencySketch,
                    pooled: &LatencySketch,
                    share_bp: u32,
                    bounds: Bounds| {
        let from = match t.origin {
            ThresholdOrigin::Source => own,
            ThresholdOrigin::Pooled => pooled,
            _ => return t,
        };
        if t.value.is_some() {
            t.value = auto_in_force(from, share_bp, &y, bounds);
        }
        t
    };
    Thresholds {
        after: cheapest(
            threshold_in_force(
                auto.after,
                ttft,
                &pool.ttft,
                after_bp,
                auto.after_bounds,
                auto.min_samples,
            ),
            ttft,
            &pool.ttft,
            after_bp,
            auto.after_bounds,
        ),
        stall_after: cheapest(
            threshold_in_force(
                auto.stall_after,
                gap,
                &pool.gap,
                stall_bp,
                auto.stall_bounds,
                auto.min_samples,
            ),
            gap,
            &pool.gap,
            stall_bp,
            auto.stall_bounds,
        ),
    }
}

/// The scope's hedge budget (SPEC §19.1): a token bucket. Each call adds `BUDGET_PCT`/100
/// of a leg; each extra leg takes one. It starts with `HEDGE__BURST` legs and holds the
/// more of that burst and the budget of the calls of the last `HEDGE__BANK_S` (default
/// [`DEFAULT_BANK`]): a quiet scope can rescue `burst` consecutive stalls, and a busy one
/// banks what its last minute of calls allowed, so stalls that cluster in a minute are
/// each rescued at their threshold instead of waiting for the bucket to refill (a bucket
/// of 3 legs in front of a hundred streams runs dry whenever a few stall together, and
/// the stalls that find it empty are the tail the budget is for). Banked legs expire
/// with the calls that earned them. Over any run the extra legs stay within
/// `BUDGET_PCT` % of the calls plus the burst: the bank only keeps what the calls added.
/// `BUDGET_PCT` 0 = no cap (every leg is allowed and nothing is taken).
///
/// Exact: levels are counted in hundredths of a leg; calls are counted in
/// [`BANK_SLOTS`] slots of the bank (a call leaves the bank between 59/60 and 1 × the
/// bank after it started).
#[derive(Debug, Clone)]
pub struct HedgeBudget {
    /// The burst, hundredths of a leg.
    burst: u64,
    /// Available, hundredths of a leg (≤ the capacity in force).
    level: u64,
    /// The capacity at the last operation, hundredths of a leg.
    cap: u64,
    /// One slot of the bank (zero: no bank).
    slot: Duration,
    /// Calls per slot of the bank: (slot since `origin`, calls), oldest first, strictly
    /// increasing slots.
    recent: VecDeque<(u64, u64)>,
    /// The first instant seen.
    origin: Option<Instant>,
}

/// Default `HEDGE__BANK_S`: how long the budget of a call stays in the bank of a
/// [`HedgeBudget`].
pub const DEFAULT_BANK: Duration = Duration::from_secs(60);

/// Slots a [`HedgeBudget`]'s bank counts its calls in.
pub const BANK_SLOTS: u64 = 60;

/// One extra leg taken from a [`HedgeBudget`]; give it back with
/// [`HedgeBudget::give_back`] when the leg is not launched after all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a ticket not launched must be given back"]
pub struct BudgetTicket {
    /// Hundredths of a leg taken (0 under no cap).
    amount: u64,
}

/// One leg, in the bucket's units.
const LEG: u64 = 100;

impl Default for HedgeBudget {
    fn default() -> Self {
        Self::new()
    }
}

impl HedgeBudget {
    /// A full budget with the default burst and bank.
    pub fn new() -> Self {
        Self::banking(DEFAULT_BURST, DEFAULT_BANK)
    }

    /// A full budget holding `burst` legs (at least 1), with the default bank.
    pub fn with_burst(burst: u32) -> Self {
        Self::banking(burst, DEFAULT_BANK)
    }

    /// A full budget holding `burst` legs (at least 1) that banks the budget of the
    /// calls of the last `bank` (zero: none; the burst only).
    pub fn banking(burst: u32, bank: Duration) -> Self {
        let burst = u64::from(burst.max(1)) * LEG;
        HedgeBudget {
            burst,
            level: burst,
            cap: burst,
            slot: bank / BANK_SLOTS as u32,
            recent: VecDeque::new(),
            origin: None,
        }
    }

    /// The burst, in legs.
    pub fn burst(&self) -> u32 {
        (self.burst / LEG) as u32
    }

    /// Forgets the calls older than the bank at `now`; the slot `now` falls in (`None`
    /// without a bank).
    fn advance(&mut self, now: Instant) -> Option<u64> {
        if self.slot.is_zero() {
            return None;
        }
        let origin = *self.origin.get_or_insert(now);
        let at = (now.saturating_duration_since(origin).as_nanos() / self.slot.as_nanos())
            .try_into()
            .unwrap_or(u64::MAX);
        let at = self.recent.back().map_or(at, |&(last, _)| at.max(last));
        while self
            .recent
            .front()
            .is_some_and(|&(s, _)| s.saturating_add(BANK_SLOTS) <= at)
        {
            self.recent.pop_front();
        }
        Some(at)
    }

    /// The capacity in force: the more of the burst and `pct` % of a leg per call in the
    /// bank; the level above it expires.
    fn set_cap(&mut self, pct: u32) {
        let calls: u64 = self.recent.iter().map(|&(_, n)| n).sum();
        self.cap = self.burst.max(calls.saturating_mul(u64::from(pct)));
        self.level = self.level.min(self.cap);
    }

    /// A logical call started at `now`: it adds `pct` % of a leg.
    pub fn record_call(&mut self, now: Instant, pct: u32) {
        if let Some(at) = self.advance(now) {
            match self.recent.back_mut() {
                Some((s, n)) if *s == at => *n = n.saturating_add(1),
                _ => self.recent.push_back((at, 1)),
            }
        }
        self.set_cap(pct);
        self.level = self.level.saturating_add(u64::from(pct)).min(self.cap);
    }

    /// How full the bucket is at `now` with `pct`: level ÷ capacity (0..=1).
    pub fn fill(&mut self, now: Instant, pct: u32) -> f64 {
        self.advance(now);
        self.set_cap(pct);
        self.level as f64 / self.cap as f64
    }

    /// Legs available at `now` with `pct` (fractional).
    pub fn available(&mut self, now: Instant, pct: u32) -> f64 {
        self.advance(now);
        self.set_cap(pct);
        self.level as f64 / LEG as f64
    }

    /// Takes one extra leg if a whole one is available (`pct` 0 = no cap: always, and
    /// nothing is taken).
    pub fn try_take(&mut self, now: Instant, pct: u32) -> Option<BudgetTicket> {
        if pct == 0 {
            return Some(BudgetTicket { amount: 0 });
        }
        self.advance(now);
        self.set_cap(pct);
        if self.level < LEG {
            return None;
        }
        self.level -= LEG;
        Some(BudgetTicket { amount: LEG })
    }

    /// Gives back a leg taken by [`HedgeBudget::try_take`] that was not launched: the
    /// bucket is then exactly as if it had never been taken.
    pub fn give_back(&mut self, ticket: BudgetTicket) {
        self.level = self.level.saturating_add(ticket.amount).min(self.cap);
    }
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

    #[test]
    fn auto_is_off_where_it_cannot_fire_and_static_stays() {
        let d = HedgeSettings::default();
        assert!(effective(d, true, 2).enabled());
        assert!(!effective(d, true, 1).enabled(), "one source");
        assert!(!effective(d, false, 3).enabled(), "not chat");
        let st = HedgeSettings {
            after: ThresholdSetting::Static(Duration::from_secs(2)),
            ..d
        };
        let e = effective(st, true, 1);
        assert_eq!(e.after, ThresholdSetting::Static(Duration::from_secs(2)));
        assert_eq!(e.stall_after, ThresholdSetting::Off);
        assert!(describe(&d, true, 2).contains("first token auto, stalls auto"));
        assert!(describe(&d, true, 1).contains("auto needs a second source"));
        assert!(describe(&d, false, 2).contains("chat-only"));
        assert!(describe(&HedgeSettings::off(), true, 2).contains("are off"));
        assert!(describe(&st, true, 1).contains("first token 2 s, stalls off"));
        // Off by configuration with one source: off, not "auto needs a second source".
        let off = describe(&HedgeSettings::off(), true, 1);
        assert!(
            off.contains("are off") && !off.contains("second source"),
            "{off}"
        );
        // The budget's part: a cap, or none.
        assert!(describe(&d, true, 2).contains("budget 10 % of calls, burst 3"));
        assert!(
            describe(&d, true, 2).contains(
                "starting from priors (first token 15 s for streams, stall 10 s) that give way over 200 legs"
            ),
            "{}",
            describe(&d, true, 2)
        );
        let uncapped = HedgeSettings {
            budget_pct: 0,
            ..st
        };
        let line = describe(&uncapped, true, 2);
        assert!(
            line.contains("no budget cap") && !line.contains("% of calls"),
            "{line}"
        );
    }

    /// The new leg's wait `Y` is taken at the first-token distribution's ten deciles
    /// (the middle of each tenth), and a saving is the mean over them.
    #[test]
    fn the_saving_averages_over_the_deciles_of_the_new_legs_wait() {
        let mut u = LatencySketch::new();
        for i in 0..1000u64 {
            u.observe(ms(i * 10)); // 0..10 s, uniform
        }
        let d = deciles(Some(&u));
        assert_eq!(d.len(), 10);
        for (i, y) in d.iter().enumerate() {
            let mid = 500 + 1000 * i as u64;
            // (a sketch's bins are 1 % wide)
            let near = ms(mid / 100 + 20);
            assert!(
                y.abs_diff(ms(mid)) <= near,
                "decile {i}: {y:?}, not ≈ {mid} ms"
            );
        }
        assert!(deciles(None).is_empty());
        let tail = u.tail();
        let t = ms(2_000);
        assert_eq!(saving(&tail, t, &[]), tail.excess_ms(t));
        let y = [ms(1_000), ms(3_000)];
        let mean = (tail.excess_ms(ms(3_000)) + tail.excess_ms(ms(5_000))) / 2.0;
        assert!((saving(&tail, t, &y) - mean).abs() < 1e-9);
    }

    /// The knee stops at the quantile of half the share: on a tail whose saving sits
    /// in a few huge values it would otherwise chase them far past the waits it fires
    /// on (DECISIONS 162).
    #[test]
    fn the_knee_stops_at_the_quantile_of_half_the_share() {
        let mut g = LatencySketch::new();
        for i in 0..900u64 {
            g.observe(ms(100 + i % 7));
        }
        for i in 0..90u64 {
            g.observe(ms(1_000 + i * 22)); // 1–3 s
        }
        for _ in 0..10 {
            g.observe(ms(1_000_000));
        }
        g.add_legs(1000);
        let wide = Bounds {
            min: Duration::ZERO,
            max: Duration::from_secs(7200),
        };
        let t = auto_threshold_bp(&g, 1_000, wide).unwrap();
        let half = auto_threshold_bp(&g, 500, wide).unwrap();
        assert!(half < ms(3_000), "{half:?}");
        // Unbounded, the knee would go tens of seconds past every wait but the huge ones.
        assert!(knee(&g, t, &[], wide.max) > ms(10_000));
        let v = auto_in_force(&g, 1_000, &[], wide).unwrap();
        assert!(t <= v && v <= half, "{t:?} ≤ {v:?} ≤ {half:?}");
        // Where the knee has room below that quantile, it moves: past the pauses.
        let p = pauses_and_stalls();
        let v = auto_in_force(&p, 2_000, &[ms(1_600); 10], DEFAULT_STALL_BOUNDS).unwrap();
        assert!(v >= ms(5_000), "past the pauses: {v:?}");
    }

    /// A call's credit leaves the bank with its own slot: 100 calls at 0 s and 100 at
    /// 30 s bank 200 × the budget until a minute after the first, then the second
    /// hundred's alone.
    #[test]
    fn banked_calls_leave_with_their_own_slot() {
        let s = t0();
        let mut b = HedgeBudget::with_burst(1);
        for _ in 0..100 {
            b.record_call(s, 10);
        }
        for _ in 0..100 {
            b.record_call(s + Duration::from_secs(30), 10);
        }
        assert_eq!(b.available(s + Duration::from_secs(59), 10).round(), 20.0);
        let later = b.available(s + Duration::from_secs(61), 10);
        assert_eq!(
            later.round(),
            10.0,
            "the first hundred left the bank: {later}"
        );
        assert_eq!(b.available(s + Duration::from_secs(91), 10).round(), 1.0);
    }

    /// How full the bucket is: its level over its capacity.
    #[test]
    fn the_fill_is_the_level_over_the_capacity() {
        let s = t0();
        let mut b = HedgeBudget::with_burst(4);
        assert_eq!(b.fill(s, 10), 1.0);
        let t = b.try_take(s, 10).unwrap();
        assert_eq!(b.fill(s, 10), 0.75);
        b.give_back(t);
        for _ in 0..4 {
            let _ = b.try_take(s, 10).unwrap();
        }
        assert_eq!(b.fill(s, 10), 0.0);
    }

    /// A pooled threshold moves `earlier` and to the knee like a source's own.
    #[test]
    fn a_pooled_threshold_is_the_threshold_in_force_of_the_pool() {
        let auto = HedgeSettings {
            after: ThresholdSetting::Off,
            stall_after: ThresholdSetting::Auto,
            ..HedgeSettings::default()
        };
        let pool = LatencySnapshot {
            ttft: LatencySketch::new(),
            gap: pauses_and_stalls(),
        };
        let none = LatencySketch::new();
        let t = thresholds(&auto, &none, &none, &pool, 2_500);
        assert_eq!(t.stall_after.origin, ThresholdOrigin::Pooled);
        let share = trigger_share_bp(2_500, auto.max_extra);
        let want = auto_in_force(&pool.gap, share, &[], auto.stall_bounds);
        assert_eq!(t.stall_after.value, want);
        assert_ne!(
            want,
            auto_threshold_bp(&pool.gap, share, auto.stall_bounds),
            "it moved"
        );
    }

    /// The aim falls linearly from the budget at half full to 80 % of it at empty.
    #[test]
    fn the_aim_falls_linearly_below_half_full() {
        for (fill, want) in [(1.0, 10_000), (0.5, 10_000), (0.25, 9_000), (0.0, 8_000)] {
            assert_eq!(aim_bp(10_000, fill), want, "at {fill}");
        }
    }

    /// The per-leg share is the `p` with `p + p² + … + p^max_extra` = the budget, to a
    /// basis point (below it, never above): with two extra legs, `(√(1 + 4b) − 1) / 2`.
    #[test]
    fn the_trigger_share_solves_the_chain_of_extra_legs() {
        for (b, want) in [(2_500u32, 2_071u32), (1_000, 916), (500, 477)] {
            assert_eq!(trigger_share_bp(b, 2), want, "{b} bp");
            let x = f64::from(b) / 10_000.0;
            let exact = ((1.0 + 4.0 * x).sqrt() - 1.0) / 2.0 * 10_000.0;
            assert!((exact - f64::from(want)).abs() < 1.0, "{b}: {exact}");
        }
        // Three extra legs: p + p² + p³ = 0.25 at p ≈ 0.2056.
        let p = f64::from(trigger_share_bp(2_500, 3)) / 10_000.0;
        let cost = |p: f64| p + p * p + p * p * p;
        assert!(cost(p) <= 0.25 && cost(p + 0.0001) > 0.25, "{p}");
        assert_eq!(trigger_share_bp(2_500, 1), 2_500);
        assert_eq!(trigger_share_bp(0, 2), 0);
    }

    /// The distribution the split and the new leg's wait are read from: the source's
    /// once it has the evidence, else the pool's, never an empty one.
    #[test]
    fn evidence_comes_from_the_source_then_the_pool() {
        let filled = |n: u64| {
            let mut s = LatencySketch::new();
            for i in 0..n {
                s.observe(ms(100 + i));
            }
            s.add_legs(n);
            s
        };
        let (few, many, none) = (filled(3), filled(60), LatencySketch::new());
        let is = |got: Option<&LatencySketch>, want: &LatencySketch| {
            got.is_some_and(|g| std::ptr::eq(g, want))
        };
        assert!(is(evidence_of(&many, &few, 50), &many));
        assert!(is(evidence_of(&few, &many, 50), &many), "too few: the pool");
        assert!(evidence_of(&few, &few, 50).is_none());
        assert!(is(evidence_of(&none, &few, 0), &few), "never an empty one");
        assert!(evidence_of(&none, &none, 0).is_none());
    }

    /// A threshold that saves nothing (the new leg's wait is longer than any wait
    /// beyond it) stays where it is, even where an earlier one would save something:
    /// there is no rate of its own to weigh the earlier legs at.
    #[test]
    fn a_threshold_that_saves_nothing_stays() {
        let mut g = LatencySketch::new();
        for (v, n) in [(100, 83), (4_000, 2), (10_000, 15)] {
            for _ in 0..n {
                g.observe(ms(v));
            }
        }
        g.add_legs(100);
        let (t, y) = (ms(4_500), [ms(6_000)]);
        let tail = g.tail();
        assert!(tail.survival(t) > 0.0);
        assert_eq!(saving(&tail, t, &y), 0.0);
        assert!(
            saving(&tail, ms(100), &y) > 0.0,
            "an earlier one would save"
        );
        assert!(tail.survival(ms(100)) <= tail.survival(t) * (1.0 + EARLIER_SPEND));
        assert_eq!(earlier(&g, t, &y, Duration::ZERO), t);
    }

    /// A policy fires only with a trigger and room for an extra leg.
    #[test]
    fn a_policy_needs_a_trigger_and_an_extra_leg() {
        let p = |after: Option<Duration>, stall: Option<Duration>, max_extra| HedgePolicy {
            after,
            stall_after: stall,
            max_extra,
        };
        let s = Some(Duration::from_secs(1));
        assert!(p(s, None, 1).enabled());
        assert!(p(None, s, 1).enabled());
        assert!(!p(s, s, 0).enabled(), "no extra leg allowed");
        assert!(!p(None, None, 2).enabled(), "no trigger");
    }
    use crate::error::ErrorLabel;
    use proptest::prelude::*;

    fn t0() -> Instant {
        #[allow(clippy::disallowed_methods)]
        Instant::now()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn plain_request_with_only_stall_is_unhedged() {
        let h = HedgeSettings {
            stall_after: ThresholdSetting::Static(ms(100)),
            ..HedgeSettings::off()
        };
        let p = HedgePolicy::for_request(&h, false);
        assert!(!p.enabled());
        assert!(HedgePolicy::for_request(&h, true).enabled());
    }

    #[test]
    fn budget_is_a_token_bucket() {
        let s = t0();
        let mut b = HedgeBudget::with_burst(2);
        b.record_call(s, 20);
        assert!(b.try_take(s, 20).is_some(), "starts full");
        assert!(b.try_take(s, 20).is_some(), "a burst of 2");
        assert!(b.try_take(s, 20).is_none());
        for _ in 0..4 {
            b.record_call(s, 20);
        }
        assert!(b.try_take(s, 20).is_none(), "4 calls × 20 % < 1 leg");
        b.record_call(s, 20);
        assert!(b.try_take(s, 20).is_some(), "5 calls × 20 % = 1 leg");
        assert!(b.try_take(s, 20).is_none());
        assert!(
            b.try_take(s, 0).is_some() && b.try_take(s, 0).is_some(),
            "0 = no cap"
        );
        assert_eq!(HedgeBudget::new().burst(), DEFAULT_BURST);
        assert_eq!(HedgeBudget::with_burst(0).burst(), 1, "at least one leg");
    }

    #[test]
    fn give_back_refills_the_bucket() {
        let s = t0();
        let mut b = HedgeBudget::with_burst(1);
        let t = b.try_take(s, 10).expect("full");
        assert!(b.try_take(s, 10).is_none());
        b.give_back(t);
        assert_eq!(b.available(s, 10), 1.0);
        assert!(b.try_take(s, 10).is_some());
    }

    #[test]
    fn threshold_origins_table() {
        let bounds = DEFAULT_AFTER_BOUNDS;
        let mut few = LatencySketch::new();
        let mut many = LatencySketch::new();
        for i in 0..60u64 {
            let d = Duration::from_millis(1000 + 100 * i);
            if i < 10 {
                few.observe(d);
                few.add_legs(1);
            }
            many.observe(d);
            many.add_legs(1);
        }
        let empty = LatencySketch::new();
        let t = |setting, src: &LatencySketch, pool: &LatencySketch| {
            threshold_in_force(setting, src, pool, 1_000, bounds, 50)
        };
        use ThresholdOrigin::{Configured, NotYet, Pooled, Source};
        use ThresholdSetting::{Auto, Static};
        assert_eq!(
            t(ThresholdSetting::Off, &many, &many),
            ThresholdInForce {
                value: None,
                origin: ThresholdOrigin::Off,
                prior_bp: 0,
            }
        );
        assert_eq!(
            t(Static(ms(7)), &many, &many),
            ThresholdInForce {
                value: Some(ms(7)),
                origin: Configured,
                prior_bp: 0,
            },
            "a configured threshold wins, even outside the auto bounds"
        );
        assert_eq!(t(Auto, &many, &empty).origin, Source);
        assert_eq!(t(Auto, &few, &many).origin, Pooled);
        assert_eq!(
            t(Auto, &few, &few),
            ThresholdInForce {
                value: None,
                origin: NotYet,
                prior_bp: 0,
            }
        );
        // 60 samples 1.0 s … 6.9 s: the 0.9 quantile is the 54th, 6.3 s (its bin's top)
        let v = t(Auto, &many, &empty).value.unwrap();
        assert!((ms(6300)..=ms(6340)).contains(&v), "{v:?}");
        let json = serde_json::to_string(&t(Auto, &few, &many)).unwrap();
        assert!(
            json.starts_with(r#"{"ms":63"#) && json.ends_with(r#","origin":"pooled"}"#),
            "{json}"
        );
        assert_eq!(serde_json::to_string(&Static(ms(1500))).unwrap(), "1.5");
        assert_eq!(serde_json::to_string(&Auto).unwrap(), r#""auto""#);
    }

    #[test]
    fn auto_hedge_defaults_match_the_spec() {
        let a = HedgeSettings::default();
        assert_eq!(
            (a.after, a.stall_after),
            (ThresholdSetting::Auto, ThresholdSetting::Auto)
        );
        assert_eq!(a.window, Duration::from_secs(600));
        assert_eq!((a.min_samples, a.burst), (50, 3));
        assert_eq!(DEFAULT_BUDGET_PCT, 10);
        assert_eq!(
            (a.after_bounds.min, a.after_bounds.max),
            (ms(500), Duration::from_secs(60))
        );
    }

    #[test]
    fn policy_from_thresholds_keeps_stalls_to_streams() {
        let t = Thresholds {
            after: ThresholdInForce {
                value: Some(ms(900)),
                origin: ThresholdOrigin::Source,
                prior_bp: 0,
            },
            stall_after: ThresholdInForce {
                value: Some(ms(2000)),
                origin: ThresholdOrigin::Pooled,
                prior_bp: 0,
            },
        };
        let plain = HedgePolicy::with_thresholds(&t, 1, false);
        assert_eq!((plain.after, plain.stall_after), (Some(ms(900)), None));
        let stream = HedgePolicy::with_thresholds(&t, 1, true);
        assert_eq!(stream.stall_after, Some(ms(2000)));
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

    fn shuffle<T>(v: &mut [T], seed: u64) {
        let mut x = seed;
        for i in (1..v.len()).rev() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            v.swap(i, ((x >> 33) % (i as u64 + 1)) as usize);
        }
    }

    /// A sketch from proptest values: observed and censored ms, extra streamed legs.
    fn sketch(observed: &[u64], censored: &[u64], extra_legs: u64) -> LatencySketch {
        let mut s = LatencySketch::new();
        observed.iter().for_each(|&v| s.observe(ms(v)));
        censored.iter().for_each(|&v| s.censor(ms(v)));
        s.add_legs((observed.len() + censored.len()) as u64 / (1 + extra_legs) + 1);
        s
    }

    fn values() -> impl Strategy<Value = Vec<u64>> {
        proptest::collection::vec(prop_oneof![0u64..300, 0u64..10_000, 0u64..200_000], 0..80)
    }

    /// One step of a scope's budget: a call, a trigger, giving back the oldest ticket,
    /// or time passing (seconds).
    #[derive(Debug, Clone, Copy)]
    enum Op {
        Call,
        Take,
        GiveBack,
        Wait(u64),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        proptest::collection::vec(
            prop_oneof![
                4 => Just(Op::Call),
                3 => Just(Op::Take),
                1 => Just(Op::GiveBack),
                1 => (0u64..90).prop_map(Op::Wait)
            ],
            0..300,
        )
    }

    /// Runs `ops` from `clock` on (moving it); returns (calls, legs kept) after each
    /// step.
    fn run(
        b: &mut HedgeBudget,
        ops: &[Op],
        pct: u32,
        mut tickets: Vec<BudgetTicket>,
        clock: &mut Instant,
    ) -> Vec<(u64, u64)> {
        let (mut calls, mut kept) = (0u64, 0u64);
        ops.iter()
            .map(|op| {
                match op {
                    Op::Call => {
                        b.record_call(*clock, pct);
                        calls += 1;
                    }
                    Op::Take => {
                        if let Some(t) = b.try_take(*clock, pct) {
                            tickets.push(t);
                            kept += 1;
                        }
                    }
                    Op::GiveBack => {
                        if !tickets.is_empty() {
                            b.give_back(tickets.remove(0));
                            kept = kept.saturating_sub(1);
                        }
                    }
                    Op::Wait(secs) => *clock += Duration::from_secs(*secs),
                }
                (calls, kept)
            })
            .collect()
    }

    /// A workload's two distributions: first tokens (one per leg) and gaps (`gaps` per
    /// leg), `legs` legs.
    fn workload(
        legs: u64,
        ttft: impl Fn(u64) -> u64,
        gaps: u64,
        gap: impl Fn(u64) -> u64,
    ) -> (LatencySketch, LatencySketch) {
        let (mut t, mut g) = (LatencySketch::new(), LatencySketch::new());
        for i in 0..legs {
            t.observe(ms(ttft(i)));
            for j in 0..gaps {
                g.observe(ms(gap(i * gaps + j)));
            }
        }
        t.add_legs(legs);
        g.add_legs(legs);
        (t, g)
    }

    /// The knee crosses a flat stretch of the distribution: pauses of 1–5 s in 30 % of
    /// legs, stalls of 20–120 s in 19 %. The budget's threshold at a fifth of the legs
    /// falls in the pauses' tail (about 4.8 s), where a trigger fires on pauses that end
    /// before a new leg could help; the knee is past the pauses (5 s), saving within
    /// 3 % of it, and on a distribution with no flat stretch it moves little.
    #[test]
    fn the_knee_crosses_the_gap_between_pauses_and_stalls() {
        let g = pauses_and_stalls();
        let y = vec![ms(1_600); 10];
        let t = auto_threshold_bp(&g, 2_000, DEFAULT_STALL_BOUNDS).unwrap();
        assert!((ms(4_000)..ms(5_000)).contains(&t), "{t:?}");
        let k = knee(&g, t, &y, DEFAULT_STALL_BOUNDS.max);
        assert!(k >= ms(5_000), "past the pauses: {k:?}");
        assert!(k < ms(20_000), "not past the stalls' start: {k:?}");
        // A steep distribution (uniform 0–100 s): the knee stays within a second.
        let mut u = LatencySketch::new();
        for i in 0..1000u64 {
            u.observe(ms(i * 100));
        }
        u.add_legs(1000);
        let t = auto_threshold_bp(
            &u,
            1_000,
            Bounds {
                min: ms(0),
                max: ms(200_000),
            },
        )
        .unwrap();
        let k = knee(&u, t, &y, ms(200_000));
        assert!(k >= t && k - t < ms(1_000), "{t:?} → {k:?}");
    }

    /// Pauses of 1–5 s in 30 % of legs, stalls of 20–120 s in 19 %, nothing between.
    fn pauses_and_stalls() -> LatencySketch {
        let mut g = LatencySketch::new();
        for i in 0..1000u64 {
            let v = match i % 100 {
                0..=18 => 20_000 + (i * 104_729) % 100_000,
                19..=48 => 1_000 + (i * 7_919) % 4_000,
                _ => 100 + i % 200,
            };
            g.observe(ms(v));
        }
        g.add_legs(1000);
        g
    }

    /// A share of legs a little below the stalls' own (16 % against 19 %) puts the
    /// quantile into the stalls, 20 s past their start; `earlier` brings it back to the
    /// stalls' start for the 3 % more legs (the knee then keeps it before any stall).
    /// On a smooth distribution it stays where it is.
    #[test]
    fn a_threshold_in_a_flat_stretch_comes_back_to_its_start() {
        let g = pauses_and_stalls();
        let y = vec![ms(1_600); 10];
        let t = auto_threshold_bp(&g, 1_600, DEFAULT_STALL_BOUNDS).unwrap();
        assert!(t > ms(20_000), "the quantile is in the stalls: {t:?}");
        let e = earlier(&g, t, &y, DEFAULT_STALL_BOUNDS.min);
        assert!(
            (ms(4_900)..ms(5_100)).contains(&e),
            "the stalls' start: {e:?}"
        );
        // Through the threshold in force: the same, then the knee.
        let k = auto_in_force(&g, 1_600, &y, DEFAULT_STALL_BOUNDS).unwrap();
        assert!((ms(4_900)..ms(20_000)).contains(&k), "{k:?}");
        let tail = g.tail();
        assert!(tail.survival(e) <= tail.survival(t) * (1.0 + EARLIER_SPEND));
        let k = knee(&g, e, &y, DEFAULT_STALL_BOUNDS.max);
        assert!((ms(4_900)..ms(20_000)).contains(&k), "{k:?}");
        // Already at the stalls' start (a fifth of the legs: the pauses' tail), nothing
        // earlier is worth its legs: the pauses it would add end before a new leg helps.
        let t = auto_threshold_bp(&g, 2_000, DEFAULT_STALL_BOUNDS).unwrap();
        assert_eq!(earlier(&g, t, &y, DEFAULT_STALL_BOUNDS.min), t);
        // A smooth tail (exponential, mean 10 s): the earlier legs are worth less than
        // the average one; it stays.
        let mut x = LatencySketch::new();
        for i in 0..2000u64 {
            let u = (f64::from(i as u32) + 0.5) / 2000.0;
            x.observe(ms((-10_000.0 * (1.0 - u).ln()) as u64));
        }
        x.add_legs(2000);
        for bp in [500, 1_000, 2_500] {
            let t = auto_threshold_bp(&x, bp, DEFAULT_STALL_BOUNDS).unwrap();
            assert_eq!(earlier(&x, t, &[], DEFAULT_STALL_BOUNDS.min), t, "{bp} bp");
        }
    }

    #[test]
    fn quantiles_are_each_quantile() {
        let mut s = LatencySketch::new();
        for i in 0..500u64 {
            s.observe(ms(i * 37 % 3_000));
            if i % 7 == 0 {
                s.censor(ms(i * 11 % 4_000));
            }
        }
        let qs = [0.9, 0.1, 0.5, 0.999, 0.0, 1.0, f64::NAN, 0.5];
        let each: Vec<Duration> = qs.iter().map(|&q| s.quantile(q).unwrap()).collect();
        assert_eq!(s.quantiles(&qs), each);
        assert!(LatencySketch::new().quantiles(&qs).is_empty());
    }

    #[test]
    fn the_budget_goes_to_the_trigger_that_carries_the_tail() {
        let auto = HedgeSettings::default();
        // Long stalls in 19 % of calls (20–120 s), first tokens 1–3 s: the stall trigger
        // saves far more per leg, so it gets (nearly) all of the budget.
        let (t, g) = workload(
            1000,
            |i| 1000 + (i * 7919) % 2000,
            40,
            |k| {
                let call = k / 40;
                if k % 40 == 0 && call % 100 < 19 {
                    20_000 + (call * 104_729) % 100_000
                } else {
                    50
                }
            },
        );
        let (ft, st) = split_budget(&auto, Some(&t), Some(&g), 1000);
        assert_eq!(ft + st, 1000);
        assert!(st >= 900, "stalls carry the tail: {ft} / {st}");
        // A reasoning model: first tokens 5–90 s, steady gaps of 50 ms: all to the first
        // token.
        let (t, g) = workload(1000, |i| 5000 + (i * 7919) % 85_000, 40, |_| 50);
        let (ft, st) = split_budget(&auto, Some(&t), Some(&g), 1000);
        assert_eq!((ft, st), (1000, 0), "nothing to save on gaps");
        // No evidence for one of them: half each, as before there was any.
        assert_eq!(split_budget(&auto, Some(&t), None, 1000), (500, 500));
        assert_eq!(split_budget(&auto, None, None, 1001), (501, 500));
        assert_eq!(split_budget(&auto, Some(&t), Some(&g), 0), (0, 0));
    }

    #[test]
    fn excess_is_the_hand_computation_without_censoring() {
        let s = sketch(&[1000, 2000, 4000], &[], 0);
        // E[(X − 1500)⁺] = (0 + 500 + 2500) / 3, within the bins' 1 %.
        let e = s.excess_ms(ms(1500)).unwrap();
        assert!((e - 1000.0).abs() < 30.0, "{e}");
        assert_eq!(s.excess_ms(ms(10_000)), Some(0.0));
        assert_eq!(LatencySketch::new().excess_ms(ms(1)), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// A bigger budget never gives a later threshold (first token and stalls alike).
        #[test]
        fn auto_threshold_is_monotone_in_the_budget(o in values(), c in values(), legs in 0u64..300, p1 in 0u32..=100, p2 in 0u32..=100) {
            let s = sketch(&o, &c, legs);
            let (lo, hi) = (p1.min(p2), p1.max(p2));
            let wide = Bounds { min: Duration::ZERO, max: Duration::from_secs(7200) };
            for bounds in [wide, DEFAULT_AFTER_BOUNDS, DEFAULT_STALL_BOUNDS] {
                prop_assert!(auto_threshold(&s, hi, bounds) <= auto_threshold(&s, lo, bounds),
                    "{} % → {:?} later than {} % → {:?}", hi, auto_threshold(&s, hi, bounds), lo, auto_threshold(&s, lo, bounds));
            }
        }

        /// The aim (DECISIONS 163): the whole budget while the bucket is at least half
        /// full, never less than 80 % of it, and monotone in the fill and the budget.
        #[test]
        fn the_aim_is_the_budget_until_the_bucket_drains(b1 in 0u32..30_000, b2 in 0u32..30_000, f1 in 0.0f64..=1.0, f2 in 0.0f64..=1.0) {
            let (blo, bhi) = (b1.min(b2), b1.max(b2));
            let (flo, fhi) = (f1.min(f2), f1.max(f2));
            for b in [blo, bhi] {
                for f in [flo, fhi] {
                    let a = aim_bp(b, f);
                    prop_assert!(a <= b && u64::from(a) * 10 + 10 >= u64::from(b) * 8, "{b} at {f} → {a}");
                    if f >= 0.5 {
                        prop_assert_eq!(a, b);
                    }
                }
                prop_assert!(aim_bp(b, flo) <= aim_bp(b, fhi));
            }
            for f in [flo, fhi] {
                prop_assert!(aim_bp(blo, f) <= aim_bp(bhi, f));
            }
            prop_assert_eq!(aim_bp(bhi, f64::NAN), bhi);
        }

        /// The knee (DECISIONS 162): never earlier than the threshold the budget allows,
        /// never past the bound, worth at least `1 − KNEE_SLACK` of that threshold's
        /// saving, and monotone — a later starting threshold never gives an earlier
        /// knee (so `auto` stays monotone in the budget).
        #[test]
        fn the_knee_is_later_never_worth_less_and_monotone(
            o in values(), c in values(), y in proptest::collection::vec(0u64..20_000, 0..10),
            t1 in 0u64..150_000, t2 in 0u64..150_000, max in 1u64..200_000,
        ) {
            let s = sketch(&o, &c, 0);
            let y: Vec<Duration> = y.into_iter().map(ms).collect();
            let max = ms(max);
            let tail = s.tail();
            let (lo, hi) = (ms(t1.min(t2)), ms(t1.max(t2)));
            for t in [lo, hi] {
                let k = knee(&s, t, &y, max);
                prop_assert!(k >= t, "{k:?} < {t:?}");
                if t <= max {
                    prop_assert!(k <= max);
                    let (at_t, at_k) = (saving(&tail, t, &y), saving(&tail, k, &y));
                    prop_assert!(at_k >= at_t * (1.0 - KNEE_SLACK) - 1e-6,
                        "the knee {k:?} saves {at_k} ms, {t:?} saves {at_t} ms");
                } else {
                    prop_assert_eq!(k, t);
                }
            }
            // (up to the search's 0.5 % precision)
            let (k_lo, k_hi) = (knee(&s, lo, &y, max), knee(&s, hi, &y, max));
            prop_assert!(k_lo <= k_hi + k_hi / 190 + ms(1),
                "{lo:?} → {k_lo:?} is later than {hi:?} → {k_hi:?}");
        }

        /// `earlier` (DECISIONS 166): never later than the threshold it starts from, never
        /// below the bound, firing on at most `1 + EARLIER_SPEND` times its legs, and
        /// worth its extra legs at the starting threshold's rate.
        #[test]
        fn an_earlier_threshold_is_worth_its_extra_legs(
            o in values(), c in values(), y in proptest::collection::vec(0u64..20_000, 0..10),
            t in 0u64..150_000, min in 0u64..5_000,
        ) {
            let s = sketch(&o, &c, 0);
            let y: Vec<Duration> = y.into_iter().map(ms).collect();
            let (t, min) = (ms(t), ms(min));
            let e = earlier(&s, t, &y, min);
            prop_assert!(e <= t);
            if t >= min {
                prop_assert!(e >= min, "{e:?} below {min:?}");
            } else {
                prop_assert_eq!(e, t);
            }
            let tail = s.tail();
            // `t` itself, or one of the values that carry mass (the best threshold of its
            // step), never a point between them or below the floor.
            prop_assert!(e == t || tail.points().any(|v| ms(v.ceil() as u64) == e && e >= min),
                "{e:?} is neither {t:?} nor a value of the sketch");
            let (f_t, f_e) = (tail.survival(t), tail.survival(e));
            prop_assert!(f_e <= f_t * (1.0 + EARLIER_SPEND) + 1e-9, "fires on {f_e}, {t:?} on {f_t}");
            if e < t {
                let (s_t, s_e) = (saving(&tail, t, &y), saving(&tail, e, &y));
                prop_assert!(s_e - s_t >= s_t / f_t * (f_e - f_t),
                    "{e:?} adds {} ms for {} more legs at {} ms each", s_e - s_t, f_e - f_t, s_t / f_t);
            }
        }

        /// The threshold in force from a share (DECISIONS 166): within the quantiles of
        /// `1 + EARLIER_SPEND` times the share and of half of it, and never later for a
        /// share at least `2 × (1 + EARLIER_SPEND)` times another (their windows do not
        /// overlap); `thresholds` reads it.
        #[test]
        fn the_threshold_in_force_stays_in_its_window(
            o in values(), c in values(), y in proptest::collection::vec(0u64..20_000, 0..10),
            p in 1u32..5_000, times in 2.4f64..20.0,
        ) {
            let s = sketch(&o, &c, 0);
            let y: Vec<Duration> = y.into_iter().map(ms).collect();
            for bounds in [DEFAULT_AFTER_BOUNDS, DEFAULT_STALL_BOUNDS] {
                let at = |p: u32| auto_in_force(&s, p, &y, bounds);
                let q = |p: u32| auto_threshold_bp(&s, p, bounds);
                let Some(v) = at(p) else {
                    prop_assert!(q(p).is_none());
                    continue;
                };
                let wider = (f64::from(p) * (1.0 + EARLIER_SPEND)).round() as u32;
                prop_assert!(q(wider).unwrap() <= v && v <= q(p / 2).unwrap(),
                    "{v:?} outside {:?}..={:?}", q(wider), q(p / 2));
                let big = (f64::from(p) * times).ceil() as u32;
                let w = at(big).unwrap();
                prop_assert!(w <= v, "{big} bp → {w:?} later than {p} bp → {v:?}");
            }
            let auto = HedgeSettings {
                after: ThresholdSetting::Off,
                stall_after: ThresholdSetting::Auto,
                min_samples: 1,
                ..HedgeSettings::default()
            };
            let none = LatencySketch::new();
            let t = thresholds(&auto, &none, &s, &LatencySnapshot::default(), p);
            prop_assert_eq!(t.stall_after.value, auto_in_force(&s, trigger_share_bp(p, auto.max_extra), &[], DEFAULT_STALL_BOUNDS));
        }

        /// The two triggers' parts always add up to the budget, and the split does not
        /// depend on the order the samples were merged in.
        #[test]
        fn the_split_adds_up_and_ignores_merge_order(a in values(), b in values(), c in values(), pct in 0u32..=100) {
            let auto = HedgeSettings::default();
            let t = sketch(&a, &[], 0);
            let (mut g1, mut g2) = (sketch(&b, &[], 5), sketch(&c, &[], 5));
            let (ft, st) = split_budget(&auto, Some(&t), Some(&{ let mut x = g1.clone(); x.merge(&g2); x }), pct * 100);
            prop_assert_eq!(ft + st, pct * 100);
            g2.merge(&g1);
            g1 = g2;
            prop_assert_eq!(split_budget(&auto, Some(&t), Some(&g1), pct * 100), (ft, st));
        }

        /// Censored samples never lower the expected excess (the no-feedback-loop rule:
        /// cancelled legs cannot make a trigger look less useful).
        #[test]
        fn censoring_never_lowers_the_excess(o in values(), c in values(), at in 0u64..200_000) {
            let with = sketch(&o, &c, 0);
            let without = sketch(&o, &[], 0);
            let all: Vec<u64> = o.iter().chain(c.iter()).copied().collect();
            let as_observed = sketch(&all, &[], 0);
            if let (Some(w), Some(x)) = (with.excess_ms(ms(at)), as_observed.excess_ms(ms(at))) {
                prop_assert!(w + 1e-6 >= x, "{} < {} (censored read as observed)", w, x);
            }
            if let (Some(w), Some(x)) = (with.excess_ms(ms(at)), without.excess_ms(ms(at))) {
                // Left out, the censored samples' mass would not lift the tail at all:
                // with them it is at least as heavy above the last observed value.
                let top = o.iter().copied().max().unwrap_or(0);
                if c.iter().all(|&v| v >= top) {
                    prop_assert!(w + 1e-6 >= x, "{} < {} (censored left out)", w, x);
                }
            }
        }

        /// The per-leg share spends no more than the budget, is monotone in it, and is
        /// the budget itself with one extra leg per round.
        #[test]
        fn trigger_share_stays_within_the_budget(a in 0u32..=30_000, b in 0u32..=30_000, extra in 1u32..=3) {
            let (lo, hi) = (a.min(b), a.max(b));
            let p = trigger_share_bp(hi, extra);
            prop_assert!(p <= hi);
            prop_assert!(trigger_share_bp(lo, extra) <= p);
            let x = f64::from(p) / 10_000.0;
            let cost: f64 = (1..=extra).map(|k| x.powi(k as i32)).sum();
            prop_assert!(cost <= f64::from(hi) / 10_000.0 + 1e-9, "{} > {}", cost, hi);
            prop_assert_eq!(trigger_share_bp(hi, 1), hi);
        }

        /// An `auto` threshold is always within its bounds.
        #[test]
        fn auto_threshold_is_within_bounds(o in values(), c in values(), pct in 0u32..=150, a in 0u64..100_000, b in 0u64..100_000) {
            let s = sketch(&o, &c, 0);
            let bounds = Bounds { min: ms(a.min(b)), max: ms(a.max(b)) };
            if let Some(t) = auto_threshold(&s, pct, bounds) {
                prop_assert!(bounds.min <= t && t <= bounds.max, "{:?} outside {:?}", t, bounds);
            } else {
                prop_assert!(s.samples() == 0);
            }
        }

        /// Merging per-process parts in any order gives the same thresholds in force.
        #[test]
        fn threshold_is_stable_under_merge_order(parts in proptest::collection::vec((values(), values()), 1..6), pct in 1u32..50, seed: u64) {
            let sketches: Vec<LatencySketch> = parts.iter().map(|(o, c)| sketch(o, c, 3)).collect();
            let mut forward = LatencySketch::new();
            sketches.iter().for_each(|x| forward.merge(x));
            let mut order: Vec<usize> = (0..sketches.len()).collect();
            shuffle(&mut order, seed);
            let mut shuffled = LatencySketch::new();
            order.iter().for_each(|&i| shuffled.merge(&sketches[i]));
            let empty = LatencySketch::new();
            for setting in [ThresholdSetting::Auto, ThresholdSetting::Static(ms(3))] {
                prop_assert_eq!(
                    threshold_in_force(setting, &forward, &empty, pct * 100, DEFAULT_STALL_BOUNDS, 10),
                    threshold_in_force(setting, &shuffled, &empty, pct * 100, DEFAULT_STALL_BOUNDS, 10)
                );
            }
        }

        /// The origin: off, configured (wins over any distribution), the source's own
        /// from `min_samples` legs on, else the pool's, else none yet.
        #[test]
        fn threshold_origin_is_right(src_n in 0usize..40, pool_n in 0usize..40, min_samples in 0u64..30, kind in 0u8..3, d in 1u64..90_000) {
            let own = sketch(&vec![1500; src_n], &[], 0);
            let pool = sketch(&vec![2500; pool_n], &[], 0);
            let setting = [ThresholdSetting::Off, ThresholdSetting::Static(ms(d)), ThresholdSetting::Auto][kind as usize];
            let t = threshold_in_force(setting, &own, &pool, 1_000, DEFAULT_AFTER_BOUNDS, min_samples);
            let expected = match setting {
                ThresholdSetting::Off => ThresholdOrigin::Off,
                ThresholdSetting::Static(_) => ThresholdOrigin::Configured,
                ThresholdSetting::Auto if src_n > 0 && own.evidence() >= min_samples => ThresholdOrigin::Source,
                ThresholdSetting::Auto if pool_n > 0 && pool.evidence() >= min_samples => ThresholdOrigin::Pooled,
                ThresholdSetting::Auto => ThresholdOrigin::NotYet,
            };
            prop_assert_eq!(t.origin, expected);
            prop_assert_eq!(t.value.is_some(), !matches!(expected, ThresholdOrigin::Off | ThresholdOrigin::NotYet));
            match expected {
                ThresholdOrigin::Configured => prop_assert_eq!(t.value, Some(ms(d))),
                ThresholdOrigin::Source => prop_assert!(t.value.unwrap() >= ms(1500) && t.value.unwrap() < ms(1510)),
                ThresholdOrigin::Pooled => prop_assert!(t.value.unwrap() >= ms(2500) && t.value.unwrap() < ms(2520)),
                _ => {}
            }
        }

        /// A quiet scope (a full bucket) serves `burst` consecutive stalls, whatever the
        /// budget; the next one only once the calls since have refilled a leg.
        #[test]
        fn quiet_scope_serves_consecutive_stalls_up_to_the_burst(burst in 1u32..6, pct in 1u32..=100) {
            let s = t0();
            let mut b = HedgeBudget::with_burst(burst);
            for i in 0..burst {
                b.record_call(s, pct);
                prop_assert!(b.try_take(s, pct).is_some(), "stall {} of a burst of {}", i + 1, burst);
            }
            // the calls since the first stall may have refilled whole legs, no more
            let mut more = 0u64;
            while b.try_take(s, pct).is_some() {
                more += 1;
            }
            prop_assert!(100 * more <= u64::from(burst - 1) * u64::from(pct));
            // and ⌈100 / pct⌉ calls later the next stall is served again
            for _ in 0..100_u32.div_ceil(pct) {
                b.record_call(s, pct);
            }
            prop_assert!(b.try_take(s, pct).is_some());
        }

        /// Over any run, extra legs kept ≤ BUDGET_PCT % of the calls + the burst —
        /// whatever the calls' timing (the bank only keeps what they added).
        #[test]
        fn extra_legs_stay_within_the_budget(ops in ops(), burst in 1u32..6, pct in 1u32..=100) {
            let mut b = HedgeBudget::with_burst(burst);
            for (calls, kept) in run(&mut b, &ops, pct, Vec::new(), &mut t0()) {
                prop_assert!(100 * kept <= u64::from(pct) * calls + 100 * u64::from(burst),
                    "{} legs for {} calls at {} % with a burst of {}", kept, calls, pct, burst);
            }
        }

        /// A busy scope banks exactly the budget of its last minute of calls (or the
        /// burst, if more), and the bank expires with the calls that earned it.
        #[test]
        fn a_busy_scope_banks_a_minute_of_its_budget(
            n in 0u64..3000, burst in 1u32..6, pct in 1u32..=100, spread in 0u64..60,
        ) {
            let s = t0();
            let mut b = HedgeBudget::with_burst(burst);
            // n calls over `spread` seconds (all within one minute of the last)
            for i in 0..n {
                b.record_call(s + Duration::from_secs(spread * i / n.max(1)), pct);
            }
            let last = s + Duration::from_secs(spread * n.saturating_sub(1) / n.max(1));
            let banked = (u64::from(burst) * 100).max(n * u64::from(pct));
            let first_out = s + DEFAULT_BANK;
            let hundredths = |x: f64| (x * 100.0).round() as u64;
            prop_assert_eq!(hundredths(b.available(last, pct)), banked);
            if first_out > last {
                prop_assert_eq!(hundredths(b.available(first_out - Duration::from_millis(1), pct)), banked,
                    "nothing expires within a minute of the first call");
            }
            prop_assert!(b.available(last + DEFAULT_BANK, pct) <= f64::from(burst),
                "a quiet minute later only the burst is left");
        }

        /// Without a bank (`HEDGE__BANK_S` 0) the bucket holds the burst only, however
        /// busy the scope.
        #[test]
        fn without_a_bank_the_bucket_holds_the_burst(n in 0u64..500, burst in 1u32..6, pct in 1u32..=100) {
            let s = t0();
            let mut b = HedgeBudget::banking(burst, Duration::ZERO);
            for _ in 0..n {
                b.record_call(s, pct);
            }
            prop_assert_eq!(b.available(s, pct), f64::from(burst));
        }

        /// A leg taken and given back leaves the bucket exactly as if never taken, however
        /// many calls and takes happened in between.
        #[test]
        fn give_back_restores_exactly(before in ops(), between in ops(), after in ops(), burst in 1u32..6, pct in 1u32..=100) {
            let mut cw = t0();
            let mut cwo = cw;
            let mut with = HedgeBudget::with_burst(burst);
            let mut without = HedgeBudget::with_burst(burst);
            run(&mut with, &before, pct, Vec::new(), &mut cw);
            run(&mut without, &before, pct, Vec::new(), &mut cwo);
            let Some(ticket) = with.try_take(cw, pct) else { return Ok(()); };
            // between: both see the same calls and time; `with` is one leg short meanwhile
            let calls: Vec<Op> = between.iter().copied().filter(|o| matches!(o, Op::Call | Op::Wait(_))).collect();
            run(&mut with, &calls, pct, Vec::new(), &mut cw);
            run(&mut without, &calls, pct, Vec::new(), &mut cwo);
            with.give_back(ticket);
            prop_assert_eq!(with.available(cw, pct), without.available(cwo, pct));
            prop_assert_eq!(run(&mut with, &after, pct, Vec::new(), &mut cw), run(&mut without, &after, pct, Vec::new(), &mut cwo));
        }

        /// `BUDGET_PCT` 0 = no cap: every leg is allowed and none is counted.
        #[test]
        fn pct_zero_is_no_cap(takes in 0usize..50, burst in 1u32..6) {
            let s = t0();
            let mut b = HedgeBudget::with_burst(burst);
            for _ in 0..takes {
                prop_assert!(b.try_take(s, 0).is_some());
            }
            prop_assert_eq!(b.available(s, 10), f64::from(burst));
        }
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
    }
}
