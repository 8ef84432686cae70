//! [`Profile`]: a distribution of behaviors sampled per request from a seeded RNG —
//! named (`fast`, `long-tail`, `flaky`, `stall`, `fast-chat`, `reasoning`) or read from
//! a JSON profile file — with a `time_scale` factor (1.0 = real seconds of SPEC §12).
//!
//! The three workloads of the hedging benchmark (crates/polygw/benches/hedging.rs) are
//! named profiles, unscaled here:
//! - `long-tail`: the reference workload of SPEC §12 (TTFT median 1.6 s; a 20–120 s
//!   stall in 19 % of answers) — its tail is made by mid-stream stalls;
//! - `fast-chat`: a fast chat model — TTFT median 0.4 s, p99 3 s; short answers; rare
//!   mid-stream stalls (3 %, 3–30 s) and ordinary pauses (10 %, 0.3–1.5 s);
//! - `reasoning`: a reasoning model that thinks before its first visible token — TTFT
//!   median 15 s, p99 90 s — then streams steadily (no stalls): its tail is the TTFT.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::behavior::{Behavior, Fault, RetryAfter, Stall};
use crate::billing::Prices;
use crate::cache::PrefixCache;
use crate::prefill::{PrefillDialect, PrefillMode, PrefillPolicy};

/// The SPEC §12 long-tail shape, unscaled (seconds / milliseconds of real time).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LongTail {
    /// TTFT lognormal median (s).
    pub ttft_median_s: f64,
    /// TTFT lognormal σ.
    pub ttft_sigma: f64,
    /// Fewest incremental chunks.
    pub chunks_min: u32,
    /// Most incremental chunks.
    pub chunks_max: u32,
    /// Mean of the exponential gaps between chunks (ms).
    pub gap_mean_ms: f64,
    /// Probability of one long stall.
    pub long_stall_p: f64,
    /// Long stall lognormal median (s).
    pub long_stall_median_s: f64,
    /// Long stall lognormal σ.
    pub long_stall_sigma: f64,
    /// Long stall lower clip (s).
    pub long_stall_min_s: f64,
    /// Long stall upper clip (s).
    pub long_stall_max_s: f64,
    /// Probability of one short stall.
    pub short_stall_p: f64,
    /// Short stall uniform lower bound (s).
    pub short_stall_min_s: f64,
    /// Short stall uniform upper bound (s).
    pub short_stall_max_s: f64,
    /// Probability that the answer starts with reasoning (SPEC §12: 129 of 4407).
    pub reasoning_p: f64,
    /// Keepalive comments during silences (s), if any.
    pub keepalive_s: Option<f64>,
    /// The prefill mode of every sampled behavior (None = the server's policy).
    pub prefill: Option<PrefillMode>,
    /// The prefill dialects of every sampled behavior (None = the server's policy).
    pub prefill_dialects: Option<Vec<PrefillDialect>>,
    /// The answer's length (content chunks) is a function of the request — its last
    /// user message — instead of a draw: every mock plans the same length for the same
    /// question, as one model would, so a prefill continuation on another mock generates
    /// the rest of that answer rather than an answer of a new length (the stalls' places
    /// are drawn over the whole answer, so a shorter continuation meets fewer of them).
    /// Default false (the length is drawn).
    pub length_by_request: bool,
}

impl Default for LongTail {
    fn default() -> Self {
        LongTail {
            ttft_median_s: 1.6,
            ttft_sigma: 0.8,
            chunks_min: 50,
            chunks_max: 400,
            gap_mean_ms: 30.0,
            long_stall_p: 0.19,
            long_stall_median_s: 40.0,
            long_stall_sigma: 0.5,
            long_stall_min_s: 20.0,
            long_stall_max_s: 120.0,
            short_stall_p: 0.3,
            short_stall_min_s: 1.0,
            short_stall_max_s: 5.0,
            reasoning_p: 129.0 / 4407.0,
            keepalive_s: None,
            prefill: None,
            prefill_dialects: None,
            length_by_request: false,
        }
    }
}

/// One entry of a mix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Weighted {
    /// Relative weight (> 0).
    pub weight: f64,
    /// The behavior played when drawn.
    pub behavior: Behavior,
}

/// What a profile samples from.
#[derive(Debug, Clone, PartialEq)]
pub enum ProfileKind {
    /// Always the same behavior.
    Fixed(Box<Behavior>),
    /// A weighted choice among behaviors.
    Mix(Vec<Weighted>),
    /// The long-tail generator.
    LongTail(LongTail),
}

