//! Live latency distributions (SPEC §19.1), pure: per source, the time to the first
//! incremental chunk (TTFT) and the gaps between incremental chunks — from the engine,
//! each streamed leg's longest gap ([`ScopeLatency::leg_ended`]), so that a quantile
//! reads directly as a share of legs — kept as mergeable quantile sketches that decay
//! over a window. Time comes in as `Instant` arguments.
//!
//! - [`LatencySketch`]: one distribution. Bins are HdrHistogram's (2 significant
//!   figures: a value's bin is within 1 % of it, in whole milliseconds, up to
//!   [`MAX_SAMPLE_MS`]); counts are integers, so [`LatencySketch::merge`] is exact,
//!   commutative and associative: merge order never changes a quantile.
//! - [`DecayingSketch`]: a ring of [`SLOTS`] per-interval sketches and their running
//!   merge; a sample leaves between 0.9 × and 1 × the window after it was recorded.
//! - [`ScopeLatency`]: a scope's sources (TTFT and gaps each), what the engine records
//!   into, with the per-process delta and the merged remote view of SPEC §19.2.
//!
//! # The no-feedback-loop rule (censored samples)
//!
//! Every leg's first token is a sample of its own source. A leg that ends before its
//! first token (cancelled because another leg won, killed by a watchdog, failed) is a
//! *censored* sample at that time: its true TTFT is known only to be at least that long.
//! Likewise a leg that ends in the middle of a gap gives a censored gap. Censored samples
//! are weighed by the Kaplan–Meier estimator: a censored sample's mass goes to the
//! samples above it, never below. Hence the invariants, property-tested below:
//!
//! 1. adding censored samples never lowers any quantile (compared with leaving them out,
//!    and compared with reading them as ordinary samples at their censoring time);
//! 2. below the lowest censoring time the estimate is exactly the truth: cancelling legs
//!    at or after a threshold `T` cannot move the estimate of anything below `T`, so a
//!    hedge that fires at `T` and cancels the slow primary can never drive the next
//!    threshold below `min(T, the true quantile)` — the threshold cannot spiral down.
//!
//! (Recording survivors only — dropping cancelled legs — pulls quantiles down and closes
//! the loop: lower threshold, more hedges, more cancelled slow legs, lower threshold.)
//!
//! # Serialization (for the Redis merge of SPEC §19.2)
//!
//! A sketch is a set of bins `(kind, value_ms, count)` plus a leg count; merging is the
//! sum of counts per bin. Two forms, both exact and order-independent:
//! - [`LatencySketch::to_bytes`] / [`LatencySketch::from_bytes`]: version byte 1, LEB128
//!   varints: `legs`, then the observed bins and the censored bins, each as a count of
//!   bins followed by `(value_ms − previous value_ms, count)` pairs in ascending order;
//! - [`LatencySketch::to_fields`] / [`LatencySketch::from_fields`]: `("o<ms>", count)`,
//!   `("c<ms>", count)` and `("legs", n)`, for a Redis hash merged with `HINCRBY`.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::hedge::{self, ThresholdOrigin, ThresholdSetting, Thresholds};
use crate::settings::HedgeSettings;

/// Largest sample kept, in ms (one hour); longer samples count at this value.
pub const MAX_SAMPLE_MS: u64 = 3_600_000;

/// Slots of a [`DecayingSketch`]'s ring (each covers `window / SLOTS`).
pub const SLOTS: u64 = 10;

/// Default `HEDGE__WINDOW_S`.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(600);

/// HdrHistogram precision: 2 significant figures (bins within 1 % of their values).
const SIGFIG: u8 = 2;

/// Version byte of [`LatencySketch::to_bytes`].
const FORMAT_VERSION: u8 = 1;

/// Survival at or below `1 − q + EPS` reaches the q-quantile (float noise in the
/// Kaplan–Meier product must not move a quantile by a bin).
const EPS: f64 = 1e-9;

/// Whether a sample is an observation or a lower bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SampleKind {
    /// The event happened after this long (a first token, the end of a gap).
    Observed,
    /// The leg ended this long without the event: the true value is at least this.
    Censored,
}

/// One bin of a sketch: `count` samples of `kind` in the bin whose lowest value is
/// `value_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bin {
    /// Observed or censored.
    pub kind: SampleKind,
    /// The bin's lowest value, ms.
    pub value_ms: u64,
    /// Samples in the bin.
    pub count: u64,
}

/// A sketch that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SketchDecodeError {
    /// Unknown format version.
    #[error("latency sketch: unknown format version {0}")]
    Version(u8),
    /// The bytes end early or a varint is malformed.
    #[error("latency sketch: truncated or malformed")]
    Truncated,
    /// Bytes after the sketch.
    #[error("latency sketch: {0} trailing bytes")]
    Trailing(usize),
    /// A bin out of order, above [`MAX_SAMPLE_MS`], or with a zero count.
    #[error("latency sketch: invalid bin")]
    InvalidBin,
    /// A field name that is not `legs`, `o<ms>` or `c<ms>`.
    #[error("latency sketch: unknown field {0:?}")]
    Field(String),
}

fn histogram() -> Histogram<u32> {
    Histogram::new(SIGFIG).expect("2 significant figures are a valid precision")
}

