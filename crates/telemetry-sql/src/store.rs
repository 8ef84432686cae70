//! [`SqlResponseStore`]: stored OpenAI Responses (SPEC §18.1) in the telemetry database,
//! table `polygw_responses` (migration 4), behind core's
//! [`polygw_core::ports::ResponseStore`] port.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::ports::{ResponseStore, StoredResponse};
use polygw_core::TelemetryError;
use serde_json::Value;

use crate::db::{err, Backend, Db};

/// Expired rows deleted by one `put` at most (the oldest first): bounded work per call,
/// and a table that gains one row per put loses up to this many.
pub const PURGE_BATCH: i64 = 64;

/// What the store handles of one recorder share.
pub(crate) struct StoreBase {
    pub(crate) db: Db,
    /// The URL, for errors (passwords removed by `describe`); never printed as is.
    url: String,
    label: String,
    timeout: Duration,
}

impl fmt::Debug for StoreBase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreBase")
            .field("url", &self.label)
            .field("backend", &self.db.backend())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl StoreBase {
    pub(crate) fn new(db: Db, url: &str, label: &str, timeout: Duration) -> StoreBase {
        StoreBase {
            db,
            url: url.to_string(),
            label: label.to_string(),
            timeout,
        }
    }

    /// Runs one database operation within the timeout, its error described without
    /// the URL's password.
    pub(crate) async fn bounded<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, TelemetryError> {
        let limit = self.timeout;
        match tokio::time::timeout(limit, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(sqlx::Error::PoolClosed)) => Err(TelemetryError(format!(
                "cannot {what} ({}): the telemetry recorder was shut down",
                self.label
            ))),
            Ok(Err(e)) => Err(err(&format!("cannot {what}"), &e, &self.url)),
            Err(_) => Err(TelemetryError(format!(
                "cannot {what} ({}): no answer within {limit:?}",
                self.label
            ))),
        }
    }

    /// The readiness check of [`crate::SqlRecorder`]'s
    /// `TelemetryRecorder::check_writable`, on these connections.
    pub(crate) async fn check_writable(&self) -> Result<(), TelemetryError> {
        match self
            .bounded("check the telemetry database", self.db.writable())
            .await?
        {
            true => Ok(()),
            false => Err(TelemetryError(format!(
                "the telemetry database {} is read-only (a standby, or no INSERT privilege \
                 on llm_calls)",
                self.label
            ))),
        }
    }
}

/// The [`ResponseStore`] of a telemetry database: table `polygw_responses` (primary key
/// `(scope, id)`, an index on `expires_at_ms`), in the database of the
/// [`crate::SqlRecorder`] it was made from ([`crate::SqlRecorder::response_store`]).
///
/// - `put` stores or replaces (`ON CONFLICT (scope, id) DO UPDATE`) and then deletes up to
///   [`PURGE_BATCH`] rows that expired by the new row's `created_at_ms` (a failed purge
///   is only logged at debug level: the row is stored).
/// - `get` never returns a row whose `expires_at_ms` is at or before `now_ms`.
/// - `delete` says whether a row was there (expired or not, until purged).
/// - Every operation is bounded by the recorder's `write_timeout` (connection included).
/// - `response` and `input_items` are stored as JSON text and parsed back: values come back
///   equal, key order aside (numbers as serde_json reads them: integers exactly, floats
///   exactly unless they need more than 15–17 significant digits and the build lacks
///   serde_json's `float_roundtrip`).
/// - SQLite: the recorder's one connection (a GET may wait for a batch insert, a few ms).
///   PostgreSQL: a pool of its own, up to [`crate::STORE_PG_CONNECTIONS`], opened on
///   first use and closed after a minute idle, so a GET never waits behind the writer.
/// - It keeps the database open while it lives, also after every recorder handle is
///   dropped (SQLite: the recorder's writer too). [`crate::SqlRecorder::shutdown`] closes
///   it: later calls fail with an error.
///
/// Cheap to clone (clones share the connections).
#[derive(Clone)]
pub struct SqlResponseStore {
    base: Arc<StoreBase>,
    /// SQLite: the recorder, whose writer owns the shared connection (closing it on stop).
    _keep: Option<Arc<dyn fmt::Debug + Send + Sync>>,
}

