//! Benchmark (not a test): one Redis shared by 4 processes — each a copy of this program
//! (re-invoked through `current_exe()` as a worker), all governing one scope. Measures
//! total acquire + settle throughput and per-process latency against the same load from
//! 1 process in the same run, and checks that the shared limits hold across processes
//! (admitted ≤ RPM, in flight ≤ MAX_CONCURRENCY) — on the single server
//! (`POLYGW_TEST_REDIS_URL`) and, as a second column, on the local Redis Cluster
//! (`POLYGW_TEST_REDIS_CLUSTER_URL`, started by `.ci/redis-cluster.sh`; skipped when it
//! is down). `cargo bench -p polygw-limiter-redis --bench redis_processes`
//! (`cargo xtask bench governance`); skipped with a message when Redis is down. Method
//! and results: docs/BENCHMARKS.md, "Governance across processes".

#![allow(
    clippy::disallowed_methods,
    reason = "a benchmark measures real elapsed time"
)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use polygw_core::ports::{AcquireRequest, Admission, RateLimiter};
use polygw_limiter_redis::{RedisGovernance, RedisLimiter, RedisOptions};

/// Set (to the mode) in a worker's environment.
const WORKER: &str = "POLYGW_BENCH_REDIS_WORKER";

/// What one worker process does.
#[derive(Debug, Clone)]
struct Job {
    /// `throughput`, `rpm` or `concurrency`.
    mode: String,
    url: String,
    scope: String,
    tasks: usize,
    /// Operations per task (`rpm`: attempts; others: admitted cycles).
    ops: usize,
    /// The limit under test (`rpm`: RPM; `concurrency`: MAX_CONCURRENCY).
    limit: u64,
}

impl Job {
    fn env(&self) -> Vec<(String, String)> {
        vec![
            (WORKER.into(), self.mode.clone()),
            ("POLYGW_BENCH_REDIS_URL".into(), self.url.clone()),
            ("POLYGW_BENCH_REDIS_SCOPE".into(), self.scope.clone()),
            ("POLYGW_BENCH_REDIS_TASKS".into(), self.tasks.to_string()),
            ("POLYGW_BENCH_REDIS_OPS".into(), self.ops.to_string()),
            ("POLYGW_BENCH_REDIS_LIMIT".into(), self.limit.to_string()),
        ]
    }

    fn from_env(mode: String) -> Job {
        let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
        let num = |k: &str| var(k).parse::<u64>().unwrap_or_else(|_| panic!("{k}"));
        Job {
            mode,
            url: var("POLYGW_BENCH_REDIS_URL"),
            scope: var("POLYGW_BENCH_REDIS_SCOPE"),
            tasks: num("POLYGW_BENCH_REDIS_TASKS") as usize,
            ops: num("POLYGW_BENCH_REDIS_OPS") as usize,
            limit: num("POLYGW_BENCH_REDIS_LIMIT"),
        }
    }

    fn request(&self) -> AcquireRequest<'_> {
        let mut r = AcquireRequest {
            scope: &self.scope,
            source: "bench",
            rpm: 10_000_000,
            tpm: 1 << 45,
            max_concurrency: 100_000,
            scope_rpm: 10_000_000,
            scope_tpm: 1 << 46,
            est_tokens: 1000,
            lease: Duration::from_secs(90),
        };
        match self.mode.as_str() {
            "rpm" => r.rpm = self.limit as u32,
            "concurrency" => r.max_concurrency = self.limit as u32,
            _ => {}
        }
        r
    }
}

/// What one task of a worker saw.
#[derive(Default)]
struct TaskOut {
    lat: Vec<Duration>,
    admitted: u64,
    refused: u64,
    max_in_flight: i64,
}

