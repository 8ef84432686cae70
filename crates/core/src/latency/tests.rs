//! The sketches, the window, the scope's book, and the no-feedback-loop invariant.

use super::*;
use crate::hedge::{auto_threshold, Bounds, ThresholdOrigin};
use proptest::prelude::*;

fn t0() -> Instant {
    #[allow(clippy::disallowed_methods)]
    Instant::now()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Milliseconds spread over the bins that matter (sub-second gaps to minutes).
fn value_ms() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..300, 0u64..10_000, 0u64..200_000]
}

fn sketch_of(observed: &[u64], censored: &[u64]) -> LatencySketch {
    let mut s = LatencySketch::new();
    for &v in observed {
        s.observe(ms(v));
    }
    for &v in censored {
        s.censor(ms(v));
    }
    s.add_legs((observed.len() + censored.len()) as u64);
    s
}

fn any_sketch() -> impl Strategy<Value = LatencySketch> {
    (
        prop::collection::vec(value_ms(), 0..80),
        prop::collection::vec(value_ms(), 0..40),
        0u64..50,
    )
        .prop_map(|(o, c, extra_legs)| {
            let mut s = sketch_of(&o, &c);
            s.add_legs(extra_legs);
            s
        })
}

const QS: [f64; 9] = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0];

// ------------------------------------------------------------------ the sketch itself

#[test]
fn without_censoring_quantiles_are_the_empirical_ones() {
    let s = sketch_of(&(1..=100).map(|i| i * 10).collect::<Vec<_>>(), &[]);
    // bins are exact below 256 ms, 2 ms wide to 511, 4 ms wide to 1023
    assert_eq!(
        s.quantile(0.5),
        Some(ms(500) + ms(1)),
        "50th of 100: 500 ms, bin 500–501"
    );
    assert_eq!(s.quantile(0.1), Some(ms(100)));
    assert_eq!(s.quantile(0.9), Some(ms(903)), "90th: 900 ms, bin 900–903");
    assert_eq!(s.quantile(1.0), Some(ms(1000) + ms(3)));
    assert!((s.cdf(ms(250)).unwrap() - 0.25).abs() < 1e-12);
    assert_eq!(LatencySketch::new().quantile(0.5), None);
    assert_eq!((s.samples(), s.legs(), s.evidence()), (100, 100, 100));
}

#[test]
fn censored_mass_goes_to_the_samples_above_it() {
    // observed 1, 2, 3, 4 s; a leg cancelled at 2.5 s: its mass goes to 3 s and 4 s
    let s = sketch_of(&[1000, 2000, 3000, 4000], &[2500]);
    assert!((s.cdf(ms(1000)).unwrap() - 0.2).abs() < 1e-12);
    assert!((s.cdf(ms(2600)).unwrap() - 0.4).abs() < 1e-12);
    assert!(
        (s.cdf(ms(3100)).unwrap() - 0.7).abs() < 1e-12,
        "0.4 + 0.6/2"
    );
    // read as an ordinary sample at 2.5 s the median would be 2.5 s; as a lower bound
    // it is 3 s
    let q = s.quantile(0.5).unwrap();
    assert!((ms(3000)..ms(3100)).contains(&q), "{q:?}");
    // the slowest legs all cancelled: the estimate never reaches 1; the quantile is the
    // largest lower bound seen
    let s = sketch_of(&[1000], &[5000, 6000]);
    let q = s.quantile(0.9).unwrap();
    assert!((ms(6000)..ms(6100)).contains(&q), "{q:?}");
}

