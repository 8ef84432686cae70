//! Errors of every layer: configuration, one attempt, governance, and the logical call.
//!
//! An [`AttemptError`] knows where it came from and whether a retry may help: its
//! [`ErrorClass`] decides budget, breaker and settlement; its [`ErrorLabel`] is what
//! telemetry records. A [`GatewayError`] is what a caller of `chat()` sees: the terminal
//! reason of SPEC §6, the last attempt error and every source's reason.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::response::{Usage, UsageSource};

/// Configuration errors name the key, the (redacted) value and what was expected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A value could not be parsed or is out of range.
    #[error("{key}={value:?} is invalid: expected {expected}")]
    Invalid {
        /// The full key, e.g. `LLM__DEEPSEEK__0__RPM`.
        key: String,
        /// The value as given; secrets are replaced by `<redacted>`.
        value: String,
        /// What a valid value looks like.
        expected: String,
    },
    /// A required key is absent.
    #[error("{key} is missing: expected {expected}")]
    Missing {
        /// The full key that must be set.
        key: String,
        /// What it must hold.
        expected: String,
    },
    /// A key that polygw does not know, under a scope it loads.
    #[error("{key} is not a known key: {hint}")]
    UnknownKey {
        /// The offending key.
        key: String,
        /// The keys or fields that are accepted there.
        hint: String,
    },
    /// A reserved segment name used as a provider name.
    #[error("{key}: `{provider}` is a reserved segment and cannot be a provider name (reserved: {reserved})")]
    ReservedProvider {
        /// The offending key.
        key: String,
        /// The provider segment.
        provider: String,
        /// The reserved names.
        reserved: String,
    },
    /// A scope without any source.
    #[error("scope {scope} has no source: set at least {scope}__<PROVIDER>__0__BASE_URL, __API_KEY and __MODEL")]
    NoSources {
        /// The scope's name.
        scope: String,
    },
    /// Two sources with the same name in one scope.
    #[error("scope {scope}: source name `{source_name}` is used twice")]
    DuplicateSource {
        /// The scope.
        scope: String,
        /// The repeated name.
        source_name: String,
    },
    /// A cross-key assembly guard (SPEC §2.2) failed.
    #[error("{key}={value} is invalid: {message}")]
    Guard {
        /// The key the guard is about.
        key: String,
        /// Its value.
        value: String,
        /// Why the combination cannot work.
        message: String,
    },
    /// Several errors at once (all of them are reported, not just the first).
    #[error("{}", list_errors(.0))]
    Multiple(Vec<ConfigError>),
}

fn list_errors(errors: &[ConfigError]) -> String {
    let mut out = format!("{} configuration errors:", errors.len());
    for e in errors {
        out.push_str("\n  - ");
        out.push_str(&e.to_string());
    }
    out
}

impl ConfigError {
    /// Folds a list of errors into one (`Ok` when empty).
    pub fn from_list(mut errors: Vec<ConfigError>) -> Result<(), ConfigError> {
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(ConfigError::Multiple(errors)),
        }
    }

    /// Every single error inside (flattens [`ConfigError::Multiple`]).
    pub fn all(&self) -> Vec<&ConfigError> {
        match self {
            ConfigError::Multiple(v) => v.iter().flat_map(|e| e.all()).collect(),
            e => vec![e],
        }
    }
}

/// The class of a failed attempt: it decides budget, breaker and settlement (SPEC §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// Timeouts, 5xx, connection failures, truncated streams: retry elsewhere; feeds the breaker.
    Transient,
    /// HTTP 429 (or an in-band rate-limit error): budget refunded, source cools down.
    RateLimited,
    /// 400/413/422: the request itself is refused; terminal for the logical call.
    Rejected,
    /// A 200 that is unusable (bad JSON, no choices, too big, nothing generated).
    Invalid,
    /// 401/403/404: the source is out for `BREAKER__DEAD_S`.
    Dead,
}

