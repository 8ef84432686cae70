//! `cargo bench -p polygw --bench hedging` (`cargo xtask bench hedging`): hedging that
//! needs no tuning (SPEC §19) against thresholds tuned by hand, on three workloads —
//! the reference long tail (SPEC §12), a fast chat model and a reasoning model (the
//! mock profiles `long-tail`, `fast-chat`, `reasoning`), each time scaled.
//!
//! For each workload, in one run: a grid of static `HEDGE__AFTER_S` × `STALL_AFTER_S`
//! (off included, no budget cap: each point costs what its thresholds fire on), `auto`
//! at `HEDGE__BUDGET_PCT` 5, 10 and 25, and the reference workload's tuned static
//! setting (8 s / 5 s) on the other two. Per setting: latency p50/p99/p99.9 of streamed
//! `chat()` calls, extra upstream requests and extra completion tokens (counted by the
//! simulated upstreams, cancelled legs included). Then, per `auto` budget, the best
//! static p99 among the grid points that spend no more extra requests, and whether
//! `auto`'s p99 reduction reaches 90 % of it (issue 24, item 5). Last, a shifting
//! workload: one source of the fast chat model slows down ×5 for a minute; the bench
//! prints the thresholds in force and the p99 per time bucket.
//!
//! Every config faces fresh upstreams with the same seeds and every question must get
//! exactly the same answer text in every config of its workload (one answer length per
//! question, `length_by_request`, so a prefill continuation ends the same answer).
//! Chunks are coalesced (fewer, longer gaps; same generation time) so that two shared
//! cores keep up with the plan: the program prints how late the upstream answers ended
//! against their plan for every config.
//!
//! Time scaling: every duration of the workload is multiplied by its time scale — the
//! profile, `TIMEOUT_S`, backoffs, static thresholds, and `auto`'s bounds, window and
//! the budget's bank (`HEDGE__MIN_S`/`MAX_S`, `STALL_MIN_S`/`STALL_MAX_S`, `WINDOW_S`,
//! `BANK_S`) and the priors (`AFTER_PRIOR_S`, `STALL_PRIOR_S`): `auto` sees the
//! workload exactly as it would unscaled. Counts (`MIN_SAMPLES`, `BURST`, `BUDGET_PCT`)
//! are not durations. Not scaled: the engine's 1 s threshold cache (`THRESHOLDS_TTL`)
//! and timer granularity (1 ms) — hence each workload's scale keeps its thresholds
//! ≥ 10 ms and its window ≥ the 10 s that `HEDGE__WINDOW_S` must be.
//!
//! Method and results: docs/BENCHMARKS.md, "Hedging: auto against a tuned grid".
//!
//! Environment (optional): `POLYGW_BENCH_HEDGE_CALLS` (measured calls per config,
//! default 3000), `POLYGW_BENCH_HEDGE_WARMUP` (calls an `auto` config runs before it is
//! measured, default 300), `POLYGW_BENCH_HEDGE_WORKLOADS` (comma-separated subset of
//! `long-tail,fast-chat,reasoning,shift`), `POLYGW_BENCH_HEDGE_SETTINGS` (comma-separated
//! parts of setting names, e.g. `auto,8 / 5`; `off` always runs),
//! `POLYGW_BENCH_HEDGE_COLD` (calls each config's fresh process makes first, recorded as
//! its cold start, default 100; 0 = none), `POLYGW_BENCH_HEDGE_PROFILE=full` (the
//! profiles' own chunking, not coalesced), `POLYGW_BENCH_HEDGE_SUITE=resume` (instead:
//! the earlier restart-vs-resume comparison on the long tail, "Hedging efficacy").

#![allow(
    clippy::disallowed_methods,
    reason = "a benchmark measures real elapsed time"
)]

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use polygw::{ChatRequest, GatewayClient};
use polygw_core::hedge::{ThresholdInForce, ThresholdOrigin, Thresholds};
use polygw_mock_upstream::{Behavior, EndKind, MockConfig, PairedDraws, Profile, ProfileKind};
use support::{cpu_time, full_run, loadavg, pct, MockHost};
use tokio::time::Instant;

const SEED: u64 = 42;
const SOURCES: usize = 3;
/// `HEDGE__MAX_EXTRA` (and `STREAM__MAX_RESUMES`) of every hedging config: with three
/// sources a round has at most three legs.
const MAX_EXTRA: u32 = 2;
/// The `auto` budgets compared.
const AUTO_BUDGETS: [u32; 3] = [5, 10, 25];
/// `auto`'s p99 reduction must reach this share of the best static one.
const TARGET: f64 = 0.9;

// === Workloads and settings ===

/// One workload: a named mock profile at a time scale.
#[derive(Clone, Copy, Debug)]
struct Workload {
    /// The mock profile (`Profile::named`).
    profile: &'static str,
    /// Multiplies every duration (1 s of the workload lasts `1000 × time_scale` ms).
    time_scale: f64,
    /// Chunks merged into one (their gaps add up), to keep the simulator on plan.
    coalesce: u32,
    /// Concurrent callers (closed loop).
    concurrency: usize,
    /// What the grid spans, for the header.
    about: &'static str,
}

const LONG_TAIL: Workload = Workload {
    profile: "long-tail",
    time_scale: 0.02,
    coalesce: 5,
    concurrency: 128,
    about: "SPEC §12: TTFT median 1.6 s; a 20–120 s stall in 19 % of answers, a 1–5 s one in 30 %",
};

const FAST_CHAT: Workload = Workload {
    profile: "fast-chat",
    time_scale: 0.05,
    coalesce: 3,
    concurrency: 64,
    about:
        "TTFT median 0.4 s, p99 3 s; a 3–30 s stall in 3 % of answers, a 0.3–1.5 s pause in 10 %",
};

const REASONING: Workload = Workload {
    profile: "reasoning",
    time_scale: 0.02,
    coalesce: 5,
    concurrency: 192,
    about: "TTFT median 15 s, p99 90 s; then steady streaming, no stalls",
};

/// A threshold key's value, in seconds of the unscaled workload.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Th {
    Off,
    Secs(f64),
    Auto,
}

impl Th {
    fn env(self, scale: f64) -> String {
        match self {
            Th::Off => "off".into(),
            Th::Secs(s) => secs(s * scale),
            Th::Auto => "auto".into(),
        }
    }

    fn label(self) -> String {
        match self {
            Th::Off => "off".into(),
            Th::Secs(s) => format!("{s}"),
            Th::Auto => "auto".into(),
        }
    }
}

/// What a setting is in the comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// A point of the static grid.
    Grid,
    /// `auto` at a budget.
    Auto,
    /// The reference workload's tuned setting on another workload.
    Contrast,
    /// The restart-vs-resume suite.
    Suite,
}

/// One hedging setting.
#[derive(Clone, Debug)]
struct Setting {
    name: String,
    after: Th,
    stall: Th,
    /// `HEDGE__BUDGET_PCT` (0 = no cap).
    budget_pct: u32,
    max_extra: u32,
    /// `STREAM__RESUME=auto` (prefill continuations) or `off` (restart only).
    resume: bool,
    role: Role,
}