fn to_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis())
        .unwrap_or(u64::MAX)
        .min(MAX_SAMPLE_MS)
}

/// Adds `count` samples at `ms` (a bin's count saturates at `u32::MAX`: 4 billion
/// samples in one bin within one window).
fn put(h: &mut Histogram<u32>, ms: u64, count: u64) {
    let n = u32::try_from(count).unwrap_or(u32::MAX);
    if n > 0 {
        h.record_n(ms.min(MAX_SAMPLE_MS), n)
            .expect("values up to MAX_SAMPLE_MS fit an auto-resizing histogram");
    }
}

/// (lowest value, highest value, count) of each non-empty bin, ascending.
fn bins_of(h: &Histogram<u32>) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    h.iter_recorded().map(move |v| {
        let hi = v.value_iterated_to();
        (h.lowest_equivalent(hi), hi, u64::from(v.count_at_value()))
    })
}

/// One distribution: observed and censored samples in HdrHistogram bins, and the number
/// of legs they came from (for gaps: streamed legs past their first token; the
/// [`ScopeLatency`] counts one leg per TTFT sample).
#[derive(Clone)]
pub struct LatencySketch {
    observed: Histogram<u32>,
    censored: Histogram<u32>,
    legs: u64,
}

impl Default for LatencySketch {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for LatencySketch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LatencySketch")
            .field("observed", &self.observed())
            .field("censored", &self.censored())
            .field("legs", &self.legs)
            .field("p50", &self.quantile(0.5))
            .field("p90", &self.quantile(0.9))
            .finish()
    }
}

/// Equal when they hold the same bins and legs (whatever their histograms' sizes).
impl PartialEq for LatencySketch {
    fn eq(&self, other: &Self) -> bool {
        self.legs == other.legs && self.bins().eq(other.bins())
    }
}

impl Eq for LatencySketch {}

impl LatencySketch {
    /// An empty sketch.
    pub fn new() -> Self {
        LatencySketch {
            observed: histogram(),
            censored: histogram(),
            legs: 0,
        }
    }

    /// An observed sample: the event happened `d` after its start.
    pub fn observe(&mut self, d: Duration) {
        put(&mut self.observed, to_ms(d), 1);
    }

    /// A censored sample: the leg ended `d` after its start without the event.
    pub fn censor(&mut self, d: Duration) {
        put(&mut self.censored, to_ms(d), 1);
    }

    /// A sample of either kind.
    pub fn record(&mut self, kind: SampleKind, d: Duration) {
        self.record_n(kind, d, 1);
    }

    /// `n` samples of one kind and value.
    pub fn record_n(&mut self, kind: SampleKind, d: Duration, n: u64) {
        let h = match kind {
            SampleKind::Observed => &mut self.observed,
            SampleKind::Censored => &mut self.censored,
        };
        put(h, to_ms(d), n);
    }

    /// Counts `n` more legs.
    pub fn add_legs(&mut self, n: u64) {
        self.legs = self.legs.saturating_add(n);
    }

    /// Adds a bin (as read from [`LatencySketch::bins`] of another sketch).
    pub fn add_bin(&mut self, bin: Bin) {
        let h = match bin.kind {
            SampleKind::Observed => &mut self.observed,
            SampleKind::Censored => &mut self.censored,
        };
        put(h, bin.value_ms, bin.count);
    }

