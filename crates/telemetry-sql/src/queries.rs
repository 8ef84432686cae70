//! Example queries over `llm_calls` that run unchanged on SQLite and PostgreSQL
//! (docs/TELEMETRY.md quotes them verbatim; a test runs each on both databases).
//!
//! Portability notes: booleans are compared as truth values (`AND ok`, `NOT cache_hit`),
//! which works on PostgreSQL's BOOLEAN and SQLite's INTEGER 0/1; ratios cast to
//! `DOUBLE PRECISION` (a REAL in SQLite) so neither database divides integers, and sums
//! of integer columns cast to `BIGINT` (PostgreSQL's `SUM(BIGINT)` is a NUMERIC); the p99 is
//! the nearest-rank percentile computed with window functions (SQLite ≥ 3.25 and every
//! supported PostgreSQL have them).

/// Cost per source: attempts, summed cost, and how many attempts have a known cost.
/// `SUM` skips NULLs, so `unknown_cost_attempts` says how much of the bill is missing.
pub const COST_PER_SOURCE: &str = "\
SELECT source,
       COUNT(*) AS attempts,
       SUM(cost) AS cost,
       COUNT(cost) AS priced_attempts,
       COUNT(*) - COUNT(cost) AS unknown_cost_attempts
FROM llm_calls
WHERE kind = 'attempt'
GROUP BY source
ORDER BY source";

/// p99 latency of successful attempts per source (nearest rank: the smallest latency
/// with at least 99 % of the source's attempts at or below it).
pub const P99_LATENCY_PER_SOURCE: &str = "\
WITH ranked AS (
    SELECT source,
           latency_ms,
           ROW_NUMBER() OVER (PARTITION BY source ORDER BY latency_ms) AS rn,
           COUNT(*) OVER (PARTITION BY source) AS n
    FROM llm_calls
    WHERE kind = 'attempt' AND ok AND latency_ms IS NOT NULL
)
SELECT source, MIN(latency_ms) AS p99_latency_ms, MAX(n) AS attempts
FROM ranked
WHERE rn * 100 >= n * 99
GROUP BY source
ORDER BY source";

/// Stall share per source: time spent in stalls over the wall time of successful
/// streamed attempts (a NULL `stall_ms` — fewer than two incremental chunks — counts
/// as no stall).
pub const STALL_SHARE_PER_SOURCE: &str = "\
SELECT source,
       CAST(SUM(COALESCE(stall_ms, 0)) AS DOUBLE PRECISION)
           / CAST(NULLIF(SUM(latency_ms), 0) AS DOUBLE PRECISION) AS stall_share
FROM llm_calls
WHERE kind = 'attempt' AND ok AND stream AND latency_ms IS NOT NULL
GROUP BY source
ORDER BY source";

/// Hedge win rate: among logical calls that launched a hedge leg, the share whose
/// winning (ok) attempt was a hedge leg.
pub const HEDGE_WIN_RATE: &str = "\
WITH hedged AS (
    SELECT logical_call_id,
           MAX(CASE WHEN ok AND is_hedge THEN 1 ELSE 0 END) AS hedge_won
    FROM llm_calls
    WHERE kind = 'attempt'
    GROUP BY logical_call_id
    HAVING MAX(CASE WHEN is_hedge THEN 1 ELSE 0 END) = 1
)
SELECT COUNT(*) AS hedged_calls,
       COALESCE(SUM(hedge_won), 0) AS hedge_wins,
       CAST(SUM(hedge_won) AS DOUBLE PRECISION)
           / CAST(NULLIF(COUNT(*), 0) AS DOUBLE PRECISION) AS hedge_win_rate
FROM hedged";

/// Failed attempts per source and error label.
pub const ERRORS_PER_SOURCE: &str = "\
SELECT source, error, COUNT(*) AS attempts
FROM llm_calls
WHERE kind = 'attempt' AND NOT ok
GROUP BY source, error
ORDER BY source, error";

/// The accounting gap (SPEC §8): attempts whose usage, and so cost, is unknown; cache
/// hits excluded. The same text as [`polygw_core::telemetry::ACCOUNTING_GAP_SQL`].
pub const ACCOUNTING_GAP: &str = polygw_core::telemetry::ACCOUNTING_GAP_SQL;

