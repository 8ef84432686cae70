//! Benchmark (not a test): the Redis limiter's acquire + settle cost — latency
//! percentiles one at a time, throughput under concurrency, and the server time of each
//! script — against a raw single-script EVALSHA baseline measured in the same run on the
//! same server. It runs on a `redis-server` of its own (started on a free port, so the
//! server's statistics hold only this program's commands), or on `POLYGW_TEST_REDIS_URL`
//! when `redis-server` cannot be started.
//! `cargo bench -p polygw-limiter-redis --bench redis_governance`; skipped with a message
//! when no Redis is reachable. Method and numbers: docs/BENCHMARKS.md, "Governance".

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

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // An own server when possible (statistics of this program's commands only); kept
    // alive until the end of main.
    let own = polygw_testkit::services::RedisServer::start();
    let url = match &own {
        Ok(s) => s.url(),
        Err(e) => match polygw_testkit::services::redis_url() {
            Some(u) => {
                println!("(no own redis-server: {e}; using the shared {u}: its statistics include other clients)");
                u
            }
            None => {
                println!("redis governance benchmark skipped: Redis is not reachable");
                return;
            }
        },
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

    let server: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut raw.clone())
        .await
        .expect("INFO");
    let version = server
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .to_string();
    println!(
        "redis governance benchmark: Redis {version} ({}); sequential {SEQUENTIAL} ops; concurrent {TASKS} tasks × {PER_TASK} ops, one connection; load average {}",
        if own.is_ok() { "own server" } else { "shared server" },
        load()
    );
    let mut lat = Vec::with_capacity(SEQUENTIAL);
    let start = Instant::now();
    for _ in 0..SEQUENTIAL {
        let t = Instant::now();
        baseline(&mut raw.clone(), &script).await;
        lat.push(t.elapsed());
    }
    let total = start.elapsed();
    let base_p50 = {
        let mut l = lat.clone();
        l.sort();
        pct(&l, 0.5)
    };
    report("baseline EVALSHA, sequential", lat, total);
    // Acquire alone: each permit is finished right after its acquire is timed (outside
    // the timing), so no phase starts with thousands of open permits in the windows.
    let mut lat = Vec::with_capacity(SEQUENTIAL);
    let mut busy = Duration::ZERO;
    for _ in 0..SEQUENTIAL {
        let t = Instant::now();
        let admission = limiter.acquire(&request(&scope)).await.expect("acquire");
        let d = t.elapsed();
        lat.push(d);
        busy += d;
        match admission {
            Admission::Admitted(mut p) => p.finish(700).await.expect("settle"),
            Admission::Refused(r) => panic!("{r:?}"),
        }
    }
    report("acquire only, sequential", lat, busy);
    let mut lat = Vec::with_capacity(SEQUENTIAL);
    let start = Instant::now();
    for _ in 0..SEQUENTIAL {
        let t = Instant::now();
        cycle(&limiter, &scope).await;
        lat.push(t.elapsed());
    }
    let total = start.elapsed();
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
    let mut admin = raw.clone();
    let s0 = evalsha_stats(&mut admin).await;
    let (lat, total) = run_concurrent("baseline").await;
    let s1 = evalsha_stats(&mut admin).await;
    let base_tput = lat.len() as f64 / total.as_secs_f64();
    report("baseline EVALSHA, concurrent", lat, total);
    let (lat, total) = run_concurrent("pair").await;
    let s2 = evalsha_stats(&mut admin).await;
    let pair_tput = lat.len() as f64 / total.as_secs_f64();
    report("acquire+settle, concurrent", lat, total);
    println!(
        "  server time per script (INFO commandstats): baseline {:.1} µs, acquire/settle {:.1} µs ({:.1}× the baseline)",
        server_us(s0, s1),
        server_us(s1, s2),
        server_us(s1, s2) / server_us(s0, s1)
    );
    // Each script alone: 2 000 acquires (their permits open meanwhile), then their
    // settlements, the server's time read around each half.
    let mut permits = Vec::with_capacity(2000);
    let a0 = evalsha_stats(&mut admin).await;
    for _ in 0..2000 {
        match limiter.acquire(&request(&scope)).await.expect("acquire") {
            Admission::Admitted(p) => permits.push(p),
            Admission::Refused(r) => panic!("{r:?}"),
        }
    }
    let a1 = evalsha_stats(&mut admin).await;
    for mut p in permits {
        p.finish(700).await.expect("settle");
    }
    let a2 = evalsha_stats(&mut admin).await;
    println!(
        "  server time per script, one at a time (INFO commandstats): acquire {:.1} µs, settle + release {:.1} µs ({:.1}× / {:.1}× the baseline's)",
        server_us(a0, a1),
        server_us(a1, a2),
        server_us(a0, a1) / server_us(s0, s1),
        server_us(a1, a2) / server_us(s0, s1),
    );
    println!(
        "  ratio acquire+settle / baseline: p50 latency {:.2}× (2 round trips ⇒ ≥ 2×); concurrent throughput {:.2} of the baseline's",
        pair_p50 / base_p50,
        pair_tput / base_tput
    );
    limiter.flush().await.expect("flush");
    println!("  load average {}", load());
}