impl Setting {
    fn new(after: Th, stall: Th, budget_pct: u32, role: Role) -> Setting {
        let name = match role {
            Role::Auto => format!("auto, budget {budget_pct} %"),
            Role::Contrast => format!("{} / {} (long-tail's)", after.label(), stall.label()),
            _ => format!("{} / {}", after.label(), stall.label()),
        };
        Setting {
            name,
            after,
            stall,
            budget_pct,
            max_extra: MAX_EXTRA,
            resume: true,
            role,
        }
    }

    fn hedging(&self) -> bool {
        self.after != Th::Off || self.stall != Th::Off
    }

    fn auto(&self) -> bool {
        self.after == Th::Auto || self.stall == Th::Auto
    }

    fn is_off(&self) -> bool {
        self.role == Role::Grid && !self.hedging()
    }

    fn is_static(&self) -> bool {
        matches!(self.role, Role::Grid | Role::Contrast)
    }
}

/// A static grid (no budget cap), `auto` at each budget, and the contrast settings.
fn settings(
    after: &[Th],
    stall: &[Th],
    extra: &[(Th, Th)],
    contrast: &[(Th, Th)],
    smoke: bool,
) -> Vec<Setting> {
    let mut v = Vec::new();
    for &a in after {
        for &s in stall {
            v.push(Setting::new(a, s, 0, Role::Grid));
        }
    }
    for &(a, s) in extra {
        v.push(Setting::new(a, s, 0, Role::Grid));
    }
    for &(a, s) in contrast {
        v.push(Setting::new(a, s, 0, Role::Contrast));
    }
    for pct in AUTO_BUDGETS {
        v.push(Setting::new(Th::Auto, Th::Auto, pct, Role::Auto));
    }
    if smoke {
        // Off, one static point, one auto: the program end to end in seconds.
        let keep = [0, 1, v.len() - 2];
        v = keep.iter().map(|&i| v[i].clone()).collect();
    }
    v
}

/// The reference workload's tuned static setting (docs/HEDGING.md).
const TUNED: (Th, Th) = (Th::Secs(8.0), Th::Secs(5.0));

fn long_tail_settings(smoke: bool) -> Vec<Setting> {
    use Th::{Off, Secs};
    settings(
        &[Off, Secs(4.0), Secs(8.0)],
        &[
            Off,
            Secs(5.0),
            Secs(10.0),
            Secs(30.0),
            Secs(40.0),
            Secs(50.0),
            Secs(60.0),
        ],
        &[],
        &[],
        smoke,
    )
}

fn fast_chat_settings(smoke: bool) -> Vec<Setting> {
    use Th::{Off, Secs};
    settings(
        &[Off, Secs(1.0), Secs(1.5), Secs(2.5)],
        &[Off, Secs(1.0), Secs(2.0), Secs(5.0)],
        &[],
        &[TUNED],
        smoke,
    )
}

fn reasoning_settings(smoke: bool) -> Vec<Setting> {
    use Th::{Off, Secs};
    settings(
        &[
            Off,
            Secs(20.0),
            Secs(25.0),
            Secs(30.0),
            Secs(40.0),
            Secs(50.0),
            Secs(60.0),
        ],
        &[Off],
        // The stall trigger has nothing to fire on in a steady stream.
        &[(Off, Secs(2.0)), (Secs(40.0), Secs(2.0))],
        &[TUNED],
        smoke,
    )
}

/// The earlier comparison (docs/BENCHMARKS.md, "Hedging efficacy"): restarting and
/// resuming legs on the long tail at time scale 0.01, budget 30 %.
fn resume_suite() -> (Workload, Vec<Setting>) {
    let w = Workload {
        time_scale: 0.01,
        concurrency: 64,
        ..LONG_TAIL
    };
    let mk = |name: &str, after: Th, stall: Th, max_extra: u32, resume: bool| Setting {
        name: name.into(),
        after,
        stall,
        budget_pct: 30,
        max_extra,
        resume,
        role: if after == Th::Off {
            Role::Grid
        } else {
            Role::Suite
        },
    };
    use Th::{Off, Secs};
    (
        w,
        vec![
            mk("off", Off, Off, 1, false),
            mk("restart 8/10/1", Secs(8.0), Secs(10.0), 1, false),
            mk("restart 8/5/3", Secs(8.0), Secs(5.0), 3, false),
            mk("resume 8/5/2", Secs(8.0), Secs(5.0), 2, true),
            mk("resume 8/5/3", Secs(8.0), Secs(5.0), 3, true),
        ],
    )
}

// === Configuration of the client under test ===

