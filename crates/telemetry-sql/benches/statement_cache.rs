//! The SQLite writer's prepared-statement cache (`cargo bench -p polygw-telemetry-sql
//! --bench statement_cache`; hand-written harness). sqlx keeps every statement it prepared
//! in a per-connection cache (up to 100), one per distinct SQL text, and a multi-row
//! INSERT of n rows is a text of its own for every n: a writer that sends batches of
//! every size from 1 to 256 keeps up to 100 large prepared statements alive.
//!
//! Each strategy runs in a child process of its own (this binary again, with
//! `POLYGW_STMT_BENCH=<strategy>`), so that one strategy's heap does not inflate the
//! next one's resident size:
//!
//! - `one-row`: one single-row INSERT per row, cached (one text: the baseline, what the
//!   database itself costs in memory);
//! - `per-size`: one INSERT of all the batch's rows, cached (the writer before the fix);
//! - `unpersisted`: the same INSERT, not cached (`persistent(false)`: prepared and
//!   finalized on every batch);
//! - `pow2`: the batch split into power-of-two INSERTs, cached (at most 9 texts up to 256);
//! - `recorder`: `SqlRecorder` as built (whatever strategy it uses), batches forced to
//!   each size by record-n-then-flush.
//!
//! Workload: batches of every size 1..=256 in a shuffled order, twice (65 792 rows), then
//! full batches of 256 rows (the steady state under load). Reported: resident set growth
//! over the workload (VmRSS after − before, from /proc/self/status) and its peak (VmHWM),
//! and rows per second for the mixed and the full batches.

// Measuring wall time is the point of a benchmark.
#![allow(clippy::disallowed_methods)]

use std::str::FromStr;
use std::time::{Duration, Instant};

use polygw_core::ports::telemetry::TelemetryRecorder;
use polygw_core::{RowKind, TelemetryRow, UsageSource};
use polygw_telemetry_sql::{RecorderConfig, SqlRecorder, COLUMNS};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{ConnectOptions, Connection, SqliteConnection};

const STRATEGIES: [&str; 5] = ["one-row", "per-size", "unpersisted", "pow2", "recorder"];
const ROUNDS: usize = 2;
const FULL_BATCHES: usize = 200;

fn row(i: usize) -> TelemetryRow {
    let mut r = TelemetryRow::new(
        RowKind::Attempt,
        format!("0193a5f0-7c1e-7d2a-9b3c-{i:012}"),
        format!("0193a5f0-7c1e-7d2a-8000-{:012}", i / 2),
        "LLM",
        "chat",
        1_796_211_128_123 + i as i64,
    );
    r.source = Some("deepseek-0".into());
    r.provider = Some("deepseek".into());
    r.model = Some("deepseek-chat".into());
    r.attempt_index = Some((i % 3) as u32);
    r.stream = true;
    r.ok = true;
    r.http_status = Some(200);
    r.prompt_tokens = Some(1200);
    r.completion_tokens = Some(350);
    r.usage_source = UsageSource::Measured;
    r.cost = Some(0.000709);
    r.latency_ms = Some(2300);
    r.ttft_ms = Some(410);
    r.api = Some("chat".into());
    r
}

/// Sizes 1..=256, each `ROUNDS` times, in a fixed pseudo-random order.
fn mixed_sizes() -> Vec<usize> {
    let mut sizes: Vec<usize> = (0..ROUNDS).flat_map(|_| 1..=256).collect();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in (1..sizes.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        sizes.swap(i, (x % (i as u64 + 1)) as usize);
    }
    sizes
}

