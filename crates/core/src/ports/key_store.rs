//! The `ClientKeyStore` port (SPEC §21.1): client keys in the telemetry database (SQLite
//! or PostgreSQL), by hash. The CLI (`polygw keys`) writes them; every `polygw serve`
//! replica reads them and looks again every few seconds, so a change reaches all of them.

use async_trait::async_trait;

use crate::client_key::ClientKey;
use crate::error::TelemetryError;

/// Stores client keys.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait ClientKeyStore: Send + Sync + std::fmt::Debug {
    /// Stores a new key. An id, name or hash already stored is an error naming it.
    async fn create(&self, key: ClientKey) -> Result<(), TelemetryError>;
    /// Replaces the stored key of the same id (limits, hash after a rotation, revocation);
    /// whether it was there.
    async fn update(&self, key: ClientKey) -> Result<bool, TelemetryError>;
    /// Every key, revoked ones included, oldest first.
    async fn list(&self) -> Result<Vec<ClientKey>, TelemetryError>;
    /// The key of this id or name.
    async fn find(&self, id_or_name: &str) -> Result<Option<ClientKey>, TelemetryError>;
}
