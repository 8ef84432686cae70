//! The `ResponseStore` port (SPEC §18.1): stored OpenAI Responses (`store: true`), so
//! that `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` work — in the
//! scope's telemetry database (SQLite or PostgreSQL), or a bounded in-process store
//! when the scope has none. Entries expire (`RESPONSES__TTL_S`).

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::TelemetryError;

/// One stored response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The response id (`resp_…`).
    pub id: String,
    /// The scope that answered it (a lookup from another scope does not see it).
    pub scope: String,
    /// The `response` object as answered.
    pub response: Value,
    /// The conversation's input items up to this response (what the next call's
    /// `previous_response_id` continues, together with `response.output`).
    pub input_items: Vec<Value>,
    /// When it was stored (Unix ms).
    pub created_at_ms: i64,
    /// When it expires (Unix ms).
    pub expires_at_ms: i64,
}

/// Stores responses by id.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait ResponseStore: Send + Sync + std::fmt::Debug {
    /// Stores (or replaces) a response.
    async fn put(&self, r: StoredResponse) -> Result<(), TelemetryError>;
    /// The response `id` of `scope`, unless it expired before `now_ms` or was deleted.
    async fn get(
        &self,
        scope: &str,
        id: &str,
        now_ms: i64,
    ) -> Result<Option<StoredResponse>, TelemetryError>;
    /// Deletes it; whether it was there.
    async fn delete(&self, scope: &str, id: &str) -> Result<bool, TelemetryError>;
}

/// A store that keeps nothing (a scope whose responses are never stored).
#[derive(Debug, Clone, Copy, Default)]
pub struct NullStore;

#[async_trait]
impl ResponseStore for NullStore {
    async fn put(&self, _r: StoredResponse) -> Result<(), TelemetryError> {
        Ok(())
    }
    async fn get(
        &self,
        _scope: &str,
        _id: &str,
        _now_ms: i64,
    ) -> Result<Option<StoredResponse>, TelemetryError> {
        Ok(None)
    }
    async fn delete(&self, _scope: &str, _id: &str) -> Result<bool, TelemetryError> {
        Ok(false)
    }
}
