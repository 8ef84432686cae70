//! # polygw
//!
//! Several OpenAI-compatible LLM sources as one dependable endpoint: every source's
//! RPM/TPM/concurrency quota respected (also across processes, through Redis),
//! failures classified and retried within a budget, slow or stuck sources hedged to
//! another source, and one telemetry row per attempt in SQLite or PostgreSQL with exact
//! usage and cost.
//!
//! ```no_run
//! use polygw::{ChatRequest, GatewayClient};
//!
//! # async fn run() -> Result<(), polygw::GatewayError> {
//! // LLM__DEEPSEEK__0__BASE_URL, LLM__DEEPSEEK__0__API_KEY, LLM__DEEPSEEK__0__MODEL, …
//! let client = GatewayClient::from_env("LLM").await?;
//! let answer = client.chat(ChatRequest::user("Say hello").with_stream(true)).await?;
//! println!("{} (from {}, {} attempts)", answer.content, answer.source, answer.call_stats.attempts);
//! client.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! Cargo features choose the adapters: `memory` (in-process limiter, breaker store and
//! cache) and `sqlite` by default; `redis` and `postgres` optional; `schema` (JSON Schema
//! validation in `chat_json_with_schema`) optional.

pub mod admin;
mod builder;
mod client;
pub mod client_keys;
pub mod clock;
mod embedding;
mod engine;
pub mod env;
pub mod metrics;
mod ocr;
pub mod otel;
mod reload;
mod schema;
mod scope_client;
mod stream;
mod structured;
mod wiring;

pub use builder::{GatewayBuilder, ScopeClients};
pub use client::{CallOptions, GatewayClient};
pub use embedding::{EmbeddingClient, Embeddings};
pub use engine::latency::UpstreamEvidence;
pub use engine::round::{Commit, DeltaSink};
pub use engine::Ports;
pub use env::process_vars;
pub use metrics::Metrics;
pub use ocr::{OcrClient, OcrText, MAX_IMAGE_BYTES};
pub use reload::{ReloadingClient, RELOAD_POLL};
pub use stream::{ChatEvent, ChatStream};
pub use structured::{strip_code_fence, Structured};

/// The SQL telemetry adapter: the recorder, and reading rows back (`polygw report`).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub mod telemetry {
    pub use polygw_telemetry_sql::time::format_utc_ms;
    pub use polygw_telemetry_sql::{
        accounting_gap, read_rows, RecorderConfig, SqlKeyStore, SqlRecorder, TelemetryReader,
    };
}

/// The in-process governance adapter, for [`GatewayBuilder::limiter`] and
/// [`GatewayBuilder::breakers`] with a clock of the caller's (the default wiring shares
/// one per scope name: [`polygw_limiter_memory::shared`]).
#[cfg(feature = "memory")]
pub mod memory {
    pub use polygw_limiter_memory::{MemoryAffinity, MemoryBreakerStore, MemoryLimiter};
}

pub use polygw_core as core;
pub use polygw_core::ports::{FlushReport, StreamDelta, ToolCallDelta};
pub use polygw_core::{
    AttemptError, CallStats, ChatRequest, ConfigError, ConfigWarning, EmbeddingInput, ErrorClass,
    ErrorLabel, GatewayError, LlmResponse, Message, RetryPrefer, ScopeKind, ScopeSettings,
    SourceConfig, TerminalReason, ToolCall, Usage, UsageSource,
};
