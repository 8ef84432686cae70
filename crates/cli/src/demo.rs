//! `polygw demo`: the main job on embedded defaults. Starts simulated upstreams with the
//! reference long-tail profile (SPEC §12, time scaled) in-process, runs the same
//! workload with hedging off and on, writes telemetry to a local SQLite file, and
//! prints a side-by-side table. No network, no configuration, well under a minute.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use futures_util::stream::{self, StreamExt};
use indicatif::{ProgressBar, ProgressStyle};
use polygw::core::telemetry::RowKind;
use polygw::core::TelemetryRow;
use polygw::{ChatRequest, GatewayClient, LlmResponse, UsageSource};
use polygw_mock_upstream::{LongTail, MockConfig, MockUpstream, PairedDraws, Profile, ProfileKind};

use crate::table::{money, ms, pct, quantile, Table};

/// Arguments of `polygw demo` (every one has a default).
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Streamed calls per run (one run with hedging off, one with it on).
    #[arg(long, default_value_t = 300)]
    pub calls: usize,
    /// Calls each run makes first, left out of the table and the telemetry figures: `auto`
    /// thresholds start from their priors and have learned each source's latency once it
    /// has 4 × `HEDGE__MIN_SAMPLES` (200) legs of evidence, so the table shows both runs
    /// in their steady state.
    #[arg(long, default_value_t = 600)]
    pub warmup: usize,
    /// Concurrent callers.
    #[arg(long, default_value_t = 24)]
    pub concurrency: usize,
    /// Simulated upstreams.
    #[arg(long, default_value_t = 3)]
    pub sources: usize,
    /// Time scale of the long-tail profile (0.01: one real second lasts 10 ms).
    #[arg(long, default_value_t = 0.01)]
    pub time_scale: f64,
    /// Seed of the simulated upstreams (the same seed replays the same workload).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Where the telemetry goes (an SQLite file, replaced if it exists).
    #[arg(long, default_value = "polygw-demo.db")]
    pub db: PathBuf,
}

/// The outcome of one run.
struct Run {
    scope: &'static str,
    responses: Vec<LlmResponse>,
    failures: usize,
    rows: Vec<TelemetryRow>,
    /// The hedge thresholds in force per source at the end (streamed calls).
    thresholds: Vec<(String, polygw::core::hedge::Thresholds)>,
}

fn scaled(s: f64, scale: f64) -> String {
    format!("{}", s * scale)
}

/// The hedging-on column sets no hedge key: it runs the defaults (SPEC §19.3: both
/// triggers `auto`, budget 10 %, burst 3, resume `auto`). Only the defaults' own times
/// are scaled with the simulation — the `auto` thresholds' bounds, priors and decay window, in
/// real seconds here (unscaled, a 0.5 s bound would be 50 s of the simulated workload).
const AUTO_TIMES: [(&str, f64); 7] = [
    ("HEDGE__MIN_S", 0.5),
    ("HEDGE__MAX_S", 60.0),
    ("HEDGE__STALL_MIN_S", 1.0),
    ("HEDGE__STALL_MAX_S", 60.0),
    ("HEDGE__WINDOW_S", 600.0),
    ("HEDGE__AFTER_PRIOR_S", 15.0),
    ("HEDGE__STALL_PRIOR_S", 10.0),
];

