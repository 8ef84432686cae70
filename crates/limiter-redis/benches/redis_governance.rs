//! Benchmark (not a test): the Redis limiter's acquire + settle cost — latency
//! percentiles one at a time and throughput under concurrency — against a raw
//! single-script EVALSHA baseline measured in the same run on the same connection.
//! `cargo bench -p polygw-limiter-redis`; skipped with a message when Redis is down.
//! Method and recorded numbers: docs/BENCHMARKS.md, section "Governance".

#![allow(
    clippy::disallowed_methods,
    reason = "a benchmark measures real elapsed time"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use polygw_core::ports::{AcquireRequest, Admission, RateLimiter};
use polygw_limiter_redis::{RedisGovernance, RedisLimiter, RedisOptions};

const SEQUENTIAL: usize = 4000;
const TASKS: usize = 32;
const PER_TASK: usize = 500;

fn request(scope: &str) -> AcquireRequest<'_> {
    AcquireRequest {
        scope,
        source: "bench",
        rpm: 10_000_000,
        tpm: 1 << 45,
        max_concurrency: 10_000,
        scope_rpm: 10_000_000,
        scope_tpm: 1 << 46,
        est_tokens: 1000,
        lease: Duration::from_secs(90),
    }
}

async fn cycle(l: &RedisLimiter, scope: &str) {
    match l.acquire(&request(scope)).await.expect("acquire") {
        Admission::Admitted(mut p) => p.finish(700).await.expect("settle"),
        Admission::Refused(r) => panic!("benchmark limits refused: {r:?}"),
    }
}

/// One EVALSHA round trip of a trivial script (the floor any script-based limiter pays).
async fn baseline(con: &mut redis::aio::ConnectionManager, script: &redis::Script) {
    let _: i64 = script
        .key("polygw:{BENCH}:baseline")
        .arg(1)
        .invoke_async(con)
        .await
        .expect("baseline evalsha");
}

/// (calls, µs) the server has spent in EVALSHA so far (INFO commandstats).
async fn evalsha_stats(con: &mut redis::aio::ConnectionManager) -> (u64, u64) {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(con)
        .await
        .expect("INFO");
    let line = info
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .unwrap_or("");
    let field = |name: &str| {
        line.split([':', ','])
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("calls"), field("usec"))
}

/// Server time per script between two readings.
fn server_us(before: (u64, u64), after: (u64, u64)) -> f64 {
    (after.1 - before.1) as f64 / (after.0 - before.0).max(1) as f64
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn report(name: &str, mut lat: Vec<Duration>, total: Duration) {
    lat.sort();
    println!(
        "  {name:<34} {:>9.0} ops/s   p50 {:>6.0} µs   p95 {:>6.0} µs   p99 {:>6.0} µs",
        lat.len() as f64 / total.as_secs_f64(),
        pct(&lat, 0.50),
        pct(&lat, 0.95),
        pct(&lat, 0.99),
    );
}

async fn sequential<F, Fut>(n: usize, mut f: F) -> (Vec<Duration>, Duration)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut lat = Vec::with_capacity(n);
    let start = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        f().await;
        lat.push(t.elapsed());
    }
    (lat, start.elapsed())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Some(url) = polygw_testkit::services::redis_url() else {
        println!("redis governance benchmark skipped: Redis is not reachable");
        return;
    };
    let gov = RedisGovernance::connect(&url, RedisOptions::default())
        .await
        .expect("connect");
    let limiter = gov.limiter();
    let client = redis::Client::open(url.as_str()).expect("url");
    let raw = redis::aio::ConnectionManager::new(client)
        .await
        .expect("raw connection");
    let script = redis::Script::new("return redis.call('EXISTS', KEYS[1]) + tonumber(ARGV[1])");
    let scope = polygw_testkit::services::unique_name("BENCH");

    // warm-up (loads the scripts, fills connection buffers)
    for _ in 0..300 {
        cycle(&limiter, &scope).await;
        baseline(&mut raw.clone(), &script).await;
    }

    println!(
        "redis governance benchmark: sequential {SEQUENTIAL} ops; concurrent {TASKS} tasks × {PER_TASK} ops, one connection"
    );
    let (lat, total) = sequential(SEQUENTIAL, || {
        let (mut con, script) = (raw.clone(), script.clone());
        async move { baseline(&mut con, &script).await }
    })
    .await;
    let base_p50 = {
        let mut l = lat.clone();
        l.sort();
        pct(&l, 0.5)
    };
    report("baseline EVALSHA, sequential", lat, total);
    let (lat, total) = sequential(SEQUENTIAL, || async {
        match limiter.acquire(&request(&scope)).await.expect("acquire") {
            Admission::Admitted(p) => std::mem::forget(p),
            Admission::Refused(r) => panic!("{r:?}"),
        }
    })
    .await;
    report("acquire only, sequential", lat, total);
    let (lat, total) = sequential(SEQUENTIAL, || cycle(&limiter, &scope)).await;
    let pair_p50 = {
        let mut l = lat.clone();
        l.sort();
        pct(&l, 0.5)
    };
    report("acquire+settle, sequential", lat, total);

    let lim = Arc::new(limiter.clone());
    let run_concurrent = |which: &'static str| {
        let lim = lim.clone();
        let scope = scope.clone();
        let raw = raw.clone();
        let script = script.clone();
        async move {
            let start = Instant::now();
            let mut tasks = vec![];
            for _ in 0..TASKS {
                let (lim, scope, mut raw, script) =
                    (lim.clone(), scope.clone(), raw.clone(), script.clone());
                tasks.push(tokio::spawn(async move {
                    let mut lat = Vec::with_capacity(PER_TASK);
                    for _ in 0..PER_TASK {
                        let t = Instant::now();
                        if which == "pair" {
                            cycle(&lim, &scope).await;
                        } else {
                            baseline(&mut raw, &script).await;
                        }
                        lat.push(t.elapsed());
                    }
                    lat
                }));
            }
            let mut all = vec![];
            for t in tasks {
                all.extend(t.await.expect("task"));
            }
            (all, start.elapsed())
        }
    };
    let s0 = evalsha_stats(&mut raw.clone()).await;
    let (lat, total) = run_concurrent("baseline").await;
    let s1 = evalsha_stats(&mut raw.clone()).await;
    let base_tput = lat.len() as f64 / total.as_secs_f64();
    report("baseline EVALSHA, concurrent", lat, total);
    let (lat, total) = run_concurrent("pair").await;
    let s2 = evalsha_stats(&mut raw.clone()).await;
    let pair_tput = lat.len() as f64 / total.as_secs_f64();
    report("acquire+settle, concurrent", lat, total);
    println!(
        "  server time per script (INFO commandstats): baseline {:.1} µs, acquire/settle {:.1} µs",
        server_us(s0, s1),
        server_us(s1, s2)
    );

    println!(
        "  ratio acquire+settle / baseline: p50 latency {:.2}× (2 round trips ⇒ ≥ 2×), concurrent throughput {:.2}× fewer ops/s",
        pair_p50 / base_p50,
        base_tput / pair_tput
    );
    limiter.flush().await.expect("flush");
}
