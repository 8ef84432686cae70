//! What a call returns: [`LlmResponse`], [`Usage`], [`UsageSource`], [`CallStats`].

use std::fmt;

use serde::{Deserialize, Serialize};

/// Token usage of one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Input tokens.
    pub prompt_tokens: u64,
    /// Output tokens (reasoning included, as providers count them).
    pub completion_tokens: u64,
    /// `completion_tokens_details.reasoning_tokens`, when the provider reports it.
    #[serde(default)]
    pub reasoning_tokens: Option<u64>,
    /// Prompt tokens read from the provider's prompt cache, when it reports them
    /// (`prompt_tokens_details.cached_tokens`, DeepSeek's `prompt_cache_hit_tokens`,
    /// `cache_read_input_tokens`). Part of `prompt_tokens` (SPEC §20.1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_prompt_tokens: Option<u64>,
    /// Prompt tokens written to the provider's prompt cache, when it reports them
    /// (`cache_creation_input_tokens`). Part of `prompt_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
    /// Of `cache_write_tokens`, those written for an hour (Anthropic's
    /// `cache_creation.ephemeral_1h_input_tokens`, priced at `CACHE_WRITE_1H_PRICE`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_1h_tokens: Option<u64>,
}

impl Usage {
    /// Usage with prompt and completion tokens.
    pub fn new(prompt_tokens: u64, completion_tokens: u64) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            reasoning_tokens: None,
            cached_prompt_tokens: None,
            cache_write_tokens: None,
            cache_write_1h_tokens: None,
        }
    }

    /// prompt + completion.
    pub fn total(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }

    /// Adds another usage (embedding batches).
    pub fn add(&self, other: &Usage) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens.saturating_add(other.prompt_tokens),
            completion_tokens: self
                .completion_tokens
                .saturating_add(other.completion_tokens),
            reasoning_tokens: add_known(self.reasoning_tokens, other.reasoning_tokens),
            cached_prompt_tokens: add_known(self.cached_prompt_tokens, other.cached_prompt_tokens),
            cache_write_tokens: add_known(self.cache_write_tokens, other.cache_write_tokens),
            cache_write_1h_tokens: None,
        }
    }
}

/// The sum of two optional counts: unknown only when both are (a part that does not
/// report a detail contributes none of it).
fn add_known(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
    }
}

/// Where usage figures come from. One shared set of values (SPEC §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageSource {
    /// The provider reported usage for a complete answer.
    Measured,
    /// The provider reported usage, but the stream broke after `finish_reason` (salvaged).
    Estimated,
    /// No usage is known (no usage frame, failed attempts, terminal rows).
    #[default]
    Unavailable,
}

impl UsageSource {
    /// Every value.
    pub const ALL: [UsageSource; 3] = [
        UsageSource::Measured,
        UsageSource::Estimated,
        UsageSource::Unavailable,
    ];

    /// The stable name stored in the `usage_source` column.
    pub fn as_str(self) -> &'static str {
        match self {
            UsageSource::Measured => "measured",
            UsageSource::Estimated => "estimated",
            UsageSource::Unavailable => "unavailable",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        UsageSource::ALL.into_iter().find(|u| u.as_str() == s)
    }

    /// Merges batch sources: any unavailable → unavailable; else any estimated →
    /// estimated; else measured (SPEC §8).
    pub fn merge(self, other: UsageSource) -> UsageSource {
        use UsageSource::*;
        match (self, other) {
            (Unavailable, _) | (_, Unavailable) => Unavailable,
            (Estimated, _) | (_, Estimated) => Estimated,
            (Measured, Measured) => Measured,
        }
    }
}

impl fmt::Display for UsageSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One assembled tool call.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ToolCall {
    /// Position among the answer's tool calls.
    pub index: u32,
    /// The provider's id (first non-empty value seen).
    #[serde(default)]
    pub id: Option<String>,
    /// The function name (first non-empty value seen).
    #[serde(default)]
    pub name: Option<String>,
    /// The concatenated JSON arguments.
    #[serde(default)]
    pub arguments: String,
}

/// The figures of one logical call (SPEC §3). Every field is public contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CallStats {
    /// Attempts actually sent, hedge legs included.
    pub attempts: u32,
    /// Answered from the response cache (then attempts = 0, generation_ms = 0).
    pub cache_hit: bool,
    /// Wall time of the whole logical call.
    pub total_latency_ms: u64,
    /// Extra legs actually launched.
    pub hedges: u32,
    /// Resume legs launched (SPEC §13): streams continued on another attempt after a
    /// failure or a stall.
    #[serde(default)]
    pub resumes: u32,
    /// The winner was an extra leg.
    pub hedge_won: bool,
    /// The winner's transport wall time minus `stall_ms`, clamped at 0.
    pub generation_ms: u64,
    /// Sum of the winner's gaps between incremental chunks over the stall threshold;
    /// `None` for plain calls or fewer than 2 incremental chunks.
    pub stall_ms: Option<u64>,
    /// Number of such gaps (same `None` rule).
    pub stall_count: Option<u32>,
}