fn status_kb(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn insert_sql(rows: usize) -> String {
    let one = format!("({})", vec!["?"; COLUMNS.len()].join(", "));
    format!(
        "INSERT INTO llm_calls ({}) VALUES {} ON CONFLICT (call_id) DO NOTHING",
        COLUMNS.join(", "),
        vec![one.as_str(); rows].join(", ")
    )
}

/// One INSERT of `rows`, every column bound (the columns after `created_at` as in the
/// writer: resume and revision-3 columns, NULL but `api`).
async fn insert(c: &mut SqliteConnection, rows: &[TelemetryRow], persistent: bool) {
    let sql = insert_sql(rows.len());
    let mut q = sqlx::query(&sql).persistent(persistent);
    for r in rows {
        q = q
            .bind(r.call_id.as_str())
            .bind(r.logical_call_id.as_str())
            .bind(&*r.scope)
            .bind(&*r.operation)
            .bind(r.kind.as_str())
            .bind(r.source.as_deref())
            .bind(r.provider.as_deref())
            .bind(r.model.as_deref())
            .bind(r.attempt_index.map(i64::from))
            .bind(r.is_hedge)
            .bind(r.stream)
            .bind(r.ok)
            .bind(r.error.as_deref())
            .bind(r.error_detail.as_deref())
            .bind(r.http_status.map(i64::from))
            .bind(r.prompt_tokens.map(|v| v as i64))
            .bind(r.completion_tokens.map(|v| v as i64))
            .bind(r.reasoning_tokens.map(|v| v as i64))
            .bind(r.usage_source.as_str())
            .bind(r.cost)
            .bind(r.latency_ms.map(|v| v as i64))
            .bind(r.ttft_ms.map(|v| v as i64))
            .bind(r.max_inter_token_ms.map(|v| v as i64))
            .bind(r.stall_ms.map(|v| v as i64))
            .bind(r.stall_count.map(i64::from))
            .bind(r.cache_hit)
            .bind(polygw_telemetry_sql::time::format_utc_ms(r.created_at_ms))
            .bind(None::<&str>)
            .bind(None::<&str>)
            .bind(None::<i64>)
            .bind(r.api.as_deref());
        for _ in 31..COLUMNS.len() {
            q = q.bind(None::<i64>);
        }
    }
    q.execute(&mut *c).await.unwrap();
}

async fn write_batch(c: &mut SqliteConnection, strategy: &str, rows: &[TelemetryRow]) {
    let mut tx = c.begin().await.unwrap();
    match strategy {
        "one-row" => {
            for r in rows {
                insert(&mut tx, std::slice::from_ref(r), true).await;
            }
        }
        "per-size" => insert(&mut tx, rows, true).await,
        "unpersisted" => insert(&mut tx, rows, false).await,
        "pow2" => {
            let mut rest = rows;
            while !rest.is_empty() {
                let n = 1 << (usize::BITS - 1 - rest.len().leading_zeros());
                let (chunk, tail) = rest.split_at(n);
                insert(&mut tx, chunk, true).await;
                rest = tail;
            }
        }
        other => panic!("unknown strategy {other}"),
    }
    tx.commit().await.unwrap();
}

struct Measured {
    rss_growth_kb: u64,
    hwm_growth_kb: u64,
    mixed_rows_s: f64,
    full_rows_s: f64,
}

async fn run(strategy: &str, dir: &std::path::Path) -> Measured {
    let url = format!("sqlite://{}", dir.join("stmt.db").display());
    // The schema through the recorder (its migrations).
    SqlRecorder::connect(&url, RecorderConfig::default())
        .await
        .unwrap()
        .shutdown()
        .await;
    let sizes = mixed_sizes();
    let mixed_rows: usize = sizes.iter().sum();
    let mut next = 0usize;
    let mut take = |n: usize| -> Vec<TelemetryRow> {
        let v = (next..next + n).map(row).collect();
        next += n;
        v
    };
    let batches: Vec<Vec<TelemetryRow>> = sizes.iter().map(|&n| take(n)).collect();
    let full: Vec<Vec<TelemetryRow>> = (0..FULL_BATCHES).map(|_| take(256)).collect();

    if strategy == "recorder" {
        let cfg = RecorderConfig {
            queue_capacity: 100_000,
            flush_interval: Duration::from_secs(3600),
            flush_timeout: Duration::from_secs(120),
            ..RecorderConfig::default()
        };
        let rec = SqlRecorder::connect(&url, cfg).await.unwrap();
        let (rss0, hwm0) = (status_kb("VmRSS:"), status_kb("VmHWM:"));
        let t = Instant::now();
        for b in batches {
            for r in b {
                rec.record(r);
            }
            assert_eq!(rec.flush().await.unwrap().pending, 0);
        }
        let mixed = t.elapsed();
        let (rss1, hwm1) = (status_kb("VmRSS:"), status_kb("VmHWM:"));
        let t = Instant::now();
        for b in full {
            for r in b {
                rec.record(r);
            }
            assert_eq!(rec.flush().await.unwrap().pending, 0);
        }
        let full_d = t.elapsed();
        rec.shutdown().await;
        return Measured {
            rss_growth_kb: rss1.saturating_sub(rss0),
            hwm_growth_kb: hwm1.saturating_sub(hwm0),
            mixed_rows_s: mixed_rows as f64 / mixed.as_secs_f64(),
            full_rows_s: (FULL_BATCHES * 256) as f64 / full_d.as_secs_f64(),
        };
    }

    let mut c = SqliteConnectOptions::from_str(&url)
        .unwrap()
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .connect()
        .await
        .unwrap();
    let (rss0, hwm0) = (status_kb("VmRSS:"), status_kb("VmHWM:"));
    let t = Instant::now();
    for b in &batches {
        write_batch(&mut c, strategy, b).await;
    }
    let mixed = t.elapsed();
    let (rss1, hwm1) = (status_kb("VmRSS:"), status_kb("VmHWM:"));
    let t = Instant::now();
    for b in &full {
        write_batch(&mut c, strategy, b).await;
    }
    let full_d = t.elapsed();
    c.close().await.unwrap();
    Measured {
        rss_growth_kb: rss1.saturating_sub(rss0),
        hwm_growth_kb: hwm1.saturating_sub(hwm0),
        mixed_rows_s: mixed_rows as f64 / mixed.as_secs_f64(),
        full_rows_s: (FULL_BATCHES * 256) as f64 / full_d.as_secs_f64(),
    }
}

fn main() {
    const KEY: &str = "POLYGW_STMT_BENCH";
    if let Ok(strategy) = std::env::var(KEY) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let m = rt.block_on(run(&strategy, dir.path()));
        println!(
            "RESULT {} {} {:.0} {:.0}",
            m.rss_growth_kb, m.hwm_growth_kb, m.mixed_rows_s, m.full_rows_s
        );
        return;
    }
    let exe = std::env::current_exe().unwrap();
    println!(
        "## SQLite writer: prepared statements over batches of every size 1..=256 \
         ({ROUNDS} rounds, then {FULL_BATCHES} batches of 256)"
    );
    println!("| strategy | RSS growth (MiB) | peak growth (MiB) | rows/s, mixed sizes | rows/s, batches of 256 |");
    println!("|---|---:|---:|---:|---:|");
    for s in STRATEGIES {
        let out = std::process::Command::new(&exe)
            .env(KEY, s)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let Some(line) = text.lines().find(|l| l.starts_with("RESULT ")) else {
            println!(
                "| {s} | failed: {} |",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            continue;
        };
        let v: Vec<f64> = line[7..]
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        println!(
            "| {s} | {:.1} | {:.1} | {:.0} | {:.0} |",
            v[0] / 1024.0,
            v[1] / 1024.0,
            v[2],
            v[3]
        );
    }
}
