//! `cargo bench -p polygw-cli --bench serve` (`cargo xtask bench serve`): what the
//! `polygw serve` proxy (the release binary, a separate process: memory governance,
//! telemetry to SQLite) adds to calling the loopback mock upstream directly — plain and
//! streamed, with 1, 16 and 64 concurrent callers: added µs at p50/p99, added time to first
//! token, calls/s, and the proxy's own CPU per call. Baseline and proxy calls are
//! interleaved round by round in the same run. Method and results: docs/BENCHMARKS.md,
//! "Proxy overhead".

#![allow(
    clippy::disallowed_methods,
    reason = "a benchmark measures real elapsed time"
)]

#[path = "../../polygw/benches/support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use polygw_mock_upstream::{Behavior, MockConfig};
use support::{
    cpu_time, drive, env_count, full_run, idle_cpu, loadavg, plain_answer, profile_drive,
    streamed_answer, Acc, Direct, MockHost,
};

const CHUNKS: usize = 20;
const MODEL: &str = "mock-model";
const UPSTREAM_KEY: &str = "sk-upstream";
const PROXY_KEY: &str = "sk-proxy-bench";

/// `polygw serve` as a child process; killed on drop.
struct Serve {
    child: Child,
    base: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// The child is killed and waited for by `Serve`'s drop.
#[allow(clippy::zombie_processes)]
fn serve(env: &[(String, String)]) -> Serve {
    // `POLYGW_BENCH_SERVE_WRAPPER`: a command the proxy runs under (a profiler, e.g.
    // `valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.serve`).
    let wrapper = std::env::var("POLYGW_BENCH_SERVE_WRAPPER").unwrap_or_default();
    let mut words = wrapper.split_whitespace();
    let mut cmd = match words.next() {
        Some(program) => {
            let mut c = Command::new(program);
            c.args(words).arg(env!("CARGO_BIN_EXE_polygw"));
            c
        }
        None => Command::new(env!("CARGO_BIN_EXE_polygw")),
    };
    let mut child = cmd
        // 64 callers share one client address: lift the per-client connection cap
        // (64 by default) above what the pool may open while connections turn over.
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--grace-s",
            "1",
            "--max-connections-per-client",
            "1024",
        ])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        // The proxy's worker threads, when the run sets them.
        .envs(std::env::var("TOKIO_WORKER_THREADS").map(|n| ("TOKIO_WORKER_THREADS", n)))
        .envs(env.iter().cloned())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn polygw serve");
    let (tx, rx) = mpsc::channel();
    for pipe in [
        Box::new(child.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().expect("stderr")),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                // Anything the proxy says after startup (warnings) is shown.
                if tx.send(line.clone()).is_err() {
                    eprintln!("polygw serve: {line}");
                }
            }
        });
    }
    let mut seen = Vec::new();
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("polygw serve did not start: {seen:?}"));
        if let Some(rest) = line.split("on http://").nth(1) {
            let addr = rest.split('/').next().expect("address").to_string();
            return Serve {
                child,
                base: format!("http://{addr}"),
            };
        }
        seen.push(line);
    }
}

fn scope_env(scope: &str, url: &str, db: &str) -> Vec<(String, String)> {
    let p = format!("{scope}__MOCK__0");
    vec![
        (format!("{p}__BASE_URL"), url.to_string()),
        (format!("{p}__API_KEY"), UPSTREAM_KEY.to_string()),
        (format!("{p}__MODEL"), MODEL.to_string()),
        (format!("{p}__RPM"), "100000000".into()),
        (format!("{p}__TPM"), "100000000000".into()),
        (format!("{p}__MAX_CONCURRENCY"), "100000".into()),
        (format!("{p}__EST_TOKENS"), "1000".into()),
        (format!("{scope}__LIMITS__RPM"), "100000000".into()),
        (format!("{scope}__LIMITS__TPM"), "100000000000".into()),
        (format!("{scope}__TELEMETRY__URL"), db.to_string()),
    ]
}

/// (name, streamed, through the proxy)
const VARIANTS: &[(&str, bool, bool)] = &[
    ("direct to upstream, plain", false, false),
    ("direct to upstream, streamed", true, false),
    ("through polygw serve, plain", false, true),
    ("through polygw serve, streamed", true, true),
];

