//! `cargo bench -p polygw --bench overhead` (`cargo xtask bench overhead`): what a
//! `GatewayClient` call adds to a direct reqwest call to the same loopback mock upstream —
//! plain and streamed, memory governance on, telemetry off and to SQLite — with 1 and
//! with 64 concurrent callers: added µs at p50/p99, added time to first token, calls/s
//! at saturation and CPU per call. The baseline runs in the same process, interleaved
//! round by round with the gateway variants. Method and results: docs/BENCHMARKS.md,
//! "Call overhead" and "Telemetry overhead per call".

#![allow(
    clippy::disallowed_methods,
    reason = "a benchmark measures real elapsed time"
)]

mod support;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use polygw::{ChatRequest, DeltaSink, GatewayClient, StreamDelta};
use polygw_mock_upstream::{Behavior, MockConfig};
use support::{
    cpu_time, drive, env_count, full_run, loadavg, plain_answer, profile_drive, streamed_answer,
    Acc, Direct, MockHost, Sample,
};
use tokio::time::Instant;

/// Content chunks of every answer (one word each; plain answers without delay, streams
/// with one 1 ms pause after the first chunk: the upstream costs little more than its
/// HTTP and JSON, so what is measured is the client side).
const CHUNKS: usize = 20;
const MODEL: &str = "mock-model";
const KEY: &str = "sk-bench";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// reqwest, plain JSON answer.
    DirectPlain,
    /// reqwest, SSE parsed event by event.
    DirectStream,
    /// `chat()`, plain.
    Plain,
    /// `chat()` with `stream = true` (aggregated answer).
    Stream,
    /// `chat_streaming()` with a sink: time to the first incremental chunk delivered.
    Passthrough,
}

#[derive(Clone, Copy, Debug)]
struct Variant {
    name: &'static str,
    kind: Kind,
    telemetry: bool,
    /// Index of its baseline in `VARIANTS`.
    baseline: usize,
}

const VARIANTS: &[Variant] = &[
    Variant {
        name: "direct reqwest, plain",
        kind: Kind::DirectPlain,
        telemetry: false,
        baseline: 0,
    },
    Variant {
        name: "direct reqwest, streamed",
        kind: Kind::DirectStream,
        telemetry: false,
        baseline: 1,
    },
    Variant {
        name: "chat(), plain, telemetry off",
        kind: Kind::Plain,
        telemetry: false,
        baseline: 0,
    },
    Variant {
        name: "chat(), plain, SQLite",
        kind: Kind::Plain,
        telemetry: true,
        baseline: 0,
    },
    Variant {
        name: "chat(), streamed, telemetry off",
        kind: Kind::Stream,
        telemetry: false,
        baseline: 1,
    },
    Variant {
        name: "chat(), streamed, SQLite",
        kind: Kind::Stream,
        telemetry: true,
        baseline: 1,
    },
    Variant {
        name: "chat_streaming(), telemetry off",
        kind: Kind::Passthrough,
        telemetry: false,
        baseline: 1,
    },
    Variant {
        name: "chat_streaming(), SQLite",
        kind: Kind::Passthrough,
        telemetry: true,
        baseline: 1,
    },
];

/// Records when the first incremental chunk reached the caller.
struct FirstToken(OnceLock<Instant>);

impl DeltaSink for FirstToken {
    fn send(&self, delta: StreamDelta) {
        if delta.is_incremental() {
            let _ = self.0.set(Instant::now());
        }
    }
}

