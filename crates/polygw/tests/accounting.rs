//! Prompt-cache pricing and the accounting gap end to end (SPEC §20.1, §20.4; issue 25):
//! `GatewayClient` over the real transport against mock upstreams that simulate a
//! provider prefix cache and keep a billing log (every prompt they accepted, every token
//! generated before the connection closed, at their prices), telemetry in SQLite, and
//! the books computed from the rows read back at the configuration's prices — the
//! figures `polygw report` shows (`core::telemetry::Accounts`).
//!
//! - every row measured → each row's cost is its billing entry's cost bit for bit, and
//!   the sum of the rows' costs is the invoice's total, in each cache dialect;
//! - hedge losers cancelled, cut legs, replayed and prefilled resumes, retries → the
//!   provider's invoice lies within the report's range (the reported cost plus the gap
//!   from `est_prompt_tokens` / `est_received_tokens`).
//!
//! The mock's content chunks here are four-byte words, one token each in the mock's
//! count and in the gateway's estimate (a token per 4 bytes), so the lower bound (what
//! was received) is exact; prompts are counted by the gateway at least as high as by
//! the mock (a token per 4 bytes of each message, plus 4 per message), and every planned
//! answer is shorter than `EST_TOKENS`, so the upper bound holds. Real time, short
//! durations; nothing waits for a window to pass.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use polygw::core::config::load_scope;
use polygw::core::telemetry::{Accounts, RowKind, TokenPrices};
use polygw::core::TelemetryRow;
use polygw::{ChatRequest, DeltaSink, GatewayClient, Message, ScopeKind, StreamDelta, UsageSource};
use polygw_mock_upstream::{
    Behavior, CacheDialect, Fault, Invoice, MockConfig, MockUpstream, PrefixCache, Prices, Stall,
};

/// The prices of every mock and every source: input, output, cached input, cache write.
const PRICES: [(&str, &str); 4] = [
    ("INPUT_PRICE", "2"),
    ("OUTPUT_PRICE", "8"),
    ("CACHED_INPUT_PRICE", "0.5"),
    ("CACHE_WRITE_PRICE", "2.5"),
];

/// `EST_TOKENS` of every source: above every planned answer.
const EST_TOKENS: u64 = 400;

fn mock_prices() -> Prices {
    Prices::new(2.0, 8.0)
        .with_cached_input(0.5)
        .with_cache_write(2.5)
}

async fn mock(cache: Option<CacheDialect>) -> MockUpstream {
    MockUpstream::start(MockConfig {
        prices: Some(mock_prices()),
        prefix_cache: cache.map(|d| PrefixCache::new(d).with_blocks(16, 32)),
        ..MockConfig::default()
    })
    .await
    .expect("mock")
}

/// `n` content chunks of four bytes (one token each, in both counts).
fn words(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("w{:02} ", i % 100)).collect()
}

fn answer(n: usize) -> Behavior {
    Behavior {
        chunks: words(n),
        ..Behavior::default()
    }
}

/// A long system prompt (shared: the prefix cache reads it back) and a question.
fn request(question: &str, stream: bool) -> ChatRequest {
    let system = "You are the polygw accounting assistant. ".repeat(24);
    ChatRequest::new(vec![Message::system(system), Message::user(question)]).with_stream(stream)
}

struct Setup {
    vars: Vec<(String, String)>,
    db: String,
    _dir: tempfile::TempDir,
}

/// Keys, as (`FIELD`, value).
type Keys<'a> = &'a [(&'a str, &'a str)];

/// Scope `LLM` over `sources` (name, mock, priority, extra source keys), priced, with
/// telemetry in a fresh SQLite file, and these scope keys.
fn setup(sources: &[(&str, &MockUpstream, u32, Keys<'_>)], scope: Keys<'_>) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("t.db").display());
    let mut vars = vec![("LLM__TELEMETRY__URL".to_string(), db.clone())];
    for (name, m, prio, extra) in sources {
        let p = format!("LLM__{}__0__", name.to_uppercase());
        let mut kv = vec![
            ("BASE_URL", m.base_url()),
            ("API_KEY", format!("sk-{name}-secret")),
            ("MODEL", format!("model-{name}")),
            ("PRIORITY", prio.to_string()),
            ("EST_TOKENS", EST_TOKENS.to_string()),
        ];
        kv.extend(PRICES.iter().map(|(k, v)| (*k, v.to_string())));
        kv.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
        vars.extend(kv.into_iter().map(|(k, v)| (format!("{p}{k}"), v)));
    }
    vars.extend(
        scope
            .iter()
            .map(|(k, v)| (format!("LLM__{k}"), v.to_string())),
    );
    Setup {
        vars,
        db,
        _dir: dir,
    }
}

