//! [`Behavior`] (alias [`Script`]): how the mock answers one request — status, delays,
//! chunks, stalls, keepalives, faults, usage — as plain data that also reads from JSON
//! (profile files). Every field has a default, so `{}` is a fast, complete answer.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::prefill::{PrefillDialect, PrefillMode, PrefillPolicy};

/// One scripted response. All durations are milliseconds (fractions allowed) of real
/// time; a profile's `time_scale` multiplies them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Behavior {
    /// HTTP status (200 = an answer; anything else = an error response).
    pub status: u16,
    /// Silence before the status line and headers are sent.
    pub headers_delay_ms: f64,
    /// `Retry-After` header, on any status: a number of seconds, or a raw string (an
    /// HTTP-date, or garbage to test parsers).
    pub retry_after: Option<RetryAfter>,
    /// `error.code` of the generated error body (non-2xx); a default per status.
    pub error_code: Option<String>,
    /// `error.message` of the generated error body (non-2xx).
    pub error_message: Option<String>,
    /// A verbatim JSON error body (non-2xx), instead of the generated one.
    pub error_body: Option<Value>,
    /// Headers → first incremental chunk (streams). Plain answers wait for the whole
    /// generation (ttft + gaps + stalls) before their headers.
    pub ttft_ms: f64,
    /// Content chunk texts, in order.
    pub chunks: Vec<String>,
    /// Or: this many generated content chunks (one word each). Ignored when `chunks`
    /// is not empty. `Some(0)` = no content at all.
    pub chunk_count: Option<u32>,
    /// Gap between consecutive incremental chunks.
    pub gap_ms: f64,
    /// Per-gap values (gap before incremental chunk i+1 is `gaps_ms[i]`); entries
    /// missing at the end fall back to `gap_ms`.
    pub gaps_ms: Vec<f64>,
    /// Reasoning chunk texts, sent before the content.
    pub reasoning: Vec<String>,
    /// The delta field carrying reasoning.
    pub reasoning_field: ReasoningField,
    /// A tool call, sent after the content.
    pub tool_call: Option<ToolCallSpec>,
    /// Silences inserted before given incremental chunks.
    pub stalls: Vec<Stall>,
    /// During any silence after the headers, send `: keepalive` comments this often.
    pub keepalive_ms: Option<f64>,
    /// A fault to inject.
    pub fault: Option<Fault>,
    /// Where (whether) usage is reported.
    pub usage: UsageMode,
    /// Send `data: [DONE]` at the end of a stream.
    pub done: bool,
    /// Send a first role-only delta (not incremental).
    pub role_chunk: bool,
    /// finish_reason of the answer (default `stop`, or `tool_calls` with a tool call).
    pub finish_reason: Option<String>,
    /// The `model` in the response (default: echo the request's model).
    pub model: Option<String>,
    /// Reported prompt tokens (default: estimated from the request, see the docs).
    pub prompt_tokens: Option<u64>,
    /// Reported completion tokens (default: the number of incremental chunks).
    pub completion_tokens: Option<u64>,
    /// A verbatim SSE body, played instead of generated frames.
    pub raw_sse: Option<String>,
    /// A file whose bytes are a verbatim SSE body (read per request).
    pub raw_sse_file: Option<PathBuf>,
    /// A file of JSON lines replayed as `data: <line>\n\n` events then `data: [DONE]`
    /// (the recorded-fixture format).
    pub jsonl_file: Option<PathBuf>,
    /// A verbatim body for any status (plain or stream requests).
    pub raw_body: Option<String>,
    /// Content-Type of `raw_body` (default `application/json`).
    pub content_type: Option<String>,
    /// Extra response headers (a provider's `x-request-id`, `x-ratelimit-*`, a
    /// `Location` of a redirect).
    pub headers: std::collections::BTreeMap<String, String>,
    /// Split raw bodies into writes of this many bytes (exercises client parsers).
    pub raw_chunk_bytes: Option<usize>,
    /// Silence between those writes.
    pub raw_chunk_gap_ms: f64,
    /// What this answer does with a prefill request (see [`PrefillPolicy`]); when this
    /// or `prefill_dialects` is set, the pair replaces the server's default policy.
    pub prefill: Option<PrefillMode>,
    /// The prefill dialects this answer honours (see [`PrefillPolicy::dialects`]).
    pub prefill_dialects: Option<Vec<PrefillDialect>>,
    /// Messages: thinking streams no `thinking_delta` (Anthropic's `display:
    /// "omitted"`): its block starts, then silence until its signature.
    pub thinking_omitted: bool,
    /// A reasoning model's chat endpoint (OpenAI's o-series, GPT-5): a request carrying
    /// `max_tokens` is refused with OpenAI's 400 `unsupported_parameter`, naming
    /// `max_completion_tokens` (SPEC §24.4).
    pub refuses_max_tokens: bool,
    /// The provider group that signs (SPEC §23.5): Messages thinking blocks it sends
    /// are signed `sig-GROUP`; a request that carries a thinking block signed otherwise
    /// (or a `redacted_thinking` block whose data is not `red-GROUP…`) is refused with
    /// Anthropic's 400 "Invalid `signature` in `thinking` block", and a Responses
    /// `reasoning` item whose `encrypted_content` is not `enc-GROUP…` with OpenAI's 400
    /// `invalid_encrypted_content`. `None`: unsigned checks (`mock-signature`).
    pub signing_group: Option<String>,
}

