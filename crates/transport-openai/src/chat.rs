//! Chat over `/chat/completions`: the plain call (whole-request timeout), the streamed
//! call (SSE, watchdogs, incremental chunks, salvage) and OCR (a plain vision call).

use std::time::{Duration, Instant};

use async_trait::async_trait;
use base64::Engine as _;
use polygw_core::body::{chat_body_bytes, ocr_body};
use polygw_core::classify::Failure;
use polygw_core::native::{self, NativeReader, NativeRequest, ReadError as NativeReadError};
use polygw_core::ports::{
    ChatAttempt, ChunkObserver, Clock, NativeAnswer, NativeCall, NullObserver, OcrResult,
    OcrTransport, StreamDelta, ToolCallDelta, Transport, TransportResult,
};
use polygw_core::request::ClientCredential;
use polygw_core::source::{SourceApi, SourceAuth};
use polygw_core::stall::StallMeter;
use polygw_core::{AttemptError, ErrorClass, SourceConfig, Usage, UsageSource};
use serde_json::{Map, Value};
use tokio::time::Instant as TokioInstant;

use crate::aggregate::{
    choice0, error_body, in_band_error, Aggregate, FrameOutcome, StreamAggregator,
};
use crate::failure::{fail, http_failure, retry_after, send_failure};
use crate::sse::{SseError, SseEvent, SseParser};
use crate::{OpenAiTransport, TransportConfig};

/// Why reading a body stopped early.
pub(crate) enum ReadError {
    TooLarge,
    Broken(reqwest::Error),
}

/// Reads a whole body, failing past `cap` bytes (checked against Content-Length first).
/// The attempt's W3C `traceparent` (SPEC §26.1: the upstream request continues the
/// caller's trace under the attempt's span), when the call is traced.
fn traced(rb: reqwest::RequestBuilder, traceparent: Option<&str>) -> reqwest::RequestBuilder {
    match traceparent.and_then(|t| reqwest::header::HeaderValue::from_str(t).ok()) {
        Some(v) => rb.header("traceparent", v),
        None => rb,
    }
}

pub(crate) async fn read_capped(
    mut resp: reqwest::Response,
    cap: usize,
) -> Result<Vec<u8>, ReadError> {
    if resp.content_length().is_some_and(|n| n > cap as u64) {
        return Err(ReadError::TooLarge);
    }
    let mut buf = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(ReadError::Broken)? {
        if buf.len() + chunk.len() > cap {
            return Err(ReadError::TooLarge);
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf)
}

/// Reads at most `cap` bytes of an (error) body; a broken body gives what was read.
pub(crate) async fn read_prefix(mut resp: reqwest::Response, cap: usize) -> Vec<u8> {
    let mut buf = Vec::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        let room = cap.saturating_sub(buf.len());
        buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if buf.len() >= cap {
            break;
        }
    }
    buf
}

/// The failure of a non-2xx response (reads a bounded prefix of the error body).
/// The response headers a proxy passes on (SPEC §17.4).
fn passed(h: &reqwest::header::HeaderMap) -> Vec<(String, String)> {
    polygw_core::ports::passed_headers(h.iter().map(|(n, v)| (n.as_str(), v.as_bytes())))
}

pub(crate) async fn status_failure(resp: reqwest::Response, cfg: &TransportConfig) -> Failure {
    let status = resp.status().as_u16();
    let ra = retry_after(resp.headers());
    let body = read_prefix(resp, cfg.max_error_body_bytes).await;
    http_failure(status, ra, error_body(&body))
}

/// Attaches measured usage to result-invalid failures (SPEC §4.3 settles it).
fn with_usage_if_invalid(e: AttemptError, usage: Option<Usage>) -> AttemptError {
    match usage {
        Some(u) if e.class == ErrorClass::Invalid => e.with_usage(u, UsageSource::Measured),
        _ => e,
    }
}

fn in_band(pe: crate::aggregate::ProviderError) -> Failure {
    Failure::InBand {
        status: pe.status,
        code: pe.code,
        message: pe.message,
    }
}

fn sse_failure(e: SseError) -> Failure {
    match e {
        SseError::LineTooLong { limit } | SseError::EventTooLarge { limit } => {
            Failure::TooLarge { limit }
        }
    }
}

/// Parses a 2xx plain body into a JSON object (empty, invalid or non-object → invalid).
pub(crate) fn parse_object(body: &[u8]) -> Result<Map<String, Value>, Failure> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(Failure::Malformed {
            detail: "empty response body".into(),
        });
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(Failure::Malformed {
            detail: "the response body is not a JSON object".into(),
        }),
        Err(e) => Err(Failure::Malformed {
            detail: format!("invalid JSON body ({e})"),
        }),
    }
}

