//! Integration tests of polygw-telemetry-sql against a real SQLite file and the local
//! PostgreSQL (mandatory under `CI=true`; skipped with a reason otherwise). One file with
//! modules, to keep link time low. Each PostgreSQL test works in its own schema, dropped
//! at the end (also on panic).

mod common {
    use std::net::SocketAddr;
    use std::str::FromStr;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use polygw_core::response::Usage;
    use polygw_core::telemetry::{cost, CostBasis};
    use polygw_core::{RowKind, SourceConfig, TelemetryRow, UsageSource};
    use polygw_telemetry_sql::{Backend, RecorderConfig};
    use sqlx::postgres::PgConnectOptions;
    use sqlx::sqlite::SqliteConnectOptions;
    use sqlx::{ConnectOptions, Connection, PgConnection, SqliteConnection};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::task::{AbortHandle, JoinHandle};

    /// 2026-12-02T11:32:08.123Z.
    pub const T0: i64 = 1_796_211_128_123;

    /// A recorder config for tests: short waits, warnings rate-limited.
    pub fn fast_config() -> RecorderConfig {
        RecorderConfig {
            flush_interval: Duration::from_millis(20),
            retry_min: Duration::from_millis(20),
            retry_max: Duration::from_millis(200),
            warn_interval: Duration::from_secs(3600),
            flush_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(5),
            ..RecorderConfig::default()
        }
    }

    /// A database to test against: a SQLite file in a temporary directory, or a fresh
    /// PostgreSQL schema (dropped when this is dropped).
    pub enum TestDb {
        Sqlite {
            _dir: tempfile::TempDir,
            url: String,
        },
        Pg(PgSchema),
    }

    impl TestDb {
        pub fn sqlite() -> TestDb {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("sqlite://{}", dir.path().join("telemetry.db").display());
            TestDb::Sqlite { _dir: dir, url }
        }

        /// [`TestDb::sqlite`] with its file and schema already created: for a test whose
        /// short `write_timeout` also bounds the recorder's first connection, which on a
        /// loaded machine can take longer than the test's write window (seen under CI).
        pub async fn sqlite_with_schema() -> TestDb {
            let db = TestDb::sqlite();
            polygw_telemetry_sql::SqlRecorder::connect(db.url(), fast_config())
                .await
                .unwrap()
                .shutdown()
                .await;
            db
        }

        pub async fn pg() -> Option<TestDb> {
            let base = polygw_testkit::services::postgres_url()?;
            Some(TestDb::Pg(PgSchema::create(&base).await))
        }

        /// SQLite, plus PostgreSQL when it is reachable (always under CI).
        pub async fn all() -> Vec<TestDb> {
            let mut v = vec![TestDb::sqlite()];
            v.extend(TestDb::pg().await);
            v
        }

        pub fn url(&self) -> &str {
            match self {
                TestDb::Sqlite { url, .. } => url,
                TestDb::Pg(s) => &s.url,
            }
        }

        pub fn backend(&self) -> Backend {
            match self {
                TestDb::Sqlite { .. } => Backend::Sqlite,
                TestDb::Pg(_) => Backend::Postgres,
            }
        }

        pub fn name(&self) -> &'static str {
            self.backend().as_str()
        }

        /// One integer from a query, on a connection of its own.
        pub async fn scalar(&self, sql: &str) -> i64 {
            scalar(self.url(), sql).await
        }

        pub async fn count(&self) -> i64 {
            self.scalar("SELECT COUNT(*) FROM llm_calls").await
        }

        /// Runs a statement on a connection of its own.
        pub async fn exec(&self, sql: &str) {
            match self.backend() {
                Backend::Sqlite => {
                    let mut c = sqlite_conn(self.url()).await;
                    sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
                    c.close().await.unwrap();
                }
                Backend::Postgres => {
                    let mut c = PgConnection::connect(self.url()).await.unwrap();
                    sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
                    c.close().await.unwrap();
                }
            }
        }
    }

    pub async fn sqlite_conn(url: &str) -> SqliteConnection {
        SqliteConnectOptions::from_str(url)
            .unwrap()
            .create_if_missing(true)
            .connect()
            .await
            .unwrap()
    }

    pub async fn scalar(url: &str, sql: &str) -> i64 {
        if url.starts_with("sqlite:") {
            let mut c = sqlite_conn(url).await;
            let v: i64 = sqlx::query_scalar(sql).fetch_one(&mut c).await.unwrap();
            c.close().await.unwrap();
            v
        } else {
            let mut c = PgConnection::connect(url).await.unwrap();
            let v: i64 = sqlx::query_scalar(sql).fetch_one(&mut c).await.unwrap();
            c.close().await.unwrap();
            v
        }
    }

    /// A PostgreSQL schema of this test's own; the URL selects it with `search_path`.
    pub struct PgSchema {
        base: String,
        name: String,
        pub url: String,
    }

    /// `url` with `search_path` set to `schema`.
    pub fn with_search_path(url: &str, schema: &str) -> String {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}options[search_path]={schema}")
    }

    impl PgSchema {
        pub async fn create(base: &str) -> PgSchema {
            let name = polygw_testkit::services::unique_name("tsql").to_lowercase();
            let mut c = PgConnection::connect(base).await.unwrap();
            sqlx::raw_sql(&format!("CREATE SCHEMA \"{name}\""))
                .execute(&mut c)
                .await
                .unwrap();
            c.close().await.unwrap();
            PgSchema {
                base: base.to_string(),
                url: with_search_path(base, &name),
                name,
            }
        }

        pub fn base(&self) -> &str {
            &self.base
        }
    }

    impl Drop for PgSchema {
        fn drop(&mut self) {
            // Drop cannot await: clean up on a thread with a runtime of its own.
            let (base, name) = (self.base.clone(), self.name.clone());
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    if let Ok(mut c) = PgConnection::connect(&base).await {
                        let _ = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                            .execute(&mut c)
                            .await;
                        let _ = c.close().await;
                    }
                });
            })
            .join();
        }
    }

    /// A TCP forwarder on 127.0.0.1 that can stop (cutting live connections and refusing
    /// new ones) and resume forwarding.
    pub struct Proxy {
        pub addr: SocketAddr,
        forwarding: Arc<AtomicBool>,
        /// When not forwarding: hold new connections open without a byte (a hung server)
        /// instead of closing them.
        blackhole: Arc<AtomicBool>,
        conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
        accept: AbortHandle,
    }

    impl Proxy {
        pub async fn start(upstream: SocketAddr) -> Proxy {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let forwarding = Arc::new(AtomicBool::new(true));
            let blackhole = Arc::new(AtomicBool::new(false));
            let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
            let (f, b, c) = (forwarding.clone(), blackhole.clone(), conns.clone());
            let accept = tokio::spawn(async move {
                let mut held = Vec::new();
                loop {
                    let Ok((mut down, _)) = listener.accept().await else {
                        continue;
                    };
                    if !f.load(Ordering::SeqCst) {
                        if b.load(Ordering::SeqCst) {
                            held.push(down);
                        } else {
                            drop(down);
                        }
                        continue;
                    }
                    let task = tokio::spawn(async move {
                        if let Ok(mut up) = TcpStream::connect(upstream).await {
                            let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                        }
                    });
                    c.lock().unwrap().push(task);
                }
            })
            .abort_handle();
            Proxy {
                addr,
                forwarding,
                blackhole,
                conns,
                accept,
            }
        }

        /// The database is gone: live connections are cut (this returns once they are),
        /// new ones are closed at once.
        pub async fn stop(&self) {
            self.forwarding.store(false, Ordering::SeqCst);
            let live: Vec<JoinHandle<()>> = self.conns.lock().unwrap().drain(..).collect();
            for c in live {
                c.abort();
                let _ = c.await;
            }
        }

        /// The database hangs: live connections are cut, new ones never get an answer.
        pub async fn hang(&self) {
            self.blackhole.store(true, Ordering::SeqCst);
            self.stop().await;
        }

        pub fn resume(&self) {
            self.forwarding.store(true, Ordering::SeqCst);
        }
    }

    impl Drop for Proxy {
        fn drop(&mut self) {
            self.forwarding.store(false, Ordering::SeqCst);
            for c in self.conns.lock().unwrap().drain(..) {
                c.abort();
            }
            self.accept.abort();
        }
    }

    /// The host:port of a PostgreSQL URL.
    pub fn pg_addr(url: &str) -> SocketAddr {
        let o = PgConnectOptions::from_str(url).unwrap();
        let host = if o.get_host() == "localhost" {
            "127.0.0.1"
        } else {
            o.get_host()
        };
        format!("{host}:{}", o.get_port()).parse().unwrap()
    }

    /// `url` pointed at another address.
    pub fn via(url: &str, addr: SocketAddr) -> String {
        let mut u = url::Url::parse(url).unwrap();
        u.set_host(Some(&addr.ip().to_string())).unwrap();
        u.set_port(Some(addr.port())).unwrap();
        u.to_string()
    }

    /// Polls `cond` every 10 ms until it holds; panics after `limit`.
    pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut cond: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + limit;
        while !cond().await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out after {limit:?} waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A plain attempt row.
    pub fn attempt(call_id: &str, logical: &str, at: i64) -> TelemetryRow {
        TelemetryRow::new(RowKind::Attempt, call_id, logical, "LLM", "chat", at)
    }

    pub fn priced() -> SourceConfig {
        SourceConfig::new("deepseek", 0, "http://127.0.0.1:9", "", "deepseek-chat")
            .with_prices(0.27, 1.10)
    }

    pub fn qwen() -> SourceConfig {
        SourceConfig::new("qwen", 0, "http://127.0.0.1:9", "", "qwen-plus").with_prices(0.8, 2.0)
    }

    fn from_source(mut r: TelemetryRow, s: &SourceConfig) -> TelemetryRow {
        r.source = Some(s.name.as_str().into());
        r.provider = Some(s.provider.as_str().into());
        r.model = Some(s.model.as_str().into());
        r
    }

    /// The scripted scenario: one row of every shape the engine writes.
    pub fn scenario() -> Vec<TelemetryRow> {
        let ds = priced();
        let qw = qwen();
        let ocr = SourceConfig::new("paddle", 0, "http://127.0.0.1:9", "", "ocr-v1")
            .with_price_per_call(0.004);
        let unpriced = SourceConfig::new("vllm", 0, "http://127.0.0.1:9", "", "llama");
        let mut rows = Vec::new();

        // l1: a measured, priced, streamed success with stalls.
        let usage = Usage {
            reasoning_tokens: Some(80),
            ..Usage::new(1200, 350)
        };
        let mut r =
            from_source(attempt("c1", "l1", T0), &ds).with_usage(&usage, UsageSource::Measured);
        r.attempt_index = Some(0);
        r.stream = true;
        r.ok = true;
        r.http_status = Some(200);
        r.cost = cost(
            CostBasis::Tokens {
                usage: &usage,
                source: UsageSource::Measured,
            },
            &ds,
        );
        r.latency_ms = Some(2300);
        r.ttft_ms = Some(410);
        r.max_inter_token_ms = Some(1200);
        r.stall_ms = Some(1100);
        r.stall_count = Some(1);
        // Through the proxy's chat route, with a client key; cached prompt tokens; the
        // call's last row, so it carries the trace.
        r.api = Some("chat".into());
        r.client_key_id = Some("key_01".into());
        r.cached_prompt_tokens = Some(1024);
        r.cache_write_tokens = Some(64);
        r.trace = Some(trace_json());
        rows.push(r);

        // l2: a failed attempt, then the terminal row of the failed call.
        let mut r = from_source(attempt("c2", "l2", T0 + 1), &qw);
        r.attempt_index = Some(0);
        r.error = Some("server_error".into());
        r.error_detail = Some("HTTP 503: upstream 'overloaded' — réessayez ✓".into());
        r.http_status = Some(503);
        r.cost = cost(CostBasis::Failed, &qw);
        r.latency_ms = Some(120);
        rows.push(r);
        let mut r = TelemetryRow::new(
            RowKind::TerminalFailure,
            "c2-t",
            "l2",
            "LLM",
            "chat",
            T0 + 2,
        );
        r.error = Some("retry_exhausted".into());
        r.error_detail = Some("last error: server_error (transient) HTTP 503".into());
        r.latency_ms = Some(9050);
        r.cost = cost(CostBasis::Failed, &qw);
        r.trace = Some(r#"{"v":1,"events":[{"t":0,"ev":"launch","leg":0}]}"#.into());
        rows.push(r);

        // l3: a hedged round; the primary loses (hedge_cancelled), the hedge leg wins.
        let mut r = from_source(attempt("c3a", "l3", T0 + 3), &ds);
        r.attempt_index = Some(0);
        r.stream = true;
        r.error = Some("hedge_cancelled".into());
        r.latency_ms = Some(3000);
        r.ttft_ms = None;
        r.cost = cost(CostBasis::Failed, &ds);
        // The loser's usage is unavailable: the gateway's estimates instead.
        r.api = Some("responses".into());
        r.est_prompt_tokens = Some(900);
        r.est_received_tokens = Some(42);
        rows.push(r);
        let u3 = Usage {
            cached_prompt_tokens: Some(512),
            ..Usage::new(900, 120)
        };
        let mut r =
            from_source(attempt("c3b", "l3", T0 + 4), &qw).with_usage(&u3, UsageSource::Measured);
        r.attempt_index = Some(1);
        r.is_hedge = true;
        r.stream = true;
        r.ok = true;
        r.http_status = Some(200);
        r.cost = cost(
            CostBasis::Tokens {
                usage: &u3,
                source: UsageSource::Measured,
            },
            &qw,
        );
        r.latency_ms = Some(1500);
        r.ttft_ms = Some(300);
        r.max_inter_token_ms = Some(40);
        r.stall_ms = Some(0);
        r.stall_count = Some(0);
        rows.push(r);

        // l4: the caller dropped the call.
        let mut r = from_source(attempt("c4", "l4", T0 + 5), &ds);
        r.attempt_index = Some(0);
        r.stream = true;
        r.error = Some("cancelled".into());
        r.latency_ms = Some(700);
        r.ttft_ms = Some(650);
        r.est_prompt_tokens = Some(1200);
        r.est_received_tokens = Some(0);
        rows.push(r);

        // l5: a cache hit (measured usage of the stored answer, cost 0.0), and one whose
        // stored answer had no usage (still 0.0: nothing was spent).
        let mut r = TelemetryRow::new(RowKind::CacheHit, "c5", "l5", "LLM", "chat", T0 + 6)
            .with_usage(&Usage::new(1200, 350), UsageSource::Measured);
        r.ok = true;
        r.cache_hit = true;
        r.cost = cost(CostBasis::CacheHit, &ds);
        r.latency_ms = Some(0);
        rows.push(r);
        let mut r = TelemetryRow::new(RowKind::CacheHit, "c5b", "l5b", "LLM", "chat", T0 + 7);
        r.ok = true;
        r.cache_hit = true;
        r.cost = cost(CostBasis::CacheHit, &unpriced);
        r.latency_ms = Some(1);
        rows.push(r);

        // l6: a success without a usage frame: NULL tokens, NULL cost.
        let mut r = from_source(attempt("c6", "l6", T0 + 8), &ds)
            .with_usage(&Usage::default(), UsageSource::Unavailable);
        r.attempt_index = Some(0);
        r.ok = true;
        r.http_status = Some(200);
        r.cost = cost(
            CostBasis::Tokens {
                usage: &Usage::default(),
                source: UsageSource::Unavailable,
            },
            &ds,
        );
        r.latency_ms = Some(800);
        r.est_prompt_tokens = Some(800);
        r.est_received_tokens = Some(150);
        rows.push(r);

        // l7: an OCR call priced per call (usage measured 0).
        let mut r = TelemetryRow::new(RowKind::Attempt, "c7", "l7", "OCR", "ocr", T0 + 9)
            .with_usage(&Usage::new(0, 0), UsageSource::Measured);
        r = from_source(r, &ocr);
        r.attempt_index = Some(0);
        r.ok = true;
        r.http_status = Some(200);
        r.cost = cost(CostBasis::PerCall, &ocr);
        r.latency_ms = Some(640);
        rows.push(r);

        // l8: a salvaged stream (estimated usage) on an unpriced source: NULL cost; and an
        // embedding with a huge token count, a deadline-cut attempt and a 429.
        let u8 = Usage::new(4_000_000_000_000, 7);
        let mut r = from_source(attempt("c8", "l8", T0 + 10), &unpriced)
            .with_usage(&u8, UsageSource::Estimated);
        r.attempt_index = Some(2);
        r.stream = true;
        r.ok = true;
        r.cost = cost(
            CostBasis::Tokens {
                usage: &u8,
                source: UsageSource::Estimated,
            },
            &unpriced,
        );
        r.latency_ms = Some(61_000);
        r.ttft_ms = Some(1);
        r.max_inter_token_ms = Some(54_900);
        r.stall_ms = Some(55_000);
        r.stall_count = Some(3);
        rows.push(r);
        let ue = Usage::new(512, 0);
        let mut r = TelemetryRow::new(RowKind::Attempt, "c9", "l9", "EMBED", "embedding", T0 + 11)
            .with_usage(&ue, UsageSource::Measured);
        r = from_source(r, &ds);
        r.attempt_index = Some(0);
        r.ok = true;
        r.cost = cost(
            CostBasis::Tokens {
                usage: &ue,
                source: UsageSource::Measured,
            },
            &ds,
        );
        r.latency_ms = Some(90);
        rows.push(r);
        let mut r = from_source(attempt("c10", "l10", T0 + 12), &qw);
        r.attempt_index = Some(0);
        r.error = Some("rate_limited".into());
        r.http_status = Some(429);
        r.latency_ms = Some(15);
        rows.push(r);
        rows
    }

    /// The accounting gap of the scenario, counted here: unavailable attempts that are
    /// not cache hits.
    pub fn expected_gap(rows: &[TelemetryRow]) -> u64 {
        rows.iter()
            .filter(|r| {
                r.usage_source == UsageSource::Unavailable
                    && !r.cache_hit
                    && r.kind == RowKind::Attempt
            })
            .count() as u64
    }

    /// Field-by-field equality, cost with a tolerance; names the field that differs.
    pub fn assert_same_rows(got: &[TelemetryRow], want: &[TelemetryRow], ctx: &str) {
        assert_eq!(got.len(), want.len(), "{ctx}: row count");
        let mut want: Vec<&TelemetryRow> = want.iter().collect();
        want.sort_by(|a, b| (a.created_at_ms, &a.call_id).cmp(&(b.created_at_ms, &b.call_id)));
        for (g, w) in got.iter().zip(want) {
            let id = &w.call_id;
            match (g.cost, w.cost) {
                (Some(a), Some(b)) => {
                    assert!(
                        (a - b).abs() <= 1e-9 * b.abs().max(1.0),
                        "{ctx} {id}: cost {a} != {b}"
                    )
                }
                (a, b) => assert_eq!(a, b, "{ctx} {id}: cost (NULL must stay NULL)"),
            }
            macro_rules! same {
                ($($f:ident),*) => {$(
                    assert_eq!(g.$f, w.$f, "{ctx} {id}: {}", stringify!($f));
                )*};
            }
            same!(
                call_id,
                logical_call_id,
                scope,
                operation,
                kind,
                source,
                provider,
                model,
                attempt_index,
                is_hedge,
                stream,
                ok,
                error,
                error_detail,
                http_status,
                prompt_tokens,
                completion_tokens,
                reasoning_tokens,
                usage_source,
                latency_ms,
                ttft_ms,
                max_inter_token_ms,
                stall_ms,
                stall_count,
                cache_hit,
                created_at_ms,
                resume_of,
                resume_mode,
                prefix_chars,
                api,
                cached_prompt_tokens,
                cache_write_tokens,
                est_prompt_tokens,
                est_received_tokens,
                client_key_id,
                trace
            );
        }
    }

    /// A row with every field set, the revision-3 ones included (a resume leg of a call
    /// through the Responses API, with a client key, cache tokens and the call's trace).
    pub fn full_row(call_id: &str, at: i64) -> TelemetryRow {
        let usage = Usage {
            reasoning_tokens: Some(80),
            cached_prompt_tokens: Some(1024),
            cache_write_tokens: Some(64),
            cache_write_1h_tokens: None,
            ..Usage::new(1200, 350)
        };
        let mut r = from_source(attempt(call_id, "lfull", at), &priced())
            .with_usage(&usage, UsageSource::Measured);
        r.attempt_index = Some(3);
        r.is_hedge = true;
        r.stream = true;
        r.ok = true;
        r.error_detail = Some("detail".into());
        r.http_status = Some(200);
        r.cost = Some(0.000_709);
        r.latency_ms = Some(2300);
        r.ttft_ms = Some(410);
        r.max_inter_token_ms = Some(1200);
        r.stall_ms = Some(1100);
        r.stall_count = Some(1);
        r.resume_of = Some("c-previous".into());
        r.resume_mode = Some("prefill".into());
        r.prefix_chars = Some(5120);
        r.api = Some("responses".into());
        r.est_prompt_tokens = Some(1190);
        r.est_received_tokens = Some(9_000_000_000_000);
        r.client_key_id = Some("key_01J9Z3K7".into());
        r.trace = Some(trace_json());
        r
    }

    /// A decision trace as the engine writes it: compact JSON, quotes and unicode.
    pub fn trace_json() -> String {
        r#"{"v":1,"events":[{"t":0,"ev":"launch","leg":0,"source":"deepseek-0","why":"primary"},{"t":812,"ev":"launch","leg":1,"source":"qwen-0","why":"hedge","threshold_ms":800,"from":"sketch:deepseek-0"},{"t":1210,"ev":"first_token","leg":1},{"t":2300,"ev":"won","leg":1,"note":"«ok» "quoted" ✓"}]}"#.to_string()
    }

    /// Rows numbered `from..to` under one logical call each.
    pub fn numbered(prefix: &str, from: usize, to: usize) -> Vec<TelemetryRow> {
        (from..to)
            .map(|i| {
                let mut r = attempt(
                    &format!("{prefix}-{i:06}"),
                    &format!("{prefix}-l{i}"),
                    T0 + i as i64,
                );
                r.ok = true;
                r.latency_ms = Some(i as u64);
                r
            })
            .collect()
    }
}

