//! `cargo bench -p polygw --bench hedging` (`cargo xtask bench hedging`): hedging
//! efficacy on the reference long-tail workload (SPEC §12, time scaled) — latency
//! p50/p95/p99/p99.9 of streamed calls with hedging off, with restarting legs (the old
//! demo settings and the frontier settings) and with resuming legs (prefill
//! continuations, SPEC §13), side by side in one run, and what each costs: extra
//! upstream requests and extra completion tokens (counted by the simulated upstreams
//! themselves, cancelled legs included). Fixed seeds, fixed concurrency; every config
//! faces fresh upstreams with the same seeds, and every question must get exactly the
//! same answer text in every config. Method and results: docs/BENCHMARKS.md, "Hedging
//! efficacy".
//!
//! The profile is `polygw demo`'s: SPEC §12's TTFT, stall and generation-time
//! distributions with chunks coalesced 5:1 (10–80 chunks, mean gap 150 ms), because at
//! time scale 0.01 the full chunking asks two shared cores for ~100 000 SSE frames/s and
//! the simulator falls behind its own schedule (the program prints how late the upstream
//! answers ended against their plan, so this stays checked).
//!
//! Environment (optional): `POLYGW_BENCH_HEDGE_CALLS` (calls per config, default 8000),
//! `POLYGW_BENCH_HEDGE_PROFILE=full` (SPEC §12's 50–400 chunks, 30 ms apart).

#![allow(
    clippy::disallowed_methods,
    reason = "a benchmark measures real elapsed time"
)]

mod support;

use std::time::Duration;

use polygw::{ChatRequest, GatewayClient, LlmResponse};
use polygw_mock_upstream::{Behavior, EndKind, LongTail, MockConfig, Profile, ProfileKind};
use support::{cpu_time, full_run, loadavg, pct, MockHost};
use tokio::time::Instant;

/// 1 s of the reference workload lasts 10 ms.
const TIME_SCALE: f64 = 0.01;
const SEED: u64 = 42;
const SOURCES: usize = 3;
const CONCURRENCY: usize = 64;
const BUDGET_PCT: u32 = 30;

/// One hedging setting. Thresholds in real (unscaled) seconds.
#[derive(Clone, Copy, Debug)]
struct Config {
    name: &'static str,
    /// `HEDGE__AFTER_S` (first-token trigger), if on.
    after_s: Option<f64>,
    /// `HEDGE__STALL_AFTER_S` (stall trigger), if on.
    stall_after_s: Option<f64>,
    /// `HEDGE__MAX_EXTRA`.
    max_extra: u32,
    /// Resume (`STREAM__RESUME=auto`, prefill-capable sources, `MAX_RESUMES` =
    /// `MAX_EXTRA`) or restart only (`STREAM__RESUME=off`: a stall hedge starts the
    /// answer again from the beginning).
    resume: bool,
}

impl Config {
    fn hedging(&self) -> bool {
        self.after_s.is_some() || self.stall_after_s.is_some()
    }
}

const CONFIGS: &[Config] = &[
    Config {
        name: "off",
        after_s: None,
        stall_after_s: None,
        max_extra: 1,
        resume: false,
    },
    // The settings `polygw demo` used before resume (AFTER_S 8, STALL_AFTER_S 10,
    // MAX_EXTRA 1).
    Config {
        name: "restart 8/10/1",
        after_s: Some(8.0),
        stall_after_s: Some(10.0),
        max_extra: 1,
        resume: false,
    },
    // The frontier settings, restarting legs only.
    Config {
        name: "restart 8/5/3",
        after_s: Some(8.0),
        stall_after_s: Some(5.0),
        max_extra: 3,
        resume: false,
    },
    // The frontier settings with resume (the demo's hedging-on column uses 8/5/2).
    Config {
        name: "resume 8/5/2",
        after_s: Some(8.0),
        stall_after_s: Some(5.0),
        max_extra: 2,
        resume: true,
    },
    Config {
        name: "resume 8/5/3",
        after_s: Some(8.0),
        stall_after_s: Some(5.0),
        max_extra: 3,
        resume: true,
    },
];