/// Folds a plain completion object; checks in-band errors, choices and caps.
fn plain_aggregate(
    obj: &Map<String, Value>,
    cfg: &TransportConfig,
) -> Result<Aggregate, PlainError> {
    if let Some(pe) = in_band_error(obj) {
        return Err(PlainError(in_band(pe), None));
    }
    let has_choices = obj
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty());
    let usage = crate::aggregate::frame_usage(obj).map(|(u, _)| u);
    if !has_choices {
        return Err(PlainError(
            Failure::Malformed {
                detail: "no choices in the response".into(),
            },
            usage.map(Box::new),
        ));
    }
    let Some(choice) = choice0(obj) else {
        return Err(PlainError(
            Failure::Malformed {
                detail: "no choice with index 0 in the response".into(),
            },
            usage.map(Box::new),
        ));
    };
    let mut agg = StreamAggregator::new();
    agg.absorb_completion(obj, choice);
    if agg.content_bytes() > cfg.max_content_bytes {
        return Err(PlainError(
            Failure::TooLarge {
                limit: cfg.max_content_bytes,
            },
            usage.map(Box::new),
        ));
    }
    let a = agg.finish();
    if !a.generated_anything() && a.finish_reason.as_deref() != Some("length") {
        return Err(PlainError(
            Failure::NothingGenerated {
                finish_reason: a.finish_reason.clone(),
            },
            a.usage.map(Box::new),
        ));
    }
    Ok(a)
}

/// [`plain_aggregate`] of a body in the common shape, read typed
/// ([`StreamAggregator::absorb_completion_typed`]); `None` when the body is not in
/// that shape or the answer fails a check (the general path then says why).
pub(crate) fn plain_typed(body: &[u8], cfg: &TransportConfig) -> Option<Aggregate> {
    let mut agg = StreamAggregator::new();
    agg.absorb_completion_typed(body)?;
    if agg.content_bytes() > cfg.max_content_bytes {
        return None;
    }
    let a = agg.finish();
    (a.generated_anything() || a.finish_reason.as_deref() == Some("length")).then_some(a)
}

/// The body of an attempt, and the native request it was made from: a `messages`
/// source gets the client's own body ([`NativeRequest::body_for`]); a chat source the
/// chat form.
#[allow(clippy::result_large_err)] // the port's error type
fn attempt_body<'r>(
    attempt: &ChatAttempt<'r>,
) -> Result<(Option<&'r NativeRequest>, Vec<u8>), AttemptError> {
    let source = attempt.source;
    let req = attempt.request;
    if source.api == SourceApi::Chat {
        return Ok((None, chat_body_bytes(source, req)));
    }
    match req.native_for(source.api) {
        Some(n) => {
            let body = n.body_for(&source.model, req.stream, &source.extra_body);
            Ok((Some(n), serde_json::to_vec(&body).unwrap_or_default()))
        }
        // The engine does not pick such a source (ChatRequest::servable_by).
        None => Err(AttemptError::new(
            ErrorClass::Rejected,
            polygw_core::ErrorLabel::Rejected,
            format!(
                "source {} speaks the {} API and this request is not in it",
                source.name,
                source.api.as_str()
            ),
        )),
    }
}

/// With `AUTH=client`, a 401, 402 or 403 is about the client's own credential or
/// account, not the source's: the client's error to see (a rejection, passed through),
/// and no reason to put the source out for every other client (SPEC §23.1).
fn client_credential_failure(source: &SourceConfig, mut e: AttemptError) -> AttemptError {
    if source.effective_auth() == SourceAuth::Client && matches!(e.http_status, Some(401..=403)) {
        e.class = ErrorClass::Rejected;
        e.label = polygw_core::ErrorLabel::Rejected;
    }
    e
}

/// Folds a plain native answer; checks an error body and the content cap.
fn native_aggregate(
    api: SourceApi,
    obj: &Map<String, Value>,
    cfg: &TransportConfig,
) -> Result<Aggregate, PlainError> {
    let m = native::read_plain(api, obj).map_err(|e| {
        PlainError(
            Failure::InBand {
                status: None,
                code: e.kind,
                message: e.message,
            },
            None,
        )
    })?;
    let mut agg = StreamAggregator::new();
    let usage = m.usage;
    agg.fold_delta(&StreamDelta {
        content: Some(m.content),
        reasoning: Some(m.reasoning),
        tool_calls: m
            .tool_calls
            .into_iter()
            .map(|(index, id, name, arguments)| ToolCallDelta {
                index,
                id,
                name,
                arguments,
            })
            .collect(),
        finish_reason: m.finish_reason,
        usage,
        model: m.model,
        ..StreamDelta::default()
    });
    if agg.content_bytes() > cfg.max_content_bytes {
        return Err(PlainError(
            Failure::TooLarge {
                limit: cfg.max_content_bytes,
            },
            usage.map(Box::new),
        ));
    }
    let a = agg.finish();
    if !m.has_blocks && a.finish_reason.as_deref() != Some("length") {
        return Err(PlainError(
            Failure::NothingGenerated {
                finish_reason: a.finish_reason.clone(),
            },
            usage.map(Box::new),
        ));
    }
    Ok(a)
}