    /// The non-empty bins: observed ones ascending, then censored ones ascending.
    pub fn bins(&self) -> impl Iterator<Item = Bin> + '_ {
        let of = |kind, h| {
            bins_of(h).map(move |(lo, _, count)| Bin {
                kind,
                value_ms: lo,
                count,
            })
        };
        of(SampleKind::Observed, &self.observed).chain(of(SampleKind::Censored, &self.censored))
    }

    /// Observed samples.
    pub fn observed(&self) -> u64 {
        self.observed.len()
    }

    /// Censored samples.
    pub fn censored(&self) -> u64 {
        self.censored.len()
    }

    /// All samples (observed and censored).
    pub fn samples(&self) -> u64 {
        self.observed() + self.censored()
    }

    /// Legs counted with [`LatencySketch::add_legs`].
    pub fn legs(&self) -> u64 {
        self.legs
    }

    /// How much the sketch knows: `min(samples, legs)` — what `HEDGE__MIN_SAMPLES` is
    /// compared with (for TTFT samples = legs; a stream's many gaps count as one leg).
    pub fn evidence(&self) -> u64 {
        self.samples().min(self.legs)
    }

    /// Samples per leg (1 with no legs counted): gaps per streamed leg.
    pub fn samples_per_leg(&self) -> f64 {
        if self.legs == 0 {
            1.0
        } else {
            self.samples() as f64 / self.legs as f64
        }
    }

    /// No samples and no legs.
    pub fn is_empty(&self) -> bool {
        self.samples() == 0 && self.legs == 0
    }

    /// Adds `other`'s samples and legs (exact: counts add per bin).
    pub fn merge(&mut self, other: &LatencySketch) {
        for (mine, theirs) in [
            (&mut self.observed, &other.observed),
            (&mut self.censored, &other.censored),
        ] {
            mine.add(theirs)
                .expect("values up to MAX_SAMPLE_MS fit an auto-resizing histogram");
        }
        self.legs = self.legs.saturating_add(other.legs);
    }

    /// Both kinds per bin, ascending: (highest value, observed, censored).
    fn walk(&self) -> Vec<(u64, u64, u64)> {
        let mut out: Vec<(u64, u64, u64)> = Vec::new();
        let mut o = bins_of(&self.observed).peekable();
        let mut c = bins_of(&self.censored).peekable();
        loop {
            let next = match (o.peek(), c.peek()) {
                (None, None) => break,
                (Some(&(lo, hi, d)), Some(&(clo, _, n))) if lo == clo => {
                    o.next();
                    c.next();
                    (hi, d, n)
                }
                (Some(&(lo, hi, d)), Some(&(clo, _, _))) if lo < clo => {
                    o.next();
                    (hi, d, 0)
                }
                (Some(&(_, hi, d)), None) => {
                    o.next();
                    (hi, d, 0)
                }
                (_, Some(&(_, hi, n))) => {
                    c.next();
                    (hi, 0, n)
                }
            };
            out.push(next);
        }
        out
    }

    /// The Kaplan–Meier estimate of `P(value ≤ d)` (at the bin holding `d`); `None` when
    /// empty. Without censored samples this is the plain empirical fraction.
    pub fn cdf(&self, d: Duration) -> Option<f64> {
        let total = self.samples();
        if total == 0 {
            return None;
        }
        let ms = to_ms(d);
        let mut at_risk = total;
        let mut survival = 1.0f64;
        for (hi, dead, cens) in self.walk() {
            if self.observed.lowest_equivalent(hi) > ms {
                break;
            }
            if dead > 0 {
                survival *= (at_risk - dead) as f64 / at_risk as f64;
            }
            at_risk -= dead + cens;
        }
        Some(1.0 - survival)
    }

    /// The q-quantile by the Kaplan–Meier estimator (the highest value of the first bin
    /// where the estimated CDF reaches `q`); `None` when empty. When censored samples
    /// leave the estimate short of `q` (the slowest samples are all lower bounds), the
    /// highest value seen: a lower bound of the quantile.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        self.quantiles(&[q]).into_iter().next()
    }

    /// [`Self::quantile`] of each of `qs`, in one walk of the bins (empty when the
    /// sketch is).
    pub fn quantiles(&self, qs: &[f64]) -> Vec<Duration> {
        let total = self.samples();
        if total == 0 {
            return Vec::new();
        }
        // (target survival, position in `qs`), highest target (lowest quantile) first.
        let mut targets: Vec<(f64, usize)> = qs
            .iter()
            .enumerate()
            .map(|(i, &q)| {
                let q = if q.is_nan() { 1.0 } else { q.clamp(0.0, 1.0) };
                (1.0 - q + EPS, i)
            })
            .collect();
        targets.sort_by(|a, b| b.0.total_cmp(&a.0));
        let mut out = vec![Duration::ZERO; qs.len()];
        let mut next = 0;
        let mut at_risk = total;
        let mut survival = 1.0f64;
        let mut highest = 0;
        for (hi, dead, cens) in self.walk() {
            if dead > 0 {
                survival *= (at_risk - dead) as f64 / at_risk as f64;
                while next < targets.len() && survival <= targets[next].0 {
                    out[targets[next].1] = Duration::from_millis(hi);
                    next += 1;
                }
                if next == targets.len() {
                    return out;
                }
            }
            at_risk -= dead + cens;
            highest = hi;
        }
        for &(_, i) in &targets[next..] {
            out[i] = Duration::from_millis(highest);
        }
        out
    }

    /// The expected excess over `c`, `E[(X − c)⁺]` in ms, by the Kaplan–Meier estimate:
    /// each observed bin weighs its estimated probability mass at its highest value; the
    /// mass the estimate leaves above the last observed sample (the slowest samples were
    /// censored) sits at the highest value seen — a lower bound, like [`Self::quantile`]'s.
    /// `None` when empty. Censored samples never lower it (their mass moves up).
    pub fn excess_ms(&self, c: Duration) -> Option<f64> {
        (self.samples() > 0).then(|| self.tail().excess_ms(c))
    }

    /// The Kaplan–Meier probability masses as [`Self::excess_ms`] weighs them — one per
    /// observed bin at its highest value, and what the estimate leaves above the last
    /// observation at the highest value seen — ready for many excess queries
    /// ([`Tail::excess_ms`], a binary search each).
    pub fn tail(&self) -> Tail {
        let mut masses: Vec<(f64, f64)> = Vec::new();
        let total = self.samples();
        if total > 0 {
            let mut at_risk = total;
            let mut survival = 1.0f64;
            let mut highest = 0u64;
            for (hi, dead, cens) in self.walk() {
                if dead > 0 {
                    let after = survival * (at_risk - dead) as f64 / at_risk as f64;
                    masses.push((hi as f64, survival - after));
                    survival = after;
                }
                at_risk -= dead + cens;
                highest = hi;
            }
            if survival > 0.0 {
                masses.push((highest as f64, survival));
            }
        }
        Tail::of(&masses)
    }

    /// The compact binary form (see the module docs).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![FORMAT_VERSION];
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut Vec<u8>) {
        put_varint(out, self.legs);
        for h in [&self.observed, &self.censored] {
            let bins: Vec<(u64, u64, u64)> = bins_of(h).collect();
            put_varint(out, bins.len() as u64);
            let mut prev = 0;
            for (lo, _, count) in bins {
                put_varint(out, lo - prev);
                put_varint(out, count);
                prev = lo;
            }
        }
    }

    /// Decodes [`LatencySketch::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SketchDecodeError> {
        let mut r = Reader { bytes, at: 0 };
        match r.byte()? {
            FORMAT_VERSION => {}
            v => return Err(SketchDecodeError::Version(v)),
        }
        let s = Self::read(&mut r)?;
        r.finish()?;
        Ok(s)
    }

    fn read(r: &mut Reader<'_>) -> Result<Self, SketchDecodeError> {
        let mut s = LatencySketch::new();
        s.legs = r.varint()?;
        for kind in [SampleKind::Observed, SampleKind::Censored] {
            let n = r.varint()?;
            let mut value = 0u64;
            for i in 0..n {
                let step = r.varint()?;
                if i > 0 && step == 0 {
                    return Err(SketchDecodeError::InvalidBin);
                }
                value = value
                    .checked_add(step)
                    .ok_or(SketchDecodeError::InvalidBin)?;
                let count = r.varint()?;
                if value > MAX_SAMPLE_MS || count == 0 {
                    return Err(SketchDecodeError::InvalidBin);
                }
                s.add_bin(Bin {
                    kind,
                    value_ms: value,
                    count,
                });
            }
        }
        Ok(s)
    }

    /// The sketch as hash fields: `("legs", n)` (when non-zero), `("o<ms>", count)`,
    /// `("c<ms>", count)`. Adding fields per name (Redis `HINCRBY`) is [`merge`].
    ///
    /// [`merge`]: LatencySketch::merge
    pub fn to_fields(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        if self.legs > 0 {
            out.push(("legs".to_string(), self.legs));
        }
        out.extend(self.bins().map(|b| {
            let tag = match b.kind {
                SampleKind::Observed => 'o',
                SampleKind::Censored => 'c',
            };
            (format!("{tag}{}", b.value_ms), b.count)
        }));
        out
    }

    /// A sketch from hash fields (any order; repeated fields add up).
    pub fn from_fields<'a, I>(fields: I) -> Result<Self, SketchDecodeError>
    where
        I: IntoIterator<Item = (&'a str, u64)>,
    {
        let mut s = LatencySketch::new();
        for (name, count) in fields {
            if name == "legs" {
                s.add_legs(count);
                continue;
            }
            let kind = match name.as_bytes().first() {
                Some(b'o') => SampleKind::Observed,
                Some(b'c') => SampleKind::Censored,
                _ => return Err(SketchDecodeError::Field(name.to_string())),
            };
            let value_ms: u64 = name[1..]
                .parse()
                .map_err(|_| SketchDecodeError::Field(name.to_string()))?;
            if value_ms > MAX_SAMPLE_MS {
                return Err(SketchDecodeError::InvalidBin);
            }
            if count > 0 {
                s.add_bin(Bin {
                    kind,
                    value_ms,
                    count,
                });
            }
        }
        Ok(s)
    }
}

