//! Aggregation for `polygw report`: pure functions over telemetry rows (no database), so
//! every figure the report shows is unit-tested on hand-made rows. Definitions:
//! docs/REPORT.md.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use polygw::core::telemetry::{cache_saving, Accounts, BilledTokens, TokenPrices};
use polygw::core::trace::CallTrace;
use polygw::core::{RowKind, TelemetryRow, Usage, UsageSource};

use super::timeline::{CallTimeline, MAX_TIMELINE_CALLS};
use crate::table::quantile;

/// Shown for an attempt row without a source (should not happen; kept visible).
pub const NO_SOURCE: &str = "(no source)";
/// Shown for a failed row without an error label.
pub const NO_LABEL: &str = "(no label)";
/// The "source" of a terminal-failure row in the error-detail list.
pub const CALL_LEVEL: &str = "(call)";
/// How many distinct error details the summary keeps.
pub const MAX_DETAILS: usize = 20;

/// Nearest-rank percentiles of a set of millisecond values.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Percentiles {
    /// Median.
    pub p50: Option<f64>,
    /// 95th percentile.
    pub p95: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
    /// Number of values.
    pub n: usize,
}

impl Percentiles {
    /// The percentiles of `values` (all `None` when empty).
    pub fn of(values: &[f64]) -> Self {
        Percentiles {
            p50: quantile(values, 0.50),
            p95: quantile(values, 0.95),
            p99: quantile(values, 0.99),
            n: values.len(),
        }
    }
}

/// Known cost next to the number of rows whose cost is unknown (NULL): unknown is never
/// added as 0.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CostTally {
    /// Sum of the known costs.
    pub known: f64,
    /// Rows with a known cost (0.0 included: free).
    pub known_rows: u64,
    /// Rows with an unknown cost (NULL).
    pub unknown_rows: u64,
}

impl CostTally {
    fn add(&mut self, cost: Option<f64>) {
        match cost {
            Some(c) => {
                self.known += c;
                self.known_rows += 1;
            }
            None => self.unknown_rows += 1,
        }
    }

    /// The known spend, `None` when no row had a known cost.
    pub fn known_sum(&self) -> Option<f64> {
        (self.known_rows > 0).then_some(self.known)
    }
}

/// Token sums over rows whose usage is known (`usage_source` not `unavailable`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenTally {
    /// Rows with known usage.
    pub rows: u64,
    /// Σ prompt_tokens.
    pub prompt: u64,
    /// Σ completion_tokens.
    pub completion: u64,
    /// Σ reasoning_tokens (where reported).
    pub reasoning: u64,
}

impl TokenTally {
    fn add(&mut self, r: &TelemetryRow) {
        if r.usage_source == UsageSource::Unavailable {
            return;
        }
        self.rows += 1;
        self.prompt += r.prompt_tokens.unwrap_or(0);
        self.completion += r.completion_tokens.unwrap_or(0);
        self.reasoning += r.reasoning_tokens.unwrap_or(0);
    }
}

/// A source's prices as the report knows them: from the configuration in the
/// environment (telemetry rows hold costs, not prices).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SourcePrices {
    /// Its token prices.
    pub prices: TokenPrices,
    /// The most a leg could have generated unseen: the source's `EST_TOKENS` (as
    /// admission derives it; 0 = no upper bound).
    pub allowance: u64,
}

/// Prices per (scope, source).
pub type PriceBook = BTreeMap<(String, String), SourcePrices>;

/// Prompt-cache figures of a source (SPEC §20.1), over attempt rows with known usage.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheTally {
    /// Σ prompt_tokens.
    pub prompt: u64,
    /// Σ cached_prompt_tokens (a row that does not report it counts 0).
    pub cached: u64,
    /// Σ cache_write_tokens.
    pub written: u64,
    /// Rows that report a cache figure.
    pub reporting_rows: u64,
    /// What caching saved at the source's prices; `None` without prices.
    pub saving: Option<f64>,
}

impl CacheTally {
    fn add(&mut self, r: &TelemetryRow, prices: Option<&TokenPrices>) {
        if r.usage_source == UsageSource::Unavailable {
            return;
        }
        self.prompt += r.prompt_tokens.unwrap_or(0);
        self.cached += r.cached_prompt_tokens.unwrap_or(0);
        self.written += r.cache_write_tokens.unwrap_or(0);
        self.reporting_rows +=
            u64::from(r.cached_prompt_tokens.is_some() || r.cache_write_tokens.is_some());
        let usage = Usage {
            reasoning_tokens: r.reasoning_tokens,
            cached_prompt_tokens: r.cached_prompt_tokens,
            cache_write_tokens: r.cache_write_tokens,
            cache_write_1h_tokens: None,
            ..Usage::new(
                r.prompt_tokens.unwrap_or(0),
                r.completion_tokens.unwrap_or(0),
            )
        };
        let saved = prices.and_then(|p| cache_saving(&BilledTokens::of(&usage), p));
        self.saving = match (self.saving, saved) {
            (Some(a), Some(b)) => Some(a + b),
            _ => None,
        };
    }

    /// cached / prompt.
    pub fn hit_share(&self) -> Option<f64> {
        ratio(self.cached, self.prompt)
    }
}

/// Figures of one source within one scope, over its `attempt` rows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SourceStats {
    /// Scope name.
    pub scope: String,
    /// Source name.
    pub source: String,
    /// Attempt rows.
    pub attempts: u64,
    /// Successful attempts.
    pub ok: u64,
    /// Failed attempts by error label.
    pub errors: BTreeMap<String, u64>,
    /// latency_ms of successful attempts.
    pub latency: Percentiles,
    /// ttft_ms of successful streamed attempts.
    pub ttft: Percentiles,
    /// Σ stall_ms over successful streamed attempts with a latency.
    pub stall_ms: u64,
    /// Σ latency_ms over the same attempts.
    pub streamed_ms: u64,
    /// Successful streamed attempts with at least one stall.
    pub stalled_attempts: u64,
    /// Successful streamed attempts.
    pub streamed_ok: u64,
    /// Extra hedge legs launched on this source (`is_hedge` attempts).
    pub hedge_legs: u64,
    /// Extra hedge legs on this source that won (`ok` and `is_hedge`).
    pub hedge_wins: u64,
    /// Tokens of attempts with known usage.
    pub tokens: TokenTally,
    /// Cost of the attempts.
    pub cost: CostTally,
    /// Attempts with usage unavailable (the SPEC §8 accounting gap).
    pub gap: u64,
    /// Prompt-cache figures.
    pub cache: CacheTally,
    /// Its books against the provider's invoice (SPEC §20.4).
    pub accounts: Accounts,
    /// Its prices were known (from the configuration in the environment).
    pub priced: bool,
}

