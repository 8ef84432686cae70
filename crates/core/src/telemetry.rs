//! Telemetry rows (SPEC §8): one per attempt, one per cache hit, one per failed logical
//! call; the cost rule that keeps "free" (0.0) and "unknown" (NULL) apart, with the
//! prompt-cache prices (SPEC §20.1); and the books of rows against a provider's invoice —
//! the accounting gap as tokens and as a cost range (SPEC §20.4).

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::ErrorLabel;
use crate::response::{Usage, UsageSource};
use crate::source::SourceConfig;
use crate::usage::LegEstimate;

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
    pub scope: Arc<str>,
    /// `chat`, `embedding` or `ocr`.
    pub operation: Arc<str>,
    /// attempt / cache_hit / terminal_failure.
    pub kind: RowKind,
    /// Source name (`{provider}-{n}`); `None` on cache hits and terminal rows.
    pub source: Option<Arc<str>>,
    /// Provider segment, lower-case.
    pub provider: Option<Arc<str>>,
    /// The model asked for (or that answered, when known).
    pub model: Option<Arc<str>>,
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
    /// An attempt its provider may have billed without reporting usage (its usage is
    /// unavailable, or estimated from the text it received): the gateway's estimate of
    /// the prompt it sent (SPEC §20.4; docs/TELEMETRY.md).
    #[serde(default)]
    pub est_prompt_tokens: Option<u64>,
    /// The same rows: an estimate of the text, reasoning and tool calls it received
    /// before the end (SPEC §20.4).
    #[serde(default)]
    pub est_received_tokens: Option<u64>,
    /// The client key the call came with (`polygw serve` client keys: SPEC §21.1).
    #[serde(default)]
    pub client_key_id: Option<String>,
    /// The agent session the call belongs to, as its client named it (SPEC §24.6).
    #[serde(default)]
    pub agent_session_id: Option<String>,
    /// The (sub-)agent that made the call, as its client named it (SPEC §24.6).
    #[serde(default)]
    pub agent_id: Option<String>,
    /// The agent that started that sub-agent (SPEC §24.6).
    #[serde(default)]
    pub parent_agent_id: Option<String>,
    /// The call's decision trace, compact JSON, on its last row (SPEC §19.4).
    #[serde(default)]
    pub trace: Option<String>,
}

/// Who a call is for, as its client says (SPEC §24.6): the agent session, the agent that
/// made the call and the agent that started it. Every row of the call carries them, so
/// spend can be summed per session and per sub-agent. Values are ids, not secrets;
/// [`Attribution::id`] keeps them short and printable.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attribution {
    /// `agent_session_id`.
    pub session: Option<String>,
    /// `agent_id`.
    pub agent: Option<String>,
    /// `parent_agent_id`.
    pub parent_agent: Option<String>,
}

impl Attribution {
    /// The longest id kept, in characters (a longer one is cut).
    pub const MAX_ID_CHARS: usize = 128;

    /// A client's id as a row keeps it: trimmed, control characters dropped, at most
    /// [`Self::MAX_ID_CHARS`]; `None` when nothing is left.
    pub fn id(raw: &str) -> Option<String> {
        let s: String = raw
            .trim()
            .chars()
            .filter(|c| !c.is_control())
            .take(Self::MAX_ID_CHARS)
            .collect();
        (!s.is_empty()).then_some(s)
    }

    /// Whether it names nothing.
    pub fn is_empty(&self) -> bool {
        self.session.is_none() && self.agent.is_none() && self.parent_agent.is_none()
    }

    /// Writes it into a row.
    pub fn apply(&self, row: &mut TelemetryRow) {
        row.agent_session_id.clone_from(&self.session);
        row.agent_id.clone_from(&self.agent);
        row.parent_agent_id.clone_from(&self.parent_agent);
    }
}