/// A distribution's probability masses with their suffix sums (see
/// [`LatencySketch::tail`]): `E[(X − c)⁺]` for any `c` by one binary search.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tail {
    /// Values (ms), ascending (equal values allowed).
    values: Vec<f64>,
    /// `Σ mass` over the values from index `i` on (one more entry: 0).
    mass_from: Vec<f64>,
    /// `Σ mass × value` over the values from index `i` on (one more entry: 0).
    moment_from: Vec<f64>,
}

impl Tail {
    /// From (value ms, mass) pairs in ascending order of value.
    fn of(masses: &[(f64, f64)]) -> Tail {
        let n = masses.len();
        let mut mass_from = vec![0.0; n + 1];
        let mut moment_from = vec![0.0; n + 1];
        for i in (0..n).rev() {
            let (v, m) = masses[i];
            mass_from[i] = mass_from[i + 1] + m;
            moment_from[i] = moment_from[i + 1] + m * v;
        }
        Tail {
            values: masses.iter().map(|&(v, _)| v).collect(),
            mass_from,
            moment_from,
        }
    }

    /// `P(X > c)` (0 for an empty distribution).
    pub fn survival(&self, c: Duration) -> f64 {
        let c = c.as_secs_f64() * 1000.0;
        self.mass_from[self.values.partition_point(|&v| v <= c)]
    }