impl SourceStats {
    /// Failed attempts.
    pub fn failed(&self) -> u64 {
        self.attempts - self.ok
    }

    /// Σ stall_ms / Σ latency_ms over successful streamed attempts.
    pub fn stall_share(&self) -> Option<f64> {
        (self.streamed_ms > 0).then(|| self.stall_ms as f64 / self.streamed_ms as f64)
    }
}

/// Figures of one scope, per logical call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ScopeStats {
    /// Scope name.
    pub scope: String,
    /// Operations seen (`chat`, `embedding`, `ocr`).
    pub operations: BTreeSet<String>,
    /// Distinct logical calls.
    pub logical_calls: u64,
    /// Calls with an `ok` row (attempt or cache hit) and no terminal row.
    pub succeeded: u64,
    /// Calls with a `terminal_failure` row.
    pub failed: u64,
    /// Calls with neither (cancelled by the caller, or cut by the time window).
    pub no_outcome: u64,
    /// Failed calls by terminal reason.
    pub terminal_reasons: BTreeMap<String, u64>,
    /// latency_ms of the terminal rows, by terminal reason.
    pub terminal_latency: BTreeMap<String, Percentiles>,
    /// `cache_hit` rows.
    pub cache_hits: u64,
    /// Attempt rows.
    pub attempts: u64,
    /// Extra hedge legs (`is_hedge` attempts).
    pub hedge_legs: u64,
    /// Logical calls with at least one attempt row.
    pub calls_with_attempts: u64,
    /// Logical calls with at least one hedge leg.
    pub hedged_calls: u64,
    /// Hedged calls whose winning `ok` attempt is a hedge leg.
    pub hedge_won_calls: u64,
    /// Call latency of successful calls that reached a source (see docs/REPORT.md).
    pub call_latency: Percentiles,
    /// Tokens of every row with known usage (cache hits count 0).
    pub tokens: TokenTally,
    /// Cost of attempts and cache hits (terminal rows are not spend).
    pub cost: CostTally,
    /// Attempts with usage unavailable.
    pub gap: u64,
}

impl ScopeStats {
    /// Hedged calls / calls with attempts.
    pub fn hedge_rate(&self) -> Option<f64> {
        ratio(self.hedged_calls, self.calls_with_attempts)
    }

    /// Hedged calls won by an extra leg / hedged calls.
    pub fn hedge_win_rate(&self) -> Option<f64> {
        ratio(self.hedge_won_calls, self.hedged_calls)
    }

    /// Extra legs / attempts that are not extra legs (the extra requests hedging cost).
    pub fn extra_requests(&self) -> Option<f64> {
        ratio(self.hedge_legs, self.attempts - self.hedge_legs)
    }
}

/// One distinct error detail and how often it occurred.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorDetail {
    /// Scope name.
    pub scope: String,
    /// Source name, or [`CALL_LEVEL`] for terminal rows.
    pub source: String,
    /// Error label or terminal reason.
    pub label: String,
    /// The `error_detail` text.
    pub detail: String,
    /// Rows with it.
    pub count: u64,
}

/// Spend of one client key (SPEC §21.1): the rows charged to it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyStats {
    /// `client_key_id`; `None`: the rows charged to no key.
    pub id: Option<String>,
    /// Its name as the report shows it (from `polygw_client_keys`: see
    /// `report::name_keys`); empty until named.
    pub name: String,
    /// Distinct logical calls.
    pub calls: u64,
    /// Calls with a `terminal_failure` row.
    pub failed_calls: u64,
    /// Tokens of the attempts and cache hits with known usage.
    pub tokens: TokenTally,
    /// Cost of the attempts and cache hits (terminal rows are not spend).
    pub cost: CostTally,
}

/// Spend of one sub-agent (SPEC §24.6).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentStats {
    /// Its spend (`id`: the agent's id).
    pub spend: KeyStats,
    /// The agent that started it, as its rows name it.
    pub parent: Option<String>,
    /// Its session, as its rows name it.
    pub session: Option<String>,
}

/// One of the slowest traced calls (SPEC §19.4).
#[derive(Debug, Clone, PartialEq)]
pub struct SlowCall {
    /// `logical_call_id`.
    pub logical_call_id: String,
    /// Scope.
    pub scope: String,
    /// The call's length in its trace (its last event, or a leg's end), ms.
    pub duration_ms: u64,
    /// Rounds.
    pub rounds: usize,
    /// Legs launched.
    pub legs: usize,
    /// Extra legs launched as hedges.
    pub hedges: usize,
    /// Resume legs.
    pub resumes: usize,
    /// Its outcome in words.
    pub outcome: String,
}

/// Everything the report shows, from a slice of rows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// Rows summarized.
    pub rows: u64,
    /// Rows by kind: attempt, cache_hit, terminal_failure.
    pub kinds: [u64; 3],
    /// Oldest `created_at` (ms since the epoch).
    pub first_ms: Option<i64>,
    /// Newest `created_at`.
    pub last_ms: Option<i64>,
    /// Per (scope, source), ordered by scope then source.
    pub sources: Vec<SourceStats>,
    /// Per scope, ordered by name.
    pub scopes: Vec<ScopeStats>,
    /// The most frequent error details (at most [`MAX_DETAILS`]).
    pub details: Vec<ErrorDetail>,
    /// Distinct error details seen (before the cut).
    pub distinct_details: usize,
    /// Attempts with usage unavailable among the rows (the SPEC §8 count on these rows).
    pub gap: u64,
    /// Spend per client key: keyed rows by known cost (highest first), then the rows of
    /// no key; empty when no row names a key.
    pub keys: Vec<KeyStats>,
    /// Whether the database has the `polygw_client_keys` table (`None`: not asked).
    pub key_table: Option<bool>,
    /// Spend per agent session (SPEC §24.6), as [`Summary::keys`] is per key: the
    /// [`MAX_SESSIONS`] dearest sessions (the rows of none last); empty when no row names
    /// a session.
    pub sessions: Vec<KeyStats>,
    /// Spend per sub-agent (SPEC §24.6); empty when no row names an agent.
    pub agents: Vec<AgentStats>,
    /// Logical calls among the rows.
    pub calls: u64,
    /// Calls whose last row carries a readable trace.
    pub traced_calls: u64,
    /// Rows whose trace could not be read.
    pub unreadable_traces: u64,
    /// The slowest traced calls, slowest first (at most
    /// [`super::timeline::MAX_TIMELINE_CALLS`]).
    pub slowest: Vec<SlowCall>,
}