impl fmt::Debug for SqlResponseStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlResponseStore")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl SqlResponseStore {
    pub(crate) fn new(
        base: Arc<StoreBase>,
        keep: Option<Arc<dyn fmt::Debug + Send + Sync>>,
    ) -> SqlResponseStore {
        SqlResponseStore { base, _keep: keep }
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.base.db.backend()
    }

    /// Rows in the table now, expired ones included (for tests and metrics).
    pub async fn len(&self) -> Result<u64, TelemetryError> {
        let n: i64 = self
            .bounded("count stored responses", async {
                match &self.base.db {
                    #[cfg(feature = "sqlite")]
                    Db::Sqlite(p) => sqlx::query_scalar(COUNT_SQL).fetch_one(p).await,
                    #[cfg(feature = "postgres")]
                    Db::Postgres(p) => sqlx::query_scalar(COUNT_SQL).fetch_one(p).await,
                }
            })
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Whether the table holds no row.
    pub async fn is_empty(&self) -> Result<bool, TelemetryError> {
        Ok(self.len().await? == 0)
    }

    /// Deletes up to `limit` rows that expired at or before `now_ms`, the oldest first;
    /// how many it deleted. `put` does this with [`PURGE_BATCH`].
    pub async fn purge_expired(&self, now_ms: i64, limit: i64) -> Result<u64, TelemetryError> {
        self.bounded("purge expired responses", async {
            let done = match &self.base.db {
                #[cfg(feature = "sqlite")]
                Db::Sqlite(p) => sqlx::query(PURGE_SQLITE)
                    .bind(now_ms)
                    .bind(limit)
                    .execute(p)
                    .await?
                    .rows_affected(),
                #[cfg(feature = "postgres")]
                Db::Postgres(p) => sqlx::query(PURGE_PG)
                    .bind(now_ms)
                    .bind(limit)
                    .execute(p)
                    .await?
                    .rows_affected(),
            };
            Ok(done)
        })
        .await
    }

    /// Runs one database operation within the timeout.
    async fn bounded<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, TelemetryError> {
        self.base.bounded(what, f).await
    }
}

const COUNT_SQL: &str = "SELECT COUNT(*) FROM polygw_responses";

const UPSERT_TAIL: &str = " ON CONFLICT (scope, id) DO UPDATE SET \
     response = excluded.response, input_items = excluded.input_items, \
     created_at_ms = excluded.created_at_ms, expires_at_ms = excluded.expires_at_ms";

#[cfg(feature = "sqlite")]
static PUT_SQLITE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "INSERT INTO polygw_responses (id, scope, response, input_items, created_at_ms, \
         expires_at_ms) VALUES (?, ?, ?, ?, ?, ?){UPSERT_TAIL}"
    )
});
#[cfg(feature = "postgres")]
static PUT_PG: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "INSERT INTO polygw_responses (id, scope, response, input_items, created_at_ms, \
         expires_at_ms) VALUES ($1, $2, $3, $4, $5, $6){UPSERT_TAIL}"
    )
});

#[cfg(feature = "sqlite")]
const GET_SQLITE: &str = "SELECT response, input_items, created_at_ms, expires_at_ms \
     FROM polygw_responses WHERE scope = ? AND id = ? AND expires_at_ms > ?";
#[cfg(feature = "postgres")]
const GET_PG: &str = "SELECT response, input_items, created_at_ms, expires_at_ms \
     FROM polygw_responses WHERE scope = $1 AND id = $2 AND expires_at_ms > $3";

#[cfg(feature = "sqlite")]
const DELETE_SQLITE: &str = "DELETE FROM polygw_responses WHERE scope = ? AND id = ?";
#[cfg(feature = "postgres")]
const DELETE_PG: &str = "DELETE FROM polygw_responses WHERE scope = $1 AND id = $2";

/// The oldest expired rows, at most a bound, through the `expires_at_ms` index.
#[cfg(feature = "sqlite")]
const PURGE_SQLITE: &str = "DELETE FROM polygw_responses WHERE (scope, id) IN \
     (SELECT scope, id FROM polygw_responses WHERE expires_at_ms <= ? \
      ORDER BY expires_at_ms LIMIT ?)";
#[cfg(feature = "postgres")]
const PURGE_PG: &str = "DELETE FROM polygw_responses WHERE (scope, id) IN \
     (SELECT scope, id FROM polygw_responses WHERE expires_at_ms <= $1 \
      ORDER BY expires_at_ms LIMIT $2)";