/// A failure plus the usage seen before it.
pub(crate) struct PlainError(Failure, Option<Box<Usage>>);

impl PlainError {
    fn into_error(self, key: &str) -> AttemptError {
        with_usage_if_invalid(fail(self.0, key), self.1.map(|u| *u))
    }
}

fn result_of(a: Aggregate, http_status: u16, salvaged: bool) -> TransportResult {
    let usage_source = match (a.usage.is_some(), salvaged) {
        (false, _) => UsageSource::Unavailable,
        (true, false) => UsageSource::Measured,
        (true, true) => UsageSource::Estimated,
    };
    TransportResult {
        content: a.content,
        reasoning_content: (!a.reasoning.is_empty()).then_some(a.reasoning),
        tool_calls: a.tool_calls,
        finish_reason: a.finish_reason,
        model: a.model,
        usage: a.usage.unwrap_or_default(),
        usage_source,
        http_status,
        stream: None,
        salvaged,
        raw: None,
        raw_body: None,
        raw_usage_object: false,
        upstream_headers: Vec::new(),
    }
}

impl OpenAiTransport {
    /// A plain POST under the whole-request timeout; returns the status, whether the
    /// body is an event stream, and the (capped) body of a 2xx response.
    async fn plain_bytes(
        &self,
        source: &SourceConfig,
        rb: reqwest::RequestBuilder,
    ) -> Result<(u16, bool, Vec<u8>, Vec<(String, String)>), AttemptError> {
        let key = source.api_key.expose();
        let cfg = &self.inner.cfg;
        let work = async {
            let resp = rb.send().await.map_err(|e| (send_failure(&e, key), None))?;
            let status = resp.status().as_u16();
            if !resp.status().is_success() {
                return Err((status_failure(resp, cfg).await, None));
            }
            let headers = passed(resp.headers());
            let is_sse = resp
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|ct| ct.trim_start().starts_with("text/event-stream"));
            let body = read_capped(resp, cfg.max_body_bytes)
                .await
                .map_err(|e| match e {
                    ReadError::TooLarge => (
                        Failure::TooLarge {
                            limit: cfg.max_body_bytes,
                        },
                        Some(status),
                    ),
                    // A 200 whose body broke off: the request was answered, the answer
                    // cut (issue 22, item 16: not a connection failure).
                    ReadError::Broken(e) => (
                        Failure::Truncated {
                            detail: format!(
                                "the body broke off: {}",
                                crate::failure::describe(&e, key)
                            ),
                        },
                        Some(status),
                    ),
                })?;
            Ok((status, is_sse, body, headers))
        };
        match tokio::time::timeout(source.timeout, work).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err((f, status))) => {
                let e = fail(f, key);
                Err(match status {
                    Some(s) => e.with_status(s),
                    None => e,
                })
            }
            Err(_) => Err(fail(Failure::Timeout, key)),
        }
    }

    /// A plain POST whose 2xx body must be a JSON object (embeddings).
    pub(crate) async fn plain_object(
        &self,
        source: &SourceConfig,
        path: &str,
        body: &Value,
        call_id: &str,
    ) -> Result<(u16, Map<String, Value>), AttemptError> {
        let body = serde_json::to_vec(body).unwrap_or_default();
        let rb = self.post(source, path, body, call_id, false);
        let (status, _, bytes, _) = self.plain_bytes(source, rb).await?;
        let obj = parse_object(&bytes).map_err(|f| fail(f, source.api_key.expose()))?;
        Ok((status, obj))
    }

    /// A plain chat completion (chat and OCR). An upstream that streams anyway
    /// (`text/event-stream`) is aggregated with the stream rules.
    async fn plain_chat(
        &self,
        source: &SourceConfig,
        client: Option<&ClientCredential>,
        body: Vec<u8>,
        call_id: &str,
        traceparent: Option<&str>,
    ) -> Result<TransportResult, AttemptError> {
        let key = source.api_key.expose();
        let rb = self.post_attempt(source, None, client, body, call_id, false);
        let rb = traced(rb, traceparent);
        let (status, is_sse, bytes, headers) = self.plain_bytes(source, rb).await?;
        if is_sse {
            let mut r = self.sse_as_plain(source, &bytes, status)?;
            r.upstream_headers = headers;
            return Ok(r);
        }
        // The common shape is read typed, without a `Value` tree; anything else (and
        // every failure) the general way.
        let mut usage_object = false;
        let (a, obj) = match plain_typed(&bytes, &self.inner.cfg) {
            Some(a) => {
                usage_object = a.usage_location == Some(crate::aggregate::UsageLocation::TopLevel);
                (a, None)
            }
            None => {
                let obj = parse_object(&bytes).map_err(|f| fail(f, key))?;
                let a = plain_aggregate(&obj, &self.inner.cfg).map_err(|e| e.into_error(key))?;
                (a, Some(obj))
            }
        };
        let mut r = result_of(a, status, false);
        r.raw = obj;
        r.raw_body = Some(bytes);
        r.raw_usage_object = usage_object;
        r.upstream_headers = headers;
        Ok(r)
    }

    /// A whole SSE body received for a plain request, folded with the stream rules
    /// (no observer calls, no figures).
    #[allow(clippy::result_large_err)] // the port's error type
    fn sse_as_plain(
        &self,
        source: &SourceConfig,
        bytes: &[u8],
        status: u16,
    ) -> Result<TransportResult, AttemptError> {
        let key = source.api_key.expose();
        let cfg = &self.inner.cfg;
        let null = NullObserver;
        let mut st = StreamState {
            native: NativeReader::for_api(source.api),
            patient: false,
            agg: StreamAggregator::new(),
            meter: StallMeter::new(self.inner.clock.now(), Duration::MAX),
            observer: &null,
            wants: false,
            wants_raw: false,
            clock: self.inner.clock.as_ref(),
            max_content: cfg.max_content_bytes,
            done: false,
            events_seen: 0,
        };
        let mut parser = SseParser::with_limits(cfg.max_body_bytes, cfg.max_body_bytes);
        let mut events = Vec::new();
        parser
            .feed(bytes, &mut events)
            .map_err(|e| st.error(sse_failure(e), key))?;
        let mut at = None;
        let mut end = End::Eof;
        for ev in events {
            st.on_event(ev, &mut at).map_err(|f| st.error(f, key))?;
            if st.done {
                end = End::Done;
                break;
            }
        }
        if !st.done {
            match parser.finish() {
                Ok(None) => {}
                Ok(Some(ev)) => match st.on_event(ev, &mut at) {
                    Ok(_) => {}
                    Err(Failure::Malformed { .. }) => {
                        end = End::Broken("the body ended inside an event".into())
                    }
                    Err(f) => return Err(st.error(f, key)),
                },
                Err(e) => return Err(st.error(sse_failure(e), key)),
            }
        }
        let mut r = st.finalize(
            end,
            status,
            source.ttft_budget(),
            source.inter_token_budget(),
            key,
        )?;
        r.stream = None;
        Ok(r)
    }

    async fn chat_plain(&self, attempt: ChatAttempt<'_>) -> Result<TransportResult, AttemptError> {
        if attempt.source.api != SourceApi::Chat {
            return self.native_plain(attempt).await;
        }
        let body = chat_body_bytes(attempt.source, attempt.request);
        let client = attempt.request.client_credential.as_ref();
        self.plain_chat(
            attempt.source,
            client,
            body,
            attempt.call_id,
            attempt.traceparent,
        )
        .await
    }

    /// A plain call to a native source: the client's body with the edits of SPEC
    /// §23.2; the answer is read for the engine and kept as received for the client.
    async fn native_plain(
        &self,
        attempt: ChatAttempt<'_>,
    ) -> Result<TransportResult, AttemptError> {
        let source = attempt.source;
        let key = source.api_key.expose();
        let (native, body) = attempt_body(&attempt)?;
        let client = attempt.request.client_credential.as_ref();
        let rb = self.post_attempt(source, native, client, body, attempt.call_id, false);
        let rb = traced(rb, attempt.traceparent);
        let (status, is_sse, bytes, headers) = self.plain_bytes(source, rb).await?;
        if is_sse {
            let mut r = self.sse_as_plain(source, &bytes, status)?;
            r.upstream_headers = headers;
            return Ok(r);
        }
        let obj = parse_object(&bytes).map_err(|f| fail(f, key))?;
        let a =
            native_aggregate(source.api, &obj, &self.inner.cfg).map_err(|e| e.into_error(key))?;
        let mut r = result_of(a, status, false);
        r.raw = Some(obj);
        r.raw_body = Some(bytes);
        r.upstream_headers = headers;
        Ok(r)
    }

    async fn chat_stream(&self, attempt: ChatAttempt<'_>) -> Result<TransportResult, AttemptError> {
        let source = attempt.source;
        let key = source.api_key.expose();
        let cfg = &self.inner.cfg;
        let (native, bytes) = attempt_body(&attempt)?;
        let client = attempt.request.client_credential.as_ref();
        let rb = self.post_attempt(source, native, client, bytes, attempt.call_id, true);
        let rb = traced(rb, attempt.traceparent);

        let ttft_budget = source.ttft_budget();
        let itb = source.inter_token_budget();
        let start = self.inner.clock.now();
        let watchdog = tokio::time::sleep(ttft_budget);
        tokio::pin!(watchdog);
        // The whole attempt's bound (TransportConfig::stream_time_factor).
        let bound = stream_bound(source, cfg.stream_time_factor);
        let bound_sleep = tokio::time::sleep(bound.unwrap_or(Duration::MAX / 4));
        tokio::pin!(bound_sleep);

        let resp = tokio::select! {
            biased;
            r = rb.send() => r.map_err(|e| fail(send_failure(&e, key), key))?,
            () = &mut watchdog => return Err(fail(Failure::TtftTimeout { budget: ttft_budget }, key)),
        };
        let status = resp.status().as_u16();
        if !resp.status().is_success() {
            let f = tokio::select! {
                biased;
                f = status_failure(resp, cfg) => f,
                // Keep the status even when the error body never comes.
                () = &mut watchdog => http_failure(status, None, None),
            };
            return Err(fail(f, key));
        }

        let headers = passed(resp.headers());
        attempt.observer.on_headers(&headers);
        let mut st = StreamState::new(&attempt, self);
        st.meter = StallMeter::new(start, attempt.stall_threshold);

        let is_json = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.trim_start().starts_with("application/json"));
        if is_json {
            // The upstream ignored `stream: true` and answered with a plain completion.
            let body = tokio::select! {
                biased;
                b = read_capped(resp, cfg.max_body_bytes) => b,
                () = &mut watchdog => return Err(fail(Failure::TtftTimeout { budget: ttft_budget }, key)),
            };
            let body = body.map_err(|e| match e {
                ReadError::TooLarge => fail(
                    Failure::TooLarge {
                        limit: cfg.max_body_bytes,
                    },
                    key,
                ),
                ReadError::Broken(e) => fail(
                    Failure::Truncated {
                        detail: format!(
                            "the body broke off: {}",
                            crate::failure::describe(&e, key)
                        ),
                    },
                    key,
                ),
            })?;
            let obj = parse_object(&body).map_err(|f| fail(f, key))?;
            let a = if source.api == SourceApi::Chat {
                plain_aggregate(&obj, cfg)
            } else {
                native_aggregate(source.api, &obj, cfg)
            }
            .map_err(|e| e.into_error(key))?;
            st.plain_as_chunk(&a);
            let mut r = result_of(a, status, false);
            r.upstream_headers = headers.clone();
            r.stream = Some(st.meter.figures());
            return Ok(r);
        }

        let line_cap = cfg.max_sse_line_bytes.min(cfg.max_body_bytes);
        let mut parser = SseParser::with_limits(line_cap, line_cap);
        let mut events: Vec<SseEvent> = Vec::new();
        let mut total: u64 = 0;
        let mut finish_seen = false;
        let mut resp = resp;
        let end = loop {
            let next = tokio::select! {
                biased;
                c = resp.chunk() => c,
                () = &mut watchdog => break End::Watchdog,
                () = &mut bound_sleep, if bound.is_some() => break End::Bound,
            };
            match next {
                Ok(Some(chunk)) => {
                    total += chunk.len() as u64;
                    if total > cfg.max_stream_bytes {
                        return Err(st.error(
                            Failure::TooLarge {
                                limit: usize::try_from(cfg.max_stream_bytes).unwrap_or(usize::MAX),
                            },
                            key,
                        ));
                    }
                    parser
                        .feed(&chunk, &mut events)
                        .map_err(|e| st.error(sse_failure(e), key))?;
                    let mut at = None;
                    for ev in events.drain(..) {
                        let incremental = st.on_event(ev, &mut at).map_err(|f| st.error(f, key))?;
                        let finish_now = !finish_seen && st.agg.finish_reason().is_some();
                        let patient = std::mem::take(&mut st.patient);
                        if incremental || finish_now || patient {
                            finish_seen |= finish_now;
                            let now = TokioInstant::now();
                            let budget = if finish_seen {
                                itb.min(cfg.finish_grace)
                            } else if patient {
                                // Silent thinking, a server tool running: the first
                                // token's budget (SPEC §23.4).
                                ttft_budget.max(itb)
                            } else {
                                itb
                            };
                            let next_deadline = now + budget;
                            // After a finish_reason the deadline only shrinks (grace).
                            let deadline = if finish_now && !incremental {
                                watchdog.deadline().min(next_deadline)
                            } else {
                                next_deadline
                            };
                            watchdog.as_mut().reset(deadline);
                        }
                        if st.done {
                            break;
                        }
                    }
                    if st.done {
                        break End::Done;
                    }
                }
                Ok(None) => match parser.finish() {
                    Ok(None) => break End::Eof,
                    Ok(Some(ev)) => {
                        let mut at = None;
                        match st.on_event(ev, &mut at) {
                            Ok(_) => break End::Eof,
                            // An unterminated last event that does not parse is a body
                            // cut mid-frame, not a malformed frame.
                            Err(Failure::Malformed { .. }) => {
                                break End::Broken("the body ended inside an event".into())
                            }
                            Err(f) => return Err(st.error(f, key)),
                        }
                    }
                    Err(e) => return Err(st.error(sse_failure(e), key)),
                },
                Err(e) => break End::Broken(crate::failure::describe(&e, key)),
            }
        };
        drop(resp);
        let mut r = st.finalize(end, status, ttft_budget, itb, key)?;
        r.upstream_headers = headers;
        Ok(r)
    }

    async fn recognize_impl(
        &self,
        source: &SourceConfig,
        image: &[u8],
        mime: &str,
        prompt: &str,
        call_id: &str,
    ) -> Result<OcrResult, AttemptError> {
        let mime = if mime.trim().is_empty() {
            "application/octet-stream"
        } else {
            mime.trim()
        };
        let uri = format!(
            "data:{mime};base64,{}",
            base64::engine::general_purpose::STANDARD.encode(image)
        );
        let body = serde_json::to_vec(&ocr_body(source, &uri, prompt)).unwrap_or_default();
        let r = self.plain_chat(source, None, body, call_id, None).await?;
        Ok(OcrResult {
            text: r.content,
            model: r.model,
            http_status: r.http_status,
        })
    }
}