/// The environment-style configuration of one run: the same keys a user would set.
fn vars(
    scope: &str,
    urls: &[String],
    scale: f64,
    db_url: &str,
    hedged: bool,
) -> Vec<(String, String)> {
    let mut v = Vec::new();
    let mut set = |k: String, x: String| v.push((k, x));
    for (i, url) in urls.iter().enumerate() {
        let p = format!("{scope}__SIM__{i}");
        set(format!("{p}__BASE_URL"), url.clone());
        set(format!("{p}__API_KEY"), String::new());
        set(format!("{p}__MODEL"), "sim-long-tail".into());
        set(format!("{p}__INPUT_PRICE"), "0.27".into());
        set(format!("{p}__OUTPUT_PRICE"), "1.10".into());
        set(format!("{p}__TIMEOUT_S"), scaled(600.0, scale));
    }
    set(format!("{scope}__TELEMETRY__URL"), db_url.to_string());
    // Metering threshold of one real second.
    set(
        format!("{scope}__STREAM__STALL_THRESHOLD_MS"),
        format!("{}", (1000.0 * scale).max(1.0) as u64),
    );
    set(
        format!("{scope}__RETRY__BACKOFF_BASE_S"),
        scaled(0.5, scale),
    );
    set(format!("{scope}__RETRY__BACKOFF_MAX_S"), scaled(8.0, scale));
    // The simulated upstreams continue an assistant prefill, as most providers do in
    // one dialect or another: a resume continues the answer instead of restarting it.
    for i in 0..urls.len() {
        set(format!("{scope}__SIM__{i}__PREFILL"), "assistant".into());
    }
    if hedged {
        for (k, x) in AUTO_TIMES {
            // The decay window has a floor of 10 s (ten slots of a second).
            let x = if k == "HEDGE__WINDOW_S" {
                (x * scale).max(10.0)
            } else {
                x * scale
            };
            set(format!("{scope}__{k}"), format!("{x}"));
        }
    } else {
        set(format!("{scope}__HEDGE__AFTER_S"), "off".into());
        set(format!("{scope}__HEDGE__STALL_AFTER_S"), "off".into());
        set(format!("{scope}__STREAM__RESUME"), "off".into());
    }
    v
}

/// The reference long-tail shape (SPEC §12) with its chunks coalesced five to one
/// (10–80 chunks, mean gap 150 ms instead of 50–400 and 30 ms): the same TTFT, stall
/// and generation-time distributions, a fifth of the frames, so the simulation stays
/// light on a small machine and the figures measure the gateway, not the simulator.
pub fn demo_profile(scale: f64, seed: u64) -> Profile {
    Profile {
        name: "long-tail (demo: 5:1 coalesced chunks)".into(),
        time_scale: scale,
        seed,
        kind: ProfileKind::LongTail(LongTail {
            chunks_min: 10,
            chunks_max: 80,
            gap_mean_ms: 150.0,
            // One answer length per question on every upstream, as one model would
            // give: a resume on another upstream ends the same answer.
            length_by_request: true,
            ..LongTail::default()
        }),
    }
}

/// `n` simulated upstreams sharing one set of draws keyed by question (DECISIONS 167):
/// the `k`-th request of a question plays the same behavior in both runs, whichever
/// upstream gets it and whenever it arrives, so the runs are compared call by call.
async fn start_mocks(n: usize, scale: f64, seed: u64) -> Result<Vec<MockUpstream>> {
    let mut mocks = Vec::new();
    let draws = PairedDraws::new(seed);
    for i in 0..n {
        let profile = demo_profile(scale, seed.wrapping_add(i as u64));
        let mock = MockUpstream::start(MockConfig {
            record_bodies: false,
            paired: Some(draws.clone()),
            ..MockConfig::with_profile(profile)
        })
        .await
        .context("starting a simulated upstream on 127.0.0.1")?;
        mocks.push(mock);
    }
    Ok(mocks)
}

