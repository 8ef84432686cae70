//! The `Rng` port: randomness for weighted choice and backoff jitter.

use std::sync::atomic::{AtomicU64, Ordering};

/// A source of random numbers. Implementations must be cheap and thread-safe.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait Rng: Send + Sync + std::fmt::Debug {
    /// 64 random bits.
    fn next_u64(&self) -> u64;

    /// A uniform float in `[0, 1)`.
    fn next_f64(&self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A uniform integer in `0..n` (`n > 0`).
    fn below(&self, n: u64) -> u64 {
        if n <= 1 {
            return 0;
        }
        // Lemire's multiply-shift; the tiny bias is irrelevant for load balancing.
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// A deterministic, lock-free SplitMix64 generator: seeded tests, and a fine production
/// generator when seeded from entropy by the caller.
#[derive(Debug)]
pub struct SplitMix64 {
    state: AtomicU64,
}

impl SplitMix64 {
    /// A generator with this seed.
    pub fn new(seed: u64) -> Self {
        SplitMix64 {
            state: AtomicU64::new(seed),
        }
    }
}

impl Rng for SplitMix64 {
    fn next_u64(&self) -> u64 {
        let mut z = self
            .state
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_in_range() {
        let a = SplitMix64::new(1);
        let b = SplitMix64::new(1);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        for _ in 0..100 {
            let f = a.next_f64();
            assert!((0.0..1.0).contains(&f));
            assert!(a.below(7) < 7);
        }
        assert_eq!(a.below(1), 0);
    }
}
