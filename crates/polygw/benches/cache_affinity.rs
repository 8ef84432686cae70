//! Benchmark (not a test): prompt-cache affinity (SPEC §20.2) on a multi-turn workload
//! against three mock upstreams that simulate a provider prefix cache and bill what they
//! served (`polygw-mock-upstream`: `PrefixCache`, `Prices`, the billing log).
//!
//! Workload: sessions of 10 turns, each turn the whole conversation so far — a shared
//! 2 000-token system prompt, the session's questions (200 tokens each) and the answers
//! (100 tokens each) — so a turn's prompt starts with the previous turn's. Three sources
//! of equal weight, one mock each (its own cache: OpenAI's rules, 128-token blocks, reads
//! from 1 024 tokens, 5 minutes), the same prices on the mocks and in the sources'
//! `INPUT_PRICE` / `CACHED_INPUT_PRICE` / `OUTPUT_PRICE`. No client key is sent: the
//! affinity key is the library's fallback, a hash of the system prompt and the first
//! question. Hedging is off, so every attempt is measured and its telemetry cost can be
//! compared with the bill exactly. Every round runs turn `t` of every session at once.
//!
//! Configurations: the one-source ideal (a scope of one source: every turn finds its
//! prefix); `AFFINITY=off` and `session` in one process (memory governance); and three
//! processes — copies of this program (re-invoked through `current_exe()` as workers,
//! each its own client, connections and memory) — that take the turns of a session in
//! turn (turn `t` of session `s` on worker `(s + t) mod 3`, the worst case for a load
//! balancer's spread), with `off` and `session` on one Redis (`POLYGW_TEST_REDIS_URL`,
//! default `redis://127.0.0.1:6379`; skipped when it is down), and `session` without
//! Redis (each process remembers only its own turns). Per configuration: the share of
//! prompt tokens read from the cache (against the ideal), the bill (against the ideal),
//! what the affinity counters said, and that Σ telemetry cost = Σ billed, exactly (every
//! row's cost is its bill entry's, bit for bit).
//!
//! `cargo bench -p polygw --features redis --bench cache_affinity` (`cargo xtask bench
//! cache-affinity`); `cargo test … --benches` runs a smoke-sized workload. Results:
//! docs/BENCHMARKS.md, "Prompt-cache affinity".

#![allow(
    clippy::disallowed_methods,
    reason = "a benchmark measures real elapsed time"
)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use polygw::core::affinity::AffinityOutcome;
use polygw::core::config::load_scope;
use polygw::core::telemetry::RowKind;
use polygw::{ChatRequest, GatewayClient, Message, ScopeKind};
use polygw_mock_upstream::{Behavior, BillingEntry, CacheDialect, MockConfig, PrefixCache, Prices};
use polygw_testkit::fakes::RecordingTelemetry;
use support::{full_run, loadavg, MockHost};

/// Set in a worker's environment: the mock URLs, comma-separated.
const WORKER: &str = "POLYGW_BENCH_AFFINITY_WORKER";
const TURNS: usize = 10;
/// Prices per 1M tokens, on the mocks and in the sources' keys.
const INPUT: f64 = 2.0;
const CACHED_INPUT: f64 = 0.5;
const OUTPUT: f64 = 8.0;

/// The shared system prompt: 8 000 characters = 2 000 tokens in the mock's count.
fn system_prompt() -> String {
    let line = "You are the support assistant of a large online shop. Be precise. ";
    let mut s = String::new();
    while s.len() < 8000 {
        s.push_str(line);
    }
    s.truncate(8000);
    s
}

/// Question `t` of session `s`: 800 characters (200 tokens).
fn question(s: usize, t: usize) -> String {
    let mut q = format!(
        "Session {s}, question {t}: what about order {}? ",
        s * 100 + t
    );
    while q.len() < 800 {
        q.push_str("Please explain the delivery options in detail. ");
    }
    q.truncate(800);
    q
}

/// The mock's answer: 100 content chunks of 4 characters (100 tokens), the same every
/// time, so any process can build a session's history.
fn answer_chunks() -> Vec<String> {
    (0..100).map(|i| format!("a{:02} ", i % 100)).collect()
}

