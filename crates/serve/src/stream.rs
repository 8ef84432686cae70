//! Streamed chat (`"stream": true`, SPEC §13, §15) on [`polygw::ChatStream`].
//!
//! Until a leg commits (its first chunk), the call is polled by the handler: a call that
//! fails then gets a proper HTTP error status. If no leg has committed after
//! `keepalive`, the answer starts anyway — 200 and SSE headers — and an SSE comment
//! (`: keepalive`) follows every `keepalive` until the first chunk, so that an idle
//! timeout in front of the proxy never cuts a reasoning model's long first token; from
//! that point on a failure is an in-stream error event.
//!
//! Each chunk is the upstream's own frame, every field passed through, except: `id`
//! and `created` are the first delivered frame's for the whole stream (a resumed stream
//! stays one stream), a frame without a `model` gets the committed source's, and usage
//! is sent once, at the end, when the client asked for it (`include_usage`): the
//! upstream's own usage object when one leg delivered the answer, else the sum over the
//! legs, marked `"polygw": {"usage_source": …}` when not measured, `null` when unknown.
//! Frames carry `"usage": null` where the upstream sent usage mid-stream. A failure
//! after the headers ends the stream with an error event, never with a silent `[DONE]`;
//! so do the end of a shutdown's grace period (`server_shutdown`) and a client that
//! ends its side (`client_closed_request`, the call is cancelled). Events that are
//! ready together go out in one write.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use polygw::{
    CallOptions, ChatEvent, ChatRequest, ChatStream, Commit, GatewayClient, GatewayError,
    LlmResponse, StreamDelta, UsageSource,
};
use serde_json::{json, Map, Value};
use tokio::time::{Instant, Sleep};

use crate::conn::ConnCtx;
use crate::errors::from_gateway;
use crate::guard::{error_response, set_request_id};
use crate::handlers::{client_closed, client_gone, gateway_error, shutting_down, unix_now};
use crate::names;
use crate::openai::{chunk_json, usage_json, ApiError};
use crate::proxy::{cut_done, State as AppState};
use crate::scope::Slot;

/// The most events written in one body chunk.
const MAX_BATCH: usize = 256;

/// Frame-level keys every chunk has; anything else is information for the client.
const ENVELOPE: [&str; 9] = [
    "id",
    "object",
    "created",
    "model",
    "system_fingerprint",
    "service_tier",
    "obfuscation",
    "choices",
    "usage",
];

type Signal = Pin<Box<dyn Future<Output = ()> + Send>>;

struct SseState {
    stream: ChatStream,
    /// The committed leg (None while waiting for the first chunk after keepalives).
    commit: Option<Commit>,
    /// `id` and `created` of the stream: the first delivered frame's.
    id: Option<String>,
    created: Option<Value>,
    logical_call_id: String,
    include_usage: bool,
    /// The last usage object an upstream sent, as sent.
    upstream_usage: Option<Value>,
    /// Legs whose chunks reached the client.
    legs: u32,
    /// Chunks written.
    chunks: u64,
    done: bool,
    keepalive: std::time::Duration,
    tick: Pin<Box<Sleep>>,
    cut: Signal,
    gone: Signal,
    /// The scope's call slot, held until the stream ends.
    _slot: Slot,
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

    fn model(&self) -> String {
        self.commit
            .as_ref()
            .map(|c| c.model.clone())
            .unwrap_or_default()
    }