/// A named distribution of behaviors.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Its name.
    pub name: String,
    /// Multiplies every duration (1.0 = real time; 0.01 turns 1 s into 10 ms).
    pub time_scale: f64,
    /// RNG seed (the same seed replays the same sequence of behaviors).
    pub seed: u64,
    /// The distribution.
    pub kind: ProfileKind,
}

/// A profile could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileError(pub String);

impl std::fmt::Display for ProfileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ProfileError {}

/// The names [`Profile::named`] knows.
pub const PROFILE_NAMES: &[&str] = &[
    "fast",
    "long-tail",
    "flaky",
    "stall",
    "fast-chat",
    "reasoning",
];

/// The standard normal's 0.99 quantile: a lognormal with median `m` and σ `s` has its
/// p99 at `m · exp(Z99 · s)`.
const Z99: f64 = 2.326_347_874;

/// The JSON profile file (see docs/MOCK_UPSTREAM.md): exactly one of `extends`,
/// `behavior`, `mix`, `long_tail`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProfileFile {
    /// The profile's name (default: the file stem, or the extended name).
    pub name: Option<String>,
    /// Start from a named profile.
    pub extends: Option<String>,
    /// Time scale (default 1.0).
    pub time_scale: Option<f64>,
    /// RNG seed (default 0).
    pub seed: Option<u64>,
    /// One fixed behavior.
    pub behavior: Option<Behavior>,
    /// A weighted mix.
    pub mix: Option<Vec<Weighted>>,
    /// Long-tail parameters (missing fields take the SPEC §12 defaults).
    pub long_tail: Option<LongTail>,
    /// The prefill mode of every behavior that does not set its own.
    pub prefill: Option<PrefillMode>,
    /// The prefill dialects of every behavior that does not set its own.
    pub prefill_dialects: Option<Vec<PrefillDialect>>,
    /// A server-wide prefix cache (read by [`crate::MockSettings`], not by the profile).
    pub prefix_cache: Option<PrefixCache>,
    /// Server-wide prices (read by [`crate::MockSettings`], not by the profile).
    pub prices: Option<Prices>,
}

fn fast() -> LongTail {
    LongTail {
        ttft_median_s: 0.2,
        ttft_sigma: 0.3,
        chunks_min: 20,
        chunks_max: 60,
        gap_mean_ms: 10.0,
        long_stall_p: 0.0,
        short_stall_p: 0.0,
        reasoning_p: 0.0,
        ..LongTail::default()
    }
}

fn flaky() -> Vec<Weighted> {
    let ok = Behavior {
        ttft_ms: 200.0,
        chunk_count: Some(30),
        gap_ms: 10.0,
        ..Behavior::default()
    };
    let with = |weight: f64, f: &dyn Fn(Behavior) -> Behavior| Weighted {
        weight,
        behavior: f(ok.clone()),
    };
    vec![
        with(0.70, &|b| b),
        with(0.06, &|b| Behavior {
            status: 429,
            retry_after: Some(RetryAfter::Seconds(1.0)),
            ..b
        }),
        with(0.04, &|b| Behavior { status: 429, ..b }),
        with(0.05, &|b| Behavior { status: 500, ..b }),
        with(0.03, &|b| Behavior { status: 503, ..b }),
        with(0.03, &|b| Behavior {
            fault: Some(Fault::ResetBeforeHeaders),
            ..b
        }),
        with(0.03, &|b| Behavior {
            fault: Some(Fault::ResetAfter { chunks: 10 }),
            ..b
        }),
        with(0.02, &|b| Behavior {
            fault: Some(Fault::TruncateAfter { chunks: 15 }),
            ..b
        }),
        with(0.02, &|b| Behavior {
            fault: Some(Fault::MalformedAt { chunk: 5 }),
            ..b
        }),
        with(0.02, &|b| Behavior {
            fault: Some(Fault::ErrorFrameAt {
                chunk: 5,
                error: None,
            }),
            ..b
        }),
    ]
}

fn stall() -> LongTail {
    LongTail {
        ttft_median_s: 0.5,
        ttft_sigma: 0.3,
        chunks_min: 20,
        chunks_max: 80,
        gap_mean_ms: 20.0,
        long_stall_p: 1.0,
        long_stall_median_s: 10.0,
        long_stall_sigma: 0.3,
        long_stall_min_s: 5.0,
        long_stall_max_s: 20.0,
        short_stall_p: 0.0,
        reasoning_p: 0.0,
        keepalive_s: Some(1.0),
        ..LongTail::default()
    }
}