impl ErrorClass {
    /// Whether a round failing with this class consumes retry budget.
    pub fn consumes_budget(self) -> bool {
        !matches!(self, ErrorClass::RateLimited | ErrorClass::Rejected)
    }

    /// Whether this failure counts toward opening the source's breaker.
    pub fn feeds_breaker(self) -> bool {
        matches!(self, ErrorClass::Transient)
    }

    /// Whether the logical call ends at once (no other source is tried).
    pub fn is_terminal_for_call(self) -> bool {
        matches!(self, ErrorClass::Rejected)
    }

    /// The stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::RateLimited => "rate_limited",
            ErrorClass::Rejected => "rejected",
            ErrorClass::Invalid => "invalid",
            ErrorClass::Dead => "dead",
        }
    }
}

/// The telemetry label of an attempt that did not succeed (SPEC §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorLabel {
    /// The caller dropped the call while this attempt ran.
    Cancelled,
    /// A hedge leg that lost to another leg of its round.
    HedgeCancelled,
    /// The call deadline cut this attempt.
    Deadline,
    /// HTTP 429.
    RateLimited,
    /// Whole-request timeout (plain calls), or HTTP 408.
    Timeout,
    /// No incremental chunk within the TTFT budget.
    TtftTimeout,
    /// A gap between incremental chunks exceeded the inter-token budget.
    StallTimeout,
    /// Connection refused, reset, DNS or TLS failure.
    Connect,
    /// 5xx, 409, or an in-band server error.
    ServerError,
    /// The stream ended or broke before any `finish_reason`.
    Truncated,
    /// 400/413/422.
    Rejected,
    /// An unusable 200.
    Invalid,
    /// 401/403/404.
    Dead,
    /// A replayed resume leg contradicted the text the caller already had.
    ResumeDiverged,
}

impl ErrorLabel {
    /// Every label, for documentation and exhaustive tests.
    pub const ALL: [ErrorLabel; 14] = [
        ErrorLabel::Cancelled,
        ErrorLabel::HedgeCancelled,
        ErrorLabel::Deadline,
        ErrorLabel::RateLimited,
        ErrorLabel::Timeout,
        ErrorLabel::TtftTimeout,
        ErrorLabel::StallTimeout,
        ErrorLabel::Connect,
        ErrorLabel::ServerError,
        ErrorLabel::Truncated,
        ErrorLabel::Rejected,
        ErrorLabel::Invalid,
        ErrorLabel::Dead,
        ErrorLabel::ResumeDiverged,
    ];

    /// The stable name stored in the `error` column.
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorLabel::Cancelled => "cancelled",
            ErrorLabel::HedgeCancelled => "hedge_cancelled",
            ErrorLabel::Deadline => "deadline",
            ErrorLabel::RateLimited => "rate_limited",
            ErrorLabel::Timeout => "timeout",
            ErrorLabel::TtftTimeout => "ttft_timeout",
            ErrorLabel::StallTimeout => "stall_timeout",
            ErrorLabel::Connect => "connect",
            ErrorLabel::ServerError => "server_error",
            ErrorLabel::Truncated => "truncated",
            ErrorLabel::Rejected => "rejected",
            ErrorLabel::Invalid => "invalid",
            ErrorLabel::Dead => "dead",
            ErrorLabel::ResumeDiverged => "resume_diverged",
        }
    }
}

impl fmt::Display for ErrorLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One failed attempt, classified. Built by [`crate::classify`]; never holds a secret.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptError {
    /// Decides budget, breaker and settlement.
    pub class: ErrorClass,
    /// What telemetry records.
    pub label: ErrorLabel,
    /// The HTTP status, when a response arrived.
    pub http_status: Option<u16>,
    /// The provider's Retry-After, when given (seconds or HTTP date, resolved).
    pub retry_after: Option<Duration>,
    /// The provider's own error code (e.g. `context_length_exceeded`).
    pub provider_code: Option<String>,
    /// The provider's own error message (shortened).
    pub provider_message: Option<String>,
    /// A short human description of what happened (never a secret).
    pub detail: String,
    /// Usage the provider reported before failing (result invalid with measured usage).
    pub usage: Option<Usage>,
    /// Where `usage` came from.
    pub usage_source: UsageSource,
    /// The source cannot serve this call at all (it redirected, or its answer was over
    /// the size cap): the call does not send it this request again (SPEC §17.4).
    pub excludes_source: bool,
}

