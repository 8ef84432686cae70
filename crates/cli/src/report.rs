//! `polygw report` (SPEC §11): per-source latency/TTFT percentiles, stall share, hedging,
//! error labels, tokens, cost and the accounting gap from the telemetry table (SPEC §8),
//! spend per client key (SPEC §21.1) and the slowest calls (SPEC §19.4), as text tables,
//! and with `--html FILE` a self-contained HTML file with SVG charts (the legs of the
//! slowest calls as a timeline among them). `--call ID` explains one call: its rows and
//! its decision trace as a timeline. Figures and definitions: docs/REPORT.md.

mod call;
mod html;
mod stats;
mod timeline;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use polygw::core::secret::redact_url;

use crate::table::{money, ms, pct, Table};
use stats::Summary;

/// Most points the HTML latency-over-time scatter draws.
pub const MAX_SCATTER_POINTS: usize = 5_000;

/// Longest `--since` accepted (100 years), so the bound never overflows.
const MAX_SINCE_SECS: u64 = 36_500 * 86_400;

/// Arguments of `polygw report`.
#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// Telemetry database URL (`sqlite://path.db` or `postgres://…`); never created.
    #[arg(long, value_name = "URL")]
    pub db: String,
    /// Only rows created within this long before now: a whole number followed by `s`,
    /// `m`, `h` or `d` (`90s`, `30m`, `2h`, `7d`).
    #[arg(long, value_name = "DUR", value_parser = parse_since)]
    pub since: Option<Duration>,
    /// Also write the report with SVG charts into this self-contained HTML file.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Only this scope (case-insensitive).
    #[arg(long, value_name = "S")]
    pub scope: Option<String>,
    /// Explain one call instead: its rows and its decision trace as a timeline. ID: a
    /// logical_call_id, or the call_id of one of its rows. With `--html`, the page shows
    /// its rows and its legs as a timeline chart.
    #[arg(long, value_name = "ID", conflicts_with_all = ["since", "scope"])]
    pub call: Option<String>,
}

/// Parses a `--since` duration: a whole number > 0 followed by `s`, `m`, `h` or `d`.
pub fn parse_since(s: &str) -> Result<Duration, String> {
    const EXPECTED: &str =
        "expected a whole number followed by s, m, h or d (e.g. 90s, 30m, 2h, 7d)";
    let Some((at, unit)) = s.char_indices().last() else {
        return Err(EXPECTED.into());
    };
    let num = &s[..at];
    let unit_secs: u64 = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3_600,
        'd' => 86_400,
        _ => return Err(EXPECTED.into()),
    };
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return Err(EXPECTED.into());
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s} is too long a window"))?;
    if n == 0 {
        return Err("the window must be longer than zero".into());
    }
    match n.checked_mul(unit_secs) {
        Some(secs) if secs <= MAX_SINCE_SECS => Ok(Duration::from_secs(secs)),
        _ => Err(format!("{s} is too long a window (at most 36500d)")),
    }
}