/// `fast-chat`: a fast chat model. TTFT lognormal with median 0.4 s and p99 3 s (σ =
/// ln(3 / 0.4) / z₀.₉₉ ≈ 0.866: ≈ 14.5 % over 1 s, ≈ 0.4 % over 4 s); 30–150 chunks
/// (uniform), gaps exponential with mean 25 ms (≈ 2.3 s of generation on average); rare
/// mid-stream stalls — with probability 0.03 one stall at a uniformly random chunk,
/// lognormal median 8 s, σ 0.6, clipped to 3–30 s — and, with probability 0.1, one
/// ordinary pause of 0.3–1.5 s (uniform), which a stall threshold should not fire on;
/// no reasoning.
fn fast_chat() -> LongTail {
    LongTail {
        ttft_median_s: 0.4,
        ttft_sigma: (3.0f64 / 0.4).ln() / Z99,
        chunks_min: 30,
        chunks_max: 150,
        gap_mean_ms: 25.0,
        long_stall_p: 0.03,
        long_stall_median_s: 8.0,
        long_stall_sigma: 0.6,
        long_stall_min_s: 3.0,
        long_stall_max_s: 30.0,
        short_stall_p: 0.1,
        short_stall_min_s: 0.3,
        short_stall_max_s: 1.5,
        reasoning_p: 0.0,
        ..LongTail::default()
    }
}

/// `reasoning`: a reasoning model that thinks before its first visible token (its
/// reasoning is not streamed, as with OpenAI's o-series). TTFT lognormal with median
/// 15 s and p99 90 s (σ = ln 6 / z₀.₉₉ ≈ 0.770: ≈ 35 % over 20 s, ≈ 10 % over 40 s,
/// ≈ 3.6 % over 60 s); then steady streaming: 100–600 chunks (uniform), gaps
/// exponential with mean 20 ms (≈ 7 s of generation on average), no stalls, no pauses.
fn reasoning() -> LongTail {
    LongTail {
        ttft_median_s: 15.0,
        ttft_sigma: 6.0f64.ln() / Z99,
        chunks_min: 100,
        chunks_max: 600,
        gap_mean_ms: 20.0,
        long_stall_p: 0.0,
        short_stall_p: 0.0,
        reasoning_p: 0.0,
        ..LongTail::default()
    }
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut fastrand::Rng) -> f64 {
    let u1 = 1.0 - rng.f64(); // (0, 1]
    let u2 = rng.f64();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// A lognormal draw with this median and σ.
pub fn lognormal(rng: &mut fastrand::Rng, median: f64, sigma: f64) -> f64 {
    (median.ln() + sigma * normal(rng)).exp()
}

/// An exponential draw with this mean.
pub fn exponential(rng: &mut fastrand::Rng, mean: f64) -> f64 {
    -mean * (1.0 - rng.f64()).ln()
}

fn uniform(rng: &mut fastrand::Rng, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo).max(0.0) * rng.f64()
}

impl LongTail {
    /// Draws one behavior (unscaled).
    pub fn sample(&self, rng: &mut fastrand::Rng) -> Behavior {
        self.sample_for(rng, None)
    }

    /// Draws one behavior (unscaled) for a request whose seed is `request_seed` (see
    /// [`LongTail::length_by_request`]; the other draws do not depend on it, and the RNG
    /// advances the same either way).
    pub fn sample_for(&self, rng: &mut fastrand::Rng, request_seed: Option<u64>) -> Behavior {
        let (lo, hi) = (
            self.chunks_min.max(1),
            self.chunks_max.max(self.chunks_min.max(1)),
        );
        let drawn = rng.u32(lo..=hi);
        let n = match request_seed {
            Some(seed) if self.length_by_request => {
                let span = u64::from(hi - lo) + 1;
                lo + (crate::text::mix(seed ^ 0x6c65_6e67_7468) % span) as u32
            }
            _ => drawn,
        };
        let ttft_ms = lognormal(rng, self.ttft_median_s, self.ttft_sigma) * 1000.0;
        let reasoning_n = if rng.f64() < self.reasoning_p {
            (n / 4).max(1)
        } else {
            0
        };
        let total = n + reasoning_n;
        let gaps_ms: Vec<f64> = (1..total)
            .map(|_| exponential(rng, self.gap_mean_ms))
            .collect();
        let mut stalls = Vec::new();
        if total >= 2 && rng.f64() < self.long_stall_p {
            let s = lognormal(rng, self.long_stall_median_s, self.long_stall_sigma)
                .clamp(self.long_stall_min_s, self.long_stall_max_s);
            stalls.push(Stall {
                before_chunk: rng.u32(1..total),
                ms: s * 1000.0,
            });
        }
        if total >= 2 && rng.f64() < self.short_stall_p {
            let s = uniform(rng, self.short_stall_min_s, self.short_stall_max_s);
            stalls.push(Stall {
                before_chunk: rng.u32(1..total),
                ms: s * 1000.0,
            });
        }
        let seed = rng.u64(..);
        Behavior {
            ttft_ms,
            chunk_count: Some(n),
            gaps_ms,
            reasoning: (0..reasoning_n)
                .map(|i| crate::text::word(seed, i + 10_000))
                .collect(),
            stalls,
            keepalive_ms: self.keepalive_s.map(|s| s * 1000.0),
            prefill: self.prefill,
            prefill_dialects: self.prefill_dialects.clone(),
            ..Behavior::default()
        }
    }
}

