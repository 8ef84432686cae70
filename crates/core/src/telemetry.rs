//! Telemetry rows (SPEC §8): one per attempt, one per cache hit, one per failed logical
//! call; the cost rule that keeps "free" (0.0) and "unknown" (NULL) apart.

use serde::{Deserialize, Serialize};

use crate::response::{Usage, UsageSource};
use crate::source::SourceConfig;

/// The `kind` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RowKind {
    /// One HTTP request to one source (hedge legs included).
    Attempt,
    /// A response served from the cache.
    CacheHit,
    /// The end of a failed logical call.
    TerminalFailure,
}

impl RowKind {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            RowKind::Attempt => "attempt",
            RowKind::CacheHit => "cache_hit",
            RowKind::TerminalFailure => "terminal_failure",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        [
            RowKind::Attempt,
            RowKind::CacheHit,
            RowKind::TerminalFailure,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

/// One row of `llm_calls`. Column order and meaning: docs/TELEMETRY.md.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TelemetryRow {
    /// Unique id of the row (attempt id); inserts are idempotent on it.
    pub call_id: String,
    /// The logical call it belongs to.
    pub logical_call_id: String,
    /// Scope name.
    pub scope: String,
    /// `chat`, `embedding` or `ocr`.
    pub operation: String,
    /// attempt / cache_hit / terminal_failure.
    pub kind: RowKind,
    /// Source name (`{provider}-{n}`); `None` on cache hits and terminal rows.
    pub source: Option<String>,
    /// Provider segment, lower-case.
    pub provider: Option<String>,
    /// The model asked for (or that answered, when known).
    pub model: Option<String>,
    /// 0-based index of the attempt within its logical call.
    pub attempt_index: Option<u32>,
    /// The attempt was an extra hedge leg.
    pub is_hedge: bool,
    /// The upstream was read as a stream.
    pub stream: bool,
    /// The attempt (or call) succeeded.
    pub ok: bool,
    /// Error label, or terminal reason on terminal rows.
    pub error: Option<String>,
    /// Short detail; never a secret.
    pub error_detail: Option<String>,
    /// HTTP status, when a response arrived.
    pub http_status: Option<u16>,
    /// Input tokens (`None` when unknown).
    pub prompt_tokens: Option<u64>,
    /// Output tokens (`None` when unknown).
    pub completion_tokens: Option<u64>,
    /// Reasoning tokens, when reported.
    pub reasoning_tokens: Option<u64>,
    /// measured / estimated / unavailable.
    pub usage_source: UsageSource,
    /// Cost; `None` when unknown (never 0 for unknown usage).
    pub cost: Option<f64>,
    /// Wall time of the attempt (or the call, on terminal and cache rows).
    pub latency_ms: Option<u64>,
    /// Time to first incremental chunk.
    pub ttft_ms: Option<u64>,
    /// Largest gap between incremental chunks.
    pub max_inter_token_ms: Option<u64>,
    /// Sum of gaps over the stall threshold.
    pub stall_ms: Option<u64>,
    /// Number of such gaps.
    pub stall_count: Option<u32>,
    /// Served from the cache.
    pub cache_hit: bool,
    /// Wall clock, ms since the Unix epoch (UTC).
    pub created_at_ms: i64,
    /// A resume leg: the `call_id` of the attempt whose answer it continues.
    #[serde(default)]
    pub resume_of: Option<String>,
    /// A resume leg: `prefill` or `replay`.
    #[serde(default)]
    pub resume_mode: Option<String>,
    /// A resume leg: characters of content the caller had when it started.
    #[serde(default)]
    pub prefix_chars: Option<u64>,
    /// The API route the call came by (`chat`, `responses`, `messages`, `embeddings`;
    /// `None` for library calls: SPEC §18.4).
    #[serde(default)]
    pub api: Option<String>,
    /// Prompt tokens read from the provider's prompt cache (SPEC §20.1).
    #[serde(default)]
    pub cached_prompt_tokens: Option<u64>,
    /// Prompt tokens written to the provider's prompt cache.
    #[serde(default)]
    pub cache_write_tokens: Option<u64>,
    /// A row whose usage is unavailable: the gateway's estimate of the prompt it sent
    /// (SPEC §20.4).
    #[serde(default)]
    pub est_prompt_tokens: Option<u64>,
    /// A row whose usage is unavailable: an estimate of the text and reasoning it
    /// received before the end (SPEC §20.4).
    #[serde(default)]
    pub est_received_tokens: Option<u64>,
    /// The client key the call came with (`polygw serve` client keys: SPEC §21.1).
    #[serde(default)]
    pub client_key_id: Option<String>,
    /// The call's decision trace, compact JSON, on its last row (SPEC §19.4).
    #[serde(default)]
    pub trace: Option<String>,
}

impl TelemetryRow {
    /// An empty row of a kind; callers fill the rest.
    pub fn new(
        kind: RowKind,
        call_id: impl Into<String>,
        logical_call_id: impl Into<String>,
        scope: impl Into<String>,
        operation: impl Into<String>,
        created_at_ms: i64,
    ) -> Self {
        TelemetryRow {
            call_id: call_id.into(),
            logical_call_id: logical_call_id.into(),
            scope: scope.into(),
            operation: operation.into(),
            kind,
            source: None,
            provider: None,
            model: None,
            attempt_index: None,
            is_hedge: false,
            stream: false,
            ok: false,
            error: None,
            error_detail: None,
            http_status: None,
            prompt_tokens: None,
            completion_tokens: None,
            reasoning_tokens: None,
            usage_source: UsageSource::Unavailable,
            cost: None,
            latency_ms: None,
            ttft_ms: None,
            max_inter_token_ms: None,
            stall_ms: None,
            stall_count: None,
            cache_hit: false,
            created_at_ms,
            resume_of: None,
            resume_mode: None,
            api: None,
            cached_prompt_tokens: None,
            cache_write_tokens: None,
            est_prompt_tokens: None,
            est_received_tokens: None,
            client_key_id: None,
            trace: None,
            prefix_chars: None,
        }
    }