fn vars(scope: &str, url: &str, db: Option<&str>) -> Vec<(String, String)> {
    let p = format!("{scope}__MOCK__0");
    let mut v = vec![
        (format!("{p}__BASE_URL"), url.to_string()),
        (format!("{p}__API_KEY"), KEY.to_string()),
        (format!("{p}__MODEL"), MODEL.to_string()),
        // Every limit on (so both windows and the in-flight count are exercised on
        // every call), none ever reached.
        (format!("{p}__RPM"), "100000000".into()),
        (format!("{p}__TPM"), "100000000000".into()),
        (format!("{p}__MAX_CONCURRENCY"), "100000".into()),
        // Explicit: the derived reservation (TPM / 60) admits only ≈ 60 calls in flight.
        (format!("{p}__EST_TOKENS"), "1000".into()),
        (format!("{scope}__LIMITS__RPM"), "100000000".into()),
        (format!("{scope}__LIMITS__TPM"), "100000000000".into()),
    ];
    if let Some(db) = db {
        v.push((format!("{scope}__TELEMETRY__URL"), db.to_string()));
    }
    v
}

/// The callers: plain calls go to one upstream, streamed calls to another (see `main`).
#[derive(Clone)]
struct Callers {
    direct_plain: Direct,
    direct_stream: Direct,
    /// [plain, streamed] × [telemetry off, SQLite].
    clients: [[GatewayClient; 2]; 2],
}

impl Callers {
    fn client(&self, v: Variant) -> &GatewayClient {
        let streamed = matches!(v.kind, Kind::Stream | Kind::Passthrough);
        &self.clients[usize::from(streamed)][usize::from(v.telemetry)]
    }

    async fn call(&self, v: Variant, i: usize) -> Result<Sample, String> {
        let prompt = format!("Question {i}: tell me something.");
        let client = self.client(v);
        match v.kind {
            Kind::DirectPlain => self.direct_plain.call(&prompt, false, CHUNKS).await,
            Kind::DirectStream => self.direct_stream.call(&prompt, true, CHUNKS).await,
            Kind::Plain | Kind::Stream => {
                let stream = v.kind == Kind::Stream;
                let start = Instant::now();
                let r = client
                    .chat(ChatRequest::user(prompt).with_stream(stream))
                    .await
                    .map_err(|e| e.to_string())?;
                let total = start.elapsed();
                check(&r)?;
                Ok(Sample {
                    total,
                    ttft: None,
                    last: None,
                    coalesced: false,
                })
            }
            Kind::Passthrough => {
                let sink = Arc::new(FirstToken(OnceLock::new()));
                let start = Instant::now();
                let r = client
                    .chat_streaming(ChatRequest::user(prompt).with_stream(true), sink.clone())
                    .await
                    .map_err(|e| e.to_string())?;
                let total = start.elapsed();
                check(&r)?;
                let first = sink
                    .0
                    .get()
                    .ok_or("no incremental chunk reached the sink")?;
                Ok(Sample {
                    total,
                    ttft: Some(first.duration_since(start)),
                    last: None,
                    coalesced: false,
                })
            }
        }
    }
}

fn check(r: &polygw::LlmResponse) -> Result<(), String> {
    if r.content.split_whitespace().count() != CHUNKS || r.call_stats.attempts != 1 {
        return Err(format!(
            "unexpected answer: {:?} after {} attempts",
            r.content, r.call_stats.attempts
        ));
    }
    Ok(())
}

/// Runs every variant `rounds` times (`per_round` calls each, order rotated per round so
/// a change of machine load hits every variant alike); the first round is a warm-up.
async fn level(callers: &Callers, concurrency: usize, rounds: usize, per_round: usize) -> Vec<Acc> {
    let mut accs: Vec<Acc> = VARIANTS.iter().map(|_| Acc::default()).collect();
    for round in 0..=rounds {
        for k in 0..VARIANTS.len() {
            let vi = (k + round) % VARIANTS.len();
            let v = VARIANTS[vi];
            let c = callers.clone();
            let cpu0 = cpu_time(None);
            let (samples, failures, wall) = drive(per_round, concurrency, move |i| {
                let c = c.clone();
                async move { c.call(v, i).await }
            })
            .await;
            if v.telemetry {
                // The writer's work for these rows is this variant's cost: flush it
                // inside the CPU window (outside the wall time of the calls).
                callers.client(v).shutdown().await;
            }
            let cpu = match (cpu0, cpu_time(None)) {
                (Some(a), Some(b)) => b.saturating_sub(a),
                _ => Duration::ZERO,
            };
            if round > 0 {
                accs[vi].add(samples, failures, wall);
                accs[vi].cpu += cpu;
            } else if !failures.is_empty() {
                accs[vi].failures.extend(failures);
            }
        }
    }
    for a in &mut accs {
        a.finish();
    }
    accs
}