mod roundtrip {
    use polygw_core::ports::telemetry::TelemetryRecorder;
    use polygw_telemetry_sql::{accounting_gap, read_rows, SqlRecorder, TelemetryReader};

    use crate::common::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_same_scenario_gives_the_same_rows_in_both_databases() {
        let rows = scenario();
        let mut read_back = Vec::new();
        for db in TestDb::all().await {
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            // Recorded in reverse: the table order comes from created_at, not arrival.
            for r in rows.iter().rev() {
                rec.record(r.clone());
            }
            let report = rec.flush().await.unwrap();
            assert_eq!(
                (report.written, report.dropped, report.pending),
                (rows.len() as u64, 0, 0),
                "{}",
                db.name()
            );
            let got = read_rows(db.url(), None).await.unwrap();
            assert_same_rows(&got, &rows, db.name());

            // since: created_at >= bound, both databases.
            let later = read_rows(db.url(), Some(T0 + 6)).await.unwrap();
            let want: Vec<_> = rows
                .iter()
                .filter(|r| r.created_at_ms >= T0 + 6)
                .cloned()
                .collect();
            assert_same_rows(&later, &want, &format!("{} since", db.name()));
            assert!(read_rows(db.url(), Some(T0 + 1000))
                .await
                .unwrap()
                .is_empty());

            let reader = TelemetryReader::connect(db.url()).await.unwrap();
            assert_eq!(reader.backend(), db.backend());
            assert_eq!(reader.rows(None).await.unwrap().len(), rows.len());
            reader.close().await;
            rec.shutdown().await;
            read_back.push((db.name(), got));
        }
        if let [(_, a), (_, b)] = read_back.as_slice() {
            assert_same_rows(a, b, "sqlite vs postgres");
        }
    }

    /// Every field, the revision-3 columns included, written and read back alike by both
    /// backends (and NULL stays NULL for a row that sets none of them).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_row_with_every_field_set_round_trips_on_both_backends() {
        let mut big = full_row("full-big", T0 + 2);
        big.trace = Some(format!(
            "{{\"v\":1,\"events\":[{}]}}",
            vec![r#"{"t":1,"ev":"stall","leg":0}"#; 4000].join(",")
        ));
        big.cached_prompt_tokens = Some(u64::MAX);
        let rows = vec![full_row("full", T0), attempt("bare", "lbare", T0 + 1), big];
        let mut read_back = Vec::new();
        for db in TestDb::all().await {
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            for r in &rows {
                rec.record(r.clone());
            }
            assert_eq!(rec.flush().await.unwrap().written, 3, "{}", db.name());
            rec.shutdown().await;
            let got = read_rows(db.url(), None).await.unwrap();
            // u64::MAX is stored saturated at i64::MAX (a BIGINT).
            let mut want = rows.clone();
            want[2].cached_prompt_tokens = Some(i64::MAX as u64);
            assert_same_rows(&got, &want, db.name());
            let full = got.iter().find(|r| r.call_id == "full").unwrap();
            assert_eq!(full, &rows[0], "{}: the whole row", db.name());
            let bare = got.iter().find(|r| r.call_id == "bare").unwrap();
            assert_eq!(
                (
                    &bare.api,
                    bare.cached_prompt_tokens,
                    bare.cache_write_tokens,
                    bare.est_prompt_tokens,
                    bare.est_received_tokens,
                    &bare.client_key_id,
                    &bare.trace
                ),
                (&None, None, None, None, None, &None, &None),
                "{}",
                db.name()
            );
            read_back.push(got);
        }
        if let [a, b] = read_back.as_slice() {
            assert_same_rows(a, b, "sqlite vs postgres");
        }
    }