fn answer() -> String {
    answer_chunks().concat()
}

/// Turn `t` of session `s`: the whole conversation so far.
fn request(s: usize, t: usize, system: &str) -> ChatRequest {
    let mut m = vec![Message::system(system)];
    for i in 0..t {
        m.push(Message::user(question(s, i)));
        m.push(Message::assistant(answer()));
    }
    m.push(Message::user(question(s, t)));
    ChatRequest::new(m)
}

fn mock_config() -> MockConfig {
    MockConfig {
        default: Some(Behavior {
            chunks: answer_chunks(),
            ttft_ms: 40.0,
            ..Behavior::default()
        }),
        record_bodies: false,
        prefix_cache: Some(PrefixCache::new(CacheDialect::Openai)),
        prices: Some(Prices::new(INPUT, OUTPUT).with_cached_input(CACHED_INPUT)),
        ..MockConfig::default()
    }
}

/// What a configuration sets.
#[derive(Debug, Clone)]
struct Config {
    name: &'static str,
    scope: String,
    sources: usize,
    affinity: &'static str,
    redis: Option<String>,
    processes: usize,
}

fn vars(c: &Config, urls: &[String]) -> Vec<(String, String)> {
    let s = &c.scope;
    let mut v = vec![
        (format!("{s}__HEDGE__AFTER_S"), "off".to_string()),
        (format!("{s}__HEDGE__STALL_AFTER_S"), "off".to_string()),
        (format!("{s}__AFFINITY"), c.affinity.to_string()),
    ];
    if let Some(r) = &c.redis {
        v.push((format!("{s}__REDIS__URL"), r.clone()));
    }
    for (i, url) in urls.iter().take(c.sources).enumerate() {
        let p = format!("{s}__MOCK__{i}__");
        for (k, val) in [
            ("BASE_URL", url.clone()),
            ("API_KEY", String::new()),
            ("MODEL", "bench-model".to_string()),
            ("INPUT_PRICE", INPUT.to_string()),
            ("CACHED_INPUT_PRICE", CACHED_INPUT.to_string()),
            ("OUTPUT_PRICE", OUTPUT.to_string()),
        ] {
            v.push((format!("{p}{k}"), val));
        }
    }
    v
}

async fn client(c: &Config, urls: &[String], rows: Arc<RecordingTelemetry>) -> GatewayClient {
    let loaded = load_scope(vars(c, urls), &c.scope, ScopeKind::Chat).expect("scope");
    GatewayClient::builder(loaded.settings)
        .telemetry(rows)
        .build()
        .await
        .expect("client")
}

/// One attempt as telemetry recorded it.
#[derive(Debug, Clone)]
struct Row {
    call_id: String,
    source: String,
    cost_bits: Option<u64>,
}

/// One worker's (or the in-process client's) end of the run.
#[derive(Debug, Default)]
struct Out {
    rows: Vec<Row>,
    /// Hit, miss, moved.
    affinity: [u64; 3],
    /// Session → sources that served it.
    served: BTreeMap<usize, BTreeSet<String>>,
}

fn rows_of(rec: &RecordingTelemetry) -> Vec<Row> {
    rec.rows()
        .into_iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .map(|r| Row {
            call_id: r.call_id,
            source: r.source.as_deref().unwrap_or_default().to_string(),
            cost_bits: r.cost.map(f64::to_bits),
        })
        .collect()
}

fn affinity_counts(c: &GatewayClient) -> [u64; 3] {
    let m = c.metrics();
    AffinityOutcome::ALL.map(|o| m.affinity_with(o))
}

/// Runs turn `t` of session `s`; the source that served it.
async fn turn(c: &GatewayClient, s: usize, t: usize, system: &str) -> String {
    let r = c.chat(request(s, t, system)).await.expect("a call");
    assert_eq!(r.content, answer(), "the mock's fixed answer");
    r.source
}

