//! Backoff between retry rounds (SPEC §6): exponential with full jitter,
//! `uniform(0, min(BACKOFF_MAX_S, BACKOFF_BASE_S · 2^k))`, randomness from the `Rng` port.

use std::time::Duration;

use crate::ports::Rng;

/// The cap of the `k`-th backoff (k = 0 for the first retry).
pub fn backoff_cap(k: u32, base: Duration, max: Duration) -> Duration {
    let factor = 2f64.powi(k.min(62) as i32);
    let cap = base.as_secs_f64() * factor;
    if !cap.is_finite() || cap >= max.as_secs_f64() {
        max
    } else {
        Duration::from_secs_f64(cap)
    }
}

/// The `k`-th backoff with full jitter.
pub fn backoff_delay(k: u32, base: Duration, max: Duration, rng: &dyn Rng) -> Duration {
    backoff_cap(k, base, max).mul_f64(rng.next_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::SplitMix64;
    use proptest::prelude::*;

    #[test]
    fn caps_double_then_saturate() {
        let b = Duration::from_millis(500);
        let m = Duration::from_secs(8);
        let caps: Vec<u128> = (0..7).map(|k| backoff_cap(k, b, m).as_millis()).collect();
        assert_eq!(caps, [500, 1000, 2000, 4000, 8000, 8000, 8000]);
        assert_eq!(backoff_cap(u32::MAX, b, m), m);
    }

    proptest! {
        #[test]
        fn jitter_stays_within_cap(k in 0u32..40, seed: u64, base_ms in 1u64..5_000, extra in 0u64..60_000) {
            let base = Duration::from_millis(base_ms);
            let max = Duration::from_millis(base_ms + extra);
            let rng = SplitMix64::new(seed);
            let d = backoff_delay(k, base, max, &rng);
            prop_assert!(d <= backoff_cap(k, base, max));
        }
    }

    #[test]
    fn jitter_spreads_over_the_range() {
        let rng = SplitMix64::new(7);
        let cap = Duration::from_secs(1);
        let xs: Vec<f64> = (0..2000)
            .map(|_| backoff_delay(0, cap, cap, &rng).as_secs_f64())
            .collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((0.45..0.55).contains(&mean), "mean {mean}");
        assert!(xs.iter().any(|x| *x < 0.05) && xs.iter().any(|x| *x > 0.95));
    }
}
