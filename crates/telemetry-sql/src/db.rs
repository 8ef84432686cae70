//! The two backends behind one enum: opening a pool from a URL, migrating, the batch
//! insert, reading rows back and the accounting-gap count. Runtime-checked queries only.

use std::str::FromStr;
use std::time::Duration;

use polygw_core::secret::redact_url;
use polygw_core::telemetry::ACCOUNTING_GAP_SQL;
use polygw_core::{RowKind, TelemetryError, TelemetryRow, UsageSource};
#[cfg(feature = "postgres")]
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
#[cfg(feature = "sqlite")]
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
#[cfg(feature = "postgres")]
use sqlx::Postgres;
#[cfg(feature = "sqlite")]
use sqlx::Sqlite;
use sqlx::{ConnectOptions, Connection, Row};

#[cfg(not(any(feature = "sqlite", feature = "postgres")))]
compile_error!("polygw-telemetry-sql needs a driver: its `sqlite` or `postgres` feature");

use crate::migrations;
use crate::time::format_utc_ms;
#[cfg(feature = "sqlite")]
use crate::time::parse_utc_ms;

/// How the writers read one column from a row; the variant is also its SQL type.
#[derive(Clone, Copy)]
enum Get {
    /// TEXT (the NOT NULL ones are always `Some`).
    Text(for<'a> fn(&'a TelemetryRow) -> Option<&'a str>),
    /// INTEGER / BIGINT.
    Int(fn(&TelemetryRow) -> Option<i64>),
    /// INTEGER 0/1 / BOOLEAN.
    Bool(fn(&TelemetryRow) -> bool),
    /// REAL / DOUBLE PRECISION.
    Real(fn(&TelemetryRow) -> Option<f64>),
    /// `created_at`: ISO-8601 UTC text / TIMESTAMPTZ (written as the same text).
    Time(fn(&TelemetryRow) -> i64),
}

/// One column of `llm_calls`: its name and how a row gives its value.
#[derive(Clone, Copy)]
struct Column {
    name: &'static str,
    get: Get,
}

const fn col(name: &'static str, get: Get) -> Column {
    Column { name, get }
}

/// The one list both writers bind from (SQLite row by row, PostgreSQL column by column),
/// the reader's types for missing columns and the PostgreSQL array types come from: a
/// column added here is written, typed and read alike by both backends.
const TABLE: [Column; 40] = [
    col("call_id", Get::Text(|r| Some(&r.call_id))),
    col("logical_call_id", Get::Text(|r| Some(&r.logical_call_id))),
    col("scope", Get::Text(|r| Some(&r.scope))),
    col("operation", Get::Text(|r| Some(&r.operation))),
    col("kind", Get::Text(|r| Some(r.kind.as_str()))),
    col("source", Get::Text(|r| r.source.as_deref())),
    col("provider", Get::Text(|r| r.provider.as_deref())),
    col("model", Get::Text(|r| r.model.as_deref())),
    col(
        "attempt_index",
        Get::Int(|r| r.attempt_index.map(i64::from)),
    ),
    col("is_hedge", Get::Bool(|r| r.is_hedge)),
    col("stream", Get::Bool(|r| r.stream)),
    col("ok", Get::Bool(|r| r.ok)),
    col("error", Get::Text(|r| r.error.as_deref())),
    col("error_detail", Get::Text(|r| r.error_detail.as_deref())),
    col("http_status", Get::Int(|r| r.http_status.map(i64::from))),
    col("prompt_tokens", Get::Int(|r| big(r.prompt_tokens))),
    col("completion_tokens", Get::Int(|r| big(r.completion_tokens))),
    col("reasoning_tokens", Get::Int(|r| big(r.reasoning_tokens))),
    col("usage_source", Get::Text(|r| Some(r.usage_source.as_str()))),
    col("cost", Get::Real(|r| r.cost)),
    col("latency_ms", Get::Int(|r| big(r.latency_ms))),
    col("ttft_ms", Get::Int(|r| big(r.ttft_ms))),
    col(
        "max_inter_token_ms",
        Get::Int(|r| big(r.max_inter_token_ms)),
    ),
    col("stall_ms", Get::Int(|r| big(r.stall_ms))),
    col("stall_count", Get::Int(|r| r.stall_count.map(i64::from))),
    col("cache_hit", Get::Bool(|r| r.cache_hit)),
    col("created_at", Get::Time(|r| r.created_at_ms)),
    // Migration 2.
    col("resume_of", Get::Text(|r| r.resume_of.as_deref())),
    col("resume_mode", Get::Text(|r| r.resume_mode.as_deref())),
    col("prefix_chars", Get::Int(|r| big(r.prefix_chars))),
    // Migration 3.
    col("api", Get::Text(|r| r.api.as_deref())),
    col(
        "cached_prompt_tokens",
        Get::Int(|r| big(r.cached_prompt_tokens)),
    ),
    col(
        "cache_write_tokens",
        Get::Int(|r| big(r.cache_write_tokens)),
    ),
    col("est_prompt_tokens", Get::Int(|r| big(r.est_prompt_tokens))),
    col(
        "est_received_tokens",
        Get::Int(|r| big(r.est_received_tokens)),
    ),
    col("client_key_id", Get::Text(|r| r.client_key_id.as_deref())),
    col("trace", Get::Text(|r| r.trace.as_deref())),
    // Migration 6.
    col(
        "agent_session_id",
        Get::Text(|r| r.agent_session_id.as_deref()),
    ),
    col("agent_id", Get::Text(|r| r.agent_id.as_deref())),
    col(
        "parent_agent_id",
        Get::Text(|r| r.parent_agent_id.as_deref()),
    ),
];