/// A duration as `--since` writes it (the largest unit that divides it).
pub fn format_since(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => "0s".into(),
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3_600 == 0 => format!("{}h", s / 3_600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// The wall clock in ms since the Unix epoch.
// `--since` means "this long before now" on the wall clock by definition (rows carry
// wall-clock `created_at`); the CLI has no injected Clock here.
#[allow(clippy::disallowed_methods)]
fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Milliseconds since the epoch as ISO-8601 UTC (`2026-12-02T11:32:08.123Z`), the
/// telemetry adapter's own format.
pub fn iso(ms: i64) -> String {
    polygw::telemetry::format_utc_ms(ms)
}

/// What the report was asked for and the database-wide figures next to the rows.
#[derive(Debug, Clone)]
pub(crate) struct Context {
    /// The database URL, redacted.
    pub db: String,
    /// `--since` and the bound it gave (ms since the epoch).
    pub since: Option<(Duration, i64)>,
    /// `--scope`.
    pub scope: Option<String>,
    /// When the report was made (ms since the epoch).
    pub generated_ms: i64,
    /// The SPEC §8 accounting-gap query over the whole database.
    pub db_gap: u64,
    /// Where the prices came from (one line).
    pub prices: String,
}

impl Context {
    fn filtered(&self) -> bool {
        self.since.is_some() || self.scope.is_some()
    }

    /// The filter in words.
    pub fn filter_text(&self) -> String {
        let mut parts = Vec::new();
        if let Some((d, bound)) = self.since {
            parts.push(format!(
                "since {} (created_at ≥ {})",
                format_since(d),
                iso(bound)
            ));
        }
        if let Some(s) = &self.scope {
            parts.push(format!("scope {s}"));
        }
        if parts.is_empty() {
            "none (every row)".into()
        } else {
            parts.join(", ")
        }
    }
}

/// The accounting-gap sentence: the SPEC §8 query for the whole database, and this
/// report's own count when a filter narrows the rows.
pub(crate) fn gap_line(sum: &Summary, ctx: &Context) -> String {
    if ctx.filtered() {
        format!(
            "Accounting gap: {} attempts with usage unavailable in the rows shown ({}; counted \
             by the report); {} in the whole database (SPEC §8 query).",
            sum.gap,
            ctx.filter_text(),
            ctx.db_gap
        )
    } else if sum.gap == ctx.db_gap {
        format!(
            "Accounting gap: {} attempts with usage unavailable (SPEC §8 query, whole \
             database).",
            ctx.db_gap
        )
    } else {
        format!(
            "Accounting gap: {} attempts with usage unavailable (SPEC §8 query, whole \
             database); {} among the rows read (rows were written in between).",
            ctx.db_gap, sum.gap
        )
    }
}

/// One table of the report, rendered as text or HTML.
#[derive(Debug, Clone)]
pub(crate) struct Section {
    /// Heading.
    pub title: &'static str,
    /// How the figures are computed (one sentence).
    pub note: &'static str,
    /// Column headers.
    pub headers: Vec<&'static str>,
    /// Cells.
    pub rows: Vec<Vec<String>>,
    /// Shown instead of the table when there is no row.
    pub empty: &'static str,
    /// In text: one line per row instead of aligned columns (long free text).
    pub as_lines: bool,
}

fn count_or_dash(known: bool, v: u64) -> String {
    if known {
        v.to_string()
    } else {
        "—".into()
    }
}

/// The report's tables.
pub(crate) fn sections(sum: &Summary) -> Vec<Section> {
    let name = |scope: &str, source: &str| format!("{scope}/{source}");
    let mut out = Vec::new();

    out.push(Section {
        title: "Sources",
        note: "Attempt rows per scope/source. Latency: ok attempts; TTFT and stall share \
               (Σ stall_ms / Σ latency_ms): ok streamed attempts; nearest-rank percentiles. \
               Hedge legs: extra legs launched on the source; hedge wins: those that won.",
        headers: vec![
            "source",
            "attempts",
            "ok",
            "failed",
            "p50",
            "p95",
            "p99",
            "TTFT p50",
            "TTFT p95",
            "stall share",
            "hedge legs",
            "hedge wins",
        ],
        rows: sum
            .sources
            .iter()
            .map(|s| {
                vec![
                    name(&s.scope, &s.source),
                    s.attempts.to_string(),
                    s.ok.to_string(),
                    s.failed().to_string(),
                    ms(s.latency.p50),
                    ms(s.latency.p95),
                    ms(s.latency.p99),
                    ms(s.ttft.p50),
                    ms(s.ttft.p95),
                    pct(s.stall_share()),
                    s.hedge_legs.to_string(),
                    s.hedge_wins.to_string(),
                ]
            })
            .collect(),
        empty: "no attempt rows",
        as_lines: false,
    });

    out.push(Section {
        title: "Errors by label",
        note: "Failed attempts per source and error label (hedge_cancelled: a leg that lost \
               its race), with their share of the source's attempts.",
        headers: vec!["source", "label", "attempts", "share"],
        rows: sum
            .sources
            .iter()
            .flat_map(|s| {
                s.errors.iter().map(move |(label, n)| {
                    vec![
                        name(&s.scope, &s.source),
                        label.clone(),
                        n.to_string(),
                        pct(Some(*n as f64 / s.attempts.max(1) as f64)),
                    ]
                })
            })
            .collect(),
        empty: "no failed attempt",
        as_lines: false,
    });

    let mut usage_rows = Vec::new();
    for sc in &sum.scopes {
        for s in sum.sources.iter().filter(|s| s.scope == sc.scope) {
            let known = s.tokens.rows > 0;
            usage_rows.push(vec![
                name(&s.scope, &s.source),
                format!("{}/{}", s.tokens.rows, s.attempts),
                count_or_dash(known, s.tokens.prompt),
                count_or_dash(known, s.tokens.completion),
                count_or_dash(known, s.tokens.reasoning),
                money(s.cost.known_sum()),
                s.cost.unknown_rows.to_string(),
                s.gap.to_string(),
            ]);
        }
        let known = sc.tokens.rows > 0;
        usage_rows.push(vec![
            format!("{} (scope, with cache hits)", sc.scope),
            format!("{}/{}", sc.tokens.rows, sc.attempts + sc.cache_hits),
            count_or_dash(known, sc.tokens.prompt),
            count_or_dash(known, sc.tokens.completion),
            count_or_dash(known, sc.tokens.reasoning),
            money(sc.cost.known_sum()),
            sc.cost.unknown_rows.to_string(),
            sc.gap.to_string(),
        ]);
    }
    out.push(Section {
        title: "Tokens and cost",
        note: "Tokens: sums over rows with known usage (usage known = such rows / rows). Cost: \
               sum of the known costs; 'unknown cost' counts the rows whose cost is NULL \
               (failed attempts, usage unavailable, no price), never added as 0. Gap: \
               attempts with usage unavailable (SPEC §8).",
        headers: vec![
            "source",
            "usage known",
            "prompt",
            "completion",
            "reasoning",
            "cost (known)",
            "unknown cost",
            "gap",
        ],
        rows: usage_rows,
        empty: "no rows",
        as_lines: false,
    });

    out.push(Section {
        title: "Prompt cache",
        note: "Attempt rows with known usage: prompt tokens, those read from the provider's \
               prompt cache (cached) and written to it (written); hit share = cached / prompt. \
               Saved: cached × (INPUT_PRICE − CACHED_INPUT_PRICE) + written × (INPUT_PRICE − \
               CACHE_WRITE_PRICE), / 1e6, at the prices of the configuration in the \
               environment — 'prices unknown' for a source not configured there (rows hold \
               costs, not prices). Negative when cache writes cost more than reads saved.",
        headers: vec![
            "source",
            "reporting rows",
            "prompt",
            "cached",
            "written",
            "hit share",
            "saved",
        ],
        rows: sum
            .sources
            .iter()
            .filter(|s| s.tokens.rows > 0)
            .map(|s| {
                vec![
                    name(&s.scope, &s.source),
                    format!("{}/{}", s.cache.reporting_rows, s.tokens.rows),
                    s.cache.prompt.to_string(),
                    s.cache.cached.to_string(),
                    s.cache.written.to_string(),
                    pct(s.cache.hit_share()),
                    priced_money(s.priced, s.cache.saving),
                ]
            })
            .collect(),
        empty: "no attempt with known usage",
        as_lines: false,
    });

    out.push(Section {
        title: "Accounting gap",
        note: "Attempts the provider may have billed without reporting usage (SPEC §20.4): \
               usage unavailable (a cancelled hedge loser, a leg cut or failed after sending) \
               or estimated from the text received (a cut leg the answer counts). est. prompt \
               / est. received: the gateway's estimates. Gap cost: at least what was received \
               × OUTPUT_PRICE; at most the prompt at its dearest price plus (received + the \
               source's EST_TOKENS) × OUTPUT_PRICE ('≥' when EST_TOKENS is 0: no upper \
               bound). Reported: the cost of the rows billed as the provider reported them. \
               Invoice: reported + gap, where the provider's bill lies. Not billed: unavailable \
               attempts without an estimate (answered with an error status, or never sent).",
        headers: vec![
            "source",
            "gap rows",
            "unavailable",
            "est. prompt",
            "est. received",
            "gap cost",
            "reported",
            "invoice",
            "not billed",
        ],
        rows: sum
            .sources
            .iter()
            .map(|s| {
                let a = &s.accounts;
                let unpriced = if s.priced {
                    "unknown (a price is missing)"
                } else {
                    "prices unknown"
                };
                vec![
                    name(&s.scope, &s.source),
                    a.gap_rows.to_string(),
                    a.gap_unavailable.to_string(),
                    a.est_prompt_tokens.to_string(),
                    a.est_received_tokens.to_string(),
                    if a.gap_rows == 0 {
                        money(Some(0.0))
                    } else {
                        a.gap.map_or(unpriced.to_string(), range)
                    },
                    if a.unpriced_rows > 0 {
                        format!(
                            "{} (+{} unpriced rows)",
                            money(Some(a.reported_cost)),
                            a.unpriced_rows
                        )
                    } else {
                        money(Some(a.reported_cost))
                    },
                    a.invoice_range().map_or(unpriced.to_string(), range),
                    a.not_billed_rows.to_string(),
                ]
            })
            .collect(),
        empty: "no attempt rows",
        as_lines: false,
    });

    out.push(Section {
        title: "Calls per scope",
        note: "Logical calls. ok: an ok attempt or a cache hit; failed: a terminal_failure \
               row; no outcome: neither (cancelled by the caller, or cut by --since). Call \
               latency: successful calls that reached a source, from the earliest attempt \
               start (created_at − latency_ms) to the last row's created_at.",
        headers: vec![
            "scope",
            "operations",
            "calls",
            "ok",
            "failed",
            "no outcome",
            "cache hits",
            "call p50",
            "call p95",
            "call p99",
        ],
        rows: sum
            .scopes
            .iter()
            .map(|s| {
                vec![
                    s.scope.clone(),
                    s.operations.iter().cloned().collect::<Vec<_>>().join(","),
                    s.logical_calls.to_string(),
                    s.succeeded.to_string(),
                    s.failed.to_string(),
                    s.no_outcome.to_string(),
                    s.cache_hits.to_string(),
                    ms(s.call_latency.p50),
                    ms(s.call_latency.p95),
                    ms(s.call_latency.p99),
                ]
            })
            .collect(),
        empty: "no rows",
        as_lines: false,
    });

    out.push(Section {
        title: "Hedging per scope",
        note: "Hedge rate: calls with at least one extra leg / calls that reached a source. \
               Hedge win rate: hedged calls whose winning ok attempt is an extra leg / hedged \
               calls. Extra requests: extra legs / other attempts.",
        headers: vec![
            "scope",
            "calls w/ attempts",
            "hedged",
            "hedge rate",
            "won by leg",
            "hedge win rate",
            "extra legs",
            "extra requests",
        ],
        rows: sum
            .scopes
            .iter()
            .map(|s| {
                vec![
                    s.scope.clone(),
                    s.calls_with_attempts.to_string(),
                    s.hedged_calls.to_string(),
                    pct(s.hedge_rate()),
                    s.hedge_won_calls.to_string(),
                    pct(s.hedge_win_rate()),
                    s.hedge_legs.to_string(),
                    pct(s.extra_requests()),
                ]
            })
            .collect(),
        empty: "no rows",
        as_lines: false,
    });

    out.push(Section {
        title: "Failed calls by terminal reason",
        note: "terminal_failure rows; latency: the call's wall time up to the failure.",
        headers: vec!["scope", "reason", "calls", "latency p50", "latency p95"],
        rows: sum
            .scopes
            .iter()
            .flat_map(|s| {
                s.terminal_reasons.iter().map(move |(reason, n)| {
                    let lat = s.terminal_latency.get(reason).copied().unwrap_or_default();
                    vec![
                        s.scope.clone(),
                        reason.clone(),
                        n.to_string(),
                        ms(lat.p50),
                        ms(lat.p95),
                    ]
                })
            })
            .collect(),
        empty: "no failed call",
        as_lines: false,
    });

    out.push(Section {
        title: "Most frequent error details",
        note: if sum.distinct_details > stats::MAX_DETAILS {
            "error_detail of failed attempts and terminal rows, most frequent first (the \
             first 20 distinct ones)."
        } else {
            "error_detail of failed attempts and terminal rows, most frequent first."
        },
        headers: vec!["rows", "source", "label", "detail"],
        rows: sum
            .details
            .iter()
            .map(|d| {
                vec![
                    format!("{}×", d.count),
                    name(&d.scope, &d.source),
                    d.label.clone(),
                    d.detail.clone(),
                ]
            })
            .collect(),
        empty: "no error detail",
        as_lines: true,
    });

    out.push(Section {
        title: "Spend per client key",
        note: match sum.key_table {
            Some(false) => {
                "Rows per client_key_id (the client key a call was charged to; SPEC §21.1): \
                 calls, failed calls, and over attempts and cache hits the tokens with known \
                 usage, the known cost, and the rows whose cost is unknown (NULL, never added \
                 as 0). Names: this database has no polygw_client_keys table."
            }
            _ => {
                "Rows per client_key_id (the client key a call was charged to; SPEC §21.1): \
                 calls, failed calls, and over attempts and cache hits the tokens with known \
                 usage, the known cost, and the rows whose cost is unknown (NULL, never added \
                 as 0). Names from polygw_client_keys; keys by id only, nothing secret."
            }
        },
        headers: [&["client key", "name"][..], &SPEND_HEADERS].concat(),
        rows: sum
            .keys
            .iter()
            .map(|k| {
                let mut row = vec![
                    k.id.clone().unwrap_or_else(|| NO_KEY.to_string()),
                    if k.name.is_empty() {
                        "—".into()
                    } else {
                        k.name.clone()
                    },
                ];
                row.extend(spend_cells(k));
                row
            })
            .collect(),
        empty: "no call was charged to a client key",
        as_lines: false,
    });

    if !sum.sessions.is_empty() {
        out.push(Section {
            title: "Spend per agent session",
            note: "Rows per agent_session_id (SPEC §24.6: Claude Code's session id, Codex's \
                   session_id, a prompt_cache_key), the dearest first: calls, failed calls, \
                   tokens with known usage, the known cost, and the rows whose cost is \
                   unknown.",
            headers: [&["session"][..], &SPEND_HEADERS].concat(),
            rows: sum
                .sessions
                .iter()
                .map(|k| {
                    let mut row = vec![k.id.clone().unwrap_or_else(|| NO_SESSION.to_string())];
                    row.extend(spend_cells(k));
                    row
                })
                .collect(),
            empty: "no call named an agent session",
            as_lines: false,
        });
    }
    if !sum.agents.is_empty() {
        out.push(Section {
            title: "Spend per sub-agent",
            note: "Rows per agent_id (SPEC §24.6: Claude Code's x-claude-code-agent-id), with \
                   the agent that started it and its session.",
            headers: [&["agent", "parent", "session"][..], &SPEND_HEADERS].concat(),
            rows: sum
                .agents
                .iter()
                .map(|a| {
                    let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "—".into());
                    let mut row = vec![
                        a.spend.id.clone().unwrap_or_default(),
                        dash(&a.parent),
                        dash(&a.session),
                    ];
                    row.extend(spend_cells(&a.spend));
                    row
                })
                .collect(),
            empty: "no call named a sub-agent",
            as_lines: false,
        });
    }

    out.push(Section {
        title: "Slowest calls",
        note: if sum.traced_calls < sum.calls {
            "The slowest calls by their decision trace (SPEC §19.4: the call's last row; \
             rows written before polygw kept traces have none, and are not ranked). polygw \
             report --call ID prints one's rows and timeline."
        } else {
            "The slowest calls by their decision trace (SPEC §19.4: the call's last row). \
             polygw report --call ID prints one's rows and timeline."
        },
        headers: vec![
            "call", "scope", "duration", "rounds", "legs", "hedges", "resumes", "outcome",
        ],
        rows: sum
            .slowest
            .iter()
            .map(|c| {
                vec![
                    c.logical_call_id.clone(),
                    c.scope.clone(),
                    ms(Some(c.duration_ms as f64)),
                    c.rounds.to_string(),
                    c.legs.to_string(),
                    c.hedges.to_string(),
                    c.resumes.to_string(),
                    c.outcome.clone(),
                ]
            })
            .collect(),
        empty: "no row carries a decision trace",
        as_lines: false,
    });
    out
}

/// A client key's name as `polygw_client_keys` holds it (nothing secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyName {
    /// Its id.
    pub id: String,
    /// Its name.
    pub name: String,
    /// It was revoked.
    pub revoked: bool,
}