fn ratio(num: u64, den: u64) -> Option<f64> {
    (den > 0).then(|| num as f64 / den as f64)
}

/// Whether a row counts in the SPEC §8 accounting gap.
pub fn in_gap(r: &TelemetryRow) -> bool {
    r.kind == RowKind::Attempt && r.usage_source == UsageSource::Unavailable && !r.cache_hit
}

fn kind_index(k: RowKind) -> usize {
    match k {
        RowKind::Attempt => 0,
        RowKind::CacheHit => 1,
        RowKind::TerminalFailure => 2,
    }
}

/// Values collected per source before the percentiles are taken.
#[derive(Default)]
struct SourceAcc {
    stats: SourceStats,
    latencies: Vec<f64>,
    ttfts: Vec<f64>,
}

/// Per logical call, while scanning.
#[derive(Default)]
struct CallAcc {
    attempts: u64,
    hedged: bool,
    hedge_won: bool,
    ok: bool,
    terminal: bool,
    start_ms: Option<i64>,
    end_ms: Option<i64>,
}

#[derive(Default)]
struct ScopeAcc {
    stats: ScopeStats,
    calls: HashMap<String, CallAcc>,
    terminal_latencies: BTreeMap<String, Vec<f64>>,
}

/// Summarizes rows (any order), without prices.
#[cfg(test)]
pub fn summarize(rows: &[TelemetryRow]) -> Summary {
    summarize_priced(rows, &PriceBook::new())
}

/// Summarizes rows (any order); money figures that need prices (what caching saved,
/// the accounting gap's cost range) use `book`.
pub fn summarize_priced(rows: &[TelemetryRow], book: &PriceBook) -> Summary {
    let mut sum = Summary::default();
    let mut sources: BTreeMap<(String, String), SourceAcc> = BTreeMap::new();
    let mut scopes: BTreeMap<String, ScopeAcc> = BTreeMap::new();
    let mut details: HashMap<(String, String, String, String), u64> = HashMap::new();

    for r in rows {
        sum.rows += 1;
        sum.kinds[kind_index(r.kind)] += 1;
        sum.first_ms = Some(
            sum.first_ms
                .map_or(r.created_at_ms, |m| m.min(r.created_at_ms)),
        );
        sum.last_ms = Some(
            sum.last_ms
                .map_or(r.created_at_ms, |m| m.max(r.created_at_ms)),
        );
        let gap = in_gap(r);
        sum.gap += u64::from(gap);

        let sc = scopes.entry(r.scope.to_string()).or_default();
        sc.stats.operations.insert(r.operation.to_string());
        sc.stats.gap += u64::from(gap);
        sc.stats.tokens.add(r);
        let call = sc.calls.entry(r.logical_call_id.clone()).or_default();
        if let Some(lat) = r.latency_ms {
            let lat = i64::try_from(lat).unwrap_or(i64::MAX);
            let start = r.created_at_ms.saturating_sub(lat);
            call.start_ms = Some(call.start_ms.map_or(start, |s| s.min(start)));
            call.end_ms = Some(
                call.end_ms
                    .map_or(r.created_at_ms, |e| e.max(r.created_at_ms)),
            );
        }

        let label = || r.error.clone().unwrap_or_else(|| NO_LABEL.to_string());
        match r.kind {
            RowKind::Attempt => {
                sc.stats.attempts += 1;
                sc.stats.hedge_legs += u64::from(r.is_hedge);
                sc.stats.cost.add(r.cost);
                call.attempts += 1;
                call.hedged |= r.is_hedge;
                call.hedge_won |= r.ok && r.is_hedge;
                call.ok |= r.ok;

                let source = r.source.as_deref().unwrap_or(NO_SOURCE).to_string();
                let acc = sources
                    .entry((r.scope.to_string(), source.clone()))
                    .or_insert_with(|| {
                        let priced = book.contains_key(&(r.scope.to_string(), source.clone()));
                        SourceAcc {
                            stats: SourceStats {
                                scope: r.scope.to_string(),
                                source: source.clone(),
                                cache: CacheTally {
                                    saving: priced.then_some(0.0),
                                    ..CacheTally::default()
                                },
                                accounts: Accounts::new(),
                                priced,
                                ..SourceStats::default()
                            },
                            ..SourceAcc::default()
                        }
                    });
                let prices = book.get(&(r.scope.to_string(), source.clone()));
                let s = &mut acc.stats;
                s.cache.add(r, prices.map(|p| &p.prices));
                s.accounts.add(
                    r,
                    prices.map(|p| &p.prices),
                    prices.map_or(0, |p| p.allowance),
                );
                s.attempts += 1;
                s.gap += u64::from(gap);
                s.tokens.add(r);
                s.cost.add(r.cost);
                s.hedge_legs += u64::from(r.is_hedge);
                if r.ok {
                    s.ok += 1;
                    s.hedge_wins += u64::from(r.is_hedge);
                    if let Some(l) = r.latency_ms {
                        acc.latencies.push(l as f64);
                    }
                    if r.stream {
                        s.streamed_ok += 1;
                        if let Some(t) = r.ttft_ms {
                            acc.ttfts.push(t as f64);
                        }
                        if let Some(l) = r.latency_ms {
                            s.streamed_ms += l;
                            s.stall_ms += r.stall_ms.unwrap_or(0);
                        }
                        s.stalled_attempts += u64::from(r.stall_count.unwrap_or(0) > 0);
                    }
                } else {
                    *s.errors.entry(label()).or_default() += 1;
                    if let Some(d) = &r.error_detail {
                        *details
                            .entry((r.scope.to_string(), source, label(), d.clone()))
                            .or_default() += 1;
                    }
                }
            }
            RowKind::CacheHit => {
                sc.stats.cache_hits += 1;
                sc.stats.cost.add(r.cost);
                call.ok |= r.ok;
            }
            RowKind::TerminalFailure => {
                call.terminal = true;
                let reason = label();
                *sc.stats.terminal_reasons.entry(reason.clone()).or_default() += 1;
                if let Some(l) = r.latency_ms {
                    sc.terminal_latencies
                        .entry(reason.clone())
                        .or_default()
                        .push(l as f64);
                }
                if let Some(d) = &r.error_detail {
                    *details
                        .entry((
                            r.scope.to_string(),
                            CALL_LEVEL.to_string(),
                            reason,
                            d.clone(),
                        ))
                        .or_default() += 1;
                }
            }
        }
    }

    sum.sources = sources
        .into_values()
        .map(|acc| {
            let mut s = acc.stats;
            s.latency = Percentiles::of(&acc.latencies);
            s.ttft = Percentiles::of(&acc.ttfts);
            s
        })
        .collect();

    sum.scopes = scopes
        .into_iter()
        .map(|(name, acc)| {
            let mut s = acc.stats;
            s.scope = name;
            let mut call_lat = Vec::new();
            for c in acc.calls.values() {
                s.logical_calls += 1;
                if c.terminal {
                    s.failed += 1;
                } else if c.ok {
                    s.succeeded += 1;
                    if c.attempts > 0 {
                        if let (Some(a), Some(b)) = (c.start_ms, c.end_ms) {
                            call_lat.push((b - a).max(0) as f64);
                        }
                    }
                } else {
                    s.no_outcome += 1;
                }
                if c.attempts > 0 {
                    s.calls_with_attempts += 1;
                    if c.hedged {
                        s.hedged_calls += 1;
                        s.hedge_won_calls += u64::from(c.hedge_won);
                    }
                }
            }
            s.call_latency = Percentiles::of(&call_lat);
            s.terminal_latency = acc
                .terminal_latencies
                .iter()
                .map(|(k, v)| (k.clone(), Percentiles::of(v)))
                .collect();
            s
        })
        .collect();

    sum.keys = key_stats(rows);
    sum.sessions = spend_by(rows, |r| r.agent_session_id.as_deref());
    sum.sessions.truncate(MAX_SESSIONS);
    sum.agents = agent_stats(rows);
    let (calls, traced, unreadable, slowest) = slowest_calls(rows, MAX_TIMELINE_CALLS);
    sum.calls = calls;
    sum.traced_calls = traced;
    sum.unreadable_traces = unreadable;
    sum.slowest = slowest;

    sum.distinct_details = details.len();
    let mut details: Vec<ErrorDetail> = details
        .into_iter()
        .map(|((scope, source, label, detail), count)| ErrorDetail {
            scope,
            source,
            label,
            detail,
            count,
        })
        .collect();
    details.sort_by(|a, b| {
        b.count
            .cmp(&a.count)
            .then_with(|| a.scope.cmp(&b.scope))
            .then_with(|| a.source.cmp(&b.source))
            .then_with(|| a.label.cmp(&b.label))
            .then_with(|| a.detail.cmp(&b.detail))
    });
    details.truncate(MAX_DETAILS);
    sum.details = details;
    sum
}

