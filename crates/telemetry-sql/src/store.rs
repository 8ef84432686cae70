//! [`SqlResponseStore`]: stored OpenAI Responses (SPEC §18.1, §24.5) in the telemetry
//! database, table `polygw_response_turns` (migration 7), behind core's
//! [`polygw_core::ports::ResponseStore`] port.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::ports::store::MAX_TURNS;
use polygw_core::ports::{entry_bytes, ResponseStore, StoredResponse};
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

/// The [`ResponseStore`] of a telemetry database: table `polygw_response_turns`
/// (migration 7; primary key `(scope, id)`, indexes on `expires_at_ms` and on
/// `(scope, expires_at_ms)`), in the database of the [`crate::SqlRecorder`] it was made
/// from ([`crate::SqlRecorder::response_store`]). One row per turn (SPEC §24.5): its own
/// input items, its response, the turn it continues (`previous_id`).
///
/// - `put` refuses a row larger than its `max_bytes`; else stores or replaces it
///   (`ON CONFLICT (scope, id) DO UPDATE`), renews the live turns it continues to its
///   expiry (one recursive statement), keeps its owner's rows within `max_bytes` (the
///   rows that expire soonest go first, the new one never: one windowed `DELETE`, run
///   only when a sum says the owner is over), and deletes up to [`PURGE_BATCH`] rows
///   that expired by the new row's `created_at_ms` (a failed renewal, bound or purge is
///   logged: the row is stored). Replicas that put for one owner at once may leave it
///   over its bound until its next put.
/// - `chain` reads a conversation in one recursive query.
/// - Rows of `polygw_responses` (migration 4: one per response, holding its whole
///   conversation) are still read (as turns that continue nothing), deleted and purged;
///   nothing is written there any more.
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