impl Setup {
    async fn client(&self) -> GatewayClient {
        GatewayClient::from_vars(self.vars.clone(), "LLM")
            .await
            .expect("client")
    }

    /// Shuts the client down (telemetry flushed) and reads the attempt rows back.
    async fn rows(&self, c: GatewayClient) -> Vec<TelemetryRow> {
        let report = c.shutdown().await;
        assert_eq!(report.dropped, 0);
        polygw::telemetry::read_rows(&self.db, None)
            .await
            .unwrap()
            .into_iter()
            .filter(|r| r.kind == RowKind::Attempt)
            .collect()
    }

    /// The books per source at the configuration's prices, as `polygw report` keeps
    /// them.
    fn books(&self, rows: &[TelemetryRow]) -> BTreeMap<String, Accounts> {
        let l = load_scope(self.vars.clone(), "LLM", ScopeKind::Chat).unwrap();
        let mut books = BTreeMap::new();
        for src in &l.settings.sources {
            let prices = TokenPrices::of(src);
            let allowance = src.effective_est_tokens(l.settings.limits.tpm);
            assert_eq!(allowance, EST_TOKENS);
            let mut a = Accounts::new();
            for r in rows
                .iter()
                .filter(|r| r.source.as_deref() == Some(&src.name))
            {
                a.add(r, Some(&prices), allowance);
            }
            books.insert(src.name.clone(), a);
        }
        books
    }
}

/// A passthrough caller that reads nothing.
struct Discard;

impl DeltaSink for Discard {
    fn send(&self, _delta: StreamDelta) {}
}

/// The invoice of a mock once every request sent to it has ended (`attempts`: the
/// attempt rows of its source; each sent at most one request).
async fn invoice(m: &MockUpstream, attempts: usize) -> Invoice {
    let billed = m.wait_for_billed(attempts, Duration::from_secs(10)).await;
    assert_eq!(billed.len(), attempts, "every attempt reached the mock");
    m.invoice()
}

/// Checks that the provider's bill lies within the report's range for every source,
/// and prints the figures.
async fn assert_within_range(
    what: &str,
    s: &Setup,
    rows: &[TelemetryRow],
    mocks: &[(&str, &MockUpstream)],
) -> (u64, u64) {
    let books = s.books(rows);
    let (mut gap_rows, mut estimated) = (0, 0);
    for (name, m) in mocks {
        let src = format!("{name}-0");
        let n = rows
            .iter()
            .filter(|r| r.source.as_deref() == Some(&src))
            .count();
        let inv = invoice(m, n).await;
        let total = inv.total.expect("priced mock");
        let a = &books[&src];
        let range = a.invoice_range().expect("every row priced");
        eprintln!(
            "{what}: {src}: {n} attempts, {} in the gap ({} unavailable), est. prompt {} / \
             received {}; reported {:.9}, invoice range {:.9}–{:.9}, billed {total:.9}",
            a.gap_rows,
            a.gap_unavailable,
            a.est_prompt_tokens,
            a.est_received_tokens,
            a.reported_cost,
            range.low,
            range.high.unwrap(),
        );
        assert!(
            range.contains(total),
            "{what}: {src}: the provider billed {total}, outside {range:?}\nrows: \
             {rows:#?}\ninvoice: {inv:#?}"
        );
        gap_rows += a.gap_rows;
        estimated += a.gap_rows - a.gap_unavailable;
        // Rows billed as reported cost exactly what the provider billed for them.
        for r in rows.iter().filter(|r| r.source.as_deref() == Some(&src)) {
            let e = inv.by_call_id(&r.call_id);
            if r.est_prompt_tokens.is_none() && r.usage_source != UsageSource::Unavailable {
                assert_eq!(r.cost, e.and_then(|e| e.cost), "{what}: {r:#?}");
            }
        }
    }
    (gap_rows, estimated)
}

