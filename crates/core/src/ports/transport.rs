//! The transport ports: chat ([`Transport`]), [`EmbeddingTransport`] and
//! [`OcrTransport`], and what they return.

// mockall's generated expectation closures return the ports' own `Result<_, AttemptError>`.
#![cfg_attr(
    any(test, feature = "mock"),
    allow(clippy::result_large_err, reason = "mockall-generated code")
)]

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::AttemptError;
use crate::ports::observer::ChunkObserver;
use crate::request::ChatRequest;
use crate::response::{ToolCall, Usage, UsageSource};
use crate::source::SourceConfig;
use crate::stall::StreamFigures;

/// One chat attempt to one source.
#[derive(Clone, Copy)]
pub struct ChatAttempt<'a> {
    /// The source to call.
    pub source: &'a SourceConfig,
    /// What to ask.
    pub request: &'a ChatRequest,
    /// The attempt's id (sent as `x-polygw-call-id` for upstream correlation).
    pub call_id: &'a str,
    /// `STREAM__STALL_THRESHOLD_MS` of the scope (metering only).
    pub stall_threshold: Duration,
    /// Called for every incremental chunk.
    pub observer: &'a dyn ChunkObserver,
    /// The W3C `traceparent` the request carries (SPEC §26.1), when the call is traced.
    pub traceparent: Option<&'a str>,
}

impl std::fmt::Debug for ChatAttempt<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatAttempt")
            .field("source", &self.source.name)
            .field("call_id", &self.call_id)
            .field("stream", &self.request.stream)
            .finish()
    }
}

/// What a successful chat attempt produced.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TransportResult {
    /// Answer text.
    pub content: String,
    /// Reasoning text, if any.
    pub reasoning_content: Option<String>,
    /// Assembled tool calls.
    pub tool_calls: Vec<ToolCall>,
    /// Last non-null finish_reason.
    pub finish_reason: Option<String>,
    /// The upstream's `model`, if it said.
    pub model: Option<String>,
    /// Usage (0/0 when unavailable).
    pub usage: Usage,
    /// Where usage came from.
    pub usage_source: UsageSource,
    /// HTTP status of the response.
    pub http_status: u16,
    /// Stream figures; `None` for plain calls.
    pub stream: Option<StreamFigures>,
    /// The stream broke after its finish_reason and was accepted (SPEC §5 salvage).
    pub salvaged: bool,
    /// A plain answer: the upstream's completion object as received.
    #[serde(skip)]
    pub raw: Option<serde_json::Map<String, serde_json::Value>>,
    /// A plain answer: the body `raw` was parsed from, as received (a proxy passes it
    /// on unchanged when it needs no edit, instead of serializing `raw` again).
    #[serde(skip)]
    pub raw_body: Option<Vec<u8>>,
    /// A plain answer read typed: its top-level `usage` is an object, read for `usage`
    /// (a proxy passes `raw_body` on without looking for it again).
    #[serde(skip)]
    pub raw_usage_object: bool,
    /// The response headers a proxy passes on ([`crate::ports::passed_headers`]).
    #[serde(skip)]
    pub upstream_headers: Vec<(String, String)>,
}

/// A request to one of a native source's other endpoints, forwarded as the client sent
/// it (SPEC §23.7: `count_tokens`).
#[derive(Debug, Clone, Copy)]
pub struct NativeCall<'a> {
    /// The source.
    pub source: &'a SourceConfig,
    /// The endpoint under the API's path (`count_tokens` → `…/v1/messages/count_tokens`).
    pub endpoint: &'a str,
    /// The client's body (its `model` is replaced with the source's).
    pub body: &'a serde_json::Map<String, serde_json::Value>,
    /// The client's `anthropic-*` headers.
    pub headers: &'a [(String, String)],
    /// The client's own credential, for a source with `AUTH=client`.
    pub client: Option<&'a crate::request::ClientCredential>,
    /// The call's id.
    pub call_id: &'a str,
}

/// A native endpoint's answer, as received.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NativeAnswer {
    /// Its status.
    pub status: u16,
    /// Its body (capped).
    pub body: Vec<u8>,
}

/// Chat over an OpenAI-compatible `/chat/completions`, or a native source's API.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// Sends one attempt; the future is cancel-safe (dropping it closes the request).
    /// (The attempt's lifetime is named rather than elided so that mockall can mock the
    /// port: implementations write the same signature.)
    async fn chat<'a>(&self, attempt: ChatAttempt<'a>) -> Result<TransportResult, AttemptError>;

    /// Forwards a request to one of a native source's other endpoints. A transport
    /// that reaches no native source refuses it.
    async fn native_call<'a>(&self, call: NativeCall<'a>) -> Result<NativeAnswer, AttemptError> {
        Err(AttemptError::new(
            crate::ErrorClass::Rejected,
            crate::ErrorLabel::Rejected,
            format!(
                "this transport cannot call {}'s {} endpoint",
                call.source.name, call.endpoint
            ),
        ))
    }
}

/// What an embedding attempt produced.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct EmbeddingResult {
    /// One vector per input, in input order.
    pub vectors: Vec<Vec<f32>>,
    /// Usage (0/0 when unavailable).
    pub usage: Usage,
    /// Where usage came from.
    pub usage_source: UsageSource,
    /// The upstream's `model`, if it said.
    pub model: Option<String>,
    /// HTTP status.
    pub http_status: u16,
}

/// Embeddings over `/embeddings`.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait EmbeddingTransport: Send + Sync + std::fmt::Debug {
    /// Embeds one batch.
    async fn embed(
        &self,
        source: &SourceConfig,
        texts: &[String],
        call_id: &str,
    ) -> Result<EmbeddingResult, AttemptError>;

    /// Embeds one batch of inputs that may be token arrays. The default serves texts
    /// through [`EmbeddingTransport::embed`] and refuses token arrays (a transport that
    /// sends them, as the OpenAI-compatible one does, overrides it).
    async fn embed_inputs(
        &self,
        source: &SourceConfig,
        inputs: &[crate::EmbeddingInput],
        call_id: &str,
    ) -> Result<EmbeddingResult, AttemptError> {
        let mut texts = Vec::with_capacity(inputs.len());
        for i in inputs {
            match i {
                crate::EmbeddingInput::Text(t) => texts.push(t.clone()),
                crate::EmbeddingInput::Tokens(_) => {
                    return Err(AttemptError::new(
                        crate::ErrorClass::Rejected,
                        crate::ErrorLabel::Rejected,
                        "this embedding transport does not take token arrays",
                    ))
                }
            }
        }
        self.embed(source, &texts, call_id).await
    }
}

/// What an OCR attempt produced.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct OcrResult {
    /// The recognized text.
    pub text: String,
    /// The upstream's `model`, if it said.
    pub model: Option<String>,
    /// HTTP status.
    pub http_status: u16,
}

/// OCR through an OpenAI-compatible vision request.
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
#[async_trait]
pub trait OcrTransport: Send + Sync + std::fmt::Debug {
    /// Recognizes the text of one image.
    async fn recognize(
        &self,
        source: &SourceConfig,
        image: &[u8],
        mime: &str,
        prompt: &str,
        call_id: &str,
    ) -> Result<OcrResult, AttemptError>;
}