/// The columns of `llm_calls`, in table order (SPEC §8; migrations 2 and 3 appended
/// theirs).
pub const COLUMNS: [&str; TABLE.len()] = {
    let mut names = [""; TABLE.len()];
    let mut i = 0;
    while i < TABLE.len() {
        names[i] = TABLE[i].name;
        i += 1;
    }
    names
};

/// `application_name` of polygw's PostgreSQL connections (unless the URL sets one).
pub const APPLICATION_NAME: &str = "polygw-telemetry";

/// Connections of a PostgreSQL [`crate::SqlResponseStore`]'s own pool (at most; opened on
/// first use). The recorder's writer keeps its one connection besides.
pub const STORE_PG_CONNECTIONS: u32 = 2;

/// A PostgreSQL store connection idle this long is closed.
#[cfg(feature = "postgres")]
const STORE_PG_IDLE: Duration = Duration::from_secs(60);

/// The connect options of a PostgreSQL URL, connections named [`APPLICATION_NAME`]
/// unless the URL names them.
#[cfg(feature = "postgres")]
fn pg_options(url: &str) -> Result<PgConnectOptions, TelemetryError> {
    let mut o =
        PgConnectOptions::from_str(url).map_err(|e| err("invalid PostgreSQL URL", &e, url))?;
    // Name the connections in pg_stat_activity, unless the URL does.
    if o.get_application_name().is_none() {
        o = o.application_name(APPLICATION_NAME);
    }
    Ok(o)
}

/// SQLite's default bind-parameter limit (SQLITE_MAX_VARIABLE_NUMBER since 3.32).
pub const SQLITE_MAX_BINDS: usize = 32_766;
/// PostgreSQL's bind-parameter limit (the wire protocol's u16 count).
pub const POSTGRES_MAX_BINDS: usize = 65_535;

/// Which database a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// `sqlite://path.db`, `sqlite:path.db`, `sqlite::memory:`.
    Sqlite,
    /// `postgres://…` or `postgresql://…`.
    Postgres,
}

impl Backend {
    /// The backend of a URL, by its scheme.
    pub fn of_url(url: &str) -> Result<Backend, TelemetryError> {
        let lower = url.trim_start().to_ascii_lowercase();
        if lower.starts_with("sqlite:") {
            Ok(Backend::Sqlite)
        } else if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
            Ok(Backend::Postgres)
        } else {
            Err(TelemetryError(format!(
                "unsupported telemetry URL {}: expected sqlite://PATH or postgres://…",
                redact_url(url)
            )))
        }
    }

    /// Rows per INSERT statement so the statement stays under the bind limit.
    pub fn max_rows_per_statement(self) -> usize {
        let limit = match self {
            Backend::Sqlite => SQLITE_MAX_BINDS,
            Backend::Postgres => POSTGRES_MAX_BINDS,
        };
        limit / COLUMNS.len()
    }

    /// The stored name (`sqlite`, `postgres`).
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }
}

/// What an open is for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpenOptions {
    /// Create the SQLite file when missing (the recorder does; the reader does not).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code, reason = "SQLite only"))]
    pub create: bool,
    /// Bound on connecting and on one operation.
    pub timeout: Duration,
}

/// An open pool.
#[derive(Debug, Clone)]
pub(crate) enum Db {
    #[cfg(feature = "sqlite")]
    Sqlite(SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(PgPool),
}

/// The error for a URL whose driver this build lacks.
#[cfg_attr(
    all(feature = "sqlite", feature = "postgres"),
    allow(dead_code, reason = "used when a driver is off")
)]
pub(crate) fn missing_driver(url: &str, backend: Backend) -> TelemetryError {
    TelemetryError(format!(
        "{}: this build has no {} driver: enable the `{}` cargo feature \
         (of polygw, or of polygw-telemetry-sql)",
        redact_url(url),
        backend.as_str(),
        backend.as_str()
    ))
}

/// A database error as text, without the URL's password should a driver ever echo it.
pub(crate) fn describe(err: &dyn std::fmt::Display, url: &str) -> String {
    let mut text = err.to_string();
    if let Ok(u) = url::Url::parse(url) {
        if let Some(pw) = u.password().filter(|p| !p.is_empty()) {
            text = text.replace(pw, polygw_core::secret::REDACTED);
            let decoded: String = url::form_urlencoded::parse(format!("p={pw}").as_bytes())
                .map(|(_, v)| v.into_owned())
                .next()
                .unwrap_or_default();
            if !decoded.is_empty() {
                text = text.replace(&decoded, polygw_core::secret::REDACTED);
            }
        }
    }
    text
}

pub(crate) fn err(context: &str, e: &dyn std::fmt::Display, url: &str) -> TelemetryError {
    TelemetryError(format!(
        "{context} ({}): {}",
        redact_url(url),
        describe(e, url)
    ))
}

/// Opens (and closes) one connection first: a pool would only say "timed out" where
/// the driver says why (connection refused, authentication failed, no such file).
async fn probe<O>(o: &O, limit: Duration, url: &str, context: &str) -> Result<(), TelemetryError>
where
    O: ConnectOptions,
    O::Connection: Sized,
{
    match tokio::time::timeout(limit, o.connect()).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(err(context, &e, url)),
        Err(_) => Err(err(
            context,
            &format!("no connection within {limit:?}"),
            url,
        )),
    }
}

