//! The `AffinityStore` port (SPEC §20.2): which source last served an affinity key, kept
//! for a TTL — in the process (memory backend) or shared by every process of the scope
//! (Redis: one small expiring key per session under the scope's hash tag).
//!
//! Keys are [`crate::affinity::AffinityKey`] digests (32 hex characters), never a
//! client's text. The same store remembers the signature family of the signed blobs a
//! scope passed (SPEC §23.5, [`crate::native::family::blob_key`]: `sg` and 32 hex
//! characters), read and written many at once ([`AffinityStore::get_many`]). The store is a hint, not governance: the engine treats a failing store
//! as "no source remembered" (the call takes the normal order) and logs it.

use std::time::Duration;

use async_trait::async_trait;

use crate::error::GovernanceError;

/// Remembers the source of each affinity key of a scope.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait AffinityStore: Send + Sync + std::fmt::Debug {
    /// The source that last served `key` in `scope`, unless its TTL has run out.
    async fn get(&self, scope: &str, key: &str) -> Result<Option<String>, GovernanceError>;

    /// `source` served `key` in `scope`: remembered (replacing what was) for `ttl` from
    /// now. A zero `ttl` forgets the key.
    async fn put(
        &self,
        scope: &str,
        key: &str,
        source: &str,
        ttl: Duration,
    ) -> Result<(), GovernanceError>;

    /// [`AffinityStore::get`] of each of `keys`, in order: one round trip where the
    /// backend has one (Redis: `MGET`).
    async fn get_many(
        &self,
        scope: &str,
        keys: &[String],
    ) -> Result<Vec<Option<String>>, GovernanceError> {
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            out.push(self.get(scope, k).await?);
        }
        Ok(out)
    }

    /// [`AffinityStore::put`] of each of `keys` with the same `value` and `ttl`.
    async fn put_many(
        &self,
        scope: &str,
        keys: &[String],
        value: &str,
        ttl: Duration,
    ) -> Result<(), GovernanceError> {
        for k in keys {
            self.put(scope, k, value, ttl).await?;
        }
        Ok(())
    }
}

/// A store that remembers nothing (affinity without a backend: every call is a miss).
#[derive(Debug, Clone, Copy, Default)]
pub struct NullAffinity;

#[async_trait]
impl AffinityStore for NullAffinity {
    async fn get(&self, _scope: &str, _key: &str) -> Result<Option<String>, GovernanceError> {
        Ok(None)
    }

    async fn put(
        &self,
        _scope: &str,
        _key: &str,
        _source: &str,
        _ttl: Duration,
    ) -> Result<(), GovernanceError> {
        Ok(())
    }
}
