//! [`SqlKeyStore`]: client keys (SPEC §21.1) in the telemetry database, table
//! `polygw_client_keys` (migration 5), behind core's
//! [`polygw_core::ports::ClientKeyStore`] port.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::client_key::{ClientKey, KeyLimits};
use polygw_core::ports::ClientKeyStore;
use polygw_core::secret::redact_url;
use polygw_core::TelemetryError;

use crate::db::{Backend, Db, OpenOptions};
use crate::store::StoreBase;

/// The [`ClientKeyStore`] of a telemetry database: table `polygw_client_keys`.
///
/// - `create` refuses an id, name or hash already stored (the error names which).
/// - `update` replaces every column of the row of the same id.
/// - Keys are kept by hash; the table never sees a key in clear.
/// - Every operation is bounded by the timeout given to [`SqlKeyStore::connect`] (or the
///   recorder's `write_timeout`).
///
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct SqlKeyStore {
    base: Arc<StoreBase>,
}

impl SqlKeyStore {
    /// Opens the database of `url` (SQLite: created when missing), migrates it, and
    /// returns its key store.
    pub async fn connect(url: &str, timeout: Duration) -> Result<SqlKeyStore, TelemetryError> {
        let db = Db::open(
            url,
            OpenOptions {
                create: true,
                timeout,
            },
        )
        .await?;
        db.migrate(url).await?;
        Ok(SqlKeyStore::on(db, url, timeout))
    }

    pub(crate) fn on(db: Db, url: &str, timeout: Duration) -> SqlKeyStore {
        SqlKeyStore {
            base: Arc::new(StoreBase::new(db, url, &redact_url(url), timeout)),
        }
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.base.db.backend()
    }

    /// Closes the connections.
    pub async fn close(&self) {
        self.base.db.close().await;
    }
}

const COLUMNS: &str = "id, name, hash, prefix, scopes, models, rpm, tpm, max_concurrency, \
     budget_day_nanos, budget_month_nanos, created_at_ms, updated_at_ms, revoked_at_ms";

/// A row as read.
type Raw = (
    String,
    String,
    String,
    String,
    String,
    String,
    i64,
    i64,
    i64,
    Option<i64>,
    Option<i64>,
    i64,
    i64,
    Option<i64>,
);

fn decode(r: Raw) -> Result<ClientKey, TelemetryError> {
    let (
        id,
        name,
        hash,
        prefix,
        scopes,
        models,
        rpm,
        tpm,
        conc,
        day,
        month,
        created,
        updated,
        revoked,
    ) = r;
    let list = |what: &str, text: &str| {
        serde_json::from_str::<Vec<String>>(text).map_err(|e| {
            TelemetryError(format!(
                "polygw_client_keys row {id:?}: {what} is not a JSON array of names: {e}"
            ))
        })
    };
    let count = |what: &str, v: i64| {
        u64::try_from(v).map_err(|_| {
            TelemetryError(format!("polygw_client_keys row {id:?}: {what} is negative"))
        })
    };
    let limits = KeyLimits {
        rpm: u32::try_from(count("rpm", rpm)?).unwrap_or(u32::MAX),
        tpm: count("tpm", tpm)?,
        max_concurrency: u32::try_from(count("max_concurrency", conc)?).unwrap_or(u32::MAX),
        budget_day_nanos: day.map(|v| count("budget_day_nanos", v)).transpose()?,
        budget_month_nanos: month.map(|v| count("budget_month_nanos", v)).transpose()?,
    };
    Ok(ClientKey {
        scopes: list("scopes", &scopes)?,
        models: list("models", &models)?,
        id,
        name,
        hash,
        prefix,
        limits,
        created_at_ms: created,
        updated_at_ms: updated,
        revoked_at_ms: revoked,
    })
}

/// [`decode`], or — for a row that cannot be read — the key denied: revoked (as of its
/// last update), with no scope and no model, so that one bad row neither stops every
/// later reload (revocations would stop applying) nor lets its key in (SPEC §24.2).
fn decode_or_deny(r: Raw) -> ClientKey {
    let (id, name, hash, prefix, created, updated, revoked) = (
        r.0.clone(),
        r.1.clone(),
        r.2.clone(),
        r.3.clone(),
        r.11,
        r.12,
        r.13,
    );
    match decode(r) {
        Ok(k) => k,
        Err(e) => {
            tracing::warn!(key = %id, error = %e, "a client key row cannot be read: the key is denied");
            ClientKey {
                id,
                name,
                hash,
                prefix,
                scopes: Vec::new(),
                models: Vec::new(),
                limits: KeyLimits::default(),
                created_at_ms: created,
                updated_at_ms: updated,
                revoked_at_ms: Some(revoked.unwrap_or(updated)),
            }
        }
    }
}