/// Prompt-cache hit share per source (SPEC §20.1): the share of prompt tokens read from
/// the provider's cache, over attempts whose usage is known (`cached_prompt_tokens` is
/// part of `prompt_tokens`; a source that does not report caching counts as 0 cached).
pub const CACHE_HIT_SHARE_PER_SOURCE: &str = "\
SELECT source,
       CAST(SUM(prompt_tokens) AS BIGINT) AS prompt_tokens,
       CAST(SUM(COALESCE(cached_prompt_tokens, 0)) AS BIGINT) AS cached_prompt_tokens,
       CAST(SUM(COALESCE(cache_write_tokens, 0)) AS BIGINT) AS cache_write_tokens,
       CAST(SUM(COALESCE(cached_prompt_tokens, 0)) AS DOUBLE PRECISION)
           / CAST(NULLIF(SUM(prompt_tokens), 0) AS DOUBLE PRECISION) AS cache_hit_share
FROM llm_calls
WHERE kind = 'attempt' AND prompt_tokens IS NOT NULL
GROUP BY source
ORDER BY source";

/// What prompt caching saved per source (SPEC §20.1): cached tokens × (`INPUT_PRICE` −
/// `CACHED_INPUT_PRICE`) plus written tokens × (`INPUT_PRICE` − `CACHE_WRITE_PRICE`)
/// (negative where writes cost more), / 1e6. Prices are configuration, not columns: put
/// each source's in the `prices` list (the values here are examples; an unset cache price
/// is `INPUT_PRICE`).
pub const CACHE_SAVING_PER_SOURCE: &str = "\
WITH prices (source, input_price, cached_input_price, cache_write_price) AS (
    VALUES ('deepseek-0', 0.27, 0.07, 0.27), ('qwen-0', 0.8, 0.2, 0.8)
)
SELECT c.source,
       CAST(SUM(COALESCE(c.cached_prompt_tokens, 0)) AS BIGINT) AS cached_prompt_tokens,
       CAST(SUM(COALESCE(c.cache_write_tokens, 0)) AS BIGINT) AS cache_write_tokens,
       (CAST(SUM(COALESCE(c.cached_prompt_tokens, 0)) AS DOUBLE PRECISION)
           * CAST(p.input_price - p.cached_input_price AS DOUBLE PRECISION)
        + CAST(SUM(COALESCE(c.cache_write_tokens, 0)) AS DOUBLE PRECISION)
           * CAST(p.input_price - p.cache_write_price AS DOUBLE PRECISION)) / 1e6 AS saving
FROM llm_calls c JOIN prices p ON p.source = c.source
WHERE c.kind = 'attempt' AND c.prompt_tokens IS NOT NULL
GROUP BY c.source, p.input_price, p.cached_input_price, p.cache_write_price
ORDER BY c.source";

/// The accounting gap in tokens (SPEC §20.4): per source, the attempts whose usage is
/// unavailable and the gateway's estimates for them — the prompt sent and what was
/// received before the end. `estimated_attempts` counts those that carry an estimate.
pub const ACCOUNTING_GAP_TOKENS_PER_SOURCE: &str = "\
SELECT source,
       COUNT(*) AS unavailable_attempts,
       COUNT(est_prompt_tokens) AS estimated_attempts,
       CAST(SUM(COALESCE(est_prompt_tokens, 0)) AS BIGINT) AS est_prompt_tokens,
       CAST(SUM(COALESCE(est_received_tokens, 0)) AS BIGINT) AS est_received_tokens
FROM llm_calls
WHERE usage_source = 'unavailable' AND NOT cache_hit AND kind = 'attempt'
GROUP BY source
ORDER BY source";

/// Every example query, by name.
pub const ALL: [(&str, &str); 9] = [
    ("cost per source", COST_PER_SOURCE),
    ("p99 latency per source", P99_LATENCY_PER_SOURCE),
    ("stall share per source", STALL_SHARE_PER_SOURCE),
    ("hedge win rate", HEDGE_WIN_RATE),
    ("errors per source", ERRORS_PER_SOURCE),
    ("accounting gap", ACCOUNTING_GAP),
    ("cache hit share per source", CACHE_HIT_SHARE_PER_SOURCE),
    ("cache saving per source", CACHE_SAVING_PER_SOURCE),
    (
        "accounting gap in tokens per source",
        ACCOUNTING_GAP_TOKENS_PER_SOURCE,
    ),
];