/// Runs every variant `rounds` times (`per_round` calls each, order rotated per round);
/// round 0 is a warm-up. Returns the per-variant figures and the proxy's CPU per variant.
async fn level(
    callers: &[Direct; 4],
    proxy_pid: u32,
    concurrency: usize,
    rounds: usize,
    per_round: usize,
) -> (Vec<Acc>, Vec<Duration>) {
    let mut accs: Vec<Acc> = VARIANTS.iter().map(|_| Acc::default()).collect();
    let mut proxy_cpu = vec![Duration::ZERO; VARIANTS.len()];
    for round in 0..=rounds {
        for k in 0..VARIANTS.len() {
            let vi = (k + round) % VARIANTS.len();
            let streamed = VARIANTS[vi].1;
            let d = callers[vi].clone();
            let (cpu0, pcpu0) = (cpu_time(None), cpu_time(Some(proxy_pid)));
            let (samples, failures, wall) =
                drive(per_round, concurrency, move |i| ask(d.clone(), i, streamed)).await;
            let (cpu1, pcpu1) = (cpu_time(None), cpu_time(Some(proxy_pid)));
            if round > 0 {
                accs[vi].add(samples, failures, wall);
                if let (Some(a), Some(b)) = (cpu0, cpu1) {
                    accs[vi].cpu += b.saturating_sub(a);
                }
                if let (Some(a), Some(b)) = (pcpu0, pcpu1) {
                    proxy_cpu[vi] += b.saturating_sub(a);
                }
            } else {
                accs[vi].failures.extend(failures);
            }
        }
    }
    for a in &mut accs {
        a.finish();
    }
    (accs, proxy_cpu)
}

fn report(concurrency: usize, accs: &[Acc], proxy_cpu: &[Duration], idle_us_per_s: f64) -> bool {
    println!(
        "\n{concurrency} concurrent caller(s): latency (µs); cpu/call = this process (callers + mock), \
         proxy cpu = the polygw serve process's CPU per call (µs), its idle use ({idle_us_per_s:.0} µs/s) taken out"
    );
    println!(
        "  {:<31} {:>6} {:>4} {:>7} {:>7} {:>8} {:>8} {:>8} {:>8} {:>9} | {:>7} {:>7} {:>7} {:>6}",
        "variant",
        "calls",
        "fail",
        "p50",
        "p99",
        "ttft p50",
        "ttft p99",
        "calls/s",
        "cpu/call",
        "proxy cpu",
        "+p50",
        "+p99",
        "+ttft50",
        "tput"
    );
    let mut ok = true;
    for (vi, ((name, streamed, proxied), a)) in VARIANTS.iter().zip(accs).enumerate() {
        let b = &accs[usize::from(*streamed)];
        let t = |x: Option<f64>| x.map_or("-".to_string(), |t| format!("{t:.0}"));
        let d = |x: f64, y: f64| {
            if *proxied {
                format!("{:+.0}", x - y)
            } else {
                "-".into()
            }
        };
        let dt = match (a.ttft_p(0.5), b.ttft_p(0.5)) {
            (Some(x), Some(y)) if *proxied => format!("{:+.0}", x - y),
            _ => "-".into(),
        };
        println!(
            "  {:<31} {:>6} {:>4} {:>7.0} {:>7.0} {:>8} {:>8} {:>8.0} {:>8.1} {:>9} | {:>7} {:>7} {:>7} {:>5.2}×",
            name,
            a.calls,
            a.failures.len(),
            a.p(0.5),
            a.p(0.99),
            t(a.ttft_p(0.5)),
            t(a.ttft_p(0.99)),
            a.per_s(),
            a.cpu_per_call_us(),
            if *proxied {
                let busy = support::us(proxy_cpu[vi]) - idle_us_per_s * a.wall.as_secs_f64();
                format!("{:.1}", busy / a.calls.max(1) as f64)
            } else {
                "-".into()
            },
            d(a.p(0.5), b.p(0.5)),
            d(a.p(0.99), b.p(0.99)),
            dt,
            a.per_s() / b.per_s(),
        );
        for f in a.failures.iter().take(3) {
            println!("      failure: {f}");
            ok = false;
        }
    }
    for (name, a) in VARIANTS.iter().map(|v| v.0).zip(accs) {
        if let (Some(s50), Some(s99), Some(t50), Some(t99)) =
            (a.span_p(0.5), a.span_p(0.99), a.tail_p(0.5), a.tail_p(0.99))
        {
            println!(
                "  {name:<31} first → last content chunk p50 {s50:.0} µs, p99 {s99:.0} µs (upstream: 1 ms pause); \
                 last chunk → end p50 {t50:.0} µs, p99 {t99:.0} µs; {} of {} streams arrived in fewer chunks",
                a.coalesced,
                a.calls
            );
        }
    }
    ok
}