    /// The distinct values that carry mass (ms), ascending: where `P(X > c)` steps down.
    pub fn points(&self) -> impl Iterator<Item = f64> + '_ {
        let mut last = f64::NAN;
        self.values.iter().copied().filter(move |&v| {
            let new = v != last;
            last = v;
            new
        })
    }

    /// `E[(X − c)⁺]` in ms (0 for an empty distribution).
    pub fn excess_ms(&self, c: Duration) -> f64 {
        let c = c.as_secs_f64() * 1000.0;
        let i = self.values.partition_point(|&v| v <= c);
        (self.moment_from[i] - c * self.mass_from[i]).max(0.0)
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> Result<u8, SketchDecodeError> {
        let b = *self
            .bytes
            .get(self.at)
            .ok_or(SketchDecodeError::Truncated)?;
        self.at += 1;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64, SketchDecodeError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            let part = u64::from(b & 0x7f);
            if shift == 63 && part > 1 {
                return Err(SketchDecodeError::Truncated);
            }
            v |= part << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(SketchDecodeError::Truncated)
    }

    fn finish(&self) -> Result<(), SketchDecodeError> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            n => Err(SketchDecodeError::Trailing(n)),
        }
    }
}

/// A sketch that forgets: a ring of [`SLOTS`] per-interval sketches (each `window /
/// SLOTS` long) and their running merge. A sample recorded at `t` is counted until
/// between `t + 0.9 × window` and `t + window`. An instant older than the newest slot
/// counts in the newest slot (slots stay in time order whatever order instants come in).
#[derive(Debug, Clone)]
pub struct DecayingSketch {
    slot_len: Duration,
    origin: Option<Instant>,
    /// (slot index, samples of that slot), oldest first, strictly increasing indices.
    slots: VecDeque<(u64, LatencySketch)>,
    /// The merge of `slots`.
    total: LatencySketch,
}

impl DecayingSketch {
    /// An empty sketch over `window` (at least 10 ms).
    pub fn new(window: Duration) -> Self {
        let slot_len = (window / SLOTS as u32).max(Duration::from_millis(1));
        DecayingSketch {
            slot_len,
            origin: None,
            slots: VecDeque::new(),
            total: LatencySketch::new(),
        }
    }

    /// The window (`SLOTS` slots).
    pub fn window(&self) -> Duration {
        self.slot_len * SLOTS as u32
    }

    fn slot_index(&mut self, now: Instant) -> u64 {
        let origin = *self.origin.get_or_insert(now);
        let idx = (now.saturating_duration_since(origin).as_nanos() / self.slot_len.as_nanos())
            .try_into()
            .unwrap_or(u64::MAX);
        self.slots.back().map_or(idx, |&(last, _)| idx.max(last))
    }

    fn advance(&mut self, idx: u64) {
        let mut expired = false;
        while let Some(&(s, _)) = self.slots.front() {
            if s.saturating_add(SLOTS) <= idx {
                self.slots.pop_front();
                expired = true;
            } else {
                break;
            }
        }
        if expired {
            let mut total = LatencySketch::new();
            for (_, s) in &self.slots {
                total.merge(s);
            }
            self.total = total;
        }
    }

    /// Applies `f` to the current slot and to the running merge.
    fn with_current(&mut self, now: Instant, f: impl Fn(&mut LatencySketch)) {
        let idx = self.slot_index(now);
        self.advance(idx);
        if self.slots.back().map(|s| s.0) != Some(idx) {
            self.slots.push_back((idx, LatencySketch::new()));
        }
        if let Some((_, s)) = self.slots.back_mut() {
            f(s);
        }
        f(&mut self.total);
    }

    /// Records a sample at `now`.
    pub fn record(&mut self, now: Instant, kind: SampleKind, d: Duration) {
        self.record_n(now, kind, d, 1);
    }

    /// Records `n` samples of one value at `now`.
    pub fn record_n(&mut self, now: Instant, kind: SampleKind, d: Duration, n: u64) {
        self.with_current(now, |s| s.record_n(kind, d, n));
    }

    /// Counts `n` legs at `now`.
    pub fn add_legs(&mut self, now: Instant, n: u64) {
        self.with_current(now, |s| s.add_legs(n));
    }

    /// Adds a whole sketch at `now`.
    pub fn merge_at(&mut self, now: Instant, other: &LatencySketch) {
        self.with_current(now, |s| s.merge(other));
    }

    /// The samples in the window at `now`.
    pub fn snapshot(&mut self, now: Instant) -> &LatencySketch {
        let idx = self.slot_index(now);
        self.advance(idx);
        &self.total
    }
}

/// When a leg's events happened (what [`ScopeLatency::leg_ended`] derives its samples
/// from).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LegTimes {
    /// Launched.
    pub launched: Instant,
    /// Its first incremental chunk arrived.
    pub first_chunk: Option<Instant>,
    /// Its last incremental chunk arrived.
    pub last_chunk: Option<Instant>,
    /// It ended (its answer completed, it failed, or it was cancelled).
    pub ended: Instant,
    /// It completed its answer (a success, won or not).
    pub completed: bool,
    /// It continues an answer another leg delivered in part (a resume leg): its first
    /// token counts, its gaps do not — it streams only the rest of an answer, so its
    /// longest gap is of another population, and counting such legs would lower the
    /// stall threshold as hedging grows (more resume legs, more short legs: the
    /// feedback loop of SPEC §19.1).
    pub continues: bool,
}

