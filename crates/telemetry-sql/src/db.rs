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
use sqlx::QueryBuilder;
#[cfg(feature = "sqlite")]
use sqlx::Sqlite;
use sqlx::{ConnectOptions, Connection, Row};

#[cfg(not(any(feature = "sqlite", feature = "postgres")))]
compile_error!("polygw-telemetry-sql needs a driver: its `sqlite` or `postgres` feature");

use crate::migrations;
use crate::time::format_utc_ms;
#[cfg(feature = "sqlite")]
use crate::time::parse_utc_ms;

/// The columns of `llm_calls`, in table order (SPEC §8).
pub const COLUMNS: [&str; 30] = [
    "call_id",
    "logical_call_id",
    "scope",
    "operation",
    "kind",
    "source",
    "provider",
    "model",
    "attempt_index",
    "is_hedge",
    "stream",
    "ok",
    "error",
    "error_detail",
    "http_status",
    "prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "usage_source",
    "cost",
    "latency_ms",
    "ttft_ms",
    "max_inter_token_ms",
    "stall_ms",
    "stall_count",
    "cache_hit",
    "created_at",
    "resume_of",
    "resume_mode",
    "prefix_chars",
];

/// `application_name` of polygw's PostgreSQL connections (unless the URL sets one).
pub const APPLICATION_NAME: &str = "polygw-telemetry";

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

