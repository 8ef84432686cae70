//! [`RedisAffinityStore`]: prompt-cache affinity shared by every process of a scope
//! (SPEC §20.2), behind core's [`AffinityStore`] port.
//!
//! One small string key per session, `polygw:{S}:aff:<key>` → the source's name, under the
//! scope's hash tag (one Redis Cluster slot with the rest of the scope), written with
//! `SET … PX <ttl>` so it expires by itself; `<key>` is the 32-hex-character digest
//! ([`polygw_core::affinity::AffinityKey`]), never the client's text. A read is one `GET`.
//! Expiry is the server's, so process clocks do not matter.

use std::time::Duration;

use async_trait::async_trait;
use polygw_core::error::GovernanceError;
use polygw_core::ports::AffinityStore;

use crate::{keys, Conn};

/// The shared affinity store of a [`crate::RedisGovernance`] (cheap to clone).
#[derive(Debug, Clone)]
pub struct RedisAffinityStore {
    conn: Conn,
}

impl RedisAffinityStore {
    pub(crate) fn new(conn: Conn) -> Self {
        RedisAffinityStore { conn }
    }
}

#[async_trait]
impl AffinityStore for RedisAffinityStore {
    async fn get(&self, scope: &str, key: &str) -> Result<Option<String>, GovernanceError> {
        let k = keys::affinity(scope, key)?;
        self.conn
            .query("read an affinity key", redis::cmd("GET").arg(&k))
            .await
    }

    async fn put(
        &self,
        scope: &str,
        key: &str,
        source: &str,
        ttl: Duration,
    ) -> Result<(), GovernanceError> {
        let k = keys::affinity(scope, key)?;
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        if ttl_ms == 0 {
            return self
                .conn
                .query("forget an affinity key", redis::cmd("DEL").arg(&k))
                .await
                .map(|_: i64| ());
        }
        self.conn
            .query(
                "write an affinity key",
                redis::cmd("SET").arg(&k).arg(source).arg("PX").arg(ttl_ms),
            )
            .await
            .map(|_: redis::Value| ())
    }
}