    /// Sets usage columns: tokens only when usage is known.
    pub fn with_usage(mut self, usage: &Usage, source: UsageSource) -> Self {
        self.usage_source = source;
        if source != UsageSource::Unavailable {
            self.prompt_tokens = Some(usage.prompt_tokens);
            self.completion_tokens = Some(usage.completion_tokens);
            self.reasoning_tokens = usage.reasoning_tokens;
            self.cached_prompt_tokens = usage.cached_prompt_tokens;
            self.cache_write_tokens = usage.cache_write_tokens;
        }
        self
    }
}

/// What a cost is computed for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CostBasis<'a> {
    /// A cache hit: nothing was spent.
    CacheHit,
    /// A failed attempt or a terminal row: unknown.
    Failed,
    /// A successful token-priced attempt.
    Tokens {
        /// Its usage.
        usage: &'a Usage,
        /// Where usage came from.
        source: UsageSource,
    },
    /// A successful OCR call (priced per call).
    PerCall,
}

/// SPEC §8 cost rule. cache hit → 0.0; failed → NULL; usage unavailable → NULL; no
/// price → NULL; else `(prompt·INPUT_PRICE + completion·OUTPUT_PRICE) / 1e6`. A price
/// that is missing for a non-zero token count makes the cost unknown (NULL), never 0.
pub fn cost(basis: CostBasis<'_>, src: &SourceConfig) -> Option<f64> {
    match basis {
        CostBasis::CacheHit => Some(0.0),
        CostBasis::Failed => None,
        CostBasis::PerCall => src.price_per_call,
        CostBasis::Tokens { usage, source } => {
            if source == UsageSource::Unavailable || !src.has_token_prices() {
                return None;
            }
            let part = |tokens: u64, price: Option<f64>| -> Option<f64> {
                match (tokens, price) {
                    (0, _) => Some(0.0),
                    (t, Some(p)) => Some(t as f64 * p),
                    (_, None) => None,
                }
            };
            let total = part(usage.prompt_tokens, src.input_price)?
                + part(usage.completion_tokens, src.output_price)?;
            Some(total / 1e6)
        }
    }
}

/// The accounting-gap query of SPEC §8 (standard SQL, both databases).
pub const ACCOUNTING_GAP_SQL: &str =
    "SELECT COUNT(*) FROM llm_calls WHERE usage_source = 'unavailable' AND NOT cache_hit AND kind = 'attempt'";

#[cfg(test)]
mod tests {
    use super::*;

    fn src() -> SourceConfig {
        SourceConfig::new("p", 0, "http://x", "", "m")
    }

    #[test]
    fn cost_rule_table() {
        let u = Usage::new(1_000_000, 500_000);
        let priced = src().with_prices(2.0, 8.0);
        let in_only = SourceConfig {
            input_price: Some(2.0),
            ..src()
        };
        let ocr = src().with_price_per_call(0.01);
        let zero_out = Usage::new(1000, 0);
        let unpriced = src();
        let rows: Vec<(&str, CostBasis<'_>, &SourceConfig, Option<f64>)> = vec![
            ("cache hit", CostBasis::CacheHit, &priced, Some(0.0)),
            (
                "cache hit, no price",
                CostBasis::CacheHit,
                &unpriced,
                Some(0.0),
            ),
            ("failed", CostBasis::Failed, &priced, None),
            (
                "unavailable",
                CostBasis::Tokens {
                    usage: &u,
                    source: UsageSource::Unavailable,
                },
                &priced,
                None,
            ),
            (
                "no price",
                CostBasis::Tokens {
                    usage: &u,
                    source: UsageSource::Measured,
                },
                &unpriced,
                None,
            ),
            (
                "measured",
                CostBasis::Tokens {
                    usage: &u,
                    source: UsageSource::Measured,
                },
                &priced,
                Some(6.0),
            ),
            (
                "estimated",
                CostBasis::Tokens {
                    usage: &u,
                    source: UsageSource::Estimated,
                },
                &priced,
                Some(6.0),
            ),
            (
                "output price missing",
                CostBasis::Tokens {
                    usage: &u,
                    source: UsageSource::Measured,
                },
                &in_only,
                None,
            ),
            (
                "output price missing, no output",
                CostBasis::Tokens {
                    usage: &zero_out,
                    source: UsageSource::Measured,
                },
                &in_only,
                Some(0.002),
            ),
            ("ocr priced", CostBasis::PerCall, &ocr, Some(0.01)),
            ("ocr unpriced", CostBasis::PerCall, &unpriced, None),
        ];
        for (name, basis, s, want) in rows {
            let got = cost(basis, s);
            match (got, want) {
                (Some(a), Some(b)) => assert!((a - b).abs() < 1e-12, "{name}: {a} != {b}"),
                (a, b) => assert_eq!(a, b, "{name}"),
            }
        }
    }

    #[test]
    fn unavailable_rows_have_null_tokens() {
        let r = TelemetryRow::new(RowKind::Attempt, "c", "l", "S", "chat", 0)
            .with_usage(&Usage::new(5, 6), UsageSource::Unavailable);
        assert_eq!((r.prompt_tokens, r.completion_tokens), (None, None));
        let r = r.with_usage(&Usage::new(5, 6), UsageSource::Measured);
        assert_eq!((r.prompt_tokens, r.completion_tokens), (Some(5), Some(6)));
        assert_eq!(RowKind::parse("cache_hit"), Some(RowKind::CacheHit));
    }
}
