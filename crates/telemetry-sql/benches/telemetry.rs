//! Telemetry benchmark (`cargo bench -p polygw-telemetry-sql`; hand-written harness, no
//! criterion): the per-call cost of `record()` against a plain `VecDeque` push, and rows
//! per second written through the recorder's batch writer against single-row INSERTs,
//! into SQLite and PostgreSQL (skipped with a reason when PostgreSQL is not reachable).
//! Baselines run in the same process, on the same machine, right before; the ratios are
//! what to compare across machines. Method and numbers: docs/BENCHMARKS.md, "Telemetry".

// Measuring wall time is the point of a benchmark.
#![allow(clippy::disallowed_methods)]

use std::collections::VecDeque;
use std::hint::black_box;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use polygw_core::ports::telemetry::TelemetryRecorder;
use polygw_core::{RowKind, TelemetryRow, UsageSource};
use polygw_telemetry_sql::{RecorderConfig, SqlRecorder, COLUMNS};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{ConnectOptions, Connection, PgConnection};

/// Rows pushed per `record()` measurement.
const PUSH_ROWS: usize = 50_000;
/// Rows written through the recorder per throughput measurement.
const BATCH_ROWS: usize = 100_000;
/// Rows written one INSERT at a time (the baseline is slow; fewer rows suffice).
const SQLITE_SINGLE_ROWS: usize = 5_000;
const PG_SINGLE_ROWS: usize = 2_000;
/// Repetitions of the in-memory measurements (the median is reported).
const REPEAT: usize = 5;

/// A row shaped like a real streamed attempt.
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
    r.is_hedge = i % 7 == 0;
    r.stream = true;
    r.ok = true;
    r.http_status = Some(200);
    r.prompt_tokens = Some(1200);
    r.completion_tokens = Some(350);
    r.reasoning_tokens = Some(80);
    r.usage_source = UsageSource::Measured;
    r.cost = Some(0.000709);
    r.latency_ms = Some(2300);
    r.ttft_ms = Some(410);
    r.max_inter_token_ms = Some(1200);
    r.stall_ms = Some(1100);
    r.stall_count = Some(1);
    r
}