fn secs(s: f64) -> String {
    let t = format!("{s:.6}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn profile(w: &Workload, seed: u64, coalesced: bool) -> Profile {
    let mut p = Profile::named(w.profile, w.time_scale, seed).expect("named profile");
    if let ProfileKind::LongTail(l) = &mut p.kind {
        let k = if coalesced { w.coalesce.max(1) } else { 1 };
        l.chunks_min = (l.chunks_min / k).max(1);
        l.chunks_max = (l.chunks_max / k).max(l.chunks_min);
        l.gap_mean_ms *= f64::from(k);
        // One answer length per question on every source: a prefill continuation ends
        // the same answer, and every config answers each question with the same text.
        l.length_by_request = true;
    }
    p
}

fn vars(scope: &str, urls: &[String], w: &Workload, s: &Setting) -> Vec<(String, String)> {
    let scaled = |x: f64| secs(x * w.time_scale);
    let mut v = Vec::new();
    for (i, url) in urls.iter().enumerate() {
        let p = format!("{scope}__SIM__{i}");
        v.push((format!("{p}__BASE_URL"), url.clone()));
        v.push((format!("{p}__API_KEY"), String::new()));
        v.push((format!("{p}__MODEL"), format!("sim-{}", w.profile)));
        v.push((format!("{p}__TIMEOUT_S"), scaled(600.0)));
        // The mocks continue an assistant prefill (every dialect).
        v.push((format!("{p}__PREFILL"), "assistant".into()));
    }
    let mut set = |k: &str, val: String| v.push((format!("{scope}__{k}"), val));
    set(
        "STREAM__STALL_THRESHOLD_MS",
        format!("{}", (1000.0 * w.time_scale).max(1.0) as u64),
    );
    set("RETRY__BACKOFF_BASE_S", scaled(0.5));
    set("RETRY__BACKOFF_MAX_S", scaled(8.0));
    // Set explicitly: a chat scope with two or more sources defaults to `auto`.
    set("HEDGE__AFTER_S", s.after.env(w.time_scale));
    set("HEDGE__STALL_AFTER_S", s.stall.env(w.time_scale));
    set("HEDGE__BUDGET_PCT", s.budget_pct.to_string());
    set("HEDGE__MAX_EXTRA", s.max_extra.to_string());
    // `auto`'s durations, scaled like the workload (defaults of SPEC §19).
    set("HEDGE__WINDOW_S", scaled(600.0));
    set("HEDGE__MIN_S", scaled(0.5));
    set("HEDGE__MAX_S", scaled(60.0));
    set("HEDGE__STALL_MIN_S", scaled(1.0));
    set("HEDGE__STALL_MAX_S", scaled(60.0));
    // The priors (SPEC §25.1), likewise.
    set("HEDGE__AFTER_PRIOR_S", scaled(15.0));
    set("HEDGE__STALL_PRIOR_S", scaled(10.0));
    set("HEDGE__MIN_SAMPLES", "50".into());
    set("HEDGE__BURST", "3".into());
    set("HEDGE__BANK_S", scaled(60.0));
    if s.resume {
        set("STREAM__RESUME", "auto".into());
        set("STREAM__MAX_RESUMES", s.max_extra.to_string());
    } else {
        set("STREAM__RESUME", "off".into());
    }
    v
}

// === Driving calls ===

/// One call's figures.
struct Rec {
    /// Started, since the run's start.
    start: Duration,
    ms: f64,
    result: Result<Answer, String>,
}

struct Answer {
    index: usize,
    content: String,
    tokens: u64,
    attempts: u32,
    hedges: u32,
    resumes: u32,
    hedge_won: bool,
    ttft_ms: Option<u64>,
}

/// Tokens of an answer as the mocks count them (one word per chunk; content words after
/// the first and every reasoning word start with a space).
fn answer_tokens(content: &str, reasoning: &str) -> u64 {
    let spaces = |t: &str| t.bytes().filter(|b| *b == b' ').count() as u64;
    spaces(content) + u64::from(!content.is_empty()) + spaces(reasoning)
}

#[derive(Clone, Copy)]
enum Stop {
    /// This many calls, then the callers stop.
    Count(usize),
    /// This many calls, recorded; the callers keep the load up with calls of another
    /// tag, not recorded, until the last of them has ended (the cool-down: the last
    /// recorded calls run in the steady state, not in a scope emptying out, where no new
    /// call adds to the hedge budget).
    Measured(usize),
    /// Calls until then.
    Until(Instant),
}

/// The tag of the cool-down calls of [`Stop::Measured`].
const COOL_DOWN: &str = "Cool-down";

/// Closed loop: `concurrency` callers, each taking the next question until `stop`.
async fn drive(
    client: &GatewayClient,
    concurrency: usize,
    stop: Stop,
    tag: &'static str,
    t0: Instant,
) -> Vec<Rec> {
    let next = Arc::new(AtomicUsize::new(0));
    // Recorded calls ended, and cool-down calls started (Stop::Measured).
    let (ended, cooling) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (client, next, ended, cooling) =
            (client.clone(), next.clone(), ended.clone(), cooling.clone());
        set.spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let more = match stop {
                    Stop::Count(n) | Stop::Measured(n) => i < n,
                    Stop::Until(t) => Instant::now() < t,
                };
                if !more {
                    let Stop::Measured(n) = stop else { break };
                    if ended.load(Ordering::Relaxed) >= n {
                        break;
                    }
                    let j = cooling.fetch_add(1, Ordering::Relaxed);
                    // Unrecorded; a failure here shows in no figure (the mocks' logs
                    // are read by answer text, which a cool-down call never shares).
                    let _ = client
                        .chat(
                            ChatRequest::user(format!("{COOL_DOWN} {j}: tell me something."))
                                .with_stream(true),
                        )
                        .await;
                    continue;
                }
                let t = Instant::now();
                let r = client
                    .chat(
                        ChatRequest::user(format!("{tag} {i}: tell me something."))
                            .with_stream(true),
                    )
                    .await;
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let result = match r {
                    Ok(resp)
                        if !resp.content.is_empty()
                            && resp.finish_reason.as_deref() == Some("stop") =>
                    {
                        let s = resp.call_stats;
                        let reasoning = resp.reasoning_content.unwrap_or_default();
                        Ok(Answer {
                            index: i,
                            tokens: answer_tokens(&resp.content, &reasoning),
                            content: resp.content,
                            attempts: s.attempts,
                            hedges: s.hedges,
                            resumes: s.resumes,
                            hedge_won: s.hedge_won,
                            ttft_ms: resp.ttft_ms,
                        })
                    }
                    Ok(resp) => Err(format!(
                        "incomplete answer: finish {:?}, {} chars",
                        resp.finish_reason,
                        resp.content.len()
                    )),
                    Err(e) => Err(e.to_string()),
                };
                out.push(Rec {
                    start: t.duration_since(t0),
                    ms,
                    result,
                });
                ended.fetch_add(1, Ordering::Relaxed);
            }
            out
        });
    }
    let mut recs = Vec::new();
    while let Some(r) = set.join_next().await {
        recs.extend(r.expect("caller"));
    }
    recs
}

/// Runs `warmup` calls, then more until every source's thresholds come from its own
/// distribution (the engine recomputes them at most once a second of real time,
/// whatever the time scale), for at most 20 s.
async fn warm_up(client: &GatewayClient, w: &Workload, warmup: usize) {
    let t0 = Instant::now();
    // Its own distribution, and the prior without weight left (SPEC §25.1: from
    // 4 × MIN_SAMPLES legs on).
    let own = |c: &GatewayClient| {
        c.hedge_thresholds(true).iter().all(|(_, t)| {
            [t.after, t.stall_after].iter().all(|t| match t.origin {
                ThresholdOrigin::Off => true,
                ThresholdOrigin::Source => t.prior_bp == 0,
                _ => false,
            })
        })
    };
    let mut n = warmup;
    loop {
        let warm = drive(client, w.concurrency, Stop::Count(n), "Warm-up", t0).await;
        if let Some(Err(e)) = warm.iter().map(|r| &r.result).find(|r| r.is_err()) {
            println!("      warm-up failure: {e}");
        }
        if own(client) || t0.elapsed() > Duration::from_secs(20) {
            return;
        }
        n = w.concurrency;
    }
}

/// The time a sampled behavior plans from request to last chunk (ms, scaled).
fn planned_ms(b: &Behavior) -> f64 {
    b.headers_delay_ms
        + b.ttft_ms
        + b.gaps_ms.iter().sum::<f64>()
        + b.stalls.iter().map(|s| s.ms).sum::<f64>()
}

/// The first calls of a fresh process (SPEC §25: the "cold start" column): how long
/// they took and the legs beyond one per call they cost.
#[derive(Default)]
struct Cold {
    /// Sorted latencies of the successful calls (ms, scaled).
    latency_ms: Vec<f64>,
    calls: usize,
    extra_attempts: u64,
    failures: usize,
}

/// Calls a config's fresh process makes first, recorded as its cold start
/// (`POLYGW_BENCH_HEDGE_COLD`, 0 = none).
const COLD_CALLS: usize = 100;

/// The figures of one config.
struct Outcome {
    /// Its first calls, before any warm-up.
    cold: Cold,
    /// Sorted latencies of the successful calls (ms, scaled).
    latency_ms: Vec<f64>,
    failures: Vec<String>,
    calls: usize,
    attempts: u64,
    hedges: u64,
    resumes: u64,
    hedged_calls: usize,
    wins: usize,
    upstream_requests: usize,
    upstream_tokens: u64,
    winner_tokens: u64,
    wall: Duration,
    cpu: Duration,
    /// Completed upstream answers: how much later than planned they ended (ms, sorted).
    late_ms: Vec<f64>,
    /// Per question, the answer's content.
    answers: Vec<Option<String>>,
    /// The thresholds in force at the end (`auto` configs).
    thresholds: Option<Vec<(String, Thresholds)>>,
    /// `auto`: the medians of the thresholds in force during the measured calls (all
    /// sources; first token, stall; seconds of the unscaled workload).
    during: Option<(f64, f64)>,
    /// `auto`: the `1 − BUDGET_PCT` quantile of the TTFTs the upstreams drew for the
    /// measured requests (what the first-token threshold estimates), unscaled seconds.
    ttft_target: Option<f64>,
}

