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

#[path = "serve_counts/mod.rs"]
mod counts;

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
fn serve(bin: &str, env: &[(String, String)], wrapper: &str) -> Serve {
    // `POLYGW_BENCH_SERVE_WRAPPER`: a command the proxy runs under (a profiler, e.g.
    // `valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.serve`).
    let mut words = wrapper.split_whitespace();
    let mut cmd = match words.next() {
        Some(program) => {
            let mut c = Command::new(program);
            c.args(words).arg(bin);
            c
        }
        None => Command::new(bin),
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
            .recv_timeout(Duration::from_secs(if wrapper.is_empty() {
                30
            } else {
                300
            }))
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

/// One way of calling: directly or through one of the proxies, plain or streamed.
struct Variant {
    name: String,
    streamed: bool,
    /// Index into the run's proxies; `None` = the upstream directly.
    proxy: Option<usize>,
    caller: Direct,
}

/// A proxy under test: the binary built from this tree, or the baseline binary
/// (`POLYGW_BENCH_SERVE_BASELINE`), run side by side with the same configuration.
struct Proxy {
    label: String,
    bin: String,
    serve: Serve,
    idle_us_per_s: f64,
}

impl Proxy {
    fn pid(&self) -> u32 {
        self.serve.child.id()
    }
}

/// Runs every variant `rounds` times (`per_round` calls each, order rotated per round);
/// round 0 is a warm-up. Returns the per-variant figures and the proxy's CPU per variant.
async fn level(
    variants: &[Variant],
    proxies: &[Proxy],
    concurrency: usize,
    rounds: usize,
    per_round: usize,
) -> (Vec<Acc>, Vec<Duration>) {
    let mut accs: Vec<Acc> = variants.iter().map(|_| Acc::default()).collect();
    let mut proxy_cpu = vec![Duration::ZERO; variants.len()];
    for round in 0..=rounds {
        for k in 0..variants.len() {
            let vi = (k + round) % variants.len();
            let v = &variants[vi];
            let streamed = v.streamed;
            let d = v.caller.clone();
            let pid = v.proxy.map(|p| proxies[p].pid());
            let (cpu0, pcpu0) = (cpu_time(None), pid.and_then(|p| cpu_time(Some(p))));
            let (samples, failures, wall) =
                drive(per_round, concurrency, move |i| ask(d.clone(), i, streamed)).await;
            let (cpu1, pcpu1) = (cpu_time(None), pid.and_then(|p| cpu_time(Some(p))));
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

/// The proxy's own CPU per call of a variant (µs), its idle use taken out.
fn proxy_cpu_us(v: &Variant, a: &Acc, cpu: Duration, proxies: &[Proxy]) -> Option<f64> {
    let p = &proxies[v.proxy?];
    let busy = support::us(cpu) - p.idle_us_per_s * a.wall.as_secs_f64();
    Some(busy / a.calls.max(1) as f64)
}

fn report(
    concurrency: usize,
    variants: &[Variant],
    accs: &[Acc],
    proxy_cpu: &[Duration],
    proxies: &[Proxy],
) -> bool {
    println!(
        "\n{concurrency} concurrent caller(s): latency (µs); cpu/call = this process (callers + mock), \
         proxy cpu = the proxy process's CPU per call (µs), its idle use taken out"
    );
    println!(
        "  {:<40} {:>6} {:>4} {:>7} {:>7} {:>8} {:>8} {:>8} {:>8} {:>9} | {:>7} {:>7} {:>7} {:>6}",
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
    for (vi, (v, a)) in variants.iter().zip(accs).enumerate() {
        // Variants 0 and 1 are the direct calls, plain and streamed.
        let b = &accs[usize::from(v.streamed)];
        let proxied = v.proxy.is_some();
        let t = |x: Option<f64>| x.map_or("-".to_string(), |t| format!("{t:.0}"));
        let d = |x: f64, y: f64| {
            if proxied {
                format!("{:+.0}", x - y)
            } else {
                "-".into()
            }
        };
        let dt = match (a.ttft_p(0.5), b.ttft_p(0.5)) {
            (Some(x), Some(y)) if proxied => format!("{:+.0}", x - y),
            _ => "-".into(),
        };
        println!(
            "  {:<40} {:>6} {:>4} {:>7.0} {:>7.0} {:>8} {:>8} {:>8.0} {:>8.1} {:>9} | {:>7} {:>7} {:>7} {:>5.2}×",
            v.name,
            a.calls,
            a.failures.len(),
            a.p(0.5),
            a.p(0.99),
            t(a.ttft_p(0.5)),
            t(a.ttft_p(0.99)),
            a.per_s(),
            a.cpu_per_call_us(),
            proxy_cpu_us(v, a, proxy_cpu[vi], proxies).map_or("-".into(), |c| format!("{c:.1}")),
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
    for (v, a) in variants.iter().zip(accs) {
        if let (Some(s50), Some(s99), Some(t50), Some(t99)) =
            (a.span_p(0.5), a.span_p(0.99), a.tail_p(0.5), a.tail_p(0.99))
        {
            println!(
                "  {:<40} first → last content chunk p50 {s50:.0} µs, p99 {s99:.0} µs (upstream: 1 ms pause); \
                 last chunk → end p50 {t50:.0} µs, p99 {t99:.0} µs; {} of {} streams arrived in fewer chunks",
                v.name,
                a.coalesced,
                a.calls
            );
        }
    }
    if proxies.len() > 1 {
        // This tree's proxy against the baseline binary, per kind of call.
        for streamed in [false, true] {
            let of = |p: usize| {
                let vi = variants
                    .iter()
                    .position(|v| v.proxy == Some(p) && v.streamed == streamed)?;
                let cpu = proxy_cpu_us(&variants[vi], &accs[vi], proxy_cpu[vi], proxies)?;
                Some((cpu, accs[vi].per_s()))
            };
            if let (Some((c0, r0)), Some((c1, r1))) = (of(0), of(1)) {
                println!(
                    "  {} ÷ {}, {}: proxy CPU per call {:.2}×, calls/s {:.2}×",
                    proxies[0].label,
                    proxies[1].label,
                    if streamed { "streamed" } else { "plain" },
                    c0 / c1,
                    r0 / r1
                );
            }
        }
    }
    ok
}

/// `POLYGW_BENCH_PROFILE=<variant name part>` (with `POLYGW_BENCH_CALLERS`, default 16,
/// and `POLYGW_BENCH_CALLS`, default 20 000): only that variant, for a profiler on the
/// proxy (`perf record -p`, or `POLYGW_BENCH_SERVE_WRAPPER`); prints calls/s and the
/// proxy's CPU per call, no baseline.
async fn profile_one(variants: &[Variant], proxies: &[Proxy], name: &str) -> bool {
    let Some(v) = variants.iter().find(|v| v.name.contains(name)) else {
        eprintln!("no variant named like {name:?}");
        return false;
    };
    let (calls, concurrency) = (
        env_count("POLYGW_BENCH_CALLS", 20_000),
        env_count("POLYGW_BENCH_CALLERS", 16),
    );
    let pid = v.proxy.map(|p| proxies[p].pid());
    println!(
        "profiling {:?}: {calls} calls, {concurrency} callers (proxy pid {pid:?})",
        v.name
    );
    let (d, streamed) = (v.caller.clone(), v.streamed);
    profile_drive(calls, concurrency, pid, move |i| {
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

/// Calls of one variant, all of which must succeed.
async fn run_calls(v: &Variant, calls: usize, concurrency: usize) -> Duration {
    let (d, streamed) = (v.caller.clone(), v.streamed);
    let (_, failures, wall) = drive(calls, concurrency, move |i| ask(d.clone(), i, streamed)).await;
    assert!(
        failures.is_empty(),
        "{}: {} calls failed, e.g. {}",
        v.name,
        failures.len(),
        failures[0]
    );
    wall
}

/// SPEC §27.2's hard gates on a plain proxied call of this tree's binary (issue 42):
/// the bench exits non-zero above them.
const GATE_INSTRUCTIONS: f64 = 140_000.0;
const GATE_ALLOCATIONS: f64 = 110.0;
const GATE_SYSCALLS: f64 = 6.0;

/// The gates a plain call of this tree's proxy (`label`) is over, as messages.
fn gates(label: &str, counts: &[(&str, f64, f64)]) -> Vec<String> {
    if label != "polygw serve" {
        return Vec::new();
    }
    counts
        .iter()
        .filter(|(_, value, gate)| value > gate)
        .map(|(what, value, gate)| format!("{what} per plain call {value:.1} > {gate}"))
        .collect()
}

/// System calls, context switches and allocations per call of every proxied variant
/// (16 callers; see `serve_counts`). Returns the gates this tree's plain call is over.
async fn count_per_call(
    variants: &[Variant],
    proxies: &[Proxy],
    dir: &std::path::Path,
) -> Vec<String> {
    let mut over = Vec::new();
    if let Some(why) = counts::unavailable() {
        println!("\nper-call counts skipped: {why}");
        return over;
    }
    let plain = env_count("POLYGW_BENCH_COUNT_CALLS", 5_000);
    println!(
        "\nper call, counted in the proxy process by perf stat (syscalls: raw_syscalls:sys_enter; \
         allocations: uprobes on glibc's malloc, calloc, realloc, posix_memalign and on the binary's mimalloc when linked), 16 callers, \
         {plain} plain calls / {} streams, idle rate taken out",
        plain / 5
    );
    println!(
        "  {:<40} {:>9} {:>9} {:>12}",
        "variant", "syscalls", "switches", "allocations"
    );
    for (p, proxy) in proxies.iter().enumerate() {
        let pid = proxy.pid();
        let own = counts::own_allocator_events(&proxy.bin);
        let idle = tokio::task::block_in_place(|| {
            counts::idle_rates(pid, &own, dir, Duration::from_secs(2))
        });
        for v in variants.iter().filter(|v| v.proxy == Some(p)) {
            let calls = if v.streamed { plain / 5 } else { plain };
            // Warm: connections open, the telemetry writer's threads started.
            run_calls(v, 500, 16).await;
            let (mut c, mut wall) = ([0.0; 3], [Duration::ZERO; 3]);
            for allocations in [None, Some(own.as_slice())] {
                let stat = counts::Stat::start(pid, allocations, dir, "calls");
                run_calls(v, calls, 16).await;
                let (n, w) = stat.stop();
                // Syscalls and switches come from the first phase, allocations from
                // the second.
                let counted: &[usize] = if allocations.is_none() { &[0, 1] } else { &[2] };
                for &i in counted {
                    c[i] = n[i];
                    wall[i] = w;
                }
            }
            let pc = counts::per_call(c, wall, idle, calls);
            println!(
                "  {:<40} {:>9.2} {:>9.2} {:>12.1}",
                v.name, pc.syscalls, pc.switches, pc.allocations
            );
            if !v.streamed {
                over.extend(gates(
                    &proxy.label,
                    &[
                        ("system calls", pc.syscalls, GATE_SYSCALLS),
                        ("allocations", pc.allocations, GATE_ALLOCATIONS),
                    ],
                ));
            }
        }
        counts::remove_events(&own);
    }
    over
}

/// The resident set of process `pid` (kB, `/proc/PID/status`).
fn rss_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// RSS of a fresh proxy of each binary after 10 000 plain calls and after
/// `POLYGW_BENCH_RSS_CALLS` (default 400 000), 16 callers, telemetry to SQLite: a proxy
/// that keeps something per call grows with the number of calls (issue 27's bound:
/// ≤ 1.5×).
async fn rss_growth(bins: &[(String, String)], env: &dyn Fn(usize) -> Vec<(String, String)>) {
    let total = env_count("POLYGW_BENCH_RSS_CALLS", 400_000).max(20_000);
    println!(
        "
RSS of a fresh proxy (16 callers, plain, telemetry to SQLite)"
    );
    for (k, (label, bin)) in bins.iter().enumerate() {
        let serve = tokio::task::block_in_place(|| serve(bin, &env(20 + k), ""));
        let pid = serve.child.id();
        let v = Variant {
            name: label.clone(),
            streamed: false,
            proxy: Some(0),
            caller: Direct::new(&format!("{}/v1", serve.base), "plain", PROXY_KEY),
        };
        run_calls(&v, 10_000, 16).await;
        let early = rss_kb(pid);
        run_calls(&v, total - 10_000, 16).await;
        let late = rss_kb(pid);
        if let (Some(a), Some(b)) = (early, late) {
            println!(
                "  {label:<40} after 10 000 calls {:>7} kB, after {total} {:>7} kB: {:.2}×",
                a,
                b,
                b as f64 / a as f64
            );
        }
        drop(serve);
    }
}

/// Instructions per call of each proxy binary under callgrind (1 caller, after a
/// warm-up; `-- --instructions` or `POLYGW_BENCH_SERVE_CALLGRIND=1`).
async fn count_instructions(
    bins: &[(String, String)],
    env: &[(String, String)],
    dir: &std::path::Path,
) -> Vec<String> {
    let mut over = Vec::new();
    if let Some(why) = counts::callgrind_unavailable() {
        println!("\ninstructions per call skipped: {why}");
        return over;
    }
    let calls = env_count("POLYGW_BENCH_CALLGRIND_CALLS", 2_000);
    println!(
        "\ninstructions per call (callgrind on the proxy process, 1 caller, {calls} plain calls / {} streams after 200 warm-up calls)",
        calls / 2
    );
    for (k, (label, bin)) in bins.iter().enumerate() {
        let prefix = format!("cg-{k}");
        let out = dir.join(&prefix);
        let wrapper = format!(
            "valgrind --tool=callgrind --callgrind-out-file={}",
            out.display()
        );
        let serve = tokio::task::block_in_place(|| serve(bin, env, &wrapper));
        let pid = serve.child.id();
        let proxy_url = format!("{}/v1", serve.base);
        for (model, streamed) in [("plain", false), ("stream", true)] {
            let v = Variant {
                name: format!("{label}, {model}"),
                streamed,
                proxy: Some(0),
                caller: Direct::new(&proxy_url, model, PROXY_KEY),
            };
            let n = if streamed { calls / 2 } else { calls };
            run_calls(&v, 200, 1).await;
            counts::callgrind(pid, true, dir, &prefix);
            run_calls(&v, n, 1).await;
            // Work the proxy does after the calls (an export thread's batches) counts.
            tokio::time::sleep(Duration::from_secs(2)).await;
            match counts::callgrind(pid, false, dir, &prefix) {
                Some(ir) => {
                    let per_call = ir as f64 / n as f64;
                    println!("  {:<40} {per_call:>10.0} instructions per call", v.name);
                    if !streamed {
                        over.extend(gates(
                            label,
                            &[("instructions", per_call, GATE_INSTRUCTIONS)],
                        ));
                    }
                }
                None => println!("  {:<40} callgrind gave no dump", v.name),
            }
        }
        drop(serve);
    }
    over
}

/// Ends the run: non-zero when a gate of SPEC §27.2 was exceeded.
fn exit_on_gates(over: &[String]) {
    if !over.is_empty() {
        eprintln!(
            "serve benchmark: over SPEC §27.2's gates (issue 42): {}",
            over.join("; ")
        );
        std::process::exit(2);
    }
}

/// A proxy of binary `bin` with `env`, its idle CPU measured.
fn start_proxy(
    label: &str,
    bin: &str,
    env: &[(String, String)],
    wrapper: &str,
    full: bool,
) -> Proxy {
    let serve = serve(bin, env, wrapper);
    let pid = serve.child.id();
    let idle = idle_cpu(pid, Duration::from_secs(if full { 5 } else { 1 })).unwrap_or(0.0);
    Proxy {
        label: label.to_string(),
        bin: bin.to_string(),
        serve,
        idle_us_per_s: idle,
    }
}

/// The upstream directly (plain, streamed), then each proxy plain and streamed, named
/// `{prefix}{label}, plain|streamed`.
fn variants_of(urls: &[String], proxies: &[Proxy], prefix: &str) -> Vec<Variant> {
    let mut variants = vec![
        Variant {
            name: "direct to upstream, plain".into(),
            streamed: false,
            proxy: None,
            caller: Direct::new(&urls[0], MODEL, UPSTREAM_KEY),
        },
        Variant {
            name: "direct to upstream, streamed".into(),
            streamed: true,
            proxy: None,
            caller: Direct::new(&urls[1], MODEL, UPSTREAM_KEY),
        },
    ];
    for (p, proxy) in proxies.iter().enumerate() {
        let url = format!("{}/v1", proxy.serve.base);
        for (model, streamed, kind) in [("plain", false, "plain"), ("stream", true, "streamed")] {
            variants.push(Variant {
                name: format!("{prefix}{}, {kind}", proxy.label),
                streamed,
                proxy: Some(p),
                caller: Direct::new(&url, model, PROXY_KEY),
            });
        }
    }
    variants
}

/// A minimal OTLP/HTTP receiver for the OpenTelemetry comparison: it reads each request
/// whole and answers 200 after `delay` (keep-alive). Its address.
fn otlp_sink(delay: Duration) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the OTLP sink");
    let addr = listener.local_addr().expect("address");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 16 * 1024];
                loop {
                    // Headers, then the body its content-length announces.
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match conn.read(&mut chunk) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buf.len() < head_end + len {
                        match conn.read(&mut chunk) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..head_end + len);
                    std::thread::sleep(delay);
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                    if conn.write_all(ok).is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

/// `polygw_otel_dropped_total` of a proxy (`-` when it exports nothing).
async fn otel_dropped(base: &str) -> String {
    let text = match reqwest::get(format!("{base}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    text.lines()
        .find_map(|l| l.strip_prefix("polygw_otel_dropped_total "))
        .map_or_else(|| "-".to_string(), |v| v.trim().to_string())
}

/// `-- --otel` (`cargo xtask bench serve-otel`): the proxy's CPU per call with
/// OpenTelemetry export off, on (a receiver that answers at once), on with 10% of traces
/// sampled, and on with a receiver that is down or slow — five proxies of this tree's binary side by side,
/// rounds interleaved; the ratios to export off, and what each dropped (SPEC §26.1,
/// target ≤ 1.10×).
fn compare_otel(
    bin: &str,
    env_for: &dyn Fn(usize) -> Vec<(String, String)>,
    host: MockHost,
    full: bool,
) {
    let fast = otlp_sink(Duration::ZERO);
    let slow = otlp_sink(Duration::from_secs(2));
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", l.local_addr().expect("address"))
    };
    let otel = |endpoint: &str, extra: &[(&str, &str)]| {
        let mut v = vec![
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT".to_string(),
                endpoint.to_string(),
            ),
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "1000".into()),
            ("OTEL_METRIC_EXPORT_INTERVAL".into(), "5000".into()),
        ];
        v.extend(extra.iter().map(|(k, x)| (k.to_string(), x.to_string())));
        v
    };
    let configs: Vec<(&str, Vec<(String, String)>)> = vec![
        ("export off", Vec::new()),
        ("export on", otel(&fast, &[])),
        (
            "export on, 10% of traces",
            otel(
                &fast,
                &[
                    ("OTEL_TRACES_SAMPLER", "traceidratio"),
                    ("OTEL_TRACES_SAMPLER_ARG", "0.1"),
                ],
            ),
        ),
        (
            "receiver down",
            otel(&down, &[("OTEL_EXPORTER_OTLP_TIMEOUT", "500")]),
        ),
        (
            "receiver slow (2 s)",
            otel(&slow, &[("OTEL_EXPORTER_OTLP_TIMEOUT", "500")]),
        ),
    ];
    // `-- --otel --instructions`: instructions per call under callgrind, export off and
    // on (the export thread's work counts: each dump waits for its batches to go).
    if std::env::args().any(|a| a == "--instructions") {
        let rt = support::runtime();
        let dir = tempfile::tempdir().expect("temp dir");
        for (k, (label, extra)) in configs.iter().take(3).enumerate() {
            let mut env = env_for(40 + k);
            env.extend(extra.iter().cloned());
            let bins = [(label.to_string(), bin.to_string())];
            rt.block_on(count_instructions(&bins, &env, dir.path()));
        }
        drop(rt);
        host.shutdown();
        return;
    }
    let proxies: Vec<Proxy> = configs
        .iter()
        .enumerate()
        .map(|(k, (label, extra))| {
            let mut env = env_for(30 + k);
            env.extend(extra.iter().cloned());
            start_proxy(label, bin, &env, "", full)
        })
        .collect();
    let variants = variants_of(&host.urls(), &proxies, "");
    let (rounds, per_round) = if full { (5, 2000) } else { (1, 200) };
    println!(
        "OpenTelemetry export: the proxy's CPU per call, export off / on / 10% of traces / receiver down / receiver slow; \
         {rounds} rounds (+1 warm-up), {per_round} calls per variant per round, 16 callers; load average {}",
        loadavg()
    );
    let rt = support::runtime();
    let ok = rt.block_on(async {
        let (accs, cpu) = level(&variants, &proxies, 16, rounds, per_round).await;
        let ok = report(16, &variants, &accs, &cpu, &proxies);
        let us = |i: usize| proxy_cpu_us(&variants[i], &accs[i], cpu[i], &proxies);
        println!("\n  proxy CPU per call against export off (same run):");
        for (p, proxy) in proxies.iter().enumerate().skip(1) {
            let ratio = |kind: usize| match (us(2 + kind), us(2 + 2 * p + kind)) {
                (Some(off), Some(on)) if off > 0.0 => format!("{:.3}×", on / off),
                _ => "n/a".to_string(),
            };
            println!(
                "  {:<24} plain {:>8}  streamed {:>8}  dropped {}",
                proxy.label,
                ratio(0),
                ratio(1),
                otel_dropped(&proxy.serve.base).await
            );
        }
        ok
    });
    println!("\nload average {}", loadavg());
    drop(rt);
    drop(proxies);
    host.shutdown();
    if !ok {
        eprintln!("serve benchmark (OpenTelemetry): some calls failed (see above)");
        std::process::exit(1);
    }
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
    let wrapper = std::env::var("POLYGW_BENCH_SERVE_WRAPPER").unwrap_or_default();
    // `POLYGW_BENCH_SERVE_BASELINE`: an earlier `polygw` binary, run beside this tree's.
    let mut bins = vec![(
        "polygw serve".to_string(),
        env!("CARGO_BIN_EXE_polygw").to_string(),
    )];
    if let Ok(b) = std::env::var("POLYGW_BENCH_SERVE_BASELINE") {
        if !b.is_empty() {
            bins.push(("baseline".to_string(), b));
        }
    }
    let env_for = |k: usize| {
        let db = format!(
            "sqlite://{}",
            dir.path().join(format!("serve-{k}.db")).display()
        );
        let mut env = scope_env("PLAIN", &urls[0], &db);
        env.extend(scope_env("STREAM", &urls[1], &db));
        env.push(("POLYGW_PROXY_KEYS".into(), PROXY_KEY.into()));
        env
    };
    if std::env::args().any(|a| a == "--otel") {
        compare_otel(&bins[0].1, &env_for, host, full);
        return;
    }
    let rt = support::runtime();
    // `-- --instructions` (`cargo xtask bench serve-instructions`) or
    // `POLYGW_BENCH_SERVE_CALLGRIND=1`: only the instruction counts.
    if std::env::args().any(|a| a == "--instructions")
        || std::env::var("POLYGW_BENCH_SERVE_CALLGRIND").is_ok_and(|v| v == "1")
    {
        let over = rt.block_on(count_instructions(&bins, &env_for(9), dir.path()));
        drop(rt);
        host.shutdown();
        exit_on_gates(&over);
        return;
    }
    let proxies: Vec<Proxy> = bins
        .iter()
        .enumerate()
        .map(|(k, (label, bin))| start_proxy(label, bin, &env_for(k), &wrapper, full))
        .collect();
    let variants = variants_of(&urls, &proxies, "through ");
    if let Ok(name) = std::env::var("POLYGW_BENCH_PROFILE") {
        let ok = rt.block_on(profile_one(&variants, &proxies, &name));
        // A polite stop, so that a profiler wrapping the proxy writes its output.
        for p in &proxies {
            let _ = Command::new("kill")
                .args(["-TERM", &p.pid().to_string()])
                .status();
        }
        for mut p in proxies {
            let _ = p.serve.child.wait();
        }
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
    for p in &proxies {
        println!(
            "  {}: {} (idle {:.0} µs/s)",
            p.label, p.bin, p.idle_us_per_s
        );
    }
    // `POLYGW_BENCH_SERVE_RSS_ONLY=1`: only the RSS growth.
    if std::env::var("POLYGW_BENCH_SERVE_RSS_ONLY").is_ok_and(|v| v == "1") {
        rt.block_on(rss_growth(&bins, &env_for));
        drop(rt);
        drop(proxies);
        host.shutdown();
        return;
    }
    // `POLYGW_BENCH_SERVE_COUNTS_ONLY=1`: only the per-call counts.
    if std::env::var("POLYGW_BENCH_SERVE_COUNTS_ONLY").is_ok_and(|v| v == "1") {
        let over = rt.block_on(count_per_call(&variants, &proxies, dir.path()));
        drop(rt);
        drop(proxies);
        host.shutdown();
        exit_on_gates(&over);
        return;
    }
    let mut over = Vec::new();
    let ok = rt.block_on(async {
        let (one, p1) = level(&variants, &proxies, 1, rounds, c1).await;
        let mut ok = report(1, &variants, &one, &p1, &proxies);
        let (some, p16) = level(&variants, &proxies, 16, rounds, c64).await;
        ok &= report(16, &variants, &some, &p16, &proxies);
        let (many, p64) = level(&variants, &proxies, 64, rounds, c64).await;
        ok &= report(64, &variants, &many, &p64, &proxies);
        if full && ok {
            over = count_per_call(&variants, &proxies, dir.path()).await;
            rss_growth(&bins, &env_for).await;
        }
        ok
    });
    println!("\nload average {}", loadavg());
    drop(rt);
    drop(proxies);
    host.shutdown();
    if !ok {
        eprintln!("serve benchmark: some calls failed (see above)");
        std::process::exit(1);
    }
    exit_on_gates(&over);
}