impl TelemetryRow {
    /// An empty row of a kind; callers fill the rest.
    pub fn new(
        kind: RowKind,
        call_id: impl Into<String>,
        logical_call_id: impl Into<String>,
        scope: impl Into<Arc<str>>,
        operation: impl Into<Arc<str>>,
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
            agent_session_id: None,
            agent_id: None,
            parent_agent_id: None,
            trace: None,
            prefix_chars: None,
        }
    }

    /// Sets usage columns: tokens only when usage is known.
    pub fn with_usage(mut self, usage: &Usage, source: UsageSource) -> Self {
        self.set_usage(usage, source);
        self
    }

    /// [`TelemetryRow::with_usage`] in place.
    pub fn set_usage(&mut self, usage: &Usage, source: UsageSource) {
        self.usage_source = source;
        if source != UsageSource::Unavailable {
            self.prompt_tokens = Some(usage.prompt_tokens);
            self.completion_tokens = Some(usage.completion_tokens);
            self.reasoning_tokens = usage.reasoning_tokens;
            self.cached_prompt_tokens = usage.cached_prompt_tokens;
            self.cache_write_tokens = usage.cache_write_tokens;
        }
    }

    /// Sets the estimate columns (SPEC §20.4) of a row whose usage the provider did not
    /// report: unavailable, or estimated from the text it received (then they hold the
    /// same figures as its token columns).
    pub fn with_estimate(mut self, e: &LegEstimate) -> Self {
        self.set_estimate(e);
        self
    }

    /// [`TelemetryRow::with_estimate`] in place.
    pub fn set_estimate(&mut self, e: &LegEstimate) {
        self.est_prompt_tokens = Some(e.prompt_tokens);
        self.est_received_tokens = Some(e.received_tokens);
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

/// The tokens of a usage as a provider bills them (SPEC §8, §20.1), each at its own
/// price.
///
/// [`Usage`]'s convention is OpenAI's: cached and cache-write tokens are *part of*
/// `prompt_tokens`, and reasoning tokens part of `completion_tokens`. The transport
/// normalises what providers send to it (an Anthropic-style usage whose
/// `cache_read_input_tokens + cache_creation_input_tokens` exceed its `prompt_tokens`
/// counts them apart, and they are added to the prompt; xAI's reasoning reported
/// outside `completion_tokens` is added to it). A usage built otherwise is read the same
/// way, so the rule is idempotent on normalised usage:
/// - cache figures larger than the prompt → the prompt is the uncached part (Anthropic's
///   convention);
/// - reasoning larger than the completion → reported outside it, billed on top of it.
///
/// No part is ever negative and the parts never count a token twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BilledTokens {
    /// Prompt tokens neither read from nor written to the cache (`INPUT_PRICE`).
    pub uncached_prompt: u64,
    /// Prompt tokens read from the cache (`CACHED_INPUT_PRICE`).
    pub cached_prompt: u64,
    /// Prompt tokens written to the cache for the default time (`CACHE_WRITE_PRICE`).
    pub cache_write: u64,
    /// Prompt tokens written to the cache for an hour (`CACHE_WRITE_1H_PRICE`).
    pub cache_write_1h: u64,
    /// Completion tokens, reasoning included (`OUTPUT_PRICE`).
    pub output: u64,
}

impl BilledTokens {
    /// The billed parts of `u` (see the type's doc).
    pub fn of(u: &Usage) -> Self {
        let cached = u.cached_prompt_tokens.unwrap_or(0);
        let write = u.cache_write_tokens.unwrap_or(0);
        let cache = cached.saturating_add(write);
        let uncached = if cache > u.prompt_tokens {
            u.prompt_tokens
        } else {
            u.prompt_tokens - cache
        };
        let reasoning = u.reasoning_tokens.unwrap_or(0);
        let output = if reasoning > u.completion_tokens {
            u.completion_tokens.saturating_add(reasoning)
        } else {
            u.completion_tokens
        };
        let write_1h = u.cache_write_1h_tokens.unwrap_or(0).min(write);
        BilledTokens {
            uncached_prompt: uncached,
            cached_prompt: cached,
            cache_write: write - write_1h,
            cache_write_1h: write_1h,
            output,
        }
    }

    /// All prompt tokens billed (uncached, cached and written).
    pub fn prompt(&self) -> u64 {
        self.uncached_prompt
            .saturating_add(self.cached_prompt)
            .saturating_add(self.cache_write)
            .saturating_add(self.cache_write_1h)
    }
}

/// A source's token prices as the cost rule reads them, per 1M tokens: `cached_input`
/// and `cache_write` are `CACHED_INPUT_PRICE` / `CACHE_WRITE_PRICE`, else `INPUT_PRICE`
/// (SPEC §20.1). A price that is not a finite number ≥ 0 (the guards refuse those; a
/// struct built by hand may hold one) counts as not configured, so no cost is ever
/// negative or NaN.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TokenPrices {
    /// `INPUT_PRICE`.
    pub input: Option<f64>,
    /// `CACHED_INPUT_PRICE`, else `INPUT_PRICE`.
    pub cached_input: Option<f64>,
    /// `CACHE_WRITE_PRICE`, else `INPUT_PRICE`.
    pub cache_write: Option<f64>,
    /// `CACHE_WRITE_1H_PRICE`, else `CACHE_WRITE_PRICE`, else `INPUT_PRICE`.
    pub cache_write_1h: Option<f64>,
    /// `OUTPUT_PRICE`.
    pub output: Option<f64>,
}