/// `n` streamed calls `"{tag} {i}: …"`, `concurrency` at a time, each counted on `bar`.
async fn ask(
    client: &GatewayClient,
    tag: &str,
    n: usize,
    concurrency: usize,
    bar: Option<&ProgressBar>,
) -> Vec<Result<LlmResponse, polygw::GatewayError>> {
    stream::iter(0..n)
        .map(|i| {
            let c = client.clone();
            let bar = bar.cloned();
            async move {
                let r = c
                    .chat(
                        ChatRequest::user(format!("{tag} {i}: tell me something."))
                            .with_stream(true),
                    )
                    .await;
                if let Some(bar) = bar {
                    bar.inc(1);
                }
                r
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await
}

async fn run_once(
    args: &DemoArgs,
    scope: &'static str,
    hedged: bool,
    db_url: &str,
    bar: &ProgressBar,
) -> Result<Run> {
    // Fresh upstreams with the same draws: both runs face the same legs per question.
    let mocks = start_mocks(args.sources, args.time_scale, args.seed).await?;
    let urls: Vec<String> = mocks.iter().map(|m| m.base_url()).collect();
    let client =
        GatewayClient::from_vars(vars(scope, &urls, args.time_scale, db_url, hedged), scope)
            .await
            .with_context(|| format!("building the {scope} client"))?;
    // The warm-up: other questions (so the measured ones face the same draws in both
    // runs), the same concurrency; its calls count nowhere below.
    let warm = ask(&client, "Warm-up", args.warmup, args.concurrency, None).await;
    if let Some(Err(e)) = warm.iter().find(|r| r.is_err()) {
        bar.println(format!("{scope}: a warm-up call failed: {e}"));
    }
    let results = ask(&client, "Question", args.calls, args.concurrency, Some(bar)).await;
    let thresholds = client.hedge_thresholds(true);
    let report = client.shutdown().await;
    for m in mocks {
        m.shutdown().await;
    }
    let mut responses = Vec::new();
    let mut failures = 0;
    // The measured calls, whose rows the figures read.
    let mut measured = std::collections::HashSet::new();
    for r in results {
        match r {
            Ok(x) => {
                measured.insert(x.logical_call_id.clone());
                responses.push(x);
            }
            Err(e) => {
                failures += 1;
                if let Some(c) = e.context() {
                    measured.insert(c.logical_call_id.clone());
                }
                bar.println(format!("{scope}: call failed: {e}"));
            }
        }
    }
    if report.dropped > 0 {
        bar.println(format!(
            "{scope}: {} telemetry rows dropped",
            report.dropped
        ));
    }
    let rows = polygw::telemetry::read_rows(db_url, None)
        .await
        .context("reading the telemetry back")?
        .into_iter()
        .filter(|r| *r.scope == *scope && measured.contains(&r.logical_call_id))
        .collect();
    Ok(Run {
        scope,
        responses,
        failures,
        rows,
        thresholds,
    })
}

struct Figures {
    ok: String,
    p50: String,
    p95: String,
    p99: String,
    extra: String,
    hedges: String,
    resumes: String,
    stall_share: String,
    tokens: String,
    cost: String,
    gap: String,
    rows: usize,
}

fn figures(run: &Run, calls: usize) -> Figures {
    let lat: Vec<f64> = run
        .responses
        .iter()
        .map(|r| r.call_stats.total_latency_ms as f64)
        .collect();
    let attempts: u64 = run
        .rows
        .iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .count() as u64;
    let hedges: u64 = run
        .responses
        .iter()
        .map(|r| r.call_stats.hedges as u64)
        .sum();
    let resumes: u64 = run
        .responses
        .iter()
        .map(|r| r.call_stats.resumes as u64)
        .sum();
    let wins = run
        .responses
        .iter()
        .filter(|r| r.call_stats.hedge_won)
        .count();
    let (stall, wall) = run.responses.iter().fold((0u64, 0u64), |(s, w), r| {
        let st = r.call_stats.stall_ms.unwrap_or(0);
        (s + st, w + r.call_stats.generation_ms + st)
    });
    let known: Vec<f64> = run.rows.iter().filter_map(|r| r.cost).collect();
    let unknown_cost = run
        .rows
        .iter()
        .filter(|r| r.kind == RowKind::Attempt && r.cost.is_none())
        .count();
    let tokens: u64 = run
        .rows
        .iter()
        .map(|r| r.prompt_tokens.unwrap_or(0) + r.completion_tokens.unwrap_or(0))
        .sum();
    let gap = run
        .rows
        .iter()
        .filter(|r| {
            r.kind == RowKind::Attempt && r.usage_source == UsageSource::Unavailable && !r.cache_hit
        })
        .count();
    Figures {
        ok: format!("{}/{}", run.responses.len(), calls),
        p50: ms(quantile(&lat, 0.50)),
        p95: ms(quantile(&lat, 0.95)),
        p99: ms(quantile(&lat, 0.99)),
        extra: pct(Some(
            (attempts as f64 - calls as f64).max(0.0) / calls.max(1) as f64,
        )),
        hedges: format!("{hedges} / {wins}"),
        resumes: resumes.to_string(),
        stall_share: pct((wall > 0).then(|| stall as f64 / wall as f64)),
        tokens: tokens.to_string(),
        cost: format!(
            "{}{}",
            money(Some(known.iter().sum())),
            if unknown_cost > 0 {
                format!(" (+{unknown_cost} unknown)")
            } else {
                String::new()
            }
        ),
        gap: gap.to_string(),
        rows: run.rows.len(),
    }
}

/// The prompt-cache line: the multi-turn workload with affinity off and at its default.
async fn affinity_line(sources: usize) -> Result<()> {
    let off = crate::demo_affinity::run(sources, Some("off")).await?;
    let on = crate::demo_affinity::run(sources, None).await?;
    if off.failures + on.failures > 0 {
        anyhow::bail!(
            "the prompt-cache workload had {} failed call(s)",
            off.failures + on.failures
        );
    }
    println!("{}", crate::demo_affinity::line(&off, &on));
    Ok(())
}

pub async fn run(args: DemoArgs) -> Result<ExitCode> {
    if !args.time_scale.is_finite() || args.time_scale <= 0.0 || args.time_scale > 1.0 {
        anyhow::bail!(
            "--time-scale {}: expected a number in (0, 1]",
            args.time_scale
        );
    }
    if args.calls == 0 || args.sources < 2 {
        anyhow::bail!("--calls must be ≥ 1 and --sources ≥ 2 (hedging needs another source)");
    }
    for suffix in ["", "-wal", "-shm"] {
        let mut p = args.db.clone().into_os_string();
        p.push(suffix);
        let _ = std::fs::remove_file(&p);
    }
    let db_url = format!("sqlite://{}", args.db.display());
    println!(
        "polygw demo: {} simulated upstreams on 127.0.0.1 (long-tail profile of SPEC §12, 1 s → {} ms), \
         {} streamed calls per run after {} warm-up calls, {} concurrent",
        args.sources,
        1000.0 * args.time_scale,
        args.calls,
        args.warmup,
        args.concurrency
    );
    println!(
        "hedging off: HEDGE__AFTER_S=off HEDGE__STALL_AFTER_S=off STREAM__RESUME=off; \
         hedging on: the defaults (auto thresholds from live latency, budget 10 %, burst 3, \
         resume auto), their bounds and window scaled with the simulation"
    );
    let bar = ProgressBar::new((2 * args.calls) as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} calls · {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.enable_steady_tick(Duration::from_millis(100));
    bar.set_message("hedging off");
    let off = run_once(&args, "HEDGE_OFF", false, &db_url, &bar).await?;
    bar.set_message("hedging on");
    let on = run_once(&args, "HEDGE_ON", true, &db_url, &bar).await?;
    bar.finish_and_clear();

    let a = figures(&off, args.calls);
    let b = figures(&on, args.calls);
    let mut t = Table::new(["", "hedging off", "hedging on"]);
    t.row(["calls ok", a.ok.as_str(), b.ok.as_str()]);
    t.row(["latency p50", &a.p50, &b.p50]);
    t.row(["latency p95", &a.p95, &b.p95]);
    t.row(["latency p99", &a.p99, &b.p99]);
    t.row(["extra upstream requests", &a.extra, &b.extra]);
    t.row(["hedge legs / wins", &a.hedges, &b.hedges]);
    t.row(["of which resumes (prefill)", &a.resumes, &b.resumes]);
    t.row([
        "stall share of winners' time",
        &a.stall_share,
        &b.stall_share,
    ]);
    t.row(["tokens", &a.tokens, &b.tokens]);
    t.row(["cost (0.27/1.10 per 1M)", &a.cost, &b.cost]);
    t.row(["accounting gap (rows)", &a.gap, &b.gap]);
    println!();
    print!("{}", t.render());
    println!();
    println!(
        "Extra upstream requests are hedge legs (a resume continues the answer where a \
         stalled stream stopped, on another upstream); the losers are cancelled, so their \
         usage is unknown: they make the accounting gap and the \"unknown\" costs (an \
         upstream may still bill them)."
    );
    affinity_line(args.sources).await?;
    for (src, t) in &on.thresholds {
        let show = |t: &polygw::core::hedge::ThresholdInForce| match t.value {
            Some(d) => format!("{:.1} s", d.as_secs_f64() / args.time_scale),
            None => "none".to_string(),
        };
        println!(
            "auto thresholds at the end, {src}: first token {} ({:?}), stall {} ({:?}) (real s)",
            show(&t.after),
            t.after.origin,
            show(&t.stall_after),
            t.stall_after.origin
        );
    }
    println!(
        "Latencies are measured at the demo's time scale (×{}); at real scale multiply by {}.",
        args.time_scale,
        1.0 / args.time_scale
    );
    println!(
        "Telemetry: one row per attempt in {} (scopes {} and {}): {} for the calls above, \
         the warm-up's too.",
        args.db.display(),
        off.scope,
        on.scope,
        a.rows + b.rows
    );
    println!("Next: polygw report --db {db_url} --html polygw-demo.html");
    let failed = off.failures + on.failures;
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        eprintln!("{failed} call(s) failed");
        ExitCode::FAILURE
    })
}