/// Runs `$body` with `$p`, the backend's pool, and `$sql`, the statement `$tpl`
/// (written with SQLite's `?N` parameters) in the backend's syntax.
macro_rules! on_db {
    ($db:expr, $tpl:expr, |$p:ident, $sql:ident| $body:expr) => {
        match $db {
            #[cfg(feature = "sqlite")]
            Db::Sqlite($p) => {
                let $sql: &str = $tpl;
                $body
            }
            #[cfg(feature = "postgres")]
            Db::Postgres($p) => {
                let pg = $tpl.replace('?', "$");
                let $sql: &str = &pg;
                $body
            }
        }
    };
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

    /// Rows in the tables now (turns and migration 4's rows), expired ones included (for
    /// tests and metrics).
    pub async fn len(&self) -> Result<u64, TelemetryError> {
        let n: i64 = self
            .bounded("count stored responses", async {
                on_db!(&self.base.db, COUNT_SQL, |p, q| {
                    sqlx::query_scalar(q).fetch_one(p).await
                })
            })
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Whether the tables hold no row.
    pub async fn is_empty(&self) -> Result<bool, TelemetryError> {
        Ok(self.len().await? == 0)
    }

    /// Bytes `owner`'s turns count now, expired ones included until purged.
    pub async fn owner_bytes(&self, owner: &str) -> Result<u64, TelemetryError> {
        let n: i64 = self
            .bounded("sum stored responses", async {
                on_db!(&self.base.db, OWNER_BYTES_SQL, |p, q| {
                    sqlx::query_scalar(q).bind(owner).fetch_one(p).await
                })
            })
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Deletes up to `limit` rows of each table that expired at or before `now_ms`, the
    /// oldest first; how many it deleted. `put` does this with [`PURGE_BATCH`].
    pub async fn purge_expired(&self, now_ms: i64, limit: i64) -> Result<u64, TelemetryError> {
        self.bounded("purge expired responses", async {
            let mut done = 0;
            for tpl in [PURGE_TURNS, PURGE_LEGACY] {
                done += on_db!(&self.base.db, tpl, |p, q| sqlx::query(q)
                    .bind(now_ms)
                    .bind(limit)
                    .execute(p)
                    .await?
                    .rows_affected());
            }
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

    /// Renews the live turns `r` continues, then bounds its owner (the steps of `put`
    /// after the row is stored).
    async fn after_put(&self, r: &StoredResponse, max_bytes: i64) -> Result<(), TelemetryError> {
        if r.previous_id.is_some() {
            self.bounded("renew a conversation", async {
                on_db!(&self.base.db, RENEW_SQL, |p, q| sqlx::query(q)
                    .bind(r.scope.as_str())
                    .bind(r.id.as_str())
                    .bind(r.expires_at_ms)
                    .bind(r.created_at_ms)
                    .bind(MAX_TURNS as i64)
                    .execute(p)
                    .await
                    .map(|_| ()))
            })
            .await?;
        }
        let held = self.owner_bytes(&r.scope).await?;
        if i64::try_from(held).unwrap_or(i64::MAX) > max_bytes {
            self.bounded("bound a key's stored responses", async {
                on_db!(&self.base.db, BOUND_SQL, |p, q| sqlx::query(q)
                    .bind(r.scope.as_str())
                    .bind(r.id.as_str())
                    .bind(max_bytes)
                    .execute(p)
                    .await
                    .map(|_| ()))
            })
            .await?;
        }
        Ok(())
    }

    /// The live row `id` of `scope` in the table `tpl` reads ([`GET_SQL`] or
    /// [`GET_LEGACY`]: a row of migration 4's table continues nothing).
    async fn get_from(
        &self,
        tpl: &str,
        scope: &str,
        id: &str,
        now_ms: i64,
    ) -> Result<Option<StoredResponse>, TelemetryError> {
        let raw: Option<RawRow> = self
            .bounded("read a stored response", async {
                on_db!(&self.base.db, tpl, |p, q| sqlx::query_as(q)
                    .bind(scope)
                    .bind(id)
                    .bind(now_ms)
                    .fetch_optional(p)
                    .await)
            })
            .await?;
        raw.map(|raw| decode(scope, id, raw)).transpose()
    }
}

const COUNT_SQL: &str = "SELECT (SELECT COUNT(*) FROM polygw_response_turns) \
     + (SELECT COUNT(*) FROM polygw_responses)";

const OWNER_BYTES_SQL: &str = "SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) \
     FROM polygw_response_turns WHERE scope = ?1";

const PUT_SQL: &str = "INSERT INTO polygw_response_turns (id, scope, response, input_items, \
     previous_id, bytes, created_at_ms, expires_at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
     ON CONFLICT (scope, id) DO UPDATE SET response = excluded.response, \
     input_items = excluded.input_items, previous_id = excluded.previous_id, \
     bytes = excluded.bytes, created_at_ms = excluded.created_at_ms, \
     expires_at_ms = excluded.expires_at_ms";

/// The live turns row `?2` continues get its expiry `?3` where theirs is sooner (`?4`:
/// now; `?5`: the depth bound).
const RENEW_SQL: &str = "WITH RECURSIVE anc(id, n) AS (\
     SELECT previous_id, 1 FROM polygw_response_turns WHERE scope = ?1 AND id = ?2 \
     UNION ALL \
     SELECT t.previous_id, anc.n + 1 FROM polygw_response_turns t JOIN anc \
     ON t.scope = ?1 AND t.id = anc.id WHERE anc.n < ?5) \
     UPDATE polygw_response_turns SET expires_at_ms = ?3 WHERE scope = ?1 \
     AND id IN (SELECT id FROM anc) AND expires_at_ms > ?4 AND expires_at_ms < ?3";

/// Owner `?1`'s rows beyond `?3` bytes, keeping row `?2` and then those that expire
/// latest (the newest first among equals).
const BOUND_SQL: &str = "DELETE FROM polygw_response_turns WHERE scope = ?1 AND id IN (\
     SELECT id FROM (SELECT id, SUM(bytes) OVER (ORDER BY CASE WHEN id = ?2 THEN 0 ELSE 1 END, \
     expires_at_ms DESC, created_at_ms DESC, id DESC ROWS UNBOUNDED PRECEDING) AS kept \
     FROM polygw_response_turns WHERE scope = ?1) w WHERE kept > ?3)";

const GET_SQL: &str = "SELECT response, input_items, previous_id, created_at_ms, expires_at_ms \
     FROM polygw_response_turns WHERE scope = ?1 AND id = ?2 AND expires_at_ms > ?3";

const GET_LEGACY: &str = "SELECT response, input_items, NULL, created_at_ms, expires_at_ms \
     FROM polygw_responses WHERE scope = ?1 AND id = ?2 AND expires_at_ms > ?3";

/// Row `?2` and the live turns it continues, newest first, `?4` at most.
const CHAIN_SQL: &str = "WITH RECURSIVE chain(id, previous_id, response, input_items, \
     created_at_ms, expires_at_ms, n) AS (\
     SELECT id, previous_id, response, input_items, created_at_ms, expires_at_ms, 1 \
     FROM polygw_response_turns WHERE scope = ?1 AND id = ?2 AND expires_at_ms > ?3 \
     UNION ALL \
     SELECT t.id, t.previous_id, t.response, t.input_items, t.created_at_ms, t.expires_at_ms, \
     chain.n + 1 FROM polygw_response_turns t JOIN chain ON t.scope = ?1 \
     AND t.id = chain.previous_id WHERE t.expires_at_ms > ?3 AND chain.n < ?4) \
     SELECT id, response, input_items, previous_id, created_at_ms, expires_at_ms \
     FROM chain ORDER BY n";

const DELETE_TURN: &str = "DELETE FROM polygw_response_turns WHERE scope = ?1 AND id = ?2";
const DELETE_LEGACY: &str = "DELETE FROM polygw_responses WHERE scope = ?1 AND id = ?2";

/// The oldest expired rows, at most a bound, through the `expires_at_ms` index.
const PURGE_TURNS: &str = "DELETE FROM polygw_response_turns WHERE (scope, id) IN \
     (SELECT scope, id FROM polygw_response_turns WHERE expires_at_ms <= ?1 \
      ORDER BY expires_at_ms LIMIT ?2)";
const PURGE_LEGACY: &str = "DELETE FROM polygw_responses WHERE (scope, id) IN \
     (SELECT scope, id FROM polygw_responses WHERE expires_at_ms <= ?1 \
      ORDER BY expires_at_ms LIMIT ?2)";

/// A stored row as read: `response`, `input_items`, `previous_id`, `created_at_ms`,
/// `expires_at_ms`.
type RawRow = (String, String, Option<String>, i64, i64);

fn decode(scope: &str, id: &str, raw: RawRow) -> Result<StoredResponse, TelemetryError> {
    let (response, items, previous_id, created_at_ms, expires_at_ms) = raw;
    let bad = |what: &str, e: serde_json::Error| {
        TelemetryError(format!(
            "stored response ({scope:?}, {id:?}): {what} is not valid JSON: {e}"
        ))
    };
    Ok(StoredResponse {
        id: id.to_string(),
        scope: scope.to_string(),
        response: serde_json::from_str::<Value>(&response).map_err(|e| bad("response", e))?,
        input_items: serde_json::from_str::<Vec<Value>>(&items)
            .map_err(|e| bad("input_items", e))?,
        previous_id,
        created_at_ms,
        expires_at_ms,
    })
}

#[async_trait]
impl ResponseStore for SqlResponseStore {
    async fn put(&self, r: StoredResponse, max_bytes: u64) -> Result<(), TelemetryError> {
        let bad = |e: serde_json::Error| {
            TelemetryError(format!("response {:?} cannot be stored: {e}", r.id))
        };
        let response = serde_json::to_string(&r.response).map_err(bad)?;
        let items = serde_json::to_string(&r.input_items).map_err(bad)?;
        let bytes = entry_bytes(&r, response.len(), items.len());
        if bytes > max_bytes {
            return Err(TelemetryError(format!(
                "response {:?} ({bytes} bytes) is larger than RESPONSES__MAX_BYTES_PER_KEY \
                 ({max_bytes} bytes); not stored",
                r.id
            )));
        }
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        self.bounded("store a response", async {
            on_db!(&self.base.db, PUT_SQL, |p, q| sqlx::query(q)
                .bind(r.id.as_str())
                .bind(r.scope.as_str())
                .bind(response.as_str())
                .bind(items.as_str())
                .bind(r.previous_id.as_deref())
                .bind(bytes)
                .bind(r.created_at_ms)
                .bind(r.expires_at_ms)
                .execute(p)
                .await
                .map(|_| ()))
        })
        .await?;
        // The row is stored; what follows keeps the store tidy and is logged on failure.
        let max_bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
        if let Err(e) = self.after_put(&r, max_bytes).await {
            tracing::warn!(error = %e.0, "renewing or bounding stored responses failed");
        }
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
        match self.get_from(GET_SQL, scope, id, now_ms).await? {
            Some(r) => Ok(Some(r)),
            None => self.get_from(GET_LEGACY, scope, id, now_ms).await,
        }
    }

    async fn chain(
        &self,
        scope: &str,
        id: &str,
        now_ms: i64,
    ) -> Result<Vec<StoredResponse>, TelemetryError> {
        let rows: Vec<(String, String, String, Option<String>, i64, i64)> = self
            .bounded("read a stored conversation", async {
                on_db!(&self.base.db, CHAIN_SQL, |p, q| sqlx::query_as(q)
                    .bind(scope)
                    .bind(id)
                    .bind(now_ms)
                    .bind(MAX_TURNS as i64)
                    .fetch_all(p)
                    .await)
            })
            .await?;
        let mut chain = rows
            .into_iter()
            .map(|(id, response, items, prev, created, expires)| {
                decode(scope, &id, (response, items, prev, created, expires))
            })
            .collect::<Result<Vec<_>, _>>()?;
        // A conversation stored before migration 7 ends in one of its rows.
        let older = match chain.last() {
            None => Some(id.to_string()),
            Some(last) if chain.len() < MAX_TURNS => last.previous_id.clone(),
            Some(_) => None,
        };
        if let Some(older) = older {
            if let Some(r) = self.get_from(GET_LEGACY, scope, &older, now_ms).await? {
                chain.push(r);
            }
        }
        Ok(chain)
    }

    async fn delete(&self, scope: &str, id: &str) -> Result<bool, TelemetryError> {
        let n = self
            .bounded("delete a stored response", async {
                let mut done = 0;
                for tpl in [DELETE_TURN, DELETE_LEGACY] {
                    done += on_db!(&self.base.db, tpl, |p, q| sqlx::query(q)
                        .bind(scope)
                        .bind(id)
                        .execute(p)
                        .await?
                        .rows_affected());
                }
                Ok(done)
            })
            .await?;
        Ok(n > 0)
    }
}