#[test]
fn decoding_rejects_what_it_did_not_write() {
    let s = sketch_of(&[5, 700, 40_000], &[1200]);
    let b = s.to_bytes();
    assert_eq!(LatencySketch::from_bytes(&b), Ok(s.clone()));
    assert_eq!(b.len(), 1 + 1 + 1 + 3 * 3 + 1 + 3, "compact: {b:?}");
    assert_eq!(
        LatencySketch::from_bytes(&[]),
        Err(SketchDecodeError::Truncated)
    );
    assert_eq!(
        LatencySketch::from_bytes(&[2]),
        Err(SketchDecodeError::Version(2))
    );
    assert_eq!(
        LatencySketch::from_bytes(&b[..b.len() - 1]),
        Err(SketchDecodeError::Truncated)
    );
    let mut long = b.clone();
    long.push(0);
    assert_eq!(
        LatencySketch::from_bytes(&long),
        Err(SketchDecodeError::Trailing(1))
    );
    // legs 0, one observed bin at 1 with count 0
    assert_eq!(
        LatencySketch::from_bytes(&[1, 0, 1, 1, 0, 0]),
        Err(SketchDecodeError::InvalidBin)
    );
    // two bins at the same value
    assert_eq!(
        LatencySketch::from_bytes(&[1, 0, 2, 5, 1, 0, 1, 0]),
        Err(SketchDecodeError::InvalidBin)
    );
    assert!(matches!(
        LatencySketch::from_fields([("x12", 1)]),
        Err(SketchDecodeError::Field(_))
    ));
    assert_eq!(
        LatencySketch::from_fields([("o99999999", 1)]),
        Err(SketchDecodeError::InvalidBin)
    );
    let fields = s.to_fields();
    assert!(
        fields.contains(&("legs".to_string(), 4)) && fields.contains(&("c1200".to_string(), 1))
    );
    let snap = LatencySnapshot {
        ttft: s.clone(),
        gap: sketch_of(&[30, 31], &[]),
    };
    assert_eq!(LatencySnapshot::from_bytes(&snap.to_bytes()), Ok(snap));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Both serial forms give back the same sketch, and merging is exact and
    /// order-free: any order and grouping of the parts gives the same bins and quantiles.
    #[test]
    fn merge_and_serialization_are_exact(parts in prop::collection::vec(any_sketch(), 1..6), seed: u64) {
        for p in &parts {
            prop_assert_eq!(&LatencySketch::from_bytes(&p.to_bytes()).unwrap(), p);
            let fields = p.to_fields();
            let back = LatencySketch::from_fields(fields.iter().map(|(k, v)| (k.as_str(), *v))).unwrap();
            prop_assert_eq!(&back, p);
        }
        let mut forward = LatencySketch::new();
        parts.iter().for_each(|p| forward.merge(p));
        let mut order: Vec<usize> = (0..parts.len()).collect();
        shuffle(&mut order, seed);
        // a different grouping too: pairs first
        let mut other = LatencySketch::new();
        for pair in order.chunks(2) {
            let mut g = LatencySketch::new();
            pair.iter().rev().for_each(|&i| g.merge(&parts[i]));
            other.merge(&LatencySketch::from_bytes(&g.to_bytes()).unwrap());
        }
        prop_assert_eq!(forward.to_bytes(), other.to_bytes());
        for q in QS {
            prop_assert_eq!(forward.quantile(q), other.quantile(q));
        }
        prop_assert_eq!(forward.samples(), parts.iter().map(|p| p.samples()).sum::<u64>());
    }

    /// Decoding arbitrary bytes never panics.
    #[test]
    fn decoding_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        let _ = LatencySketch::from_bytes(&bytes);
        let _ = LatencySnapshot::from_bytes(&bytes);
    }

    /// The quantile is monotone in q, and within the values seen.
    #[test]
    fn quantiles_are_ordered(s in any_sketch()) {
        let qs: Vec<Option<Duration>> = QS.iter().map(|&q| s.quantile(q)).collect();
        prop_assert!(qs.windows(2).all(|w| w[0] <= w[1]), "{:?}", qs);
    }
}

fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut rng = SplitMix(seed);
    for i in (1..v.len()).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// A small deterministic generator (splitmix64) for the simulations.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Lognormal with this median and σ.
    fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        let (u, v) = (self.unit(), self.unit());
        let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
        median * (sigma * z).exp()
    }
}

// ------------------------------------------------------------ no feedback loop (§19.1)