/// The longest provider message kept in an error (bytes, cut at a char boundary): long
/// enough that a rejection reaches the client in the provider's own words, which agents
/// match on to recover (SPEC §23.2).
pub const MAX_PROVIDER_MESSAGE: usize = 4096;

/// The longest detail kept in an error (bytes, cut at a char boundary).
pub const MAX_DETAIL: usize = 512;

impl AttemptError {
    /// A new error of the given class and label.
    pub fn new(class: ErrorClass, label: ErrorLabel, detail: impl Into<String>) -> Self {
        AttemptError {
            class,
            label,
            http_status: None,
            retry_after: None,
            provider_code: None,
            provider_message: None,
            detail: shorten(detail.into(), MAX_DETAIL),
            usage: None,
            usage_source: UsageSource::Unavailable,
            excludes_source: false,
        }
    }

    /// Marks the error as one that keeps its source out of the rest of the call.
    pub fn excluding_source(mut self) -> Self {
        self.excludes_source = true;
        self
    }

    /// Sets the HTTP status.
    pub fn with_status(mut self, status: u16) -> Self {
        self.http_status = Some(status);
        self
    }

    /// Sets Retry-After.
    pub fn with_retry_after(mut self, retry_after: Option<Duration>) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// Sets the provider's code and message (the message is shortened).
    pub fn with_provider(mut self, code: Option<String>, message: Option<String>) -> Self {
        self.provider_code = code.map(|c| shorten(c, 128));
        self.provider_message = message.map(|m| shorten(m, MAX_PROVIDER_MESSAGE));
        self
    }

    /// Attaches usage reported before the failure.
    pub fn with_usage(mut self, usage: Usage, source: UsageSource) -> Self {
        self.usage = Some(usage);
        self.usage_source = source;
        self
    }

    /// A short detail for the telemetry `error_detail` column.
    pub fn short_detail(&self) -> String {
        let mut s = self.detail.clone();
        if let Some(code) = &self.provider_code {
            s.push_str(" [");
            s.push_str(code);
            s.push(']');
        }
        shorten(s, 256)
    }
}

impl fmt::Display for AttemptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.label, self.class.as_str())?;
        if let Some(s) = self.http_status {
            write!(f, " HTTP {s}")?;
        }
        write!(f, ": {}", self.detail)?;
        if let Some(code) = &self.provider_code {
            write!(f, " [code {code}]")?;
        }
        if let Some(msg) = &self.provider_message {
            if !self.detail.contains(msg.as_str()) {
                write!(f, " — {msg}")?;
            }
        }
        if let Some(ra) = self.retry_after {
            write!(f, " (retry after {:.3}s)", ra.as_secs_f64())?;
        }
        Ok(())
    }
}

impl std::error::Error for AttemptError {}

/// Cuts a string to at most `max` bytes at a char boundary, marking the cut.
pub fn shorten(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut cut = max.saturating_sub(3);
    while cut > 0 && !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    s.push_str("...");
    s
}