/// The most agent sessions the report lists (the dearest).
pub const MAX_SESSIONS: usize = 20;

/// Spend per client key (see [`Summary::keys`]).
fn key_stats(rows: &[TelemetryRow]) -> Vec<KeyStats> {
    spend_by(rows, |r| r.client_key_id.as_deref())
}

/// Spend per sub-agent (see [`Summary::agents`]), with its parent and session.
fn agent_stats(rows: &[TelemetryRow]) -> Vec<AgentStats> {
    let mut whose: HashMap<&str, (Option<&str>, Option<&str>)> = HashMap::new();
    for r in rows {
        if let Some(a) = r.agent_id.as_deref() {
            let e = whose.entry(a).or_default();
            e.0 = e.0.or(r.parent_agent_id.as_deref());
            e.1 = e.1.or(r.agent_session_id.as_deref());
        }
    }
    spend_by(rows, |r| r.agent_id.as_deref())
        .into_iter()
        .filter_map(|spend| {
            let (parent, session) = whose.get(spend.id.as_deref()?).copied()?;
            Some(AgentStats {
                parent: parent.map(str::to_string),
                session: session.map(str::to_string),
                spend,
            })
        })
        .collect()
}

/// Spend per value of `group` (a key, a session, an agent): its calls, failed calls,
/// tokens and cost; the dearest first, the rows of no value last. Empty when no row has
/// a value.
fn spend_by<'r>(
    rows: &'r [TelemetryRow],
    group: impl Fn(&'r TelemetryRow) -> Option<&'r str>,
) -> Vec<KeyStats> {
    if rows.iter().all(|r| group(r).is_none()) {
        return Vec::new();
    }
    // Per value: its figures, its calls, its failed calls.
    type Acc<'a> = (KeyStats, HashSet<&'a str>, HashSet<&'a str>);
    let mut keys: BTreeMap<Option<&str>, Acc<'_>> = BTreeMap::new();
    for r in rows {
        let id = group(r);
        let (k, calls, failed) = keys.entry(id).or_insert_with(|| {
            (
                KeyStats {
                    id: id.map(str::to_string),
                    ..KeyStats::default()
                },
                HashSet::new(),
                HashSet::new(),
            )
        });
        calls.insert(&r.logical_call_id);
        match r.kind {
            RowKind::Attempt | RowKind::CacheHit => {
                k.tokens.add(r);
                k.cost.add(r.cost);
            }
            RowKind::TerminalFailure => {
                failed.insert(&r.logical_call_id);
            }
        }
    }
    let mut out: Vec<KeyStats> = keys
        .into_values()
        .map(|(mut k, calls, failed)| {
            k.calls = calls.len() as u64;
            k.failed_calls = failed.len() as u64;
            k
        })
        .collect();
    out.sort_by(|a, b| {
        a.id.is_none()
            .cmp(&b.id.is_none())
            .then_with(|| b.cost.known.total_cmp(&a.cost.known))
            .then_with(|| a.id.cmp(&b.id))
    });
    out
}