proptest! {
    #![proptest_config(ProptestConfig::with_cases(384))]

    /// Invariant 1a: legs cancelled before their first token never lower any quantile,
    /// compared with leaving them out.
    #[test]
    fn censored_samples_never_lower_a_quantile(
        observed in prop::collection::vec(value_ms(), 1..60),
        censored in prop::collection::vec(value_ms(), 0..60),
    ) {
        let with = sketch_of(&observed, &censored);
        let without = sketch_of(&observed, &[]);
        for q in QS {
            prop_assert!(with.quantile(q) >= without.quantile(q), "q {}: {:?} < {:?}", q, with.quantile(q), without.quantile(q));
        }
    }

    /// Invariant 1b: a censored sample counts at least as the lower bound it is: never
    /// below reading it as an ordinary sample at its cancellation time.
    #[test]
    fn censored_samples_count_at_least_at_their_cancellation_time(
        observed in prop::collection::vec(value_ms(), 0..60),
        censored in prop::collection::vec(value_ms(), 1..60),
    ) {
        let with = sketch_of(&observed, &censored);
        let all: Vec<u64> = observed.iter().chain(&censored).copied().collect();
        let as_ordinary = sketch_of(&all, &[]);
        for q in QS {
            prop_assert!(with.quantile(q) >= as_ordinary.quantile(q), "q {}", q);
        }
    }

    /// Invariant 2: legs cancelled at or after `t` (a hedge fired at `t` and won `h`
    /// later) leave the estimate below the earliest cancellation exactly the truth, so
    /// the quantile is the true one, or at least `t`.
    #[test]
    fn cancelling_at_or_after_t_leaves_the_estimate_below_t_exact(
        legs in prop::collection::vec((value_ms(), 0u64..20_000), 1..120),
        t in 0u64..20_000,
    ) {
        let mut seen = LatencySketch::new();
        let mut truth = LatencySketch::new();
        for &(x, h) in &legs {
            truth.observe(ms(x));
            if x > t + h { seen.censor(ms(t + h)) } else { seen.observe(ms(x)) }
        }
        let lowest_cut = legs.iter().filter(|&&(x, h)| x > t + h).map(|&(_, h)| t + h).min();
        for v in [0, 10, 100, 255, 300, 1000, 1500, 4000, 9000, 15_000, 19_999] {
            if lowest_cut.is_some_and(|c| truth.observed.lowest_equivalent(v) >= truth.observed.lowest_equivalent(c)) {
                continue;
            }
            prop_assert_eq!(seen.cdf(ms(v)), truth.cdf(ms(v)), "at {} ms", v);
        }
        for q in QS {
            let (est, real) = (seen.quantile(q).unwrap(), truth.quantile(q).unwrap());
            prop_assert!(est >= real.min(ms(t)), "q {}: {:?} < min({:?}, {} ms)", q, est, real, t);
        }
    }

}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    /// The closed loop: each leg's threshold comes from the legs before it; a leg slower
    /// than its threshold is hedged and cancelled `h` later (whatever `h`, even chosen
    /// adversarially). The threshold never drops below both the true quantile of the
    /// legs so far and every earlier threshold: hedging cannot spiral it down.
    #[test]
    fn hedging_at_the_threshold_cannot_spiral_it_down(
        legs in prop::collection::vec((value_ms(), 0u64..5_000), 60..260),
        pct in 1u32..50,
    ) {
        let wide = Bounds { min: Duration::ZERO, max: ms(MAX_SAMPLE_MS) };
        let mut seen = LatencySketch::new();
        let mut truth = LatencySketch::new();
        let mut lowest: Option<Duration> = None;
        for (i, &(x, h)) in legs.iter().enumerate() {
            // the first 50 legs warm up unhedged
            let threshold = (i >= 50).then(|| auto_threshold(&seen, pct, wide).unwrap());
            if let Some(th) = threshold {
                let real = auto_threshold(&truth, pct, wide).unwrap();
                let floor = lowest.map_or(real, |l| l.min(real));
                prop_assert!(th >= floor, "leg {}: threshold {:?} below {:?}", i, th, floor);
                lowest = Some(lowest.map_or(th, |l| l.min(th)));
            }
            truth.observe(ms(x));
            truth.add_legs(1);
            seen.add_legs(1);
            match threshold {
                Some(th) if ms(x) > th + ms(h) => seen.censor(th + ms(h)),
                _ => seen.observe(ms(x)),
            }
        }
    }
}