/// Why a candidate was not admitted (SPEC §4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalReason {
    /// Breaker open (or half-open with its probe taken).
    CircuitOpen,
    /// Source dead after 401/403/404.
    Dead,
    /// Cooling down after a 429.
    Cooldown,
    /// Source requests-per-minute quota.
    Rpm,
    /// Source tokens-per-minute quota.
    Tpm,
    /// Source in-flight cap.
    Concurrency,
    /// Scope-wide requests-per-minute quota.
    ScopeRpm,
    /// Scope-wide tokens-per-minute quota.
    ScopeTpm,
    /// The client key's requests-per-minute limit (SPEC §21.1).
    KeyRpm,
    /// The client key's tokens-per-minute limit.
    KeyTpm,
    /// The client key's in-flight cap (its calls in flight).
    KeyConcurrency,
    /// The client key's spend budget of the current UTC day.
    KeyBudgetDay,
    /// The client key's spend budget of the current UTC month.
    KeyBudgetMonth,
    /// The client key has a budget but the scope has no prices: what a call costs cannot
    /// be known, so it is not admitted (never passes with time).
    KeyBudgetUnpriced,
    /// An operator took the source out (SPEC §26.3: drained) until it is brought back
    /// (never passes with time).
    Drained,
}

impl RefusalReason {
    /// The stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::CircuitOpen => "circuit_open",
            RefusalReason::Dead => "dead",
            RefusalReason::Cooldown => "cooldown",
            RefusalReason::Rpm => "rpm",
            RefusalReason::Tpm => "tpm",
            RefusalReason::Concurrency => "concurrency",
            RefusalReason::ScopeRpm => "scope_rpm",
            RefusalReason::ScopeTpm => "scope_tpm",
            RefusalReason::KeyRpm => "key_rpm",
            RefusalReason::KeyTpm => "key_tpm",
            RefusalReason::KeyConcurrency => "key_concurrency",
            RefusalReason::KeyBudgetDay => "key_budget_day",
            RefusalReason::KeyBudgetMonth => "key_budget_month",
            RefusalReason::KeyBudgetUnpriced => "key_budget_unpriced",
            RefusalReason::Drained => "drained",
        }
    }

    /// Every reason, in declaration order (tests, metrics label sets).
    pub const ALL: [RefusalReason; 15] = [
        RefusalReason::CircuitOpen,
        RefusalReason::Dead,
        RefusalReason::Cooldown,
        RefusalReason::Rpm,
        RefusalReason::Tpm,
        RefusalReason::Concurrency,
        RefusalReason::ScopeRpm,
        RefusalReason::ScopeTpm,
        RefusalReason::KeyRpm,
        RefusalReason::KeyTpm,
        RefusalReason::KeyConcurrency,
        RefusalReason::KeyBudgetDay,
        RefusalReason::KeyBudgetMonth,
        RefusalReason::KeyBudgetUnpriced,
        RefusalReason::Drained,
    ];

    /// Whether the refusal passes with time (then `ON_NO_RUNNABLE=wait` may wait for it).
    pub fn passes_with_time(self) -> bool {
        !matches!(
            self,
            RefusalReason::Dead | RefusalReason::KeyBudgetUnpriced | RefusalReason::Drained
        )
    }

    /// Whether this is a client key's refusal (SPEC §21.1: answered as the key's own 429,
    /// never mixed with the sources' reasons).
    pub fn is_key(self) -> bool {
        matches!(
            self,
            RefusalReason::KeyRpm
                | RefusalReason::KeyTpm
                | RefusalReason::KeyConcurrency
                | RefusalReason::KeyBudgetDay
                | RefusalReason::KeyBudgetMonth
                | RefusalReason::KeyBudgetUnpriced
        )
    }
}

impl fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A source's reason in a terminal error: refused at admission, or failed in an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "reason", rename_all = "snake_case")]
pub enum SourceReason {
    /// The source was not admitted.
    Refused(RefusalReason),
    /// The source's last attempt failed with this label.
    Failed(ErrorLabel),
}

impl fmt::Display for SourceReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceReason::Refused(r) => write!(f, "refused: {r}"),
            SourceReason::Failed(l) => write!(f, "failed: {l}"),
        }
    }
}

/// Every source's latest reason, by source name.
pub type SourceReasons = BTreeMap<String, SourceReason>;