/// The bound of a whole stream attempt: `factor` × the largest of the source's
/// budgets (`TIMEOUT_S`, TTFT, inter-token), so it never cuts what a watchdog allows
/// for one phase. `None` when `factor` is 0.
fn stream_bound(source: &SourceConfig, factor: u32) -> Option<Duration> {
    (factor > 0).then(|| {
        source
            .timeout
            .max(source.ttft_budget())
            .max(source.inter_token_budget())
            .saturating_mul(factor)
    })
}

/// How a stream stopped being read.
enum End {
    /// `data: [DONE]`.
    Done,
    /// Clean end of the body.
    Eof,
    /// The body broke (connection error, reset, cut mid-event).
    Broken(String),
    /// The watchdog fired.
    Watchdog,
    /// The whole attempt's bound passed (`stream_time_factor`).
    Bound,
}

struct StreamState<'a> {
    /// The reader of a native source's events (`None`: chat frames).
    native: Option<NativeReader>,
    /// The last event said a silence may follow that is no stall (SPEC §23.4).
    patient: bool,
    agg: StreamAggregator,
    meter: StallMeter,
    observer: &'a dyn ChunkObserver,
    wants: bool,
    wants_raw: bool,
    clock: &'a dyn Clock,
    max_content: usize,
    done: bool,
    events_seen: u64,
}