impl Outcome {
    fn p(&self, q: f64, scale: f64) -> f64 {
        if self.latency_ms.is_empty() {
            return f64::NAN;
        }
        pct(&self.latency_ms, q) / scale / 1000.0
    }

    fn extra_req(&self) -> f64 {
        (self.upstream_requests as f64 - self.calls as f64) / self.calls.max(1) as f64 * 100.0
    }

    fn extra_tok(&self) -> f64 {
        (self.upstream_tokens as f64 - self.winner_tokens as f64) / self.winner_tokens.max(1) as f64
            * 100.0
    }
}

/// The upstreams of one config: three mocks of the workload's profile sharing one set of
/// draws keyed by question ([`PairedDraws`]), fresh for every config — every config faces
/// the same first leg, second leg, … of every question, whichever source serves it and
/// in whatever order concurrent calls reach it.
fn mock_configs(w: &Workload, coalesced: bool, capacity: usize) -> Vec<MockConfig> {
    let draws = PairedDraws::new(SEED);
    (0..SOURCES)
        .map(|i| MockConfig {
            record_bodies: false,
            log_capacity: capacity,
            paired: Some(draws.clone()),
            ..MockConfig::with_profile(profile(w, SEED + i as u64, coalesced))
        })
        .collect()
}

async fn run_config(
    w: &Workload,
    s: &Setting,
    calls: usize,
    warmup: usize,
    coalesced: bool,
) -> Outcome {
    // Fresh upstreams with the same seeds for every config.
    let cfgs = mock_configs(w, coalesced, (calls + warmup) * 4);
    let host = tokio::task::spawn_blocking(move || MockHost::start(cfgs))
        .await
        .expect("mock host");
    let scope = "HEDGE_BENCH";
    let client = GatewayClient::from_vars(vars(scope, &host.urls(), w, s), scope)
        .await
        .expect("client");
    // The cold start: the fresh process's first calls, every config alike.
    let cold_n =
        env_usize("POLYGW_BENCH_HEDGE_COLD").unwrap_or(if full_run() { COLD_CALLS } else { 10 });
    let mut cold = Cold::default();
    if cold_n > 0 {
        let recs = drive(
            &client,
            w.concurrency,
            Stop::Count(cold_n),
            "Cold",
            Instant::now(),
        )
        .await;
        cold.calls = recs.len();
        for r in recs {
            match r.result {
                Ok(a) => {
                    cold.latency_ms.push(r.ms);
                    cold.extra_attempts += u64::from(a.attempts.saturating_sub(1));
                }
                Err(_) => cold.failures += 1,
            }
        }
        cold.latency_ms.sort_by(f64::total_cmp);
    }
    // `auto` learns its distributions first; what follows is its steady state.
    if warmup > 0 && s.auto() {
        warm_up(&client, w, warmup).await;
    }
    let measured_from = std::time::Instant::now();
    let cpu0 = cpu_time(None);
    let t0 = Instant::now();
    // `auto`: the thresholds in force, read every 250 ms (they change at most once a
    // second) while the measured calls run.
    let readings: Arc<Mutex<(Vec<f64>, Vec<f64>)>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = s.auto().then(|| {
        let (client, readings, stop, scale) =
            (client.clone(), readings.clone(), stop.clone(), w.time_scale);
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let t = client.hedge_thresholds(true);
                {
                    let mut r = readings.lock().unwrap_or_else(|e| e.into_inner());
                    for (_, t) in &t {
                        if let Some(v) = t.after.value {
                            r.0.push(v.as_secs_f64() / scale);
                        }
                        if let Some(v) = t.stall_after.value {
                            r.1.push(v.as_secs_f64() / scale);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    });
    let recs = drive(
        &client,
        w.concurrency,
        Stop::Measured(calls),
        "Question",
        t0,
    )
    .await;
    // The upstream requests of the measured calls: those whose planned answer is one of
    // theirs (every question has its own text; cool-down calls are left out).
    let answers: std::collections::HashSet<String> = recs
        .iter()
        .filter_map(|r| r.result.as_ref().ok())
        .map(|a| a.content.clone())
        .collect();
    let measured = |r: &&polygw_mock_upstream::RecordedRequest| {
        r.arrived_at >= measured_from && answers.contains(&r.full_content)
    };
    let wall = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    if let Some(r) = reader {
        r.await.expect("threshold reader");
    }
    let during = s.auto().then(|| {
        let mut r = readings.lock().unwrap_or_else(|e| e.into_inner());
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            if v.is_empty() {
                f64::NAN
            } else {
                pct(v, 0.5)
            }
        };
        let (a, b) = &mut *r;
        let m = (med(a), med(b));
        if std::env::var("DBG").is_ok() {
            let q = |v: &Vec<f64>, x: f64| if v.is_empty() { f64::NAN } else { pct(v, x) };
            println!(
                "DBG stall thresholds in force: min {:.2} p10 {:.2} p90 {:.2} max {:.2}",
                q(b, 0.0),
                q(b, 0.1),
                q(b, 0.9),
                q(b, 1.0)
            );
        }
        m
    });
    let thresholds = s.auto().then(|| client.hedge_thresholds(true));
    let dbg_pool = {
        let mut p = polygw_core::latency::LatencySnapshot::default();
        for (_, v) in client.hedge_latency(true) {
            p.merge(&v);
        }
        p
    };
    client.shutdown().await;
    // Every leg has ended (losers are cancelled before chat() returns); give the
    // upstreams a moment to notice the last disconnects, then read their logs.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut o = Outcome {
        cold,
        latency_ms: Vec::with_capacity(calls),
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
        wall,
        cpu: Duration::ZERO,
        late_ms: Vec::new(),
        answers: vec![None; calls],
        thresholds,
        during,
        ttft_target: None,
    };
    let recs_ttft: Vec<f64> = recs
        .iter()
        .filter_map(|r| r.result.as_ref().ok())
        .filter(|a| a.hedges == 0)
        .filter_map(|a| a.ttft_ms)
        .map(|t| t as f64 / w.time_scale / 1000.0)
        .collect();
    if std::env::var("DBG").is_ok() {
        let mut slow: Vec<(f64, String)> = recs
            .iter()
            .filter_map(|r| {
                r.result.as_ref().ok().map(|a| {
                    (
                        r.ms / w.time_scale / 1000.0,
                        format!(
                            "att {} hedg {} res {} ttft {:.1} started {:.1} s q {}",
                            a.attempts,
                            a.hedges,
                            a.resumes,
                            a.ttft_ms.unwrap_or(0) as f64 / w.time_scale / 1000.0,
                            r.start.as_secs_f64() / w.time_scale,
                            a.index
                        ),
                    )
                })
            })
            .collect();
        slow.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (ms, d) in slow.iter().take(35) {
            println!("DBG slow {ms:.1} s: {d}");
        }
    }
    for r in recs {
        match r.result {
            Ok(a) => {
                o.latency_ms.push(r.ms);
                o.attempts += u64::from(a.attempts);
                o.hedges += u64::from(a.hedges);
                o.resumes += u64::from(a.resumes);
                o.hedged_calls += usize::from(a.hedges > 0);
                o.wins += usize::from(a.hedge_won);
                o.winner_tokens += a.tokens;
                o.answers[a.index] = Some(a.content);
            }
            Err(e) => o.failures.push(e),
        }
    }
    let mut drawn_ttft: Vec<f64> = Vec::new();
    if std::env::var("DBG").is_ok() {
        let mut tt: Vec<f64> = recs_ttft.clone();
        tt.sort_by(f64::total_cmp);
        let mut d: Vec<f64> = Vec::new();
        for m in host.mocks() {
            for r in m.requests().iter().filter(measured) {
                if let Some(b) = &r.behavior {
                    d.push(b.ttft_ms / w.time_scale / 1000.0);
                }
            }
        }
        d.sort_by(f64::total_cmp);
        println!("DBG unhedged winners ttft p50 {:.2} p90 {:.2} p99 {:.2} (n {}) | draws p50 {:.2} p90 {:.2} p99 {:.2} (n {})", pct(&tt,0.5), pct(&tt,0.9), pct(&tt,0.99), tt.len(), pct(&d,0.5), pct(&d,0.9), pct(&d,0.99), d.len());
    }
    for m in host.mocks() {
        let log = m.requests();
        for r in log.iter().filter(measured) {
            if let Some(b) = &r.behavior {
                drawn_ttft.push(b.ttft_ms / w.time_scale / 1000.0);
            }
            o.upstream_requests += 1;
            o.upstream_tokens += u64::from(r.chunks_sent);
            if let (EndKind::Completed, Some(b), Some(end)) = (r.end, &r.behavior, r.ended_at) {
                let took = end.duration_since(r.arrived_at).as_secs_f64() * 1e3;
                o.late_ms.push(took - planned_ms(b));
            }
        }
    }
    if std::env::var("DBG").is_ok() && s.auto() {
        let mut truth: Vec<f64> = Vec::new();
        for m in host.mocks() {
            for r in m.requests().iter().filter(measured) {
                let Some(b) = &r.behavior else { continue };
                let mut g = b.gaps_ms.clone();
                for st in &b.stalls {
                    let i = st.before_chunk as usize;
                    if i >= 1 && i - 1 < g.len() {
                        g[i - 1] += st.ms;
                    }
                }
                truth.push(g.iter().copied().fold(0.0, f64::max) / w.time_scale / 1000.0);
            }
        }
        let gp = &dbg_pool.gap;
        let mut line = format!(
            "DBG gap pool: obs {} cens {} legs {} | S(t) est/truth:",
            gp.observed(),
            gp.censored(),
            gp.legs()
        );
        for t in [
            1.0f64, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0,
        ] {
            let est = gp
                .cdf(Duration::from_secs_f64(t * w.time_scale))
                .map_or(f64::NAN, |c| 1.0 - c);
            let tr = truth.iter().filter(|&&x| x > t).count() as f64 / truth.len().max(1) as f64;
            line += &format!(" {t}:{est:.3}/{tr:.3}");
        }
        println!("{line}");
        let cens: Vec<String> = gp
            .bins()
            .filter(|b| b.kind == polygw_core::latency::SampleKind::Censored)
            .map(|b| {
                format!(
                    "{:.1}x{}",
                    b.value_ms as f64 / w.time_scale / 1000.0,
                    b.count
                )
            })
            .collect();
        println!("DBG censored bins: {}", cens.join(" "));
    }
    if std::env::var("DBG").is_ok() && s.auto() {
        use polygw_core::latency::LatencySketch;
        let q = 1.0 - f64::from(s.budget_pct) / 100.0;
        let (mut all, mut surv) = (LatencySketch::new(), LatencySketch::new());
        let (mut n_cancel_nochunk, mut n_cancel_chunk, mut n_done) = (0, 0, 0);
        for m in host.mocks() {
            for r in m.requests().iter().filter(measured) {
                let Some(b) = &r.behavior else { continue };
                let ttft = Duration::from_secs_f64(b.ttft_ms / 1000.0);
                let end = r
                    .ended_at
                    .map(|e| e.duration_since(r.arrived_at))
                    .unwrap_or_default();
                if r.end == EndKind::Completed {
                    all.observe(ttft);
                    surv.observe(ttft);
                    n_done += 1;
                } else if r.chunks_sent > 0 {
                    all.observe(ttft);
                    n_cancel_chunk += 1;
                } else {
                    all.censor(end);
                    n_cancel_nochunk += 1;
                }
            }
        }
        let f = |x: &LatencySketch| {
            x.quantile(q)
                .map_or(f64::NAN, |d| d.as_secs_f64() / w.time_scale)
        };
        println!("DBG KM all legs {:.2} | completed only {:.2} | completed {} cancelled-after-chunk {} cancelled-before {}", f(&all), f(&surv), n_done, n_cancel_chunk, n_cancel_nochunk);
    }
    if s.auto() && !drawn_ttft.is_empty() {
        drawn_ttft.sort_by(f64::total_cmp);
        o.ttft_target = Some(pct(&drawn_ttft, 1.0 - f64::from(s.budget_pct) / 100.0));
    }
    o.cpu = match (cpu0, cpu_time(None)) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => Duration::ZERO,
    };
    tokio::task::spawn_blocking(move || host.shutdown())
        .await
        .expect("mock shutdown");
    o.latency_ms.sort_by(f64::total_cmp);
    o.late_ms.sort_by(f64::total_cmp);
    o
}

