//! Passthrough streaming for `/v1/chat/completions` with `stream: true`.
//!
//! The call's future is polled by the handler until a leg commits (its first
//! incremental chunk): a call that fails before that gets a proper HTTP error status.
//! From the commit on, the response is an SSE body that owns the call's future and
//! forwards the committed leg's chunks as they arrive; a later failure ends the stream
//! with an error event, never with a silent `[DONE]`. If the client goes away, the body
//! (and with it the call) is dropped: every leg is cancelled (`cancelled` rows).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use polygw::{
    ChatRequest, Commit, DeltaSink, GatewayClient, GatewayError, LlmResponse, StreamDelta,
};
use tokio::sync::mpsc;

use super::openai::{chunk_json, usage_chunk_json, ApiError};
use super::{api_error_response, unix_now};

enum Event {
    Commit(Commit),
    Delta(StreamDelta),
}

struct ChannelSink(mpsc::UnboundedSender<Event>);

impl DeltaSink for ChannelSink {
    fn committed(&self, commit: &Commit) {
        let _ = self.0.send(Event::Commit(commit.clone()));
    }
    fn send(&self, delta: &StreamDelta) {
        let _ = self.0.send(Event::Delta(delta.clone()));
    }
}

type CallFuture = Pin<Box<dyn Future<Output = Result<LlmResponse, GatewayError>> + Send>>;

struct SseState {
    call: Option<CallFuture>,
    rx: mpsc::UnboundedReceiver<Event>,
    rx_open: bool,
    pending: VecDeque<Bytes>,
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
    done: bool,
}

fn sse(v: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

impl SseState {
    fn push_delta(&mut self, d: &StreamDelta) {
        // Usage is sent once, at the end, from the final figures (when asked for).
        if let Some(c) = chunk_json(&self.id, &self.model, self.created, d) {
            self.pending.push_back(sse(&c));
        }
    }

    fn finish(&mut self, result: Result<LlmResponse, GatewayError>) {
        while let Ok(ev) = self.rx.try_recv() {
            if let Event::Delta(d) = ev {
                self.push_delta(&d);
            }
        }
        match result {
            Ok(r) => {
                if self.include_usage {
                    self.pending.push_back(sse(&usage_chunk_json(
                        &self.id,
                        &r.model,
                        self.created,
                        &r.usage,
                    )));
                }
                self.pending
                    .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            }
            Err(e) => {
                tracing::warn!(error = %e, "stream failed after its first chunk");
                let err = ApiError::from_gateway(&e);
                self.pending.push_back(sse(&err.body()));
            }
        }
        self.done = true;
    }

    async fn next_bytes(&mut self) -> Option<Bytes> {
        loop {
            if let Some(b) = self.pending.pop_front() {
                return Some(b);
            }
            if self.done {
                return None;
            }
            let call = self.call.as_mut()?;
            tokio::select! {
                biased;
                ev = self.rx.recv(), if self.rx_open => match ev {
                    Some(Event::Delta(d)) => self.push_delta(&d),
                    Some(Event::Commit(_)) => {}
                    None => self.rx_open = false,
                },
                r = call => {
                    self.call = None;
                    self.finish(r);
                }
            }
        }
    }
}

/// Runs a streamed chat and answers with passthrough SSE (or an error status when the
/// call fails before its first chunk).
pub async fn respond(client: GatewayClient, request: ChatRequest, include_usage: bool) -> Response {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut call: CallFuture = Box::pin(async move {
        client
            .chat_streaming(request, Arc::new(ChannelSink(tx)))
            .await
    });
    // Phase 1: until a leg commits, or the call ends. A whole answer can arrive in one
    // read, so the call may end in the same poll that committed: look for the commit in
    // the channel before treating the call as ended without one.
    let (commit, early) = loop {
        tokio::select! {
            biased;
            ev = rx.recv() => match ev {
                Some(Event::Commit(c)) => break (c, None),
                Some(Event::Delta(_)) | None => {}
            },
            r = &mut call => {
                let mut commit = None;
                while let Ok(ev) = rx.try_recv() {
                    if let Event::Commit(c) = ev {
                        commit = Some(c);
                        break;
                    }
                }
                match (commit, r) {
                    (Some(c), r) => break (c, Some(r)),
                    (None, Err(e)) => return api_error_response(&ApiError::from_gateway(&e)),
                    (None, Ok(r)) => return one_shot(r, include_usage),
                }
            }
        }
    };
    let mut state = SseState {
        call: if early.is_some() { None } else { Some(call) },
        rx,
        rx_open: true,
        pending: VecDeque::new(),
        id: format!("chatcmpl-{}", commit.logical_call_id),
        model: commit.model.clone(),
        created: unix_now(),
        include_usage,
        done: false,
    };
    if let Some(r) = early {
        state.finish(r);
    }
    // The commit event precedes the first deltas in the channel: nothing is lost.
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        s.next_bytes()
            .await
            .map(|b| (Ok::<Bytes, std::io::Error>(b), s))
    });
    let mut resp = Response::new(Body::from_stream(stream));
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

/// A streamed answer that ended without its commit reaching the sink (it generated no
/// incremental chunk): one chunk with the whole answer, the usage chunk when asked
/// for, `[DONE]`, and the usual headers.
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
    let mut body = String::new();
    if let Some(c) = chunk_json(&id, &r.model, created, &d) {
        body.push_str(&format!("data: {c}\n\n"));
    }
    if include_usage {
        let u = usage_chunk_json(&id, &r.model, created, &r.usage);
        body.push_str(&format!("data: {u}\n\n"));
    }
    body.push_str("data: [DONE]\n\n");
    let mut resp = Response::new(Body::from(body));
    stream_headers(
        &mut resp,
        &r.logical_call_id,
        &r.source,
        r.call_stats.hedge_won,
    );
    resp
}