/// Two sources with the same true TTFT (lognormal, median 1.6 s, σ 0.8: SPEC §12) hedge
/// each other at their `auto` thresholds; the loser of each race is cancelled, which
/// censors its sample (the slow primary when the hedge wins, the hedge leg when the
/// primary's token comes first). The thresholds settle on the true quantile.
#[test]
fn closed_loop_thresholds_settle_on_the_true_quantile() {
    for (pct, true_q) in [(10u32, 1.2816f64), (25, 0.6745)] {
        let truth = 1.6 * (0.8 * true_q).exp(); // the (1 − pct) quantile, seconds
        for seed in 1..=3u64 {
            let th = run_two_source_loop(seed, pct, 12_000);
            for t in th {
                let ratio = t.as_secs_f64() / truth;
                assert!(
                    (0.9..1.1).contains(&ratio),
                    "pct {pct}, seed {seed}: threshold {t:?} vs true {truth:.2} s"
                );
            }
        }
    }
}

/// The last thresholds of both sources after `calls` hedged calls.
fn run_two_source_loop(seed: u64, pct: u32, calls: usize) -> [Duration; 2] {
    let auto = HedgeSettings {
        stall_after: ThresholdSetting::Off,
        after_bounds: Bounds {
            min: ms(10),
            max: ms(MAX_SAMPLE_MS),
        },
        ..HedgeSettings::default()
    };
    let names = ["a", "b"];
    let mut rng = SplitMix(seed);
    let mut book = ScopeLatency::new(Duration::from_secs(3600 * 24));
    let s = t0();
    let secs = |x: f64| Duration::from_secs_f64(x);
    let mut th = [None, None];
    for call in 0..calls {
        let now = s + ms(call as u64 * 100);
        let (p, o) = (call % 2, 1 - call % 2);
        // thresholds refreshed every 8 calls, as an engine may cache them
        if call % 16 < 2 {
            th[p] = book.thresholds(names[p], now, &auto, pct * 100).after.value;
        }
        let th = th[p];
        let x = rng.lognormal(1.6, 0.8);
        match th {
            Some(t) if secs(x) > t => {
                let y = rng.lognormal(1.6, 0.8);
                let t = t.as_secs_f64();
                if t + y < x {
                    book.cancelled_before_first_token(names[p], now, secs(t + y));
                    book.first_token(names[o], now, secs(y), false);
                } else {
                    book.first_token(names[p], now, secs(x), false);
                    book.cancelled_before_first_token(names[o], now, secs(x - t));
                }
            }
            _ => book.first_token(names[p], now, secs(x), false),
        }
    }
    let end = s + ms(calls as u64 * 100);
    let a = book.thresholds("a", end, &auto, pct * 100).after;
    let b = book.thresholds("b", end, &auto, pct * 100).after;
    assert_eq!(
        (a.origin, b.origin),
        (ThresholdOrigin::Source, ThresholdOrigin::Source)
    );
    [a.value.unwrap(), b.value.unwrap()]
}

// ---------------------------------------------------------------------- the window

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A sample is counted for at least 0.9 × the window and at most the window.
    #[test]
    fn old_samples_leave_the_window(window_ms in 10u64..2_000_000, at_ms in 0u64..5_000_000, age_permille in 0u64..1500) {
        let s = t0();
        let mut d = DecayingSketch::new(ms(window_ms));
        let w = d.window();
        d.record(s, SampleKind::Observed, ms(5)); // sets the origin
        let at = s + ms(at_ms);
        d.record(at, SampleKind::Censored, ms(7));
        let age = w * age_permille as u32 / 1000;
        let counted = d.snapshot(at + age).censored();
        if age < w * 9 / 10 {
            prop_assert_eq!(counted, 1, "age {:?} of window {:?}", age, w);
        }
        if age >= w {
            prop_assert_eq!(counted, 0, "age {:?} of window {:?}", age, w);
        }
    }

    /// The running merge is always the merge of the slots in the window, and those are
    /// the samples whose slot is one of the last `SLOTS` (times in any order).
    #[test]
    fn the_window_is_the_merge_of_its_slots(steps in prop::collection::vec((0u64..400, value_ms(), any::<bool>()), 1..80)) {
        let s = t0();
        let mut d = DecayingSketch::new(ms(1000));
        let mut at = s;
        for (i, &(dt, v, back)) in steps.iter().enumerate() {
            // mostly forward, sometimes an older instant
            at = if back && i % 3 == 0 { at.checked_sub(ms(dt)).unwrap_or(s).max(s) } else { at + ms(dt) };
            d.record(at, SampleKind::Observed, ms(v));
            let total = d.snapshot(at).clone();
            let mut merged = LatencySketch::new();
            d.slots.iter().for_each(|(_, x)| merged.merge(x));
            prop_assert_eq!(&total, &merged);
            let idx: Vec<u64> = d.slots.iter().map(|x| x.0).collect();
            prop_assert!(idx.windows(2).all(|w| w[0] < w[1]), "{:?}", idx);
            prop_assert!(idx.first().unwrap() + SLOTS > *idx.last().unwrap());
        }
    }
}