/// A plain connection for the in-flight counter: single server or cluster.
#[derive(Clone)]
enum Raw {
    Single(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Raw {
    async fn connect(url: &str) -> Raw {
        let (nodes, cluster) = polygw_core::config::guards::redis_nodes(url).expect("a redis url");
        if cluster {
            let c = redis::cluster::ClusterClient::new(nodes).expect("cluster client");
            Raw::Cluster(c.get_async_connection().await.expect("cluster connection"))
        } else {
            Raw::Single(
                redis::aio::ConnectionManager::new(redis::Client::open(url).expect("url"))
                    .await
                    .expect("raw connection"),
            )
        }
    }

    async fn add(&mut self, key: &str, by: i64) -> i64 {
        let mut cmd = redis::cmd("INCRBY");
        cmd.arg(key).arg(by);
        match self {
            Raw::Single(c) => cmd.query_async(c).await,
            Raw::Cluster(c) => cmd.query_async(c).await,
        }
        .expect("INCRBY")
    }
}

async fn task(job: Job, lim: RedisLimiter, mut con: Raw) -> TaskOut {
    let mut out = TaskOut::default();
    let req = job.request();
    let counter = format!("polygw:{{{}}}:bench-in-flight", job.scope);
    let give_up = Instant::now() + Duration::from_secs(60);
    let mut done = 0;
    while done < job.ops && Instant::now() < give_up {
        let t = Instant::now();
        match lim.acquire(&req).await.expect("acquire") {
            Admission::Admitted(mut p) => {
                out.admitted += 1;
                if job.mode == "concurrency" {
                    // Count ourselves in flight while holding the permit (the counter
                    // can only under-count the limiter's in-flight set).
                    let n = con.add(&counter, 1).await;
                    out.max_in_flight = out.max_in_flight.max(n);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    con.add(&counter, -1).await;
                }
                p.finish(700).await.expect("settle");
                if job.mode != "concurrency" {
                    out.lat.push(t.elapsed());
                }
                done += 1;
            }
            Admission::Refused(_) => {
                out.refused += 1;
                match job.mode.as_str() {
                    "rpm" => done += 1,
                    "concurrency" => tokio::time::sleep(Duration::from_millis(1)).await,
                    _ => panic!("benchmark limits refused an acquire"),
                }
            }
        }
    }
    out
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e6
}

/// A worker: connect and warm up, say `ready`, wait for `go` on stdin, run, print one
/// `result k=v …` line.
fn worker(mode: String) {
    let job = Job::from_env(mode);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (gov, raw) = rt.block_on(async {
        let gov = RedisGovernance::connect(&job.url, RedisOptions::default())
            .await
            .expect("connect");
        let raw = Raw::connect(&job.url).await;
        // Warm-up on a scope of its own (loads the scripts, fills buffers).
        let warm = Job {
            mode: "throughput".into(),
            scope: format!("{}-warm-{}", job.scope, std::process::id()),
            tasks: 1,
            ops: 100,
            ..job.clone()
        };
        task(warm, gov.limiter(), raw.clone()).await;
        (gov, raw)
    });
    println!("ready");
    std::io::stdout().flush().expect("stdout");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("stdin");
    assert_eq!(line.trim(), "go", "unexpected start signal");
    let (outs, secs) = rt.block_on(async {
        let start = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..job.tasks {
            set.spawn(task(job.clone(), gov.limiter(), raw.clone()));
        }
        let mut outs = Vec::new();
        while let Some(o) = set.join_next().await {
            outs.push(o.expect("task"));
        }
        let secs = start.elapsed().as_secs_f64();
        gov.limiter().flush().await.expect("flush");
        (outs, secs)
    });
    let mut lat: Vec<Duration> = outs.iter().flat_map(|o| o.lat.iter().copied()).collect();
    lat.sort();
    println!(
        "result admitted={} refused={} secs={secs:.6} p50={:.1} p99={:.1} max_in_flight={}",
        outs.iter().map(|o| o.admitted).sum::<u64>(),
        outs.iter().map(|o| o.refused).sum::<u64>(),
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        outs.iter().map(|o| o.max_in_flight).max().unwrap_or(0),
    );
}

/// The parsed `result` line of one worker.
type Figures = HashMap<String, f64>;

/// Starts `procs` workers, releases them together, returns their results and the wall
/// time from the start signal to the last result.
fn run_phase(procs: usize, job: &Job) -> (Vec<Figures>, Duration) {
    let exe = std::env::current_exe().expect("current exe");
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut children: Vec<Child> = Vec::new();
    for i in 0..procs {
        let mut child = Command::new(&exe)
            .envs(job.env())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn worker");
        let out = child.stdout.take().expect("stdout");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((i, line));
            }
        });
        children.push(child);
    }
    let wait_for = |prefix: &str| {
        let mut got = vec![None; procs];
        while got.iter().any(Option::is_none) {
            let (i, line) = rx
                .recv_timeout(Duration::from_secs(120))
                .unwrap_or_else(|_| panic!("a worker did not say `{prefix}`"));
            if line.starts_with(prefix) {
                got[i] = Some(line);
            }
        }
        got.into_iter().map(Option::unwrap).collect::<Vec<_>>()
    };
    wait_for("ready");
    let start = Instant::now();
    for c in &mut children {
        let stdin = c.stdin.as_mut().expect("stdin");
        stdin.write_all(b"go\n").expect("go");
        stdin.flush().expect("flush");
    }
    let lines = wait_for("result");
    let wall = start.elapsed();
    for mut c in children {
        let status = c.wait().expect("wait");
        assert!(status.success(), "worker failed: {status}");
    }
    let figures = lines
        .iter()
        .map(|l| {
            l.split_whitespace()
                .skip(1)
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.parse().unwrap_or(f64::NAN)))
                .collect()
        })
        .collect();
    (figures, wall)
}

