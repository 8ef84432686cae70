//! The HTTP side of the mock: the accept loop (connection tasks owned by a `JoinSet`),
//! the per-connection kill switch used for resets (SO_LINGER 0, then close = RST), and
//! the request handlers (`/v1/chat/completions`, `/v1/embeddings`, `/v1/models`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use polygw_core::Usage;
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;

use crate::behavior::{Behavior, Fault, UsageMode};
use crate::billing::{BillState, Prices};
use crate::cache::{self, CacheDialect, CacheUse, PrefixCache, PromptCacheSeen, Store};
use crate::play::{self, Ctx, Plan, PlayerBody, WireApi};
use crate::prefill::{self, Decision, PrefillOutcome, PrefillPolicy, PrefillSeen};
use crate::profile::Profile;
use crate::record::{now, EndKind, Guard, Log, RecordedRequest};
use crate::text;
use crate::MockConfig;

pub(crate) type RespBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// What plays when no script is queued.
pub(crate) enum DefaultPlay {
    Fixed(Box<Behavior>),
    Profile {
        profile: Box<Profile>,
        rng: fastrand::Rng,
    },
}

pub(crate) struct Shared {
    pub(crate) cfg: MockConfig,
    pub(crate) log: Arc<Log>,
    pub(crate) scripts: Mutex<VecDeque<Behavior>>,
    pub(crate) default: Mutex<DefaultPlay>,
    pub(crate) prefill: Mutex<PrefillPolicy>,
    pub(crate) cache: Mutex<CacheState>,
    pub(crate) prices: Mutex<Option<Prices>>,
}

/// The prefix cache of a mock: its settings (None = off) and the blocks it holds.
#[derive(Debug, Default)]
pub(crate) struct CacheState {
    pub(crate) cfg: Option<PrefixCache>,
    pub(crate) store: Store,
    /// The block size the held blocks were cut with.
    store_block: Option<u64>,
}

impl CacheState {
    /// Sets the settings (sanitized); a new block size forgets the blocks held.
    pub(crate) fn set(&mut self, cfg: Option<PrefixCache>) {
        let cfg = cfg.map(|mut c| {
            c.block_tokens = c.block_tokens.max(1);
            c.max_entries = c.max_entries.max(1);
            if !c.hit_ttft_factor.is_finite() || c.hit_ttft_factor < 0.0 {
                c.hit_ttft_factor = 1.0;
            }
            c
        });
        if let Some(c) = &cfg {
            if self.store_block.is_some_and(|b| b != c.block_tokens) {
                self.store.clear();
            }
            self.store_block = Some(c.block_tokens);
        }
        self.cfg = cfg;
    }
}

impl Shared {
    pub(crate) fn cache_state(&self) -> std::sync::MutexGuard<'_, CacheState> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn current_prices(&self) -> Option<Prices> {
        *self.prices.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads then writes the prefix cache for an accepted chat request (None when the
    /// cache is off). The prompt is hashed outside the lock.
    fn prefix_lookup(&self, body: &Value) -> Option<(PrefixCache, PromptCacheSeen)> {
        let block = self.cache_state().cfg.as_ref()?.block_tokens;
        let blocks = cache::blocks(body, block);
        let mut st = self.cache_state();
        let cfg = st.cfg.clone()?;
        if cfg.block_tokens != block {
            return None; // reconfigured meanwhile: this request is not cached
        }
        let look = st
            .store
            .lookup_and_write(&cfg, &blocks, tokio::time::Instant::now());
        let seen = PromptCacheSeen {
            prompt_tokens: blocks.tokens,
            cached_tokens: look.cached,
            cache_write_tokens: look.written - look.cached,
            written_tokens: look.written,
            dialect: cfg.dialect,
        };
        Some((cfg, seen))
    }

    fn prefill_policy(&self) -> PrefillPolicy {
        self.prefill
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn next_behavior(&self, body: &Value) -> Behavior {
        if let Some(b) = self
            .scripts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
        {
            return b;
        }
        match &mut *self.default.lock().unwrap_or_else(|e| e.into_inner()) {
            DefaultPlay::Fixed(b) => (**b).clone(),
            DefaultPlay::Profile { profile, rng } => {
                let seed = text::request_seed(body);
                match &self.cfg.paired {
                    Some(draws) => profile.sample_paired(draws, seed),
                    None => profile.sample_for(rng, Some(seed)),
                }
            }
        }
    }
}

/// Accepts connections until `shutdown` changes (or its sender is gone), then aborts
/// every connection and waits for them.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    conns.spawn(serve_conn(stream, shared.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "mock upstream: accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            _ = shutdown.changed() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    shared
        .log
        .shutting_down
        .store(true, std::sync::atomic::Ordering::Relaxed);
    conns.shutdown().await;
}

async fn serve_conn(stream: TcpStream, shared: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    // A duplicate of the socket's descriptor lets the kill switch set SO_LINGER 0 while
    // hyper owns the stream; closing both then sends an RST.
    let (stream, handle) = match stream.into_std() {
        Ok(std) => {
            let handle = std.try_clone().ok();
            match TcpStream::from_std(std) {
                Ok(s) => (s, handle),
                Err(_) => return,
            }
        }
        Err(_) => return,
    };
    let kill = Arc::new(Notify::new());
    let svc = {
        let kill = kill.clone();
        hyper::service::service_fn(move |req| handle_request(shared.clone(), kill.clone(), req))
    };
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        () = kill.notified() => {
            if let Some(h) = &handle {
                let _ = socket2::SockRef::from(h).set_linger(Some(Duration::ZERO));
            }
        }
    }
    // `conn` (and the stream it owns) and `handle` drop here: with linger 0, an RST.
}