// ------------------------------------------------------------------ the scope's book

#[test]
fn a_scope_records_every_event_of_a_leg() {
    let s = t0();
    let mut book = ScopeLatency::new(Duration::from_secs(600));
    book.first_token("a", s, ms(800), true);
    book.gap("a", s, ms(30));
    book.gap("a", s, ms(40));
    book.cancelled_in_gap("a", s, ms(3000));
    book.cancelled_before_first_token("b", s, ms(900));
    let a = book.view("a", s);
    assert_eq!((a.ttft.observed(), a.ttft.legs()), (1, 1));
    assert_eq!(
        (a.gap.observed(), a.gap.censored(), a.gap.legs()),
        (2, 1, 1)
    );
    let b = book.view("b", s);
    assert_eq!((b.ttft.censored(), b.ttft.legs(), b.gap.legs()), (1, 1, 0));
    assert_eq!(book.pooled(s).ttft.samples(), 2);
    assert!(book.view("unknown", s).is_empty());
    // ten minutes later all of it has left the window
    assert!(book.pooled(s + Duration::from_secs(600)).is_empty());
}

#[test]
fn a_new_source_uses_the_pool_then_its_own_distribution() {
    let s = t0();
    // Without priors (the learned part alone; with them, see the next test).
    let auto = HedgeSettings {
        priors: crate::threshold::Priors {
            after: None,
            stall: None,
        },
        ..HedgeSettings::default()
    };
    let mut book = ScopeLatency::default();
    let th = |book: &mut ScopeLatency, src| book.thresholds(src, s, &auto, 1_000);
    assert_eq!(th(&mut book, "fast").after.origin, ThresholdOrigin::NotYet);
    for i in 0..50 {
        book.first_token("fast", s, ms(1000 + i), false);
    }
    let pooled = th(&mut book, "new");
    assert_eq!(pooled.after.origin, ThresholdOrigin::Pooled);
    assert_eq!(
        pooled.after,
        th(&mut book, "fast")
            .after
            .with_origin(ThresholdOrigin::Pooled)
    );
    assert_eq!(th(&mut book, "fast").after.origin, ThresholdOrigin::Source);
    for _ in 0..50 {
        book.first_token("new", s, ms(20_000), false);
    }
    let own = th(&mut book, "new").after;
    assert_eq!(own.origin, ThresholdOrigin::Source);
    assert!(own.value.unwrap() >= ms(20_000));
    // no stream yet: the stall trigger has no distribution
    assert_eq!(
        th(&mut book, "new").stall_after.origin,
        ThresholdOrigin::NotYet
    );
}