fn usable(p: Option<f64>) -> Option<f64> {
    p.filter(|p| p.is_finite() && *p >= 0.0)
}

impl TokenPrices {
    /// The prices of a source.
    pub fn of(src: &SourceConfig) -> Self {
        let input = usable(src.input_price);
        let cache_write = usable(src.cache_write_price).or(input);
        TokenPrices {
            input,
            cached_input: usable(src.cached_input_price).or(input),
            cache_write,
            cache_write_1h: usable(src.cache_write_1h_price).or(cache_write),
            output: usable(src.output_price),
        }
    }

    /// Whether any token price is configured (none: every token cost is unknown).
    pub fn any(&self) -> bool {
        self.input.is_some()
            || self.cached_input.is_some()
            || self.cache_write.is_some()
            || self.output.is_some()
    }

    /// The dearest price a prompt token can have (uncached, cached or written); `None`
    /// when one of them is unknown.
    pub fn max_prompt(&self) -> Option<f64> {
        Some(
            self.input?
                .max(self.cached_input?)
                .max(self.cache_write?)
                .max(self.cache_write_1h?),
        )
    }
}

/// `tokens × price`: 0 for no token whatever the price; unknown for tokens without a
/// price.
fn part(tokens: u64, price: Option<f64>) -> Option<f64> {
    match (tokens, price) {
        (0, _) => Some(0.0),
        (t, Some(p)) => Some(t as f64 * p),
        (_, None) => None,
    }
}

/// The cost of `t` at `p` (SPEC §8, §20.1):
/// `(uncached·INPUT_PRICE + cached·CACHED_INPUT_PRICE + write·CACHE_WRITE_PRICE +
/// output·OUTPUT_PRICE) / 1e6`, summed in that order in `f64` (the mock upstream's
/// billing log sums in the same order, so measured rows equal its bill bit for bit).
/// `None` when no token price is configured at all, or when a part with a non-zero
/// count has no price — unknown, never 0. Never negative.
pub fn token_cost(t: &BilledTokens, p: &TokenPrices) -> Option<f64> {
    if !p.any() {
        return None;
    }
    let total = part(t.uncached_prompt, p.input)?
        + part(t.cached_prompt, p.cached_input)?
        + part(t.cache_write, p.cache_write)?
        + part(t.cache_write_1h, p.cache_write_1h)?
        + part(t.output, p.output)?;
    Some(total / 1e6)
}

/// SPEC §8 cost rule, with SPEC §20.1's prompt-cache prices. cache hit → 0.0; failed →
/// NULL; usage unavailable → NULL; no price → NULL; OCR → `PRICE_PER_CALL`; else
/// [`token_cost`] of [`BilledTokens::of`] the usage at [`TokenPrices::of`] the source. A
/// price that is missing for a non-zero token count makes the cost unknown (NULL),
/// never 0.
pub fn cost(basis: CostBasis<'_>, src: &SourceConfig) -> Option<f64> {
    match basis {
        CostBasis::CacheHit => Some(0.0),
        CostBasis::Failed => None,
        CostBasis::PerCall => usable(src.price_per_call),
        CostBasis::Tokens { usage, source } => {
            if source == UsageSource::Unavailable {
                return None;
            }
            token_cost(&BilledTokens::of(usage), &TokenPrices::of(src))
        }
    }
}

/// What the provider's prompt cache saved on `t` at `p`: the cost of its cached and
/// written prompt tokens at `INPUT_PRICE` minus their cost as billed,
/// `(cached·(INPUT − CACHED_INPUT) + write·(INPUT − CACHE_WRITE)) / 1e6`. Negative when
/// writes cost more than they saved (Anthropic bills writes at 1.25×). `Some(0.0)` for
/// no cached or written token; `None` when `INPUT_PRICE` is unknown and there are some.
pub fn cache_saving(t: &BilledTokens, p: &TokenPrices) -> Option<f64> {
    if t.cached_prompt == 0 && t.cache_write == 0 && t.cache_write_1h == 0 {
        return Some(0.0);
    }
    let input = p.input?;
    let cached = t.cached_prompt as f64 * (input - p.cached_input?);
    let write = t.cache_write as f64 * (input - p.cache_write?);
    let write_1h = if t.cache_write_1h == 0 {
        0.0
    } else {
        t.cache_write_1h as f64 * (input - p.cache_write_1h?)
    };
    Some((cached + write + write_1h) / 1e6)
}