fn report(concurrency: usize, accs: &[Acc]) -> bool {
    println!(
        "\n{concurrency} concurrent caller(s): latency (µs), calls/s over the variant's wall time, process CPU per call (µs, mock + client)"
    );
    println!(
        "  {:<33} {:>6} {:>4} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8} | {:>7} {:>7} {:>7} {:>7} {:>6}",
        "variant",
        "calls",
        "fail",
        "p50",
        "p99",
        "ttft p50",
        "ttft p99",
        "calls/s",
        "cpu/call",
        "+p50",
        "+p99",
        "+ttft50",
        "+cpu",
        "tput"
    );
    let mut ok = true;
    for (v, a) in VARIANTS.iter().zip(accs) {
        let b = &accs[v.baseline];
        let ttft = |x: Option<f64>| x.map_or("-".to_string(), |t| format!("{t:.0}"));
        let is_base = matches!(v.kind, Kind::DirectPlain | Kind::DirectStream);
        let added = |x: f64, y: f64| {
            if is_base {
                "-".to_string()
            } else {
                format!("{:+.0}", x - y)
            }
        };
        let added_ttft = match (a.ttft_p(0.5), b.ttft_p(0.5)) {
            (Some(x), Some(y)) if !is_base => format!("{:+.0}", x - y),
            _ => "-".into(),
        };
        println!(
            "  {:<33} {:>6} {:>4} {:>8.0} {:>8.0} {:>9} {:>9} {:>8.0} {:>8.1} | {:>7} {:>7} {:>7} {:>7} {:>5.2}×",
            v.name,
            a.calls,
            a.failures.len(),
            a.p(0.5),
            a.p(0.99),
            ttft(a.ttft_p(0.5)),
            ttft(a.ttft_p(0.99)),
            a.per_s(),
            a.cpu_per_call_us(),
            added(a.p(0.5), b.p(0.5)),
            added(a.p(0.99), b.p(0.99)),
            added_ttft,
            added(a.cpu_per_call_us(), b.cpu_per_call_us()),
            a.per_s() / b.per_s(),
        );
        for f in a.failures.iter().take(3) {
            println!("      failure: {f}");
            ok = false;
        }
    }
    ok
}

/// Telemetry on vs off, same run: the difference each pair shows.
fn telemetry_delta(concurrency: usize, accs: &[Acc]) {
    println!("\n{concurrency} concurrent caller(s): telemetry to SQLite vs off (same run)");
    for (off, on) in [(2usize, 3usize), (4, 5), (6, 7)] {
        let (a, b) = (&accs[off], &accs[on]);
        println!(
            "  {:<33} p50 {:+6.0} µs   p99 {:+6.0} µs   cpu/call {:+6.1} µs   calls/s {:.2}×",
            VARIANTS[on].name,
            b.p(0.5) - a.p(0.5),
            b.p(0.99) - a.p(0.99),
            b.cpu_per_call_us() - a.cpu_per_call_us(),
            b.per_s() / a.per_s(),
        );
    }
}