impl Db {
    /// Opens a pool of one connection (the writer is the only user).
    pub(crate) async fn open(url: &str, opts: OpenOptions) -> Result<Db, TelemetryError> {
        match Backend::of_url(url)? {
            #[cfg(feature = "sqlite")]
            Backend::Sqlite => {
                let o = SqliteConnectOptions::from_str(url)
                    .map_err(|e| err("invalid SQLite URL", &e, url))?
                    .create_if_missing(opts.create)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Normal)
                    .busy_timeout(opts.timeout / 2);
                probe(&o, opts.timeout, url, "cannot open SQLite database").await?;
                // One connection, kept open: SQLite has a single writer anyway, and an
                // in-memory database lives only as long as its connection.
                let pool = SqlitePoolOptions::new()
                    .max_connections(1)
                    .idle_timeout(None)
                    .max_lifetime(None)
                    .acquire_timeout(opts.timeout)
                    .connect_with(o)
                    .await
                    .map_err(|e| err("cannot open SQLite database", &e, url))?;
                Ok(Db::Sqlite(pool))
            }
            #[cfg(not(feature = "sqlite"))]
            Backend::Sqlite => Err(missing_driver(url, Backend::Sqlite)),
            #[cfg(feature = "postgres")]
            Backend::Postgres => {
                let o = pg_options(url)?;
                probe(&o, opts.timeout, url, "cannot connect to PostgreSQL").await?;
                let pool = PgPoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(opts.timeout)
                    .connect_with(o)
                    .await
                    .map_err(|e| err("cannot connect to PostgreSQL", &e, url))?;
                Ok(Db::Postgres(pool))
            }
            #[cfg(not(feature = "postgres"))]
            Backend::Postgres => Err(missing_driver(url, Backend::Postgres)),
        }
    }

    /// The connections of a [`crate::SqlResponseStore`] made from the recorder that
    /// opened `self`. SQLite: the same pool (one connection: SQLite has one writer, and
    /// an in-memory database exists only on its connection). PostgreSQL: a pool of its
    /// own of up to [`STORE_PG_CONNECTIONS`], opened on first use and closed when idle,
    /// so that a GET never queues behind the writer's batch insert.
    pub(crate) fn for_store(&self, url: &str, timeout: Duration) -> Result<Db, TelemetryError> {
        match self {
            #[cfg(feature = "sqlite")]
            Db::Sqlite(p) => {
                let _ = (url, timeout);
                Ok(Db::Sqlite(p.clone()))
            }
            #[cfg(feature = "postgres")]
            Db::Postgres(_) => {
                let pool = PgPoolOptions::new()
                    .max_connections(STORE_PG_CONNECTIONS)
                    .min_connections(0)
                    .idle_timeout(STORE_PG_IDLE)
                    .acquire_timeout(timeout)
                    .connect_lazy_with(pg_options(url)?);
                Ok(Db::Postgres(pool))
            }
        }
    }

    /// The backend.
    pub(crate) fn backend(&self) -> Backend {
        match self {
            #[cfg(feature = "sqlite")]
            Db::Sqlite(_) => Backend::Sqlite,
            #[cfg(feature = "postgres")]
            Db::Postgres(_) => Backend::Postgres,
        }
    }

    /// Whether rows can be written, checked without writing: PostgreSQL — one query
    /// (a primary, transactions not read-only by default, and `INSERT` on `llm_calls`
    /// through the search path); SQLite — the
    /// write lock taken and released (`BEGIN IMMEDIATE`, rolled back when the
    /// transaction is dropped, also if this future is).
    pub(crate) async fn writable(&self) -> Result<bool, sqlx::Error> {
        match self {
            #[cfg(feature = "sqlite")]
            Db::Sqlite(p) => {
                let tx = p.begin_with("BEGIN IMMEDIATE").await?;
                tx.rollback().await?;
                Ok(true)
            }
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => {
                sqlx::query_scalar(
                    "SELECT NOT pg_is_in_recovery() \
                     AND current_setting('transaction_read_only') = 'off' \
                     AND has_table_privilege('llm_calls', 'INSERT')",
                )
                .fetch_one(p)
                .await
            }
        }
    }

    /// Closes the pool.
    pub(crate) async fn close(&self) {
        match self {
            #[cfg(feature = "sqlite")]
            Db::Sqlite(p) => p.close().await,
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => p.close().await,
        }
    }

    /// Refuses a `_sqlx_migrations` table that holds another application's migrations,
    /// then runs the embedded migrations.
    pub(crate) async fn migrate(&self, url: &str) -> Result<(), TelemetryError> {
        let applied: Vec<(i64, String)> = match self {
            #[cfg(feature = "sqlite")]
            Db::Sqlite(p) => {
                let exists: Option<String> = sqlx::query_scalar(
                    "SELECT name FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
                )
                .fetch_optional(p)
                .await
                .map_err(|e| err("cannot read the migrations table", &e, url))?;
                if exists.is_some() {
                    sqlx::query_as("SELECT version, description FROM _sqlx_migrations")
                        .fetch_all(p)
                        .await
                        .map_err(|e| err("cannot read the migrations table", &e, url))?
                } else {
                    Vec::new()
                }
            }
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => {
                let exists: bool =
                    sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
                        .fetch_one(p)
                        .await
                        .map_err(|e| err("cannot read the migrations table", &e, url))?;
                if exists {
                    sqlx::query_as("SELECT version, description FROM _sqlx_migrations")
                        .fetch_all(p)
                        .await
                        .map_err(|e| err("cannot read the migrations table", &e, url))?
                } else {
                    Vec::new()
                }
            }
        };
        if let Some((v, d)) = applied
            .iter()
            .find(|(_, d)| !d.starts_with(migrations::DESCRIPTION_PREFIX))
        {
            return Err(TelemetryError(format!(
                "{}: _sqlx_migrations holds another application's migration ({v} {d:?}); \
                 give polygw telemetry its own SQLite file, or its own PostgreSQL database \
                 or schema (e.g. ?options[search_path]=polygw)",
                redact_url(url)
            )));
        }
        let list = match self.backend() {
            Backend::Sqlite => migrations::SQLITE,
            Backend::Postgres => migrations::POSTGRES,
        };
        let migrator = migrations::migrator(list)
            .await
            .map_err(|e| err("cannot load migrations", &e, url))?;
        // Two processes creating the same fresh database at once may collide (SQLite has
        // no migration lock): the loser retries and then sees the work done.
        let mut tries = 0;
        loop {
            let res = match self {
                #[cfg(feature = "sqlite")]
                Db::Sqlite(p) => migrator.run(p).await,
                #[cfg(feature = "postgres")]
                Db::Postgres(p) => migrator.run(p).await,
            };
            match res {
                Ok(()) => return Ok(()),
                Err(e) if tries < 2 => {
                    tries += 1;
                    tracing::debug!(error = %describe(&e, url), "telemetry migration retry");
                    tokio::time::sleep(Duration::from_millis(100 * tries)).await;
                }
                Err(e) => return Err(err("migration failed", &e, url)),
            }
        }
    }

    /// Inserts rows atomically — SQLite: one transaction (several statements when the
    /// bind limit asks for it); PostgreSQL: one statement — skipping rows whose `call_id`
    /// exists or came earlier in the batch (idempotent).
    pub(crate) async fn insert(&self, rows: &[TelemetryRow]) -> Result<(), sqlx::Error> {
        if rows.is_empty() {
            return Ok(());
        }
        match self {
            // One transaction of multi-row INSERTs whose row counts are powers of two
            // (a batch of 255 rows is 128 + 64 + … + 1): sqlx keeps every statement it
            // prepared in a per-connection cache, one per distinct SQL text, so a text per
            // batch size would hold up to 100 large prepared statements (+55 MiB over
            // batches of every size, benches/statement_cache.rs); powers of two bound
            // them to 10 texts, +2.6 MiB, and full batches stay one cached statement
            // (docs/TELEMETRY.md).
            #[cfg(feature = "sqlite")]
            Db::Sqlite(p) => {
                let mut tx = p.begin().await?;
                for q in sqlite_statements(rows) {
                    q.execute(&mut *tx).await?;
                }
                tx.commit().await
            }
            // One statement per batch whatever its size: every column is bound as one
            // array and `UNNEST` turns the arrays back into rows. The statement text never
            // changes, so it is prepared once per connection, and the server parses 30
            // parameters instead of 30 per row (docs/BENCHMARKS.md, "Telemetry").
            // A single statement is atomic on its own: no BEGIN / COMMIT round trips.
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => pg_unnest_insert(rows).execute(p).await.map(|_| ()),
        }
    }

    /// The columns of `llm_calls` that exist in this database.
    async fn existing_columns(&self) -> Result<Vec<String>, sqlx::Error> {
        match self {
            #[cfg(feature = "sqlite")]
            Db::Sqlite(p) => {
                sqlx::query_scalar("SELECT name FROM pragma_table_info('llm_calls')")
                    .fetch_all(p)
                    .await
            }
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => {
                sqlx::query_scalar(
                    "SELECT column_name::TEXT FROM information_schema.columns \
                     WHERE table_schema = current_schema() AND table_name = 'llm_calls'",
                )
                .fetch_all(p)
                .await
            }
        }
    }

    /// Reads the rows `filter` selects, oldest first (ties by `call_id`).
    /// Columns a database lacks (created by an older polygw) read as NULL.
    pub(crate) async fn read_rows(
        &self,
        url: &str,
        filter: RowFilter<'_>,
    ) -> Result<Vec<TelemetryRow>, TelemetryError> {
        let present = self
            .existing_columns()
            .await
            .map_err(|e| err("cannot read llm_calls", &e, url))?;
        if present.is_empty() {
            return Err(TelemetryError(format!(
                "{}: no llm_calls table (is this a polygw telemetry database?)",
                redact_url(url)
            )));
        }
        let backend = self.backend();
        let select: Vec<String> = COLUMNS
            .iter()
            .map(|c| {
                let has = present.iter().any(|p| p == c);
                match (backend, *c, has) {
                    (Backend::Postgres, "created_at", true) => {
                        "CAST(EXTRACT(EPOCH FROM created_at) * 1000 AS BIGINT) AS created_at"
                            .to_string()
                    }
                    (_, c, true) => c.to_string(),
                    (_, c, false) => format!("CAST(NULL AS {}) AS {c}", null_type(backend, c)),
                }
            })
            .collect();
        let mut sql = format!("SELECT {} FROM llm_calls", select.join(", "));
        let map = |e: sqlx::Error| err("cannot read llm_calls", &e, url);
        match self {
            #[cfg(feature = "sqlite")]
            Db::Sqlite(p) => {
                match filter {
                    RowFilter::Since(None) => {}
                    RowFilter::Since(Some(_)) => sql.push_str(" WHERE created_at >= ?"),
                    RowFilter::Call(_) => sql.push_str(
                        " WHERE logical_call_id = ? OR logical_call_id IN \
                         (SELECT logical_call_id FROM llm_calls WHERE call_id = ?)",
                    ),
                }
                sql.push_str(" ORDER BY created_at, call_id");
                let mut q = sqlx::query(&sql);
                match filter {
                    RowFilter::Since(None) => {}
                    RowFilter::Since(Some(ms)) => q = q.bind(format_utc_ms(ms)),
                    RowFilter::Call(id) => q = q.bind(id).bind(id),
                }
                let rows = q.fetch_all(p).await.map_err(map)?;
                rows.iter().map(|r| decode_sqlite(r, url)).collect()
            }
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => {
                match filter {
                    RowFilter::Since(None) => {}
                    RowFilter::Since(Some(_)) => {
                        sql.push_str(" WHERE created_at >= CAST($1 AS TIMESTAMPTZ)");
                    }
                    RowFilter::Call(_) => sql.push_str(
                        " WHERE logical_call_id = $1 OR logical_call_id IN \
                         (SELECT logical_call_id FROM llm_calls WHERE call_id = $1)",
                    ),
                }
                sql.push_str(" ORDER BY llm_calls.created_at, call_id");
                let mut q = sqlx::query(&sql);
                match filter {
                    RowFilter::Since(None) => {}
                    RowFilter::Since(Some(ms)) => q = q.bind(format_utc_ms(ms)),
                    RowFilter::Call(id) => q = q.bind(id),
                }
                let rows = q.fetch_all(p).await.map_err(map)?;
                rows.iter().map(|r| decode_pg(r, url)).collect()
            }
        }
    }

    /// `(id, name, revoked)` of every client key in `polygw_client_keys` (SPEC §21.1),
    /// nothing secret (no hash, no prefix); `None` when the database has no such table
    /// (made by a polygw older than client keys).
    pub(crate) async fn client_key_names(
        &self,
        url: &str,
    ) -> Result<Option<Vec<(String, String, bool)>>, TelemetryError> {
        const SQL: &str = "SELECT id, name, revoked_at_ms IS NOT NULL FROM polygw_client_keys \
                           ORDER BY id";
        let map = |e: sqlx::Error| err("cannot read polygw_client_keys", &e, url);
        match self {
            #[cfg(feature = "sqlite")]
            Db::Sqlite(p) => {
                let tables: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM sqlite_master \
                     WHERE type = 'table' AND name = 'polygw_client_keys'",
                )
                .fetch_one(p)
                .await
                .map_err(map)?;
                if tables == 0 {
                    return Ok(None);
                }
                sqlx::query_as(SQL)
                    .fetch_all(p)
                    .await
                    .map(Some)
                    .map_err(map)
            }
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => {
                let tables: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM information_schema.tables \
                     WHERE table_schema = current_schema() AND table_name = 'polygw_client_keys'",
                )
                .fetch_one(p)
                .await
                .map_err(map)?;
                if tables == 0 {
                    return Ok(None);
                }
                sqlx::query_as(SQL)
                    .fetch_all(p)
                    .await
                    .map(Some)
                    .map_err(map)
            }
        }
    }

    /// Runs [`ACCOUNTING_GAP_SQL`] (SPEC §8).
    pub(crate) async fn accounting_gap(&self, url: &str) -> Result<u64, TelemetryError> {
        let n: i64 = match self {
            #[cfg(feature = "sqlite")]
            Db::Sqlite(p) => sqlx::query_scalar(ACCOUNTING_GAP_SQL).fetch_one(p).await,
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => sqlx::query_scalar(ACCOUNTING_GAP_SQL).fetch_one(p).await,
        }
        .map_err(|e| err("accounting gap query failed", &e, url))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}