/// The terminal reasons of a failed logical call (SPEC §6), also the telemetry `error`
/// of its `terminal_failure` row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TerminalReason {
    /// The retry budget is spent.
    RetryExhausted,
    /// No progress for `RETRY__STALL_WINDOW_S`.
    Stalled,
    /// `CALL_DEADLINE_S` passed.
    DeadlineExceeded,
    /// The request was rejected (400/413/422).
    Rejected,
    /// No source could be admitted.
    NoRunnableSource,
    /// The governance backend (Redis) failed; polygw fails closed.
    GovernanceBackend,
    /// A structured answer stayed invalid after every re-ask.
    StructuredInvalid,
}

impl TerminalReason {
    /// The stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            TerminalReason::RetryExhausted => "retry_exhausted",
            TerminalReason::Stalled => "stalled",
            TerminalReason::DeadlineExceeded => "deadline_exceeded",
            TerminalReason::Rejected => "rejected",
            TerminalReason::NoRunnableSource => "no_runnable_source",
            TerminalReason::GovernanceBackend => "governance_backend",
            TerminalReason::StructuredInvalid => "structured_invalid",
        }
    }
}

impl fmt::Display for TerminalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What every terminal error carries besides its reason.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FailureContext {
    /// The logical call that failed.
    pub logical_call_id: String,
    /// The last attempt error, if any attempt was made.
    pub last_error: Option<Box<AttemptError>>,
    /// The source of the last attempt error.
    #[serde(default)]
    pub last_source: Option<String>,
    /// Every source's latest reason.
    pub reasons: SourceReasons,
    /// Attempts actually sent.
    pub attempts: u32,
    /// The earliest moment a retry could succeed, when known (cooldowns, quota).
    pub retry_after: Option<Duration>,
    /// Extra detail (governance backend message, structured parse error).
    pub detail: Option<String>,
}