/// An alias: one queued script is one [`Behavior`].
pub type Script = Behavior;

impl Default for Behavior {
    fn default() -> Self {
        Behavior {
            status: 200,
            headers_delay_ms: 0.0,
            retry_after: None,
            error_code: None,
            error_message: None,
            error_body: None,
            ttft_ms: 0.0,
            chunks: Vec::new(),
            chunk_count: None,
            gap_ms: 0.0,
            gaps_ms: Vec::new(),
            reasoning: Vec::new(),
            reasoning_field: ReasoningField::ReasoningContent,
            tool_call: None,
            stalls: Vec::new(),
            keepalive_ms: None,
            fault: None,
            usage: UsageMode::FinalFrame,
            done: true,
            role_chunk: true,
            finish_reason: None,
            model: None,
            prompt_tokens: None,
            completion_tokens: None,
            raw_sse: None,
            raw_sse_file: None,
            jsonl_file: None,
            raw_body: None,
            content_type: None,
            raw_chunk_bytes: None,
            raw_chunk_gap_ms: 0.0,
            headers: Default::default(),
            prefill: None,
            prefill_dialects: None,
            thinking_omitted: false,
            refuses_max_tokens: false,
            signing_group: None,
        }
    }
}

/// A `Retry-After` header value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RetryAfter {
    /// Delay-seconds (written as an integer when whole).
    Seconds(f64),
    /// Sent verbatim (an HTTP-date, or anything else).
    Raw(String),
}

impl RetryAfter {
    /// The header value.
    pub fn header_value(&self) -> String {
        match self {
            RetryAfter::Seconds(s) if s.fract() == 0.0 && *s >= 0.0 => format!("{}", *s as u64),
            RetryAfter::Seconds(s) => format!("{s}"),
            RetryAfter::Raw(r) => r.clone(),
        }
    }
}

/// Which delta field carries reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningField {
    /// `delta.reasoning_content` (DeepSeek, Qwen).
    #[default]
    ReasoningContent,
    /// `delta.reasoning` (Groq, Cerebras).
    Reasoning,
}

/// Where usage is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageMode {
    /// A final `choices: []` frame after the finish chunk (OpenAI).
    #[default]
    FinalFrame,
    /// On the finish chunk, top-level (DeepSeek, Groq).
    Inline,
    /// On the finish chunk, inside `choices[0].usage` (Moonshot).
    Choice,
    /// Never.
    None,
}

/// A tool call in the answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolCallSpec {
    /// Its id.
    pub id: String,
    /// Function name.
    pub name: String,
    /// JSON arguments (a string).
    pub arguments: String,
    /// Split the arguments over this many chunks (≥ 1).
    pub fragments: u32,
}

impl Default for ToolCallSpec {
    fn default() -> Self {
        ToolCallSpec {
            id: "call_mock_0".into(),
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
            fragments: 1,
        }
    }
}

/// A silence before incremental chunk `before_chunk` (0 extends the TTFT).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stall {
    /// Index of the incremental chunk the silence comes before.
    pub before_chunk: u32,
    /// Its length.
    pub ms: f64,
}