impl Profile {
    /// A built-in profile: `fast`, `long-tail`, `flaky`, `stall`, `fast-chat` or
    /// `reasoning` (see the module docs).
    pub fn named(name: &str, time_scale: f64, seed: u64) -> Result<Profile, ProfileError> {
        let kind = match name {
            "fast" => ProfileKind::LongTail(fast()),
            "long-tail" | "long_tail" => ProfileKind::LongTail(LongTail::default()),
            "flaky" => ProfileKind::Mix(flaky()),
            "stall" => ProfileKind::LongTail(stall()),
            "fast-chat" => ProfileKind::LongTail(fast_chat()),
            "reasoning" => ProfileKind::LongTail(reasoning()),
            other => {
                return Err(ProfileError(format!(
                    "unknown profile `{other}`; known: {}",
                    PROFILE_NAMES.join(", ")
                )))
            }
        };
        let p = Profile {
            name: name.to_string(),
            time_scale,
            seed,
            kind,
        };
        p.validate()?;
        Ok(p)
    }

    /// A command-line argument `NAME|FILE`: a built-in name (real time, seed 0), else a
    /// JSON profile file.
    pub fn from_arg(arg: &str) -> Result<Profile, ProfileError> {
        if PROFILE_NAMES.contains(&arg) || arg == "long_tail" {
            Profile::named(arg, 1.0, 0)
        } else {
            Profile::from_file(arg)
        }
    }

    /// This profile with `policy` on every behavior that does not set its own prefill
    /// policy (a long-tail profile: on every draw).
    pub fn with_prefill(mut self, policy: PrefillPolicy) -> Profile {
        let set = |b: &mut Behavior| {
            if b.prefill_policy().is_none() {
                b.prefill = Some(policy.mode);
                b.prefill_dialects = policy.dialects.clone();
            }
        };
        match &mut self.kind {
            ProfileKind::Fixed(b) => set(b),
            ProfileKind::Mix(m) => m.iter_mut().for_each(|w| set(&mut w.behavior)),
            ProfileKind::LongTail(l) => {
                if l.prefill.is_none() && l.prefill_dialects.is_none() {
                    l.prefill = Some(policy.mode);
                    l.prefill_dialects = policy.dialects.clone();
                }
            }
        }
        self
    }

    /// A profile that always plays `behavior`.
    pub fn fixed(name: &str, behavior: Behavior) -> Profile {
        Profile {
            name: name.to_string(),
            time_scale: 1.0,
            seed: 0,
            kind: ProfileKind::Fixed(Box::new(behavior)),
        }
    }

