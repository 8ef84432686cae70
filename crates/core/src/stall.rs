//! Stall metering (SPEC §3, §5): figures derived from the monotonic timestamps of a
//! stream's incremental chunks. Chunk ≠ token: every gap figure is per incremental chunk.
//!
//! [`StallMeter`] is fed one timestamp at a time (O(1) memory, no buffering); [`meter`]
//! is the same rule over a slice, used by tests and tools.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The figures of one attempt's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StreamFigures {
    /// Attempt start → first incremental chunk.
    pub ttft_ms: Option<u64>,
    /// Largest gap between consecutive incremental chunks (≥ 2 chunks).
    pub max_inter_token_ms: Option<u64>,
    /// Sum of the gaps longer than the stall threshold (≥ 2 chunks).
    pub stall_ms: Option<u64>,
    /// Number of such gaps (≥ 2 chunks).
    pub stall_count: Option<u32>,
    /// Incremental chunks seen.
    pub incremental_chunks: u32,
}

/// Incremental stall meter: feed [`StallMeter::on_chunk`] with each incremental chunk's
/// timestamp, then read [`StallMeter::figures`].
#[derive(Debug, Clone, Copy)]
pub struct StallMeter {
    start: Instant,
    threshold: Duration,
    first: Option<Instant>,
    last: Option<Instant>,
    chunks: u32,
    max_gap: Duration,
    stall: Duration,
    stall_count: u32,
}

impl StallMeter {
    /// A meter for an attempt that started at `start`.
    pub fn new(start: Instant, threshold: Duration) -> Self {
        StallMeter {
            start,
            threshold,
            first: None,
            last: None,
            chunks: 0,
            max_gap: Duration::ZERO,
            stall: Duration::ZERO,
            stall_count: 0,
        }
    }

    /// Records one incremental chunk. Out-of-order timestamps count as a zero gap.
    pub fn on_chunk(&mut self, at: Instant) {
        if let Some(last) = self.last {
            let gap = at.saturating_duration_since(last);
            self.max_gap = self.max_gap.max(gap);
            if gap > self.threshold {
                self.stall += gap;
                self.stall_count += 1;
            }
            self.last = Some(at.max(last));
        } else {
            self.first = Some(at);
            self.last = Some(at);
        }
        self.chunks = self.chunks.saturating_add(1);
    }

    /// Time of the latest incremental chunk.
    pub fn last_chunk(&self) -> Option<Instant> {
        self.last
    }

    /// Number of incremental chunks so far.
    pub fn chunks(&self) -> u32 {
        self.chunks
    }

    /// The figures so far (`None` rules of SPEC §3 applied).
    pub fn figures(&self) -> StreamFigures {
        let multi = self.chunks >= 2;
        StreamFigures {
            ttft_ms: self
                .first
                .map(|f| ms(f.saturating_duration_since(self.start))),
            max_inter_token_ms: multi.then(|| ms(self.max_gap)),
            stall_ms: multi.then(|| ms(self.stall)),
            stall_count: multi.then_some(self.stall_count),
            incremental_chunks: self.chunks,
        }
    }
}

/// Whole milliseconds of a duration (floor).
pub fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The same rule over offsets from the attempt start (sorted or not: each gap is
/// measured between consecutive entries as given).
pub fn meter(offsets: &[Duration], threshold: Duration) -> StreamFigures {
    let gaps: Vec<Duration> = offsets
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0]))
        .collect();
    let multi = offsets.len() >= 2;
    let stalls: Vec<Duration> = gaps.iter().copied().filter(|g| *g > threshold).collect();
    StreamFigures {
        ttft_ms: offsets.first().map(|d| ms(*d)),
        max_inter_token_ms: multi.then(|| ms(gaps.iter().copied().max().unwrap_or_default())),
        stall_ms: multi.then(|| ms(stalls.iter().sum())),
        stall_count: multi.then_some(stalls.len() as u32),
        incremental_chunks: offsets.len() as u32,
    }
}

/// `generation_ms` (SPEC §3): the winner's transport wall time minus `stall_ms`,
/// clamped at 0; the whole wall time when `stall_ms` is `None`.
pub fn generation_ms(wall_ms: u64, stall_ms: Option<u64>) -> u64 {
    wall_ms.saturating_sub(stall_ms.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn d(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn none_rules() {
        let t = d(1000);
        let none = meter(&[], t);
        assert_eq!(none, StreamFigures::default());
        let one = meter(&[d(1500)], t);
        assert_eq!(one.ttft_ms, Some(1500));
        assert_eq!(
            (one.max_inter_token_ms, one.stall_ms, one.stall_count),
            (None, None, None)
        );
        assert_eq!(generation_ms(4000, one.stall_ms), 4000);
    }

    #[test]
    fn stalls_count_only_gaps_over_threshold() {
        // gaps: 100, 1000 (= threshold, not a stall), 2500, 50, 1001
        let offs = [d(200), d(300), d(1300), d(3800), d(3850), d(4851)];
        let f = meter(&offs, d(1000));
        assert_eq!(f.ttft_ms, Some(200));
        assert_eq!(f.max_inter_token_ms, Some(2500));
        assert_eq!(f.stall_count, Some(2));
        assert_eq!(f.stall_ms, Some(3501));
        assert_eq!(f.incremental_chunks, 6);
        assert_eq!(generation_ms(5000, f.stall_ms), 1499);
    }

    #[test]
    fn generation_clamps_at_zero() {
        assert_eq!(generation_ms(100, Some(500)), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The incremental meter agrees with the batch rule; wall = generation + stall;
        /// stall_count = number of gaps over the threshold; None rules hold.
        #[test]
        fn meter_properties(
            gaps in proptest::collection::vec(0u64..5_000, 0..60),
            first in 0u64..3_000,
            tail in 0u64..2_000,
            threshold in 1u64..3_000,
        ) {
            let mut offs = Vec::new();
            let mut t = first;
            for (i, g) in gaps.iter().enumerate() {
                if i > 0 { t += g; }
                offs.push(Duration::from_millis(t));
            }
            let wall = Duration::from_millis(t + tail);
            let thr = Duration::from_millis(threshold);
            let batch = meter(&offs, thr);

            // Incremental meter on real Instants agrees with the batch rule.
            let base = Instant::now_for_tests();
            let mut m = StallMeter::new(base, thr);
            for o in &offs { m.on_chunk(base + *o); }
            prop_assert_eq!(m.figures(), batch);

            if offs.len() < 2 {
                prop_assert_eq!(batch.stall_ms, None);
                prop_assert_eq!(batch.stall_count, None);
                prop_assert_eq!(batch.max_inter_token_ms, None);
                prop_assert_eq!(generation_ms(ms(wall), batch.stall_ms), ms(wall));
            } else {
                let over = offs.windows(2).filter(|w| w[1] - w[0] > thr).count() as u32;
                prop_assert_eq!(batch.stall_count, Some(over));
                let stall = batch.stall_ms.unwrap();
                prop_assert!(stall <= ms(wall));
                prop_assert_eq!(generation_ms(ms(wall), batch.stall_ms) + stall, ms(wall));
                prop_assert!(batch.max_inter_token_ms.unwrap() <= ms(wall));
            }
        }
    }

    /// Tests may read the real clock; production core code may not (clippy.toml).
    trait NowForTests {
        fn now_for_tests() -> Instant;
    }
    impl NowForTests for Instant {
        #[allow(clippy::disallowed_methods)]
        fn now_for_tests() -> Instant {
            Instant::now()
        }
    }
}