/// `POLYGW_BENCH_PROFILE=<variant name part>` (with `POLYGW_BENCH_CALLERS`, default 64,
/// and `POLYGW_BENCH_CALLS`, default 50 000): only that variant, for a profiler attached to the process
/// (`perf record -p`); prints calls/s and CPU per call, no baseline.
async fn profile_one(callers: &Callers, name: &str) -> bool {
    let Some(&v) = VARIANTS.iter().find(|v| v.name.contains(name)) else {
        eprintln!("no variant named like {name:?}");
        return false;
    };
    let concurrency = env_count("POLYGW_BENCH_CALLERS", 64);
    let calls = env_count("POLYGW_BENCH_CALLS", 50_000);
    println!(
        "profiling {:?}: {calls} calls, {concurrency} callers (pid {})",
        v.name,
        std::process::id()
    );
    // What a caller moves around: the call's future (its state is boxed inside).
    let future_bytes = std::mem::size_of_val(&callers.client(v).chat(ChatRequest::user("x")));
    println!("a chat() future is {future_bytes} bytes");
    let c = callers.clone();
    profile_drive(calls, concurrency, None, move |i| {
        let c = c.clone();
        async move { c.call(v, i).await }
    })
    .await
}

pub fn main() {
    let full = full_run();
    let mock = |b: Behavior| MockConfig {
        record_bodies: false,
        log_capacity: 1000,
        default: Some(b),
        ..MockConfig::default()
    };
    let host = MockHost::start(vec![
        mock(plain_answer(CHUNKS)),
        mock(streamed_answer(CHUNKS)),
    ]);
    let urls = host.urls();
    let dir = tempfile::tempdir().expect("temp dir");
    let db = |name: &str| format!("sqlite://{}", dir.path().join(name).display());
    let rt = support::runtime();
    let ok = rt.block_on(async {
        let build = |scope: &str, url: &str, db: Option<String>| {
            let vars = vars(scope, url, db.as_deref());
            let scope = scope.to_string();
            async move {
                GatewayClient::from_vars(vars, &scope)
                    .await
                    .unwrap_or_else(|e| panic!("client {scope}: {e}"))
            }
        };
        let callers = Callers {
            direct_plain: Direct::new(&urls[0], MODEL, KEY),
            direct_stream: Direct::new(&urls[1], MODEL, KEY),
            clients: [
                [
                    build("PLAIN_OFF", &urls[0], None).await,
                    build("PLAIN_ON", &urls[0], Some(db("plain.db"))).await,
                ],
                [
                    build("STREAM_OFF", &urls[1], None).await,
                    build("STREAM_ON", &urls[1], Some(db("stream.db"))).await,
                ],
            ],
        };
        if let Ok(name) = std::env::var("POLYGW_BENCH_PROFILE") {
            return profile_one(&callers, &name).await;
        }
        let (rounds, c1, c64) = if full { (5, 400, 2000) } else { (1, 20, 64) };
        println!(
            "call overhead: mock upstream on loopback ({CHUNKS} chunks; streams pause 1 ms after the first), {rounds} rounds (+1 warm-up) per level, \
             {c1} calls per variant per round with 1 caller, {c64} with 64; load average {}",
            loadavg()
        );
        let one = level(&callers, 1, rounds, c1).await;
        let mut ok = report(1, &one);
        telemetry_delta(1, &one);
        let many = level(&callers, 64, rounds, c64).await;
        ok &= report(64, &many);
        telemetry_delta(64, &many);
        let mut written = 0;
        let mut dropped = 0;
        for pair in &callers.clients {
            pair[0].shutdown().await;
            let rep = pair[1].shutdown().await;
            written += rep.written;
            dropped += rep.dropped + rep.pending;
        }
        let calls_on =
            VARIANTS.iter().filter(|v| v.telemetry).count() * (rounds + 1) * (c1 + c64);
        println!(
            "\ntelemetry: {written} rows written (expected {calls_on}, one per call), {dropped} dropped or pending; load average {}",
            loadavg()
        );
        ok & (written == calls_on as u64 && dropped == 0)
    });
    drop(rt);
    host.shutdown();
    if !ok {
        eprintln!("overhead benchmark: some calls failed or rows are missing (see above)");
        std::process::exit(1);
    }
}