    /// Reads a JSON profile file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Profile, ProfileError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ProfileError(format!("cannot read {}: {e}", path.display())))?;
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("profile");
        Profile::from_json(&text, stem)
            .map_err(|e| ProfileError(format!("{}: {e}", path.display())))
    }

    /// Parses a JSON profile document; `default_name` names it when it has no `name`.
    pub fn from_json(text: &str, default_name: &str) -> Result<Profile, ProfileError> {
        let f: ProfileFile = serde_json::from_str(text)
            .map_err(|e| ProfileError(format!("invalid profile: {e}")))?;
        let given = [
            f.extends.is_some(),
            f.behavior.is_some(),
            f.mix.is_some(),
            f.long_tail.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if given != 1 {
            return Err(ProfileError(
                "a profile needs exactly one of `extends`, `behavior`, `mix`, `long_tail`".into(),
            ));
        }
        let time_scale = f.time_scale.unwrap_or(1.0);
        let seed = f.seed.unwrap_or(0);
        let prefill =
            (f.prefill.is_some() || f.prefill_dialects.is_some()).then(|| PrefillPolicy {
                mode: f.prefill.unwrap_or_default(),
                dialects: f.prefill_dialects.clone(),
            });
        let p = if let Some(base) = &f.extends {
            let mut p = Profile::named(base, time_scale, seed)?;
            if let Some(n) = f.name {
                p.name = n;
            }
            p
        } else {
            let kind = if let Some(b) = f.behavior {
                ProfileKind::Fixed(Box::new(b))
            } else if let Some(m) = f.mix {
                ProfileKind::Mix(m)
            } else {
                ProfileKind::LongTail(f.long_tail.unwrap_or_default())
            };
            Profile {
                name: f.name.unwrap_or_else(|| default_name.to_string()),
                time_scale,
                seed,
                kind,
            }
        };
        let p = match prefill {
            Some(policy) => p.with_prefill(policy),
            None => p,
        };
        p.validate()?;
        Ok(p)
    }

    /// Checks the scale, weights, probabilities and every behavior.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let err = |m: String| Err(ProfileError(format!("profile {}: {m}", self.name)));
        if !self.time_scale.is_finite() || self.time_scale < 0.0 {
            return err(format!(
                "time_scale {} must be a finite number ≥ 0",
                self.time_scale
            ));
        }
        match &self.kind {
            ProfileKind::Fixed(b) => {
                if let Err(e) = b.validate() {
                    return err(e);
                }
            }
            ProfileKind::Mix(m) => {
                if m.is_empty() {
                    return err("mix is empty".into());
                }
                for (i, w) in m.iter().enumerate() {
                    if !w.weight.is_finite() || w.weight <= 0.0 {
                        return err(format!("mix[{i}].weight must be > 0"));
                    }
                    if let Err(e) = w.behavior.validate() {
                        return err(format!("mix[{i}]: {e}"));
                    }
                }
            }
            ProfileKind::LongTail(l) => {
                let positive = [
                    ("ttft_median_s", l.ttft_median_s),
                    ("long_stall_median_s", l.long_stall_median_s),
                    ("gap_mean_ms", l.gap_mean_ms),
                ];
                for (n, v) in positive {
                    if !v.is_finite() || v <= 0.0 {
                        return err(format!("long_tail.{n} must be > 0"));
                    }
                }
                for (n, v) in [
                    ("long_stall_p", l.long_stall_p),
                    ("short_stall_p", l.short_stall_p),
                    ("reasoning_p", l.reasoning_p),
                ] {
                    if !(0.0..=1.0).contains(&v) {
                        return err(format!("long_tail.{n} must be in 0..=1"));
                    }
                }
                if l.chunks_min == 0 || l.chunks_min > l.chunks_max {
                    return err("long_tail needs 1 ≤ chunks_min ≤ chunks_max".into());
                }
                if l.long_stall_min_s > l.long_stall_max_s
                    || l.short_stall_min_s > l.short_stall_max_s
                {
                    return err("long_tail stall bounds are inverted".into());
                }
                if l.keepalive_s.is_some_and(|k| !k.is_finite() || k <= 0.0) {
                    return err("long_tail.keepalive_s must be > 0".into());
                }
            }
        }
        Ok(())
    }

    /// The profile's RNG, seeded.
    pub fn rng(&self) -> fastrand::Rng {
        fastrand::Rng::with_seed(self.seed)
    }

    /// Draws one behavior, already scaled by `time_scale`.
    pub fn sample(&self, rng: &mut fastrand::Rng) -> Behavior {
        self.sample_for(rng, None)
    }

    /// Draws one behavior for a request with seed `request_seed`, already scaled by
    /// `time_scale` (the seed matters only to [`LongTail::length_by_request`]).
    pub fn sample_for(&self, rng: &mut fastrand::Rng, request_seed: Option<u64>) -> Behavior {
        let b = match &self.kind {
            ProfileKind::Fixed(b) => (**b).clone(),
            ProfileKind::Mix(m) => {
                let total: f64 = m.iter().map(|w| w.weight).sum();
                let mut x = rng.f64() * total;
                let mut pick = &m[m.len() - 1].behavior;
                for w in m {
                    if x < w.weight {
                        pick = &w.behavior;
                        break;
                    }
                    x -= w.weight;
                }
                pick.clone()
            }
            ProfileKind::LongTail(l) => l.sample_for(rng, request_seed),
        };
        b.scaled(self.time_scale)
    }
}