fn profile(coalesced: bool, seed: u64) -> Profile {
    let base = if coalesced {
        // polygw demo's shape: same TTFT, stalls and generation time, 5:1 fewer frames.
        LongTail {
            chunks_min: 10,
            chunks_max: 80,
            gap_mean_ms: 150.0,
            ..LongTail::default()
        }
    } else {
        LongTail::default()
    };
    Profile {
        name: "long-tail".into(),
        time_scale: TIME_SCALE,
        seed,
        // One answer length per question on every source: a prefill continuation ends
        // the same answer, and every config answers each question with the same text.
        kind: ProfileKind::LongTail(LongTail {
            length_by_request: true,
            ..base
        }),
    }
}

fn scaled(s: f64) -> String {
    format!("{}", s * TIME_SCALE)
}

fn vars(scope: &str, urls: &[String], c: Config) -> Vec<(String, String)> {
    let mut v = Vec::new();
    for (i, url) in urls.iter().enumerate() {
        let p = format!("{scope}__SIM__{i}");
        v.push((format!("{p}__BASE_URL"), url.clone()));
        v.push((format!("{p}__API_KEY"), String::new()));
        v.push((format!("{p}__MODEL"), "sim-long-tail".into()));
        v.push((format!("{p}__TIMEOUT_S"), scaled(600.0)));
        // The mocks continue an assistant prefill (every dialect); restart-only configs
        // turn resume off instead, so both face the same upstreams.
        v.push((format!("{p}__PREFILL"), "assistant".into()));
    }
    v.push((
        format!("{scope}__STREAM__STALL_THRESHOLD_MS"),
        format!("{}", (1000.0 * TIME_SCALE).max(1.0) as u64),
    ));
    v.push((format!("{scope}__RETRY__BACKOFF_BASE_S"), scaled(0.5)));
    v.push((format!("{scope}__RETRY__BACKOFF_MAX_S"), scaled(8.0)));
    if let Some(a) = c.after_s {
        v.push((format!("{scope}__HEDGE__AFTER_S"), scaled(a)));
    }
    if let Some(s) = c.stall_after_s {
        v.push((format!("{scope}__HEDGE__STALL_AFTER_S"), scaled(s)));
    }
    if c.hedging() {
        v.push((
            format!("{scope}__HEDGE__BUDGET_PCT"),
            BUDGET_PCT.to_string(),
        ));
        v.push((
            format!("{scope}__HEDGE__MAX_EXTRA"),
            c.max_extra.to_string(),
        ));
    }
    if c.resume {
        v.push((format!("{scope}__STREAM__RESUME"), "auto".into()));
        v.push((
            format!("{scope}__STREAM__MAX_RESUMES"),
            c.max_extra.to_string(),
        ));
    } else {
        v.push((format!("{scope}__STREAM__RESUME"), "off".into()));
    }
    v
}

/// The figures of one config.
struct Outcome {
    latency_ms: Vec<f64>,
    ttft_ms: Vec<f64>,
    failures: Vec<String>,
    calls: usize,
    attempts: u64,
    hedges: u64,
    resumes: u64,
    hedged_calls: usize,
    wins: usize,
    upstream_requests: usize,
    upstream_tokens: u64,
    /// Tokens of the answers returned (what one unhedged leg per call would send).
    winner_tokens: u64,
    wall: Duration,
    cpu: Duration,
    /// Completed upstream responses: how much later than planned they ended (ms).
    late_ms: Vec<f64>,
    /// Per question: the answer's content, to check that every config answers each
    /// question with exactly the same text (the reasoning is drawn per leg, so a
    /// hedge's winner may have thought differently).
    answers: Vec<Option<String>>,
    /// The slowest calls: (latency ms, attempts, hedges, resumes, hedge won, TTFT ms).
    slowest: Vec<(f64, u32, u32, u32, bool, Option<u64>)>,
}