// === Printing ===

/// Seconds, with a precision that suits their size.
fn fmt_s(s: f64) -> String {
    if !s.is_finite() {
        "-".into()
    } else if s < 10.0 {
        format!("{s:.2}")
    } else {
        format!("{s:.1}")
    }
}

/// A signed difference in seconds.
fn fmt_delta(d: f64) -> String {
    if d < 0.0 {
        format!("−{}", fmt_s(-d))
    } else {
        format!("+{}", fmt_s(d))
    }
}

/// A threshold in force in seconds of the unscaled workload, and its origin.
fn fmt_threshold(t: &ThresholdInForce, scale: f64) -> String {
    let origin = match t.origin {
        ThresholdOrigin::Off => "off",
        ThresholdOrigin::Configured => "configured",
        ThresholdOrigin::Source => "source",
        ThresholdOrigin::Pooled => "pooled",
        ThresholdOrigin::NotYet => "not yet",
        ThresholdOrigin::Prior => "prior",
    };
    match t.value {
        Some(v) => format!("{} s ({origin})", fmt_s(v.as_secs_f64() / scale)),
        None => format!("- ({origin})"),
    }
}

fn header() {
    println!(
        "  {:<24} {:>5} {:>4} {:>7} {:>7} {:>7} {:>6} {:>7} {:>7} {:>7} {:>9} {:>9} {:>6} {:>6}",
        "setting (after / stall)",
        "ok",
        "fail",
        "p50 s",
        "p99 s",
        "p99.9 s",
        "p99×",
        "extra",
        "tokens+",
        "hedged",
        "ft/stall",
        "late p99",
        "wall s",
        "cpu s"
    );
}