fn err(context: &str, e: &dyn std::fmt::Display, url: &str) -> TelemetryError {
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
                let mut o = PgConnectOptions::from_str(url)
                    .map_err(|e| err("invalid PostgreSQL URL", &e, url))?;
                // Name the connections in pg_stat_activity, unless the URL does.
                if o.get_application_name().is_none() {
                    o = o.application_name(APPLICATION_NAME);
                }
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

    /// The backend.
    pub(crate) fn backend(&self) -> Backend {
        match self {
            #[cfg(feature = "sqlite")]
            Db::Sqlite(_) => Backend::Sqlite,
            #[cfg(feature = "postgres")]
            Db::Postgres(_) => Backend::Postgres,
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
            #[cfg(feature = "sqlite")]
            Db::Sqlite(p) => {
                let per = Backend::Sqlite.max_rows_per_statement();
                let mut tx = p.begin().await?;
                for chunk in rows.chunks(per) {
                    let mut qb = insert_head::<Sqlite>();
                    qb.push_values(chunk, |mut b, r| {
                        push_common!(b, r);
                        b.push_bind(format_utc_ms(r.created_at_ms));
                        push_resume!(b, r);
                    });
                    qb.push(" ON CONFLICT (call_id) DO NOTHING");
                    qb.build().execute(&mut *tx).await?;
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

    /// Reads rows (all, or those created at or after `since_unix_ms`), oldest first.
    /// Columns a database lacks (created by an older polygw) read as NULL.
    pub(crate) async fn read_rows(
        &self,
        url: &str,
        since_unix_ms: Option<i64>,
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
                if since_unix_ms.is_some() {
                    sql.push_str(" WHERE created_at >= ?");
                }
                sql.push_str(" ORDER BY created_at, call_id");
                let mut q = sqlx::query(&sql);
                if let Some(ms) = since_unix_ms {
                    q = q.bind(format_utc_ms(ms));
                }
                let rows = q.fetch_all(p).await.map_err(map)?;
                rows.iter().map(|r| decode_sqlite(r, url)).collect()
            }
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => {
                if since_unix_ms.is_some() {
                    sql.push_str(" WHERE created_at >= CAST($1 AS TIMESTAMPTZ)");
                }
                sql.push_str(" ORDER BY llm_calls.created_at, call_id");
                let mut q = sqlx::query(&sql);
                if let Some(ms) = since_unix_ms {
                    q = q.bind(format_utc_ms(ms));
                }
                let rows = q.fetch_all(p).await.map_err(map)?;
                rows.iter().map(|r| decode_pg(r, url)).collect()
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

/// The SQL type a missing column is read as.
fn null_type(backend: Backend, column: &str) -> &'static str {
    match (backend, column) {
        (_, "cost") => match backend {
            Backend::Sqlite => "REAL",
            Backend::Postgres => "DOUBLE PRECISION",
        },
        (
            _,
            "attempt_index" | "http_status" | "prompt_tokens" | "completion_tokens"
            | "reasoning_tokens" | "latency_ms" | "ttft_ms" | "max_inter_token_ms" | "stall_ms"
            | "stall_count" | "prefix_chars",
        ) => match backend {
            Backend::Sqlite => "INTEGER",
            Backend::Postgres => "BIGINT",
        },
        (Backend::Postgres, "is_hedge" | "stream" | "ok" | "cache_hit") => "BOOLEAN",
        (Backend::Sqlite, "is_hedge" | "stream" | "ok" | "cache_hit") => "INTEGER",
        _ => "TEXT",
    }
}

/// `INSERT … SELECT … FROM UNNEST($1::TEXT[], …) ON CONFLICT (call_id) DO NOTHING`.
#[cfg(feature = "postgres")]
static PG_UNNEST_INSERT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let ty = |c: &str| match c {
        "attempt_index" | "http_status" | "prompt_tokens" | "completion_tokens"
        | "reasoning_tokens" | "latency_ms" | "ttft_ms" | "max_inter_token_ms" | "stall_ms"
        | "stall_count" | "prefix_chars" => "BIGINT",
        "is_hedge" | "stream" | "ok" | "cache_hit" => "BOOLEAN",
        "cost" => "DOUBLE PRECISION",
        // created_at travels as text (the same ISO-8601 form as SQLite's) and is cast
        // in the SELECT, as the single-row form did.
        _ => "TEXT",
    };
    let params: Vec<String> = COLUMNS
        .iter()
        .enumerate()
        .map(|(i, c)| format!("${}::{}[]", i + 1, ty(c)))
        .collect();
    let select: Vec<String> = COLUMNS
        .iter()
        .map(|c| match *c {
            "created_at" => "CAST(u.created_at AS TIMESTAMPTZ)".to_string(),
            c => format!("u.{c}"),
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
    fn col<'r, T>(rows: &'r [TelemetryRow], f: impl Fn(&'r TelemetryRow) -> T) -> Vec<T> {
        rows.iter().map(f).collect()
    }
    let text = |f: fn(&TelemetryRow) -> &str| col(rows, f);
    let opt_text = |f: fn(&TelemetryRow) -> Option<&str>| col(rows, f);
    let int = |f: fn(&TelemetryRow) -> Option<i64>| col(rows, f);
    let flag = |f: fn(&TelemetryRow) -> bool| col(rows, f);
    sqlx::query(PG_UNNEST_INSERT.as_str())
        .bind(text(|r| &r.call_id))
        .bind(text(|r| &r.logical_call_id))
        .bind(text(|r| &r.scope))
        .bind(text(|r| &r.operation))
        .bind(text(|r| r.kind.as_str()))
        .bind(opt_text(|r| r.source.as_deref()))
        .bind(opt_text(|r| r.provider.as_deref()))
        .bind(opt_text(|r| r.model.as_deref()))
        .bind(int(|r| r.attempt_index.map(i64::from)))
        .bind(flag(|r| r.is_hedge))
        .bind(flag(|r| r.stream))
        .bind(flag(|r| r.ok))
        .bind(opt_text(|r| r.error.as_deref()))
        .bind(opt_text(|r| r.error_detail.as_deref()))
        .bind(int(|r| r.http_status.map(i64::from)))
        .bind(int(|r| big(r.prompt_tokens)))
        .bind(int(|r| big(r.completion_tokens)))
        .bind(int(|r| big(r.reasoning_tokens)))
        .bind(text(|r| r.usage_source.as_str()))
        .bind(col(rows, |r| r.cost))
        .bind(int(|r| big(r.latency_ms)))
        .bind(int(|r| big(r.ttft_ms)))
        .bind(int(|r| big(r.max_inter_token_ms)))
        .bind(int(|r| big(r.stall_ms)))
        .bind(int(|r| r.stall_count.map(i64::from)))
        .bind(flag(|r| r.cache_hit))
        .bind(col(rows, |r| format_utc_ms(r.created_at_ms)))
        .bind(opt_text(|r| r.resume_of.as_deref()))
        .bind(opt_text(|r| r.resume_mode.as_deref()))
        .bind(int(|r| big(r.prefix_chars)))
}

#[cfg(feature = "sqlite")]
fn insert_head<'a, DB: sqlx::Database>() -> QueryBuilder<'a, DB> {
    QueryBuilder::new(format!("INSERT INTO llm_calls ({}) ", COLUMNS.join(", ")))
}

/// A u64 as a BIGINT (saturating: no real count reaches 2^63).
fn big(v: Option<u64>) -> Option<i64> {
    v.map(|x| i64::try_from(x).unwrap_or(i64::MAX))
}

/// Binds the 26 columns before `created_at`, in [`COLUMNS`] order. Text is bound by
/// reference (the batch outlives the statement): no copy of each row's strings.
#[cfg(feature = "sqlite")]
macro_rules! push_common {
    ($b:ident, $r:ident) => {
        $b.push_bind($r.call_id.as_str())
            .push_bind($r.logical_call_id.as_str())
            .push_bind($r.scope.as_str())
            .push_bind($r.operation.as_str())
            .push_bind($r.kind.as_str())
            .push_bind($r.source.as_deref())
            .push_bind($r.provider.as_deref())
            .push_bind($r.model.as_deref())
            .push_bind($r.attempt_index.map(i64::from))
            .push_bind($r.is_hedge)
            .push_bind($r.stream)
            .push_bind($r.ok)
            .push_bind($r.error.as_deref())
            .push_bind($r.error_detail.as_deref())
            .push_bind($r.http_status.map(i64::from))
            .push_bind(big($r.prompt_tokens))
            .push_bind(big($r.completion_tokens))
            .push_bind(big($r.reasoning_tokens))
            .push_bind($r.usage_source.as_str())
            .push_bind($r.cost)
            .push_bind(big($r.latency_ms))
            .push_bind(big($r.ttft_ms))
            .push_bind(big($r.max_inter_token_ms))
            .push_bind(big($r.stall_ms))
            .push_bind($r.stall_count.map(i64::from))
            .push_bind($r.cache_hit);
    };
}
#[cfg(feature = "sqlite")]
use push_common;

/// Binds the columns after `created_at`, in [`COLUMNS`] order.
#[cfg(feature = "sqlite")]
macro_rules! push_resume {
    ($b:ident, $r:ident) => {
        $b.push_bind($r.resume_of.as_deref())
            .push_bind($r.resume_mode.as_deref())
            .push_bind(big($r.prefix_chars));
    };
}
#[cfg(feature = "sqlite")]
use push_resume;

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
            scope: get(row, "scope", id, url)?,
            operation: get(row, "operation", id, url)?,
            kind,
            source: get(row, "source", id, url)?,
            provider: get(row, "provider", id, url)?,
            model: get(row, "model", id, url)?,
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
            assert!(rows >= 1000, "{b:?}: {rows}");
            let limit = match b {
                Backend::Sqlite => SQLITE_MAX_BINDS,
                Backend::Postgres => POSTGRES_MAX_BINDS,
            };
            assert!(rows * COLUMNS.len() <= limit);
            assert!((rows + 1) * COLUMNS.len() > limit);
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