/// Tokens of an answer as the mocks count them (one word per chunk; content words after
/// the first and every reasoning word start with a space).
fn answer_tokens(content: &str, reasoning: &str) -> u64 {
    let spaces = |t: &str| t.bytes().filter(|b| *b == b' ').count() as u64;
    spaces(content) + u64::from(!content.is_empty()) + spaces(reasoning)
}

/// The time a sampled behavior plans from request to last chunk (ms, scaled).
fn planned_ms(b: &Behavior) -> f64 {
    b.headers_delay_ms
        + b.ttft_ms
        + b.gaps_ms.iter().sum::<f64>()
        + b.stalls.iter().map(|s| s.ms).sum::<f64>()
}

async fn run_config(c: Config, calls: usize, coalesced: bool) -> Outcome {
    // Fresh upstreams with the same seeds for every config: the same sequence of draws.
    let host = tokio::task::spawn_blocking(move || {
        MockHost::start(
            (0..SOURCES)
                .map(|i| MockConfig {
                    record_bodies: false,
                    log_capacity: calls * 3,
                    ..MockConfig::with_profile(profile(coalesced, SEED + i as u64))
                })
                .collect(),
        )
    })
    .await
    .expect("mock host");
    let scope = "HEDGE_BENCH";
    let client = GatewayClient::from_vars(vars(scope, &host.urls(), c), scope)
        .await
        .expect("client");
    let cpu0 = cpu_time(None);
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..CONCURRENCY {
        let (client, next) = (client.clone(), next.clone());
        set.spawn(async move {
            let mut out: Vec<(usize, f64, Result<LlmResponse, String>)> = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= calls {
                    break;
                }
                let t = Instant::now();
                let r = client
                    .chat(
                        ChatRequest::user(format!("Question {i}: tell me something."))
                            .with_stream(true),
                    )
                    .await
                    .map_err(|e| e.to_string());
                out.push((i, t.elapsed().as_secs_f64() * 1e3, r));
            }
            out
        });
    }
    let mut o = Outcome {
        latency_ms: Vec::with_capacity(calls),
        ttft_ms: Vec::with_capacity(calls),
        failures: Vec::new(),
        calls,
        attempts: 0,
        hedges: 0,
        resumes: 0,
        hedged_calls: 0,
        wins: 0,
        upstream_requests: 0,
        upstream_tokens: 0,
        winner_tokens: 0,
        wall: Duration::ZERO,
        cpu: Duration::ZERO,
        late_ms: Vec::new(),
        answers: vec![None; calls],
        slowest: Vec::new(),
    };
    while let Some(r) = set.join_next().await {
        for (i, ms, r) in r.expect("caller") {
            match r {
                Ok(resp) => {
                    if resp.content.is_empty() || resp.finish_reason.as_deref() != Some("stop") {
                        o.failures.push(format!(
                            "incomplete answer: finish {:?}, {} chars",
                            resp.finish_reason,
                            resp.content.len()
                        ));
                        continue;
                    }
                    o.latency_ms.push(ms);
                    if let Some(t) = resp.ttft_ms {
                        o.ttft_ms.push(t as f64);
                    }
                    let s = resp.call_stats;
                    o.attempts += s.attempts as u64;
                    o.hedges += s.hedges as u64;
                    o.resumes += s.resumes as u64;
                    o.hedged_calls += usize::from(s.hedges > 0);
                    o.wins += usize::from(s.hedge_won);
                    let reasoning = resp.reasoning_content.unwrap_or_default();
                    o.winner_tokens += answer_tokens(&resp.content, &reasoning);
                    o.answers[i] = Some(resp.content);
                    o.slowest.push((
                        ms,
                        s.attempts,
                        s.hedges,
                        s.resumes,
                        s.hedge_won,
                        resp.ttft_ms,
                    ));
                }
                Err(e) => o.failures.push(e),
            }
        }
    }
    o.wall = start.elapsed();
    client.shutdown().await;
    // Every leg has ended (losers are cancelled before chat() returns); give the
    // upstreams a moment to notice the last disconnects, then read their logs.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for m in host.mocks() {
        let log = m.requests();
        o.upstream_requests += log.len();
        o.upstream_tokens += log.iter().map(|r| r.chunks_sent as u64).sum::<u64>();
        for r in log.iter().filter(|r| r.end == EndKind::Completed) {
            if let (Some(b), Some(end)) = (&r.behavior, r.ended_at) {
                let took = end.duration_since(r.arrived_at).as_secs_f64() * 1e3;
                o.late_ms.push(took - planned_ms(b));
            }
        }
    }
    o.cpu = match (cpu0, cpu_time(None)) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => Duration::ZERO,
    };
    tokio::task::spawn_blocking(move || host.shutdown())
        .await
        .expect("mock shutdown");
    o.latency_ms.sort_by(f64::total_cmp);
    o.slowest.sort_by(|a, b| b.0.total_cmp(&a.0));
    o.slowest.truncate(o.calls.div_ceil(1000).max(1));
    o.late_ms.sort_by(f64::total_cmp);
    o.ttft_ms.sort_by(f64::total_cmp);
    o
}