/// The names of the client keys in the database of `reader`: `Some(None)` when it has no
/// `polygw_client_keys` table; `None` when they could not be read (a warning, not the
/// report's end: the keys are shown by id).
pub(crate) async fn key_names(
    reader: &polygw::telemetry::TelemetryReader,
    db: &str,
) -> Option<Option<Vec<KeyName>>> {
    match reader.client_key_names().await {
        Ok(names) => Some(names.map(|v| {
            v.into_iter()
                .map(|n| KeyName {
                    id: n.id,
                    name: n.name,
                    revoked: n.revoked,
                })
                .collect()
        })),
        Err(e) => {
            eprintln!("warning: cannot read the client keys' names from {db}: {e}");
            None
        }
    }
}

/// The "client key" of rows charged to none.
pub const NO_KEY: &str = "(no client key)";

/// The row of the calls that named no agent session.
pub const NO_SESSION: &str = "(no session)";

/// The headers of [`spend_cells`].
const SPEND_HEADERS: [&str; 7] = [
    "calls",
    "failed",
    "usage known",
    "prompt",
    "completion",
    "cost (known)",
    "unknown cost",
];

/// The spend cells of a per-key / per-session / per-agent table: calls, failed, usage
/// known, prompt, completion, cost (known), unknown cost.
fn spend_cells(k: &stats::KeyStats) -> Vec<String> {
    let known = k.tokens.rows > 0;
    vec![
        k.calls.to_string(),
        k.failed_calls.to_string(),
        format!(
            "{}/{}",
            k.tokens.rows,
            k.cost.known_rows + k.cost.unknown_rows
        ),
        count_or_dash(known, k.tokens.prompt),
        count_or_dash(known, k.tokens.completion),
        money(k.cost.known_sum()),
        k.cost.unknown_rows.to_string(),
    ]
}