/// `POLYGW_BENCH_PROFILE=<variant name part>` (with `POLYGW_BENCH_CALLERS`, default 16,
/// and `POLYGW_BENCH_CALLS`, default 20 000): only that variant, for a profiler on the
/// proxy (`perf record -p`, or `POLYGW_BENCH_SERVE_WRAPPER`); prints calls/s and the
/// proxy's CPU per call, no baseline.
async fn profile_one(callers: &[Direct; 4], pid: u32, name: &str) -> bool {
    let Some(vi) = VARIANTS.iter().position(|v| v.0.contains(name)) else {
        eprintln!("no variant named like {name:?}");
        return false;
    };
    let (calls, concurrency) = (
        env_count("POLYGW_BENCH_CALLS", 20_000),
        env_count("POLYGW_BENCH_CALLERS", 16),
    );
    println!(
        "profiling {:?}: {calls} calls, {concurrency} callers (proxy pid {pid})",
        VARIANTS[vi].0
    );
    let (d, streamed) = (callers[vi].clone(), VARIANTS[vi].1);
    profile_drive(calls, concurrency, Some(pid), move |i| {
        ask(d.clone(), i, streamed)
    })
    .await
}

/// One call of the benchmark's question `i`.
async fn ask(d: Direct, i: usize, streamed: bool) -> Result<support::Sample, String> {
    d.call(
        &format!("Question {i}: tell me something."),
        streamed,
        CHUNKS,
    )
    .await
}

fn main() {
    let full = full_run();
    let mock = |b: Behavior| MockConfig {
        record_bodies: false,
        log_capacity: 1000,
        require_key: Some(UPSTREAM_KEY.into()),
        default: Some(b),
        ..MockConfig::default()
    };
    let host = MockHost::start(vec![
        mock(plain_answer(CHUNKS)),
        mock(streamed_answer(CHUNKS)),
    ]);
    let urls = host.urls();
    let dir = tempfile::tempdir().expect("temp dir");
    let db = format!("sqlite://{}", dir.path().join("serve.db").display());
    let mut env = scope_env("PLAIN", &urls[0], &db);
    env.extend(scope_env("STREAM", &urls[1], &db));
    env.push(("POLYGW_PROXY_KEYS".into(), PROXY_KEY.into()));
    let proxy = serve(&env);
    let proxy_url = format!("{}/v1", proxy.base);
    let callers = [
        Direct::new(&urls[0], MODEL, UPSTREAM_KEY),
        Direct::new(&urls[1], MODEL, UPSTREAM_KEY),
        Direct::new(&proxy_url, "plain", PROXY_KEY),
        Direct::new(&proxy_url, "stream", PROXY_KEY),
    ];
    let pid = proxy.child.id();
    let idle = idle_cpu(pid, Duration::from_secs(if full { 5 } else { 1 })).unwrap_or(0.0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if let Ok(name) = std::env::var("POLYGW_BENCH_PROFILE") {
        let ok = rt.block_on(profile_one(&callers, pid, &name));
        // A polite stop, so that a profiler wrapping the proxy writes its output.
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let mut proxy = proxy;
        let _ = proxy.child.wait();
        drop(rt);
        host.shutdown();
        std::process::exit(i32::from(!ok));
    }
    let (rounds, c1, c64) = if full { (5, 400, 2000) } else { (1, 20, 64) };
    println!(
        "proxy overhead: polygw serve (release binary, memory governance, telemetry to SQLite) vs the mock upstream \
         directly; {CHUNKS} chunks (streams pause 1 ms after the first); {rounds} rounds (+1 warm-up), {c1} calls per variant per round \
         with 1 caller, {c64} with 16 and with 64; load average {}",
        loadavg()
    );
    let ok = rt.block_on(async {
        let (one, p1) = level(&callers, pid, 1, rounds, c1).await;
        let mut ok = report(1, &one, &p1, idle);
        // 16 callers: issue 17's target level for plain calls (≥ 0.5× direct).
        let (some, p16) = level(&callers, pid, 16, rounds, c64).await;
        ok &= report(16, &some, &p16, idle);
        let (many, p64) = level(&callers, pid, 64, rounds, c64).await;
        ok &= report(64, &many, &p64, idle);
        ok
    });
    println!("\nload average {}", loadavg());
    drop(rt);
    drop(proxy);
    host.shutdown();
    if !ok {
        eprintln!("serve benchmark: some calls failed (see above)");
        std::process::exit(1);
    }
}
