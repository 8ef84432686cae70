//! Reading `llm_calls` back (for `polygw report`): rows as [`TelemetryRow`]s (all, since
//! an instant, or one logical call's), the accounting gap of SPEC §8, and the names of the
//! client keys the rows were charged to.

use std::time::Duration;

use polygw_core::{TelemetryError, TelemetryRow};

use crate::db::{Backend, Db, OpenOptions, RowFilter};

/// A client key as `polygw report` names it (SPEC §21.1): nothing secret — no hash, no
/// prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientKeyName {
    /// The key's public id (`client_key_id` in the rows).
    pub id: String,
    /// Its name.
    pub name: String,
    /// It has been revoked.
    pub revoked: bool,
}

/// A read-only view of a telemetry database. It never creates a file and never migrates:
/// columns a database lacks (made by an older polygw) read as `None`/`false`.
#[derive(Debug)]
pub struct TelemetryReader {
    db: Db,
    url: String,
}

impl TelemetryReader {
    /// Default bound on connecting.
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

    /// Opens `sqlite://PATH` (which must exist) or `postgres://…`.
    pub async fn connect(url: &str) -> Result<TelemetryReader, TelemetryError> {
        let db = Db::open(
            url,
            OpenOptions {
                create: false,
                timeout: Self::CONNECT_TIMEOUT,
            },
        )
        .await?;
        Ok(TelemetryReader {
            db,
            url: url.to_string(),
        })
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.db.backend()
    }

    /// Rows created at or after `since_unix_ms` (all when `None`), oldest first (ties by
    /// `call_id`).
    pub async fn rows(
        &self,
        since_unix_ms: Option<i64>,
    ) -> Result<Vec<TelemetryRow>, TelemetryError> {
        self.db
            .read_rows(&self.url, RowFilter::Since(since_unix_ms))
            .await
    }

    /// The rows of one logical call, oldest first: `id` is its `logical_call_id`, or the
    /// `call_id` of one of its rows. Empty when no row matches.
    pub async fn call_rows(&self, id: &str) -> Result<Vec<TelemetryRow>, TelemetryError> {
        self.db.read_rows(&self.url, RowFilter::Call(id)).await
    }

    /// The client keys of `polygw_client_keys`, by id; `None` when the database has no
    /// such table (made by a polygw older than client keys). Never a hash or a prefix.
    pub async fn client_key_names(&self) -> Result<Option<Vec<ClientKeyName>>, TelemetryError> {
        Ok(self.db.client_key_names(&self.url).await?.map(|keys| {
            keys.into_iter()
                .map(|(id, name, revoked)| ClientKeyName { id, name, revoked })
                .collect()
        }))
    }

    /// `COUNT(*)` of attempts whose usage is unavailable, cache hits excluded
    /// ([`polygw_core::telemetry::ACCOUNTING_GAP_SQL`]).
    pub async fn accounting_gap(&self) -> Result<u64, TelemetryError> {
        self.db.accounting_gap(&self.url).await
    }

    /// Closes the connection.
    pub async fn close(self) {
        self.db.close().await;
    }
}

/// Reads the rows of a telemetry database (see [`TelemetryReader::rows`]).
pub async fn read_rows(
    url: &str,
    since_unix_ms: Option<i64>,
) -> Result<Vec<TelemetryRow>, TelemetryError> {
    let reader = TelemetryReader::connect(url).await?;
    let rows = reader.rows(since_unix_ms).await;
    reader.close().await;
    rows
}

/// Runs the accounting-gap query of SPEC §8 on a telemetry database.
pub async fn accounting_gap(url: &str) -> Result<u64, TelemetryError> {
    let reader = TelemetryReader::connect(url).await?;
    let n = reader.accounting_gap().await;
    reader.close().await;
    n
}