/// Logical calls, calls with a readable trace, unreadable traces, and the `max` slowest
/// traced calls (by their trace's length; ties by id).
fn slowest_calls(rows: &[TelemetryRow], max: usize) -> (u64, u64, u64, Vec<SlowCall>) {
    let calls: HashSet<&str> = rows.iter().map(|r| r.logical_call_id.as_str()).collect();
    // The last row of each call that carries a trace.
    let mut last: HashMap<&str, &TelemetryRow> = HashMap::new();
    for r in rows.iter().filter(|r| r.trace.is_some()) {
        let e = last.entry(&r.logical_call_id).or_insert(r);
        if (r.created_at_ms, &r.call_id) > (e.created_at_ms, &e.call_id) {
            *e = r;
        }
    }
    let mut unreadable = 0;
    let mut ranked: Vec<(u64, &str, CallTrace, &TelemetryRow)> = Vec::new();
    for (id, r) in last {
        match CallTrace::from_json(r.trace.as_deref().unwrap_or_default()) {
            Ok(t) => {
                let end = t.events.iter().map(|e| e.t).max().unwrap_or(0);
                ranked.push((end, id, t, r));
            }
            Err(_) => unreadable += 1,
        }
    }
    let traced = ranked.len() as u64;
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    ranked.truncate(max);
    let slowest = ranked
        .into_iter()
        .map(|(_, _, trace, r)| {
            let t = CallTimeline::of(&trace, &[r]);
            let count = |why: &str| t.legs.iter().filter(|l| l.why == why).count();
            SlowCall {
                logical_call_id: r.logical_call_id.clone(),
                scope: r.scope.to_string(),
                duration_ms: t.duration,
                rounds: t.rounds.len().max(usize::from(!t.legs.is_empty())),
                legs: t.legs.len(),
                hedges: count("hedge"),
                resumes: count("resume"),
                outcome: t.outcome(),
            }
        })
        .collect();
    (calls.len() as u64, traced, unreadable, slowest)
}

/// Every error label that occurs in the per-source figures, in a stable order.
pub fn error_labels(sources: &[SourceStats]) -> Vec<String> {
    let set: BTreeSet<&String> = sources.iter().flat_map(|s| s.errors.keys()).collect();
    set.into_iter().cloned().collect()
}

/// One point of the latency-over-time scatter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// `created_at` (ms since the epoch).
    pub at_ms: i64,
    /// `latency_ms`.
    pub latency_ms: f64,
    /// The attempt succeeded.
    pub ok: bool,
}

/// Attempt rows with a latency, thinned to at most `max` points.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scatter {
    /// The points kept.
    pub points: Vec<Point>,
    /// Attempt rows with a latency before thinning.
    pub total: usize,
    /// Every `stride`-th point of each outcome was kept (1: all).
    pub stride: usize,
}