#[test]
fn priors_protect_from_the_first_call_and_give_way_to_evidence() {
    let s = t0();
    let auto = HedgeSettings::default();
    let mut book = ScopeLatency::default();
    let th = |book: &mut ScopeLatency, src| book.thresholds(src, s, &auto, 1_000);
    // No evidence at all: both priors, in full.
    let t = th(&mut book, "a");
    assert_eq!(
        (t.after.value, t.after.origin, t.after.prior_bp),
        (
            Some(Duration::from_secs(15)),
            ThresholdOrigin::Prior,
            10_000
        )
    );
    assert_eq!(
        (t.stall_after.value, t.stall_after.origin),
        (Some(Duration::from_secs(10)), ThresholdOrigin::Prior)
    );
    // 50 legs of 1 s first tokens: a quarter learned, geometric.
    for _ in 0..50 {
        book.first_token("a", s, ms(1000), false);
    }
    let quarter = th(&mut book, "a").after;
    assert_eq!(
        (quarter.origin, quarter.prior_bp),
        (ThresholdOrigin::Source, 7_500)
    );
    let learned = quarter.value.unwrap();
    assert!(
        learned > Duration::from_secs(7) && learned < Duration::from_secs(8),
        "15^0.75 × 1.0x^0.25 ≈ 7.6 s: {learned:?}"
    );
    // 4 × MIN_SAMPLES legs: the learned value alone.
    for _ in 0..150 {
        book.first_token("a", s, ms(1000), false);
    }
    let full = th(&mut book, "a").after;
    assert_eq!((full.origin, full.prior_bp), (ThresholdOrigin::Source, 0));
    assert!(
        full.value.unwrap() < Duration::from_millis(1100),
        "{full:?}"
    );
    // A trigger that is off has no prior.
    let off = HedgeSettings {
        stall_after: crate::hedge::ThresholdSetting::Off,
        ..auto
    };
    let t = book.thresholds("b", s, &off, 1_000);
    assert_eq!(
        (t.stall_after.value, t.stall_after.origin),
        (None, ThresholdOrigin::Off)
    );
}

impl crate::hedge::ThresholdInForce {
    fn with_origin(mut self, origin: ThresholdOrigin) -> Self {
        self.origin = origin;
        self
    }
}