fn rows(n: usize, offset: usize) -> Vec<TelemetryRow> {
    (offset..offset + n).map(row).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn ns_per(d: Duration, n: usize) -> f64 {
    d.as_nanos() as f64 / n as f64
}

fn per_sec(d: Duration, n: usize) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// Times `PUSH_ROWS` pushes of prebuilt rows; ns per push.
fn timed_pushes(mut push: impl FnMut(TelemetryRow), offset: usize) -> f64 {
    let input = rows(PUSH_ROWS, offset);
    let t = Instant::now();
    for r in input {
        push(r);
    }
    ns_per(t.elapsed(), PUSH_ROWS)
}

/// A recorder whose queue has already grown to `PUSH_ROWS` (steady state).
async fn warm_recorder(url: &str, cfg: RecorderConfig) -> SqlRecorder {
    let rec = SqlRecorder::connect(url, cfg).await.unwrap();
    for r in rows(PUSH_ROWS, 50_000_000) {
        rec.record(r);
    }
    assert_eq!(rec.flush().await.unwrap().pending, 0);
    rec
}

/// ns per push of a prebuilt row, in steady state (buffers already grown): into a
/// VecDeque, a Mutex<VecDeque>, and `record()` with the writer idle or writing.
async fn record_cost(dir: &std::path::Path) {
    println!("## record() cost ({PUSH_ROWS} rows per run, median of {REPEAT} runs, steady state)");
    let mut q = VecDeque::with_capacity(PUSH_ROWS);
    let mut plain = Vec::new();
    let m = Mutex::new(VecDeque::with_capacity(PUSH_ROWS));
    let mut locked = Vec::new();
    // The writer idle during the pushes (flushed between runs, unmeasured).
    let idle_rec = warm_recorder(
        &format!("sqlite://{}", dir.join("idle.db").display()),
        RecorderConfig {
            queue_capacity: PUSH_ROWS,
            batch_size: PUSH_ROWS + 1,
            flush_interval: Duration::from_secs(3600),
            flush_timeout: Duration::from_secs(60),
            ..RecorderConfig::default()
        },
    )
    .await;
    let mut idle = Vec::new();
    // The writer draining into SQLite during the pushes (lock contention included).
    let busy_rec = warm_recorder(
        &format!("sqlite://{}", dir.join("busy.db").display()),
        RecorderConfig {
            queue_capacity: PUSH_ROWS,
            flush_timeout: Duration::from_secs(60),
            ..RecorderConfig::default()
        },
    )
    .await;
    let mut busy = Vec::new();
    for run in 0..=REPEAT {
        // Run 0 warms every buffer and is not counted.
        let keep = run > 0;
        q.clear();
        let ns = timed_pushes(|r| q.push_back(r), 0);
        black_box(&q);
        if keep {
            plain.push(ns);
        }
        m.lock().unwrap().clear();
        let ns = timed_pushes(|r| m.lock().unwrap().push_back(r), 0);
        black_box(&m);
        if keep {
            locked.push(ns);
        }
        let offset = run * PUSH_ROWS;
        let ns = timed_pushes(|r| idle_rec.record(r), offset);
        assert_eq!(idle_rec.flush().await.unwrap().pending, 0);
        if keep {
            idle.push(ns);
        }
        let ns = timed_pushes(|r| busy_rec.record(r), offset);
        assert_eq!(busy_rec.flush().await.unwrap().pending, 0);
        if keep {
            busy.push(ns);
        }
    }
    assert_eq!(idle_rec.shutdown().await.dropped, 0);
    assert_eq!(busy_rec.shutdown().await.dropped, 0);
    let (plain, locked, idle, busy) = (median(plain), median(locked), median(idle), median(busy));
    println!("| operation | ns per row | vs VecDeque::push_back |");
    println!("|---|---:|---:|");
    println!("| `VecDeque::push_back` (baseline) | {plain:.0} | 1.0× |");
    println!(
        "| `Mutex<VecDeque>` lock + push | {locked:.0} | {:.1}× |",
        locked / plain
    );
    println!(
        "| `record()`, writer idle | {idle:.0} | {:.1}× |",
        idle / plain
    );
    println!(
        "| `record()`, writer writing to SQLite meanwhile | {busy:.0} | {:.1}× |",
        busy / plain
    );
    println!();
}

/// The single-row baseline's statement: the columns through `created_at` (the resume
/// columns after it stay NULL, as in the rows here), `created_at` cast on PostgreSQL.
fn insert_sql(pg: bool) -> String {
    let cols: Vec<&str> = COLUMNS
        .iter()
        .copied()
        .take_while(|c| *c != "created_at")
        .chain(["created_at"])
        .collect();
    let params: Vec<String> = (1..=cols.len())
        .map(|i| {
            let p = if pg { format!("${i}") } else { "?".to_string() };
            if i == cols.len() && pg {
                format!("CAST({p} AS TIMESTAMPTZ)")
            } else {
                p
            }
        })
        .collect();
    format!(
        "INSERT INTO llm_calls ({}) VALUES ({}) ON CONFLICT (call_id) DO NOTHING",
        cols.join(", "),
        params.join(", ")
    )
}

macro_rules! bind_row {
    ($q:expr, $r:expr) => {
        $q.bind($r.call_id.clone())
            .bind($r.logical_call_id.clone())
            .bind($r.scope.to_string())
            .bind($r.operation.to_string())
            .bind($r.kind.as_str())
            .bind($r.source.as_deref().map(str::to_string))
            .bind($r.provider.as_deref().map(str::to_string))
            .bind($r.model.as_deref().map(str::to_string))
            .bind($r.attempt_index.map(i64::from))
            .bind($r.is_hedge)
            .bind($r.stream)
            .bind($r.ok)
            .bind($r.error.clone())
            .bind($r.error_detail.clone())
            .bind($r.http_status.map(i64::from))
            .bind($r.prompt_tokens.map(|v| v as i64))
            .bind($r.completion_tokens.map(|v| v as i64))
            .bind($r.reasoning_tokens.map(|v| v as i64))
            .bind($r.usage_source.as_str())
            .bind($r.cost)
            .bind($r.latency_ms.map(|v| v as i64))
            .bind($r.ttft_ms.map(|v| v as i64))
            .bind($r.max_inter_token_ms.map(|v| v as i64))
            .bind($r.stall_ms.map(|v| v as i64))
            .bind($r.stall_count.map(i64::from))
            .bind($r.cache_hit)
            .bind(polygw_telemetry_sql::time::format_utc_ms($r.created_at_ms))
    };
}

/// The recorder's PostgreSQL method before `UNNEST`, measured in the same run: batches of
/// `batch` rows as one multi-row `INSERT … VALUES (…), (…) ON CONFLICT DO NOTHING` each,
/// one transaction per batch, on one connection; returns rows/s.
async fn pg_multirow_values(url: &str, offset: usize, batch: usize) -> f64 {
    let mut c = PgConnection::connect(url).await.unwrap();
    let input = rows(BATCH_ROWS, offset);
    let sql = insert_sql(true);
    let head = &sql[..sql.find(" VALUES ").unwrap()];
    let t = Instant::now();
    for chunk in input.chunks(batch) {
        let mut qb = sqlx::QueryBuilder::<sqlx::Postgres>::new(head);
        qb.push(" ");
        qb.push_values(chunk, |mut b, r| {
            b.push_bind(r.call_id.clone())
                .push_bind(r.logical_call_id.clone())
                .push_bind(r.scope.to_string())
                .push_bind(r.operation.to_string())
                .push_bind(r.kind.as_str())
                .push_bind(r.source.as_deref().map(str::to_string))
                .push_bind(r.provider.as_deref().map(str::to_string))
                .push_bind(r.model.as_deref().map(str::to_string))
                .push_bind(r.attempt_index.map(i64::from))
                .push_bind(r.is_hedge)
                .push_bind(r.stream)
                .push_bind(r.ok)
                .push_bind(r.error.clone())
                .push_bind(r.error_detail.clone())
                .push_bind(r.http_status.map(i64::from))
                .push_bind(r.prompt_tokens.map(|v| v as i64))
                .push_bind(r.completion_tokens.map(|v| v as i64))
                .push_bind(r.reasoning_tokens.map(|v| v as i64))
                .push_bind(r.usage_source.as_str())
                .push_bind(r.cost)
                .push_bind(r.latency_ms.map(|v| v as i64))
                .push_bind(r.ttft_ms.map(|v| v as i64))
                .push_bind(r.max_inter_token_ms.map(|v| v as i64))
                .push_bind(r.stall_ms.map(|v| v as i64))
                .push_bind(r.stall_count.map(i64::from))
                .push_bind(r.cache_hit);
            b.push("CAST(");
            b.push_bind_unseparated(polygw_telemetry_sql::time::format_utc_ms(r.created_at_ms));
            b.push_unseparated(" AS TIMESTAMPTZ)");
        });
        qb.push(" ON CONFLICT (call_id) DO NOTHING");
        let mut tx = c.begin().await.unwrap();
        qb.build().execute(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
    }
    let rate = per_sec(t.elapsed(), BATCH_ROWS);
    c.close().await.unwrap();
    rate
}

/// Rows through the recorder: record them all, then flush; returns rows/s.
async fn through_recorder(url: &str, offset: usize, batch_size: usize) -> f64 {
    let cfg = RecorderConfig {
        queue_capacity: BATCH_ROWS,
        batch_size,
        flush_timeout: Duration::from_secs(300),
        ..RecorderConfig::default()
    };
    let rec = SqlRecorder::connect(url, cfg).await.unwrap();
    let input = rows(BATCH_ROWS, offset);
    let t = Instant::now();
    for r in input {
        rec.record(r);
    }
    let report = rec.flush().await.unwrap();
    let d = t.elapsed();
    assert_eq!(
        (report.written, report.dropped, report.pending),
        (BATCH_ROWS as u64, 0, 0)
    );
    rec.shutdown().await;
    per_sec(d, BATCH_ROWS)
}

fn print_throughput(db: &str, single: f64, single_rows: usize, batched: &[(usize, f64)]) {
    println!("| database | method | rows | rows/s | vs single-row |");
    println!("|---|---|---:|---:|---:|");
    println!("| {db} | single-row INSERT, one transaction each (baseline) | {single_rows} | {single:.0} | 1.0× |");
    for (batch, rate) in batched {
        println!(
            "| {db} | `SqlRecorder`, batch {batch} (one transaction per batch) | {BATCH_ROWS} | {rate:.0} | {:.0}× |",
            rate / single
        );
    }
    println!();
}

/// The recorder at the default batch size and a larger one.
async fn recorder_rates(url: &str) -> Vec<(usize, f64)> {
    let mut out = Vec::new();
    for (i, batch) in [RecorderConfig::default().batch_size, 1024]
        .into_iter()
        .enumerate()
    {
        out.push((batch, through_recorder(url, i * BATCH_ROWS, batch).await));
    }
    out
}

async fn sqlite_throughput(dir: &std::path::Path) {
    println!("## SQLite rows/s (file in a temporary directory, WAL, synchronous=NORMAL)");
    let url = format!("sqlite://{}", dir.join("throughput.db").display());
    // Create the schema through the recorder, then the baseline on a connection of its own.
    SqlRecorder::connect(&url, RecorderConfig::default())
        .await
        .unwrap()
        .shutdown()
        .await;
    let mut c = SqliteConnectOptions::from_str(&url)
        .unwrap()
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .connect()
        .await
        .unwrap();
    let sql = insert_sql(false);
    let input = rows(SQLITE_SINGLE_ROWS, 10_000_000);
    let t = Instant::now();
    for r in &input {
        bind_row!(sqlx::query(&sql), r)
            .execute(&mut c)
            .await
            .unwrap();
    }
    let single = per_sec(t.elapsed(), SQLITE_SINGLE_ROWS);
    c.close().await.unwrap();
    let batched = recorder_rates(&url).await;
    print_throughput("SQLite", single, SQLITE_SINGLE_ROWS, &batched);
}

async fn pg_throughput() {
    let Some(base) = polygw_testkit::services::postgres_url() else {
        println!("## PostgreSQL rows/s: skipped (PostgreSQL not reachable)\n");
        return;
    };
    println!("## PostgreSQL rows/s (local server, default settings, own schema)");
    let schema = polygw_testkit::services::unique_name("bench").to_lowercase();
    let mut admin = PgConnection::connect(&base).await.unwrap();
    sqlx::raw_sql(&format!("CREATE SCHEMA \"{schema}\""))
        .execute(&mut admin)
        .await
        .unwrap();
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}options[search_path]={schema}");
    SqlRecorder::connect(&url, RecorderConfig::default())
        .await
        .unwrap()
        .shutdown()
        .await;
    let mut c = PgConnection::connect(&url).await.unwrap();
    let sql = insert_sql(true);
    let input = rows(PG_SINGLE_ROWS, 10_000_000);
    let t = Instant::now();
    for r in &input {
        bind_row!(sqlx::query(&sql), r)
            .execute(&mut c)
            .await
            .unwrap();
    }
    let single = per_sec(t.elapsed(), PG_SINGLE_ROWS);
    c.close().await.unwrap();
    // The previous method and the recorder, interleaved: the server's load moves.
    let mut multirow = Vec::new();
    let mut batched = Vec::new();
    for (i, batch) in [RecorderConfig::default().batch_size, 1024]
        .into_iter()
        .enumerate()
    {
        multirow.push((
            batch,
            pg_multirow_values(&url, (4 + i) * BATCH_ROWS, batch).await,
        ));
        batched.push((batch, through_recorder(&url, i * BATCH_ROWS, batch).await));
    }
    print_throughput("PostgreSQL", single, PG_SINGLE_ROWS, &batched);
    for ((batch, old), (_, new)) in multirow.iter().zip(&batched) {
        println!(
            "PostgreSQL, batch {batch}: multi-row INSERT … VALUES (the previous method) {old:.0} rows/s ({:.0}× single-row); the recorder (INSERT … SELECT FROM UNNEST) {new:.0} rows/s = {:.2}× the previous method",
            old / single,
            new / old
        );
    }
    println!();
    sqlx::raw_sql(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&mut admin)
        .await
        .unwrap();
    admin.close().await.unwrap();
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let load = || {
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!(
        "# polygw-telemetry-sql benchmark ({} CPUs; load average {})\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load()
    );
    rt.block_on(async {
        record_cost(dir.path()).await;
        sqlite_throughput(dir.path()).await;
        pg_throughput().await;
    });
    println!("load average {}", load());
}