/// Which rows [`Db::read_rows`] reads.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RowFilter<'a> {
    /// Every row (`None`), or those created at or after this instant (ms since the
    /// epoch).
    Since(Option<i64>),
    /// The rows of one logical call: `id` is its `logical_call_id`, or the `call_id` of
    /// one of its rows.
    Call(&'a str),
}

/// The SQL type a missing column is read as.
fn null_type(backend: Backend, column: &str) -> &'static str {
    let get = TABLE.iter().find(|c| c.name == column).map(|c| c.get);
    match (backend, get) {
        (Backend::Sqlite, Some(Get::Int(_) | Get::Bool(_))) => "INTEGER",
        (Backend::Postgres, Some(Get::Int(_))) => "BIGINT",
        (Backend::Postgres, Some(Get::Bool(_))) => "BOOLEAN",
        (Backend::Sqlite, Some(Get::Real(_))) => "REAL",
        (Backend::Postgres, Some(Get::Real(_))) => "DOUBLE PRECISION",
        (Backend::Postgres, Some(Get::Time(_))) => "TIMESTAMPTZ",
        _ => "TEXT",
    }
}

/// `INSERT … SELECT … FROM UNNEST($1::TEXT[], …) ON CONFLICT (call_id) DO NOTHING`: one
/// text whatever the batch size, so one prepared statement per connection.
#[cfg(feature = "postgres")]
static PG_UNNEST_INSERT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let params: Vec<String> = TABLE
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let ty = match c.get {
                Get::Int(_) => "BIGINT",
                Get::Bool(_) => "BOOLEAN",
                Get::Real(_) => "DOUBLE PRECISION",
                // created_at travels as text (the same ISO-8601 form as SQLite's) and is
                // cast in the SELECT.
                Get::Text(_) | Get::Time(_) => "TEXT",
            };
            format!("${}::{ty}[]", i + 1)
        })
        .collect();
    let select: Vec<String> = TABLE
        .iter()
        .map(|c| match c.get {
            Get::Time(_) => format!("CAST(u.{0} AS TIMESTAMPTZ)", c.name),
            _ => format!("u.{}", c.name),
        })
        .collect();
    format!(
        "INSERT INTO llm_calls ({cols}) SELECT {select} FROM UNNEST({params}) AS u({cols}) \
         ON CONFLICT (call_id) DO NOTHING",
        cols = COLUMNS.join(", "),
        select = select.join(", "),
        params = params.join(", "),
    )
});