#[test]
fn stall_threshold_fires_on_about_the_budget_share_of_streams() {
    // 100 streams of 200 chunks: gaps of 30 ms, and one stall of 2–12 s in 40 of them
    let s = t0();
    let mut book = ScopeLatency::default();
    for leg in 0..100u64 {
        book.first_token("a", s, ms(500), true);
        for _ in 0..200 {
            book.gap("a", s, ms(30));
        }
        if leg % 5 < 2 {
            book.gap("a", s, ms(2000 + leg * 100));
        }
    }
    let t = book
        .thresholds("a", s, &HedgeSettings::default(), 1_000)
        .stall_after;
    assert_eq!(t.origin, ThresholdOrigin::Source);
    // Both triggers auto share the 10 % by what each saves (`hedge::split_budget`): every
    // first token takes 500 ms, so a first-token hedge saves nothing and the stall
    // trigger has the whole 10 % of the 100 streams — the 10 longest stalls.
    // The stalls come in pairs 0.5 s apart with nothing between: the quantile falls
    // in such a gap, and `earlier` (DECISIONS 166) may take the next pair too — at most
    // 1.2 × the budget's share of streams.
    let above = (0..100u64)
        .filter(|leg| leg % 5 < 2 && ms(2000 + leg * 100) > t.value.unwrap())
        .count();
    assert!((9..=12).contains(&above), "{above} streams above {t:?}");
    // Alone (first token off), the stall trigger has the whole 10 %.
    let alone = HedgeSettings {
        after: crate::hedge::ThresholdSetting::Off,
        ..HedgeSettings::default()
    };
    let t = book.thresholds("a", s, &alone, 1_000).stall_after;
    // The stalls come in pairs 0.5 s apart with nothing between: the quantile falls
    // in such a gap, and `earlier` (DECISIONS 166) may take the next pair too — at most
    // 1.2 × the budget's share of streams.
    let above = (0..100u64)
        .filter(|leg| leg % 5 < 2 && ms(2000 + leg * 100) > t.value.unwrap())
        .count();
    assert!((9..=12).contains(&above), "{above} streams above {t:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Processes that hand their deltas to a shared store (any order, any flush points)
    /// and read the merge back end up with one threshold: the one a single process would
    /// have computed from all the samples.
    #[test]
    fn processes_merging_deltas_converge_on_one_threshold(
        samples in prop::collection::vec((0usize..3, value_ms(), any::<bool>(), any::<bool>()), 50..300),
        order_seed: u64,
    ) {
        let s = t0();
        let auto = HedgeSettings { min_samples: 20, ..HedgeSettings::default() };
        let mut procs: Vec<ScopeLatency> = (0..3).map(|_| ScopeLatency::default()).collect();
        let mut single = ScopeLatency::default();
        let mut store: Vec<Vec<u8>> = Vec::new(); // the shared store: deltas as bytes
        for &(p, v, censored, flush) in &samples {
            for book in [&mut procs[p], &mut single] {
                if censored {
                    book.cancelled_before_first_token("a", s, ms(v));
                } else {
                    book.first_token("a", s, ms(v), true);
                    book.gap("a", s, ms(v / 10));
                }
            }
            if flush {
                store.extend(procs[p].take_deltas().into_iter().map(|(_, d)| d.to_bytes()));
            }
        }
        for book in &mut procs {
            store.extend(book.take_deltas().into_iter().map(|(_, d)| d.to_bytes()));
        }
        let mut expected = None;
        for (i, book) in procs.iter_mut().enumerate() {
            let mut order = store.clone();
            shuffle(&mut order, order_seed.wrapping_add(i as u64));
            let mut merged = LatencySnapshot::default();
            for b in &order {
                merged.merge(&LatencySnapshot::from_bytes(b).unwrap());
            }
            book.set_remote("a", merged);
            let t = book.thresholds("a", s, &auto, 1_000);
            prop_assert_eq!(*expected.get_or_insert(t), t);
        }
        prop_assert_eq!(expected.unwrap(), single.thresholds("a", s, &auto, 1_000));
        // a sample recorded after the read counts at once in its own process
        procs[0].first_token("a", s, ms(1), false);
        prop_assert_eq!(procs[0].view("a", s).ttft.samples(), single.view("a", s).ttft.samples() + 1);
        procs[0].clear_remote();
        let own = samples.iter().filter(|x| x.0 == 0).count() as u64;
        prop_assert_eq!(procs[0].view("a", s).ttft.samples(), own + 1, "back to its own window");
    }
}

#[test]
fn a_streamed_leg_gives_its_longest_gap_observed_or_censored_when_cut() {
    // Within the bins' 1 %.
    let near = |q: Option<Duration>, want: u64| {
        q.is_some_and(|d| d.as_millis().abs_diff(u128::from(want)) * 100 <= u128::from(want))
    };
    let s = t0();
    let mut book = ScopeLatency::default();
    let mut gaps = GapTally::default();
    let floor = ms(1000);
    for at in [100, 130, 3130, 3160, 3200] {
        gaps.on_chunk(s + ms(at), floor);
    }
    let times = |completed, ended| LegTimes {
        launched: s,
        first_chunk: Some(s + ms(100)),
        last_chunk: Some(s + ms(3200)),
        ended: s + ms(ended),
        completed,
        continues: false,
    };
    book.leg_ended("a", s, times(true, 3300), &gaps);
    let v = book.view("a", s);
    // Four gaps, one sample: the 3 s one.
    assert_eq!(
        (v.gap.observed(), v.gap.censored(), v.gap.legs()),
        (1, 0, 1)
    );
    assert!(near(v.gap.quantile(1.0), 3000));
    // Cut 5 s into a silence: censored at 5 s; cut 1 s into one: censored at the 3 s
    // it had already seen.
    book.leg_ended("b", s, times(false, 8200), &gaps);
    book.leg_ended("c", s, times(false, 4200), &gaps);
    let b = book.view("b", s);
    let c = book.view("c", s);
    assert_eq!((b.gap.observed(), b.gap.censored()), (0, 1));
    assert!(near(b.gap.quantile(1.0), 5000));
    assert!(near(c.gap.quantile(1.0), 3000));
    // A resume leg counts its first token only.
    let resumed = LegTimes {
        continues: true,
        ..times(true, 3300)
    };
    book.leg_ended("d", s, resumed, &gaps);
    let d = book.view("d", s);
    assert_eq!(
        (d.ttft.observed(), d.gap.samples(), d.gap.legs()),
        (1, 0, 0)
    );
}