fn full(bytes: impl Into<Bytes>) -> RespBody {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

fn response(
    status: u16,
    content_type: &str,
    body: RespBody,
    b: Option<&Behavior>,
) -> Response<RespBody> {
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if let Ok(v) = HeaderValue::from_str(content_type) {
        r.headers_mut().insert(CONTENT_TYPE, v);
    }
    if let Some(ra) = b.and_then(|b| b.retry_after.as_ref()) {
        if let Ok(v) = HeaderValue::from_str(&ra.header_value()) {
            r.headers_mut().insert(RETRY_AFTER, v);
        }
    }
    if let Some(b) = b {
        extra_headers(&mut r, &b.headers);
    }
    r
}

/// A behavior's extra response headers.
fn extra_headers(r: &mut Response<RespBody>, headers: &std::collections::BTreeMap<String, String>) {
    for (k, v) in headers {
        if let (Ok(k), Ok(v)) = (
            hyper::header::HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            r.headers_mut().insert(k, v);
        }
    }
}

fn json_response(status: u16, v: &Value, b: Option<&Behavior>) -> Response<RespBody> {
    response(status, "application/json", full(v.to_string()), b)
}

/// OpenAI's error shape, with a default code and message per status.
/// [`error_json`] in the API's shape: Anthropic's `{"type":"error","error":{…}}` for
/// Messages, with the type Anthropic uses for the status (or `code`).
pub(crate) fn error_json_in(
    api: WireApi,
    status: u16,
    code: Option<&str>,
    message: Option<&str>,
) -> Value {
    match api {
        WireApi::Chat | WireApi::Responses => error_json(status, code, message),
        WireApi::Messages => {
            let ty = code.unwrap_or(match status {
                400 | 422 => "invalid_request_error",
                401 => "authentication_error",
                402 => "billing_error",
                403 => "permission_error",
                404 => "not_found_error",
                413 => "request_too_large",
                429 => "rate_limit_error",
                529 => "overloaded_error",
                504 => "timeout_error",
                _ => "api_error",
            });
            let message = message.map_or_else(
                || match ty {
                    "overloaded_error" => "Overloaded".to_string(),
                    "rate_limit_error" => {
                        "Number of request tokens has exceeded your per-minute rate limit"
                            .to_string()
                    }
                    _ => format!("mock error {status}"),
                },
                str::to_string,
            );
            json!({"type": "error", "error": {"type": ty, "message": message}})
        }
    }
}

pub(crate) fn error_json(status: u16, code: Option<&str>, message: Option<&str>) -> Value {
    let (dcode, dmsg) = match status {
        400 => ("invalid_request_error", "Invalid request."),
        401 => ("invalid_api_key", "Incorrect API key provided."),
        403 => (
            "permission_denied",
            "You are not allowed to use this model.",
        ),
        404 => ("model_not_found", "The model does not exist."),
        408 => ("request_timeout", "The request timed out."),
        409 => ("conflict", "The request conflicts with another one."),
        413 => ("request_too_large", "The request is too large."),
        422 => ("invalid_request_error", "The request cannot be processed."),
        429 => (
            "rate_limit_exceeded",
            "Rate limit reached. Please try again later.",
        ),
        502 => ("bad_gateway", "Bad gateway."),
        503 => ("overloaded", "The engine is currently overloaded."),
        500..=599 => ("server_error", "The server had an error."),
        _ => ("error", "Error."),
    };
    let kind = match status {
        429 => "requests",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    json!({"error": {
        "message": message.unwrap_or(dmsg),
        "type": kind,
        "code": code.unwrap_or(dcode),
        "param": null,
    }})
}

fn ms(x: f64) -> Duration {
    Duration::from_secs_f64(x.max(0.0) / 1000.0)
}

#[allow(clippy::disallowed_methods)] // `created` is wall-clock seconds by definition.
fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn handle_request(
    shared: Arc<Shared>,
    kill: Arc<Notify>,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, Infallible> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().map(str::to_string);
    let anthropic_headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .filter(|(k, _)| k.as_str().starts_with("anthropic-"))
        .map(|(k, v)| {
            (
                k.to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let api_key = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let call_id = header("x-polygw-call-id");
    let traceparent = header("traceparent");
    let auth = header(AUTHORIZATION.as_str());
    let raw = Limited::new(req.into_body(), shared.cfg.max_request_bytes)
        .collect()
        .await
        .map(|c| c.to_bytes());
    let (body, body_ok) = match &raw {
        Ok(b) if b.is_empty() => (Value::Null, true),
        Ok(b) => match serde_json::from_slice::<Value>(b) {
            Ok(v) => (v, true),
            Err(_) => (Value::Null, false),
        },
        Err(_) => (Value::Null, false),
    };
    let log = shared.log.clone();
    let id = log.next_id();
    log.push(RecordedRequest {
        id,
        method: method.to_string(),
        path: path.clone(),
        model: body
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_string),
        stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        body: if shared.cfg.record_bodies {
            body.clone()
        } else {
            Value::Null
        },
        call_id: call_id.clone(),
        authorization: auth.is_some(),
        bearer: auth
            .as_deref()
            .and_then(|a| a.strip_prefix("Bearer "))
            .map(str::to_string),
        traceparent,
        arrived_at: now(),
        headers_at: None,
        ended_at: None,
        end: EndKind::InFlight,
        status: 0,
        chunks_sent: 0,
        frames_sent: 0,
        keepalives_sent: 0,
        usage: None,
        content: String::new(),
        reasoning: String::new(),
        full_content: String::new(),
        prefill: None,
        images: Vec::new(),
        prompt_cache: None,
        behavior: None,
        x_api_key: api_key.is_some(),
        anthropic_headers,
        query,
    });
    let guard = Guard::new(log, id);

    let simple = |mut guard: Guard, status: u16, v: Value| {
        guard.headers_sent(status);
        guard.finish(if (200..300).contains(&status) {
            EndKind::Completed
        } else {
            EndKind::Error { status }
        });
        json_response(status, &v, None)
    };

    let api = match path.as_str() {
        "/v1/messages" => WireApi::Messages,
        "/v1/responses" => WireApi::Responses,
        _ => WireApi::Chat,
    };
    if let Some(k) = &shared.cfg.require_key {
        let ok = match api {
            WireApi::Messages => api_key.as_deref() == Some(k.as_str()),
            WireApi::Chat | WireApi::Responses => {
                auth.as_deref() == Some(format!("Bearer {k}").as_str())
            }
        };
        if !ok {
            return Ok(simple(guard, 401, error_json_in(api, 401, None, None)));
        }
    }
    if raw.is_err() {
        return Ok(simple(
            guard,
            413,
            error_json(413, None, Some("The request body is too large or broken.")),
        ));
    }
    let resp = match (&method, path.as_str()) {
        (&Method::GET, "/v1/models") => {
            let data: Vec<Value> = shared
                .cfg
                .models
                .iter()
                .map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "polygw-mock"}))
                .collect();
            simple(guard, 200, json!({"object": "list", "data": data}))
        }
        (&Method::POST, "/v1/messages/count_tokens") => {
            if !body_ok || !body.is_object() {
                return Ok(simple(
                    guard,
                    400,
                    error_json_in(
                        WireApi::Messages,
                        400,
                        None,
                        Some("The body is not a JSON object."),
                    ),
                ));
            }
            let n = text::prompt_tokens(&body, text::images_of(&body).len());
            simple(guard, 200, json!({"input_tokens": n}))
        }
        (&Method::POST, "/v1/responses/input_tokens") => {
            let n = text::prompt_tokens(&body, text::images_of(&body).len());
            simple(
                guard,
                200,
                json!({"object": "response.input_tokens", "input_tokens": n}),
            )
        }
        (&Method::POST, "/v1/chat/completions")
        | (&Method::POST, "/v1/embeddings")
        | (&Method::POST, "/v1/messages")
        | (&Method::POST, "/v1/responses") => {
            if !body_ok || !body.is_object() {
                return Ok(simple(
                    guard,
                    400,
                    error_json_in(api, 400, None, Some("The body is not a JSON object.")),
                ));
            }
            if api == WireApi::Messages && body.get("max_tokens").and_then(Value::as_u64).is_none()
            {
                // Anthropic's own wording.
                return Ok(simple(
                    guard,
                    400,
                    error_json_in(api, 400, None, Some("max_tokens: Field required")),
                ));
            }
            let b = shared.next_behavior(&body);
            guard_behavior(&guard, &b);
            if b.refuses_max_tokens && api == WireApi::Chat && body.get("max_tokens").is_some() {
                // OpenAI's own wording for a reasoning model.
                return Ok(simple(
                    guard,
                    400,
                    error_json_in(
                        api,
                        400,
                        Some("unsupported_parameter"),
                        Some(
                            "Unsupported parameter: 'max_tokens' is not supported with this \
                             model. Use 'max_completion_tokens' instead.",
                        ),
                    ),
                ));
            }
            if let Some(group) = &b.signing_group {
                if let Some((code, message)) = crate::signing::refusal(api, &body, group) {
                    return Ok(simple(
                        guard,
                        400,
                        error_json_in(api, 400, Some(code), Some(&message)),
                    ));
                }
            }
            if path.ends_with("/embeddings") {
                embeddings(&shared, kill, guard, b, body).await
            } else {
                chat(&shared, kill, guard, b, body, call_id, api).await
            }
        }
        _ => simple(
            guard,
            404,
            error_json(
                404,
                Some("not_found"),
                Some(&format!("No route for {method} {path}.")),
            ),
        ),
    };
    Ok(resp)
}

fn guard_behavior(guard: &Guard, b: &Behavior) {
    let b = b.clone();
    guard_log(guard, move |r| r.behavior = Some(b));
}

fn guard_log(guard: &Guard, f: impl FnOnce(&mut RecordedRequest)) {
    guard.log_update(f);
}

/// Headers delay, reset before headers, and error statuses. `Ok(guard)` = go on with a
/// 2xx answer.
async fn prelude(
    kill: &Notify,
    mut guard: Guard,
    b: &Behavior,
    api: WireApi,
) -> Result<Guard, Response<RespBody>> {
    if b.headers_delay_ms > 0.0 {
        tokio::time::sleep(ms(b.headers_delay_ms)).await;
    }
    if b.fault == Some(Fault::ResetBeforeHeaders) {
        guard.finish(EndKind::ResetBeforeHeaders);
        kill.notify_one();
        std::future::pending::<()>().await;
    }
    if !(200..300).contains(&b.status) {
        guard.headers_sent(b.status);
        guard.finish(EndKind::Error { status: b.status });
        let resp = if let Some(raw) = &b.raw_body {
            response(
                b.status,
                b.content_type.as_deref().unwrap_or("application/json"),
                full(raw.clone()),
                Some(b),
            )
        } else {
            let v = b.error_body.clone().unwrap_or_else(|| {
                error_json_in(
                    api,
                    b.status,
                    b.error_code.as_deref(),
                    b.error_message.as_deref(),
                )
            });
            json_response(b.status, &v, Some(b))
        };
        return Err(resp);
    }
    Ok(guard)
}

async fn raw_bytes(b: &Behavior) -> Result<Option<(Bytes, &'static str)>, String> {
    if let Some(s) = &b.raw_sse {
        return Ok(Some((Bytes::from(s.clone()), "text/event-stream")));
    }
    if let Some(p) = &b.raw_sse_file {
        let bytes = tokio::fs::read(p)
            .await
            .map_err(|e| format!("cannot read {}: {e}", p.display()))?;
        return Ok(Some((Bytes::from(bytes), "text/event-stream")));
    }
    if let Some(p) = &b.jsonl_file {
        let text = tokio::fs::read_to_string(p)
            .await
            .map_err(|e| format!("cannot read {}: {e}", p.display()))?;
        let mut out = String::with_capacity(text.len() + 4096);
        for line in text.split('\n') {
            if line.trim().is_empty() {
                continue;
            }
            out.push_str("data: ");
            out.push_str(line);
            out.push_str("\n\n");
        }
        if b.done {
            out.push_str("data: [DONE]\n\n");
        }
        return Ok(Some((Bytes::from(out), "text/event-stream")));
    }
    Ok(None)
}

/// The request's output cap: `max_tokens`, `max_completion_tokens` or (Responses)
/// `max_output_tokens` (the smallest when several).
fn max_tokens(body: &Value) -> Option<u64> {
    ["max_tokens", "max_completion_tokens", "max_output_tokens"]
        .iter()
        .filter_map(|k| body.get(*k).and_then(Value::as_u64))
        .min()
}

async fn chat(
    shared: &Shared,
    kill: Arc<Notify>,
    guard: Guard,
    mut b: Behavior,
    body: Value,
    call_id: Option<String>,
    api: WireApi,
) -> Response<RespBody> {
    let guard = match prelude(&kill, guard, &b, api).await {
        Ok(g) => g,
        Err(resp) => return resp,
    };
    // Prefill: continue from the prefix, reject, or answer from scratch.
    let policy = b
        .prefill_policy()
        .unwrap_or_else(|| shared.prefill_policy());
    let seen = |p: &prefill::Prefill, outcome| PrefillSeen {
        dialect: p.dialect,
        prefix_chars: p.prefix.chars().count(),
        matched: false,
        outcome,
    };
    let decision = match prefill::decide(&body, &policy) {
        Decision::Continue(p) if api == WireApi::Messages => {
            match prefill::messages_refusal(&body, &p) {
                Some(m) => Decision::Reject(p, m),
                None => Decision::Continue(p),
            }
        }
        d => d,
    };
    let (prefix, mut prefill_seen) = match decision {
        Decision::None => (None, None),
        Decision::Reject(p, message) => {
            let s = seen(&p, PrefillOutcome::Rejected);
            guard_log(&guard, move |r| r.prefill = Some(s));
            let mut g = guard;
            g.headers_sent(400);
            g.finish(EndKind::Error { status: 400 });
            let v = error_json_in(api, 400, Some("invalid_request_error"), Some(message));
            return json_response(400, &v, None);
        }
        Decision::Ignore(p) => (None, Some(seen(&p, PrefillOutcome::Ignored))),
        Decision::Continue(p) => {
            let s = seen(&p, PrefillOutcome::Continued);
            (Some(p.prefix), Some(s))
        }
    };
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let images = text::images_of(&body);
    let image_summary = (!images.is_empty()).then(|| {
        let parts: Vec<String> = images
            .iter()
            .map(|i| format!("{} {} bytes", i.mime, i.bytes))
            .collect();
        format!("[mock-ocr] {} image(s): {}", images.len(), parts.join(", "))
    });
    // The prefix cache: read, then write this prompt's blocks; a hit answers sooner.
    let cache_use = match shared.prefix_lookup(&body) {
        Some((cfg, seen)) => {
            if seen.cached_tokens > 0 {
                b.ttft_ms *= cfg.hit_ttft_factor;
                guard_behavior(&guard, &b);
            }
            guard_log(&guard, move |r| r.prompt_cache = Some(seen));
            Some(CacheUse {
                dialect: cfg.dialect,
                cached: seen.cached_tokens,
                write: seen.cache_write_tokens,
            })
        }
        None => None,
    };
    let mut ctx = Ctx {
        model: b
            .model
            .clone()
            .or_else(|| {
                body.get("model")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .unwrap_or_else(|| "mock-model".into()),
        prompt_tokens: text::prompt_tokens(&body, images.len()),
        seed: text::request_seed(&body),
        created: unix_secs(),
        image_summary,
        prefill: prefix,
        max_tokens: max_tokens(&body),
        cache: cache_use,
        kill,
        guard,
        api,
    };
    let plan = Plan::new(&b, &ctx);
    {
        let raw = b.raw_sse.is_some()
            || b.raw_sse_file.is_some()
            || b.jsonl_file.is_some()
            || b.raw_body.is_some();
        if let Some(s) = &mut prefill_seen {
            // A verbatim body is played as is: never a continuation.
            s.matched = !raw && plan.prefill_matched == Some(true);
        }
        let full = match &ctx.prefill {
            Some(prefix) if !raw => format!("{prefix}{}", plan.full_content()),
            _ => plan.full_content(),
        };
        guard_log(&ctx.guard, move |r| {
            r.full_content = full;
            r.images = images;
            r.prefill = prefill_seen;
        });
    }

    // Verbatim bodies.
    let raw = match raw_bytes(&b).await {
        Ok(raw) => raw,
        Err(e) => {
            let mut g = ctx.guard;
            g.headers_sent(500);
            g.finish(EndKind::Error { status: 500 });
            return json_response(500, &error_json(500, None, Some(&e)), None);
        }
    };
    // Accepted: from here on the answer is generated, and billed when it ends.
    {
        let verbatim = raw.is_some() || b.raw_body.is_some();
        let prompt_tokens = plan.usage.prompt_tokens;
        let cache = cache_use.map(|c| c.clamped(prompt_tokens));
        let (planned_completion, planned_items) = if verbatim {
            (b.completion_tokens.unwrap_or(0), 0)
        } else {
            (plan.usage.completion_tokens, plan.items.len() as u32)
        };
        ctx.guard.bill = Some(Box::new(BillState {
            call_id,
            model: body
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_string),
            stream,
            prompt_tokens,
            cached_tokens: cache.map_or(0, |c| c.cached),
            cache_write_tokens: cache
                .filter(|c| c.dialect == CacheDialect::Anthropic)
                .map_or(0, |c| c.write),
            planned_completion,
            planned_items,
            verbatim,
            cache_dialect: cache.map(|c| c.dialect),
            prices: shared.current_prices(),
        }));
    }
    if let Some((bytes, ct)) = raw {
        return raw_response(b, ctx, bytes, ct);
    }
    if let Some(raw) = b.raw_body.clone() {
        let ct = b
            .content_type
            .clone()
            .unwrap_or_else(|| "application/json".into());
        return raw_response_ct(b, ctx, Bytes::from(raw), ct);
    }

    if stream {
        ctx.guard.headers_sent(b.status);
        let status = b.status;
        let headers = b.headers.clone();
        let body = PlayerBody::new(move |out| play::play_stream(b, ctx, out));
        let mut r = response(status, "text/event-stream", body.boxed_unsync(), None);
        extra_headers(&mut r, &headers);
        r.headers_mut()
            .insert("cache-control", HeaderValue::from_static("no-cache"));
        return r;
    }

    // Plain: the headers wait for the whole generation, chunk by chunk (a chunk
    // is generated, and billed, when its time has come).
    let n = plan.items.len();
    let mut at = tokio::time::Instant::now() + ms(b.ttft_ms);
    for i in 0..n {
        if i > 0 {
            at += ms(b.gap_before(i));
        }
        at += ms(b.stall_before(i));
        if at > tokio::time::Instant::now() {
            tokio::time::sleep_until(at).await;
        }
        ctx.guard.generated += 1;
    }
    if at > tokio::time::Instant::now() {
        tokio::time::sleep_until(at).await;
    }
    if let Some(Fault::ErrorFrameAt { error, .. }) = &b.fault {
        let e = error
            .clone()
            .unwrap_or_else(|| play::default_error_object(api));
        ctx.guard.headers_sent(b.status);
        ctx.guard.finish(EndKind::Completed);
        return json_response(b.status, &e, Some(&b));
    }
    let v = match api {
        WireApi::Chat => play::completion_json(&b, &ctx, &plan),
        WireApi::Messages => play::message_json(&b, &ctx, &plan),
        WireApi::Responses => play::response_json(&b, &ctx, &plan),
    };
    let bytes = Bytes::from(v.to_string());
    ctx.guard.headers_sent(b.status);
    match b.fault {
        Some(Fault::ResetAfter { .. })
        | Some(Fault::ResetAfterFinish)
        | Some(Fault::TruncateAfter { .. })
        | Some(Fault::MalformedAt { .. })
        | Some(Fault::HangAfterFinish) => {
            let status = b.status;
            let usage = plan.usage;
            let headers = b.headers.clone();
            let body =
                PlayerBody::new(move |out| play::play_plain_fault(b, ctx, out, bytes, usage));
            let mut r = response(status, "application/json", body.boxed_unsync(), None);
            extra_headers(&mut r, &headers);
            r
        }
        _ => {
            play::plain_sent(&mut ctx, &b, &plan);
            ctx.guard.finish(EndKind::Completed);
            response(b.status, "application/json", full(bytes), Some(&b))
        }
    }
}

fn raw_response(b: Behavior, ctx: Ctx, bytes: Bytes, ct: &str) -> Response<RespBody> {
    raw_response_ct(b, ctx, bytes, ct.to_string())
}

fn raw_response_ct(b: Behavior, ctx: Ctx, bytes: Bytes, ct: String) -> Response<RespBody> {
    ctx.guard.headers_sent(b.status);
    let status = b.status;
    let retry = b.retry_after.clone();
    let headers = b.headers.clone();
    let body = PlayerBody::new(move |out| play::play_raw(b, ctx, out, bytes));
    let mut r = response(status, &ct, body.boxed_unsync(), None);
    extra_headers(&mut r, &headers);
    if let Some(ra) = retry {
        if let Ok(v) = HeaderValue::from_str(&ra.header_value()) {
            r.headers_mut().insert(RETRY_AFTER, v);
        }
    }
    r
}

async fn embeddings(
    shared: &Shared,
    kill: Arc<Notify>,
    guard: Guard,
    b: Behavior,
    body: Value,
) -> Response<RespBody> {
    let mut guard = match prelude(&kill, guard, &b, WireApi::Chat).await {
        Ok(g) => g,
        Err(resp) => return resp,
    };
    if b.ttft_ms > 0.0 {
        tokio::time::sleep(ms(b.ttft_ms)).await;
    }
    let Some(inputs) = text::embedding_inputs(&body) else {
        guard.headers_sent(400);
        guard.finish(EndKind::Error { status: 400 });
        return json_response(
            400,
            &error_json(
                400,
                None,
                Some("`input` must be a string or an array of strings."),
            ),
            None,
        );
    };
    guard.headers_sent(b.status);
    if let Some(raw) = &b.raw_body {
        guard.finish(EndKind::Completed);
        let ct = b.content_type.as_deref().unwrap_or("application/json");
        return response(b.status, ct, full(raw.clone()), Some(&b));
    }
    match &b.fault {
        Some(Fault::ErrorFrameAt { error, .. }) => {
            guard.finish(EndKind::Completed);
            let e = error
                .clone()
                .unwrap_or_else(|| play::default_error_object(WireApi::Chat));
            return json_response(b.status, &e, Some(&b));
        }
        Some(Fault::MalformedAt { .. }) | Some(Fault::TruncateAfter { .. }) => {
            guard.finish(EndKind::Completed);
            return response(
                b.status,
                "application/json",
                full("{\"data\": [{\"emb"),
                Some(&b),
            );
        }
        _ => {}
    }
    let dim = shared.cfg.embedding_dim;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| json!({"object": "embedding", "index": i, "embedding": text::embedding_of(t, dim)}))
        .collect();
    let tokens: u64 = inputs.iter().map(|t| text::text_tokens(t)).sum();
    let tokens = b.prompt_tokens.unwrap_or(tokens);
    let model = b
        .model
        .clone()
        .or_else(|| {
            body.get("model")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_else(|| "mock-embedding".into());
    let mut v = json!({"object": "list", "data": data, "model": model});
    if b.usage != UsageMode::None {
        v["usage"] = json!({"prompt_tokens": tokens, "total_tokens": tokens});
        guard.usage = Some(Usage::new(tokens, 0));
    }
    guard.chunks_sent = inputs.len() as u32;
    guard.finish(EndKind::Completed);
    json_response(b.status, &v, Some(&b))
}