/// The batch insert of PostgreSQL: one array per column, in [`COLUMNS`] order.
#[cfg(feature = "postgres")]
fn pg_unnest_insert(
    rows: &[TelemetryRow],
) -> sqlx::query::Query<'_, Postgres, sqlx::postgres::PgArguments> {
    let mut q = sqlx::query(PG_UNNEST_INSERT.as_str());
    for c in &TABLE {
        q = match c.get {
            Get::Text(f) => q.bind(rows.iter().map(f).collect::<Vec<_>>()),
            Get::Int(f) => q.bind(rows.iter().map(f).collect::<Vec<_>>()),
            Get::Bool(f) => q.bind(rows.iter().map(f).collect::<Vec<_>>()),
            Get::Real(f) => q.bind(rows.iter().map(f).collect::<Vec<_>>()),
            Get::Time(f) => q.bind(rows.iter().map(|r| format_utc_ms(f(r))).collect::<Vec<_>>()),
        };
    }
    q
}

/// The largest row count of one SQLite INSERT: the largest power of two whose binds stay
/// under SQLite's limit (512 rows of 37 columns).
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_MAX_CHUNK: usize = {
    let max = SQLITE_MAX_BINDS / TABLE.len();
    let mut p = 1;
    while p * 2 <= max {
        p *= 2;
    }
    p
};