impl<'a> StreamState<'a> {
    /// The state of a new stream of the attempt's source.
    fn new(attempt: &ChatAttempt<'a>, t: &'a OpenAiTransport) -> Self {
        let source = attempt.source;
        let observer = attempt.observer;
        StreamState {
            native: NativeReader::for_api(source.api),
            patient: false,
            agg: StreamAggregator::new(),
            meter: StallMeter::new(t.inner.clock.now(), attempt.stall_threshold),
            observer,
            wants: observer.wants_deltas(),
            wants_raw: observer.wants_raw(),
            clock: t.inner.clock.as_ref(),
            max_content: t.inner.cfg.max_content_bytes,
            done: false,
            events_seen: 0,
        }
    }

    /// Handles one event of a native source (SPEC §23.4).
    fn on_native_event(&mut self, ev: SseEvent, at: &mut Option<Instant>) -> Result<bool, Failure> {
        self.events_seen += 1;
        let Some(reader) = self.native.as_mut() else {
            return Ok(false);
        };
        if ev.data.trim().is_empty() && ev.event.as_deref() != Some("error") {
            return Ok(false);
        }
        let d = match reader.on_event(ev.event.as_deref(), &ev.data) {
            Ok(d) => d,
            Err(NativeReadError::Malformed(detail)) => return Err(Failure::Malformed { detail }),
            Err(NativeReadError::Provider(e)) => {
                return Err(Failure::InBand {
                    status: None,
                    code: e.kind,
                    message: e.message,
                })
            }
        };
        self.done = reader.done();
        self.patient = d.native.as_ref().is_some_and(|n| n.patient);
        let incremental = self.agg.fold_delta(&d);
        if self.agg.content_bytes() > self.max_content {
            return Err(Failure::TooLarge {
                limit: self.max_content,
            });
        }
        let t = *at.get_or_insert_with(|| self.clock.now());
        if incremental {
            self.meter.on_chunk(t);
            if !self.wants {
                self.observer.on_chunk(t);
            }
        }
        if self.wants {
            self.observer.on_delta(t, d);
        }
        Ok(incremental)
    }