/// What an attempt's row charges to its client key (SPEC §24.2): its cost; for a failed
/// attempt no provider billed — a connect failure, or an error status answered before
/// any body — 0, not the unknown cost that settles at the reservation (a key's budget
/// does not burn in an outage).
pub fn key_cost(row: &TelemetryRow) -> Option<f64> {
    if row.cost.is_some() || row.ok {
        return row.cost;
    }
    let label = row
        .error
        .as_deref()
        .and_then(|e| ErrorLabel::ALL.iter().copied().find(|l| l.as_str() == e));
    match label {
        Some(l) if !may_be_billed(l, row.http_status) => Some(0.0),
        _ => None,
    }
}

/// Whether a failed attempt may have been billed by its provider (SPEC §20.4): its
/// request was sent (anything but `connect`, which means no connection was made) and not
/// answered with an error status (an error answer is not billed; a 2xx, or no answer
/// yet — a timeout, a cancelled leg — may be). Its row then records the gateway's
/// estimate ([`TelemetryRow::with_estimate`]).
pub fn may_be_billed(label: ErrorLabel, http_status: Option<u16>) -> bool {
    label != ErrorLabel::Connect && http_status.is_none_or(|s| (200..300).contains(&s))
}

/// The cost range of an attempt the gateway only estimated (SPEC §20.4), at `p`:
/// - `low` — what was received: `received × OUTPUT_PRICE / 1e6` (the provider certainly
///   generated it; the prompt is not counted, as the request may never have been
///   accepted, and its figure is an estimate);
/// - `high` — plus everything it may have billed: `(prompt × the dearest prompt price +
///   (received + allowance) × OUTPUT_PRICE) / 1e6`, where `allowance` is the most the
///   leg could have generated beyond what arrived (the source's `EST_TOKENS`); `None`
///   (no upper bound) when `allowance` is 0.
///
/// `None` when a price needed for a non-zero count is unknown.
pub fn gap_cost_range(
    est_prompt: u64,
    est_received: u64,
    allowance: u64,
    p: &TokenPrices,
) -> Option<CostRange> {
    let low = part(est_received, p.output)? / 1e6;
    let high = if allowance == 0 {
        None
    } else {
        let prompt = part(
            est_prompt,
            if est_prompt == 0 {
                Some(0.0)
            } else {
                p.max_prompt()
            },
        )?;
        let out = part(est_received.saturating_add(allowance), p.output)?;
        Some((prompt + out) / 1e6)
    };
    Some(CostRange { low, high })
}

/// A range of costs: at least `low`, at most `high` (`None`: no upper bound known).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CostRange {
    /// The least it can be.
    pub low: f64,
    /// The most it can be, when bounded.
    pub high: Option<f64>,
}

impl CostRange {
    /// The range of a known cost.
    pub fn exact(c: f64) -> Self {
        CostRange {
            low: c,
            high: Some(c),
        }
    }

    /// The sum of two ranges.
    pub fn plus(self, o: CostRange) -> CostRange {
        CostRange {
            low: self.low + o.low,
            high: self.high.zip(o.high).map(|(a, b)| a + b),
        }
    }

    /// Whether `c` lies within the range.
    pub fn contains(&self, c: f64) -> bool {
        c >= self.low && self.high.is_none_or(|h| c <= h)
    }
}

