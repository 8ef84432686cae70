//! The billing log: what a real provider would bill for each chat request the mock
//! accepted — the prompt (cached and cache-write parts included) and the completion
//! tokens generated before the response ended, however it ended — and what that costs
//! at the mock's prices.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::cache::CacheDialect;
use crate::record::EndKind;

/// A mock's prices, in currency units per 1 000 000 tokens (`MockConfig::prices`,
/// `MockUpstream::set_prices`). JSON: `{"input", "output", "cached_input",
/// "cache_write"}`; the last two default to `input` (as SPEC §20.1's source keys).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    /// Uncached prompt tokens.
    pub input: f64,
    /// Completion tokens (reasoning included).
    pub output: f64,
    /// Prompt tokens read from the cache (default: `input`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input: Option<f64>,
    /// Prompt tokens written to the cache, where the dialect bills writes
    /// (`anthropic`; default: `input`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write: Option<f64>,
}

impl Prices {
    /// Input and output prices (cached input and cache writes at the input price).
    pub fn new(input: f64, output: f64) -> Self {
        Prices {
            input,
            output,
            cached_input: None,
            cache_write: None,
        }
    }

    /// These prices with a cached-input price.
    pub fn with_cached_input(mut self, price: f64) -> Self {
        self.cached_input = Some(price);
        self
    }

    /// These prices with a cache-write price.
    pub fn with_cache_write(mut self, price: f64) -> Self {
        self.cache_write = Some(price);
        self
    }

    /// What `e` costs at these prices:
    /// `(uncached·input + cached·cached_input + write·cache_write + completion·output)
    /// / 1e6`, summed in that order in `f64`, with `uncached = prompt − cached − write`.
    pub fn cost(&self, e: &BillingEntry) -> f64 {
        let uncached = e.uncached_prompt_tokens() as f64 * self.input;
        let cached = e.cached_tokens as f64 * self.cached_input.unwrap_or(self.input);
        let write = e.cache_write_tokens as f64 * self.cache_write.unwrap_or(self.input);
        let out = e.completion_tokens as f64 * self.output;
        (uncached + cached + write + out) / 1e6
    }

    /// Checks the prices are finite and ≥ 0.
    pub fn validate(&self) -> Result<(), String> {
        let all = [
            ("input", Some(self.input)),
            ("output", Some(self.output)),
            ("cached_input", self.cached_input),
            ("cache_write", self.cache_write),
        ];
        for (name, v) in all {
            if let Some(v) = v {
                if !v.is_finite() || v < 0.0 {
                    return Err(format!("prices.{name} = {v} must be a finite number ≥ 0"));
                }
            }
        }
        Ok(())
    }
}

/// What a provider would bill for one accepted chat request. Recorded when its
/// response ends (any way: complete, cut by a fault, the client gone, the server shut
/// down).
#[derive(Debug, Clone, PartialEq)]
pub struct BillingEntry {
    /// The request's sequence number ([`crate::RecordedRequest::id`]).
    pub id: u64,
    /// Its `x-polygw-call-id` header ([`crate::RecordedRequest::call_id`]).
    pub call_id: Option<String>,
    /// The request's `model`.
    pub model: Option<String>,
    /// Whether it was a streamed request.
    pub stream: bool,
    /// Prompt tokens billed (the `prompt_tokens` reported, or that would have been).
    /// Cached and cache-write tokens are part of it.
    pub prompt_tokens: u64,
    /// Of those, tokens read from the prefix cache.
    pub cached_tokens: u64,
    /// Of those, tokens written to the prefix cache at the write price (only the
    /// `anthropic` dialect bills writes; 0 otherwise).
    pub cache_write_tokens: u64,
    /// Completion tokens generated before the response ended (see the docs: every
    /// incremental chunk whose time had come, in the mock's count).
    pub completion_tokens: u64,
    /// Whether every planned incremental chunk was generated.
    pub complete: bool,
    /// Whether the response carried usage (a usage frame, inline usage, or a plain
    /// body's `usage`) that was handed to the connection.
    pub usage_sent: bool,
    /// A verbatim body (`raw_sse`, `raw_sse_file`, `jsonl_file`, `raw_body`): the mock
    /// does not parse it; completion tokens are the behavior's `completion_tokens`
    /// (else 0).
    pub verbatim: bool,
    /// The dialect of the prefix cache, when one was on.
    pub cache_dialect: Option<CacheDialect>,
    /// How the response ended.
    pub end: EndKind,
    /// When it ended (tokio's clock).
    pub ended_at: Instant,
    /// The prices in force when the request was accepted.
    pub prices: Option<Prices>,
    /// Its cost at those prices ([`Prices::cost`]); `None` without prices.
    pub cost: Option<f64>,
}

impl BillingEntry {
    /// Prompt tokens neither read from nor written to the cache.
    pub fn uncached_prompt_tokens(&self) -> u64 {
        self.prompt_tokens
            .saturating_sub(self.cached_tokens)
            .saturating_sub(self.cache_write_tokens)
    }
}

/// The billing log with its costs.
#[derive(Debug, Clone, PartialEq)]
pub struct Invoice {
    /// Every entry, in the order the responses ended.
    pub entries: Vec<BillingEntry>,
    /// The sum of the entries' costs (in entry order); `None` when an entry has no
    /// price. `Some(0.0)` for no entry.
    pub total: Option<f64>,
}

impl Invoice {
    /// Builds the invoice of these entries.
    pub fn of(entries: Vec<BillingEntry>) -> Invoice {
        let total = entries
            .iter()
            .try_fold(0.0_f64, |acc, e| e.cost.map(|c| acc + c));
        Invoice { entries, total }
    }

