//! Criterion micro-benchmark (not a test): ns per memory-limiter operation in steady
//! state — acquire + settle + release of a [`MemoryLimiter`] permit with every limit on
//! (source RPM, TPM and concurrency, scope RPM and TPM), the same cycle on core's
//! `WindowLimiter` alone, and a refused acquire. The clock advances 1 ms per cycle, so
//! the windows hold one minute of traffic at 1 000 cycles/s and every cycle also prunes
//! the entry that left them. `cargo bench -p polygw-limiter-memory --bench limiter_ns`
//! (part of `cargo xtask bench governance`); method and numbers: docs/BENCHMARKS.md,
//! "Governance".

#![allow(
    clippy::disallowed_methods,
    reason = "a benchmark reads the load average and needs a base instant"
)]

use std::future::Future;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion};
use polygw_core::ports::{AcquireRequest, Admission, Clock, RateLimiter};
use polygw_core::window::WindowLimiter;
use polygw_limiter_memory::MemoryLimiter;

/// A clock that moves `step` at every reading (0.5 ms: an acquire and a settlement read
/// it once each, one cycle per ms; 0: time stands still).
#[derive(Debug)]
struct SteppingClock {
    base: Instant,
    readings: AtomicU64,
    step: Duration,
}

impl SteppingClock {
    fn new(step: Duration) -> Arc<Self> {
        Arc::new(SteppingClock {
            base: Instant::now(),
            readings: AtomicU64::new(0),
            step,
        })
    }
}

impl Clock for SteppingClock {
    fn now(&self) -> Instant {
        let n = self.readings.fetch_add(1, Ordering::Relaxed);
        self.base + self.step * u32::try_from(n).unwrap_or(u32::MAX)
    }
    fn unix_ms(&self) -> i64 {
        0
    }
}

/// Polls a future that never pends (the memory limiter's never do) to completion.
fn ready<F: Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("the memory limiter never pends"),
    }
}

/// Every limit on, never reached at 1 000 cycles/s (60 000 requests per window).
fn request(rpm: u32) -> AcquireRequest<'static> {
    AcquireRequest {
        scope: "BENCH",
        source: "a",
        rpm,
        tpm: 1 << 40,
        max_concurrency: 64,
        scope_rpm: 1_000_000,
        scope_tpm: 1 << 41,
        est_tokens: 1000,
        lease: Duration::from_secs(90),
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("memory_limiter");
    g.sample_size(50).measurement_time(Duration::from_secs(4));

    let limiter = MemoryLimiter::new(SteppingClock::new(Duration::from_micros(500)));
    let req = request(1_000_000);
    let mut i = 0u64;
    g.bench_function("acquire+settle+release", |b| {
        b.iter(|| {
            i += 1;
            match ready(limiter.acquire(black_box(&req))) {
                Ok(Admission::Admitted(mut p)) => ready(p.finish(500 + i % 7)).expect("settle"),
                other => panic!("expected an admission, got {other:?}"),
            }
        })
    });

    let mut model = WindowLimiter::new();
    let mut now = 0u64;
    g.bench_function("same cycle on core's WindowLimiter", |b| {
        b.iter(|| {
            now += 1;
            let id = model.acquire(now, black_box(&req)).expect("admitted");
            model.settle(now, id, 500 + now % 7);
            model.release(id);
            // Compacted as often as the memory backend does it (every 15 s of clock).
            if now % 15_000 == 0 {
                model.compact(now);
            }
        })
    });

    let refusing = MemoryLimiter::new(SteppingClock::new(Duration::ZERO));
    let full = request(100);
    for _ in 0..100 {
        if let Ok(Admission::Admitted(mut p)) = ready(refusing.acquire(&full)) {
            ready(p.finish(1)).expect("settle");
        }
    }
    g.bench_function("refused acquire (rpm full)", |b| {
        b.iter(|| match ready(refusing.acquire(black_box(&full))) {
            Ok(Admission::Refused(r)) => r,
            other => panic!("expected a refusal, got {other:?}"),
        })
    });
    g.finish();
}

criterion_group!(benches, bench);

fn main() {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "memory limiter ns/op (criterion; clock +1 ms per cycle); load average: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    benches();
    Criterion::default().configure_from_args().final_summary();
}