/// A stored row as read: `response`, `input_items`, `created_at_ms`, `expires_at_ms`.
type RawRow = (String, String, i64, i64);

fn decode(scope: &str, id: &str, raw: RawRow) -> Result<StoredResponse, TelemetryError> {
    let (response, items, created_at_ms, expires_at_ms) = raw;
    let bad = |what: &str, e: serde_json::Error| {
        TelemetryError(format!(
            "polygw_responses row ({scope:?}, {id:?}): {what} is not valid JSON: {e}"
        ))
    };
    Ok(StoredResponse {
        id: id.to_string(),
        scope: scope.to_string(),
        response: serde_json::from_str::<Value>(&response).map_err(|e| bad("response", e))?,
        input_items: serde_json::from_str::<Vec<Value>>(&items)
            .map_err(|e| bad("input_items", e))?,
        created_at_ms,
        expires_at_ms,
    })
}

#[async_trait]
impl ResponseStore for SqlResponseStore {
    async fn put(&self, r: StoredResponse) -> Result<(), TelemetryError> {
        let bad = |e: serde_json::Error| {
            TelemetryError(format!("response {:?} cannot be stored: {e}", r.id))
        };
        let response = serde_json::to_string(&r.response).map_err(bad)?;
        let items = serde_json::to_string(&r.input_items).map_err(bad)?;
        self.bounded("store a response", async {
            match &self.base.db {
                #[cfg(feature = "sqlite")]
                Db::Sqlite(p) => sqlx::query(PUT_SQLITE.as_str())
                    .bind(r.id.as_str())
                    .bind(r.scope.as_str())
                    .bind(response.as_str())
                    .bind(items.as_str())
                    .bind(r.created_at_ms)
                    .bind(r.expires_at_ms)
                    .execute(p)
                    .await
                    .map(|_| ()),
                #[cfg(feature = "postgres")]
                Db::Postgres(p) => sqlx::query(PUT_PG.as_str())
                    .bind(r.id.as_str())
                    .bind(r.scope.as_str())
                    .bind(response.as_str())
                    .bind(items.as_str())
                    .bind(r.created_at_ms)
                    .bind(r.expires_at_ms)
                    .execute(p)
                    .await
                    .map(|_| ()),
            }
        })
        .await?;
        // Opportunistic, bounded: the stored row does not depend on it.
        if let Err(e) = self.purge_expired(r.created_at_ms, PURGE_BATCH).await {
            tracing::debug!(error = %e.0, "purging expired responses failed");
        }
        Ok(())
    }

    async fn get(
        &self,
        scope: &str,
        id: &str,
        now_ms: i64,
    ) -> Result<Option<StoredResponse>, TelemetryError> {
        let raw: Option<RawRow> = self
            .bounded("read a stored response", async {
                match &self.base.db {
                    #[cfg(feature = "sqlite")]
                    Db::Sqlite(p) => {
                        sqlx::query_as(GET_SQLITE)
                            .bind(scope)
                            .bind(id)
                            .bind(now_ms)
                            .fetch_optional(p)
                            .await
                    }
                    #[cfg(feature = "postgres")]
                    Db::Postgres(p) => {
                        sqlx::query_as(GET_PG)
                            .bind(scope)
                            .bind(id)
                            .bind(now_ms)
                            .fetch_optional(p)
                            .await
                    }
                }
            })
            .await?;
        raw.map(|raw| decode(scope, id, raw)).transpose()
    }

    async fn delete(&self, scope: &str, id: &str) -> Result<bool, TelemetryError> {
        let n = self
            .bounded("delete a stored response", async {
                let done = match &self.base.db {
                    #[cfg(feature = "sqlite")]
                    Db::Sqlite(p) => sqlx::query(DELETE_SQLITE)
                        .bind(scope)
                        .bind(id)
                        .execute(p)
                        .await?
                        .rows_affected(),
                    #[cfg(feature = "postgres")]
                    Db::Postgres(p) => sqlx::query(DELETE_PG)
                        .bind(scope)
                        .bind(id)
                        .execute(p)
                        .await?
                        .rows_affected(),
                };
                Ok(done)
            })
            .await?;
        Ok(n > 0)
    }
}