    /// The entry of the request with this `x-polygw-call-id` (the last one, if several
    /// carried it).
    pub fn by_call_id(&self, call_id: &str) -> Option<&BillingEntry> {
        self.entries
            .iter()
            .rev()
            .find(|e| e.call_id.as_deref() == Some(call_id))
    }

    /// Prompt, cached, cache-write and completion tokens summed over every entry.
    pub fn tokens(&self) -> (u64, u64, u64, u64) {
        self.entries.iter().fold((0, 0, 0, 0), |a, e| {
            (
                a.0 + e.prompt_tokens,
                a.1 + e.cached_tokens,
                a.2 + e.cache_write_tokens,
                a.3 + e.completion_tokens,
            )
        })
    }
}

/// What the guard of an accepted chat request needs to bill it when it ends.
#[derive(Debug, Clone)]
pub(crate) struct BillState {
    pub(crate) call_id: Option<String>,
    pub(crate) model: Option<String>,
    pub(crate) stream: bool,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) cache_write_tokens: u64,
    /// The completion tokens of the whole planned answer.
    pub(crate) planned_completion: u64,
    /// Incremental chunks of the whole planned answer.
    pub(crate) planned_items: u32,
    pub(crate) verbatim: bool,
    pub(crate) cache_dialect: Option<CacheDialect>,
    pub(crate) prices: Option<Prices>,
}

impl BillState {
    /// The entry of a response that generated `generated` incremental chunks.
    pub(crate) fn entry(
        self,
        id: u64,
        generated: u32,
        usage_sent: bool,
        end: EndKind,
        ended_at: Instant,
    ) -> BillingEntry {
        let complete = generated >= self.planned_items;
        let completion_tokens = if complete {
            self.planned_completion
        } else {
            // Proportional to the chunks generated (= `generated` unless the behavior
            // sets its own `completion_tokens`).
            self.planned_completion * u64::from(generated) / u64::from(self.planned_items)
        };
        let mut e = BillingEntry {
            id,
            call_id: self.call_id,
            model: self.model,
            stream: self.stream,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            cache_write_tokens: self.cache_write_tokens,
            completion_tokens,
            complete,
            usage_sent,
            verbatim: self.verbatim,
            cache_dialect: self.cache_dialect,
            end,
            ended_at,
            prices: self.prices,
            cost: None,
        };
        e.cost = self.prices.map(|p| p.cost(&e));
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn state(planned_completion: u64, planned_items: u32) -> BillState {
        BillState {
            call_id: Some("c".into()),
            model: None,
            stream: true,
            prompt_tokens: 1_000,
            cached_tokens: 600,
            cache_write_tokens: 300,
            planned_completion,
            planned_items,
            verbatim: false,
            cache_dialect: Some(CacheDialect::Anthropic),
            prices: Some(
                Prices::new(2.0, 8.0)
                    .with_cached_input(0.5)
                    .with_cache_write(2.5),
            ),
        }
    }

    #[test]
    fn completion_counts_what_was_generated() {
        let t = crate::record::now();
        let e = state(10, 10).entry(1, 4, false, EndKind::ResetMidStream, t);
        assert_eq!((e.completion_tokens, e.complete), (4, false));
        let e = state(10, 10).entry(1, 10, true, EndKind::Completed, t);
        assert_eq!((e.completion_tokens, e.complete), (10, true));
        // An explicit completion_tokens scales with the share generated.
        let e = state(100, 8).entry(1, 2, false, EndKind::ClientDisconnected, t);
        assert_eq!(e.completion_tokens, 25);
        // Nothing planned: complete at once.
        let e = state(0, 0).entry(1, 0, true, EndKind::Completed, t);
        assert_eq!((e.completion_tokens, e.complete), (0, true));
    }

    #[test]
    fn cost_formula() {
        let t = crate::record::now();
        let e = state(10, 10).entry(1, 10, true, EndKind::Completed, t);
        assert_eq!(e.uncached_prompt_tokens(), 100);
        // 100·2 + 600·0.5 + 300·2.5 + 10·8 = 200 + 300 + 750 + 80 = 1330 → 0.00133
        assert_eq!(e.cost, Some(1330.0 / 1e6));
        let plain = Prices::new(2.0, 8.0);
        assert_eq!(plain.cost(&e), (1000.0 * 2.0 + 80.0) / 1e6);
        let mut unpriced = e.clone();
        unpriced.cost = None;
        let inv = Invoice::of(vec![e.clone(), e.clone()]);
        assert_eq!(inv.total, Some(2660.0 / 1e6));
        assert_eq!(inv.tokens(), (2000, 1200, 600, 20));
        assert_eq!(Invoice::of(vec![e, unpriced]).total, None);
        assert_eq!(Invoice::of(vec![]).total, Some(0.0));
    }

    #[test]
    fn prices_json() {
        let p: Prices = serde_json::from_value(json!({"input": 2, "output": 8})).unwrap();
        assert_eq!(p, Prices::new(2.0, 8.0));
        let p: Prices = serde_json::from_value(
            json!({"input": 2, "output": 8, "cached_input": 0.5, "cache_write": 2.5}),
        )
        .unwrap();
        assert_eq!(p.cached_input, Some(0.5));
        assert_eq!(
            serde_json::from_value::<Prices>(serde_json::to_value(p).unwrap()).unwrap(),
            p
        );
        assert!(serde_json::from_value::<Prices>(json!({"input": 1})).is_err());
        assert!(
            serde_json::from_value::<Prices>(json!({"input": 1, "output": 1, "x": 1})).is_err()
        );
        assert!(Prices::new(-1.0, 0.0).validate().is_err());
        assert!(p.validate().is_ok());
    }
}