fn describe(c: &Config) -> String {
    if !c.hedging() {
        return "no hedging".into();
    }
    let t = |x: Option<f64>| x.map_or("off".to_string(), |v| format!("{v} s"));
    format!(
        "AFTER_S {}, STALL_AFTER_S {}, MAX_EXTRA {}, BUDGET_PCT {BUDGET_PCT}, {}",
        t(c.after_s),
        t(c.stall_after_s),
        c.max_extra,
        if c.resume {
            format!("resume (prefill, MAX_RESUMES {})", c.max_extra)
        } else {
            "restart only (STREAM__RESUME off)".into()
        }
    )
}

fn main() {
    let full = full_run();
    let calls: usize = std::env::var("POLYGW_BENCH_HEDGE_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if full { 8000 } else { 100 });
    let coalesced = std::env::var("POLYGW_BENCH_HEDGE_PROFILE").as_deref() != Ok("full");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "hedging efficacy: long-tail profile ({}, one answer length per question), time scale {TIME_SCALE} \
         (1 s → {} ms), seeds {SEED}..{}, {SOURCES} prefill-capable sources, {calls} streamed calls per config, \
         {CONCURRENCY} concurrent callers; load average {}",
        if coalesced { "coalesced 5:1 chunks" } else { "SPEC §12 chunks" },
        1000.0 * TIME_SCALE,
        SEED + SOURCES as u64 - 1,
        loadavg()
    );
    for c in CONFIGS {
        println!("  {:<15} {}", c.name, describe(c));
    }
    let outcomes: Vec<Outcome> = CONFIGS
        .iter()
        .map(|c| rt.block_on(run_config(*c, calls, coalesced)))
        .collect();
    let off = &outcomes[0];
    let q = |o: &Outcome, p: f64| pct(&o.latency_ms, p);
    println!(
        "\nlatency of the logical call (ms at time scale {TIME_SCALE}; ×{:.0} for real seconds ÷ 1000); ratio vs off in brackets",
        1.0 / TIME_SCALE
    );
    println!(
        "  {:<15} {:>5} {:>4} {:>15} {:>15} {:>15} {:>15} {:>7} {:>9} {:>7} {:>7} {:>6} {:>6} {:>8} {:>8} {:>6} {:>7}",
        "config",
        "ok",
        "fail",
        "p50",
        "p95",
        "p99",
        "p99.9",
        "mean",
        "ttft p99",
        "hedged",
        "resumes",
        "wins",
        "extra",
        "req/call",
        "tokens+",
        "wall s",
        "cpu s"
    );
    let mut ok = true;
    for (c, o) in CONFIGS.iter().zip(&outcomes) {
        let cell = |p: f64| format!("{:>6.0} ({:.2}×)", q(o, p), q(o, p) / q(off, p));
        let mean = o.latency_ms.iter().sum::<f64>() / o.latency_ms.len().max(1) as f64;
        let extra_req = (o.upstream_requests as f64 - o.calls as f64) / o.calls as f64 * 100.0;
        let extra_tok = (o.upstream_tokens as f64 - o.winner_tokens as f64)
            / o.winner_tokens.max(1) as f64
            * 100.0;
        println!(
            "  {:<15} {:>5} {:>4} {} {} {} {} {:>7.0} {:>9.0} {:>6.1}% {:>7} {:>6} {:>5.1}% {:>8.3} {:>7.1}% {:>6.1} {:>7.1}",
            c.name,
            o.latency_ms.len(),
            o.failures.len(),
            cell(0.50),
            cell(0.95),
            cell(0.99),
            cell(0.999),
            mean,
            if o.ttft_ms.is_empty() { f64::NAN } else { pct(&o.ttft_ms, 0.99) },
            o.hedged_calls as f64 / o.calls as f64 * 100.0,
            o.resumes,
            o.wins,
            extra_req,
            o.attempts as f64 / o.calls as f64,
            extra_tok,
            o.wall.as_secs_f64(),
            o.cpu.as_secs_f64(),
        );
        if o.attempts > o.upstream_requests as u64 {
            println!(
                "      {} attempts were cancelled before their request reached an upstream",
                o.attempts - o.upstream_requests as u64
            );
        }
        if !o.late_ms.is_empty() {
            println!(
                "      simulator fidelity: completed upstream answers ended {:.1} ms (p50) / {:.1} ms (p99) after their planned time",
                pct(&o.late_ms, 0.5),
                pct(&o.late_ms, 0.99)
            );
        }
        // The calls behind p99.9: what their rounds did.
        let slow: Vec<String> = o
            .slowest
            .iter()
            .map(|(ms, a, h, r, w, t)| {
                format!(
                    "{ms:.0} ms ({a} att, {h} hedges, {r} resumes{}, ttft {})",
                    if *w { ", hedge won" } else { "" },
                    t.map_or("-".into(), |t| format!("{t} ms"))
                )
            })
            .collect();
        println!("      slowest 0.1 %: {}", slow.join("; "));
        for f in o.failures.iter().take(3) {
            println!("      failure: {f}");
        }
        ok &= o.failures.is_empty();
        // Cross-checks: the upstreams saw exactly the attempts the client reports; a
        // hedging config really hedged, the unhedged one never did; a restart-only
        // config never resumed; every question got exactly the content the unhedged
        // config got (a resumed answer is the same answer, not a duplicated or
        // truncated one).
        // A leg cancelled before its request left (the call was won meanwhile) is an
        // attempt the upstreams never saw; the reverse cannot happen.
        if o.upstream_requests as u64 > o.attempts {
            println!(
                "      mismatch: upstreams saw {} requests, the client reports {} attempts",
                o.upstream_requests, o.attempts
            );
            ok = false;
        }
        if c.hedging() != (o.hedges > 0) && (o.calls >= 1000 || !c.hedging()) {
            println!(
                "      unexpected: {} hedges with config {}",
                o.hedges, c.name
            );
            ok = false;
        }
        if !c.resume && o.resumes > 0 {
            println!("      unexpected: {} resumes with resume off", o.resumes);
            ok = false;
        }
        let differ = o
            .answers
            .iter()
            .zip(&off.answers)
            .filter(|(a, b)| a.is_some() && b.is_some() && a != b)
            .count();
        if differ > 0 {
            println!(
                "      mismatch: {differ} answers' content differs from the unhedged config's"
            );
            ok = false;
        }
    }
    println!(
        "\nextra = upstream requests beyond one per call; tokens+ = completion tokens the upstreams sent \
         (all legs, cancelled ones up to the cancel) beyond the answers' own; resumes = prefill \
         continuations started; load average {}",
        loadavg()
    );
    if !ok {
        eprintln!("hedging benchmark: failures or inconsistent counts (see above)");
        std::process::exit(1);
    }
}