/// The in-process configurations: every round's turns at once on one client.
fn run_in_process(c: &Config, urls: &[String], sessions: usize) -> Out {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let rows = RecordingTelemetry::new();
        let cl = client(c, urls, rows.clone()).await;
        let system: Arc<str> = system_prompt().into();
        let mut out = Out::default();
        for t in 0..TURNS {
            let mut set = tokio::task::JoinSet::new();
            for s in 0..sessions {
                let (cl, system) = (cl.clone(), system.clone());
                set.spawn(async move { (s, turn(&cl, s, t, &system).await) });
            }
            while let Some(r) = set.join_next().await {
                let (s, src) = r.expect("a turn");
                out.served.entry(s).or_default().insert(src);
            }
        }
        out.affinity = affinity_counts(&cl);
        let report = cl.shutdown().await;
        assert_eq!(report.dropped, 0);
        out.rows = rows_of(&rows);
        out
    })
}

// === the worker processes ===

/// A worker: reads `job S T` and `end` lines, answers `done S T SOURCE`, then at the end
/// `row CALL_ID SOURCE COST_BITS|-`, `aff HIT MISS MOVED` and `bye`.
fn worker(urls: String) {
    let urls: Vec<String> = urls.split(',').map(str::to_string).collect();
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let c = Config {
        name: "worker",
        scope: var("POLYGW_BENCH_AFFINITY_SCOPE"),
        sources: urls.len(),
        affinity: if var("POLYGW_BENCH_AFFINITY_MODE") == "off" {
            "off"
        } else {
            "session"
        },
        redis: Some(var("POLYGW_BENCH_AFFINITY_REDIS")).filter(|r| !r.is_empty()),
        processes: 1,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let rows = RecordingTelemetry::new();
        let cl = client(&c, &urls, rows.clone()).await;
        let system: Arc<str> = system_prompt().into();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let out = Arc::new(std::sync::Mutex::new(std::io::stdout()));
        let mut set = tokio::task::JoinSet::new();
        while let Some(line) = rx.recv().await {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["job", s, t] => {
                    let (s, t): (usize, usize) = (s.parse().unwrap(), t.parse().unwrap());
                    let (cl, system, out) = (cl.clone(), system.clone(), out.clone());
                    set.spawn(async move {
                        let src = turn(&cl, s, t, &system).await;
                        let mut o = out.lock().unwrap();
                        writeln!(o, "done {s} {t} {src}").unwrap();
                        o.flush().unwrap();
                    });
                }
                ["end"] => break,
                _ => panic!("worker: unknown line {line:?}"),
            }
        }
        while set.join_next().await.is_some() {}
        let aff = affinity_counts(&cl);
        let report = cl.shutdown().await;
        assert_eq!(report.dropped, 0);
        let mut o = out.lock().unwrap();
        for r in rows_of(&rows) {
            let cost = r.cost_bits.map_or("-".to_string(), |b| b.to_string());
            writeln!(o, "row {} {} {cost}", r.call_id, r.source).unwrap();
        }
        writeln!(o, "aff {} {} {}", aff[0], aff[1], aff[2]).unwrap();
        writeln!(o, "bye").unwrap();
        o.flush().unwrap();
    });
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
}