    /// The upstream's frame text when it can go to the client exactly as received:
    /// kept as text by the transport (no usage, no error, one line), after the frame
    /// that named the stream, with the stream's id and created, an `object`, a model
    /// and choices — everything [`SseState::chunk`] would otherwise set or check.
    fn verbatim<'d>(&self, d: &'d StreamDelta) -> Option<&'d str> {
        let t = d.raw_text.as_ref().filter(|_| d.raw.is_none())?;
        let id = self.id.as_deref()?;
        let created = self.created.as_ref().and_then(Value::as_u64);
        let same = t.id.as_deref() == Some(id)
            && t.created.is_some()
            && t.created == created
            && t.has_object
            && t.choices > 0
            && d.model.is_some();
        same.then_some(t.json.as_str())
    }

    /// One upstream chunk as the client sees it, or `None` when nothing is left to send
    /// (a frame that carried only usage).
    fn chunk(&mut self, mut d: StreamDelta) -> Option<Value> {
        let raw = match d.raw.take() {
            Some(o) => Some(o),
            None => d.raw_object().map(std::borrow::Cow::into_owned),
        };
        let mut obj: Map<String, Value> = match raw {
            Some(o) => o,
            None => match chunk_json(&self.id(), &self.model(), 0, &d) {
                Some(Value::Object(o)) => o,
                _ => return None,
            },
        };
        // Usage goes out once, at the end: a frame keeps its `usage` key, as null.
        if let Some(u) = obj.get_mut("usage").filter(|u| u.is_object()) {
            self.upstream_usage = Some(u.take());
        }
        if let Some(choices) = obj.get_mut("choices").and_then(Value::as_array_mut) {
            for c in choices.iter_mut() {
                if let Some(u) = c.get_mut("usage").filter(|u| u.is_object()) {
                    self.upstream_usage = Some(u.take());
                }
            }
        }
        let has_choices = obj
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|c| !c.is_empty());
        let extras = obj
            .iter()
            .any(|(k, v)| !ENVELOPE.contains(&k.as_str()) && !v.is_null());
        if !has_choices && !extras {
            return None;
        }
        if self.id.is_none() {
            // The first delivered frame names the stream.
            self.id = Some(
                obj.get("id")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("chatcmpl-{}", self.logical_call_id)),
            );
            self.created = Some(
                obj.get("created")
                    .filter(|c| c.as_u64().is_some_and(|t| t > 0))
                    .cloned()
                    .unwrap_or_else(|| json!(unix_now())),
            );
        }
        // Every frame carries the stream's id and created (a resumed stream's later
        // legs have their own); most already do, and are left as they are.
        if obj.get("id").and_then(Value::as_str) != self.id.as_deref() {
            obj.insert("id".into(), json!(self.id()));
        }
        if obj.get("created") != self.created.as_ref() {
            obj.insert("created".into(), self.created());
        }
        obj.entry("object")
            .or_insert_with(|| json!("chat.completion.chunk"));
        let named = obj
            .get("model")
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty());
        if !named {
            obj.insert("model".into(), json!(self.model()));
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
                self.commit = Some(c);
            }
            Ok(ChatEvent::Delta(d)) => {
                if let Some(text) = self.verbatim(&d) {
                    self.chunks += 1;
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(text.as_bytes());
                    out.extend_from_slice(b"\n\n");
                } else if let Some(v) = self.chunk(d) {
                    self.chunks += 1;
                    sse(out, &v);
                }
            }
            Ok(ChatEvent::Done(r)) => {
                if self.chunks == 0 {
                    // Nothing was streamed (an answer from the cache after the
                    // keepalives started): the whole answer as one chunk.
                    for c in whole_answer_chunks(&r, &self.id()) {
                        sse(out, &c);
                    }
                }
                if self.include_usage {
                    let u = self.usage_chunk(&r);
                    sse(out, &u);
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                self.done = true;
            }
            Err(e) => {
                tracing::warn!(error = %e, "stream failed after its headers");
                sse(out, &from_gateway(&e).body());
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
            let mut out = Vec::new();
            let waiting = self.commit.is_none();
            tokio::select! {
                biased;
                () = &mut self.cut => {
                    sse(&mut out, &shutting_down().body());
                    self.done = true;
                }
                () = &mut self.gone => {
                    // The call is dropped with this state (every leg cancelled).
                    let e = ApiError::new(
                        StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
                        "invalid_request_error",
                        "client_closed_request",
                        "the client closed its side of the connection: the call was cancelled",
                    );
                    sse(&mut out, &e.body());
                    self.done = true;
                }
                item = self.stream.next() => {
                    match item {
                        None => self.done = true,
                        Some(item) => self.push_event(&mut out, item),
                    }
                    let mut n = 1;
                    while !self.done && n < MAX_BATCH {
                        match self.stream.next().now_or_never() {
                            Some(Some(item)) => {
                                self.push_event(&mut out, item);
                                n += 1;
                            }
                            Some(None) => self.done = true,
                            None => break,
                        }
                    }
                }
                () = &mut self.tick, if waiting => {
                    out.extend_from_slice(b": keepalive\n\n");
                    let next = Instant::now() + self.keepalive;
                    self.tick.as_mut().reset(next);
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

/// An answer that was never streamed, as chunks (role and text, then finish).
fn whole_answer_chunks(r: &LlmResponse, id: &str) -> Vec<Value> {
    let created = unix_now();
    let d = StreamDelta {
        role: Some("assistant".into()),
        content: (!r.content.is_empty() || r.tool_calls.is_empty()).then(|| r.content.clone()),
        reasoning: r.reasoning_content.clone(),
        tool_calls: r
            .tool_calls
            .iter()
            .map(|t| polygw::ToolCallDelta {
                index: t.index,
                id: t.id.clone(),
                name: t.name.clone(),
                arguments: t.arguments.clone(),
            })
            .collect(),
        finish_reason: r.finish_reason.clone(),
        ..Default::default()
    };
    chunk_json(id, &r.model, created, &d).into_iter().collect()
}

fn signal(f: impl Future<Output = ()> + Send + 'static) -> Signal {
    Box::pin(f)
}

/// Runs a streamed chat and answers with passthrough SSE, or an error status when the
/// call fails before its first chunk and before the keepalives started.
pub async fn respond(
    st: Arc<AppState>,
    client: GatewayClient,
    request: ChatRequest,
    include_usage: bool,
    options: CallOptions,
    slot: Slot,
    ctx: Option<Arc<ConnCtx>>,
) -> Response {
    let id = options.logical_call_id.clone().unwrap_or_default();
    let keepalive = st.cfg.keepalive;
    let mut stream = client.chat_stream_with(request, options);
    let tick = tokio::time::sleep(keepalive);
    tokio::pin!(tick);
    // Until a leg commits, the call ends, or the keepalives start.
    let commit: Option<Commit> = loop {
        tokio::select! {
            biased;
            ev = stream.next() => match ev {
                Some(Ok(ChatEvent::Committed(c))) => break Some(c),
                // Chunks come after their leg's commit.
                Some(Ok(ChatEvent::Delta(_))) => {}
                Some(Ok(ChatEvent::Done(r))) => return one_shot(*r, include_usage),
                Some(Err(e)) => return gateway_error(&e, &id),
                None => {
                    let mut r = error_response(&ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "internal",
                        "the call ended without an answer",
                    ));
                    set_request_id(r.headers_mut(), &id);
                    return r;
                }
            },
            () = client_gone(&ctx) => return client_closed(),
            () = cut_done(st.cut_signal()) => {
                let mut r = error_response(&shutting_down());
                set_request_id(r.headers_mut(), &id);
                return r;
            }
            () = &mut tick => break None,
        }
    };
    let gone: Signal = match ctx {
        Some(c) => signal(async move { c.closed().await }),
        None => signal(std::future::pending()),
    };
    let state = SseState {
        stream,
        commit: commit.clone(),
        id: None,
        created: None,
        logical_call_id: id.clone(),
        include_usage,
        upstream_usage: None,
        legs: u32::from(commit.is_some()),
        chunks: 0,
        done: false,
        keepalive,
        tick: Box::pin(tokio::time::sleep(std::time::Duration::ZERO)),
        cut: signal(cut_done(st.cut_signal())),
        gone,
        _slot: slot,
    };
    let body = futures_util::stream::unfold(state, |mut s| async move {
        s.next_bytes()
            .await
            .map(|b| (Ok::<Bytes, std::io::Error>(b), s))
    });
    let mut resp = Response::new(Body::from_stream(body));
    stream_headers(&mut resp, &id);
    if let Some(c) = &commit {
        commit_headers(&mut resp, c);
    }
    resp
}

fn stream_headers(resp: &mut Response, logical_call_id: &str) {
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Proxies in front (nginx) must not buffer the stream.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    set_request_id(h, logical_call_id);
}

fn commit_headers(resp: &mut Response, c: &Commit) {
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&c.source) {
        h.insert(names::X_SOURCE, v);
    }
    h.insert(
        names::X_HEDGED,
        HeaderValue::from_static(if c.is_hedge { "true" } else { "false" }),
    );
}

/// A streamed answer that ended without any leg being committed (an answer from the
/// cache): the whole answer as one chunk, the usage chunk when asked for, `[DONE]`.
fn one_shot(r: LlmResponse, include_usage: bool) -> Response {
    let id = format!("chatcmpl-{}", r.logical_call_id);
    let created = unix_now();
    let mut body = Vec::new();
    for c in whole_answer_chunks(&r, &id) {
        sse(&mut body, &c);
    }
    if include_usage {
        let usage = match r.usage_source {
            UsageSource::Unavailable => Value::Null,
            _ => usage_json(&r.usage),
        };
        let mut u = json!({
            "id": id, "object": "chat.completion.chunk", "created": created,
            "model": r.model, "choices": [], "usage": usage,
        });
        if r.usage_source != UsageSource::Measured {
            u["polygw"] = json!({"usage_source": r.usage_source.as_str()});
        }
        sse(&mut body, &u);
    }
    body.extend_from_slice(b"data: [DONE]\n\n");
    let mut resp = Response::new(Body::from(body));
    stream_headers(&mut resp, &r.logical_call_id);
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&r.source) {
        h.insert(names::X_SOURCE, v);
    }
    h.insert(
        names::X_HEDGED,
        HeaderValue::from_static(if r.call_stats.hedge_won {
            "true"
        } else {
            "false"
        }),
    );
    h.insert(
        names::X_USAGE_SOURCE,
        HeaderValue::from_static(r.usage_source.as_str()),
    );
    resp
}
