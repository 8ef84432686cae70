//! Benchmark (not a test): in-process governance cost per operation — acquire + settle +
//! release of a [`MemoryLimiter`] permit, a refused acquire, and the same under two
//! threads contending for one scope. Prints ns/op; `cargo bench -p polygw-limiter-memory`.
//! Method and recorded numbers: docs/BENCHMARKS.md, section "Governance".

#![allow(
    clippy::disallowed_methods,
    reason = "a benchmark measures real elapsed time and feeds the limiter a real clock"
)]

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use polygw_core::ports::{AcquireRequest, Admission, Clock, RateLimiter};
use polygw_limiter_memory::MemoryLimiter;

/// The system monotonic clock (the facade injects its own; the bench needs a real one).
#[derive(Debug)]
struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
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

fn request(source: &str, rpm: u32) -> AcquireRequest<'_> {
    AcquireRequest {
        scope: "BENCH",
        source,
        rpm,
        tpm: 1 << 40,
        max_concurrency: 64,
        // Every limit on (the scope RPM too), none reached.
        scope_rpm: u32::MAX,
        scope_tpm: 1 << 41,
        est_tokens: 1000,
        lease: Duration::from_secs(90),
    }
}

/// `n` acquire + settle + release cycles on `source`; returns elapsed time.
fn cycles(limiter: &MemoryLimiter, source: &str, n: u64) -> Duration {
    let req = request(source, u32::MAX);
    let start = Instant::now();
    for i in 0..n {
        match ready(limiter.acquire(&req)) {
            Ok(Admission::Admitted(mut p)) => ready(p.finish(500 + i % 7)).expect("settle"),
            other => panic!("expected an admission, got {other:?}"),
        }
    }
    start.elapsed()
}

fn ns_per_op(d: Duration, n: u64) -> f64 {
    d.as_nanos() as f64 / n as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    const N: u64 = 100_000;
    const RUNS: usize = 7;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "memory governance benchmark ({RUNS} runs of {N} ops, median); load average: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );

    // Each run gets a fresh limiter so window sizes (≤ N entries) are the same per run.
    let single: Vec<f64> = (0..RUNS)
        .map(|_| {
            let l = MemoryLimiter::new(Arc::new(SystemClock));
            cycles(&l, "a", N / 10); // warm-up
            ns_per_op(cycles(&l, "a", N), N)
        })
        .collect();
    println!(
        "  acquire+settle+release, 1 thread:       {:>8.0} ns/op",
        median(single)
    );

    // The same cycle on core's model alone (no mutex, permit, boxing or clock): the part
    // of the cost that is the reference model's own bookkeeping.
    let model: Vec<f64> = (0..RUNS)
        .map(|_| {
            let mut m = polygw_core::window::WindowLimiter::new();
            let req = request("m", u32::MAX);
            let start = Instant::now();
            for i in 0..N {
                let id = m.acquire(0, &req).expect("admitted");
                m.settle(0, id, 500 + i % 7);
                m.release(id);
            }
            ns_per_op(start.elapsed(), N)
        })
        .collect();
    println!(
        "  same cycle on core's WindowLimiter alone: {:>8.0} ns/op",
        median(model)
    );

    let refused: Vec<f64> = (0..RUNS)
        .map(|_| {
            let l = MemoryLimiter::new(Arc::new(SystemClock));
            let req = request("r", 100);
            for _ in 0..100 {
                if let Ok(Admission::Admitted(mut p)) = ready(l.acquire(&req)) {
                    ready(p.finish(1)).expect("settle");
                }
            }
            let start = Instant::now();
            for _ in 0..N {
                match ready(l.acquire(&req)) {
                    Ok(Admission::Refused(_)) => {}
                    other => panic!("expected a refusal, got {other:?}"),
                }
            }
            ns_per_op(start.elapsed(), N)
        })
        .collect();
    println!(
        "  refused acquire (rpm full), 1 thread:   {:>8.0} ns/op",
        median(refused)
    );

    let contended: Vec<f64> = (0..RUNS)
        .map(|_| {
            let l = MemoryLimiter::new(Arc::new(SystemClock));
            let start = Instant::now();
            std::thread::scope(|s| {
                for src in ["a", "b"] {
                    let l = &l;
                    s.spawn(move || cycles(l, src, N / 2));
                }
            });
            ns_per_op(start.elapsed(), N)
        })
        .collect();
    println!(
        "  acquire+settle+release, 2 threads:      {:>8.0} ns/op (wall time / total ops)",
        median(contended)
    );
}