/// The gaps between a leg's incremental chunks, tallied as they come (the engine's leg
/// observer keeps one per leg; chunks it folds would otherwise hide them). Gaps below
/// `floor` — the `auto` stall threshold's lower bound, under which no stall threshold
/// can be — are counted with their largest value only: every threshold at or above the
/// floor is the same as with each gap kept (their count and their side of the floor is
/// all a quantile at or above it needs). Gaps at or above it are kept one by one, at most
/// [`GapTally::MAX_LARGE`] (beyond that, they join the count at their maximum).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GapTally {
    /// Gaps below the floor.
    pub small: u64,
    /// The largest of them.
    pub small_max: Duration,
    /// Gaps at or above the floor.
    pub large: Vec<Duration>,
    /// The last incremental chunk.
    last: Option<Instant>,
}

impl GapTally {
    /// Large gaps kept one by one, at most.
    pub const MAX_LARGE: usize = 256;

    /// An incremental chunk arrived at `at`.
    pub fn on_chunk(&mut self, at: Instant, floor: Duration) {
        if let Some(last) = self.last.replace(at.max(self.last.unwrap_or(at))) {
            let gap = at.saturating_duration_since(last);
            if gap >= floor && self.large.len() < Self::MAX_LARGE {
                self.large.push(gap);
            } else {
                self.small += 1;
                self.small_max = self.small_max.max(gap);
            }
        }
    }

    /// Gaps tallied.
    pub fn count(&self) -> u64 {
        self.small + self.large.len() as u64
    }
}

/// A source's two distributions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LatencySnapshot {
    /// Time to the first incremental chunk (one leg per sample).
    pub ttft: LatencySketch,
    /// Gaps between incremental chunks (legs: streamed legs past their first token).
    pub gap: LatencySketch,
}

impl LatencySnapshot {
    /// Adds `other` to both distributions.
    pub fn merge(&mut self, other: &LatencySnapshot) {
        self.ttft.merge(&other.ttft);
        self.gap.merge(&other.gap);
    }

    /// Nothing recorded.
    pub fn is_empty(&self) -> bool {
        self.ttft.is_empty() && self.gap.is_empty()
    }

    /// Both distributions in the binary form: version byte 1, then each sketch's body
    /// (as in [`LatencySketch::to_bytes`], without its version byte), TTFT first.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![FORMAT_VERSION];
        self.ttft.write(&mut out);
        self.gap.write(&mut out);
        out
    }

    /// Decodes [`LatencySnapshot::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SketchDecodeError> {
        let mut r = Reader { bytes, at: 0 };
        match r.byte()? {
            FORMAT_VERSION => {}
            v => return Err(SketchDecodeError::Version(v)),
        }
        let ttft = LatencySketch::read(&mut r)?;
        let gap = LatencySketch::read(&mut r)?;
        r.finish()?;
        Ok(LatencySnapshot { ttft, gap })
    }
}

#[derive(Debug, Clone)]
struct SourceLatency {
    ttft: DecayingSketch,
    gap: DecayingSketch,
    /// Samples since the last [`ScopeLatency::take_deltas`].
    delta: LatencySnapshot,
    /// When a merged view across processes is installed: that view plus every sample
    /// recorded since (kept up to date as samples come).
    remote: Option<LatencySnapshot>,
}

impl SourceLatency {
    fn new(window: Duration) -> Self {
        SourceLatency {
            ttft: DecayingSketch::new(window),
            gap: DecayingSketch::new(window),
            delta: LatencySnapshot::default(),
            remote: None,
        }
    }

    /// The window, the delta and the remote view of one distribution.
    fn parts(
        &mut self,
        gap: bool,
    ) -> (
        &mut DecayingSketch,
        &mut LatencySketch,
        Option<&mut LatencySketch>,
    ) {
        let remote = self.remote.as_mut();
        if gap {
            (
                &mut self.gap,
                &mut self.delta.gap,
                remote.map(|r| &mut r.gap),
            )
        } else {
            (
                &mut self.ttft,
                &mut self.delta.ttft,
                remote.map(|r| &mut r.ttft),
            )
        }
    }

    /// A sample, into the window, the delta and the remote view.
    fn sample(&mut self, now: Instant, gap: bool, kind: SampleKind, d: Duration) {
        self.sample_n(now, gap, kind, d, 1);
    }

    /// `n` samples of one value, into the window, the delta and the remote view.
    fn sample_n(&mut self, now: Instant, gap: bool, kind: SampleKind, d: Duration, n: u64) {
        let (window, delta, remote) = self.parts(gap);
        window.record_n(now, kind, d, n);
        delta.record_n(kind, d, n);
        if let Some(r) = remote {
            r.record_n(kind, d, n);
        }
    }

    /// Legs, into the window, the delta and the remote view.
    fn legs(&mut self, now: Instant, gap: bool, n: u64) {
        let (window, delta, remote) = self.parts(gap);
        window.add_legs(now, n);
        delta.add_legs(n);
        if let Some(r) = remote {
            r.add_legs(n);
        }
    }

    /// (TTFT, gaps) at `now`: the remote view when installed, else the local window.
    fn view(&mut self, now: Instant) -> (&LatencySketch, &LatencySketch) {
        match &self.remote {
            Some(r) => (&r.ttft, &r.gap),
            None => (self.ttft.snapshot(now), self.gap.snapshot(now)),
        }
    }
}