    /// A classified failure with the usage seen so far (for result-invalid ones).
    fn error(&self, f: Failure, key: &str) -> AttemptError {
        with_usage_if_invalid(fail(f, key), self.agg.usage())
    }

    /// Handles one SSE event; returns whether it was an incremental chunk.
    fn on_event(&mut self, ev: SseEvent, at: &mut Option<Instant>) -> Result<bool, Failure> {
        if self.native.is_some() {
            return self.on_native_event(ev, at);
        }
        self.events_seen += 1;
        let is_error_event = ev.event.as_deref() == Some("error");
        let mut text = ev.data;
        let data = text.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(false);
        }
        if data.is_empty() {
            if is_error_event {
                return Err(Failure::InBand {
                    status: None,
                    code: None,
                    message: Some("an `error` event without data".into()),
                });
            }
            // An empty `data:` event carries no frame (some servers use it as a ping).
            return Ok(false);
        }
        // The common frame: typed and borrowed, no `Value` tree (declined, untouched,
        // for anything else, which the general path below handles). A caller that
        // wants the upstream's frame gets its text (`raw_text`) from this path and a
        // `Value` (`raw`) from the general one.
        if !is_error_event {
            // The event's own text when it needs no trimming (the common case): a kept
            // frame text is then not a copy.
            let owned = if data.len() == text.len() {
                text
            } else {
                data.to_string()
            };
            match self.agg.feed_typed_owned(owned, self.wants, self.wants_raw) {
                Ok(out) => return self.folded(out, None, at),
                Err(back) => text = back,
            }
        }
        let data = text.trim();
        let obj = match serde_json::from_str::<Value>(data) {
            Ok(Value::Object(o)) => o,
            Ok(_) if is_error_event => {
                return Err(in_band(error_body(data.as_bytes()).unwrap_or_default()))
            }
            Ok(_) => {
                return Err(Failure::Malformed {
                    detail: format!("SSE event #{} is not a JSON object", self.events_seen),
                })
            }
            Err(_) if is_error_event => {
                return Err(in_band(error_body(data.as_bytes()).unwrap_or_default()))
            }
            Err(e) => {
                return Err(Failure::Malformed {
                    detail: format!("invalid JSON in SSE event #{} ({e})", self.events_seen),
                })
            }
        };
        if let Some(pe) = in_band_error(&obj) {
            return Err(in_band(pe));
        }
        if is_error_event {
            return Err(in_band(error_body(data.as_bytes()).unwrap_or_default()));
        }
        let out = self.agg.feed(&obj, self.wants);
        self.folded(out, Some(obj), at)
    }

    /// What follows a folded frame: the content cap, the stall meter, the observer.
    fn folded(
        &mut self,
        out: FrameOutcome,
        obj: Option<Map<String, Value>>,
        at: &mut Option<Instant>,
    ) -> Result<bool, Failure> {
        if self.agg.content_bytes() > self.max_content {
            return Err(Failure::TooLarge {
                limit: self.max_content,
            });
        }
        if out.incremental {
            let t = *at.get_or_insert_with(|| self.clock.now());
            self.meter.on_chunk(t);
            if !self.wants {
                self.observer.on_chunk(t);
            }
        }
        if let Some(mut d) = out.delta {
            if self.wants_raw && d.raw_text.is_none() {
                d.raw = obj;
            }
            let t = *at.get_or_insert_with(|| self.clock.now());
            self.observer.on_delta(t, d);
        }
        Ok(out.incremental)
    }

    /// A plain completion received for a stream request counts as one chunk.
    fn plain_as_chunk(&mut self, a: &Aggregate) {
        let t = self.clock.now();
        if a.generated_anything() {
            self.meter.on_chunk(t);
            if !self.wants {
                self.observer.on_chunk(t);
            }
        }
        if self.wants {
            let d = StreamDelta {
                role: Some("assistant".into()),
                content: (!a.content.is_empty()).then(|| a.content.clone()),
                reasoning: (!a.reasoning.is_empty()).then(|| a.reasoning.clone()),
                tool_calls: a
                    .tool_calls
                    .iter()
                    .map(|t| ToolCallDelta {
                        index: t.index,
                        id: t.id.clone(),
                        name: t.name.clone(),
                        arguments: t.arguments.clone(),
                    })
                    .collect(),
                finish_reason: a.finish_reason.clone(),
                usage: a.usage,
                model: a.model.clone(),
                raw: None,
                raw_text: None,
                native: None,
            };
            self.observer.on_delta(t, d);
        }
    }

    // The error type is the port's (core's AttemptError); boxing it here would only
    // move the allocation.
    #[allow(clippy::result_large_err)]
    fn finalize(
        self,
        end: End,
        status: u16,
        ttft_budget: Duration,
        itb: Duration,
        key: &str,
    ) -> Result<TransportResult, AttemptError> {
        let figures = self.meter.figures();
        if self.agg.finish_reason().is_none() {
            let f = match end {
                End::Watchdog if self.meter.chunks() == 0 => Failure::TtftTimeout {
                    budget: ttft_budget,
                },
                End::Watchdog => Failure::StallTimeout { budget: itb },
                End::Bound => Failure::Timeout,
                End::Done => Failure::Truncated {
                    detail: "[DONE] came before any finish_reason".into(),
                },
                End::Eof => Failure::Truncated {
                    detail: "the body ended cleanly without a finish_reason".into(),
                },
                End::Broken(d) => Failure::Truncated {
                    detail: format!("the stream broke off: {d}"),
                },
            };
            // The answer had started: its status was a 2xx (item 16).
            return Err(fail(f, key).with_status(status));
        }
        let salvaged = matches!(end, End::Broken(_) | End::Watchdog | End::Bound);
        let a = self.agg.finish();
        if !a.generated_anything() && a.finish_reason.as_deref() != Some("length") {
            let usage = a.usage;
            return Err(with_usage_if_invalid(
                fail(
                    Failure::NothingGenerated {
                        finish_reason: a.finish_reason,
                    },
                    key,
                ),
                usage,
            ));
        }
        let mut r = result_of(a, status, salvaged);
        r.stream = Some(figures);
        Ok(r)
    }
}