fn row(s: &Setting, o: &Outcome, off: Option<&Outcome>, scale: f64) {
    let ratio = off.map_or(f64::NAN, |off| o.p(0.99, scale) / off.p(0.99, scale));
    println!(
        "  {:<24} {:>5} {:>4} {:>7} {:>7} {:>7} {:>6.2} {:>6.1}% {:>6.1}% {:>6.1}% {:>9} {:>6.1} ms {:>6.1} {:>6.1}",
        s.name,
        o.latency_ms.len(),
        o.failures.len(),
        fmt_s(o.p(0.5, scale)),
        fmt_s(o.p(0.99, scale)),
        fmt_s(o.p(0.999, scale)),
        ratio,
        o.extra_req(),
        o.extra_tok(),
        o.hedged_calls as f64 / o.calls.max(1) as f64 * 100.0,
        // First-token legs (fresh) / stall legs (prefill continuations).
        format!("{}/{}", o.hedges.saturating_sub(o.resumes), o.resumes),
        if o.late_ms.is_empty() {
            f64::NAN
        } else {
            pct(&o.late_ms, 0.99)
        },
        o.wall.as_secs_f64(),
        o.cpu.as_secs_f64(),
    );
    if o.cold.calls > 0 {
        let c = &o.cold;
        let p = |q| {
            if c.latency_ms.is_empty() {
                f64::NAN
            } else {
                pct(&c.latency_ms, q) / scale / 1000.0
            }
        };
        println!(
            "      cold start (first {} calls of a fresh process): p50 {} s, p99 {} s, extra requests {:.1}%{}",
            c.calls,
            fmt_s(p(0.5)),
            fmt_s(p(0.99)),
            c.extra_attempts as f64 / c.calls.max(1) as f64 * 100.0,
            if c.failures > 0 {
                format!(", {} failed", c.failures)
            } else {
                String::new()
            }
        );
    }
    if let Some(t) = &o.thresholds {
        let parts: Vec<String> = t
            .iter()
            .map(|(src, t)| {
                format!(
                    "{src}: first token {}, stall {}",
                    fmt_threshold(&t.after, scale),
                    fmt_threshold(&t.stall_after, scale)
                )
            })
            .collect();
        println!("      in force at the end: {}", parts.join("; "));
    }
    if let Some((a, st)) = o.during {
        println!(
            "      in force during the run (median of every source's readings): first token {} s, stall {} s; \
             the upstreams' TTFT draws have their p{} at {} s",
            fmt_s(a),
            fmt_s(st),
            100 - s.budget_pct,
            o.ttft_target.map_or("-".into(), fmt_s)
        );
    }
    for f in o.failures.iter().take(3) {
        println!("      failure: {f}");
    }
}