/// log2([`SQLITE_MAX_CHUNK`]) + 1: how many distinct INSERT texts the SQLite writer has.
#[cfg(feature = "sqlite")]
const SQLITE_CHUNK_SIZES: usize = SQLITE_MAX_CHUNK.trailing_zeros() as usize + 1;

/// The INSERT texts of the SQLite writer, one per power-of-two row count, built once.
#[cfg(feature = "sqlite")]
static SQLITE_INSERT_SQL: [std::sync::OnceLock<String>; SQLITE_CHUNK_SIZES] =
    [const { std::sync::OnceLock::new() }; SQLITE_CHUNK_SIZES];

/// `INSERT INTO llm_calls (…) VALUES (?, …), … ON CONFLICT (call_id) DO NOTHING` for
/// `rows` rows, `rows` a power of two up to [`SQLITE_MAX_CHUNK`].
#[cfg(feature = "sqlite")]
fn sqlite_insert_sql(rows: usize) -> &'static str {
    assert!(
        rows.is_power_of_two() && rows <= SQLITE_MAX_CHUNK,
        "{rows} rows"
    );
    SQLITE_INSERT_SQL[rows.trailing_zeros() as usize].get_or_init(|| {
        let one = format!("({})", vec!["?"; TABLE.len()].join(", "));
        format!(
            "INSERT INTO llm_calls ({}) VALUES {} ON CONFLICT (call_id) DO NOTHING",
            COLUMNS.join(", "),
            vec![one.as_str(); rows].join(", ")
        )
    })
}

/// Row counts of the statements a batch of `n` rows is written with: powers of two,
/// largest first (`n`'s binary digits, above [`SQLITE_MAX_CHUNK`] in chunks of it).
#[cfg(feature = "sqlite")]
pub(crate) fn sqlite_chunks(mut n: usize) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        if n == 0 {
            return None;
        }
        let size = if n >= SQLITE_MAX_CHUNK {
            SQLITE_MAX_CHUNK
        } else {
            1 << (usize::BITS - 1 - n.leading_zeros())
        };
        n -= size;
        Some(size)
    })
}

/// The statements the SQLite writer runs for a batch, in one transaction. Text is bound
/// by reference (the batch outlives the statements): no copy of each row's strings.
#[cfg(feature = "sqlite")]
fn sqlite_statements(
    rows: &[TelemetryRow],
) -> impl Iterator<Item = sqlx::query::Query<'_, Sqlite, sqlx::sqlite::SqliteArguments<'_>>> {
    let mut rest = rows;
    sqlite_chunks(rows.len()).map(move |n| {
        let (chunk, tail) = rest.split_at(n);
        rest = tail;
        let mut q = sqlx::query(sqlite_insert_sql(n));
        for r in chunk {
            for c in &TABLE {
                q = match c.get {
                    Get::Text(f) => q.bind(f(r)),
                    Get::Int(f) => q.bind(f(r)),
                    Get::Bool(f) => q.bind(f(r)),
                    Get::Real(f) => q.bind(f(r)),
                    Get::Time(f) => q.bind(format_utc_ms(f(r))),
                };
            }
        }
        q
    })
}

/// A u64 as a BIGINT (saturating: no real count reaches 2^63).
fn big(v: Option<u64>) -> Option<i64> {
    v.map(|x| i64::try_from(x).unwrap_or(i64::MAX))
}

/// Reads one column, naming it and the row in the error.
fn get<'r, R, T>(row: &'r R, col: &str, call_id: &str, url: &str) -> Result<T, TelemetryError>
where
    R: Row,
    T: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    // Every SELECT lists the columns in `COLUMNS` order: look the column up by position.
    let idx = COLUMNS
        .iter()
        .position(|c| *c == col)
        .expect("a known column");
    row.try_get::<T, usize>(idx).map_err(|e| {
        TelemetryError(format!(
            "{}: llm_calls row {call_id:?}, column {col}: {}",
            redact_url(url),
            describe(&e, url)
        ))
    })
}