fn as_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// `?` placeholders (SQLite) or `$n` (PostgreSQL), `n` of them.
fn marks(backend: Backend, n: usize) -> String {
    (1..=n)
        .map(|i| match backend {
            Backend::Sqlite => "?".to_string(),
            Backend::Postgres => format!("${i}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

macro_rules! bind_key {
    ($q:expr, $k:expr) => {{
        let k = $k;
        $q.bind(k.id.clone())
            .bind(k.name.clone())
            .bind(k.hash.clone())
            .bind(k.prefix.clone())
            .bind(serde_json::to_string(&k.scopes).unwrap_or_else(|_| "[]".into()))
            .bind(serde_json::to_string(&k.models).unwrap_or_else(|_| "[]".into()))
            .bind(i64::from(k.limits.rpm))
            .bind(as_i64(k.limits.tpm))
            .bind(i64::from(k.limits.max_concurrency))
            .bind(k.limits.budget_day_nanos.map(as_i64))
            .bind(k.limits.budget_month_nanos.map(as_i64))
            .bind(k.created_at_ms)
            .bind(k.updated_at_ms)
            .bind(k.revoked_at_ms)
    }};
}

impl SqlKeyStore {
    fn sql_insert(&self) -> String {
        format!(
            "INSERT INTO polygw_client_keys ({COLUMNS}) VALUES ({})",
            marks(self.backend(), 14)
        )
    }

    fn sql_update(&self) -> String {
        let b = self.backend();
        let cols: Vec<&str> = COLUMNS.split(", ").skip(1).collect();
        let sets: Vec<String> = cols
            .iter()
            .enumerate()
            .map(|(i, c)| match b {
                Backend::Sqlite => format!("{c} = ?"),
                Backend::Postgres => format!("{c} = ${}", i + 2),
            })
            .collect();
        // SQLite binds `?` in order (the id last); PostgreSQL numbers them (the id $1,
        // so the row binds in its own order).
        let id = match b {
            Backend::Sqlite => "?".to_string(),
            Backend::Postgres => "$1".to_string(),
        };
        format!(
            "UPDATE polygw_client_keys SET {} WHERE id = {id}",
            sets.join(", ")
        )
    }

    /// Which of id, name, hash is taken already (for a clear error).
    async fn taken(&self, k: &ClientKey) -> Result<Option<&'static str>, TelemetryError> {
        for (col, v, what) in [
            ("id", &k.id, "the id"),
            ("name", &k.name, "the name"),
            ("hash", &k.hash, "the key"),
        ] {
            let sql = format!(
                "SELECT COUNT(*) FROM polygw_client_keys WHERE {col} = {}",
                marks(self.backend(), 1)
            );
            let n: i64 = self
                .base
                .bounded("look up a client key", async {
                    match &self.base.db {
                        #[cfg(feature = "sqlite")]
                        Db::Sqlite(p) => sqlx::query_scalar(&sql).bind(v).fetch_one(p).await,
                        #[cfg(feature = "postgres")]
                        Db::Postgres(p) => sqlx::query_scalar(&sql).bind(v).fetch_one(p).await,
                    }
                })
                .await?;
            if n > 0 {
                return Ok(Some(what));
            }
        }
        Ok(None)
    }
}

#[async_trait]
impl ClientKeyStore for SqlKeyStore {
    async fn create(&self, key: ClientKey) -> Result<(), TelemetryError> {
        if let Some(what) = self.taken(&key).await? {
            let named = match what {
                "the name" => format!(" ({:?})", key.name),
                "the id" => format!(" ({:?})", key.id),
                _ => String::new(),
            };
            return Err(TelemetryError(format!(
                "a client key with {what}{named} exists already"
            )));
        }
        let sql = self.sql_insert();
        self.base
            .bounded("store a client key", async {
                match &self.base.db {
                    #[cfg(feature = "sqlite")]
                    Db::Sqlite(p) => bind_key!(sqlx::query(&sql), &key)
                        .execute(p)
                        .await
                        .map(|_| ()),
                    #[cfg(feature = "postgres")]
                    Db::Postgres(p) => bind_key!(sqlx::query(&sql), &key)
                        .execute(p)
                        .await
                        .map(|_| ()),
                }
            })
            .await?;
        Ok(())
    }

    async fn update(&self, key: ClientKey) -> Result<bool, TelemetryError> {
        let sql = self.sql_update();
        let done = self
            .base
            .bounded("update a client key", async {
                match &self.base.db {
                    #[cfg(feature = "sqlite")]
                    Db::Sqlite(p) => {
                        // `?` in order: the columns after the id, then the id.
                        let q = sqlx::query(&sql)
                            .bind(key.name.clone())
                            .bind(key.hash.clone())
                            .bind(key.prefix.clone())
                            .bind(serde_json::to_string(&key.scopes).unwrap_or_default())
                            .bind(serde_json::to_string(&key.models).unwrap_or_default())
                            .bind(i64::from(key.limits.rpm))
                            .bind(as_i64(key.limits.tpm))
                            .bind(i64::from(key.limits.max_concurrency))
                            .bind(key.limits.budget_day_nanos.map(as_i64))
                            .bind(key.limits.budget_month_nanos.map(as_i64))
                            .bind(key.created_at_ms)
                            .bind(key.updated_at_ms)
                            .bind(key.revoked_at_ms)
                            .bind(key.id.clone());
                        q.execute(p).await.map(|r| r.rows_affected())
                    }
                    #[cfg(feature = "postgres")]
                    Db::Postgres(p) => bind_key!(sqlx::query(&sql), &key)
                        .execute(p)
                        .await
                        .map(|r| r.rows_affected()),
                }
            })
            .await?;
        Ok(done > 0)
    }

    async fn list(&self) -> Result<Vec<ClientKey>, TelemetryError> {
        let sql = format!("SELECT {COLUMNS} FROM polygw_client_keys ORDER BY created_at_ms, id");
        let rows: Vec<Raw> = self
            .base
            .bounded("list client keys", async {
                match &self.base.db {
                    #[cfg(feature = "sqlite")]
                    Db::Sqlite(p) => sqlx::query_as(&sql).fetch_all(p).await,
                    #[cfg(feature = "postgres")]
                    Db::Postgres(p) => sqlx::query_as(&sql).fetch_all(p).await,
                }
            })
            .await?;
        Ok(rows.into_iter().map(decode_or_deny).collect())
    }

    async fn find(&self, id_or_name: &str) -> Result<Option<ClientKey>, TelemetryError> {
        let (a, b) = match self.backend() {
            Backend::Sqlite => ("?", "?"),
            Backend::Postgres => ("$1", "$1"),
        };
        let sql = format!("SELECT {COLUMNS} FROM polygw_client_keys WHERE id = {a} OR name = {b}");
        let rows: Vec<Raw> = self
            .base
            .bounded("find a client key", async {
                match &self.base.db {
                    #[cfg(feature = "sqlite")]
                    Db::Sqlite(p) => {
                        sqlx::query_as(&sql)
                            .bind(id_or_name)
                            .bind(id_or_name)
                            .fetch_all(p)
                            .await
                    }
                    #[cfg(feature = "postgres")]
                    Db::Postgres(p) => sqlx::query_as(&sql).bind(id_or_name).fetch_all(p).await,
                }
            })
            .await?;
        // An id matches before a name (a name may look like another key's id).
        let mut keys: Vec<ClientKey> = rows.into_iter().map(decode).collect::<Result<_, _>>()?;
        keys.sort_by_key(|k| k.id != id_or_name);
        Ok(keys.into_iter().next())
    }
}

#[cfg(test)]
mod deny_tests {
    use super::*;

    /// SPEC §24.2: a row whose scopes are not JSON, or whose limit is negative, is
    /// denied (revoked, no scope), and reading it does not fail.
    #[test]
    fn a_row_that_cannot_be_read_is_denied() {
        let raw = |scopes: &str, rpm: i64| -> Raw {
            (
                "key_1".into(),
                "app".into(),
                "h".into(),
                "pgw-ab".into(),
                scopes.into(),
                "[]".into(),
                rpm,
                0,
                0,
                None,
                None,
                1,
                2,
                None,
            )
        };
        let ok = decode_or_deny(raw(r#"["LLM"]"#, 5));
        assert_eq!((ok.scopes.len(), ok.revoked_at_ms), (1, None));
        for bad in [raw("not json", 5), raw("[]", -1)] {
            let k = decode_or_deny(bad);
            assert_eq!(k.revoked_at_ms, Some(2), "denied as of its last update");
            assert!(k.scopes.is_empty());
            assert_eq!(k.id, "key_1");
        }
    }
}