/// Draws keyed by question, shared by the mocks of one workload (common random
/// numbers): the `k`-th request of a question — at whichever mock sharing these draws it
/// arrives — plays the `k`-th behavior of that question's own sequence. What a request
/// plays then depends on its question and on how many requests of it came before, not
/// on the order in which concurrent requests arrive or on which source a gateway picked:
/// two gateway settings (or two runs of one) face the same first leg, the same second
/// leg, … for every question, so their latencies are compared pair by pair.
#[derive(Clone, Debug)]
pub struct PairedDraws {
    seed: u64,
    seen: Arc<Mutex<HashMap<u64, u32>>>,
}

impl PairedDraws {
    /// Fresh draws (no question seen yet) from `seed`.
    pub fn new(seed: u64) -> Self {
        PairedDraws {
            seed,
            seen: Arc::default(),
        }
    }

    /// The RNG of the next request of the question whose seed is `request_seed`.
    fn next_rng(&self, request_seed: u64) -> fastrand::Rng {
        let k = {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            let n = seen.entry(request_seed).or_insert(0);
            *n += 1;
            *n - 1
        };
        let key = crate::text::mix(request_seed ^ self.seed)
            ^ crate::text::mix(u64::from(k).wrapping_add(0x9e37_79b9_7f4a_7c15));
        fastrand::Rng::with_seed(crate::text::mix(key))
    }
}