fn unsigned<T: TryFrom<i64>>(
    v: Option<i64>,
    col: &str,
    call_id: &str,
) -> Result<Option<T>, TelemetryError> {
    v.map(|x| {
        T::try_from(x).map_err(|_| {
            TelemetryError(format!(
                "llm_calls row {call_id:?}: column {col} holds {x}, out of range"
            ))
        })
    })
    .transpose()
}

macro_rules! decode_row {
    ($row:expr, $url:expr, $created_at:expr) => {{
        let row = $row;
        let url = $url;
        let call_id: String = get(row, "call_id", "?", url)?;
        let id = call_id.as_str();
        let kind_text: String = get(row, "kind", id, url)?;
        let kind = RowKind::parse(&kind_text).ok_or_else(|| {
            TelemetryError(format!("llm_calls row {id:?}: unknown kind {kind_text:?}"))
        })?;
        let usage_text: String = get(row, "usage_source", id, url)?;
        let usage_source = UsageSource::parse(&usage_text).ok_or_else(|| {
            TelemetryError(format!(
                "llm_calls row {id:?}: unknown usage_source {usage_text:?}"
            ))
        })?;
        let int = |col: &str| -> Result<Option<i64>, TelemetryError> { get(row, col, id, url) };
        let flag = |col: &str| -> Result<bool, TelemetryError> {
            Ok(get::<_, Option<bool>>(row, col, id, url)?.unwrap_or(false))
        };
        let created_at_ms: i64 = $created_at(row, id)?;
        Ok(TelemetryRow {
            logical_call_id: get(row, "logical_call_id", id, url)?,
            scope: get::<_, String>(row, "scope", id, url)?.into(),
            operation: get::<_, String>(row, "operation", id, url)?.into(),
            kind,
            source: get::<_, Option<String>>(row, "source", id, url)?.map(Into::into),
            provider: get::<_, Option<String>>(row, "provider", id, url)?.map(Into::into),
            model: get::<_, Option<String>>(row, "model", id, url)?.map(Into::into),
            attempt_index: unsigned(int("attempt_index")?, "attempt_index", id)?,
            is_hedge: flag("is_hedge")?,
            stream: flag("stream")?,
            ok: flag("ok")?,
            error: get(row, "error", id, url)?,
            error_detail: get(row, "error_detail", id, url)?,
            http_status: unsigned(int("http_status")?, "http_status", id)?,
            prompt_tokens: unsigned(int("prompt_tokens")?, "prompt_tokens", id)?,
            completion_tokens: unsigned(int("completion_tokens")?, "completion_tokens", id)?,
            reasoning_tokens: unsigned(int("reasoning_tokens")?, "reasoning_tokens", id)?,
            usage_source,
            cost: get(row, "cost", id, url)?,
            latency_ms: unsigned(int("latency_ms")?, "latency_ms", id)?,
            ttft_ms: unsigned(int("ttft_ms")?, "ttft_ms", id)?,
            max_inter_token_ms: unsigned(int("max_inter_token_ms")?, "max_inter_token_ms", id)?,
            stall_ms: unsigned(int("stall_ms")?, "stall_ms", id)?,
            stall_count: unsigned(int("stall_count")?, "stall_count", id)?,
            cache_hit: flag("cache_hit")?,
            created_at_ms,
            resume_of: get(row, "resume_of", id, url)?,
            resume_mode: get(row, "resume_mode", id, url)?,
            prefix_chars: unsigned(int("prefix_chars")?, "prefix_chars", id)?,
            api: get(row, "api", id, url)?,
            cached_prompt_tokens: unsigned(
                int("cached_prompt_tokens")?,
                "cached_prompt_tokens",
                id,
            )?,
            cache_write_tokens: unsigned(int("cache_write_tokens")?, "cache_write_tokens", id)?,
            est_prompt_tokens: unsigned(int("est_prompt_tokens")?, "est_prompt_tokens", id)?,
            est_received_tokens: unsigned(int("est_received_tokens")?, "est_received_tokens", id)?,
            client_key_id: get(row, "client_key_id", id, url)?,
            trace: get(row, "trace", id, url)?,
            agent_session_id: get(row, "agent_session_id", id, url)?,
            agent_id: get(row, "agent_id", id, url)?,
            parent_agent_id: get(row, "parent_agent_id", id, url)?,
            call_id,
        })
    }};
}

#[cfg(feature = "sqlite")]
fn decode_sqlite(row: &SqliteRow, url: &str) -> Result<TelemetryRow, TelemetryError> {
    decode_row!(row, url, |row: &SqliteRow, id: &str| {
        let text: String = get(row, "created_at", id, url)?;
        parse_utc_ms(&text).ok_or_else(|| {
            TelemetryError(format!(
                "llm_calls row {id:?}: created_at {text:?} is not ISO-8601 UTC"
            ))
        })
    })
}