/// An `auto` threshold's weighing against its prior (SPEC §25.1, [`crate::threshold`]):
/// the learned value (kept as it is) weighs by the evidence of the distribution it was
/// read from (the source's own, or the pool's), the prior the rest (`prior_bp`); a
/// trigger with nothing learned yet runs on the prior alone ([`ThresholdOrigin::Prior`]).
/// [`crate::threshold::blend_priors`] then blends.
fn weigh(
    t: &mut hedge::ThresholdInForce,
    setting: ThresholdSetting,
    prior: Option<Duration>,
    (own, pool): (&LatencySketch, &LatencySketch),
    auto: &HedgeSettings,
) {
    if setting != ThresholdSetting::Auto || prior.is_none() {
        return;
    }
    let evidence = match t.origin {
        ThresholdOrigin::Source => own.evidence(),
        ThresholdOrigin::Pooled => pool.evidence(),
        _ => 0,
    };
    let w = crate::threshold::learned_weight(t.value.is_some(), evidence, auto.min_samples);
    t.prior_bp = ((1.0 - w) * 10_000.0).round().clamp(0.0, 10_000.0) as u16;
    if t.origin == ThresholdOrigin::NotYet {
        t.origin = ThresholdOrigin::Prior;
    }
}

/// A scope's live latency: per source (by name), TTFT and gap distributions over the
/// window. The engine records every leg's events into it and asks it for the thresholds
/// in force ([`ScopeLatency::thresholds`]).
///
/// Across processes (SPEC §19.2): [`ScopeLatency::take_deltas`] hands out what was
/// recorded since the last call (to add to the shared store), and
/// [`ScopeLatency::set_remote`] installs the merged view read back from it; from then on
/// a source's view is that merged view plus this process's samples not yet handed out.
/// [`ScopeLatency::clear_remote`] goes back to the local window (e.g. the store is down).
#[derive(Debug, Clone)]
pub struct ScopeLatency {
    window: Duration,
    sources: BTreeMap<String, SourceLatency>,
}

impl Default for ScopeLatency {
    fn default() -> Self {
        Self::new(DEFAULT_WINDOW)
    }
}

impl ScopeLatency {
    /// Empty, decaying over `window` (`HEDGE__WINDOW_S`).
    pub fn new(window: Duration) -> Self {
        ScopeLatency {
            window,
            sources: BTreeMap::new(),
        }
    }

    fn source(&mut self, name: &str) -> &mut SourceLatency {
        if !self.sources.contains_key(name) {
            self.sources
                .insert(name.to_string(), SourceLatency::new(self.window));
        }
        self.sources.get_mut(name).expect("inserted above")
    }

    /// A leg on `source` delivered its first incremental chunk (plain request: its
    /// answer) `elapsed` after its launch. `streamed`: the leg goes on streaming, so it
    /// counts as a leg of the gap distribution.
    pub fn first_token(&mut self, source: &str, now: Instant, elapsed: Duration, streamed: bool) {
        let s = self.source(source);
        s.sample(now, false, SampleKind::Observed, elapsed);
        s.legs(now, false, 1);
        if streamed {
            s.legs(now, true, 1);
        }
    }

    /// A leg on `source` ended `elapsed` after its launch without a first token, for
    /// any reason (cancelled because another leg won, by the caller, watchdog, failure):
    /// a censored TTFT sample.
    pub fn cancelled_before_first_token(&mut self, source: &str, now: Instant, elapsed: Duration) {
        let s = self.source(source);
        s.sample(now, false, SampleKind::Censored, elapsed);
        s.legs(now, false, 1);
    }

    /// A gap between two incremental chunks of a leg on `source` ended after `elapsed`.
    pub fn gap(&mut self, source: &str, now: Instant, elapsed: Duration) {
        self.source(source)
            .sample(now, true, SampleKind::Observed, elapsed);
    }

    /// A leg on `source` past its first token ended (cancelled, stall watchdog, failure)
    /// `elapsed` after its last incremental chunk: a censored gap sample. (A stream that
    /// ends normally ends no gap: record nothing.)
    pub fn cancelled_in_gap(&mut self, source: &str, now: Instant, elapsed: Duration) {
        self.source(source)
            .sample(now, true, SampleKind::Censored, elapsed);
    }

    /// A leg on `source` ended at `times.ended`: every sample it gives, by the rules of
    /// the module's documentation — its first token (observed, or censored at its end
    /// when it had none and did not complete; a completed leg without incremental
    /// chunks, e.g. a plain answer, observes its answer time), its gaps (`gaps`, as the
    /// leg's observer tallied them), and the gap it ended in when it did not complete.
    pub fn leg_ended(&mut self, source: &str, now: Instant, times: LegTimes, gaps: &GapTally) {
        let since = |a: Instant, b: Instant| b.saturating_duration_since(a);
        match times.first_chunk {
            Some(first) if times.continues => {
                self.first_token(source, now, since(times.launched, first), false);
            }
            Some(first) => {
                self.first_token(source, now, since(times.launched, first), true);
                // One sample per streamed leg: its longest gap. The stall trigger fires on
                // a leg whose gap reaches the threshold, so the share of legs it fires on
                // is the share whose longest gap does — what this distribution's
                // quantiles give directly (every gap kept, the share of legs had to be
                // guessed from the share of gaps, and long gaps cluster in few legs).
                let longest = gaps
                    .large
                    .iter()
                    .copied()
                    .chain((gaps.small > 0).then_some(gaps.small_max))
                    .max();
                if times.completed {
                    if let Some(g) = longest {
                        self.gap(source, now, g);
                    }
                } else {
                    // Cut in a gap: the longest is at least that gap (and the longest
                    // before it) — a censored sample.
                    let last = times.last_chunk.unwrap_or(first);
                    let open = since(last, times.ended);
                    self.cancelled_in_gap(source, now, longest.unwrap_or_default().max(open));
                }
            }
            None if times.completed => {
                self.first_token(source, now, since(times.launched, times.ended), false);
            }
            None => {
                self.cancelled_before_first_token(source, now, since(times.launched, times.ended));
            }
        }
    }