/// Thins the attempts for the scatter: the same stride for successes and failures, taken
/// separately so rare failures are not all skipped; `max` bounds the total.
pub fn scatter(rows: &[TelemetryRow], max: usize) -> Scatter {
    let max = max.max(2);
    let all: Vec<Point> = rows
        .iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .filter_map(|r| {
            r.latency_ms.map(|l| Point {
                at_ms: r.created_at_ms,
                latency_ms: l as f64,
                ok: r.ok,
            })
        })
        .collect();
    let total = all.len();
    let stride = total.div_ceil(max).max(1);
    if stride == 1 {
        return Scatter {
            points: all,
            total,
            stride,
        };
    }
    let (ok, failed): (Vec<Point>, Vec<Point>) = all.into_iter().partition(|p| p.ok);
    let failed: Vec<Point> = failed.into_iter().step_by(stride).collect();
    let room = max.saturating_sub(failed.len());
    let points = ok
        .into_iter()
        .step_by(stride)
        .take(room)
        .chain(failed)
        .collect();
    Scatter {
        points,
        total,
        stride,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An attempt row: `ok` with measured usage and a cost, or failed with `label`.
    pub(crate) fn attempt(
        scope: &str,
        call: &str,
        id: &str,
        source: &str,
        at_ms: i64,
        latency_ms: u64,
    ) -> TelemetryRow {
        let mut r = TelemetryRow::new(RowKind::Attempt, id, call, scope, "chat", at_ms);
        r.source = Some(source.into());
        r.provider = source.split('-').next().map(Into::into);
        r.latency_ms = Some(latency_ms);
        r
    }

    pub(crate) fn ok(
        mut r: TelemetryRow,
        prompt: u64,
        completion: u64,
        cost: Option<f64>,
    ) -> TelemetryRow {
        r.ok = true;
        r.usage_source = UsageSource::Measured;
        r.prompt_tokens = Some(prompt);
        r.completion_tokens = Some(completion);
        r.cost = cost;
        r
    }

    pub(crate) fn failed(mut r: TelemetryRow, label: &str, detail: Option<&str>) -> TelemetryRow {
        r.ok = false;
        r.error = Some(label.to_string());
        r.error_detail = detail.map(str::to_string);
        r
    }

    pub(crate) fn streamed(
        mut r: TelemetryRow,
        ttft: u64,
        stall_ms: u64,
        stalls: u32,
    ) -> TelemetryRow {
        r.stream = true;
        r.ttft_ms = Some(ttft);
        r.stall_ms = Some(stall_ms);
        r.stall_count = Some(stalls);
        r.max_inter_token_ms = Some(stall_ms.max(10));
        r
    }

    pub(crate) fn hedge(mut r: TelemetryRow) -> TelemetryRow {
        r.is_hedge = true;
        r
    }

    /// The hand-made table of the brief: every case the report must get right.
    pub(crate) fn fixture() -> Vec<TelemetryRow> {
        let mut rows = vec![
            // c1: hedged, won by the extra leg on b-0; the primary on a-0 lost.
            failed(
                streamed(
                    attempt("LLM", "c1", "c1-a", "a-0", 10_000, 5_000),
                    4_000,
                    0,
                    0,
                ),
                "hedge_cancelled",
                None,
            ),
            hedge(ok(
                streamed(
                    attempt("LLM", "c1", "c1-b", "b-0", 10_000, 3_000),
                    500,
                    1_000,
                    1,
                ),
                100,
                50,
                Some(0.002),
            )),
            // c2: hedged, won by the primary on a-0; the extra leg on b-0 lost.
            ok(
                streamed(
                    attempt("LLM", "c2", "c2-a", "a-0", 20_000, 4_000),
                    300,
                    2_000,
                    2,
                ),
                200,
                100,
                Some(0.004),
            ),
            failed(
                hedge(streamed(
                    attempt("LLM", "c2", "c2-b", "b-0", 20_000, 1_000),
                    900,
                    0,
                    0,
                )),
                "hedge_cancelled",
                None,
            ),
        ];
        // c3: a 429 then a 5xx, then the terminal row (retry_exhausted).
        let mut r = failed(
            attempt("LLM", "c3", "c3-a", "a-0", 30_000, 100),
            "rate_limited",
            Some("HTTP 429"),
        );
        r.http_status = Some(429);
        rows.push(r);
        rows.push(failed(
            attempt("LLM", "c3", "c3-b", "b-0", 31_000, 200),
            "server_error",
            Some("HTTP 502 <bad gateway>"),
        ));
        let mut t = TelemetryRow::new(
            RowKind::TerminalFailure,
            "c3-t",
            "c3",
            "LLM",
            "chat",
            31_000,
        );
        t.error = Some("retry_exhausted".into());
        t.error_detail = Some("HTTP 502 <bad gateway>".into());
        t.latency_ms = Some(1_500);
        rows.push(t);
        // c4: a cache hit.
        let mut h = TelemetryRow::new(RowKind::CacheHit, "c4-h", "c4", "LLM", "chat", 40_000);
        h.ok = true;
        h.cache_hit = true;
        h.usage_source = UsageSource::Measured;
        h.prompt_tokens = Some(0);
        h.completion_tokens = Some(0);
        h.cost = Some(0.0);
        h.latency_ms = Some(1);
        rows.push(h);
        // c5: success without a usage frame: tokens and cost unknown.
        let mut u = attempt("LLM", "c5", "c5-a", "a-0", 50_000, 2_000);
        u.ok = true;
        rows.push(u);
        // o1: an OCR call priced per call, usage measured 0/0.
        let mut o = ok(
            attempt("OCR", "o1", "o1-a", "ocr-0", 60_000, 700),
            0,
            0,
            Some(0.01),
        );
        o.operation = "ocr".into();
        rows.push(o);
        rows
    }

    fn source<'a>(s: &'a Summary, scope: &str, name: &str) -> &'a SourceStats {
        s.sources
            .iter()
            .find(|x| x.scope == scope && x.source == name)
            .unwrap_or_else(|| panic!("no {scope}/{name}"))
    }

    #[test]
    fn per_source_figures() {
        let s = summarize(&fixture());
        assert_eq!(s.rows, 10);
        assert_eq!(s.kinds, [8, 1, 1]);
        assert_eq!((s.first_ms, s.last_ms), (Some(10_000), Some(60_000)));
        let names: Vec<(&str, &str)> = s
            .sources
            .iter()
            .map(|x| (x.scope.as_str(), x.source.as_str()))
            .collect();
        assert_eq!(names, [("LLM", "a-0"), ("LLM", "b-0"), ("OCR", "ocr-0")]);

        let a = source(&s, "LLM", "a-0");
        assert_eq!((a.attempts, a.ok, a.failed()), (4, 2, 2));
        assert_eq!(
            a.errors,
            BTreeMap::from([("hedge_cancelled".into(), 1), ("rate_limited".into(), 1)])
        );
        // ok attempts: c2-a 4000, c5-a 2000 (nearest rank).
        assert_eq!(a.latency.p50, Some(2_000.0));
        assert_eq!(a.latency.p99, Some(4_000.0));
        assert_eq!(a.latency.n, 2);
        // Only c2-a is an ok streamed attempt.
        assert_eq!((a.ttft.p50, a.ttft.n), (Some(300.0), 1));
        assert_eq!(a.stall_share(), Some(0.5));
        assert_eq!((a.stalled_attempts, a.streamed_ok), (1, 1));
        assert_eq!((a.hedge_legs, a.hedge_wins), (0, 0));
        assert_eq!(
            (a.tokens.rows, a.tokens.prompt, a.tokens.completion),
            (1, 200, 100)
        );
        // c2-a known; c1-a, c3-a failed and c5-a without usage are unknown, not 0.
        assert_eq!(a.cost.known_sum(), Some(0.004));
        assert_eq!(a.cost.unknown_rows, 3);
        // Usage unavailable: c1-a, c3-a, c5-a.
        assert_eq!(a.gap, 3);

        let b = source(&s, "LLM", "b-0");
        assert_eq!((b.attempts, b.ok), (3, 1));
        assert_eq!((b.hedge_legs, b.hedge_wins), (2, 1));
        assert_eq!(b.stall_share(), Some(1_000.0 / 3_000.0));
        assert_eq!(b.ttft.p95, Some(500.0));
        assert_eq!(b.gap, 2);

        let o = source(&s, "OCR", "ocr-0");
        assert_eq!(o.cost.known_sum(), Some(0.01));
        assert_eq!((o.cost.unknown_rows, o.gap), (0, 0));
        assert_eq!((o.tokens.rows, o.tokens.prompt), (1, 0));
        assert_eq!(o.stall_share(), None);
        assert_eq!(o.ttft.p50, None);

        assert_eq!(s.gap, 5);
        assert_eq!(s.gap, fixture().iter().filter(|r| in_gap(r)).count() as u64);
    }

    #[test]
    fn per_scope_figures() {
        let s = summarize(&fixture());
        let llm = &s.scopes[0];
        assert_eq!(llm.scope, "LLM");
        assert_eq!(llm.logical_calls, 5);
        assert_eq!((llm.succeeded, llm.failed, llm.no_outcome), (4, 1, 0));
        assert_eq!(
            llm.terminal_reasons,
            BTreeMap::from([("retry_exhausted".into(), 1)])
        );
        assert_eq!(llm.terminal_latency["retry_exhausted"].p50, Some(1_500.0));
        assert_eq!(llm.cache_hits, 1);
        // c1, c2, c3, c5 reached a source; c1 and c2 were hedged; only c1 won by the leg.
        assert_eq!(llm.calls_with_attempts, 4);
        assert_eq!((llm.hedged_calls, llm.hedge_won_calls), (2, 1));
        assert_eq!(llm.hedge_rate(), Some(0.5));
        assert_eq!(llm.hedge_win_rate(), Some(0.5));
        assert_eq!((llm.attempts, llm.hedge_legs), (7, 2));
        assert_eq!(llm.extra_requests(), Some(2.0 / 5.0));
        // Call latency of successful calls that reached a source: c1 spans 5000 ms
        // (primary started at 5000, the leg ended at 10000), c2 4000, c5 2000; the cache
        // hit (c4) is left out.
        assert_eq!(llm.call_latency.n, 3);
        assert_eq!(llm.call_latency.p50, Some(4_000.0));
        assert_eq!(llm.call_latency.p99, Some(5_000.0));
        // Cache hit: known cost 0.0; terminal rows are not counted as spend.
        assert!((llm.cost.known_sum().unwrap() - 0.006).abs() < 1e-12);
        assert_eq!(llm.cost.known_rows, 3);
        assert_eq!(llm.cost.unknown_rows, 5);
        assert_eq!(llm.gap, 5);
        assert_eq!(llm.tokens.prompt, 300);

        let ocr = &s.scopes[1];
        assert_eq!(ocr.operations, BTreeSet::from(["ocr".to_string()]));
        assert_eq!((ocr.logical_calls, ocr.succeeded), (1, 1));
        assert_eq!(ocr.hedge_rate(), Some(0.0));
        assert_eq!(ocr.hedge_win_rate(), None);
        assert_eq!(ocr.gap, 0);
    }

    #[test]
    fn error_details_and_labels() {
        let s = summarize(&fixture());
        assert_eq!(s.distinct_details, 3);
        let d: Vec<(&str, &str, &str, u64)> = s
            .details
            .iter()
            .map(|d| {
                (
                    d.source.as_str(),
                    d.label.as_str(),
                    d.detail.as_str(),
                    d.count,
                )
            })
            .collect();
        assert_eq!(
            d,
            [
                (CALL_LEVEL, "retry_exhausted", "HTTP 502 <bad gateway>", 1),
                ("a-0", "rate_limited", "HTTP 429", 1),
                ("b-0", "server_error", "HTTP 502 <bad gateway>", 1),
            ]
        );
        assert_eq!(
            error_labels(&s.sources),
            ["hedge_cancelled", "rate_limited", "server_error"]
        );
    }

    #[test]
    fn a_call_without_outcome_and_a_missing_label() {
        // A caller-cancelled call: one cancelled attempt, no terminal row.
        let mut r = attempt("LLM", "x", "x-a", "a-0", 1_000, 10);
        r.error = None;
        let s = summarize(&[r]);
        assert_eq!(s.scopes[0].no_outcome, 1);
        assert_eq!(s.sources[0].errors, BTreeMap::from([(NO_LABEL.into(), 1)]));
        assert_eq!(s.sources[0].cost.known_sum(), None);
        assert_eq!(s.scopes[0].call_latency.n, 0);
    }

    #[test]
    fn empty_rows() {
        let s = summarize(&[]);
        assert_eq!(s, Summary::default());
    }

    #[test]
    fn scatter_is_bounded_and_keeps_failures() {
        let mut rows = Vec::new();
        for i in 0..10_000u64 {
            let r = attempt(
                "LLM",
                &format!("c{i}"),
                &format!("a{i}"),
                "a-0",
                i as i64,
                i,
            );
            rows.push(if i % 100 == 0 {
                failed(r, "timeout", None)
            } else {
                ok(r, 1, 1, None)
            });
        }
        let sc = scatter(&rows, 5_000);
        assert_eq!(sc.total, 10_000);
        assert_eq!(sc.stride, 2);
        assert!(sc.points.len() <= 5_000);
        assert_eq!(sc.points.iter().filter(|p| !p.ok).count(), 50);
        let small = scatter(&rows[..10], 5_000);
        assert_eq!((small.points.len(), small.stride), (10, 1));
    }

    /// Rows of a priced source with cache figures and every class of the books: what
    /// `polygw report` shows in "Prompt cache" and "Accounting gap".
    pub(crate) fn cache_rows() -> (Vec<TelemetryRow>, PriceBook) {
        let mut hit = ok(
            attempt("LLM", "k1", "k1-a", "a-0", 1_000, 100),
            1_000,
            10,
            None,
        );
        hit.cached_prompt_tokens = Some(600);
        hit.cache_write_tokens = Some(300);
        // 100·2 + 600·0.5 + 300·2.5 + 10·8 = 1330
        hit.cost = Some(1330.0 / 1e6);
        let plain = ok(
            attempt("LLM", "k2", "k2-a", "a-0", 2_000, 100),
            1_000,
            10,
            Some(2080.0 / 1e6),
        );
        // A cancelled loser: usage unavailable, the gateway's estimate.
        let mut loser = failed(
            attempt("LLM", "k3", "k3-a", "a-0", 3_000, 100),
            "hedge_cancelled",
            None,
        );
        loser.est_prompt_tokens = Some(1_000);
        loser.est_received_tokens = Some(5);
        // A cut leg the answer counts: estimated, its estimate in both column sets.
        let mut cut = failed(
            attempt("LLM", "k4", "k4-a", "a-0", 4_000, 100),
            "truncated",
            None,
        );
        cut.usage_source = UsageSource::Estimated;
        (cut.prompt_tokens, cut.completion_tokens) = (Some(1_000), Some(20));
        (cut.est_prompt_tokens, cut.est_received_tokens) = (Some(1_000), Some(20));
        cut.cost = Some(2160.0 / 1e6);
        // A 429: not billed.
        let mut limited = failed(
            attempt("LLM", "k5", "k5-a", "a-0", 5_000, 100),
            "rate_limited",
            None,
        );
        limited.http_status = Some(429);
        // An unpriced source's row.
        let mut other = ok(
            attempt("LLM", "k6", "k6-b", "b-0", 6_000, 100),
            500,
            5,
            None,
        );
        other.cached_prompt_tokens = Some(250);
        let mut book = PriceBook::new();
        book.insert(
            ("LLM".into(), "a-0".into()),
            SourcePrices {
                prices: TokenPrices {
                    input: Some(2.0),
                    cached_input: Some(0.5),
                    cache_write: Some(2.5),
                    cache_write_1h: Some(2.5),
                    output: Some(8.0),
                },
                allowance: 100,
            },
        );
        (vec![hit, plain, loser, cut, limited, other], book)
    }

    #[test]
    fn cache_share_saving_and_the_gap_at_the_configured_prices() {
        let (rows, book) = cache_rows();
        let sum = summarize_priced(&rows, &book);
        let a = &sum.sources[0];
        assert_eq!((a.source.as_str(), a.priced), ("a-0", true));
        // Known usage: hit, plain, cut (the cut's estimate reports no cache figure).
        assert_eq!(
            (
                a.cache.prompt,
                a.cache.cached,
                a.cache.written,
                a.cache.reporting_rows
            ),
            (3_000, 600, 300, 1)
        );
        assert_eq!(a.cache.hit_share(), Some(0.2));
        // Saved: 600·(2 − 0.5) − 300·(2.5 − 2) = 900 − 150 = 750.
        assert!((a.cache.saving.unwrap() - 750.0 / 1e6).abs() < 1e-15);
        let b = &a.accounts;
        assert_eq!(
            (
                b.attempts,
                b.reported_rows,
                b.gap_rows,
                b.gap_unavailable,
                b.not_billed_rows
            ),
            (5, 2, 2, 1, 1)
        );
        assert_eq!((b.est_prompt_tokens, b.est_received_tokens), (2_000, 25));
        let g = b.gap.unwrap();
        // Low: 25 received × 8. High: 2000 × 2.5 + (25 + 2 × 100) × 8.
        assert!((g.low - 200.0 / 1e6).abs() < 1e-15);
        assert!((g.high.unwrap() - (5_000.0 + 1_800.0) / 1e6).abs() < 1e-15);
        let inv = b.invoice_range().unwrap();
        assert!((inv.low - (3410.0 + 200.0) / 1e6).abs() < 1e-15);
        // b-0 is not in the book: no money figure, but its tokens are counted.
        let other = &sum.sources[1];
        assert!(!other.priced);
        assert_eq!((other.cache.cached, other.cache.saving), (250, None));
        assert_eq!(other.accounts.reported_rows, 0);
        assert_eq!(other.accounts.unpriced_rows, 1);
        assert_eq!(other.accounts.invoice_range(), None);
    }

    /// The fixture with its calls charged to keys: c1 to `key_a`, c3 (failed) to
    /// `key_b`, the others to none; c1's winner carries a trace.
    pub(crate) fn keyed_fixture() -> Vec<TelemetryRow> {
        let mut rows = fixture();
        for r in &mut rows {
            r.client_key_id = match r.logical_call_id.as_str() {
                "c1" => Some("key_a".into()),
                "c3" => Some("key_b".into()),
                _ => None,
            };
            if r.call_id == "c1-b" {
                r.trace = Some(super::super::timeline::tests::stalled_trace().to_json());
            }
        }
        rows
    }

    #[test]
    fn spend_per_client_key() {
        let s = summarize(&fixture());
        assert!(s.keys.is_empty(), "no row names a key: no table");
        let s = summarize(&keyed_fixture());
        let ids: Vec<Option<&str>> = s.keys.iter().map(|k| k.id.as_deref()).collect();
        assert_eq!(
            ids,
            [Some("key_a"), Some("key_b"), None],
            "by cost, no key last"
        );
        let a = &s.keys[0];
        assert_eq!((a.calls, a.failed_calls), (1, 0));
        assert_eq!(
            (a.tokens.rows, a.tokens.prompt, a.tokens.completion),
            (1, 100, 50)
        );
        assert_eq!((a.cost.known_sum(), a.cost.unknown_rows), (Some(0.002), 1));
        let b = &s.keys[1];
        assert_eq!((b.calls, b.failed_calls, b.tokens.rows), (1, 1, 0));
        assert_eq!((b.cost.known_sum(), b.cost.unknown_rows), (None, 2));
        let none = &s.keys[2];
        assert_eq!((none.calls, none.failed_calls), (4, 0));
        assert_eq!((none.tokens.prompt, none.tokens.completion), (200, 100));
        assert!((none.cost.known - 0.014).abs() < 1e-12);
        assert_eq!((none.cost.known_rows, none.cost.unknown_rows), (3, 2));
    }

    /// SPEC §24.6: spend per agent session and per sub-agent, from the same rows.
    #[test]
    fn spend_per_session_and_sub_agent() {
        let s = summarize(&fixture());
        assert!(s.sessions.is_empty() && s.agents.is_empty());
        let mut rows = fixture();
        for r in &mut rows {
            match r.logical_call_id.as_str() {
                "c1" => {
                    r.agent_session_id = Some("sess-1".into());
                    r.agent_id = Some("agent-sub".into());
                    r.parent_agent_id = Some("agent-main".into());
                }
                "c3" => r.agent_session_id = Some("sess-1".into()),
                _ => {}
            }
        }
        let s = summarize(&rows);
        let ids: Vec<Option<&str>> = s.sessions.iter().map(|k| k.id.as_deref()).collect();
        assert_eq!(ids, [Some("sess-1"), None], "sessions, then no session");
        assert_eq!(s.sessions[0].calls, 2);
        let keyed = summarize(&keyed_fixture());
        // The session's spend is its calls' (c1 and c3: what their keys spent).
        assert_eq!(
            s.sessions[0].cost.known_sum(),
            keyed.keys[0].cost.known_sum()
        );
        assert_eq!(s.agents.len(), 1);
        let a = &s.agents[0];
        assert_eq!(a.spend.id.as_deref(), Some("agent-sub"));
        assert_eq!(
            (a.parent.as_deref(), a.session.as_deref()),
            (Some("agent-main"), Some("sess-1"))
        );
        assert_eq!(a.spend.calls, 1);
    }

    #[test]
    fn the_slowest_traced_calls() {
        let s = summarize(&fixture());
        assert_eq!((s.calls, s.traced_calls, s.slowest.len()), (6, 0, 0));
        let mut rows = keyed_fixture();
        rows[5].trace = Some("{broken".into());
        let s = summarize(&rows);
        assert_eq!((s.calls, s.traced_calls, s.unreadable_traces), (6, 1, 1));
        let c = &s.slowest[0];
        assert_eq!(
            (c.logical_call_id.as_str(), c.duration_ms, c.rounds, c.legs),
            ("c1", 1_400, 1, 2)
        );
        assert_eq!((c.hedges, c.resumes), (0, 1));
        assert_eq!(c.outcome, "answered by r1·L1 (b-0, resume)");
    }
}
