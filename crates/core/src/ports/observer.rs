//! The `ChunkObserver` port: a synchronous callback the transport calls for every
//! incremental chunk (hedge triggers, passthrough streaming).

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::response::Usage;

/// One normalized streamed chunk, built only for observers that ask for it
/// ([`ChunkObserver::wants_deltas`]): the proxy uses it for passthrough streaming.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StreamDelta {
    /// `delta.role`, when present.
    pub role: Option<String>,
    /// New answer text.
    pub content: Option<String>,
    /// New reasoning text.
    pub reasoning: Option<String>,
    /// Tool-call fragments.
    pub tool_calls: Vec<ToolCallDelta>,
    /// `finish_reason`, when present.
    pub finish_reason: Option<String>,
    /// Usage, when the frame carries it.
    pub usage: Option<Usage>,
    /// The upstream's `model`, when present.
    pub model: Option<String>,
}

impl StreamDelta {
    /// Whether the chunk carries new content, reasoning or tool-call text (SPEC §5).
    pub fn is_incremental(&self) -> bool {
        self.content.as_deref().is_some_and(|s| !s.is_empty())
            || self.reasoning.as_deref().is_some_and(|s| !s.is_empty())
            || self.tool_calls.iter().any(|t| {
                !t.arguments.is_empty() || t.name.as_deref().is_some_and(|n| !n.is_empty())
            })
    }
}

/// A fragment of a tool call in a stream.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ToolCallDelta {
    /// The tool call's index.
    pub index: u32,
    /// Its id, when this fragment carries a non-empty one.
    pub id: Option<String>,
    /// Its function name, when this fragment carries a non-empty one.
    pub name: Option<String>,
    /// An arguments fragment.
    pub arguments: String,
}

/// Called by the transport; must not block (it runs on the read path).
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait ChunkObserver: Send + Sync {
    /// An incremental chunk arrived at `at` (monotonic). Nothing else runs per chunk
    /// unless [`ChunkObserver::wants_deltas`] is true.
    fn on_chunk(&self, at: Instant);

    /// Whether the transport should build and pass [`StreamDelta`]s.
    fn wants_deltas(&self) -> bool {
        false
    }

    /// Every parsed chunk (incremental or not), in order, when `wants_deltas()`.
    fn on_delta(&self, _delta: &StreamDelta) {}
}

/// An observer that ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NullObserver;

impl ChunkObserver for NullObserver {
    fn on_chunk(&self, _at: Instant) {}
}