/// The multi-process configurations: `c.processes` copies of this program; turn `t` of
/// session `s` on worker `(s + t) mod n`, every round's turns at once.
fn run_processes(c: &Config, urls: &[String], sessions: usize) -> Out {
    let exe = std::env::current_exe().expect("current_exe");
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut workers = Vec::new();
    for i in 0..c.processes {
        let mut child = Command::new(&exe)
            .env(WORKER, urls.join(","))
            .env("POLYGW_BENCH_AFFINITY_SCOPE", &c.scope)
            .env("POLYGW_BENCH_AFFINITY_MODE", c.affinity)
            .env(
                "POLYGW_BENCH_AFFINITY_REDIS",
                c.redis.clone().unwrap_or_default(),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a worker");
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take().expect("stdin");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send((i, line)).is_err() {
                    break;
                }
            }
        });
        workers.push(Worker { child, stdin });
    }
    let mut out = Out::default();
    let n = c.processes;
    for t in 0..TURNS {
        for s in 0..sessions {
            let w = &mut workers[(s + t) % n];
            writeln!(w.stdin, "job {s} {t}").expect("send a job");
            w.stdin.flush().expect("flush");
        }
        let mut done = 0;
        while done < sessions {
            let (_, line) = rx
                .recv_timeout(Duration::from_secs(120))
                .expect("a worker answers");
            let f: Vec<&str> = line.split_whitespace().collect();
            if let ["done", s, _t, src] = f.as_slice() {
                out.served
                    .entry(s.parse().unwrap())
                    .or_default()
                    .insert(src.to_string());
                done += 1;
            } else {
                panic!("unexpected worker line during a round: {line:?}");
            }
        }
    }
    for w in &mut workers {
        writeln!(w.stdin, "end").expect("end");
        w.stdin.flush().expect("flush");
    }
    let mut byes = 0;
    while byes < n {
        let (_, line) = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("a worker's rows");
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["row", id, src, cost] => out.rows.push(Row {
                call_id: id.to_string(),
                source: src.to_string(),
                cost_bits: cost.parse().ok(),
            }),
            ["aff", h, m, v] => {
                for (i, x) in [h, m, v].iter().enumerate() {
                    out.affinity[i] += x.parse::<u64>().unwrap();
                }
            }
            ["bye"] => byes += 1,
            _ => panic!("unexpected worker line: {line:?}"),
        }
    }
    for mut w in workers {
        let st = w.child.wait().expect("a worker exits");
        assert!(st.success(), "a worker failed: {st}");
    }
    out
}

// === the figures ===

#[derive(Debug)]
struct Result_ {
    name: &'static str,
    calls: usize,
    prompt: u64,
    cached: u64,
    billed: f64,
    telemetry: f64,
    exact: bool,
    affinity: [u64; 3],
    /// Sessions served by more than one source.
    moved_sessions: usize,
    wall: Duration,
}

impl Result_ {
    fn share(&self) -> f64 {
        self.cached as f64 / self.prompt as f64
    }
}

/// Σ of costs summed in one canonical order (sorted), so that the same multiset of
/// costs always gives the same sum, bit for bit.
fn canonical_sum(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.into_iter().sum()
}

fn measure(host: &MockHost, c: &Config, sessions: usize) -> Result_ {
    for m in host.mocks() {
        m.clear_prefix_cache();
        m.reset_billing();
        m.reset_log();
    }
    let urls = host.urls();
    let t0 = Instant::now();
    let out = if c.processes > 1 {
        run_processes(c, &urls, sessions)
    } else {
        run_in_process(c, &urls, sessions)
    };
    let wall = t0.elapsed();
    let calls = sessions * TURNS;
    // Every request has ended (the calls returned), so every entry is there.
    let entries: Vec<BillingEntry> = host
        .mocks()
        .iter()
        .take(c.sources)
        .flat_map(|m| m.billing())
        .collect();
    assert_eq!(
        entries.len(),
        calls,
        "{}: one billed request per call",
        c.name
    );
    assert_eq!(
        out.rows.len(),
        calls,
        "{}: one attempt row per call",
        c.name
    );
    // Row by row: the telemetry cost of each attempt is its bill entry's, bit for bit.
    let by_id: BTreeMap<&str, &Row> = out.rows.iter().map(|r| (r.call_id.as_str(), r)).collect();
    let mut exact = true;
    for e in &entries {
        let id = e.call_id.as_deref().expect("x-polygw-call-id");
        let row = by_id
            .get(id)
            .unwrap_or_else(|| panic!("{}: no row for {id}", c.name));
        exact &= row.cost_bits.is_some() && row.cost_bits == e.cost.map(f64::to_bits);
        assert!(row.source.starts_with("mock-"));
    }
    let billed = canonical_sum(entries.iter().map(|e| e.cost.expect("priced")).collect());
    let telemetry = canonical_sum(
        out.rows
            .iter()
            .map(|r| f64::from_bits(r.cost_bits.expect("a measured row has a cost")))
            .collect(),
    );
    exact &= billed.to_bits() == telemetry.to_bits();
    assert!(
        exact,
        "{}: telemetry {telemetry} vs billed {billed}",
        c.name
    );
    Result_ {
        name: c.name,
        calls,
        prompt: entries.iter().map(|e| e.prompt_tokens).sum(),
        cached: entries.iter().map(|e| e.cached_tokens).sum(),
        billed,
        telemetry,
        exact,
        affinity: out.affinity,
        moved_sessions: out.served.values().filter(|s| s.len() > 1).count(),
        wall,
    }
}