#[async_trait]
impl Transport for OpenAiTransport {
    async fn native_call<'a>(&self, call: NativeCall<'a>) -> Result<NativeAnswer, AttemptError> {
        let source = call.source;
        let key = source.api_key.expose();
        let mut body = call.body.clone();
        body.insert("model".into(), Value::String(source.model.clone()));
        let native = NativeRequest {
            api: source.api,
            headers: call.headers.to_vec(),
            ..NativeRequest::default()
        };
        let rb = self.post_native(
            source,
            &native,
            call.client,
            call.endpoint,
            serde_json::to_vec(&body).unwrap_or_default(),
            call.call_id,
        );
        let cap = self.inner.cfg.max_error_body_bytes.max(64 * 1024);
        let work = async {
            let resp = rb
                .send()
                .await
                .map_err(|e| fail(send_failure(&e, key), key))?;
            let status = resp.status().as_u16();
            Ok(NativeAnswer {
                status,
                body: read_prefix(resp, cap).await,
            })
        };
        match tokio::time::timeout(source.timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(fail(Failure::Timeout, key)),
        }
    }

    async fn chat<'a>(&self, attempt: ChatAttempt<'a>) -> Result<TransportResult, AttemptError> {
        let r = if attempt.request.stream {
            self.chat_stream(attempt).await
        } else {
            self.chat_plain(attempt).await
        };
        let r = r.map_err(|e| client_credential_failure(attempt.source, e));
        if let Err(e) = &r {
            tracing::debug!(source = %attempt.source.name, call_id = attempt.call_id, error = %e, "chat attempt failed");
        }
        r
    }
}

#[async_trait]
impl OcrTransport for OpenAiTransport {
    async fn recognize(
        &self,
        source: &SourceConfig,
        image: &[u8],
        mime: &str,
        prompt: &str,
        call_id: &str,
    ) -> Result<OcrResult, AttemptError> {
        let r = self
            .recognize_impl(source, image, mime, prompt, call_id)
            .await;
        if let Err(e) = &r {
            tracing::debug!(source = %source.name, call_id, error = %e, "OCR attempt failed");
        }
        r
    }
}