fn sum(f: &[Figures], k: &str) -> f64 {
    f.iter().map(|x| x[k]).sum()
}

/// (EVALSHA calls, µs) the target's servers have spent so far, summed over its nodes
/// (INFO commandstats; other clients of a shared server count too).
fn evalsha_totals(url: &str) -> (u64, u64) {
    let (nodes, _) = polygw_core::config::guards::redis_nodes(url).expect("a redis url");
    let mut total = (0, 0);
    for node in nodes {
        let node = if node.contains("://") {
            node
        } else {
            format!("redis://{node}")
        };
        let mut con = redis::Client::open(node.as_str())
            .and_then(|c| c.get_connection())
            .expect("a node connection");
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut con)
            .expect("INFO");
        let line = info
            .lines()
            .find(|l| l.starts_with("cmdstat_evalsha:"))
            .unwrap_or("");
        let field = |name: &str| -> u64 {
            line.split([':', ','])
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        total.0 += field("calls");
        total.1 += field("usec");
    }
    total
}

/// The figures of one target (single server or cluster).
#[derive(Debug, Default)]
struct Target {
    /// ops/s of the throughput phases, in order.
    rates: Vec<f64>,
    /// per-process p50 / p99 (µs) ranges of the throughput phases.
    latency: Vec<String>,
    rpm: Vec<String>,
    concurrency: Vec<String>,
    ok: bool,
}

fn measure(url: &str, name: &str, full: bool) -> Target {
    let ops = if full { 300 } else { 10 };
    let job = |mode: &str, tasks: usize, ops: usize, limit: u64| Job {
        mode: mode.into(),
        url: url.to_string(),
        scope: polygw_testkit::services::unique_name("BENCHP"),
        tasks,
        ops,
        limit,
    };
    let mut t = Target {
        ok: true,
        ..Target::default()
    };

    // Throughput: the same total concurrency from 1 process and from 4; then 4 processes
    // each as loaded as the single one.
    println!("\n[{name}] throughput (every limit on, never reached; {ops} cycles per task):");
    println!(
        "  {:<36} {:>7} {:>9} {:>9}   per-process p50 / p99 (µs)",
        "phase", "ops", "ops/s", "vs 1 proc"
    );
    let mut base = 0.0;
    for (procs, tasks) in [(1usize, 32usize), (4, 8), (4, 32)] {
        let before = evalsha_totals(url);
        let (f, wall) = run_phase(procs, &job("throughput", tasks, ops, 0));
        let after = evalsha_totals(url);
        let total = sum(&f, "admitted");
        let rate = total / wall.as_secs_f64();
        // The server side of the phase: time per script, how busy the scripts kept the
        // server, and the cycles/s that time allows (two scripts per cycle).
        let (calls, usec) = (after.0 - before.0, after.1 - before.1);
        let us_per = usec as f64 / calls.max(1) as f64;
        let server = format!(
            "server: {calls} scripts, {us_per:.1} µs each, busy {:.0} % of the phase; ceiling at that cost {:.0} cycles/s",
            100.0 * usec as f64 / 1e6 / wall.as_secs_f64(),
            1e6 / (2.0 * us_per)
        );
        if procs == 1 {
            base = rate;
        }
        let per: Vec<String> = f
            .iter()
            .map(|x| format!("{:.0}/{:.0}", x["p50"], x["p99"]))
            .collect();
        println!(
            "  {:<36} {:>7.0} {:>9.0} {:>8.2}×   {}",
            format!("{procs} process(es) × {tasks} tasks"),
            total,
            rate,
            rate / base,
            per.join("  ")
        );
        println!("  {:<36} {server}", "");
        let (lo50, hi50) = f.iter().fold((f64::MAX, 0.0f64), |(lo, hi), x| {
            (lo.min(x["p50"]), hi.max(x["p50"]))
        });
        let (lo99, hi99) = f.iter().fold((f64::MAX, 0.0f64), |(lo, hi), x| {
            (lo.min(x["p99"]), hi.max(x["p99"]))
        });
        t.rates.push(rate);
        t.latency.push(format!(
            "{:.1}–{:.1} ms / {:.1}–{:.1} ms",
            lo50 / 1000.0,
            hi50 / 1000.0,
            lo99 / 1000.0,
            hi99 / 1000.0
        ));
        assert_eq!(total as usize, procs * tasks * ops, "every cycle admitted");
    }

    // Limits shared across processes.
    println!("\n[{name}] shared limits:");
    let rpm = if full { 1000 } else { 50 };
    for (procs, tasks) in [(1usize, 32usize), (4, 8)] {
        let attempts = if full { 60 } else { 4 };
        let (f, wall) = run_phase(procs, &job("rpm", tasks, attempts, rpm));
        let admitted = sum(&f, "admitted");
        let refused = sum(&f, "refused");
        let good = admitted as u64 == rpm;
        t.ok &= admitted as u64 <= rpm;
        println!(
            "  RPM {rpm}, {procs} process(es) × {tasks} tasks × {attempts} attempts: admitted {admitted:.0}, refused {refused:.0} \
             in {:.2} s — {}",
            wall.as_secs_f64(),
            if good {
                "exactly the limit"
            } else if admitted as u64 <= rpm {
                "under the limit"
            } else {
                "OVER THE LIMIT"
            }
        );
        t.rpm.push(format!("admitted {admitted:.0} of {rpm}"));
    }
    let cap = 8;
    for (procs, tasks) in [(1usize, 32usize), (4, 8)] {
        let cycles = if full { 25 } else { 3 };
        let (f, wall) = run_phase(procs, &job("concurrency", tasks, cycles, cap));
        let admitted = sum(&f, "admitted");
        let refused = sum(&f, "refused");
        let max = f.iter().map(|x| x["max_in_flight"]).fold(0.0, f64::max);
        t.ok &= max as u64 <= cap;
        println!(
            "  MAX_CONCURRENCY {cap}, {procs} process(es) × {tasks} tasks, each holding a permit 1 ms × {cycles}: \
             admitted {admitted:.0} ({:.0}/s), refused {refused:.0}, most seen in flight {max:.0} — {}",
            admitted / wall.as_secs_f64(),
            if max as u64 <= cap { "within the cap" } else { "OVER THE CAP" }
        );
        t.concurrency.push(format!(
            "most in flight {max:.0}/{cap}; {:.0} admitted/s",
            admitted / wall.as_secs_f64()
        ));
    }
    t
}