/// Names the keys of `sum` from `polygw_client_keys` (`None`: the database has no such
/// table): the name, `(revoked)` after a revoked key's, and a key the table does not
/// hold says so.
pub(crate) fn name_keys(sum: &mut Summary, names: Option<&[KeyName]>) {
    sum.key_table = Some(names.is_some());
    let Some(names) = names else {
        return;
    };
    for k in &mut sum.keys {
        let Some(id) = &k.id else {
            continue;
        };
        k.name = match names.iter().find(|n| &n.id == id) {
            Some(n) if n.revoked => format!("{} (revoked)", n.name),
            Some(n) => n.name.clone(),
            None => "(not in polygw_client_keys)".into(),
        };
    }
}

/// A cost that needs prices: "prices unknown" for a source the configuration does not
/// price, "unknown" for a cost that could not be computed.
fn priced_money(priced: bool, v: Option<f64>) -> String {
    if priced {
        money(v)
    } else {
        "prices unknown".into()
    }
}

/// A cost range: `low–high`, or `≥ low` without an upper bound.
fn range(r: polygw::core::telemetry::CostRange) -> String {
    match r.high {
        Some(h) if h == r.low => money(Some(h)),
        Some(h) => format!("{}–{}", money(Some(r.low)), money(Some(h))),
        None => format!("≥ {}", money(Some(r.low))),
    }
}