#[cfg(feature = "postgres")]
fn decode_pg(row: &PgRow, url: &str) -> Result<TelemetryRow, TelemetryError> {
    decode_row!(row, url, |row: &PgRow, id: &str| get::<_, i64>(
        row,
        "created_at",
        id,
        url
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_schemes() {
        assert_eq!(Backend::of_url("sqlite://x.db").unwrap(), Backend::Sqlite);
        assert_eq!(Backend::of_url("sqlite::memory:").unwrap(), Backend::Sqlite);
        assert_eq!(
            Backend::of_url("postgres://u:p@h/db").unwrap(),
            Backend::Postgres
        );
        assert_eq!(
            Backend::of_url("PostgreSQL://h/db").unwrap(),
            Backend::Postgres
        );
        let e = Backend::of_url("mysql://u:hunter2@h/db").unwrap_err().0;
        assert!(e.contains("unsupported"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[test]
    fn statements_stay_under_the_bind_limits() {
        for b in [Backend::Sqlite, Backend::Postgres] {
            let rows = b.max_rows_per_statement();
            // A default batch (256 rows) is one statement.
            assert!(rows >= 512, "{b:?}: {rows}");
            let limit = match b {
                Backend::Sqlite => SQLITE_MAX_BINDS,
                Backend::Postgres => POSTGRES_MAX_BINDS,
            };
            assert!(rows * COLUMNS.len() <= limit);
            assert!((rows + 1) * COLUMNS.len() > limit);
        }
    }

    fn batch(n: usize) -> Vec<TelemetryRow> {
        (0..n)
            .map(|i| TelemetryRow::new(RowKind::Attempt, format!("c{i}"), "l", "S", "chat", 0))
            .collect()
    }

    /// The memory bug: sqlx caches one prepared statement per distinct SQL text (up to 100
    /// per connection), so the SQLite writer must not make a text per batch size. Over
    /// batches of every size up to the default batch size (and far beyond it), the texts
    /// stay the powers of two: at most log2(largest) + 1, whatever the number of sizes.
    #[cfg(feature = "sqlite")]
    #[test]
    fn the_sqlite_writer_prepares_a_bounded_set_of_statements() {
        use sqlx::{Arguments, Execute};
        let count = |sizes: &mut dyn Iterator<Item = usize>| {
            let mut texts = std::collections::HashSet::new();
            let mut statements = 0;
            for n in sizes {
                let rows = batch(n);
                let mut written = 0;
                for mut q in sqlite_statements(&rows) {
                    let sql = q.sql().to_string();
                    let args = q.take_arguments().unwrap().map_or(0, |a| a.len());
                    // The column list and `ON CONFLICT (call_id)` besides the rows.
                    let values = sql.matches('(').count() - 2;
                    assert_eq!(args, values * COLUMNS.len(), "binds = rows × columns");
                    written += values;
                    statements += 1;
                    texts.insert(sql);
                }
                assert_eq!(written, n, "every row of a batch of {n} is written once");
            }
            (texts.len(), statements)
        };
        let (texts, statements) = count(&mut (1..=256));
        assert_eq!(texts, 9, "1, 2, 4, …, 256 rows");
        // One statement per binary digit of the batch size: at most 8 below 256 rows.
        assert!(statements <= 256 * 8, "{statements}");
        let (texts, _) = count(&mut (257..=3000).step_by(61));
        assert_eq!(
            texts, SQLITE_CHUNK_SIZES,
            "bounded whatever the batch sizes"
        );
        assert_eq!(SQLITE_MAX_CHUNK, 512);
        assert!(SQLITE_MAX_CHUNK * COLUMNS.len() <= SQLITE_MAX_BINDS);
        // A full default batch is one statement.
        assert_eq!(sqlite_chunks(256).collect::<Vec<_>>(), [256]);
        assert_eq!(sqlite_chunks(255).count(), 8);
        assert_eq!(
            sqlite_chunks(1300).collect::<Vec<_>>(),
            [512, 512, 256, 16, 4]
        );
    }

    /// PostgreSQL's batch insert is one text whatever the batch size (UNNEST of one array
    /// per column): one prepared statement per connection.
    #[cfg(feature = "postgres")]
    #[test]
    fn the_postgres_writer_has_one_statement_text() {
        use sqlx::{Arguments, Execute};
        let mut texts = std::collections::HashSet::new();
        for n in 1..=256 {
            let rows = batch(n);
            let mut q = pg_unnest_insert(&rows);
            let args = q.take_arguments().unwrap().map_or(0, |a| a.len());
            assert_eq!(args, COLUMNS.len(), "one array per column");
            texts.insert(q.sql().to_string());
        }
        assert_eq!(texts.len(), 1);
        let sql = texts.into_iter().next().unwrap();
        assert!(
            sql.contains(&format!("${}::TEXT[]", COLUMNS.len())),
            "{sql}"
        );
        assert!(!sql.contains(&format!("${}", COLUMNS.len() + 1)), "{sql}");
    }

    #[test]
    fn every_column_has_its_type() {
        let distinct: std::collections::HashSet<&str> = COLUMNS.iter().copied().collect();
        assert_eq!(distinct.len(), COLUMNS.len());
        for (c, want) in [
            ("trace", ("TEXT", "TEXT")),
            ("api", ("TEXT", "TEXT")),
            ("est_received_tokens", ("INTEGER", "BIGINT")),
            ("cached_prompt_tokens", ("INTEGER", "BIGINT")),
            ("cost", ("REAL", "DOUBLE PRECISION")),
            ("ok", ("INTEGER", "BOOLEAN")),
        ] {
            assert_eq!(
                (
                    null_type(Backend::Sqlite, c),
                    null_type(Backend::Postgres, c)
                ),
                want,
                "{c}"
            );
        }
    }

    #[test]
    fn a_missing_driver_names_its_feature() {
        let e = missing_driver("postgres://u:hunter2@h/db", Backend::Postgres).0;
        assert!(e.contains("`postgres` cargo feature"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[test]
    fn describe_removes_a_password() {
        let url = "postgres://u:s3cr%21t@h/db";
        let e = "auth failed for s3cr%21t and s3cr!t";
        let d = describe(&e, url);
        assert!(!d.contains("s3cr"), "{d}");
    }
}
