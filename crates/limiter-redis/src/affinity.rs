//! [`RedisAffinityStore`]: prompt-cache affinity shared by every process of a scope
//! (SPEC §20.2), behind core's [`AffinityStore`] port.
//!
//! One small string key per session, `polygw:{S}:aff:<key>` → the source's name, under the
//! scope's hash tag (one Redis Cluster slot with the rest of the scope), written with
//! `SET … PX <ttl>` so it expires by itself; `<key>` is the 32-hex-character digest
//! ([`polygw_core::affinity::AffinityKey`]), never the client's text. A read is one `GET`.
//! Expiry is the server's, so process clocks do not matter.
//!
//! The signature families of SPEC §23.5 are keys of the same kind (`…:aff:sg<digest>`):
//! a call reads all of its blobs with one `MGET` (one slot: the scope's hash tag) and
//! an answer's are written with one pipeline of `SET … PX`.

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

    async fn get_many(
        &self,
        scope: &str,
        keys: &[String],
    ) -> Result<Vec<Option<String>>, GovernanceError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut cmd = redis::cmd("MGET");
        for k in keys {
            cmd.arg(keys::affinity(scope, k)?);
        }
        self.conn.query("read signature families", &cmd).await
    }

    async fn put_many(
        &self,
        scope: &str,
        keys: &[String],
        value: &str,
        ttl: Duration,
    ) -> Result<(), GovernanceError> {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        if keys.is_empty() || ttl_ms == 0 {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for k in keys {
            pipe.cmd("SET")
                .arg(keys::affinity(scope, k)?)
                .arg(value)
                .arg("PX")
                .arg(ttl_ms)
                .ignore();
        }
        self.conn
            .query_pipe("write signature families", &pipe)
            .await
            .map(|_: redis::Value| ())
    }
}