/// Consistency checks of one config against its workload's `off`; false on a mismatch.
fn check(s: &Setting, o: &Outcome, off: Option<&Outcome>, full: bool) -> bool {
    let mut ok = o.failures.is_empty();
    // A leg cancelled before its request left is an attempt no upstream saw; the
    // reverse cannot happen.
    if o.upstream_requests as u64 > o.attempts {
        println!(
            "      mismatch: upstreams saw {} requests, the client reports {} attempts",
            o.upstream_requests, o.attempts
        );
        ok = false;
    }
    if (!s.hedging() && o.hedges > 0) || (full && s.auto() && o.hedges == 0) {
        println!("      unexpected: {} hedges with {}", o.hedges, s.name);
        ok = false;
    }
    if !s.resume && o.resumes > 0 {
        println!("      unexpected: {} resumes with resume off", o.resumes);
        ok = false;
    }
    if let Some(off) = off {
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
    ok
}

/// One verdict of the comparison: `auto` at a budget against the best static setting
/// that spends no more extra requests.
struct Verdict {
    workload: &'static str,
    auto: String,
    auto_extra: f64,
    auto_p99: f64,
    best: String,
    best_extra: f64,
    best_p99: f64,
    off_p99: f64,
}

impl Verdict {
    /// `auto`'s p99 reduction as a share of the best static one (1 when neither cuts).
    fn share(&self) -> f64 {
        let (a, s) = (self.off_p99 - self.auto_p99, self.off_p99 - self.best_p99);
        if s <= 0.0 {
            if a >= 0.0 {
                1.0
            } else {
                0.0
            }
        } else {
            a / s
        }
    }

    fn met(&self) -> bool {
        self.share() >= TARGET
    }
}

/// The static frontier (best p99 at each extra-request level) and the verdicts.
fn compare(w: &Workload, runs: &[(Setting, Outcome)]) -> Vec<Verdict> {
    let scale = w.time_scale;
    let Some((_, off)) = runs.iter().find(|(s, _)| s.is_off()) else {
        return Vec::new();
    };
    if !runs.iter().any(|(s, _)| s.role == Role::Auto) {
        return Vec::new();
    }
    let mut statics: Vec<(&Setting, &Outcome)> = runs
        .iter()
        .filter(|(s, _)| s.is_static())
        .map(|(s, o)| (s, o))
        .collect();
    statics.sort_by(|a, b| a.1.extra_req().total_cmp(&b.1.extra_req()));
    println!("\n  static frontier (the best p99 at each extra-request level):");
    let mut best = f64::INFINITY;
    for (s, o) in &statics {
        let p99 = o.p(0.99, scale);
        if p99 < best {
            best = p99;
            println!(
                "    {:>6.1} % extra → p99 {:>6} s ({:.2}× off)  {}",
                o.extra_req(),
                fmt_s(p99),
                p99 / off.p(0.99, scale),
                s.name
            );
        }
    }
    let mut verdicts = Vec::new();
    for (s, o) in runs.iter().filter(|(s, _)| s.role == Role::Auto) {
        let Some((bs, bo)) = statics
            .iter()
            .filter(|(_, so)| so.extra_req() <= o.extra_req())
            .min_by(|a, b| a.1.p(0.99, scale).total_cmp(&b.1.p(0.99, scale)))
        else {
            continue;
        };
        let v = Verdict {
            workload: w.profile,
            auto: s.name.clone(),
            auto_extra: o.extra_req(),
            auto_p99: o.p(0.99, scale),
            best: bs.name.clone(),
            best_extra: bo.extra_req(),
            best_p99: bo.p(0.99, scale),
            off_p99: off.p(0.99, scale),
        };
        println!(
            "  {}: {:.1} % extra, p99 {} s ({} s) | best static at ≤ {:.1} %: {} — {:.1} %, p99 {} s ({} s) | {:.0} % of its reduction: {}",
            v.auto,
            v.auto_extra,
            fmt_s(v.auto_p99),
            fmt_delta(v.auto_p99 - v.off_p99),
            v.auto_extra,
            v.best,
            v.best_extra,
            fmt_s(v.best_p99),
            fmt_delta(v.best_p99 - v.off_p99),
            v.share() * 100.0,
            if v.met() { "met" } else { "NOT met" }
        );
        verdicts.push(v);
    }
    verdicts
}

/// Seconds into a run and every source's thresholds then.
type ThresholdSample = (f64, Vec<(String, Thresholds)>);
fn run_workload(
    rt: &tokio::runtime::Runtime,
    w: &Workload,
    settings: &[Setting],
    calls: usize,
    warmup: usize,
    coalesced: bool,
    full: bool,
) -> (Vec<Verdict>, bool) {
    let started = std::time::Instant::now();
    println!(
        "\n== workload {} ({}) — time scale {} (1 s → {} ms), chunks coalesced {}:1, {} callers, {} configs; load average {}",
        w.profile,
        w.about,
        w.time_scale,
        1000.0 * w.time_scale,
        if coalesced { w.coalesce } else { 1 },
        w.concurrency,
        settings.len(),
        loadavg()
    );
    println!(
        "  latency in seconds of the unscaled workload; p99× = p99 ÷ off's; extra = upstream requests beyond one per call; \
         tokens+ = completion tokens sent beyond the answers'; ft/stall = first-token legs / stall (resume) legs"
    );
    header();
    let mut runs: Vec<(Setting, Outcome)> = Vec::new();
    let mut ok = true;
    for s in settings {
        let o = rt.block_on(run_config(w, s, calls, warmup, coalesced));
        let off = runs.iter().find(|(s, _)| s.is_off()).map(|(_, o)| o);
        row(s, &o, if s.is_off() { Some(&o) } else { off }, w.time_scale);
        ok &= check(s, &o, off, full);
        runs.push((s.clone(), o));
    }
    let verdicts = compare(w, &runs);
    println!(
        "  ({} took {:.0} s; load average {})",
        w.profile,
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    (verdicts, ok)
}

// === The shifting workload ===

/// When the slowdown happens, in seconds of the unscaled workload.
#[derive(Clone, Copy)]
struct ShiftPlan {
    total_s: f64,
    slow_from_s: f64,
    slow_for_s: f64,
    bucket_s: f64,
    /// Slowdown factor of source 0.
    factor: f64,
}

async fn run_shift(w: &Workload, plan: ShiftPlan, coalesced: bool) -> bool {
    let scale = w.time_scale;
    let real = move |s: f64| Duration::from_secs_f64(s * scale);
    let setting = Setting::new(Th::Auto, Th::Auto, 10, Role::Auto);
    // Enough log for the whole run: ≈ 20 calls per second of the workload.
    let cfgs = mock_configs(w, coalesced, (plan.total_s * 200.0) as usize + 10_000);
    let host = Arc::new(
        tokio::task::spawn_blocking(move || MockHost::start(cfgs))
            .await
            .expect("mock host"),
    );
    let scope = "HEDGE_BENCH";
    let client = GatewayClient::from_vars(vars(scope, &host.urls(), w, &setting), scope)
        .await
        .expect("client");
    let t0 = Instant::now();
    let std0 = std::time::Instant::now();
    // Source 0 slows down ×factor (every duration of its profile), then recovers; fresh
    // seeds so that it does not replay its earlier draws.
    let shifter = {
        let host = host.clone();
        let (w, plan) = (*w, plan);
        tokio::spawn(async move {
            tokio::time::sleep_until(t0 + real(plan.slow_from_s)).await;
            let mut slow = profile(&w, SEED + 100, coalesced);
            slow.time_scale *= plan.factor;
            host.mocks()[0].set_profile(slow);
            tokio::time::sleep_until(t0 + real(plan.slow_from_s + plan.slow_for_s)).await;
            host.mocks()[0].set_profile(profile(&w, SEED + 200, coalesced));
        })
    };
    // The thresholds in force, sampled every 5 s of the workload.
    let samples: Arc<Mutex<Vec<ThresholdSample>>> = Arc::default();
    let sampler = {
        let (client, samples) = (client.clone(), samples.clone());
        tokio::spawn(async move {
            let mut k = 0u32;
            loop {
                k += 1;
                let at = 5.0 * f64::from(k);
                if at > plan.total_s {
                    return;
                }
                tokio::time::sleep_until(t0 + real(at)).await;
                let t = client.hedge_thresholds(true);
                samples
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((at, t));
            }
        })
    };
    let recs = drive(
        &client,
        w.concurrency,
        Stop::Until(t0 + real(plan.total_s)),
        "Question",
        t0,
    )
    .await;
    shifter.await.expect("shifter");
    sampler.await.expect("sampler");
    client.shutdown().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Upstream requests by arrival time (seconds of the workload).
    let mut arrivals: Vec<f64> = Vec::new();
    let mut late: Vec<f64> = Vec::new();
    for m in host.mocks() {
        for r in m.requests() {
            arrivals.push(r.arrived_at.duration_since(std0).as_secs_f64() / scale);
            if let (EndKind::Completed, Some(b), Some(end)) = (r.end, &r.behavior, r.ended_at) {
                late.push(end.duration_since(r.arrived_at).as_secs_f64() * 1e3 - planned_ms(b));
            }
        }
    }
    late.sort_by(f64::total_cmp);
    let failures: Vec<&String> = recs
        .iter()
        .filter_map(|r| r.result.as_ref().err())
        .collect();
    let samples = samples.lock().unwrap_or_else(|e| e.into_inner()).clone();
    println!(
        "  {} calls ({} failed); simulator fidelity: completed upstream answers ended {:.1} ms (p50) / {:.1} ms (p99) after plan",
        recs.len(),
        failures.len(),
        if late.is_empty() { f64::NAN } else { pct(&late, 0.5) },
        if late.is_empty() { f64::NAN } else { pct(&late, 0.99) },
    );
    for f in failures.iter().take(3) {
        println!("      failure: {f}");
    }
    let names: Vec<String> = samples
        .first()
        .map(|(_, t)| t.iter().map(|(n, _)| n.clone()).collect())
        .unwrap_or_default();
    println!(
        "  {:>11} {:>5} {:>6} {:>6} {:>6} {:>6}  {:<38} {:<38}",
        "t (s)",
        "calls",
        "p50 s",
        "p99 s",
        "hedged",
        "extra",
        format!(
            "{} (slowed) first token / stall",
            names.first().map_or("", |n| n.as_str())
        ),
        format!(
            "{} first token / stall",
            names.get(1).map_or("", |n| n.as_str())
        ),
    );
    let buckets = (plan.total_s / plan.bucket_s).ceil() as usize;
    for b in 0..buckets {
        let (lo, hi) = (b as f64 * plan.bucket_s, (b + 1) as f64 * plan.bucket_s);
        let inside = |t: f64| t >= lo && t < hi;
        let mut lat: Vec<f64> = Vec::new();
        let (mut calls, mut hedged) = (0usize, 0usize);
        for r in &recs {
            if !inside(r.start.as_secs_f64() / scale) {
                continue;
            }
            calls += 1;
            if let Ok(a) = &r.result {
                lat.push(r.ms / scale / 1000.0);
                hedged += usize::from(a.hedges > 0);
            }
        }
        lat.sort_by(f64::total_cmp);
        let reqs = arrivals.iter().filter(|t| inside(**t)).count();
        let at_end = samples
            .iter()
            .rev()
            .find(|(t, _)| *t <= hi + 1e-9 && *t > lo);
        let show = |i: usize| {
            at_end
                .and_then(|(_, t)| t.get(i))
                .map_or("-".to_string(), |(_, t)| {
                    format!(
                        "{} / {}",
                        fmt_threshold(&t.after, scale),
                        fmt_threshold(&t.stall_after, scale)
                    )
                })
        };
        let slow = lo < plan.slow_from_s + plan.slow_for_s && hi > plan.slow_from_s;
        println!(
            "  {:>5}–{:<5} {:>5} {:>6} {:>6} {:>5.1}% {:>5.1}%  {:<38} {:<38}{}",
            lo,
            hi,
            calls,
            if lat.is_empty() {
                "-".into()
            } else {
                fmt_s(pct(&lat, 0.5))
            },
            if lat.is_empty() {
                "-".into()
            } else {
                fmt_s(pct(&lat, 0.99))
            },
            hedged as f64 / calls.max(1) as f64 * 100.0,
            (reqs as f64 - calls as f64) / calls.max(1) as f64 * 100.0,
            show(0),
            show(1),
            if slow { "  ← source 0 slowed" } else { "" }
        );
    }
    // How fast the slowed source's first-token threshold followed: its value before, its
    // peak, and when it came back within 10 % of its value before.
    let after0 = |t: &(f64, Vec<(String, Thresholds)>)| {
        t.1.first()
            .and_then(|(_, t)| t.after.value)
            .map(|v| v.as_secs_f64() / scale)
    };
    let before: Vec<f64> = samples
        .iter()
        .filter(|s| s.0 > plan.slow_from_s - 120.0 && s.0 <= plan.slow_from_s)
        .filter_map(after0)
        .collect();
    if let Some(&base) = before.last() {
        let end = plan.slow_from_s + plan.slow_for_s;
        let during: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.0 > plan.slow_from_s)
            .filter_map(|s| after0(s).map(|v| (s.0, v)))
            .collect();
        let peak = during
            .iter()
            .copied()
            .fold((0.0, 0.0), |m, x| if x.1 > m.1 { x } else { m });
        let rose = during.iter().find(|(_, v)| *v > base * 1.1).map(|x| x.0);
        let back = during
            .iter()
            .filter(|(t, _)| *t > peak.0.max(end))
            .find(|(_, v)| *v <= base * 1.1)
            .map(|x| x.0);
        println!(
            "  source 0's first-token threshold: {} s before the slowdown; above +10 % from t = {} s; peak {} s at t = {} s; back within 10 % at t = {} (window {} s: samples leave 0.9–1 window after they came)",
            fmt_s(base),
            rose.map_or("-".into(), |t| format!("{t}")),
            fmt_s(peak.1),
            peak.0,
            back.map_or("never in the run".into(), |t| format!("{t} s, {:.0} s after the slowdown ended", t - end)),
            600
        );
    }
    let host = Arc::try_unwrap(host).unwrap_or_else(|_| panic!("mock host still shared"));
    tokio::task::spawn_blocking(move || host.shutdown())
        .await
        .expect("mock shutdown");
    failures.is_empty()
}

// === main ===

fn env_usize(key: &str) -> Option<usize> {
    std::env::var(key).ok().and_then(|v| v.parse().ok())
}

fn main() {
    let full = full_run();
    let coalesced = std::env::var("POLYGW_BENCH_HEDGE_PROFILE").as_deref() != Ok("full");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let started = std::time::Instant::now();
    let mut ok = true;
    if std::env::var("POLYGW_BENCH_HEDGE_SUITE").as_deref() == Ok("resume") {
        let calls = env_usize("POLYGW_BENCH_HEDGE_CALLS").unwrap_or(if full { 8000 } else { 100 });
        let (w, settings) = resume_suite();
        println!(
            "hedging: restart vs resume on the long tail, budget 30 %, {calls} streamed calls per config, \
             {SOURCES} prefill-capable sources, seeds {SEED}..{}",
            SEED + SOURCES as u64 - 1
        );
        ok &= run_workload(&rt, &w, &settings, calls, 0, coalesced, full).1;
    } else {
        let calls = env_usize("POLYGW_BENCH_HEDGE_CALLS").unwrap_or(if full { 3000 } else { 60 });
        let warmup = env_usize("POLYGW_BENCH_HEDGE_WARMUP").unwrap_or(if full { 300 } else { 60 });
        let only = std::env::var("POLYGW_BENCH_HEDGE_WORKLOADS").ok();
        let wanted = |name: &str| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|x| x.trim() == name))
        };
        println!(
            "hedging: auto (SPEC §19) against a static grid, {calls} measured streamed calls per config \
             ({warmup} warm-up calls before each auto config), {SOURCES} prefill-capable sources, seeds {SEED}..{}, \
             MAX_EXTRA {MAX_EXTRA} and resume on everywhere, static points uncapped (BUDGET_PCT 0); \
             auto's window and bounds scaled with the workload; load average {}",
            SEED + SOURCES as u64 - 1,
            loadavg()
        );
        let mut verdicts = Vec::new();
        let smoke = !full;
        let pick = std::env::var("POLYGW_BENCH_HEDGE_SETTINGS").ok();
        for (w, settings) in [
            (LONG_TAIL, long_tail_settings(smoke)),
            (FAST_CHAT, fast_chat_settings(smoke)),
            (REASONING, reasoning_settings(smoke)),
        ] {
            if !wanted(w.profile) {
                continue;
            }
            // A subset of the settings (`off` always runs: the reference of the others).
            let settings: Vec<Setting> = settings
                .into_iter()
                .filter(|s| {
                    s.is_off()
                        || pick
                            .as_deref()
                            .is_none_or(|p| p.split(',').any(|x| s.name.contains(x.trim())))
                })
                .collect();
            let (v, good) = run_workload(&rt, &w, &settings, calls, warmup, coalesced, full);
            verdicts.extend(v);
            ok &= good;
        }
        if wanted("shift") {
            let plan = if full {
                ShiftPlan {
                    total_s: 1200.0,
                    slow_from_s: 300.0,
                    slow_for_s: 60.0,
                    bucket_s: 30.0,
                    factor: 5.0,
                }
            } else {
                ShiftPlan {
                    total_s: 120.0,
                    slow_from_s: 30.0,
                    slow_for_s: 30.0,
                    bucket_s: 15.0,
                    factor: 5.0,
                }
            };
            let t = std::time::Instant::now();
            println!(
                "\n== shifting workload: fast-chat, auto at budget 10 %, window 600 s; source 0 slows down ×{} (every duration) \
                 from t = {} s to {} s; {} s in all, buckets of {} s (by call start), seconds of the unscaled workload; load average {}",
                plan.factor,
                plan.slow_from_s,
                plan.slow_from_s + plan.slow_for_s,
                plan.total_s,
                plan.bucket_s,
                loadavg()
            );
            ok &= rt.block_on(run_shift(&FAST_CHAT, plan, coalesced));
            println!("  (the shift took {:.0} s)", t.elapsed().as_secs_f64());
        }
        if !verdicts.is_empty() {
            println!(
                "\ntargets: auto's p99 reduction ≥ {:.0} % of the best static one at no more extra requests",
                TARGET * 100.0
            );
            for v in &verdicts {
                println!(
                    "  {:<10} {:<18} {:>5.1} % extra, p99 {:>6} s | best static ≤ that: {:<28} {:>5.1} %, p99 {:>6} s | off {:>6} s | {:>4.0} % → {}",
                    v.workload,
                    v.auto,
                    v.auto_extra,
                    fmt_s(v.auto_p99),
                    v.best,
                    v.best_extra,
                    fmt_s(v.best_p99),
                    fmt_s(v.off_p99),
                    v.share() * 100.0,
                    if v.met() { "met" } else { "NOT met" }
                );
            }
        }
    }
    println!(
        "\nhedging benchmark: {:.0} s in all; load average {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    if !ok {
        eprintln!("hedging benchmark: failures or inconsistent counts (see above)");
        std::process::exit(1);
    }
}
