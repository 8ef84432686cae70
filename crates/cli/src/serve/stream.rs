//! Passthrough streaming for `/v1/chat/completions` with `stream: true` (SPEC §13,
//! §15), on [`polygw::ChatStream`].
//!
//! The call is polled by the handler until a leg commits (its first chunk): a call that
//! fails before that gets a proper HTTP error status. From the commit on, the response
//! is an SSE body that owns the stream and writes every event already available in one
//! write. Each chunk is the upstream's own frame, every field passed through, except:
//! `id` and `created` are the first delivered leg's for the whole stream (a resumed
//! stream stays one stream), and usage is sent once, at the end, when the client asked
//! for it (`stream_options.include_usage`): the upstream's own usage object when one
//! leg delivered the answer, else the sum over the legs, marked
//! `"polygw": {"usage_source": …}` when estimated, `null` when unknown. A failure after
//! the commit ends the stream with an error event, never with a silent `[DONE]`. If the
//! client goes away, the body (and with it the call) is dropped: every leg is
//! cancelled (`cancelled` rows).

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use polygw::{
    ChatEvent, ChatRequest, ChatStream, Commit, GatewayClient, GatewayError, LlmResponse,
    StreamDelta, UsageSource,
};
use serde_json::{json, Map, Value};

use super::openai::{chunk_json, usage_json, ApiError};
use super::{api_error_response, unix_now};

/// The most events written in one body chunk.
const MAX_BATCH: usize = 256;

struct SseState {
    stream: ChatStream,
    /// `id` and `created` of the stream: the first delivered chunk's.
    id: Option<String>,
    created: Option<Value>,
    /// The model of the committed leg's source (for frames that carry none).
    model: String,
    logical_call_id: String,
    include_usage: bool,
    /// The last usage object an upstream sent, as sent.
    upstream_usage: Option<Value>,
    /// Legs whose chunks reached the client.
    legs: u32,
    done: bool,
}

impl SseState {
    fn id(&self) -> String {
        self.id
            .clone()
            .unwrap_or_else(|| format!("chatcmpl-{}", self.logical_call_id))
    }

    fn created(&self) -> Value {
        self.created.clone().unwrap_or_else(|| json!(unix_now()))
    }

    /// One upstream chunk as the client sees it, or `None` when nothing is left to
    /// send (a usage-only frame).
    fn chunk(&mut self, mut d: StreamDelta) -> Option<Value> {
        if let Some(raw) = &d.raw {
            let u = raw
                .get("usage")
                .filter(|u| u.is_object())
                .cloned()
                .or_else(|| {
                    raw.get("choices")
                        .and_then(Value::as_array)
                        .and_then(|c| c.first())
                        .and_then(|c| c.get("usage"))
                        .filter(|u| u.is_object())
                        .cloned()
                });
            if u.is_some() {
                self.upstream_usage = u;
            }
        }
        d.strip_usage();
        let mut obj: Map<String, Value> = match d.raw.take() {
            Some(o) => o,
            None => match chunk_json(&self.id(), &self.model, 0, &d) {
                Some(Value::Object(o)) => o,
                _ => return None,
            },
        };
        let no_choices = obj
            .get("choices")
            .and_then(Value::as_array)
            .is_none_or(|c| c.is_empty());
        if no_choices {
            return None;
        }
        if self.id.is_none() {
            // The first delivered chunk names the stream.
            self.id = Some(
                obj.get("id")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("chatcmpl-{}", self.logical_call_id)),
            );
            self.created = Some(
                obj.get("created")
                    .filter(|c| c.is_number())
                    .cloned()
                    .unwrap_or_else(|| json!(unix_now())),
            );
        }
        obj.insert("id".into(), json!(self.id()));
        obj.insert("created".into(), self.created());
        obj.entry("object")
            .or_insert_with(|| json!("chat.completion.chunk"));
        if !obj.get("model").is_some_and(|m| m.is_string()) {
            obj.insert("model".into(), json!(self.model));
        }
        Some(Value::Object(obj))
    }

    /// The final usage chunk (SPEC §15: measured as reported, an estimate marked,
    /// unknown as null).
    fn usage_chunk(&self, r: &LlmResponse) -> Value {
        let usage = match r.usage_source {
            UsageSource::Unavailable => Value::Null,
            UsageSource::Measured if self.legs <= 1 && self.upstream_usage.is_some() => {
                self.upstream_usage.clone().unwrap_or(Value::Null)
            }
            _ => usage_json(&r.usage),
        };
        let mut c = json!({
            "id": self.id(),
            "object": "chat.completion.chunk",
            "created": self.created(),
            "model": r.model,
            "choices": [],
            "usage": usage,
        });
        if r.usage_source != UsageSource::Measured {
            c["polygw"] = json!({"usage_source": r.usage_source.as_str()});
        }
        c
    }

    fn push_event(&mut self, out: &mut Vec<u8>, item: Result<ChatEvent, GatewayError>) {
        match item {
            Ok(ChatEvent::Committed(c)) => {
                self.legs += 1;
                if !c.first {
                    tracing::info!(source = %c.source, mode = ?c.resume_mode, "the stream resumed on another attempt");
                }
            }
            Ok(ChatEvent::Delta(d)) => {
                if let Some(v) = self.chunk(d) {
                    sse(out, &v);
                }
            }
            Ok(ChatEvent::Done(r)) => {
                if self.include_usage {
                    let u = self.usage_chunk(&r);
                    sse(out, &u);
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
            Err(e) => {
                tracing::warn!(error = %e, "stream failed after its first chunk");
                let err = ApiError::from_gateway(&e);
                sse(out, &err.body());
                self.done = true;
            }
        }
    }

    /// The next body chunk: every event available now, in one write.
    async fn next_bytes(&mut self) -> Option<Bytes> {
        loop {
            if self.done {
                return None;
            }
            let first = self.stream.next().await;
            let mut out = Vec::new();
            match first {
                None => return None,
                Some(item) => self.push_event(&mut out, item),
            }
            let mut n = 1;
            while !self.done && n < MAX_BATCH {
                match self.stream.next().now_or_never() {
                    Some(Some(item)) => {
                        self.push_event(&mut out, item);
                        n += 1;
                    }
                    Some(None) => {
                        self.done = true;
                    }
                    None => break,
                }
            }
            if !out.is_empty() {
                return Some(Bytes::from(out));
            }
        }
    }
}

fn sse(out: &mut Vec<u8>, v: &Value) {
    out.extend_from_slice(b"data: ");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, v);
    out.extend_from_slice(b"\n\n");
}