/// A fault. Chunk indexes count incremental chunks (reasoning, content, tool-call
/// fragments, in send order) from 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Fault {
    /// Close the TCP connection (RST) without any response, after `headers_delay_ms`.
    ResetBeforeHeaders,
    /// Abort the connection after `chunks` incremental chunks (before the finish chunk
    /// when `chunks` ≥ their number). Plain answers: after half the body.
    ResetAfter {
        /// Incremental chunks sent first.
        chunks: u32,
    },
    /// Abort the connection right after the finish chunk (which carries usage when
    /// `usage` is `inline` or `choice`).
    ResetAfterFinish,
    /// End the body cleanly after `chunks` incremental chunks: no finish_reason, no
    /// usage, no `[DONE]`. Plain answers: half the body, cleanly ended.
    TruncateAfter {
        /// Incremental chunks sent first.
        chunks: u32,
    },
    /// Send an invalid-JSON frame in place of incremental chunk `chunk`, then go on.
    /// Plain answers: an invalid JSON body.
    MalformedAt {
        /// Which chunk.
        chunk: u32,
    },
    /// Send an in-band error object in place of incremental chunk `chunk`, then end the
    /// body. Plain answers: a 200 whose body is the error object.
    ErrorFrameAt {
        /// Which chunk.
        chunk: u32,
        /// The error object (default: a `server_error`).
        #[serde(default)]
        error: Option<Value>,
    },
    /// After the last frame (finish, usage; no `[DONE]`), keep the connection open and
    /// silent (keepalives aside) until the client leaves. Plain answers: the body never
    /// ends.
    HangAfterFinish,
}

impl Behavior {
    /// A fast streamed answer with these content chunks.
    pub fn text(chunks: &[&str]) -> Self {
        Behavior {
            chunks: chunks.iter().map(|s| s.to_string()).collect(),
            ..Behavior::default()
        }
    }

    /// An error response with this status.
    pub fn status(status: u16) -> Self {
        Behavior {
            status,
            ..Behavior::default()
        }
    }

    /// A fault on the default answer.
    pub fn fault(fault: Fault) -> Self {
        Behavior {
            fault: Some(fault),
            ..Behavior::default()
        }
    }

    /// Replays a recorded-fixture JSON-lines file.
    pub fn jsonl(path: impl Into<PathBuf>) -> Self {
        Behavior {
            jsonl_file: Some(path.into()),
            ..Behavior::default()
        }
    }

    /// This behavior with its own prefill policy.
    pub fn with_prefill(mut self, policy: PrefillPolicy) -> Self {
        self.prefill = Some(policy.mode);
        self.prefill_dialects = policy.dialects;
        self
    }

    /// The behavior's own prefill policy, if it sets one (else the server's applies).
    pub fn prefill_policy(&self) -> Option<PrefillPolicy> {
        (self.prefill.is_some() || self.prefill_dialects.is_some()).then(|| PrefillPolicy {
            mode: self.prefill.unwrap_or_default(),
            dialects: self.prefill_dialects.clone(),
        })
    }

    /// Every duration multiplied by `factor` (Retry-After seconds included).
    pub fn scaled(mut self, factor: f64) -> Self {
        let f = if factor.is_finite() && factor >= 0.0 {
            factor
        } else {
            1.0
        };
        self.headers_delay_ms *= f;
        self.ttft_ms *= f;
        self.gap_ms *= f;
        for g in &mut self.gaps_ms {
            *g *= f;
        }
        for s in &mut self.stalls {
            s.ms *= f;
        }
        if let Some(k) = &mut self.keepalive_ms {
            *k *= f;
        }
        if let Some(RetryAfter::Seconds(s)) = &mut self.retry_after {
            *s *= f;
        }
        self.raw_chunk_gap_ms *= f;
        self
    }

