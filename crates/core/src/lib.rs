//! polygw's pure core: the domain types, configuration and its guards, the decisions
//! of a logical call, and the port traits the adapters implement.
//!
//! Nothing here does I/O or reads a clock: time and randomness come in through the
//! [`ports::Clock`] and [`ports::Rng`] ports. The async engine in the `polygw` facade
//! carries the decisions out.
//!
//! Map of the crate (one concept, one module):
//! - types: [`request`], [`response`], [`source`], [`settings`], [`secret`], [`telemetry`],
//!   [`client_key`], [`trace`] (a call's decision trace)
//! - errors: [`error`]
//! - configuration: [`config`] (environment loading, guards)
//! - decisions: [`classify`], [`settlement`], [`stall`], [`backoff`], [`admission`],
//!   [`affinity`] (prompt-cache affinity), [`hedge`], [`latency`] (live latency
//!   sketches), [`round`] (the round state machine),
//!   [`threshold`] (priors, blend, stability), [`resume`], [`retry`], [`retry_throttle`], [`breaker`], [`window`], [`key_quota`] (client keys' limits
//!   and budgets), [`body`], [`cache_key`], [`usage`]
//! - ports: [`ports`]

pub mod admission;
pub mod affinity;
pub mod backoff;
pub mod body;
pub mod breaker;
pub mod cache_key;
pub mod classify;
pub mod client_body;
pub mod client_key;
pub mod config;
mod durations;
pub mod error;
pub mod estimate;
pub mod hedge;
pub mod key_funds;
pub mod key_quota;
pub mod latency;
pub mod native;
pub mod otel;
pub mod ports;
pub mod reload;
pub mod request;
pub mod response;
pub mod resume;
pub mod retry;
pub mod retry_throttle;
pub mod round;
pub mod secret;
pub mod settings;
pub mod settlement;
pub mod source;
pub mod stall;
pub mod telemetry;
pub mod threshold;
pub mod trace;
pub mod usage;
pub mod window;

pub use config::{ConfigWarning, LoadedScope};
pub use error::{
    AttemptError, CacheError, ConfigError, ErrorClass, ErrorLabel, FailureContext, GatewayError,
    GovernanceError, RefusalReason, SourceReason, SourceReasons, TelemetryError, TerminalReason,
};
pub use request::{ChatRequest, EmbeddingInput, Message};
pub use response::{CallStats, LlmResponse, ToolCall, Usage, UsageSource};
pub use secret::Secret;
pub use settings::{
    BreakerSettings, CacheSettings, HedgeSettings, OnNoRunnable, RetryPrefer, RetrySettings,
    ScopeKind, ScopeLimits, ScopeSettings, StreamSettings,
};
pub use source::SourceConfig;
pub use stall::StreamFigures;
pub use telemetry::{RowKind, TelemetryRow};