/// The books of attempt rows against a provider's invoice (SPEC §20.4), per source:
/// what polygw knows exactly, and the accounting gap as tokens and as a cost range.
/// Fed row by row ([`Accounts::add`]); pure.
///
/// Every attempt row falls in one class:
/// - **billed as reported**: no estimate columns, a cost (measured usage, or usage the
///   provider reported before the stream broke) → `reported_cost`;
/// - **unpriced**: usage reported, cost NULL (a price missing) → `unpriced_rows`;
/// - **the gap**: the row carries `est_prompt_tokens` (usage unavailable, or estimated
///   from the text it received) → its tokens, and [`gap_cost_range`] in `gap`;
/// - **not billed**: usage unavailable without an estimate — answered with an error
///   status, or never sent (or written before polygw recorded estimates) →
///   `not_billed_rows`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Accounts {
    /// Attempt rows.
    pub attempts: u64,
    /// Σ cost of the rows billed as reported.
    pub reported_cost: f64,
    /// Rows billed as reported.
    pub reported_rows: u64,
    /// Rows with reported usage and no cost (a price missing).
    pub unpriced_rows: u64,
    /// Rows in the gap.
    pub gap_rows: u64,
    /// Of those, rows whose usage is unavailable (the rest were estimated from the text
    /// they received, and carry that estimate's cost).
    pub gap_unavailable: u64,
    /// Σ `est_prompt_tokens` of the gap.
    pub est_prompt_tokens: u64,
    /// Σ `est_received_tokens` of the gap.
    pub est_received_tokens: u64,
    /// The gap's cost range; `None` when a row of it cannot be priced.
    pub gap: Option<CostRange>,
    /// Rows not billed.
    pub not_billed_rows: u64,
}

impl Accounts {
    /// Empty books.
    pub fn new() -> Self {
        Accounts {
            gap: Some(CostRange {
                low: 0.0,
                high: Some(0.0),
            }),
            ..Accounts::default()
        }
    }

    /// Adds one row; `prices` are its source's (`None`: unknown), `allowance` the most
    /// the leg could have generated unseen (the source's `EST_TOKENS`). Rows other than
    /// attempts are ignored.
    pub fn add(&mut self, r: &TelemetryRow, prices: Option<&TokenPrices>, allowance: u64) {
        if r.kind != RowKind::Attempt {
            return;
        }
        self.attempts += 1;
        if let Some(est_prompt) = r.est_prompt_tokens {
            let received = r.est_received_tokens.unwrap_or(0);
            self.gap_rows += 1;
            if r.usage_source == UsageSource::Unavailable {
                self.gap_unavailable += 1;
            }
            self.est_prompt_tokens = self.est_prompt_tokens.saturating_add(est_prompt);
            self.est_received_tokens = self.est_received_tokens.saturating_add(received);
            let range = prices.and_then(|p| gap_cost_range(est_prompt, received, allowance, p));
            self.gap = self.gap.zip(range).map(|(a, b)| a.plus(b));
        } else if r.usage_source == UsageSource::Unavailable {
            self.not_billed_rows += 1;
        } else if let Some(c) = r.cost {
            self.reported_rows += 1;
            self.reported_cost += c;
        } else {
            self.unpriced_rows += 1;
        }
    }

    /// Where the provider's invoice must lie: the reported cost plus the gap's range;
    /// `None` when some row cannot be priced.
    pub fn invoice_range(&self) -> Option<CostRange> {
        if self.unpriced_rows > 0 {
            return None;
        }
        self.gap
            .map(|g| CostRange::exact(self.reported_cost).plus(g))
    }
}

/// The accounting-gap query of SPEC §8 (standard SQL, both databases).
pub const ACCOUNTING_GAP_SQL: &str =
    "SELECT COUNT(*) FROM llm_calls WHERE usage_source = 'unavailable' AND NOT cache_hit AND kind = 'attempt'";

#[cfg(test)]
mod tests {

    /// SPEC §24.2: a connect failure or an error status costs the key 0; a failure that
    /// may have been billed (a timeout, a 200 that broke) stays unknown; a cost is kept.
    #[test]
    fn what_no_one_billed_costs_the_key_nothing() {
        let failed = |label: ErrorLabel, status: Option<u16>| {
            let mut r = TelemetryRow::new(RowKind::Attempt, "c", "l", "S", "chat", 0);
            r.ok = false;
            r.error = Some(label.as_str().to_string());
            r.http_status = status;
            r
        };
        assert_eq!(key_cost(&failed(ErrorLabel::Connect, None)), Some(0.0));
        assert_eq!(
            key_cost(&failed(ErrorLabel::Rejected, Some(400))),
            Some(0.0)
        );
        assert_eq!(
            key_cost(&failed(ErrorLabel::ServerError, Some(503))),
            Some(0.0)
        );
        assert_eq!(key_cost(&failed(ErrorLabel::Timeout, None)), None);
        assert_eq!(key_cost(&failed(ErrorLabel::Truncated, Some(200))), None);
        let mut priced = failed(ErrorLabel::Truncated, Some(200));
        priced.cost = Some(0.5);
        assert_eq!(key_cost(&priced), Some(0.5));
    }
    use super::*;
    use proptest::prelude::*;

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