impl Profile {
    /// Draws the behavior of the next request of question `request_seed` from `draws`
    /// (see [`PairedDraws`]), already scaled by `time_scale`.
    pub fn sample_paired(&self, draws: &PairedDraws, request_seed: u64) -> Behavior {
        self.sample_for(&mut draws.next_rng(request_seed), Some(request_seed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_draws_follow_the_question_and_its_count_not_the_arrival_order() {
        let p = Profile::named("long-tail", 1.0, 7).unwrap();
        let (a, b) = (PairedDraws::new(1), PairedDraws::new(1));
        // Questions 10, 11, 12, each asked three times, in two different orders.
        let order_a = [10, 11, 12, 10, 11, 12, 10, 11, 12];
        let order_b = [12, 12, 11, 10, 12, 10, 11, 11, 10];
        let play = |d: &PairedDraws, order: &[u64]| {
            let mut by_q: HashMap<u64, Vec<Behavior>> = HashMap::new();
            for &q in order {
                by_q.entry(q).or_default().push(p.sample_paired(d, q));
            }
            by_q
        };
        let (ra, rb) = (play(&a, &order_a), play(&b, &order_b));
        assert_eq!(ra, rb);
        // A question's second request is not a replay of its first, nor another
        // question's first: each leg is a draw of its own.
        assert_ne!(ra[&10][0], ra[&10][1]);
        assert_ne!(ra[&10][0], ra[&11][0]);
        // Another seed, other draws.
        let c = PairedDraws::new(2);
        assert_ne!(p.sample_paired(&c, 10), ra[&10][0]);
    }

    fn percentile(v: &mut [f64], p: f64) -> f64 {
        v.sort_by(|a, b| a.total_cmp(b));
        v[((v.len() - 1) as f64 * p).round() as usize]
    }

    #[test]
    fn long_tail_matches_spec_shape() {
        let p = Profile::named("long-tail", 1.0, 42).unwrap();
        let mut rng = p.rng();
        let n = 20_000;
        let mut ttft = Vec::new();
        let (mut long, mut short, mut chunks_ok) = (0, 0, true);
        let mut gaps = Vec::new();
        for _ in 0..n {
            let b = p.sample(&mut rng);
            ttft.push(b.ttft_ms / 1000.0);
            let c = b.chunk_count.unwrap();
            chunks_ok &= (50..=400).contains(&c);
            gaps.extend(b.gaps_ms.iter().copied());
            for s in &b.stalls {
                if s.ms >= 20_000.0 {
                    assert!(s.ms <= 120_000.0);
                    long += 1;
                } else {
                    assert!((1000.0..=5000.0).contains(&s.ms));
                    short += 1;
                }
            }
        }
        assert!(chunks_ok);
        let med = percentile(&mut ttft, 0.5);
        assert!((1.45..1.75).contains(&med), "ttft median {med}");
        let long_share = long as f64 / n as f64;
        assert!(
            (0.17..0.21).contains(&long_share),
            "long stalls {long_share}"
        );
        let short_share = short as f64 / n as f64;
        assert!(
            (0.28..0.32).contains(&short_share),
            "short stalls {short_share}"
        );
        let mean_gap = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((29.0..31.0).contains(&mean_gap), "gap mean {mean_gap}");
    }

    /// TTFTs (s), stalls (s) of stalled answers, chunk counts and every gap (ms) of
    /// `n` draws of a named profile.
    fn draws(name: &str, n: usize) -> (Vec<f64>, Vec<Vec<f64>>, Vec<u32>, Vec<f64>) {
        let p = Profile::named(name, 1.0, 42).unwrap();
        let mut rng = p.rng();
        let (mut ttft, mut stalls, mut chunks, mut gaps) = (vec![], vec![], vec![], vec![]);
        for _ in 0..n {
            let b = p.sample(&mut rng);
            ttft.push(b.ttft_ms / 1000.0);
            stalls.push(b.stalls.iter().map(|s| s.ms / 1000.0).collect());
            chunks.push(b.chunk_count.unwrap());
            gaps.extend(b.gaps_ms.iter().copied());
            assert!(b.reasoning.is_empty(), "{name}: no reasoning");
        }
        (ttft, stalls, chunks, gaps)
    }

    #[test]
    fn fast_chat_has_a_fast_ttft_and_rare_stalls() {
        let n = 40_000;
        let (mut ttft, stalls, chunks, gaps) = draws("fast-chat", n);
        let (med, p99) = (percentile(&mut ttft, 0.5), percentile(&mut ttft, 0.99));
        assert!((0.38..0.42).contains(&med), "ttft median {med}");
        assert!((2.7..3.3).contains(&p99), "ttft p99 {p99}");
        assert!(chunks.iter().all(|c| (30..=150).contains(c)));
        let mean_gap = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((24.0..26.0).contains(&mean_gap), "gap mean {mean_gap}");
        // Stalls of 3 s or more (the rare mid-stream stalls) in ≈ 3 % of answers,
        // clipped to 3–30 s; ordinary pauses (0.3–1.5 s) in ≈ 10 %.
        let long: Vec<f64> = stalls
            .iter()
            .flatten()
            .copied()
            .filter(|s| *s >= 3.0)
            .collect();
        let pauses = stalls.iter().flatten().filter(|s| **s < 3.0).count();
        let long_share = long.len() as f64 / n as f64;
        assert!(
            (0.026..0.034).contains(&long_share),
            "long stalls {long_share}"
        );
        assert!(long.iter().all(|s| *s <= 30.0));
        let mut long = long;
        let long_med = percentile(&mut long, 0.5);
        assert!((7.0..9.0).contains(&long_med), "stall median {long_med}");
        let pause_share = pauses as f64 / n as f64;
        assert!((0.09..0.11).contains(&pause_share), "pauses {pause_share}");
        assert!(stalls
            .iter()
            .flatten()
            .all(|s| *s >= 3.0 || (0.3..=1.5).contains(s)));
    }

    #[test]
    fn reasoning_has_a_slow_ttft_then_streams_steadily() {
        let n = 20_000;
        let (mut ttft, stalls, chunks, gaps) = draws("reasoning", n);
        let (med, p90, p99) = (
            percentile(&mut ttft, 0.5),
            percentile(&mut ttft, 0.9),
            percentile(&mut ttft, 0.99),
        );
        assert!((14.3..15.7).contains(&med), "ttft median {med}");
        assert!((36.0..44.0).contains(&p90), "ttft p90 {p90}");
        assert!((80.0..100.0).contains(&p99), "ttft p99 {p99}");
        assert!(stalls.iter().all(Vec::is_empty), "no stalls");
        assert!(chunks.iter().all(|c| (100..=600).contains(c)));
        let mean_gap = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((19.5..20.5).contains(&mean_gap), "gap mean {mean_gap}");
        // Steady: no gap anywhere near a stall threshold (≥ 1 s).
        let max_gap = gaps.iter().copied().fold(0.0, f64::max);
        assert!(max_gap < 600.0, "longest gap {max_gap} ms");
    }

    #[test]
    fn same_seed_same_sequence_and_scaling() {
        let a = Profile::named("flaky", 0.01, 7).unwrap();
        let (mut r1, mut r2) = (a.rng(), a.rng());
        for _ in 0..50 {
            assert_eq!(a.sample(&mut r1), a.sample(&mut r2));
        }
        let lt = Profile::named("long-tail", 0.01, 1).unwrap();
        let b = lt.sample(&mut lt.rng());
        let unscaled = Profile::named("long-tail", 1.0, 1).unwrap();
        let c = unscaled.sample(&mut unscaled.rng());
        assert!((b.ttft_ms - c.ttft_ms * 0.01).abs() < 1e-9);
    }

    #[test]
    fn flaky_draws_faults_in_proportion() {
        let p = Profile::named("flaky", 1.0, 3).unwrap();
        let mut rng = p.rng();
        let n = 10_000;
        let ok = (0..n)
            .filter(|_| {
                let b = p.sample(&mut rng);
                b.status == 200 && b.fault.is_none()
            })
            .count();
        let share = ok as f64 / n as f64;
        assert!((0.67..0.73).contains(&share), "{share}");
    }

    #[test]
    fn prefill_policy_in_profiles() {
        use crate::prefill::{PrefillDialect, PrefillMode, PrefillPolicy};
        let p = Profile::from_json(
            r#"{"extends":"fast","prefill":"reject","prefill_dialects":["prefix"]}"#,
            "x",
        )
        .unwrap();
        let b = p.sample(&mut p.rng());
        assert_eq!(
            b.prefill_policy(),
            Some(PrefillPolicy {
                mode: PrefillMode::Reject,
                dialects: Some(vec![PrefillDialect::Prefix]),
            })
        );
        // A behavior's own policy is kept; the others get the profile's.
        let p = Profile::from_json(
            r#"{"prefill":"ignore","mix":[{"weight":1,"behavior":{"prefill":"accept"}},{"weight":1,"behavior":{}}]}"#,
            "x",
        )
        .unwrap();
        match &p.kind {
            ProfileKind::Mix(m) => {
                assert_eq!(m[0].behavior.prefill, Some(PrefillMode::Accept));
                assert_eq!(m[1].behavior.prefill, Some(PrefillMode::Ignore));
            }
            other => panic!("{other:?}"),
        }
        let p = Profile::from_json(r#"{"long_tail":{"prefill_dialects":["vllm"]}}"#, "x").unwrap();
        let b = p.sample(&mut p.rng());
        assert_eq!(b.prefill_dialects, Some(vec![PrefillDialect::Vllm]));
        let p = Profile::named("stall", 1.0, 0)
            .unwrap()
            .with_prefill(PrefillPolicy::ignore());
        assert_eq!(p.sample(&mut p.rng()).prefill, Some(PrefillMode::Ignore));
        assert!(Profile::from_json(r#"{"extends":"fast","prefill":"maybe"}"#, "x").is_err());
        // Built-in profiles leave the policy to the server.
        for n in PROFILE_NAMES {
            let p = Profile::named(n, 1.0, 0).unwrap();
            assert_eq!(p.sample(&mut p.rng()).prefill_policy(), None, "{n}");
        }
    }

    #[test]
    fn files_and_errors() {
        let p =
            Profile::from_json(r#"{"extends":"stall","time_scale":0.5,"seed":9}"#, "x").unwrap();
        assert_eq!((p.name.as_str(), p.time_scale, p.seed), ("stall", 0.5, 9));
        let p = Profile::from_json(
            r#"{"name":"mine","mix":[{"weight":1,"behavior":{"status":503}},{"weight":3,"behavior":{}}]}"#,
            "x",
        )
        .unwrap();
        assert!(matches!(p.kind, ProfileKind::Mix(ref m) if m.len() == 2));
        let p = Profile::from_json(r#"{"long_tail":{"long_stall_p":0.5}}"#, "lt").unwrap();
        match p.kind {
            ProfileKind::LongTail(l) => {
                assert_eq!(l.long_stall_p, 0.5);
                assert_eq!(l.ttft_median_s, 1.6);
            }
            _ => panic!("not long tail"),
        }
        assert_eq!(p.name, "lt");
        assert!(Profile::from_json("{}", "x").is_err());
        assert!(Profile::from_json(r#"{"extends":"nope"}"#, "x").is_err());
        assert!(Profile::from_json(r#"{"behavior":{},"mix":[]}"#, "x").is_err());
        assert!(Profile::from_json(r#"{"mix":[{"weight":0,"behavior":{}}]}"#, "x").is_err());
        assert!(Profile::from_json(r#"{"behavior":{"status":1000}}"#, "x").is_err());
        assert!(Profile::from_json(r#"{"behavior":{},"typo":1}"#, "x").is_err());
        for n in PROFILE_NAMES {
            assert!(Profile::named(n, 1.0, 0).is_ok(), "{n}");
            assert_eq!(Profile::from_arg(n).unwrap().name, *n);
        }
        let err = Profile::from_arg("/nonexistent/profile.json").unwrap_err();
        assert!(err.to_string().contains("cannot read"), "{err}");
    }
}