/// Runs a streamed chat and answers with passthrough SSE (or an error status when the
/// call fails before its first chunk).
pub async fn respond(client: GatewayClient, request: ChatRequest, include_usage: bool) -> Response {
    let mut stream = client.chat_stream(request);
    // Phase 1: until a leg commits, or the call ends.
    let commit: Commit = loop {
        match stream.next().await {
            Some(Ok(ChatEvent::Committed(c))) => break c,
            Some(Ok(ChatEvent::Delta(_))) => {}
            Some(Ok(ChatEvent::Done(r))) => return one_shot(*r, include_usage),
            Some(Err(e)) => return api_error_response(&ApiError::from_gateway(&e)),
            None => {
                return api_error_response(&ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "internal",
                    "the call ended without an answer",
                ))
            }
        }
    };
    let state = SseState {
        stream,
        id: None,
        created: None,
        model: commit.model.clone(),
        logical_call_id: commit.logical_call_id.clone(),
        include_usage,
        upstream_usage: None,
        legs: 1,
        done: false,
    };
    let body = futures_util::stream::unfold(state, |mut s| async move {
        s.next_bytes()
            .await
            .map(|b| (Ok::<Bytes, std::io::Error>(b), s))
    });
    let mut resp = Response::new(Body::from_stream(body));
    stream_headers(
        &mut resp,
        &commit.logical_call_id,
        &commit.source,
        commit.is_hedge,
    );
    resp
}

fn stream_headers(resp: &mut Response, logical_call_id: &str, source: &str, hedged: bool) {
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Ok(v) = HeaderValue::from_str(logical_call_id) {
        h.insert("x-polygw-logical-call-id", v);
    }
    if let Ok(v) = HeaderValue::from_str(source) {
        h.insert("x-polygw-source", v);
    }
    h.insert(
        "x-polygw-hedged",
        HeaderValue::from_static(if hedged { "true" } else { "false" }),
    );
}

/// A streamed answer that ended without any leg being committed (an answer from the
/// cache): one chunk with the whole answer, the usage chunk when asked for, `[DONE]`.
fn one_shot(r: LlmResponse, include_usage: bool) -> Response {
    let id = format!("chatcmpl-{}", r.logical_call_id);
    let created = unix_now();
    let d = StreamDelta {
        role: Some("assistant".into()),
        content: Some(r.content.clone()),
        reasoning: r.reasoning_content.clone(),
        finish_reason: r.finish_reason.clone(),
        ..Default::default()
    };
    let mut body = Vec::new();
    if let Some(c) = chunk_json(&id, &r.model, created, &d) {
        sse(&mut body, &c);
    }
    if include_usage {
        let state_usage = match r.usage_source {
            UsageSource::Unavailable => Value::Null,
            _ => usage_json(&r.usage),
        };
        let mut u = json!({
            "id": id, "object": "chat.completion.chunk", "created": created,
            "model": r.model, "choices": [], "usage": state_usage,
        });
        if r.usage_source != UsageSource::Measured {
            u["polygw"] = json!({"usage_source": r.usage_source.as_str()});
        }
        sse(&mut body, &u);
    }
    body.extend_from_slice(b"data: [DONE]\n\n");
    let mut resp = Response::new(Body::from(body));
    stream_headers(
        &mut resp,
        &r.logical_call_id,
        &r.source,
        r.call_stats.hedge_won,
    );
    resp
}