    /// Checks what cannot be played: statuses out of range, negative or non-finite
    /// durations, zero keepalive, zero tool-call fragments.
    pub fn validate(&self) -> Result<(), String> {
        if !(100..=599).contains(&self.status) {
            return Err(format!("status {} is not in 100..=599", self.status));
        }
        let mut times: Vec<(&str, f64)> = vec![
            ("headers_delay_ms", self.headers_delay_ms),
            ("ttft_ms", self.ttft_ms),
            ("gap_ms", self.gap_ms),
            ("raw_chunk_gap_ms", self.raw_chunk_gap_ms),
        ];
        times.extend(self.gaps_ms.iter().map(|g| ("gaps_ms[]", *g)));
        times.extend(self.stalls.iter().map(|s| ("stalls[].ms", s.ms)));
        for (name, v) in times {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{name} = {v} must be a finite number ≥ 0"));
            }
        }
        if let Some(k) = self.keepalive_ms {
            if !k.is_finite() || k <= 0.0 {
                return Err(format!("keepalive_ms = {k} must be > 0"));
            }
        }
        if let Some(t) = &self.tool_call {
            if t.fragments == 0 {
                return Err("tool_call.fragments must be ≥ 1".into());
            }
        }
        if self.raw_chunk_bytes == Some(0) {
            return Err("raw_chunk_bytes must be ≥ 1".into());
        }
        Ok(())
    }

    /// The gap before incremental chunk `i` (≥ 1).
    pub(crate) fn gap_before(&self, i: usize) -> f64 {
        self.gaps_ms
            .get(i.saturating_sub(1))
            .copied()
            .unwrap_or(self.gap_ms)
    }

    /// The total stall before incremental chunk `i`.
    pub(crate) fn stall_before(&self, i: usize) -> f64 {
        self.stalls
            .iter()
            .filter(|s| s.before_chunk as usize == i)
            .map(|s| s.ms)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn empty_json_is_the_default() {
        let b: Behavior = serde_json::from_value(json!({})).unwrap();
        assert_eq!(b, Behavior::default());
    }

    #[test]
    fn json_round_trip_with_faults() {
        let b: Behavior = serde_json::from_value(json!({
            "status": 200, "ttft_ms": 5, "chunk_count": 20, "gap_ms": 1.5,
            "stalls": [{"before_chunk": 3, "ms": 100}],
            "keepalive_ms": 10,
            "fault": {"kind": "reset_after", "chunks": 4},
            "usage": "inline", "retry_after": 2
        }))
        .unwrap();
        assert_eq!(b.fault, Some(Fault::ResetAfter { chunks: 4 }));
        assert_eq!(b.retry_after, Some(RetryAfter::Seconds(2.0)));
        assert_eq!(b.usage, UsageMode::Inline);
        let back: Behavior = serde_json::from_value(serde_json::to_value(&b).unwrap()).unwrap();
        assert_eq!(back, b);
        let raw: Behavior =
            serde_json::from_value(json!({"retry_after": "Wed, 21 Oct 2015 07:28:00 GMT"}))
                .unwrap();
        assert_eq!(
            raw.retry_after.unwrap().header_value(),
            "Wed, 21 Oct 2015 07:28:00 GMT"
        );
    }

    #[test]
    fn prefill_fields() {
        use crate::prefill::{PrefillDialect, PrefillMode, PrefillPolicy};
        let b: Behavior = serde_json::from_value(json!({
            "prefill": "reject", "prefill_dialects": ["assistant", "vllm"]
        }))
        .unwrap();
        let policy = b.prefill_policy().unwrap();
        assert_eq!(policy.mode, PrefillMode::Reject);
        assert!(policy.honours(PrefillDialect::Vllm) && !policy.honours(PrefillDialect::Prefix));
        let back: Behavior = serde_json::from_value(serde_json::to_value(&b).unwrap()).unwrap();
        assert_eq!(back, b);
        assert_eq!(Behavior::default().prefill_policy(), None);
        let only: Behavior = serde_json::from_value(json!({"prefill_dialects": []})).unwrap();
        assert_eq!(
            only.prefill_policy(),
            Some(PrefillPolicy::only(&[])),
            "a list alone means accept those"
        );
        assert_eq!(
            Behavior::default()
                .with_prefill(PrefillPolicy::ignore())
                .prefill_policy(),
            Some(PrefillPolicy::ignore())
        );
        assert!(serde_json::from_value::<Behavior>(json!({"prefill_dialects": ["nope"]})).is_err());
    }

    #[test]
    fn unknown_fields_are_refused() {
        assert!(serde_json::from_value::<Behavior>(json!({"ttft": 1})).is_err());
        assert!(serde_json::from_value::<Behavior>(json!({"fault": {"kind": "nope"}})).is_err());
    }

    #[test]
    fn scaling_and_validation() {
        let b = Behavior {
            ttft_ms: 1000.0,
            gaps_ms: vec![10.0],
            stalls: vec![Stall {
                before_chunk: 1,
                ms: 2000.0,
            }],
            retry_after: Some(RetryAfter::Seconds(4.0)),
            keepalive_ms: Some(100.0),
            ..Behavior::default()
        }
        .scaled(0.01);
        assert_eq!(b.ttft_ms, 10.0);
        assert_eq!(b.gaps_ms, vec![0.1]);
        assert_eq!(b.stalls[0].ms, 20.0);
        assert_eq!(b.retry_after, Some(RetryAfter::Seconds(0.04)));
        assert_eq!(b.retry_after.as_ref().unwrap().header_value(), "0.04");
        assert!(b.validate().is_ok());
        assert!(Behavior::status(700).validate().is_err());
        assert!(Behavior {
            gap_ms: -1.0,
            ..Behavior::default()
        }
        .validate()
        .is_err());
    }
}