/// The estimate columns are filled exactly on the rows the provider did not measure,
/// and an estimated row's estimate is its token columns.
fn assert_estimate_columns(rows: &[TelemetryRow]) {
    for r in rows {
        match r.usage_source {
            UsageSource::Measured => {
                assert_eq!(
                    (r.est_prompt_tokens, r.est_received_tokens),
                    (None, None),
                    "{r:#?}"
                )
            }
            UsageSource::Estimated => {
                assert_eq!(r.est_prompt_tokens, r.prompt_tokens, "{r:#?}");
                assert_eq!(r.est_received_tokens, r.completion_tokens, "{r:#?}");
            }
            UsageSource::Unavailable => {
                assert!(r.est_prompt_tokens.is_some(), "{r:#?}");
                assert_eq!(
                    (r.prompt_tokens, r.completion_tokens, r.cost),
                    (None, None, None),
                    "{r:#?}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measured_rows_cost_exactly_what_the_provider_bills_in_every_cache_dialect() {
    for dialect in [
        CacheDialect::Openai,
        CacheDialect::Deepseek,
        CacheDialect::Anthropic,
    ] {
        let a = mock(Some(dialect)).await;
        a.set_default(answer(12));
        let s = setup(&[("a", &a, 0, &[])], &[]);
        let c = s.client().await;
        let mut cached_calls = 0;
        for (i, q) in [
            "first",
            "second question",
            "third",
            "fourth one",
            "fifth",
            "sixth",
        ]
        .iter()
        .enumerate()
        {
            let r = c.chat(request(q, i % 2 == 1)).await.unwrap();
            assert_eq!(r.usage_source, UsageSource::Measured);
            cached_calls += usize::from(r.usage.cached_prompt_tokens.unwrap_or(0) > 0);
        }
        let rows = s.rows(c).await;
        let inv = invoice(&a, 6).await;
        assert_eq!(rows.len(), 6);
        assert!(
            cached_calls >= 5,
            "{dialect:?}: the shared prefix was read back"
        );
        // Row by row, in the invoice's order: the same tokens and the same cost, bit
        // for bit; so the sums agree exactly.
        let mut sum = 0.0;
        for e in &inv.entries {
            let r = rows
                .iter()
                .find(|r| Some(&r.call_id) == e.call_id.as_ref())
                .unwrap();
            assert_eq!(r.usage_source, UsageSource::Measured);
            assert_eq!(r.prompt_tokens, Some(e.prompt_tokens), "{dialect:?}");
            assert_eq!(r.completion_tokens, Some(e.completion_tokens));
            assert_eq!(r.cached_prompt_tokens, Some(e.cached_tokens), "{dialect:?}");
            let write = (dialect == CacheDialect::Anthropic).then_some(e.cache_write_tokens);
            assert_eq!(r.cache_write_tokens, write, "{dialect:?}");
            assert_eq!((r.est_prompt_tokens, r.est_received_tokens), (None, None));
            assert_eq!(r.cost, e.cost, "{dialect:?}: {r:#?} vs {e:#?}");
            sum += r.cost.unwrap();
        }
        assert_eq!(Some(sum), inv.total, "{dialect:?}");
        let (prompt, cached, write, _) = inv.tokens();
        eprintln!(
            "{dialect:?}: 6 measured calls, prompt {prompt} tokens ({cached} cached, {write} \
             written), Σ cost {sum:.9} = billed {:.9}",
            inv.total.unwrap()
        );
        let books = s.books(&rows);
        let a0 = &books["a-0"];
        assert_eq!(
            (a0.reported_rows, a0.gap_rows, a0.not_billed_rows),
            (6, 0, 0)
        );
        let range = a0.invoice_range().unwrap();
        assert!((range.low - sum).abs() <= sum * 1e-12 && range.high == Some(range.low));
        a.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_hedge_losers_bill_lies_within_the_reports_range() {
    let (a, b) = (
        mock(Some(CacheDialect::Openai)).await,
        mock(Some(CacheDialect::Openai)).await,
    );
    // The primary is slow to its first token: a first-token hedge on b wins, and a is
    // cancelled while generating (plain) or before its first chunk (stream).
    a.set_default(Behavior {
        ttft_ms: 3_000.0,
        gap_ms: 20.0,
        ..answer(30)
    });
    b.set_default(answer(10));
    let s = setup(
        &[("a", &a, 0, &[]), ("b", &b, 1, &[])],
        &[
            ("HEDGE__AFTER_S", "0.1"),
            ("HEDGE__STALL_AFTER_S", "0.2"),
            ("HEDGE__BUDGET_PCT", "0"),
        ],
    );
    let c = s.client().await;
    for (i, stream) in [true, false, true, false].into_iter().enumerate() {
        let r = c
            .chat(request(&format!("question {i}"), stream))
            .await
            .unwrap();
        assert_eq!((r.source.as_str(), r.call_stats.hedge_won), ("b-0", true));
    }
    // A stall hedge: a streams 6 chunks then stalls; another leg answers; a, cancelled,
    // has received text (its row is unavailable or estimated, as the answer holds it or
    // not).
    a.set_default(Behavior {
        stalls: vec![Stall {
            before_chunk: 6,
            ms: 5_000.0,
        }],
        ..answer(30)
    });
    let r = c.chat(request("a stalled question", true)).await.unwrap();
    assert!(r.call_stats.hedges >= 1, "{:?}", r.call_stats);
    let rows = s.rows(c).await;
    assert_estimate_columns(&rows);
    let losers: Vec<&TelemetryRow> = rows
        .iter()
        .filter(|r| r.error.as_deref() == Some("hedge_cancelled"))
        .collect();
    assert!(losers.len() >= 4, "{rows:#?}");
    assert!(losers.iter().all(|r| r.est_prompt_tokens.is_some()));
    let (gap, _) = assert_within_range("hedged", &s, &rows, &[("a", &a), ("b", &b)]).await;
    assert!(gap >= 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_and_resumed_calls_bill_within_the_reports_range() {
    // a cuts every answer after 8 of its 24 chunks; b answers the same text (a replay
    // reproduces it; a prefill continues it).
    let cut = || Behavior {
        fault: Some(Fault::ResetAfter { chunks: 8 }),
        gap_ms: 5.0,
        ..answer(24)
    };
    for (what, b_keys, scope) in [
        ("replayed", &[][..], &[][..]),
        ("prefilled", &[("PREFILL", "prefix")][..], &[][..]),
        ("retried", &[][..], &[("STREAM__MAX_RESUMES", "0")][..]),
    ] {
        let (a, b) = (
            mock(Some(CacheDialect::Anthropic)).await,
            mock(Some(CacheDialect::Anthropic)).await,
        );
        a.set_default(cut());
        b.set_default(answer(24));
        let s = setup(&[("a", &a, 0, &[]), ("b", &b, 1, b_keys)], scope);
        let c = s.client().await;
        let want: String = words(24).concat();
        for i in 0..3 {
            let r = c
                .chat(request(&format!("{what} question {i}"), true))
                .await
                .unwrap();
            assert_eq!(r.content, want, "{what}");
            assert_eq!(r.source, "b-0");
        }
        // Passthrough: the cut leg's 8 chunks reached the caller; a resume leg
        // continues the stream (without resumes the call cannot go on after them).
        let calls = if what == "retried" {
            3
        } else {
            let r = c
                .chat_streaming(
                    request(&format!("{what} streamed"), true),
                    Arc::new(Discard),
                )
                .await
                .unwrap();
            assert_eq!(r.content, want, "{what}");
            4
        };
        let rows = s.rows(c).await;
        assert_estimate_columns(&rows);
        let cut_rows: Vec<&TelemetryRow> = rows
            .iter()
            .filter(|r| r.source.as_deref() == Some("a-0"))
            .collect();
        assert_eq!(cut_rows.len(), calls, "{what}");
        for r in &cut_rows {
            // A leg cut after 8 four-byte chunks: 8 tokens received. With resume on the
            // round keeps its text: the row is estimated from it (decision 66); without,
            // it is unavailable and its estimate counts a token per chunk.
            let source = if what == "retried" {
                UsageSource::Unavailable
            } else {
                UsageSource::Estimated
            };
            assert_eq!(r.usage_source, source, "{what}: {r:#?}");
            assert_eq!(r.est_received_tokens, Some(8), "{what}");
        }
        if what == "prefilled" {
            assert!(rows
                .iter()
                .any(|r| r.resume_mode.as_deref() == Some("prefill")));
        }
        let (gap, estimated) = assert_within_range(what, &s, &rows, &[("a", &a), ("b", &b)]).await;
        let want = if what == "retried" { 0 } else { calls as u64 };
        assert_eq!((gap, estimated), (calls as u64, want), "{what}");
        a.shutdown().await;
        b.shutdown().await;
    }
}