fn redis_url() -> Option<String> {
    let url = std::env::var("POLYGW_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_string());
    let hp = url
        .split("://")
        .nth(1)
        .and_then(|r| r.rsplit('@').next())
        .and_then(|r| r.split('/').next())
        .unwrap_or("127.0.0.1:6379")
        .to_string();
    use std::net::ToSocketAddrs;
    let ok = hp.to_socket_addrs().ok().is_some_and(|mut a| {
        a.any(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_millis(500)).is_ok())
    });
    ok.then_some(url)
}

fn main() {
    if let Ok(urls) = std::env::var(WORKER) {
        worker(urls);
        return;
    }
    let sessions = if full_run() { 90 } else { 6 };
    let host = MockHost::start((0..3).map(|_| mock_config()).collect());
    let redis = redis_url();
    let pid = std::process::id();
    let cfg = |name, sources, affinity, redis: Option<String>, processes, n: usize| Config {
        name,
        scope: format!("AFF{n}P{pid}"),
        sources,
        affinity,
        redis,
        processes,
    };
    let mut configs = vec![
        cfg("one source (the ideal)", 1, "session", None, 1, 0),
        cfg("1 process, off", 3, "off", None, 1, 1),
        cfg("1 process, session", 3, "session", None, 1, 2),
        cfg("3 processes, no Redis, session", 3, "session", None, 3, 3),
    ];
    match &redis {
        Some(r) => {
            configs.push(cfg(
                "3 processes, Redis, off",
                3,
                "off",
                Some(r.clone()),
                3,
                4,
            ));
            configs.push(cfg(
                "3 processes, Redis, session",
                3,
                "session",
                Some(r.clone()),
                3,
                5,
            ));
        }
        None => eprintln!(
            "skipping the Redis configurations: Redis is not reachable (set POLYGW_TEST_REDIS_URL)"
        ),
    }
    println!(
        "prompt-cache affinity: {sessions} sessions x {TURNS} turns, 2000-token system prompt, \
         3 sources of equal weight (one mock each: openai cache dialect, 128-token blocks, \
         min 1024, ttl 300 s), prices {INPUT}/{CACHED_INPUT}/{OUTPUT} per 1M; load {}",
        loadavg()
    );
    let results: Vec<Result_> = configs
        .iter()
        .map(|c| {
            let r = measure(&host, c, sessions);
            eprintln!("  {}: done in {:.1} s", c.name, r.wall.as_secs_f64());
            r
        })
        .collect();
    let ideal = &results[0];
    println!();
    println!(
        "| configuration | calls | prompt tokens | cached | hit share | vs ideal | billed | vs ideal | Σ telemetry = Σ billed | affinity hit / miss / moved | sessions on > 1 source | wall s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|");
    for r in &results {
        println!(
            "| {} | {} | {} | {} | {:.1} % | {:.1} % | {:.6} | {:.3}× | {} ({:.9}) | {} / {} / {} | {} | {:.1} |",
            r.name,
            r.calls,
            r.prompt,
            r.cached,
            100.0 * r.share(),
            100.0 * r.share() / ideal.share(),
            r.billed,
            r.billed / ideal.billed,
            if r.exact { "exact" } else { "DIFFERS" },
            r.telemetry,
            r.affinity[0],
            r.affinity[1],
            r.affinity[2],
            r.moved_sessions,
            r.wall.as_secs_f64(),
        );
    }
    println!();
    for r in results
        .iter()
        .filter(|r| r.name.ends_with(", session") && !r.name.contains("no Redis"))
    {
        let share = r.share() / ideal.share();
        let cost = r.billed / ideal.billed;
        println!(
            "target ({}): hit share {:.1} % of the ideal (≥ 95 %: {}), cost {:.3}× the ideal (≤ 1.1×: {})",
            r.name,
            100.0 * share,
            if share >= 0.95 { "met" } else { "MISSED" },
            cost,
            if cost <= 1.1 { "met" } else { "MISSED" },
        );
    }
    host.shutdown();
}
