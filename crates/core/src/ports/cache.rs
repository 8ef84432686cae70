//! The `ResponseCache` port (SPEC §10). A failing cache never fails a call.

use std::time::Duration;

use async_trait::async_trait;

use crate::error::CacheError;
use crate::response::LlmResponse;

/// Stores responses by canonical request key ([`crate::cache_key`]).
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait ResponseCache: Send + Sync + std::fmt::Debug {
    /// The stored response, if present and fresh.
    async fn get(&self, key: &str) -> Result<Option<LlmResponse>, CacheError>;
    /// Stores a response for `ttl`.
    async fn put(&self, key: &str, response: &LlmResponse, ttl: Duration)
        -> Result<(), CacheError>;
}

/// A cache that never hits (cache off).
#[derive(Debug, Clone, Copy, Default)]
pub struct NullCache;

#[async_trait]
impl ResponseCache for NullCache {
    async fn get(&self, _key: &str) -> Result<Option<LlmResponse>, CacheError> {
        Ok(None)
    }
    async fn put(&self, _key: &str, _r: &LlmResponse, _ttl: Duration) -> Result<(), CacheError> {
        Ok(())
    }
}