    fn usage(p: u64, c: u64, cached: Option<u64>, write: Option<u64>, r: Option<u64>) -> Usage {
        Usage {
            reasoning_tokens: r,
            cached_prompt_tokens: cached,
            cache_write_tokens: write,
            cache_write_1h_tokens: None,
            ..Usage::new(p, c)
        }
    }

    fn measured(u: &Usage) -> CostBasis<'_> {
        CostBasis::Tokens {
            usage: u,
            source: UsageSource::Measured,
        }
    }

    #[test]
    fn cached_and_written_prompt_tokens_have_their_prices() {
        // 1000 prompt tokens: 600 read from the cache, 300 written, 100 plain; 10 out.
        let u = usage(1000, 10, Some(600), Some(300), None);
        let all = src()
            .with_prices(2.0, 8.0)
            .with_cached_input_price(0.5)
            .with_cache_write_price(2.5);
        // 100·2 + 600·0.5 + 300·2.5 + 10·8 = 200 + 300 + 750 + 80 = 1330 (the mock's
        // billing example, SPEC §20.3).
        assert_eq!(cost(measured(&u), &all), Some(1330.0 / 1e6));
        // Unset cache prices are INPUT_PRICE: the whole prompt at 2.
        let plain = src().with_prices(2.0, 8.0);
        assert_eq!(
            cost(measured(&u), &plain),
            Some((1000.0 * 2.0 + 80.0) / 1e6)
        );
        // Only the cached price: writes at INPUT_PRICE.
        let cached_only = src().with_prices(2.0, 8.0).with_cached_input_price(0.5);
        assert_eq!(
            cost(measured(&u), &cached_only),
            Some((200.0 + 300.0 + 600.0 + 80.0) / 1e6)
        );
        // No INPUT_PRICE: the 100 plain tokens have no price → unknown, even with both
        // cache prices.
        let no_input = SourceConfig {
            output_price: Some(8.0),
            cached_input_price: Some(0.5),
            cache_write_price: Some(2.5),
            ..src()
        };
        assert_eq!(cost(measured(&u), &no_input), None);
        // … but a prompt read wholly from the cache needs no INPUT_PRICE.
        let all_cached = usage(600, 10, Some(600), None, None);
        assert_eq!(
            cost(measured(&all_cached), &no_input),
            Some((300.0 + 80.0) / 1e6)
        );
    }

    #[test]
    fn anthropic_style_cache_figures_outside_the_prompt_are_not_subtracted() {
        // The transport adds them to the prompt; a usage that kept Anthropic's
        // convention (cache figures larger than the prompt) reads its prompt as the
        // uncached part.
        let outside = usage(30, 7, Some(60), Some(10), None);
        let t = BilledTokens::of(&outside);
        assert_eq!(
            (t.uncached_prompt, t.cached_prompt, t.cache_write, t.output),
            (30, 60, 10, 7)
        );
        let normalised = usage(100, 7, Some(60), Some(10), None);
        assert_eq!(BilledTokens::of(&normalised), t);
        assert_eq!(t.prompt(), 100);
    }

    #[test]
    fn reasoning_outside_the_completion_is_billed_as_output() {
        // xAI: completion 1, reasoning 290 (total = prompt + completion + reasoning).
        let x = usage(12, 1, Some(11), None, Some(290));
        assert_eq!(BilledTokens::of(&x).output, 291);
        // OpenAI: reasoning is part of the completion.
        let o = usage(15, 78, None, None, Some(64));
        assert_eq!(BilledTokens::of(&o).output, 78);
    }

    #[test]
    fn bad_prices_count_as_unknown() {
        let u = usage(10, 10, None, None, None);
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            let s = SourceConfig {
                input_price: Some(bad),
                output_price: Some(1.0),
                ..src()
            };
            assert_eq!(cost(measured(&u), &s), None, "{bad}");
            let s = src().with_prices(1.0, 1.0).with_cached_input_price(bad);
            assert_eq!(TokenPrices::of(&s).cached_input, Some(1.0), "{bad}");
        }
    }

    #[test]
    fn what_caching_saved() {
        let p = TokenPrices::of(
            &src()
                .with_prices(3.0, 15.0)
                .with_cached_input_price(0.3)
                .with_cache_write_price(3.75),
        );
        let t = BilledTokens::of(&usage(1000, 5, Some(600), Some(300), None));
        // 600·2.7 − 300·0.75 = 1620 − 225 = 1395.
        let s = cache_saving(&t, &p).unwrap();
        assert!((s - 1395.0 / 1e6).abs() < 1e-15, "{s}");
        assert_eq!(
            cache_saving(&BilledTokens::default(), &TokenPrices::default()),
            Some(0.0)
        );
        assert_eq!(cache_saving(&t, &TokenPrices::default()), None);
    }

    #[test]
    fn billed_is_every_sent_request_not_answered_with_an_error() {
        use ErrorLabel::*;
        assert!(may_be_billed(HedgeCancelled, None));
        assert!(may_be_billed(Truncated, Some(200)));
        assert!(may_be_billed(Timeout, None));
        assert!(!may_be_billed(Timeout, Some(408)));
        assert!(!may_be_billed(RateLimited, Some(429)));
        assert!(!may_be_billed(ServerError, Some(503)));
        assert!(!may_be_billed(Connect, None));
    }

    #[test]
    fn a_gap_row_costs_what_was_received_up_to_its_allowance() {
        let p = TokenPrices::of(&src().with_prices(2.0, 8.0).with_cached_input_price(0.5));
        let r = gap_cost_range(1000, 10, 100, &p).unwrap();
        assert_eq!(r.low, 80.0 / 1e6);
        assert_eq!(r.high, Some((1000.0 * 2.0 + 110.0 * 8.0) / 1e6));
        assert!(r.contains(1000.0 * 0.5 / 1e6 + 80.0 / 1e6));
        assert_eq!(gap_cost_range(1000, 10, 0, &p).unwrap().high, None);
        // No output price: what was received cannot be priced.
        let no_out = TokenPrices { output: None, ..p };
        assert_eq!(gap_cost_range(1000, 10, 100, &no_out), None);
        assert_eq!(gap_cost_range(0, 0, 0, &no_out), Some(CostRange::default()));
    }

    #[test]
    fn accounts_split_rows_into_reported_gap_and_not_billed() {
        let p = TokenPrices::of(&src().with_prices(2.0, 8.0));
        let row = |id: &str| TelemetryRow::new(RowKind::Attempt, id, "l", "S", "chat", 0);
        let mut measured = row("m").with_usage(&Usage::new(100, 10), UsageSource::Measured);
        measured.cost = Some(280.0 / 1e6);
        let est = LegEstimate {
            prompt_tokens: 100,
            received_tokens: 5,
        };
        let loser = row("h").with_estimate(&est);
        let mut cut = row("c")
            .with_usage(&Usage::new(100, 5), UsageSource::Estimated)
            .with_estimate(&est);
        cut.cost = Some(240.0 / 1e6);
        let rejected = row("r");
        let mut a = Accounts::new();
        for r in [&measured, &loser, &cut, &rejected] {
            a.add(r, Some(&p), 50);
        }
        a.add(
            &TelemetryRow::new(RowKind::TerminalFailure, "t", "l", "S", "chat", 0),
            Some(&p),
            50,
        );
        assert_eq!(
            (
                a.attempts,
                a.reported_rows,
                a.gap_rows,
                a.gap_unavailable,
                a.not_billed_rows
            ),
            (4, 1, 2, 1, 1)
        );
        assert_eq!((a.est_prompt_tokens, a.est_received_tokens), (200, 10));
        let g = a.gap.unwrap();
        assert_eq!(g.low, 2.0 * 40.0 / 1e6);
        let inv = a.invoice_range().unwrap();
        assert_eq!(inv.low, 280.0 / 1e6 + 80.0 / 1e6);
        // The cut row's estimated cost lies inside its own range.
        let one = gap_cost_range(100, 5, 50, &p).unwrap();
        assert!(one.contains(cut.cost.unwrap()));
        // A gap row without prices makes the range unknown.
        a.add(&loser, None, 50);
        assert_eq!(a.invoice_range(), None);
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

    fn arb_price() -> impl Strategy<Value = Option<f64>> {
        proptest::option::of(prop_oneof![Just(0.0), 0.0f64..100.0])
    }

    fn arb_usage() -> impl Strategy<Value = Usage> {
        (
            0u64..2_000_000,
            0u64..2_000_000,
            proptest::option::of(0u64..2_000_000),
            proptest::option::of(0u64..2_000_000),
            proptest::option::of(0u64..2_000_000),
        )
            .prop_map(|(p, c, cached, write, r)| usage(p, c, cached, write, r))
    }

    fn arb_source() -> impl Strategy<Value = SourceConfig> {
        (arb_price(), arb_price(), arb_price(), arb_price()).prop_map(|(i, o, c, w)| SourceConfig {
            input_price: i,
            output_price: o,
            cached_input_price: c,
            cache_write_price: w,
            ..src()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        /// SPEC §8 / §20.1: the cost of a measured or estimated usage is the hand
        /// computation — prompt split into uncached (prompt − cached − write, or the
        /// prompt itself when the cache figures exceed it), cached and written tokens,
        /// each at its price (cache prices defaulting to INPUT_PRICE), and the
        /// completion (plus reasoning reported outside it) at OUTPUT_PRICE, / 1e6; it is
        /// never negative; and it is NULL exactly when no token price is configured or
        /// a price needed for a non-zero count is missing.
        #[test]
        fn the_cost_is_the_hand_computation(u in arb_usage(), s in arb_source()) {
            let cached = u.cached_prompt_tokens.unwrap_or(0);
            let write = u.cache_write_tokens.unwrap_or(0);
            let uncached = if cached + write > u.prompt_tokens {
                u.prompt_tokens
            } else {
                u.prompt_tokens - cached - write
            };
            let reasoning = u.reasoning_tokens.unwrap_or(0);
            let output = if reasoning > u.completion_tokens {
                u.completion_tokens + reasoning
            } else {
                u.completion_tokens
            };
            let prices = [
                (uncached, s.input_price),
                (cached, s.cached_input_price.or(s.input_price)),
                (write, s.cache_write_price.or(s.input_price)),
                (output, s.output_price),
            ];
            let any_price = [s.input_price, s.output_price, s.cached_input_price, s.cache_write_price]
                .iter()
                .any(Option::is_some);
            let missing = prices.iter().any(|(n, p)| *n > 0 && p.is_none());
            for source in [UsageSource::Measured, UsageSource::Estimated] {
                let got = cost(CostBasis::Tokens { usage: &u, source }, &s);
                if !any_price || missing {
                    prop_assert_eq!(got, None);
                } else {
                    let want = prices
                        .iter()
                        .map(|(n, p)| *n as f64 * p.unwrap_or(0.0))
                        .sum::<f64>()
                        / 1e6;
                    let got = got.expect("every needed price is there");
                    prop_assert!(got >= 0.0, "negative: {}", got);
                    prop_assert!((got - want).abs() <= want.abs() * 1e-12 + 1e-18, "{} != {}", got, want);
                }
            }
            prop_assert_eq!(
                cost(CostBasis::Tokens { usage: &u, source: UsageSource::Unavailable }, &s),
                None
            );
            // The billed parts never count a token twice and never lose one.
            let t = BilledTokens::of(&u);
            let whole = if cached + write > u.prompt_tokens {
                u.prompt_tokens + cached + write
            } else {
                u.prompt_tokens
            };
            prop_assert_eq!(t.prompt(), whole);
            prop_assert_eq!((t.cached_prompt, t.cache_write, t.output), (cached, write, output));
        }

        /// A gap row's range is ordered, never negative, and contains every cost the
        /// provider can have billed for a prompt of at most `prompt` tokens (any split
        /// between plain, cached and written) and between `received` and
        /// `received + allowance` output tokens.
        #[test]
        fn a_gap_range_holds_every_possible_bill(
            prompt in 0u64..100_000,
            received in 0u64..10_000,
            allowance in 0u64..10_000,
            extra in 0u64..10_000,
            split in (0.0f64..=1.0, 0.0f64..=1.0),
            s in arb_source(),
        ) {
            let p = TokenPrices::of(&s);
            let Some(r) = gap_cost_range(prompt, received, allowance, &p) else {
                let needs_out = received > 0 || (allowance > 0 && p.output.is_none());
                prop_assert!(needs_out || p.max_prompt().is_none());
                return Ok(());
            };
            prop_assert!(r.low >= 0.0);
            if let Some(h) = r.high {
                prop_assert!(h >= r.low);
                let generated = received + extra.min(allowance);
                let cached = (prompt as f64 * split.0) as u64;
                let write = ((prompt - cached) as f64 * split.1) as u64;
                let bill = usage(prompt, generated, Some(cached), Some(write), None);
                if let Some(c) = token_cost(&BilledTokens::of(&bill), &p) {
                    prop_assert!(r.contains(c) || (c - h).abs() <= h * 1e-12, "{} not in {:?}", c, r);
                }
            }
        }
    }
}