/// The error of a logical call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    /// `RETRY__MAX_ATTEMPTS` budget-consuming rounds failed.
    #[error("retry_exhausted: {}", describe(.0))]
    RetryExhausted(Box<FailureContext>),
    /// No progress for `RETRY__STALL_WINDOW_S`.
    #[error("stalled: {}", describe(.0))]
    Stalled(Box<FailureContext>),
    /// `CALL_DEADLINE_S` passed.
    #[error("deadline_exceeded: {}", describe(.0))]
    DeadlineExceeded(Box<FailureContext>),
    /// The request was rejected by a source (400/413/422); the provider's code is kept.
    #[error("rejected: {}", describe(.0))]
    Rejected(Box<FailureContext>),
    /// No source could be admitted.
    #[error("no_runnable_source: {}", describe(.0))]
    NoRunnableSource(Box<FailureContext>),
    /// Redis (or another governance backend) failed; nothing was admitted blindly.
    #[error("governance_backend: {}", describe(.0))]
    GovernanceBackend(Box<FailureContext>),
    /// The structured answer stayed invalid after every re-ask.
    #[error("structured_invalid: {}", describe(.0))]
    StructuredInvalid(Box<FailureContext>),
    /// The request itself is malformed (before any attempt).
    #[error("invalid request: {field}: {message}")]
    InvalidRequest {
        /// The offending field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The client's configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

fn describe(ctx: &FailureContext) -> String {
    let mut s = String::new();
    if let Some(d) = &ctx.detail {
        s.push_str(d);
        s.push_str("; ");
    }
    match &ctx.last_error {
        Some(e) => s.push_str(&format!("last error: {e}")),
        None if ctx.attempts == 0 => s.push_str("no attempt made"),
        // Attempts were sent but none ended with an error of its own (the deadline or
        // the stall window cut them while they ran).
        None => s.push_str("no attempt finished"),
    }
    if !ctx.reasons.is_empty() {
        s.push_str("; sources: ");
        let parts: Vec<String> = ctx
            .reasons
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        s.push_str(&parts.join(", "));
    }
    s.push_str(&format!(
        "; attempts {} (logical call {})",
        ctx.attempts, ctx.logical_call_id
    ));
    s
}

impl GatewayError {
    /// Builds the terminal error for a reason.
    pub fn terminal(reason: TerminalReason, ctx: FailureContext) -> Self {
        let ctx = Box::new(ctx);
        match reason {
            TerminalReason::RetryExhausted => GatewayError::RetryExhausted(ctx),
            TerminalReason::Stalled => GatewayError::Stalled(ctx),
            TerminalReason::DeadlineExceeded => GatewayError::DeadlineExceeded(ctx),
            TerminalReason::Rejected => GatewayError::Rejected(ctx),
            TerminalReason::NoRunnableSource => GatewayError::NoRunnableSource(ctx),
            TerminalReason::GovernanceBackend => GatewayError::GovernanceBackend(ctx),
            TerminalReason::StructuredInvalid => GatewayError::StructuredInvalid(ctx),
        }
    }

    /// The terminal reason, for errors that end a logical call after it started.
    pub fn terminal_reason(&self) -> Option<TerminalReason> {
        Some(match self {
            GatewayError::RetryExhausted(_) => TerminalReason::RetryExhausted,
            GatewayError::Stalled(_) => TerminalReason::Stalled,
            GatewayError::DeadlineExceeded(_) => TerminalReason::DeadlineExceeded,
            GatewayError::Rejected(_) => TerminalReason::Rejected,
            GatewayError::NoRunnableSource(_) => TerminalReason::NoRunnableSource,
            GatewayError::GovernanceBackend(_) => TerminalReason::GovernanceBackend,
            GatewayError::StructuredInvalid(_) => TerminalReason::StructuredInvalid,
            GatewayError::InvalidRequest { .. } | GatewayError::Config(_) => return None,
        })
    }

    /// The failure context of a terminal error.
    pub fn context(&self) -> Option<&FailureContext> {
        match self {
            GatewayError::RetryExhausted(c)
            | GatewayError::Stalled(c)
            | GatewayError::DeadlineExceeded(c)
            | GatewayError::Rejected(c)
            | GatewayError::NoRunnableSource(c)
            | GatewayError::GovernanceBackend(c)
            | GatewayError::StructuredInvalid(c) => Some(c),
            GatewayError::InvalidRequest { .. } | GatewayError::Config(_) => None,
        }
    }

    /// The last attempt error, if any.
    pub fn last_error(&self) -> Option<&AttemptError> {
        self.context().and_then(|c| c.last_error.as_deref())
    }

    /// Every source's reason (empty for non-terminal errors).
    pub fn reasons(&self) -> SourceReasons {
        self.context()
            .map(|c| c.reasons.clone())
            .unwrap_or_default()
    }
}

/// A governance backend (limiter, breaker store) failure. polygw fails closed on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("governance backend {backend}: {message}")]
pub struct GovernanceError {
    /// Which backend (`redis`, `memory`).
    pub backend: String,
    /// What failed (no credentials).
    pub message: String,
}

impl GovernanceError {
    /// A new governance error.
    pub fn new(backend: impl Into<String>, message: impl Into<String>) -> Self {
        GovernanceError {
            backend: backend.into(),
            message: message.into(),
        }
    }
}

/// A response-cache failure; it never fails a call (the engine logs and goes on).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("response cache: {0}")]
pub struct CacheError(pub String);

/// A telemetry backend failure (the recorder logs, retries and counts; calls never see it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("telemetry: {0}")]
pub struct TelemetryError(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_table_matches_spec() {
        // (class, consumes budget, feeds breaker, terminal for call)
        let table = [
            (ErrorClass::Transient, true, true, false),
            (ErrorClass::RateLimited, false, false, false),
            (ErrorClass::Rejected, false, false, true),
            (ErrorClass::Invalid, true, false, false),
            (ErrorClass::Dead, true, false, false),
        ];
        for (class, budget, breaker, terminal) in table {
            assert_eq!(class.consumes_budget(), budget, "{class:?} budget");
            assert_eq!(class.feeds_breaker(), breaker, "{class:?} breaker");
            assert_eq!(class.is_terminal_for_call(), terminal, "{class:?} terminal");
            // Its stable name is serde's.
            assert_eq!(
                serde_json::to_value(class).unwrap(),
                serde_json::Value::from(class.as_str())
            );
        }
        assert_eq!(ErrorClass::RateLimited.as_str(), "rate_limited");
    }

    /// The telemetry detail: the text, the provider's code in brackets, at most 256
    /// characters.
    #[test]
    fn the_short_detail_carries_the_provider_code() {
        let mut e = AttemptError::new(ErrorClass::Rejected, ErrorLabel::Rejected, "bad input");
        assert_eq!(e.short_detail(), "bad input");
        e.provider_code = Some("invalid_request_error".into());
        assert_eq!(e.short_detail(), "bad input [invalid_request_error]");
        e.detail = "x".repeat(1000);
        assert_eq!(e.short_detail().chars().count(), 256);
    }

    /// The stable names, and serde's, of every refusal reason (metrics labels, telemetry,
    /// error bodies): a key's reasons say `key_…`.
    #[test]
    fn refusal_reasons_have_stable_names() {
        let names: Vec<&str> = RefusalReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            names,
            [
                "circuit_open",
                "dead",
                "cooldown",
                "rpm",
                "tpm",
                "concurrency",
                "scope_rpm",
                "scope_tpm",
                "key_rpm",
                "key_tpm",
                "key_concurrency",
                "key_budget_day",
                "key_budget_month",
                "key_budget_unpriced",
                "drained"
            ]
        );
        for r in RefusalReason::ALL {
            let json = serde_json::to_string(&r).unwrap();
            assert_eq!(json, format!("\"{}\"", r.as_str()));
            assert_eq!(r.is_key(), r.as_str().starts_with("key_"), "{r}");
        }
        assert!(!RefusalReason::KeyBudgetUnpriced.passes_with_time());
        assert!(RefusalReason::KeyBudgetMonth.passes_with_time());
    }

    #[test]
    fn labels_are_the_spec_names() {
        let names: Vec<&str> = ErrorLabel::ALL.iter().map(|l| l.as_str()).collect();
        assert_eq!(
            names,
            [
                "cancelled",
                "hedge_cancelled",
                "deadline",
                "rate_limited",
                "timeout",
                "ttft_timeout",
                "stall_timeout",
                "connect",
                "server_error",
                "truncated",
                "rejected",
                "invalid",
                "dead",
                "resume_diverged"
            ]
        );
        for l in ErrorLabel::ALL {
            let json = serde_json::to_string(&l).unwrap();
            assert_eq!(json, format!("\"{}\"", l.as_str()));
        }
    }

    #[test]
    fn terminal_reasons_are_the_spec_names() {
        use TerminalReason::*;
        for (r, name) in [
            (RetryExhausted, "retry_exhausted"),
            (Stalled, "stalled"),
            (DeadlineExceeded, "deadline_exceeded"),
            (Rejected, "rejected"),
            (NoRunnableSource, "no_runnable_source"),
            (GovernanceBackend, "governance_backend"),
            (StructuredInvalid, "structured_invalid"),
        ] {
            assert_eq!((r.as_str(), r.to_string()), (name, name.to_string()));
            // the telemetry `error` of a terminal row is the serialized name
            assert_eq!(serde_json::to_value(r).unwrap(), name);
        }
    }

    #[test]
    fn shorten_cuts_at_char_boundary() {
        let s = "ééééé".to_string(); // 10 bytes
        let cut = shorten(s, 6);
        assert!(cut.len() <= 6);
        assert!(cut.ends_with("..."));
        assert_eq!(cut, "é...", "as much as fits, cut at a character");
        assert_eq!(shorten("abc".into(), 6), "abc");
        assert_eq!(shorten("abcdefgh".into(), 6), "abc...");
    }

    /// An attempt error reads as its label, class, status and detail, then the
    /// provider's code, then the provider's message unless the detail says it already.
    #[test]
    fn an_attempt_error_reads_in_full_without_repeating_itself() {
        let mut e = AttemptError::new(ErrorClass::Rejected, ErrorLabel::Rejected, "HTTP 400");
        e.http_status = Some(400);
        e.provider_code = Some("bad_request".into());
        e.provider_message = Some("max_tokens is too large".into());
        e.retry_after = Some(std::time::Duration::from_millis(1500));
        assert_eq!(
            e.to_string(),
            "rejected (rejected) HTTP 400: HTTP 400 [code bad_request] — max_tokens is too large (retry after 1.500s)"
        );
        e.detail = "upstream said: max_tokens is too large".into();
        assert!(!e.to_string().contains(" — "), "{e}");
    }

    #[test]
    fn gateway_error_display_names_reason_and_sources() {
        let mut reasons = SourceReasons::new();
        reasons.insert("a-0".into(), SourceReason::Refused(RefusalReason::Rpm));
        reasons.insert("b-0".into(), SourceReason::Failed(ErrorLabel::ServerError));
        let err = GatewayError::terminal(
            TerminalReason::NoRunnableSource,
            FailureContext {
                logical_call_id: "lc1".into(),
                reasons,
                ..Default::default()
            },
        );
        let text = err.to_string();
        assert!(text.starts_with("no_runnable_source"), "{text}");
        assert!(text.contains("a-0 refused: rpm"), "{text}");
        assert!(text.contains("b-0 failed: server_error"), "{text}");
        assert_eq!(
            err.terminal_reason(),
            Some(TerminalReason::NoRunnableSource)
        );
        // the context's parts, as the facade and the proxy read them
        assert_eq!(
            err.context().map(|c| c.logical_call_id.as_str()),
            Some("lc1")
        );
        assert_eq!(err.reasons().len(), 2);
        assert_eq!(
            err.reasons()["b-0"],
            SourceReason::Failed(ErrorLabel::ServerError)
        );
        assert_eq!(err.last_error(), None);
        let last = AttemptError::new(ErrorClass::Transient, ErrorLabel::ServerError, "boom");
        let err = GatewayError::terminal(
            TerminalReason::RetryExhausted,
            FailureContext {
                last_error: Some(Box::new(last.clone())),
                ..Default::default()
            },
        );
        assert_eq!(err.last_error(), Some(&last));
        let bad = GatewayError::InvalidRequest {
            field: "messages".into(),
            message: "empty".into(),
        };
        assert_eq!((bad.context(), bad.last_error()), (None, None));
        assert!(bad.reasons().is_empty());
    }

    #[test]
    fn an_attempt_cut_in_flight_is_not_called_no_attempt() {
        let ctx = |attempts| FailureContext {
            logical_call_id: "lc".into(),
            attempts,
            ..Default::default()
        };
        let none = GatewayError::terminal(TerminalReason::DeadlineExceeded, ctx(0)).to_string();
        assert!(none.contains("no attempt made; attempts 0"), "{none}");
        let cut = GatewayError::terminal(TerminalReason::DeadlineExceeded, ctx(1)).to_string();
        assert!(!cut.contains("no attempt made"), "{cut}");
        assert!(cut.contains("no attempt finished; attempts 1"), "{cut}");
    }

    #[test]
    fn config_errors_fold() {
        assert!(ConfigError::from_list(vec![]).is_ok());
        let one = ConfigError::NoSources { scope: "X".into() };
        assert_eq!(ConfigError::from_list(vec![one.clone()]), Err(one.clone()));
        let many = ConfigError::from_list(vec![one.clone(), one.clone()]).unwrap_err();
        assert_eq!(many.all().len(), 2);
        assert!(many.to_string().starts_with("2 configuration errors"));
    }
}