    /// What `source`'s thresholds are computed from at `now`.
    pub fn view(&mut self, source: &str, now: Instant) -> LatencySnapshot {
        match self.sources.get_mut(source) {
            Some(s) => {
                let (ttft, gap) = s.view(now);
                LatencySnapshot {
                    ttft: ttft.clone(),
                    gap: gap.clone(),
                }
            }
            None => LatencySnapshot::default(),
        }
    }

    /// The scope's pooled view: the merge of every source's view.
    pub fn pooled(&mut self, now: Instant) -> LatencySnapshot {
        let mut pool = LatencySnapshot::default();
        for s in self.sources.values_mut() {
            let (ttft, gap) = s.view(now);
            pool.ttft.merge(ttft);
            pool.gap.merge(gap);
        }
        pool
    }

    /// The pooled view of some sources only (a scope's, when several scopes keep their
    /// upstreams' evidence in one book: SPEC §25.1).
    pub fn pooled_among(&mut self, members: &[String], now: Instant) -> LatencySnapshot {
        let mut pool = LatencySnapshot::default();
        for m in members {
            if let Some(s) = self.sources.get_mut(m) {
                let (ttft, gap) = s.view(now);
                pool.ttft.merge(ttft);
                pool.gap.merge(gap);
            }
        }
        pool
    }

    /// The thresholds in force for a leg on `source` ([`hedge::thresholds`] over its
    /// view and, when it has too few samples, the pooled view), for a share of calls of
    /// `budget_bp` basis points (the budget as [`hedge::aim_bp`] aims it).
    pub fn thresholds(
        &mut self,
        source: &str,
        now: Instant,
        auto: &HedgeSettings,
        budget_bp: u32,
    ) -> Thresholds {
        let mut t = self.learned_among(source, None, now, auto, budget_bp);
        crate::threshold::blend_priors(&mut t, auto);
        t
    }

    /// The learned thresholds for a leg on `source`, each with its prior's weight
    /// (`prior_bp`) but not yet blended with it (the engine holds the learned values
    /// steady first, then blends: [`crate::threshold::blend_priors`]); the pool made of
    /// `members` only (`None`: every source of the book).
    pub fn learned_among(
        &mut self,
        source: &str,
        members: Option<&[String]>,
        now: Instant,
        auto: &HedgeSettings,
        budget_bp: u32,
    ) -> Thresholds {
        let short = |setting, s: &LatencySketch| {
            setting == ThresholdSetting::Auto && s.evidence() < auto.min_samples
        };
        let needs_pool = match self.sources.get_mut(source) {
            Some(s) => {
                let (ttft, gap) = s.view(now);
                short(auto.after, ttft) || short(auto.stall_after, gap)
            }
            None => true,
        };
        let pool = if needs_pool {
            match members {
                Some(m) => self.pooled_among(m, now),
                None => self.pooled(now),
            }
        } else {
            LatencySnapshot::default() // not consulted
        };
        let empty = LatencySketch::new();
        let (ttft, gap) = match self.sources.get_mut(source) {
            Some(s) => s.view(now),
            None => (&empty, &empty),
        };
        let mut t = hedge::thresholds(auto, ttft, gap, &pool, budget_bp);
        weigh(
            &mut t.after,
            auto.after,
            auto.priors.after,
            (ttft, &pool.ttft),
            auto,
        );
        weigh(
            &mut t.stall_after,
            auto.stall_after,
            auto.priors.stall,
            (gap, &pool.gap),
            auto,
        );
        t
    }

    /// What was recorded since the last call, per source with any (to add to the shared
    /// store); resets the deltas.
    pub fn take_deltas(&mut self) -> Vec<(String, LatencySnapshot)> {
        self.sources
            .iter_mut()
            .filter(|(_, s)| !s.delta.is_empty())
            .map(|(name, s)| (name.clone(), std::mem::take(&mut s.delta)))
            .collect()
    }

    /// Installs the merged view of `source` read from the shared store (which holds the
    /// deltas handed out so far, this process's included).
    pub fn set_remote(&mut self, source: &str, merged: LatencySnapshot) {
        let s = self.source(source);
        let mut view = merged;
        view.merge(&s.delta);
        s.remote = Some(view);
    }

    /// Drops every remote view: back to this process's own window.
    pub fn clear_remote(&mut self) {
        for s in self.sources.values_mut() {
            s.remote = None;
        }
    }
}

#[cfg(test)]
mod tests;