/// The aggregated answer of a logical call.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LlmResponse {
    /// The answer text.
    pub content: String,
    /// Reasoning text (`reasoning_content` / `reasoning` / thinking parts), if any.
    pub reasoning_content: Option<String>,
    /// Assembled tool calls.
    pub tool_calls: Vec<ToolCall>,
    /// The last non-null `finish_reason`.
    pub finish_reason: Option<String>,
    /// The model that actually answered (the upstream's, else the source's configured one).
    pub model: String,
    /// The source that answered (`{provider}-{n}`).
    pub source: String,
    /// Token usage.
    pub usage: Usage,
    /// Where `usage` comes from.
    pub usage_source: UsageSource,
    /// When legs were joined into the answer (a resumed stream), the usage that
    /// describes it — the last leg's context and the output delivered (SPEC §23.6,
    /// [`crate::usage::answer_usage`]); `usage` stays what every leg billed. `None`
    /// when one leg made the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_usage: Option<Usage>,
    /// Time to the first incremental chunk (streams only).
    pub ttft_ms: Option<u64>,
    /// Largest gap between incremental chunks (streams with ≥ 2 such chunks).
    pub max_inter_token_ms: Option<u64>,
    /// The logical call's id (telemetry `logical_call_id`).
    pub logical_call_id: String,
    /// The call's figures.
    pub call_stats: CallStats,
    /// A plain (non-stream) answer: the upstream's completion object as received, so
    /// a proxy can pass every field through (SPEC §15). `None` for streams, cache hits
    /// and transports that do not keep it, and when the transport read the body typed
    /// and kept only its bytes ([`LlmResponse::upstream_body`]): read it with
    /// [`LlmResponse::upstream_object`]. Not part of the cached copy.
    #[serde(skip)]
    pub upstream: Option<serde_json::Map<String, serde_json::Value>>,
    /// The body `upstream` was parsed from, as received (same `None` rule).
    #[serde(skip)]
    pub upstream_body: Option<Vec<u8>>,
    /// `upstream_body`'s top-level `usage` is known to be an object, the one `usage` was
    /// read from (`false`: not known; a proxy looks).
    #[serde(skip)]
    pub upstream_usage_object: bool,
    /// The committed attempt's upstream response headers that a proxy passes on
    /// (`x-request-id`, `x-ratelimit-*`: SPEC §17.4), as received.
    #[serde(skip)]
    pub upstream_headers: Vec<(String, String)>,
}

impl LlmResponse {
    /// The upstream's completion object of a plain answer: [`LlmResponse::upstream`],
    /// else parsed from [`LlmResponse::upstream_body`]; `None` when there is neither
    /// (or the bytes are not a JSON object).
    pub fn upstream_object(
        &self,
    ) -> Option<std::borrow::Cow<'_, serde_json::Map<String, serde_json::Value>>> {
        if let Some(o) = &self.upstream {
            return Some(std::borrow::Cow::Borrowed(o));
        }
        match serde_json::from_slice(self.upstream_body.as_deref()?) {
            Ok(serde_json::Value::Object(o)) => Some(std::borrow::Cow::Owned(o)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upstream_object_is_the_parsed_one_or_read_from_the_bytes() {
        let mut r = LlmResponse::default();
        assert!(r.upstream_object().is_none());
        r.upstream_body = Some(br#"{"id": "x", "choices": []}"#.to_vec());
        assert_eq!(r.upstream_object().unwrap()["id"], "x");
        r.upstream = Some(serde_json::Map::from_iter([("id".to_string(), "y".into())]));
        assert_eq!(
            r.upstream_object().unwrap()["id"],
            "y",
            "the parsed object first"
        );
        r.upstream = None;
        r.upstream_body = Some(b"[1]".to_vec());
        assert!(r.upstream_object().is_none(), "not an object");
    }

    #[test]
    fn usage_source_merge_table() {
        use UsageSource::*;
        let table = [
            (Measured, Measured, Measured),
            (Measured, Estimated, Estimated),
            (Estimated, Measured, Estimated),
            (Measured, Unavailable, Unavailable),
            (Unavailable, Estimated, Unavailable),
            (Estimated, Estimated, Estimated),
        ];
        for (a, b, want) in table {
            assert_eq!(a.merge(b), want, "{a} + {b}");
        }
        for u in UsageSource::ALL {
            assert_eq!(UsageSource::parse(u.as_str()), Some(u));
        }
    }

    #[test]
    fn usage_add_keeps_reasoning_unknown_when_both_unknown() {
        let a = Usage::new(1, 2);
        let b = Usage {
            reasoning_tokens: Some(3),
            ..Usage::new(4, 5)
        };
        assert_eq!(a.add(&a).reasoning_tokens, None);
        assert_eq!(
            a.add(&b),
            Usage {
                prompt_tokens: 5,
                completion_tokens: 7,
                reasoning_tokens: Some(3),
                ..Usage::default()
            }
        );
    }
}