/// Control characters (terminal escapes, newlines in details) shown as `?` in text.
fn clean(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// The heading lines shared by the text and HTML outputs.
pub(crate) fn heading_lines(sum: &Summary, ctx: &Context) -> Vec<String> {
    let range = match (sum.first_ms, sum.last_ms) {
        (Some(a), Some(b)) => format!("{} to {}", iso(a), iso(b)),
        _ => "—".into(),
    };
    vec![
        format!("Database: {}", ctx.db),
        format!("Filter: {}", ctx.filter_text()),
        format!(
            "Rows: {} ({} attempts, {} cache hits, {} terminal failures)",
            sum.rows, sum.kinds[0], sum.kinds[1], sum.kinds[2]
        ),
        format!("Time range covered (created_at, UTC): {range}"),
        format!("Prices: {}", ctx.prices),
    ]
}

/// The whole text report (without the HTML line).
pub(crate) fn render_text(sum: &Summary, ctx: &Context) -> String {
    let mut out = String::from("polygw report\n");
    for l in heading_lines(sum, ctx) {
        out.push_str(&clean(&l));
        out.push('\n');
    }
    for s in sections(sum) {
        out.push('\n');
        out.push_str(s.title);
        out.push('\n');
        let mut t = Table::new(s.headers.iter().copied());
        for r in &s.rows {
            t.row(r.iter().map(|c| clean(c)));
        }
        if t.is_empty() {
            out.push_str(&format!("  ({})\n", s.empty));
        } else if s.as_lines {
            for r in &s.rows {
                let cells: Vec<String> = r.iter().map(|c| clean(c)).collect();
                out.push_str(&format!("  {}\n", cells.join("  ")));
            }
        } else {
            out.push_str(&t.render());
        }
    }
    out.push('\n');
    out.push_str(&gap_line(sum, ctx));
    out.push('\n');
    out
}

/// The message for no rows at all, naming what was asked.
fn empty_message(ctx: &Context, scopes_present: &BTreeSet<String>) -> String {
    let mut m = format!("No telemetry rows in {}", ctx.db);
    if let Some((d, bound)) = ctx.since {
        m.push_str(&format!(" since {} ({})", format_since(d), iso(bound)));
    }
    if let Some(s) = &ctx.scope {
        m.push_str(&format!(" for scope {s}"));
        if !scopes_present.is_empty() {
            let list: Vec<&str> = scopes_present.iter().map(String::as_str).collect();
            m.push_str(&format!(" (scopes present: {})", list.join(", ")));
        }
    }
    m.push_str(": nothing to report.");
    clean(&m)
}

/// The prices of the scopes in `scopes`, from the configuration in the environment
/// (the same keys `polygw serve` reads), and a line saying where they came from. A scope
/// the environment does not configure (or configures wrongly) has none; nothing of the
/// configuration is printed but scope names.
fn price_book(scopes: &BTreeSet<String>) -> (stats::PriceBook, String) {
    let mut book = stats::PriceBook::new();
    let (mut from_env, mut missing) = (Vec::new(), Vec::new());
    for scope in scopes {
        let loaded = crate::env::kind_of(scope).and_then(|k| crate::env::load(scope, k));
        match loaded {
            Ok(l) => {
                for src in &l.settings.sources {
                    book.insert(
                        (scope.clone(), src.name.clone()),
                        stats::SourcePrices {
                            prices: polygw::core::telemetry::TokenPrices::of(src),
                            allowance: src.effective_est_tokens(l.settings.limits.tpm),
                        },
                    );
                }
                from_env.push(scope.as_str());
            }
            Err(_) => missing.push(scope.as_str()),
        }
    }
    (book, prices_line(&from_env, &missing))
}

/// The heading's prices line.
fn prices_line(from_env: &[&str], missing: &[&str]) -> String {
    let mut parts = Vec::new();
    if !from_env.is_empty() {
        parts.push(format!(
            "from the configuration in the environment for {}",
            from_env.join(", ")
        ));
    }
    if !missing.is_empty() {
        parts.push(format!(
            "unknown for {} (not configured in the environment: savings and gap costs not \
             computed)",
            missing.join(", ")
        ));
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join("; ")
    }
}

pub async fn run(args: ReportArgs) -> anyhow::Result<ExitCode> {
    if let Some(id) = &args.call {
        return call::run(&args, id).await;
    }
    let db = redact_url(&args.db);
    let now = now_unix_ms();
    let since = args.since.map(|d| {
        let back = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        (d, now.saturating_sub(back))
    });
    let reader = polygw::telemetry::TelemetryReader::connect(&args.db)
        .await
        .with_context(|| format!("cannot read telemetry rows from {db}"))?;
    let read = reader.rows(since.map(|(_, b)| b)).await;
    // Names only for the keys the rows were charged to.
    let names = match &read {
        Ok(rows) if rows.iter().any(|r| r.client_key_id.is_some()) => key_names(&reader, &db).await,
        _ => None,
    };
    reader.close().await;
    let rows = read.with_context(|| format!("cannot read telemetry rows from {db}"))?;
    let scopes_present: BTreeSet<String> = rows.iter().map(|r| r.scope.to_string()).collect();
    let rows: Vec<_> = match &args.scope {
        Some(s) => rows
            .into_iter()
            .filter(|r| r.scope.eq_ignore_ascii_case(s))
            .collect(),
        None => rows,
    };
    let row_scopes: BTreeSet<String> = rows.iter().map(|r| r.scope.to_string()).collect();
    let (book, prices) = price_book(&row_scopes);
    let mut ctx = Context {
        db,
        since,
        scope: args.scope.clone(),
        generated_ms: now,
        db_gap: 0,
        prices,
    };

    let body = if rows.is_empty() {
        let msg = empty_message(&ctx, &scopes_present);
        println!("{msg}");
        html::render_empty(&ctx, &msg)
    } else {
        ctx.db_gap = polygw::telemetry::accounting_gap(&args.db)
            .await
            .with_context(|| format!("cannot count the accounting gap in {}", ctx.db))?;
        let mut sum = stats::summarize_priced(&rows, &book);
        if let Some(names) = &names {
            name_keys(&mut sum, names.as_deref());
        }
        print!("{}", render_text(&sum, &ctx));
        let scatter = stats::scatter(&rows, MAX_SCATTER_POINTS);
        let ids: Vec<String> = sum
            .slowest
            .iter()
            .map(|c| c.logical_call_id.clone())
            .collect();
        let timelines = timeline::timelines_of(&rows, &ids);
        html::render(&sum, &scatter, &timelines, &ctx)
    };

    if let Some(path) = &args.html {
        tokio::fs::write(path, body)
            .await
            .with_context(|| format!("cannot write the HTML report to {}", path.display()))?;
        println!("HTML report: {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::stats::tests::fixture;
    use super::*;
    use polygw_testkit::text::cells;

    #[test]
    fn since_accepts_the_four_units() {
        let cases = [
            ("90s", 90),
            ("30m", 1_800),
            ("2h", 7_200),
            ("7d", 604_800),
            ("1s", 1),
            ("36500d", MAX_SINCE_SECS),
        ];
        for (text, secs) in cases {
            assert_eq!(parse_since(text), Ok(Duration::from_secs(secs)), "{text}");
            assert_eq!(format_since(Duration::from_secs(secs)), text, "{text}");
        }
        assert_eq!(format_since(Duration::from_secs(120)), "2m");
    }

    #[test]
    fn since_rejects_everything_else() {
        for bad in [
            "",
            "h",
            "2",
            "2x",
            "2H",
            "1.5h",
            "-2h",
            "+2h",
            " 2h",
            "2h ",
            "2 h",
            "2hh",
            "0m",
            "٣m",
            "36501d",
            "99999999999999999999s",
            "2ms",
            "1w",
        ] {
            assert!(parse_since(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_since("2x").unwrap_err().contains("s, m, h or d"));
    }

    #[test]
    fn bad_since_names_the_flag_and_the_value() {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: ReportArgs,
        }
        let err = Cli::try_parse_from(["polygw", "--db", "sqlite://x.db", "--since", "5x"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--since"), "{err}");
        assert!(err.contains("'5x'"), "{err}");
        let ok = Cli::try_parse_from(["polygw", "--db", "sqlite://x.db", "--since", "2h"]).unwrap();
        assert_eq!(ok.args.since, Some(Duration::from_secs(7_200)));
    }

    #[test]
    fn iso_times() {
        assert_eq!(iso(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso(1_796_210_528_123), "2026-12-02T11:22:08.123Z");
        assert_eq!(iso(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(iso(-1), "1969-12-31T23:59:59.999Z");
    }

    fn ctx(since: Option<(Duration, i64)>, scope: Option<&str>, db_gap: u64) -> Context {
        Context {
            db: "sqlite://t.db".into(),
            since,
            scope: scope.map(str::to_string),
            generated_ms: 100_000,
            db_gap,
            prices: "none".into(),
        }
    }

    #[test]
    fn gap_line_says_which_count() {
        let sum = stats::summarize(&fixture());
        let whole = gap_line(&sum, &ctx(None, None, 5));
        assert_eq!(
            whole,
            "Accounting gap: 5 attempts with usage unavailable (SPEC §8 query, whole database)."
        );
        let raced = gap_line(&sum, &ctx(None, None, 7));
        assert!(raced.contains("7 attempts") && raced.contains("5 among the rows read"));
        let filtered = gap_line(
            &sum,
            &ctx(Some((Duration::from_secs(60), 0)), Some("LLM"), 9),
        );
        assert!(
            filtered.starts_with("Accounting gap: 5 attempts"),
            "{filtered}"
        );
        assert!(filtered.contains("since 1m"), "{filtered}");
        assert!(filtered.contains("scope LLM"), "{filtered}");
        assert!(filtered.contains("9 in the whole database"), "{filtered}");
    }

    #[test]
    fn text_report_shows_every_table() {
        let sum = stats::summarize(&fixture());
        let text = render_text(&sum, &ctx(None, None, 5));
        for want in [
            "Database: sqlite://t.db",
            "Filter: none (every row)",
            "Rows: 10 (8 attempts, 1 cache hits, 1 terminal failures)",
            "1970-01-01T00:00:10.000Z to 1970-01-01T00:01:00.000Z",
            "Sources",
            "Errors by label",
            "Tokens and cost",
            "Calls per scope",
            "Hedging per scope",
            "Failed calls by terminal reason",
            "Most frequent error details",
            "1×  LLM/b-0  server_error  HTTP 502 <bad gateway>",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        let line = |title: &str, prefix: &str| cells(&text, title, prefix);
        // Sources row of a-0: 4 attempts, 2 ok, 2 failed, p50 2000 ms, …, stall 50 %.
        assert_eq!(
            line("Sources", "LLM/a-0 ")[..10],
            [
                "LLM/a-0", "4", "2", "2", "2000 ms", "4000 ms", "4000 ms", "300 ms", "300 ms",
                "50.0 %"
            ]
        );
        // Hedging: 4 calls reached a source, 2 hedged (50 %), 1 won by the leg (50 %).
        assert_eq!(
            line("Hedging per scope", "LLM ")[..],
            ["LLM", "4", "2", "50.0 %", "1", "50.0 %", "2", "40.0 %"]
        );
        // Tokens and cost of the scope: the unknowns are counted, not added as 0.
        let scope = line("Tokens and cost", "LLM (scope, with cache hits)");
        assert_eq!(scope[1..], ["3/8", "300", "150", "0", "0.006000", "5", "5"]);
        // OCR priced per call: 0/0 tokens measured, the call's price, no gap.
        let ocr = line("Tokens and cost", "OCR/ocr-0");
        assert_eq!(ocr[1..], ["1/1", "0", "0", "0", "0.010000", "0", "0"]);
        let calls = line("Calls per scope", "LLM ");
        assert_eq!(calls[1..7], ["chat", "5", "4", "1", "0", "1"]);
        let failed = line("Failed calls by terminal reason", "LLM ");
        assert_eq!(failed[1..], ["retry_exhausted", "1", "1500 ms", "1500 ms"]);
        assert!(text.ends_with("(SPEC §8 query, whole database).\n"));
    }

    #[test]
    fn text_report_shows_the_prompt_cache_and_the_gap() {
        let (rows, book) = stats::tests::cache_rows();
        let sum = stats::summarize_priced(&rows, &book);
        let mut c = ctx(None, None, 1);
        c.prices = prices_line(&["LLM"], &["OTHER"]);
        let text = render_text(&sum, &c);
        let line = |title: &str, prefix: &str| cells(&text, title, prefix);
        assert!(text.contains(
            "Prices: from the configuration in the environment for LLM; unknown for OTHER"
        ));
        assert_eq!(
            line("Prompt cache", "LLM/a-0 ")[1..],
            ["1/3", "3000", "600", "300", "20.0 %", "0.000750"]
        );
        assert_eq!(
            line("Prompt cache", "LLM/b-0 ")[1..],
            ["1/1", "500", "250", "0", "50.0 %", "prices unknown"]
        );
        assert_eq!(
            line("Accounting gap", "LLM/a-0 ")[1..],
            [
                "2",
                "1",
                "2000",
                "25",
                "0.000200–0.006800",
                "0.003410",
                "0.003610–0.010210",
                "1"
            ]
        );
        let b = line("Accounting gap", "LLM/b-0 ");
        assert_eq!(b[5], "0.000000");
        assert!(b[6].contains("+1 unpriced rows"), "{b:?}");
        assert_eq!(b[7], "prices unknown");
        assert_eq!(
            prices_line(&[], &[]),
            "none",
            "no scope: nothing to say but that"
        );
    }

    #[test]
    fn text_has_no_control_characters_from_the_data() {
        let mut rows = fixture();
        rows[0].source = Some("evil\u{1b}[31m-0".into());
        rows[0].error_detail = Some("two\nlines".into());
        let text = render_text(&stats::summarize(&rows), &ctx(None, None, 5));
        assert!(!text.contains('\u{1b}'));
        assert!(text.contains("evil?[31m-0"));
        assert!(text.contains("two?lines"));
    }

    #[test]
    fn text_report_shows_spend_per_key_and_the_slowest_calls() {
        let mut sum = stats::summarize(&stats::tests::keyed_fixture());
        name_keys(
            &mut sum,
            Some(&[KeyName {
                id: "key_a".into(),
                name: "team-a".into(),
                revoked: true,
            }]),
        );
        let text = render_text(&sum, &ctx(None, None, 5));
        let line = |title: &str, prefix: &str| cells(&text, title, prefix);
        assert_eq!(
            line("Spend per client key", "key_a ")[1..],
            [
                "team-a (revoked)",
                "1",
                "0",
                "1/2",
                "100",
                "50",
                "0.002000",
                "1"
            ]
        );
        assert_eq!(
            line("Spend per client key", "key_b ")[1..],
            [
                "(not in polygw_client_keys)",
                "1",
                "1",
                "0/2",
                "—",
                "—",
                "unknown",
                "2"
            ]
        );
        assert_eq!(
            line("Spend per client key", NO_KEY)[1..],
            ["—", "4", "0", "3/5", "200", "100", "0.014000", "2"]
        );
        assert_eq!(
            line("Slowest calls", "c1 ")[1..],
            [
                "LLM",
                "1400 ms",
                "1",
                "2",
                "0",
                "1",
                "answered by r1·L1 (b-0, resume)"
            ]
        );
        // Without the table: ids only, and the note says why.
        let mut sum = stats::summarize(&stats::tests::keyed_fixture());
        name_keys(&mut sum, None);
        let text = render_text(&sum, &ctx(None, None, 5));
        assert_eq!(sum.key_table, Some(false));
        assert!(sum.keys.iter().all(|k| k.name.is_empty()));
        assert!(text.contains("key_a "), "{text}");
        let plain = render_text(&stats::summarize(&fixture()), &ctx(None, None, 5));
        assert!(
            plain.contains("(no call was charged to a client key)"),
            "{plain}"
        );
        assert!(
            plain.contains("(no row carries a decision trace)"),
            "{plain}"
        );
    }

    #[test]
    fn call_conflicts_with_the_filters() {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: ReportArgs,
        }
        let ok = Cli::try_parse_from(["polygw", "--db", "sqlite://x.db", "--call", "c1"]).unwrap();
        assert_eq!(ok.args.call.as_deref(), Some("c1"));
        for flag in [["--since", "1h"], ["--scope", "LLM"]] {
            let err = Cli::try_parse_from([
                "polygw",
                "--db",
                "sqlite://x.db",
                "--call",
                "c1",
                flag[0],
                flag[1],
            ])
            .unwrap_err()
            .to_string();
            assert!(err.contains("cannot be used with"), "{err}");
        }
    }

    #[test]
    fn empty_message_names_the_filter() {
        let present = BTreeSet::from(["LLM".to_string(), "OCR".to_string()]);
        let m = empty_message(&ctx(None, Some("EMBED"), 0), &present);
        assert_eq!(
            m,
            "No telemetry rows in sqlite://t.db for scope EMBED (scopes present: LLM, OCR): \
             nothing to report."
        );
        let m = empty_message(
            &ctx(Some((Duration::from_secs(7_200), 0)), None, 0),
            &present,
        );
        assert!(m.contains("since 2h (1970-01-01T00:00:00.000Z)"), "{m}");
    }
}