    /// The SQLite writer splits batches into power-of-two statements: every batch size
    /// from 1 to 300 (beyond the default batch) is written whole, once, in one
    /// transaction each.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_of_every_size_are_written_whole() {
        for db in TestDb::all().await {
            let cfg = polygw_telemetry_sql::RecorderConfig {
                batch_size: 300,
                queue_capacity: 1000,
                flush_interval: std::time::Duration::from_secs(3600),
                ..fast_config()
            };
            let rec = SqlRecorder::connect(db.url(), cfg).await.unwrap();
            let mut total = 0usize;
            for n in (1..=300).step_by(if db.backend() == polygw_telemetry_sql::Backend::Sqlite {
                1
            } else {
                7
            }) {
                for r in numbered(&format!("b{n}"), 0, n) {
                    rec.record(r);
                }
                total += n;
                let report = rec.flush().await.unwrap();
                assert_eq!(
                    (report.written, report.pending),
                    (total as u64, 0),
                    "{}",
                    db.name()
                );
            }
            assert_eq!(db.count().await, total as i64, "{}", db.name());
            rec.shutdown().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_over_tls_and_the_postgresql_scheme() {
        let Some(db) = TestDb::pg().await else { return };
        let ssl_on = {
            let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(db.url())
                .await
                .unwrap();
            let v: String = sqlx::query_scalar("SHOW ssl")
                .fetch_one(&mut c)
                .await
                .unwrap();
            sqlx::Connection::close(c).await.unwrap();
            v == "on"
        };
        let app = polygw_testkit::services::unique_name("tls");
        let mut url = db.url().replacen("postgres://", "postgresql://", 1);
        if ssl_on {
            url.push_str("&sslmode=require");
        } else {
            eprintln!("the local PostgreSQL has ssl=off: testing the postgresql:// scheme only");
        }
        url.push_str(&format!("&application_name={app}"));
        let rec = SqlRecorder::connect(&url, fast_config()).await.unwrap();
        let rows = scenario();
        for r in &rows {
            rec.record(r.clone());
        }
        assert_eq!(rec.flush().await.unwrap().written, rows.len() as u64);
        if ssl_on {
            // The recorder's own connection (named by the URL) is encrypted.
            let tls = db
                .scalar(&format!(
                    "SELECT COUNT(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
                     WHERE s.ssl AND a.application_name = '{app}'"
                ))
                .await;
            assert_eq!(tls, 1);
        }
        assert_same_rows(
            &read_rows(&url, None).await.unwrap(),
            &rows,
            "postgresql:// (tls)",
        );
        rec.shutdown().await;
        // Without a name in the URL, connections are named polygw-telemetry.
        let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
        let named = db
            .scalar(&format!(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = '{}' \
                 AND datname = current_database()",
                polygw_telemetry_sql::APPLICATION_NAME
            ))
            .await;
        assert!(named >= 1);
        rec.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reinserting_a_call_id_is_a_no_op() {
        for db in TestDb::all().await {
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            let first = scenario();
            for r in &first {
                rec.record(r.clone());
            }
            rec.flush().await.unwrap();
            // The same call_ids again, with other values, in one batch with a new row.
            let mut again: Vec<_> = first
                .iter()
                .map(|r| {
                    let mut r = r.clone();
                    r.ok = !r.ok;
                    r.latency_ms = Some(999_999);
                    r.error = Some("changed".into());
                    r
                })
                .collect();
            again.push(attempt("fresh", "lf", T0 + 500));
            for r in &again {
                rec.record(r.clone());
            }
            let report = rec.flush().await.unwrap();
            assert_eq!(report.pending, 0, "{}", db.name());
            assert_eq!(db.count().await, first.len() as i64 + 1, "{}", db.name());
            let got = read_rows(db.url(), None).await.unwrap();
            let mut want = first.clone();
            want.push(attempt("fresh", "lf", T0 + 500));
            assert_same_rows(&got, &want, db.name());
            // A call_id twice within one batch: the first row is kept.
            let dup = attempt("twice", "lt", T0 + 600);
            let mut changed = dup.clone();
            changed.error = Some("second".into());
            rec.record(dup.clone());
            rec.record(changed);
            let report = rec.flush().await.unwrap();
            assert_eq!(report.pending, 0, "{}", db.name());
            assert_eq!(db.count().await, first.len() as i64 + 2, "{}", db.name());
            let got = read_rows(db.url(), None).await.unwrap();
            want.push(dup);
            assert_same_rows(&got, &want, db.name());
            rec.shutdown().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_accounting_gap_counts_unavailable_attempts_only() {
        for db in TestDb::all().await {
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            assert_eq!(
                accounting_gap(db.url()).await.unwrap(),
                0,
                "{}: empty",
                db.name()
            );
            let rows = scenario();
            for r in &rows {
                rec.record(r.clone());
            }
            rec.flush().await.unwrap();
            // failed (c2), hedge loser (c3a), cancelled (c4), no usage frame (c6), 429 (c10);
            // not the cache hit without usage (c5b) nor the terminal row (c2-t).
            assert_eq!(expected_gap(&rows), 5);
            assert_eq!(accounting_gap(db.url()).await.unwrap(), 5, "{}", db.name());
            rec.shutdown().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reading_a_missing_database_fails_without_creating_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent.db");
        let url = format!("sqlite://{}", path.display());
        assert!(read_rows(&url, None).await.is_err());
        assert!(accounting_gap(&url).await.is_err());
        assert!(!path.exists());
        let e = read_rows("mysql://u:hunter2@h/db", None)
            .await
            .unwrap_err()
            .0;
        assert!(e.contains("unsupported") && !e.contains("hunter2"), "{e}");
    }
}

mod cost_rule {
    use polygw_core::ports::telemetry::TelemetryRecorder;
    use polygw_core::response::Usage;
    use polygw_core::telemetry::{cost, CostBasis};
    use polygw_core::{RowKind, SourceConfig, TelemetryRow, UsageSource};
    use polygw_telemetry_sql::{read_rows, SqlRecorder};

    use crate::common::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn null_stays_null_and_zero_stays_zero() {
        let u = Usage::new(1_000_000, 500_000);
        let zero_out = Usage::new(1000, 0);
        let no_tokens = Usage::new(0, 0);
        let priced = SourceConfig::new("p", 0, "http://x", "", "m").with_prices(2.0, 8.0);
        let unpriced = SourceConfig::new("p", 1, "http://x", "", "m");
        let in_only = SourceConfig {
            input_price: Some(2.0),
            ..unpriced.clone()
        };
        let ocr = SourceConfig::new("o", 0, "http://x", "", "m").with_price_per_call(0.01);
        let tokens = |usage, source| CostBasis::Tokens { usage, source };
        // (case, kind, basis, source config, usage source, cost wanted)
        type Case<'a> = (
            &'a str,
            RowKind,
            CostBasis<'a>,
            &'a SourceConfig,
            UsageSource,
            Option<f64>,
        );
        let table: Vec<Case<'_>> = vec![
            (
                "cache hit",
                RowKind::CacheHit,
                CostBasis::CacheHit,
                &priced,
                UsageSource::Measured,
                Some(0.0),
            ),
            (
                "cache hit, unpriced, no usage",
                RowKind::CacheHit,
                CostBasis::CacheHit,
                &unpriced,
                UsageSource::Unavailable,
                Some(0.0),
            ),
            (
                "failed",
                RowKind::Attempt,
                CostBasis::Failed,
                &priced,
                UsageSource::Unavailable,
                None,
            ),
            (
                "terminal",
                RowKind::TerminalFailure,
                CostBasis::Failed,
                &priced,
                UsageSource::Unavailable,
                None,
            ),
            (
                "usage unavailable",
                RowKind::Attempt,
                tokens(&u, UsageSource::Unavailable),
                &priced,
                UsageSource::Unavailable,
                None,
            ),
            (
                "no price",
                RowKind::Attempt,
                tokens(&u, UsageSource::Measured),
                &unpriced,
                UsageSource::Measured,
                None,
            ),
            (
                "measured",
                RowKind::Attempt,
                tokens(&u, UsageSource::Measured),
                &priced,
                UsageSource::Measured,
                Some(6.0),
            ),
            (
                "estimated",
                RowKind::Attempt,
                tokens(&u, UsageSource::Estimated),
                &priced,
                UsageSource::Estimated,
                Some(6.0),
            ),
            (
                "output price missing",
                RowKind::Attempt,
                tokens(&u, UsageSource::Measured),
                &in_only,
                UsageSource::Measured,
                None,
            ),
            (
                "output price missing, no output",
                RowKind::Attempt,
                tokens(&zero_out, UsageSource::Measured),
                &in_only,
                UsageSource::Measured,
                Some(0.002),
            ),
            (
                "measured, zero tokens",
                RowKind::Attempt,
                tokens(&no_tokens, UsageSource::Measured),
                &priced,
                UsageSource::Measured,
                Some(0.0),
            ),
            (
                "ocr priced",
                RowKind::Attempt,
                CostBasis::PerCall,
                &ocr,
                UsageSource::Measured,
                Some(0.01),
            ),
            (
                "ocr unpriced",
                RowKind::Attempt,
                CostBasis::PerCall,
                &unpriced,
                UsageSource::Measured,
                None,
            ),
        ];
        let rows: Vec<TelemetryRow> = table
            .iter()
            .enumerate()
            .map(|(i, (case, kind, basis, src, us, want))| {
                let mut r = TelemetryRow::new(
                    *kind,
                    format!("cost-{i:02}"),
                    format!("l{i}"),
                    "S",
                    "chat",
                    T0 + i as i64,
                )
                .with_usage(&u, *us);
                r.cost = cost(*basis, src);
                r.cache_hit = *kind == RowKind::CacheHit;
                r.ok = !matches!(basis, CostBasis::Failed);
                r.error_detail = Some(case.to_string());
                match (r.cost, want) {
                    (Some(a), Some(b)) => assert!((a - b).abs() < 1e-12, "{case}: rule gives {a}"),
                    (a, b) => assert_eq!(a, *b, "{case}: rule"),
                }
                r
            })
            .collect();
        let nulls = table.iter().filter(|t| t.5.is_none()).count() as i64;
        let zeros = table.iter().filter(|t| t.5 == Some(0.0)).count() as i64;
        assert_eq!((nulls, zeros), (6, 3));
        for db in TestDb::all().await {
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            for r in &rows {
                rec.record(r.clone());
            }
            assert_eq!(rec.flush().await.unwrap().written, rows.len() as u64);
            let got = read_rows(db.url(), None).await.unwrap();
            assert_same_rows(&got, &rows, db.name());
            for (g, (case, .., want)) in got.iter().zip(&table) {
                assert_eq!(g.cost.is_none(), want.is_none(), "{}: {case}", db.name());
                if *want == Some(0.0) {
                    assert_eq!(
                        g.cost,
                        Some(0.0),
                        "{}: {case}: 0.0 must not become NULL",
                        db.name()
                    );
                }
            }
            // In SQL, too: "free" and "unknown" are told apart.
            assert_eq!(
                db.scalar("SELECT COUNT(*) FROM llm_calls WHERE cost IS NULL")
                    .await,
                nulls,
                "{}",
                db.name()
            );
            assert_eq!(
                db.scalar("SELECT COUNT(*) FROM llm_calls WHERE cost = 0")
                    .await,
                zeros,
                "{}",
                db.name()
            );
            rec.shutdown().await;
        }
    }
}

mod outage {
    use std::time::Duration;

    use polygw_core::ports::telemetry::TelemetryRecorder;
    use polygw_telemetry_sql::{read_rows, RecorderConfig, SqlRecorder};
    use sqlx::Connection;

    use crate::common::*;

    /// Records rows and returns each `record()` time, sorted.
    fn record_timed(rec: &SqlRecorder, rows: Vec<polygw_core::TelemetryRow>) -> Vec<Duration> {
        let mut times: Vec<Duration> = rows
            .into_iter()
            .map(|r| {
                #[allow(clippy::disallowed_methods)] // the caller's cost needs a real clock
                let t = std::time::Instant::now();
                rec.record(r);
                t.elapsed()
            })
            .collect();
        times.sort();
        times
    }

    fn assert_fast(times: &[Duration], ctx: &str) {
        // A push behind a mutex: microseconds. The bounds leave room for a loaded CI
        // machine (a thread preempted now and then), and are still far below one
        // database attempt (the busy or write timeout) or one retry delay, which every
        // record() here would pay if it waited for the database.
        let p99 = times[times.len() * 99 / 100 - 1];
        let mean = times.iter().sum::<Duration>() / times.len() as u32;
        let max = *times.last().unwrap();
        assert!(
            p99 < Duration::from_millis(10),
            "{ctx}: p99 record() took {p99:?}"
        );
        assert!(
            mean < Duration::from_millis(1),
            "{ctx}: mean record() took {mean:?}"
        );
        assert!(
            max < Duration::from_secs(1),
            "{ctx}: slowest record() took {max:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_unreachable_then_reachable_loses_nothing() {
        let Some(db) = TestDb::pg().await else { return };
        let TestDb::Pg(schema) = &db else {
            unreachable!()
        };
        let proxy = Proxy::start(pg_addr(schema.base())).await;
        let url = via(&schema.url, proxy.addr);
        let cfg = RecorderConfig {
            flush_timeout: Duration::from_secs(1),
            write_timeout: Duration::from_secs(2),
            ..fast_config()
        };
        let rec = SqlRecorder::connect(&url, cfg).await.unwrap();
        for r in numbered("up", 0, 50) {
            rec.record(r);
        }
        assert_eq!(rec.flush().await.unwrap().written, 50);

        proxy.stop().await;
        assert_fast(
            &record_timed(&rec, numbered("down", 0, 500)),
            "postgres down",
        );
        // flush is bounded by flush_timeout and reports what is still queued.
        let report = rec.flush().await.unwrap();
        assert_eq!(
            (report.written, report.dropped, report.pending),
            (50, 0, 500)
        );
        assert_eq!(
            db.count().await,
            50,
            "nothing reached the database while it was away"
        );
        // The writer keeps retrying meanwhile; record() stays fast.
        assert_fast(
            &record_timed(&rec, numbered("down2", 0, 100)),
            "postgres down, retrying",
        );

        proxy.resume();
        wait_until("the queue to drain", Duration::from_secs(30), || async {
            rec.flush().await.unwrap().pending == 0
        })
        .await;
        let report = rec.flush().await.unwrap();
        assert_eq!(
            (report.written, report.dropped, report.pending),
            (650, 0, 0)
        );
        assert_eq!(db.count().await, 650);
        let mut want = numbered("up", 0, 50);
        want.extend(numbered("down", 0, 500));
        want.extend(numbered("down2", 0, 100));
        assert_same_rows(
            &read_rows(&schema.url, None).await.unwrap(),
            &want,
            "postgres",
        );
        let fin = rec.shutdown().await;
        assert_eq!((fin.written, fin.pending), (650, 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_locked_then_unlocked_loses_nothing() {
        let db = TestDb::sqlite_with_schema().await;
        let cfg = RecorderConfig {
            flush_timeout: Duration::from_secs(1),
            write_timeout: Duration::from_millis(400),
            ..fast_config()
        };
        let rec = SqlRecorder::connect(db.url(), cfg).await.unwrap();
        for r in numbered("up", 0, 20) {
            rec.record(r);
        }
        assert_eq!(rec.flush().await.unwrap().written, 20);

        // Tests run as root, so chmod would not stop writes: another connection holds
        // the database's write lock instead.
        let mut locker = sqlite_conn(db.url()).await;
        sqlx::raw_sql("BEGIN EXCLUSIVE")
            .execute(&mut locker)
            .await
            .unwrap();
        assert_fast(
            &record_timed(&rec, numbered("down", 0, 300)),
            "sqlite locked",
        );
        let report = rec.flush().await.unwrap();
        assert_eq!(
            (report.written, report.dropped, report.pending),
            (20, 0, 300)
        );
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM llm_calls")
            .fetch_one(&mut locker)
            .await
            .unwrap();
        assert_eq!(n, 20);

        sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
        locker.close().await.unwrap();
        wait_until("the queue to drain", Duration::from_secs(30), || async {
            rec.flush().await.unwrap().pending == 0
        })
        .await;
        let report = rec.flush().await.unwrap();
        assert_eq!(
            (report.written, report.dropped, report.pending),
            (320, 0, 0)
        );
        let mut want = numbered("up", 0, 20);
        want.extend(numbered("down", 0, 300));
        assert_same_rows(&read_rows(db.url(), None).await.unwrap(), &want, "sqlite");
        rec.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn overflow_while_down_keeps_the_newest_rows_and_counts_the_rest() {
        let db = TestDb::sqlite_with_schema().await;
        let cfg = RecorderConfig {
            queue_capacity: 50,
            batch_size: 16,
            flush_timeout: Duration::from_millis(500),
            write_timeout: Duration::from_millis(200),
            ..fast_config()
        };
        let rec = SqlRecorder::connect(db.url(), cfg).await.unwrap();
        let mut locker = sqlite_conn(db.url()).await;
        sqlx::raw_sql("BEGIN EXCLUSIVE")
            .execute(&mut locker)
            .await
            .unwrap();
        for r in numbered("o", 0, 120) {
            rec.record(r);
            assert!(rec.snapshot().pending <= 50 + 16, "bounded queue");
        }
        // A batch the writer took out (in flight) is put back when its write fails, and
        // the oldest rows beyond capacity are dropped then: the queue settles at 50.
        wait_until(
            "the queue to settle at capacity",
            Duration::from_secs(30),
            || async {
                let r = rec.flush().await.unwrap();
                (r.written, r.dropped, r.pending) == (0, 70, 50)
            },
        )
        .await;
        assert_eq!(rec.dropped(), 70);
        assert_eq!(rec.recorded(), 120);
        sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
        locker.close().await.unwrap();
        wait_until("the queue to drain", Duration::from_secs(30), || async {
            rec.flush().await.unwrap().pending == 0
        })
        .await;
        let report = rec.flush().await.unwrap();
        assert_eq!(
            (report.written, report.dropped, report.pending),
            (50, 70, 0)
        );
        // Drop-oldest: the 50 newest rows survive.
        assert_same_rows(
            &read_rows(db.url(), None).await.unwrap(),
            &numbered("o", 70, 120),
            "newest",
        );
        rec.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn overflow_drops_the_oldest_and_flush_reports_it() {
        for db in TestDb::all().await {
            // The writer only wakes on flush here: a batch is never full, the interval long.
            let cfg = RecorderConfig {
                queue_capacity: 10,
                batch_size: 100,
                flush_interval: Duration::from_secs(3600),
                ..fast_config()
            };
            let rec = SqlRecorder::connect(db.url(), cfg).await.unwrap();
            for r in numbered("d", 0, 25) {
                rec.record(r);
            }
            assert_eq!(rec.dropped(), 15, "{}", db.name());
            let snap = rec.snapshot();
            assert_eq!((snap.written, snap.dropped, snap.pending), (0, 15, 10));
            let report = rec.flush().await.unwrap();
            assert_eq!(
                (report.written, report.dropped, report.pending),
                (10, 15, 0),
                "{}",
                db.name()
            );
            assert_same_rows(
                &read_rows(db.url(), None).await.unwrap(),
                &numbered("d", 15, 25),
                db.name(),
            );
            assert_eq!(rec.recorded(), 25);
            rec.shutdown().await;
        }
    }
}

mod lifecycle {
    use std::time::Duration;

    use polygw_core::ports::telemetry::TelemetryRecorder;
    use polygw_core::TelemetryRow;
    use polygw_telemetry_sql::{read_rows, RecorderConfig, SqlRecorder};

    use crate::common::*;

    /// Records a cancelled attempt when dropped, as the engine's attempt guards do.
    struct AttemptGuard {
        rec: SqlRecorder,
        row: Option<TelemetryRow>,
    }

    impl Drop for AttemptGuard {
        fn drop(&mut self) {
            if let Some(mut r) = self.row.take() {
                r.error = Some("cancelled".into());
                self.rec.record(r);
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn record_works_from_drop_on_a_thread_without_a_runtime() {
        let db = TestDb::sqlite();
        let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
        let r2 = rec.clone();
        std::thread::spawn(move || {
            assert!(tokio::runtime::Handle::try_current().is_err());
            for row in numbered("g", 0, 40) {
                let _guard = AttemptGuard {
                    rec: r2.clone(),
                    row: Some(row),
                };
                // dropped here, outside any runtime
            }
        })
        .join()
        .unwrap();
        let report = rec.flush().await.unwrap();
        assert_eq!((report.written, report.pending), (40, 0));
        let rows = read_rows(db.url(), None).await.unwrap();
        assert!(rows.iter().all(|r| r.error.as_deref() == Some("cancelled")));
        rec.shutdown().await;
    }

    /// A full batch wakes the writer for full batches only: the rest waits for the
    /// interval's tick or a flush, so under load every transaction is a full batch
    /// (issue 42: writing whatever had arrived meant a transaction every few rows and
    /// about one WAL write per row). The interval here never ticks.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_batch_wakes_the_writer_for_full_batches_only() {
        let db = TestDb::sqlite();
        let cfg = RecorderConfig {
            batch_size: 16,
            flush_interval: Duration::from_secs(3600),
            ..fast_config()
        };
        let rec = SqlRecorder::connect(db.url(), cfg).await.unwrap();
        for r in numbered("f", 0, 40) {
            rec.record(r);
        }
        wait_until(
            "two full batches written",
            Duration::from_secs(30),
            || async { rec.snapshot().written == 32 },
        )
        .await;
        // The 8 left stay queued: no partial transaction on a full batch's wake. (The
        // pause gives a wrong writer time to write them; a right one never does.)
        tokio::time::sleep(Duration::from_millis(200)).await;
        let s = rec.snapshot();
        assert_eq!((s.written, s.pending), (32, 8), "{s:?}");
        // A flush writes them.
        let report = rec.flush().await.unwrap();
        assert_eq!((report.written, report.pending), (40, 0), "{report:?}");
        assert_eq!(db.count().await, 40);
        rec.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_records_are_all_accounted_for() {
        // Four threads record at once into a small queue while the writer writes: every
        // row ends up written or counted as dropped, and what is written is in the table.
        let db = TestDb::sqlite();
        let cfg = RecorderConfig {
            queue_capacity: 500,
            batch_size: 64,
            ..fast_config()
        };
        let rec = SqlRecorder::connect(db.url(), cfg).await.unwrap();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let rec = rec.clone();
                std::thread::spawn(move || {
                    for r in numbered(&format!("t{t}"), 0, 5000) {
                        rec.record(r);
                        let s = rec.snapshot();
                        assert!(s.pending <= 500 + 64, "{s:?}");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        wait_until("the queue to drain", Duration::from_secs(60), || async {
            rec.flush().await.unwrap().pending == 0
        })
        .await;
        let report = rec.flush().await.unwrap();
        assert_eq!(report.written + report.dropped, 20_000, "{report:?}");
        assert_eq!(rec.recorded(), 20_000);
        assert_eq!(db.count().await, report.written as i64);
        rec.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_writes_what_is_queued_and_stops_the_writer() {
        for db in TestDb::all().await {
            let cfg = RecorderConfig {
                flush_interval: Duration::from_secs(3600),
                batch_size: 1000,
                ..fast_config()
            };
            let rec = SqlRecorder::connect(db.url(), cfg).await.unwrap();
            let other = rec.clone();
            for r in numbered("s", 0, 30) {
                rec.record(r);
            }
            let fin = rec.shutdown().await;
            assert_eq!(
                (fin.written, fin.dropped, fin.pending),
                (30, 0, 0),
                "{}",
                db.name()
            );
            assert!(other.is_stopped());
            assert_eq!(db.count().await, 30);
            // After shutdown a row cannot be written: it is counted, not lost silently.
            other.record(attempt("late", "late", T0));
            assert_eq!(other.dropped(), 1);
            let again = other.flush().await.unwrap();
            assert_eq!((again.written, again.dropped, again.pending), (30, 1, 0));
            assert_eq!(rec.shutdown().await, again, "idempotent");
            assert_eq!(rec.recorded(), 31);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropping_the_last_handle_writes_the_queue_and_ends_the_task() {
        let db = TestDb::sqlite();
        let cfg = RecorderConfig {
            flush_interval: Duration::from_secs(3600),
            batch_size: 1000,
            ..fast_config()
        };
        let rec = SqlRecorder::connect(db.url(), cfg).await.unwrap();
        let monitor = rec.monitor();
        for r in numbered("x", 0, 12) {
            rec.record(r);
        }
        let clone = rec.clone();
        drop(rec);
        assert!(!monitor.is_stopped(), "a clone still holds the recorder");
        drop(clone);
        wait_until("the writer to stop", Duration::from_secs(15), || async {
            monitor.is_stopped()
        })
        .await;
        let report = monitor.snapshot();
        assert_eq!((report.written, report.pending), (12, 0));
        assert_eq!(read_rows(db.url(), None).await.unwrap().len(), 12);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_drop_while_the_database_is_down_ends_within_flush_timeout() {
        let db = TestDb::sqlite_with_schema().await;
        let cfg = RecorderConfig {
            flush_timeout: Duration::from_millis(300),
            write_timeout: Duration::from_millis(200),
            ..fast_config()
        };
        let rec = SqlRecorder::connect(db.url(), cfg).await.unwrap();
        let monitor = rec.monitor();
        let mut locker = sqlite_conn(db.url()).await;
        sqlx::raw_sql("BEGIN EXCLUSIVE")
            .execute(&mut locker)
            .await
            .unwrap();
        for r in numbered("y", 0, 5) {
            rec.record(r);
        }
        drop(rec);
        // flush_timeout (300 ms) plus closing the pool; generous for a loaded machine.
        wait_until("the writer to give up", Duration::from_secs(10), || async {
            monitor.is_stopped()
        })
        .await;
        let report = monitor.snapshot();
        assert_eq!(
            (report.written, report.pending),
            (0, 5),
            "lost rows are reported"
        );
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut locker)
            .await
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hung_write_is_cut_at_flush_timeout_after_the_last_drop() {
        let Some(db) = TestDb::pg().await else { return };
        let TestDb::Pg(schema) = &db else {
            unreachable!()
        };
        let proxy = Proxy::start(pg_addr(schema.base())).await;
        let cfg = RecorderConfig {
            // A write could hang for a minute; closing must not wait for it.
            write_timeout: Duration::from_secs(60),
            flush_timeout: Duration::from_millis(300),
            ..fast_config()
        };
        let rec = SqlRecorder::connect(&via(&schema.url, proxy.addr), cfg)
            .await
            .unwrap();
        let monitor = rec.monitor();
        proxy.hang().await;
        for r in numbered("h", 0, 7) {
            rec.record(r);
        }
        // Let the writer start a write that hangs (its batch is then in flight).
        let flushed = rec.flush().await.unwrap();
        assert_eq!(flushed.pending, 7);
        let dropped_at = tokio::time::Instant::now();
        drop(rec);
        wait_until("the writer to stop", Duration::from_secs(20), || async {
            monitor.is_stopped()
        })
        .await;
        // flush_timeout (300 ms) plus closing the pool (≤ 1 s), with room for a slow CI.
        assert!(
            dropped_at.elapsed() < Duration::from_secs(5),
            "{:?}",
            dropped_at.elapsed()
        );
        let report = monitor.snapshot();
        assert_eq!(
            (report.written, report.pending),
            (0, 7),
            "the lost rows are reported"
        );
        assert_eq!(monitor.recorded(), 7);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connect_rejects_bad_urls_and_configs_without_leaking_a_password() {
        let e = SqlRecorder::connect("redis://:pw@h", RecorderConfig::default())
            .await
            .unwrap_err()
            .0;
        assert!(e.contains("unsupported") && !e.contains(":pw@"), "{e}");
        let bad = RecorderConfig {
            queue_capacity: 0,
            ..RecorderConfig::default()
        };
        let db = TestDb::sqlite();
        let e = SqlRecorder::connect(db.url(), bad).await.unwrap_err().0;
        assert!(e.contains("queue_capacity"), "{e}");
        // An unreachable PostgreSQL fails within write_timeout and shows no password.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let cfg = RecorderConfig {
            write_timeout: Duration::from_secs(2),
            ..RecorderConfig::default()
        };
        let url = format!("postgres://u:s3cretpw@127.0.0.1:{port}/db");
        let e = SqlRecorder::connect(&url, cfg).await.unwrap_err().0;
        assert!(!e.contains("s3cretpw"), "{e}");
        assert!(e.contains("redacted"), "{e}");
        assert!(e.contains("refused"), "the driver's reason is kept: {e}");
    }
}

mod schema {
    use polygw_core::ports::telemetry::TelemetryRecorder;
    use polygw_telemetry_sql::migrations::{self, Embedded, EmbeddedMigration};
    use polygw_telemetry_sql::{read_rows, Backend, SqlRecorder, COLUMNS};
    use sqlx::migrate::Migrator;
    use sqlx::{Connection, PgConnection};

    use crate::common::*;

    /// A later polygw's migration: one that adds a column and a table of its own.
    const NEXT: EmbeddedMigration = EmbeddedMigration {
        version: 8,
        description: "polygw test region",
        file: "0008_polygw_test_region.sql",
        sql: "ALTER TABLE llm_calls ADD COLUMN region TEXT;\nCREATE INDEX IF NOT EXISTS llm_calls_region ON llm_calls (region);\nCREATE TABLE IF NOT EXISTS polygw_test_regions (region TEXT NOT NULL PRIMARY KEY);",
    };
    /// A later polygw's migration list: this binary's, plus [`NEXT`].
    static SQLITE_NEXT: &[EmbeddedMigration] = &[
        migrations::SQLITE[0],
        migrations::SQLITE[1],
        migrations::SQLITE[2],
        migrations::SQLITE[3],
        migrations::SQLITE[4],
        migrations::SQLITE[5],
        migrations::SQLITE[6],
        NEXT,
    ];
    static POSTGRES_NEXT: &[EmbeddedMigration] = &[
        migrations::POSTGRES[0],
        migrations::POSTGRES[1],
        migrations::POSTGRES[2],
        migrations::POSTGRES[3],
        migrations::POSTGRES[4],
        migrations::POSTGRES[5],
        migrations::POSTGRES[6],
        NEXT,
    ];
    /// This binary's latest migration.
    const LATEST: i64 = 7;

    #[test]
    fn the_lists_here_are_this_binarys_plus_one() {
        assert_eq!(migrations::SQLITE.len() as i64, LATEST);
        assert_eq!(migrations::POSTGRES.len() as i64, LATEST);
        for s in migrations::statements(NEXT.sql) {
            assert!(migrations::is_additive_statement(&s), "{s}");
        }
    }

    /// Whether a table exists, on a connection of its own.
    async fn has_table(db: &TestDb, table: &str) -> bool {
        let sql = match db.backend() {
            Backend::Sqlite => format!(
                "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = '{table}'"
            ),
            Backend::Postgres => format!(
                "SELECT COUNT(*) FROM information_schema.tables \
                 WHERE table_schema = current_schema() AND table_name = '{table}'"
            ),
        };
        db.scalar(&sql).await == 1
    }

    async fn run_migrator(db: &TestDb, list: &'static [EmbeddedMigration]) {
        let m = Migrator::new(Embedded(list)).await.unwrap();
        match db.backend() {
            Backend::Sqlite => {
                let mut c = sqlite_conn(db.url()).await;
                m.run(&mut c).await.unwrap();
                c.close().await.unwrap();
            }
            Backend::Postgres => {
                let mut c = PgConnection::connect(db.url()).await.unwrap();
                m.run(&mut c).await.unwrap();
                c.close().await.unwrap();
            }
        }
    }

    async fn column_names(db: &TestDb) -> Vec<(String, String)> {
        match db.backend() {
            Backend::Sqlite => {
                let mut c = sqlite_conn(db.url()).await;
                let v = sqlx::query_as(
                    "SELECT name, type FROM pragma_table_info('llm_calls') ORDER BY cid",
                )
                .fetch_all(&mut c)
                .await
                .unwrap();
                c.close().await.unwrap();
                v
            }
            Backend::Postgres => {
                let mut c = PgConnection::connect(db.url()).await.unwrap();
                let v = sqlx::query_as(
                    "SELECT column_name::TEXT, data_type::TEXT FROM information_schema.columns \
                     WHERE table_schema = current_schema() AND table_name = 'llm_calls' \
                     ORDER BY ordinal_position",
                )
                .fetch_all(&mut c)
                .await
                .unwrap();
                c.close().await.unwrap();
                v
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn both_databases_have_the_same_columns_and_the_documented_types() {
        let mut names = Vec::new();
        for db in TestDb::all().await {
            SqlRecorder::connect(db.url(), fast_config())
                .await
                .unwrap()
                .shutdown()
                .await;
            let cols = column_names(&db).await;
            let got: Vec<&str> = cols.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(got, COLUMNS, "{}", db.name());
            let ty = |c: &str| cols.iter().find(|(n, _)| n == c).unwrap().1.clone();
            let (boolean, int, real, ts) = match db.backend() {
                Backend::Sqlite => ("INTEGER", "INTEGER", "REAL", "TEXT"),
                Backend::Postgres => (
                    "boolean",
                    "bigint",
                    "double precision",
                    "timestamp with time zone",
                ),
            };
            for c in ["is_hedge", "stream", "ok", "cache_hit"] {
                assert_eq!(ty(c), boolean, "{} {c}", db.name());
            }
            for c in [
                "attempt_index",
                "http_status",
                "prompt_tokens",
                "completion_tokens",
                "reasoning_tokens",
                "latency_ms",
                "ttft_ms",
                "max_inter_token_ms",
                "stall_ms",
                "stall_count",
                "prefix_chars",
                "cached_prompt_tokens",
                "cache_write_tokens",
                "est_prompt_tokens",
                "est_received_tokens",
            ] {
                assert_eq!(ty(c), int, "{} {c}", db.name());
            }
            let text = match db.backend() {
                Backend::Sqlite => "TEXT",
                Backend::Postgres => "text",
            };
            for c in ["resume_of", "resume_mode", "api", "client_key_id", "trace"] {
                assert_eq!(ty(c), text, "{} {c}", db.name());
            }
            assert_eq!(ty("cost"), real);
            assert_eq!(ty("created_at"), ts);
            // The responses table (migration 4), its primary key and expiry index.
            assert!(has_table(&db, "polygw_responses").await, "{}", db.name());
            let (pk, idx) = match db.backend() {
                Backend::Sqlite => (
                    db.scalar("SELECT COUNT(*) FROM pragma_table_info('polygw_responses') WHERE pk > 0").await,
                    db.scalar("SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name = 'polygw_responses_expires_at_ms'").await,
                ),
                Backend::Postgres => (
                    db.scalar("SELECT COUNT(*) FROM information_schema.key_column_usage k JOIN information_schema.table_constraints c USING (constraint_schema, constraint_name) WHERE c.constraint_type = 'PRIMARY KEY' AND k.table_schema = current_schema() AND k.table_name = 'polygw_responses'").await,
                    db.scalar("SELECT COUNT(*) FROM pg_indexes WHERE schemaname = current_schema() AND indexname = 'polygw_responses_expires_at_ms'").await,
                ),
            };
            assert_eq!(
                (pk, idx),
                (2, 1),
                "{}: (scope, id) and expires_at_ms",
                db.name()
            );
            // The turns table (migration 7) and its two indexes.
            assert!(
                has_table(&db, "polygw_response_turns").await,
                "{}",
                db.name()
            );
            let turn_indexes = match db.backend() {
                Backend::Sqlite => db.scalar("SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name IN ('polygw_response_turns_expires_at_ms', 'polygw_response_turns_scope_expires')").await,
                Backend::Postgres => db.scalar("SELECT COUNT(*) FROM pg_indexes WHERE schemaname = current_schema() AND indexname IN ('polygw_response_turns_expires_at_ms', 'polygw_response_turns_scope_expires')").await,
            };
            assert_eq!(turn_indexes, 2, "{}", db.name());
            let indexes = match db.backend() {
                Backend::Sqlite => db.scalar("SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name IN ('llm_calls_created_at', 'llm_calls_logical_call_id')").await,
                Backend::Postgres => db.scalar("SELECT COUNT(*) FROM pg_indexes WHERE schemaname = current_schema() AND indexname IN ('llm_calls_created_at', 'llm_calls_logical_call_id')").await,
            };
            assert_eq!(indexes, 2, "{}", db.name());
            names.push(got.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        }
        if let [a, b] = names.as_slice() {
            assert_eq!(a, b);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connecting_twice_migrates_once() {
        for db in TestDb::all().await {
            let a = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            let b = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            a.record(attempt("a", "a", T0));
            b.record(attempt("b", "b", T0 + 1));
            assert_eq!(a.flush().await.unwrap().written, 1);
            assert_eq!(b.flush().await.unwrap().written, 1);
            assert_eq!(
                db.scalar("SELECT COUNT(*) FROM _sqlx_migrations").await,
                LATEST,
                "{}",
                db.name()
            );
            assert_eq!(
                db.scalar("SELECT MAX(version) FROM _sqlx_migrations").await,
                LATEST
            );
            assert_eq!(db.count().await, 2);
            a.shutdown().await;
            b.shutdown().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_database_of_migration_1_upgrades_and_older_binaries_keep_writing() {
        for db in TestDb::all().await {
            // A database made by a polygw that knew only migration 1, with a row.
            let (first, next) = match db.backend() {
                Backend::Sqlite => (&migrations::SQLITE[..1], SQLITE_NEXT),
                Backend::Postgres => (&migrations::POSTGRES[..1], POSTGRES_NEXT),
            };
            let first: &'static [EmbeddedMigration] = first;
            run_migrator(&db, first).await;
            let created = match db.backend() {
                Backend::Sqlite => "'2026-12-02T11:32:08.123Z'",
                Backend::Postgres => "CAST('2026-12-02T11:32:08.123Z' AS TIMESTAMPTZ)",
            };
            db.exec(&format!(
                "INSERT INTO llm_calls (call_id, logical_call_id, scope, operation, kind, ok, usage_source, created_at) \
                 VALUES ('old', 'l', 'LLM', 'chat', 'attempt', {}, 'unavailable', {created})",
                if db.backend() == Backend::Sqlite { "1" } else { "TRUE" }
            ))
            .await;

            // This binary upgrades it in place: the resume columns are added, the old
            // row reads them as NULL.
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            let rows = scenario();
            for r in &rows {
                rec.record(r.clone());
            }
            rec.flush().await.unwrap();
            rec.shutdown().await;
            assert_eq!(
                db.scalar("SELECT MAX(version) FROM _sqlx_migrations").await,
                LATEST
            );
            let cols = column_names(&db).await;
            let names: Vec<&str> = cols.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, COLUMNS, "{}", db.name());
            let read = read_rows(db.url(), None).await.unwrap();
            let old = read.iter().find(|r| r.call_id == "old").unwrap();
            assert_eq!(
                (&old.resume_of, &old.resume_mode, old.prefix_chars),
                (&None, &None, None)
            );

            // A later polygw adds a column and a table (migration 5).
            run_migrator(&db, next).await;
            assert_eq!(
                db.scalar("SELECT MAX(version) FROM _sqlx_migrations").await,
                LATEST + 1
            );
            let cols = column_names(&db).await;
            assert_eq!(cols.len(), COLUMNS.len() + 1);
            assert_eq!(cols.last().unwrap().0, "region");
            assert!(has_table(&db, "polygw_test_regions").await);

            // The migrated database keeps its rows, and this binary (which does not
            // know migration 5) still connects, writes and reads.
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            rec.record(attempt("after", "after", T0 + 100));
            assert_eq!(rec.flush().await.unwrap().written, 1);
            rec.shutdown().await;
            let read = read_rows(db.url(), None).await.unwrap();
            assert_eq!(read.len(), rows.len() + 2, "{}", db.name());
            let mut want = rows.clone();
            want.push(attempt("after", "after", T0 + 100));
            let read_ours: Vec<_> = read.into_iter().filter(|r| r.call_id != "old").collect();
            assert_same_rows(&read_ours, &want, db.name());
            // Running the newer migrator again is a no-op.
            run_migrator(&db, next).await;
            assert_eq!(
                db.scalar("SELECT COUNT(*) FROM _sqlx_migrations").await,
                LATEST + 1
            );
        }
    }

    /// A database made by the polygw of migrations 1–2, with rows (resume legs among
    /// them), opened by this binary: it gains the revision-3 columns and the responses
    /// table in place, the old rows read the new columns as NULL and keep theirs, and new
    /// rows carry every field.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_database_of_migrations_1_and_2_gains_the_revision3_columns_in_place() {
        for db in TestDb::all().await {
            let two: &'static [EmbeddedMigration] = match db.backend() {
                Backend::Sqlite => &migrations::SQLITE[..2],
                Backend::Postgres => &migrations::POSTGRES[..2],
            };
            run_migrator(&db, two).await;
            let cols = column_names(&db).await;
            assert_eq!(cols.len(), 30, "{}: the columns of migration 2", db.name());
            assert!(!has_table(&db, "polygw_responses").await);
            let (created, yes) = match db.backend() {
                Backend::Sqlite => ("'2026-12-02T11:32:08.123Z'", "1"),
                Backend::Postgres => ("CAST('2026-12-02T11:32:08.123Z' AS TIMESTAMPTZ)", "TRUE"),
            };
            // What the writer of migration 2 wrote: a resume leg and a plain attempt.
            db.exec(&format!(
                "INSERT INTO llm_calls (call_id, logical_call_id, scope, operation, kind, ok, \
                 usage_source, prompt_tokens, created_at, resume_of, resume_mode, prefix_chars) \
                 VALUES ('old-resume', 'l', 'LLM', 'chat', 'attempt', {yes}, 'measured', 10, \
                 {created}, 'old-first', 'replay', 77); \
                 INSERT INTO llm_calls (call_id, logical_call_id, scope, operation, kind, ok, \
                 usage_source, created_at) \
                 VALUES ('old-first', 'l', 'LLM', 'chat', 'attempt', {yes}, 'unavailable', {created})"
            ))
            .await;

            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            rec.record(full_row("new", T0 + 5));
            assert_eq!(rec.flush().await.unwrap().written, 1);
            rec.shutdown().await;
            assert_eq!(
                db.scalar("SELECT MAX(version) FROM _sqlx_migrations").await,
                LATEST
            );
            let names: Vec<String> = column_names(&db).await.into_iter().map(|c| c.0).collect();
            assert_eq!(names, COLUMNS, "{}", db.name());
            assert!(has_table(&db, "polygw_responses").await, "{}", db.name());

            let read = read_rows(db.url(), None).await.unwrap();
            assert_eq!(read.len(), 3, "{}", db.name());
            for id in ["old-resume", "old-first"] {
                let old = read.iter().find(|r| r.call_id == id).unwrap();
                assert_eq!(
                    (
                        &old.api,
                        old.cached_prompt_tokens,
                        old.cache_write_tokens,
                        old.est_prompt_tokens,
                        old.est_received_tokens,
                        &old.client_key_id,
                        &old.trace
                    ),
                    (&None, None, None, None, None, &None, &None),
                    "{} {id}",
                    db.name()
                );
                assert_eq!(old.created_at_ms, T0);
            }
            let resume = read.iter().find(|r| r.call_id == "old-resume").unwrap();
            assert_eq!(
                (
                    resume.resume_of.as_deref(),
                    resume.resume_mode.as_deref(),
                    resume.prefix_chars
                ),
                (Some("old-first"), Some("replay"), Some(77))
            );
            assert_eq!(resume.prompt_tokens, Some(10));
            let new = read.iter().find(|r| r.call_id == "new").unwrap();
            assert_eq!(new, &full_row("new", T0 + 5), "{}", db.name());
            // Connecting again changes nothing.
            SqlRecorder::connect(db.url(), fast_config())
                .await
                .unwrap()
                .shutdown()
                .await;
            assert_eq!(
                db.scalar("SELECT COUNT(*) FROM _sqlx_migrations").await,
                LATEST
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_table_without_later_columns_reads_them_as_null() {
        // A database whose llm_calls lacks some nullable columns (as one made before they
        // were added would): the reader selects NULL for them instead of failing.
        let db = TestDb::sqlite();
        let full = migrations::SQLITE[0].sql;
        let reduced: String = full
            .lines()
            .filter(|l| !l.contains("reasoning_tokens") && !l.contains("stall_count"))
            .collect::<Vec<_>>()
            .join("\n");
        db.exec(&reduced).await;
        db.exec(
            "INSERT INTO llm_calls (call_id, logical_call_id, scope, operation, kind, ok, usage_source, cost, created_at) \
             VALUES ('old', 'l', 'LLM', 'chat', 'attempt', 1, 'measured', 0.5, '2026-12-02T11:32:08.123Z')",
        )
        .await;
        let rows = read_rows(db.url(), None).await.unwrap();
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!((r.reasoning_tokens, r.stall_count), (None, None));
        assert!(r.ok);
        assert_eq!(r.cost, Some(0.5));
        assert_eq!(r.created_at_ms, T0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_applications_migrations_table_is_refused() {
        let db = TestDb::sqlite();
        static APP: &[EmbeddedMigration] = &[EmbeddedMigration {
            version: 1,
            description: "create users",
            file: "0001_create_users.sql",
            sql: "CREATE TABLE users (id INTEGER PRIMARY KEY);",
        }];
        run_migrator(&db, APP).await;
        let e = SqlRecorder::connect(db.url(), fast_config())
            .await
            .unwrap_err()
            .0;
        assert!(e.contains("another application"), "{e}");
        assert_eq!(
            db.scalar("SELECT COUNT(*) FROM sqlite_master WHERE name = 'llm_calls'")
                .await,
            0
        );
    }
}

mod queries {
    use polygw_core::ports::telemetry::TelemetryRecorder;
    use polygw_telemetry_sql::{queries, SqlRecorder};
    use sqlx::{Column, Connection, PgConnection, Row};

    use crate::common::*;

    #[derive(Debug, Clone, PartialEq)]
    enum Cell {
        Null,
        Int(i64),
        Float(f64),
        Text(String),
    }

    fn cell<R: Row>(row: &R, i: usize) -> Cell
    where
        usize: sqlx::ColumnIndex<R>,
        for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> Option<f64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        if let Ok(v) = row.try_get::<Option<i64>, _>(i) {
            return v.map_or(Cell::Null, Cell::Int);
        }
        if let Ok(v) = row.try_get::<Option<f64>, _>(i) {
            return v.map_or(Cell::Null, Cell::Float);
        }
        match row.try_get::<Option<String>, _>(i) {
            Ok(v) => v.map_or(Cell::Null, Cell::Text),
            Err(e) => panic!("column {i}: {e}"),
        }
    }

    async fn run(db: &TestDb, sql: &str) -> Vec<Vec<(String, Cell)>> {
        fn table<R: Row>(rows: Vec<R>) -> Vec<Vec<(String, Cell)>>
        where
            usize: sqlx::ColumnIndex<R>,
            for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
            for<'r> Option<f64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
            for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        {
            rows.iter()
                .map(|r| {
                    r.columns()
                        .iter()
                        .enumerate()
                        .map(|(i, c)| (c.name().to_string(), cell(r, i)))
                        .collect()
                })
                .collect()
        }
        if db.url().starts_with("sqlite:") {
            let mut c = sqlite_conn(db.url()).await;
            let rows = sqlx::query(sql).fetch_all(&mut c).await.unwrap();
            table(rows)
        } else {
            let mut c = PgConnection::connect(db.url()).await.unwrap();
            let rows = sqlx::query(sql).fetch_all(&mut c).await.unwrap();
            table(rows)
        }
    }

    fn num(c: &Cell) -> f64 {
        match c {
            Cell::Int(i) => *i as f64,
            Cell::Float(f) => *f,
            other => panic!("not a number: {other:?}"),
        }
    }

    fn same_tables(a: &[Vec<(String, Cell)>], b: &[Vec<(String, Cell)>], ctx: &str) {
        assert_eq!(a.len(), b.len(), "{ctx}");
        for (ra, rb) in a.iter().zip(b) {
            assert_eq!(ra.len(), rb.len(), "{ctx}");
            // Unnamed expressions are named differently (`COUNT(*)` vs `count`).
            for ((na, ca), (_, cb)) in ra.iter().zip(rb) {
                match (ca, cb) {
                    (Cell::Null, Cell::Null) => {}
                    (Cell::Text(x), Cell::Text(y)) => assert_eq!(x, y, "{ctx} {na}"),
                    (x, y) => assert!((num(x) - num(y)).abs() < 1e-9, "{ctx} {na}: {x:?} vs {y:?}"),
                }
            }
        }
    }

    fn get<'a>(row: &'a [(String, Cell)], name: &str) -> &'a Cell {
        &row.iter().find(|(n, _)| n == name).unwrap().1
    }

    /// The scenario plus a second hedged call that the primary won, and a spread of
    /// latencies for the percentile.
    fn workload() -> Vec<polygw_core::TelemetryRow> {
        let mut rows = scenario();
        let mut p = attempt("h2a", "h2", T0 + 20);
        p.source = Some("deepseek-0".into());
        p.ok = true;
        p.stream = true;
        p.latency_ms = Some(500);
        p.stall_ms = Some(100);
        rows.push(p);
        let mut h = attempt("h2b", "h2", T0 + 21);
        h.source = Some("qwen-0".into());
        h.is_hedge = true;
        h.stream = true;
        h.error = Some("hedge_cancelled".into());
        h.latency_ms = Some(200);
        rows.push(h);
        for i in 0..200u64 {
            let mut r = attempt(&format!("p{i}"), &format!("pl{i}"), T0 + 100 + i as i64);
            r.source = Some("vllm-0".into());
            r.ok = true;
            r.latency_ms = Some(1000 + i * 10);
            rows.push(r);
        }
        rows
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_example_query_runs_on_both_databases_with_the_same_answer() {
        let rows = workload();
        let mut results = Vec::new();
        for db in TestDb::all().await {
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            for r in &rows {
                rec.record(r.clone());
            }
            rec.flush().await.unwrap();
            rec.shutdown().await;
            let mut per_db = Vec::new();
            for (name, sql) in queries::ALL {
                per_db.push((name, run(&db, sql).await));
            }

            let hedge = &per_db
                .iter()
                .find(|(n, _)| *n == "hedge win rate")
                .unwrap()
                .1[0];
            assert_eq!(num(get(hedge, "hedged_calls")), 2.0, "{}", db.name());
            assert_eq!(num(get(hedge, "hedge_wins")), 1.0);
            assert!((num(get(hedge, "hedge_win_rate")) - 0.5).abs() < 1e-12);

            let gap = &per_db
                .iter()
                .find(|(n, _)| *n == "accounting gap")
                .unwrap()
                .1[0];
            assert_eq!(num(&gap[0].1), expected_gap(&rows) as f64);

            let p99 = &per_db
                .iter()
                .find(|(n, _)| *n == "p99 latency per source")
                .unwrap()
                .1;
            let vllm = p99
                .iter()
                .find(|r| get(r, "source") == &Cell::Text("vllm-0".into()))
                .unwrap();
            // 201 ok vllm-0 attempts (c8 at 61 s plus 1000..2990): rank ceil(0.99·201) = 199.
            assert_eq!(num(get(vllm, "attempts")), 201.0);
            assert_eq!(num(get(vllm, "p99_latency_ms")), 2980.0);

            let stall = &per_db
                .iter()
                .find(|(n, _)| *n == "stall share per source")
                .unwrap()
                .1;
            let ds = stall
                .iter()
                .find(|r| get(r, "source") == &Cell::Text("deepseek-0".into()))
                .unwrap();
            // deepseek-0 ok streamed: c1 (1100 of 2300) and h2a (100 of 500).
            assert!((num(get(ds, "stall_share")) - 1200.0 / 2800.0).abs() < 1e-12);

            let costs = &per_db
                .iter()
                .find(|(n, _)| *n == "cost per source")
                .unwrap()
                .1;
            let ds = costs
                .iter()
                .find(|r| get(r, "source") == &Cell::Text("deepseek-0".into()))
                .unwrap();
            // deepseek-0 attempts: c1, c3a, c4, c6, c9, h2a; priced: c1 and c9.
            assert_eq!(num(get(ds, "attempts")), 6.0);
            assert_eq!(num(get(ds, "priced_attempts")), 2.0);
            assert_eq!(num(get(ds, "unknown_cost_attempts")), 4.0);
            let want = (1200.0 * 0.27 + 350.0 * 1.10 + 512.0 * 0.27) / 1e6;
            assert!((num(get(ds, "cost")) - want).abs() < 1e-12);

            let errors = &per_db
                .iter()
                .find(|(n, _)| *n == "errors per source")
                .unwrap()
                .1;
            assert!(errors
                .iter()
                .any(|r| get(r, "error") == &Cell::Text("hedge_cancelled".into())));

            let by = |name: &str, source: &str| {
                per_db
                    .iter()
                    .find(|(n, _)| *n == name)
                    .unwrap()
                    .1
                    .iter()
                    .find(|r| get(r, "source") == &Cell::Text(source.into()))
                    .cloned()
                    .unwrap_or_else(|| panic!("{name}: no row for {source}"))
            };
            // deepseek-0 with known usage: c1 (1200, 1024 cached, 64 written), c9 (512,
            // caching not reported); qwen-0: c3b (900, 512 cached).
            let ds = by("cache hit share per source", "deepseek-0");
            assert_eq!(num(get(&ds, "prompt_tokens")), 1712.0, "{}", db.name());
            assert_eq!(num(get(&ds, "cached_prompt_tokens")), 1024.0);
            assert_eq!(num(get(&ds, "cache_write_tokens")), 64.0);
            assert!((num(get(&ds, "cache_hit_share")) - 1024.0 / 1712.0).abs() < 1e-12);
            let qw = by("cache hit share per source", "qwen-0");
            assert!((num(get(&qw, "cache_hit_share")) - 512.0 / 900.0).abs() < 1e-12);
            let ds = by("cache saving per source", "deepseek-0");
            assert!((num(get(&ds, "saving")) - 1024.0 * 0.20 / 1e6).abs() < 1e-15);
            let qw = by("cache saving per source", "qwen-0");
            assert!((num(get(&qw, "saving")) - 512.0 * 0.6 / 1e6).abs() < 1e-15);
            // deepseek-0 unavailable attempts: c3a (900/42), c4 (1200/0), c6 (800/150),
            // h2a (no estimate).
            let ds = by("accounting gap in tokens per source", "deepseek-0");
            assert_eq!(num(get(&ds, "unavailable_attempts")), 4.0, "{}", db.name());
            assert_eq!(num(get(&ds, "estimated_attempts")), 3.0);
            assert_eq!(num(get(&ds, "est_prompt_tokens")), 2900.0);
            assert_eq!(num(get(&ds, "est_received_tokens")), 192.0);
            results.push((db.name(), per_db));
        }
        if let [(_, a), (_, b)] = results.as_slice() {
            for ((name, ta), (_, tb)) in a.iter().zip(b) {
                same_tables(ta, tb, name);
            }
        }
    }

    #[test]
    fn docs_quote_every_example_query() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/TELEMETRY.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        for (name, sql) in queries::ALL {
            assert!(
                doc.contains(sql),
                "docs/TELEMETRY.md must quote the `{name}` query verbatim"
            );
        }
        for col in polygw_telemetry_sql::COLUMNS {
            assert!(
                doc.contains(&format!("| `{col}` |")),
                "docs/TELEMETRY.md must document `{col}`"
            );
        }
        for label in polygw_core::ErrorLabel::ALL {
            assert!(
                doc.contains(&format!("`{}`", label.as_str())),
                "label {}",
                label.as_str()
            );
        }
    }
}

mod responses {
    use std::sync::Arc;
    use std::time::Duration;

    use async_trait::async_trait;
    use polygw_core::ports::ResponseStore;
    use polygw_telemetry_sql::{
        Backend, RecorderConfig, SqlRecorder, SqlResponseStore, PURGE_BATCH, STORE_PG_CONNECTIONS,
    };
    use polygw_testkit::store_contract::{self as sc, entry, StoreHarness, T0, UNBOUNDED};
    use sqlx::Connection;

    use crate::common::*;

    /// One database per case; `other` is a second recorder on it (another connection,
    /// and on PostgreSQL another pool).
    struct Sql {
        _db: TestDb,
        store: SqlResponseStore,
        other: SqlResponseStore,
        _recorders: (SqlRecorder, SqlRecorder),
    }

    impl Sql {
        async fn open(db: TestDb) -> Sql {
            let a = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            let b = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            Sql {
                store: a.response_store(),
                other: b.response_store(),
                _recorders: (a, b),
                _db: db,
            }
        }
    }

    #[async_trait]
    impl StoreHarness for Sql {
        async fn store(&self) -> Arc<dyn ResponseStore> {
            Arc::new(self.store.clone())
        }
        async fn other(&self) -> Arc<dyn ResponseStore> {
            Arc::new(self.other.clone())
        }
    }

    macro_rules! cases {
        ($($name:ident),* $(,)?) => {
            mod sqlite {
                use super::*;
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        sc::$name(&Sql::open(TestDb::sqlite()).await).await;
                    }
                )*
            }
            mod postgres {
                use super::*;
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        let Some(db) = TestDb::pg().await else { return };
                        sc::$name(&Sql::open(db).await).await;
                    }
                )*
            }
        };
    }

    cases!(
        put_get_round_trip,
        another_scopes_id_is_invisible,
        expired_entries_are_never_returned,
        delete_returns_true_then_false,
        put_replaces,
        large_values_round_trip,
        many_entries,
        concurrent_clients,
        chains_link_turns_and_renew_them,
        an_owner_is_bounded_and_never_evicts_another,
    );

    #[test]
    fn every_contract_case_runs_here() {
        let here = include_str!("telemetry.rs");
        for case in sc::CASES {
            assert!(here.contains(&format!("        {case},\n")), "{case}");
        }
    }

    /// A put deletes at most `PURGE_BATCH` expired rows (the oldest first) and never a
    /// live one; the rows are in the table until purged, never returned.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn puts_purge_expired_rows_in_bounded_batches() {
        for db in TestDb::all().await {
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            let s = rec.response_store();
            let n = PURGE_BATCH as usize * 2 + 10;
            for i in 0..n {
                let mut r = entry("S", &format!("old{i}"), "x");
                r.expires_at_ms = T0 + 10 + i as i64;
                s.put(r, UNBOUNDED).await.unwrap();
            }
            s.put(entry("S", "live", "x"), UNBOUNDED).await.unwrap();
            assert_eq!(s.len().await.unwrap(), n as u64 + 1, "{}", db.name());
            // Every old row expired by T0 + 10 + n; a put at that time purges one batch.
            let mut later = entry("S", "later", "x");
            later.created_at_ms = T0 + 10 + n as i64;
            s.put(later.clone(), UNBOUNDED).await.unwrap();
            assert_eq!(
                s.len().await.unwrap(),
                (n + 2) as u64 - PURGE_BATCH as u64,
                "{}",
                db.name()
            );
            assert!(
                s.get("S", "old0", T0).await.unwrap().is_none(),
                "the oldest went first"
            );
            assert!(s
                .get("S", &format!("old{}", n - 1), T0)
                .await
                .unwrap()
                .is_some());
            assert!(s
                .get("S", &format!("old{}", n - 1), later.created_at_ms)
                .await
                .unwrap()
                .is_none());
            // The rest, batch by batch; the live rows stay.
            assert_eq!(
                s.purge_expired(later.created_at_ms, 1_000).await.unwrap(),
                (n - PURGE_BATCH as usize) as u64
            );
            assert_eq!(s.len().await.unwrap(), 2);
            assert!(s
                .get("S", "live", later.created_at_ms)
                .await
                .unwrap()
                .is_some());
            rec.shutdown().await;
        }
    }

    /// Rows of migration 4's table (each holding its whole conversation) are still read,
    /// as turns that continue nothing, continued by new turns, deleted and purged; new
    /// turns never go there (an older binary does not see them: a 404, never a shortened
    /// conversation).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rows_stored_before_turns_are_read_as_whole_conversations() {
        for db in TestDb::all().await {
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            let s = rec.response_store();
            let old = entry("S", "resp_old", "stored whole");
            let response = serde_json::to_string(&old.response).unwrap();
            let items = serde_json::to_string(&old.input_items).unwrap();
            db.exec(&format!(
                "INSERT INTO polygw_responses (id, scope, response, input_items, created_at_ms, \
                 expires_at_ms) VALUES ('resp_old', 'S', '{}', '{}', {}, {})",
                response.replace('\'', "''"),
                items.replace('\'', "''"),
                old.created_at_ms,
                old.expires_at_ms
            ))
            .await;
            assert_eq!(
                s.get("S", "resp_old", T0).await.unwrap().as_ref(),
                Some(&old)
            );
            let mut next = entry("S", "resp_new", "a turn");
            next.previous_id = Some("resp_old".into());
            s.put(next.clone(), UNBOUNDED).await.unwrap();
            let chain = s.chain("S", "resp_new", T0).await.unwrap();
            assert_eq!(chain, [next, old.clone()], "{}", db.name());
            assert_eq!(s.chain("S", "resp_old", T0).await.unwrap(), [old]);
            assert_eq!(
                db.scalar("SELECT COUNT(*) FROM polygw_responses").await,
                1,
                "new turns are not written to the old table"
            );
            assert!(s.delete("S", "resp_old").await.unwrap());
            assert_eq!(s.get("S", "resp_old", T0).await.unwrap(), None);
            let chain = s.chain("S", "resp_new", T0).await.unwrap();
            assert!(polygw_core::ports::conversation(&chain).is_err());
            rec.shutdown().await;
        }
    }

    /// SQLite: the store keeps the recorder's connection (and writer) while it lives,
    /// also after every recorder handle is dropped; `shutdown` ends it on both backends,
    /// and later calls fail with an error saying so.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_store_lives_with_its_handles_and_ends_with_shutdown() {
        for db in TestDb::all().await {
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            let s = rec.response_store();
            assert_eq!(s.backend(), db.backend());
            let monitor = rec.monitor();
            drop(rec);
            s.put(entry("S", "r", "x"), UNBOUNDED).await.unwrap();
            assert!(
                s.get("S", "r", T0).await.unwrap().is_some(),
                "{}",
                db.name()
            );
            if db.backend() == Backend::Sqlite {
                assert!(
                    !monitor.is_stopped(),
                    "the shared connection's writer lives on"
                );
            }
            drop(s);
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            let s = rec.response_store();
            assert!(
                s.get("S", "r", T0).await.unwrap().is_some(),
                "{}",
                db.name()
            );
            rec.shutdown().await;
            let e = s.get("S", "r", T0).await.unwrap_err().0;
            assert!(e.contains("shut down"), "{}: {e}", db.name());
            assert!(s.put(entry("S", "r2", "x"), UNBOUNDED).await.is_err());
        }
    }

    /// An in-memory SQLite database exists on its one connection: the store shares it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_in_memory_sqlite_database_serves_the_store() {
        let rec = SqlRecorder::connect("sqlite::memory:", fast_config())
            .await
            .unwrap();
        let s = rec.response_store();
        let r = entry("S", "mem", "in memory");
        s.put(r.clone(), UNBOUNDED).await.unwrap();
        assert_eq!(s.get("S", "mem", T0).await.unwrap(), Some(r));
        rec.shutdown().await;
    }

    /// PostgreSQL: the store has connections of its own (at most STORE_PG_CONNECTIONS,
    /// opened on first use), so the writer's one connection is never in its way; each
    /// operation is bounded by write_timeout, a hung server included.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_store_has_its_own_bounded_connections() {
        let Some(db) = TestDb::pg().await else { return };
        let TestDb::Pg(schema) = &db else {
            unreachable!()
        };
        let app = polygw_testkit::services::unique_name("store").to_lowercase();
        let url = format!("{}&application_name={app}", schema.url);
        let conns = || {
            let app = app.clone();
            let db = &db;
            async move {
                db.scalar(&format!(
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = '{app}'"
                ))
                .await
            }
        };
        let rec = SqlRecorder::connect(&url, fast_config()).await.unwrap();
        let s = rec.response_store();
        assert_eq!(
            conns().await,
            1,
            "the writer's; the store opens on first use"
        );
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let s = s.clone();
                tokio::spawn(async move {
                    s.put(entry("S", &format!("r{i}"), "x"), UNBOUNDED)
                        .await
                        .unwrap();
                    s.get("S", &format!("r{i}"), T0).await.unwrap().unwrap();
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let n = conns().await;
        assert!(
            (2..=1 + STORE_PG_CONNECTIONS as i64).contains(&n),
            "{n} connections"
        );
        rec.shutdown().await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while conns().await != 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if conns().await != 0 {
            let mut c = sqlx::PgConnection::connect(db.url()).await.unwrap();
            let left: Vec<(Option<String>, Option<String>, Option<String>)> =
                sqlx::query_as(&format!(
                    "SELECT state, query, backend_start::TEXT FROM pg_stat_activity \
                 WHERE application_name = '{app}'"
                ))
                .fetch_all(&mut c)
                .await
                .unwrap();
            panic!("connections left open 10 s after shutdown: {left:?}");
        }

        // A hung server: every store call ends within write_timeout, with an error.
        let proxy = Proxy::start(pg_addr(schema.base())).await;
        let cfg = RecorderConfig {
            write_timeout: Duration::from_millis(500),
            ..fast_config()
        };
        let rec = SqlRecorder::connect(&via(&schema.url, proxy.addr), cfg)
            .await
            .unwrap();
        let s = rec.response_store();
        s.put(entry("S", "before", "x"), UNBOUNDED).await.unwrap();
        proxy.hang().await;
        let t = tokio::time::Instant::now();
        let e = s.get("S", "before", T0).await.unwrap_err().0;
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        assert!(!e.is_empty());
        let t = tokio::time::Instant::now();
        assert!(s.put(entry("S", "during", "x"), UNBOUNDED).await.is_err());
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        proxy.resume();
        wait_until(
            "the store to answer again",
            Duration::from_secs(30),
            || async { s.get("S", "before", T0).await.is_ok_and(|r| r.is_some()) },
        )
        .await;
        rec.shutdown().await;
    }
}

mod logging {
    use std::io::Write;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use polygw_core::ports::telemetry::TelemetryRecorder;
    use polygw_telemetry_sql::{RecorderConfig, SqlRecorder};
    use tracing_subscriber::fmt::MakeWriter;

    use crate::common::*;

    /// Log output captured in memory.
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl Write for Capture {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Capture {
        type Writer = Capture;
        fn make_writer(&'a self) -> Capture {
            self.clone()
        }
    }

    impl Capture {
        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
        }
        fn count(&self, what: &str) -> usize {
            self.text().matches(what).count()
        }
        /// Installs it for this thread (the tests run on a current-thread runtime, so the
        /// writer task logs here too).
        fn install(&self) -> tracing::subscriber::DefaultGuard {
            let sub = tracing_subscriber::fmt()
                .with_writer(self.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::INFO)
                .finish();
            tracing::subscriber::set_default(sub)
        }
    }

    const FAILED: &str = "telemetry write failed";

    #[tokio::test]
    async fn a_failing_database_warns_once_per_interval_and_its_return_is_logged() {
        let logs = Capture::default();
        let _g = logs.install();
        let db = TestDb::sqlite_with_schema().await;
        let cfg = RecorderConfig {
            retry_min: Duration::from_millis(5),
            retry_max: Duration::from_millis(20),
            write_timeout: Duration::from_millis(100),
            flush_timeout: Duration::from_millis(150),
            warn_interval: Duration::from_secs(3600),
            ..fast_config()
        };
        let rec = SqlRecorder::connect(db.url(), cfg).await.unwrap();
        let mut locker = sqlite_conn(db.url()).await;
        sqlx::raw_sql("BEGIN EXCLUSIVE")
            .execute(&mut locker)
            .await
            .unwrap();
        for r in numbered("w", 0, 10) {
            rec.record(r);
        }
        // Each flush cuts the backoff short: at least one more failed write per flush.
        for _ in 0..6 {
            assert_eq!(rec.flush().await.unwrap().pending, 10);
        }
        assert_eq!(
            logs.count(FAILED),
            1,
            "one warning per interval:\n{}",
            logs.text()
        );
        sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
        wait_until("the queue to drain", Duration::from_secs(30), || async {
            rec.flush().await.unwrap().pending == 0
        })
        .await;
        let text = logs.text();
        let back = text
            .lines()
            .find(|l| l.contains("telemetry database is back"))
            .unwrap_or_else(|| panic!("recovery is logged:\n{text}"));
        let failures: u64 = back
            .split("failures=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .unwrap()
            .parse()
            .unwrap();
        assert!(failures >= 6, "{back}");
        assert_eq!(logs.count(FAILED), 1);
        rec.shutdown().await;
    }

    #[tokio::test]
    async fn warnings_are_rate_limited_and_never_show_the_password() {
        let Some(db) = TestDb::pg().await else { return };
        let TestDb::Pg(schema) = &db else {
            unreachable!()
        };
        let logs = Capture::default();
        let _g = logs.install();
        let proxy = Proxy::start(pg_addr(schema.base())).await;
        // The local server trusts local connections: the password is carried, not checked.
        let mut u = url::Url::parse(&via(&schema.url, proxy.addr)).unwrap();
        u.set_password(Some("hunter2-s3cret")).unwrap();
        let url = u.to_string();
        let interval = Duration::from_millis(300);
        let cfg = RecorderConfig {
            retry_min: Duration::from_millis(5),
            retry_max: Duration::from_millis(30),
            warn_interval: interval,
            flush_timeout: Duration::from_millis(200),
            ..fast_config()
        };
        let rec = SqlRecorder::connect(&url, cfg).await.unwrap();
        assert!(!rec.url_label().contains("hunter2"));
        proxy.stop().await;
        let down = tokio::time::Instant::now();
        for r in numbered("p", 0, 20) {
            rec.record(r);
        }
        wait_until("a second warning", Duration::from_secs(30), || async {
            rec.flush().await.unwrap();
            logs.count(FAILED) >= 2
        })
        .await;
        let elapsed = down.elapsed();
        let warned = logs.count(FAILED) as u128;
        assert!(
            warned <= elapsed.as_millis() / interval.as_millis() + 1,
            "{warned} warnings in {elapsed:?} with one allowed per {interval:?}"
        );
        proxy.resume();
        wait_until("the queue to drain", Duration::from_secs(30), || async {
            rec.flush().await.unwrap().pending == 0
        })
        .await;
        assert_eq!(db.count().await, 20);
        rec.shutdown().await;
        let text = logs.text();
        assert!(text.contains(FAILED));
        assert!(
            !text.contains("hunter2"),
            "a password reached the logs:\n{text}"
        );
    }
}

/// Client keys (SPEC §21.1) in both databases: stored by hash, unique ids, names and
/// hashes with errors that say which, updates in place, found by id before name.
mod client_keys {
    use std::time::Duration;

    use polygw_core::client_key::{ClientKey, KeyLimits};
    use polygw_core::ports::ClientKeyStore;
    use polygw_telemetry_sql::SqlKeyStore;

    use crate::common::TestDb;

    fn key(id: &str, name: &str, hash: &str) -> ClientKey {
        ClientKey {
            id: id.into(),
            name: name.into(),
            hash: hash.into(),
            prefix: "pgw-abcdef".into(),
            scopes: vec!["LLM".into()],
            models: vec![],
            limits: KeyLimits {
                rpm: 60,
                tpm: 0,
                max_concurrency: 4,
                budget_day_nanos: Some(25_000_000_000),
                budget_month_nanos: None,
            },
            created_at_ms: 1,
            updated_at_ms: 1,
            revoked_at_ms: None,
        }
    }

    #[tokio::test]
    async fn keys_round_trip_and_refuse_duplicates() {
        for db in TestDb::all().await {
            let s = SqlKeyStore::connect(db.url(), Duration::from_secs(10))
                .await
                .unwrap();
            let a = key("key_a", "batch", "h1");
            s.create(a.clone()).await.unwrap();
            assert_eq!(s.list().await.unwrap(), vec![a.clone()], "{}", db.name());
            for (dup, what) in [
                (key("key_a", "other", "h2"), "the id"),
                (key("key_b", "batch", "h2"), "the name"),
                (key("key_b", "other", "h1"), "the key"),
            ] {
                let e = s.create(dup).await.unwrap_err().to_string();
                assert!(e.contains(what), "{}: {e}", db.name());
                assert!(!e.contains("h1"), "no hash in errors: {e}");
            }
            let mut b = key("key_b", "key_a", "h3");
            b.created_at_ms = 2;
            b.updated_at_ms = 2;
            s.create(b.clone()).await.unwrap();
            assert_eq!(
                s.find("key_a").await.unwrap(),
                Some(a.clone()),
                "id before name"
            );
            assert_eq!(s.find("batch").await.unwrap(), Some(a.clone()));
            assert_eq!(s.find("nope").await.unwrap(), None);
            let mut a2 = a.clone();
            a2.hash = "h4".into();
            a2.limits.budget_month_nanos = Some(100_000_000_000);
            a2.limits.budget_day_nanos = None;
            a2.models = vec!["gpt".into()];
            a2.revoked_at_ms = Some(9);
            a2.updated_at_ms = 9;
            assert!(s.update(a2.clone()).await.unwrap());
            assert!(!s.update(key("key_z", "z", "hz")).await.unwrap());
            assert_eq!(s.list().await.unwrap(), vec![a2, b], "{}", db.name());
            s.close().await;
        }
    }

    /// SPEC §24.2: a row that cannot be read (its scopes are no JSON) is denied, and the
    /// other keys keep loading — revocations keep applying.
    #[tokio::test]
    async fn a_row_that_cannot_be_read_is_denied_and_the_rest_load() {
        for db in TestDb::all().await {
            let s = SqlKeyStore::connect(db.url(), Duration::from_secs(10))
                .await
                .unwrap();
            let good = key("key_good", "good", "hg");
            s.create(good.clone()).await.unwrap();
            s.create(key("key_bad", "bad", "hb")).await.unwrap();
            let sql = "UPDATE polygw_client_keys SET scopes = 'not json' WHERE id = 'key_bad'";
            if db.url().starts_with("sqlite") {
                let mut c = <sqlx::SqliteConnection as sqlx::Connection>::connect(db.url())
                    .await
                    .unwrap();
                sqlx::query(sql).execute(&mut c).await.unwrap();
            } else {
                let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(db.url())
                    .await
                    .unwrap();
                sqlx::query(sql).execute(&mut c).await.unwrap();
            }
            let keys = s.list().await.unwrap();
            assert_eq!(keys.len(), 2, "{}", db.name());
            let find = |id: &str| keys.iter().find(|k| k.id == id).unwrap();
            assert_eq!(find("key_good"), &good);
            let bad = find("key_bad");
            assert!(
                bad.revoked_at_ms.is_some() && bad.scopes.is_empty(),
                "{}",
                db.name()
            );
            s.close().await;
        }
    }
}

/// What `polygw report` reads besides the rows (SPEC §19.4, §21.1): one logical call's
/// rows, by its id or a row's `call_id`; the client keys' names — nothing secret, and
/// `None` for a database without the table.
mod report_reads {
    use std::time::Duration;

    use polygw_core::client_key::{ClientKey, KeyLimits};
    use polygw_core::ports::telemetry::TelemetryRecorder;
    use polygw_core::ports::ClientKeyStore;
    use polygw_telemetry_sql::{ClientKeyName, SqlKeyStore, SqlRecorder, TelemetryReader};

    use crate::common::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_calls_rows_and_the_key_names_on_both_backends() {
        for db in TestDb::all().await {
            let rec = SqlRecorder::connect(db.url(), fast_config()).await.unwrap();
            for (id, call, at) in [
                ("r-1a", "call-1", T0 + 2),
                ("r-1b", "call-1", T0 + 1),
                ("r-2a", "call-2", T0),
            ] {
                rec.record(attempt(id, call, at));
            }
            assert_eq!(rec.flush().await.unwrap().written, 3, "{}", db.name());
            rec.shutdown().await;
            let reader = TelemetryReader::connect(db.url()).await.unwrap();
            let ids = |rows: Vec<polygw_core::TelemetryRow>| -> Vec<String> {
                rows.into_iter().map(|r| r.call_id).collect()
            };
            for by in ["call-1", "r-1a", "r-1b"] {
                assert_eq!(
                    ids(reader.call_rows(by).await.unwrap()),
                    ["r-1b", "r-1a"],
                    "{}: by {by}, oldest first",
                    db.name()
                );
            }
            assert_eq!(ids(reader.call_rows("r-2a").await.unwrap()), ["r-2a"]);
            assert!(reader.call_rows("nope").await.unwrap().is_empty());
            assert!(reader.call_rows("' OR 1=1 --").await.unwrap().is_empty());
            // The recorder's migrations made the table: empty, then a key and a revoked one.
            assert_eq!(reader.client_key_names().await.unwrap(), Some(vec![]));
            let store = SqlKeyStore::connect(db.url(), Duration::from_secs(10))
                .await
                .unwrap();
            for (id, name, revoked) in [("key_b", "beta", Some(5)), ("key_a", "alpha", None)] {
                store
                    .create(ClientKey {
                        id: id.into(),
                        name: name.into(),
                        hash: format!("hash-of-{id}"),
                        prefix: "pgw-secret".into(),
                        scopes: vec![],
                        models: vec![],
                        limits: KeyLimits::default(),
                        created_at_ms: 1,
                        updated_at_ms: 1,
                        revoked_at_ms: revoked,
                    })
                    .await
                    .unwrap();
            }
            store.close().await;
            let name = |id: &str, name: &str, revoked| ClientKeyName {
                id: id.into(),
                name: name.into(),
                revoked,
            };
            assert_eq!(
                reader.client_key_names().await.unwrap(),
                Some(vec![
                    name("key_a", "alpha", false),
                    name("key_b", "beta", true)
                ]),
                "{}",
                db.name()
            );
            // A database made before client keys has no table: None, not an error.
            db.exec("DROP TABLE polygw_client_keys").await;
            assert_eq!(
                reader.client_key_names().await.unwrap(),
                None,
                "{}",
                db.name()
            );
            reader.close().await;
        }
    }
}