fn main() {
    if let Ok(mode) = std::env::var(WORKER) {
        worker(mode);
        return;
    }
    let Some(url) = polygw_testkit::services::redis_url() else {
        println!("redis multi-process benchmark skipped: Redis is not reachable");
        return;
    };
    let full = std::env::args().any(|a| a == "--bench");
    let load = || {
        std::fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    println!(
        "redis governance across processes: one scope, acquire + settle (reservation 1000, settlement 700); load average {}",
        load()
    );
    let single = measure(&url, "single server", full);
    let cluster =
        polygw_testkit::services::redis_cluster_url().map(|u| measure(&u, "3-node cluster", full));

    // Both targets side by side; ratios against the single server's 1-process phase of
    // this run (the baseline), and the cluster's against its own 1-process phase.
    println!("\nsummary (ops/s; ratio to the single server's 1 process × 32 tasks of this run):");
    let phases = [
        "1 process × 32 tasks",
        "4 processes × 8 tasks",
        "4 processes × 32 tasks",
    ];
    let base = single.rates[0];
    for (i, p) in phases.iter().enumerate() {
        let c = match &cluster {
            Some(c) => format!(
                "{:>9.0} ({:.2}×; {:.2}× its own 1-process)",
                c.rates[i],
                c.rates[i] / base,
                c.rates[i] / c.rates[0]
            ),
            None => "skipped (no cluster)".into(),
        };
        println!(
            "  {p:<24} single {:>9.0} ({:.2}×)   cluster {c}",
            single.rates[i],
            single.rates[i] / base
        );
        println!(
            "  {:<24} p50/p99 single {}   cluster {}",
            "",
            single.latency[i],
            cluster
                .as_ref()
                .map(|c| c.latency[i].as_str())
                .unwrap_or("-")
        );
    }
    for (i, what) in ["RPM, 1 process", "RPM, 4 processes"].iter().enumerate() {
        println!(
            "  {what:<24} single {}   cluster {}",
            single.rpm[i],
            cluster.as_ref().map(|c| c.rpm[i].as_str()).unwrap_or("-")
        );
    }
    for (i, what) in ["concurrency, 1 process", "concurrency, 4 processes"]
        .iter()
        .enumerate()
    {
        println!(
            "  {what:<24} single {}   cluster {}",
            single.concurrency[i],
            cluster
                .as_ref()
                .map(|c| c.concurrency[i].as_str())
                .unwrap_or("-")
        );
    }
    println!("\nload average {}", load());
    if !single.ok || cluster.as_ref().is_some_and(|c| !c.ok) {
        eprintln!("redis multi-process benchmark: a shared limit was exceeded");
        std::process::exit(1);
    }
}
