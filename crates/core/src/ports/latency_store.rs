//! The `LatencyStore` port (SPEC §19.2): the live latency distributions of a scope's
//! sources, shared by every process of the scope. Each process adds what it recorded
//! since its last exchange and reads the merge back; merging is a sum of counts, so
//! the order of processes and exchanges never matters. The store decays like a
//! [`crate::latency::DecayingSketch`]: a sample counts for between 0.9 × and 1 × the
//! window after the exchange that added it.

use std::time::Duration;

use async_trait::async_trait;

use crate::error::GovernanceError;
use crate::latency::LatencySnapshot;

/// One source's distributions, for streamed or for plain legs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceSketch {
    /// Streamed legs (first token and gaps), or plain ones (whole answers).
    pub streamed: bool,
    /// The source.
    pub source: String,
    /// Its distributions.
    pub snapshot: LatencySnapshot,
}

/// Shares latency distributions across processes.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait LatencyStore: Send + Sync + std::fmt::Debug {
    /// Adds `deltas` (what this process recorded since its last exchange) at `now_ms`
    /// (Unix ms) and returns the merged distributions over `window` of every source in
    /// `sources` (streamed and plain), those with nothing recorded left out.
    async fn exchange(
        &self,
        scope: &str,
        now_ms: i64,
        window: Duration,
        deltas: Vec<SourceSketch>,
        sources: Vec<String>,
    ) -> Result<Vec<SourceSketch>, GovernanceError>;
}
