//! The routes: chat completions (plain here, streamed in [`crate::stream`]),
//! embeddings, models, health and metrics, and the JSON 404/405.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use http_body_util::BodyExt;
use polygw::{CallOptions, GatewayError, LlmResponse};
use serde_json::json;

use crate::conn::ConnCtx;
use crate::errors::from_gateway;
use crate::guard::{ensure_request_id, error_response, set_request_id};
use crate::names;
use crate::openai::{completion_json, embeddings_json, parse_chat, parse_embeddings, ApiError};
use crate::proxy::{cut_done, State as AppState};
use crate::scope::{GateRefusal, ScopeClient, Slot};
use crate::stream;

/// Seconds since the Unix epoch (OpenAI's `created` of a synthesized answer).
pub fn unix_now() -> u64 {
    // The proxy's only wall-clock reading: the `created` field of answers it writes.
    #[allow(clippy::disallowed_methods)]
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The connection of a request, when served by [`crate::serve`].
pub type Conn = Option<Extension<Arc<ConnCtx>>>;

/// Resolves when the client ends its side of the connection (never without one).
pub async fn client_gone(ctx: &Option<Arc<ConnCtx>>) {
    match ctx {
        Some(c) => c.closed().await,
        None => std::future::pending().await,
    }
}

/// The answer to a client that ended its side of the connection before its answer:
/// the call is cancelled (or was never made). Written in case it only half-closed.
pub fn client_closed() -> Response {
    let status = StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST);
    let mut r = error_response(&ApiError::new(
        status,
        "invalid_request_error",
        "client_closed_request",
        "the client closed its side of the connection before the answer: polygw cancelled \
         the call (keep the connection open until the answer arrives)",
    ));
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// The 503 of a call still running when the shutdown's grace period ended.
pub fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "server_shutdown",
        "polygw is shutting down: the call was cancelled at the end of the grace period",
    )
}

/// The 429 of a call turned away by its scope's cap and queue.
fn gate_refusal(scope: &str, why: GateRefusal, wait: Duration) -> ApiError {
    let message = match why {
        GateRefusal::QueueFull => format!(
            "Rate limit reached: scope {scope} has as many calls running and waiting as polygw \
             serve allows (--max-calls-per-scope, --max-queued-per-scope); retry shortly"
        ),
        GateRefusal::Waited => format!(
            "Rate limit reached: scope {scope} had no free call slot within {} s (--max-wait-s); \
             retry shortly",
            wait.as_secs_f64()
        ),
    };
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "requests",
        "rate_limit_exceeded",
        message,
    )
    .with_retry_after(1)
}

/// The answer to a failed call: OpenAI's error, `x-request-id` and the `x-polygw-*`
/// headers known (`logical-call-id`, `attempts`, `terminal-reason`).
pub fn gateway_error(e: &GatewayError, id: &str) -> Response {
    let api = from_gateway(e);
    if api.status.is_server_error() || api.status == StatusCode::TOO_MANY_REQUESTS {
        tracing::warn!(status = api.status.as_u16(), error = %e, "call failed");
    }
    let mut resp = error_response(&api);
    let h = resp.headers_mut();
    let id = e.context().map_or(id, |c| c.logical_call_id.as_str());
    set_request_id(h, id);
    if let Some(ctx) = e.context() {
        h.insert(names::X_ATTEMPTS, HeaderValue::from(ctx.attempts));
    }
    if let Some(r) = e.terminal_reason() {
        h.insert(
            names::X_TERMINAL_REASON,
            HeaderValue::from_static(r.as_str()),
        );
    }
    resp
}

/// Reads a request body under the size limit and the body timeout, into one buffer
/// sized by `Content-Length` (no intermediate copies).
async fn read_body(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
    ctx: &Option<Arc<ConnCtx>>,
) -> Result<Bytes, Response> {
    let limit = st.cfg.max_body_bytes;
    let too_large = |st: &AppState| {
        st.counters.refused("body_too_large");
        close_after(
            ctx,
            error_response(&ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                ..ApiError::bad_request(
                    "body",
                    format!("the request body exceeds {limit} bytes (--max-body-bytes)"),
                )
            }),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large(st));
    }
    let mut buf = Vec::with_capacity(declared.unwrap_or(0).min(limit));
    let mut body = body;
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("the request body could not be read: {e}"))?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.len() > limit {
                    return Err(String::new());
                }
                buf.extend_from_slice(&data);
            }
        }
        Ok(())
    };
    match tokio::time::timeout(st.cfg.body_timeout, read).await {
        Ok(Ok(())) => {
            if let Some(c) = ctx {
                c.body_finished();
            }
            Ok(Bytes::from(buf))
        }
        Ok(Err(msg)) if msg.is_empty() => Err(too_large(st)),
        Ok(Err(msg)) => Err(close_after(
            ctx,
            error_response(&ApiError::bad_request("body", msg)),
        )),
        Err(_) => {
            st.counters.closed("body_timeout");
            Err(close_after(
                ctx,
                error_response(&ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    "request_timeout",
                    format!(
                        "the request body did not arrive within {} s",
                        st.cfg.body_timeout.as_secs_f64()
                    ),
                )),
            ))
        }
    }
}

/// Marks an answer as the connection's last (its request body was not read whole).
fn close_after(ctx: &Option<Arc<ConnCtx>>, mut r: Response) -> Response {
    if let Some(c) = ctx {
        c.close_after_answer();
    }
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// A call slot of the scope, unless the client leaves first.
async fn enter_gate(
    st: &AppState,
    served: &crate::proxy::Served,
    ctx: &Option<Arc<ConnCtx>>,
) -> Result<Slot, Response> {
    tokio::select! {
        biased;
        () = client_gone(ctx) => Err(client_closed()),
        r = served.gate.enter(st.cfg.max_wait) => r.map_err(|why| {
            error_response(&gate_refusal(&served.scope.name, why, st.cfg.max_wait))
        }),
    }
}

/// Response headers of a call that answered.
fn answer_headers(h: &mut HeaderMap, r: &LlmResponse) {
    set_request_id(h, &r.logical_call_id);
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
    h.insert(names::X_HEDGES, HeaderValue::from(r.call_stats.hedges));
    h.insert(names::X_ATTEMPTS, HeaderValue::from(r.call_stats.attempts));
    h.insert(
        names::X_USAGE_SOURCE,
        HeaderValue::from_static(r.usage_source.as_str()),
    );
}

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(st): State<Arc<AppState>>,
    conn: Conn,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let ctx = conn.map(|Extension(c)| c);
    let id = CallOptions::new_logical_call_id();
    let mut resp = chat_inner(&st, &ctx, &headers, body, &id).await;
    ensure_request_id(resp.headers_mut(), &id);
    resp
}

async fn chat_inner(
    st: &Arc<AppState>,
    ctx: &Option<Arc<ConnCtx>>,
    headers: &HeaderMap,
    body: Body,
    id: &str,
) -> Response {
    let bytes = match read_body(st, headers, body, ctx).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let parsed = match parse_chat(&bytes) {
        Ok(p) => p,
        Err(e) => return error_response(&e),
    };
    // Parsed once; the raw body is not kept for the call.
    drop(bytes);
    let Some(served) = st.scope_for(&parsed.model) else {
        return error_response(&st.unknown_model(&parsed.model));
    };
    let ScopeClient::Chat(client) = &served.scope.client else {
        return error_response(&st.wrong_kind(&parsed.model, served.scope.kind()));
    };
    // A client that already ended its side (a half-close right after its request):
    // no call is made at all.
    if ctx.as_ref().is_some_and(|c| c.client_gone_now()) {
        return client_closed();
    }
    let slot = match enter_gate(st, served, ctx).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let options = CallOptions::default()
        .with_max_wait_named(st.cfg.max_wait, "--max-wait-s")
        .with_logical_call_id(id);
    if parsed.request.stream {
        return stream::respond(
            st.clone(),
            client.clone(),
            parsed.request,
            parsed.include_usage,
            options,
            slot,
            ctx.clone(),
        )
        .await;
    }
    let call = client.chat_with(parsed.request, options);
    let r = tokio::select! {
        biased;
        r = call => r,
        () = client_gone(ctx) => return client_closed(),
        () = cut_done(st.cut_signal()) => {
            let mut resp = error_response(&shutting_down());
            set_request_id(resp.headers_mut(), id);
            return resp;
        }
    };
    drop(slot);
    match r {
        Ok(mut r) => {
            let mut resp = Json(completion_json(&mut r, unix_now())).into_response();
            answer_headers(resp.headers_mut(), &r);
            resp
        }
        Err(e) => gateway_error(&e, id),
    }
}

/// `POST /v1/embeddings`.
pub async fn embeddings(
    State(st): State<Arc<AppState>>,
    conn: Conn,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let ctx = conn.map(|Extension(c)| c);
    let id = CallOptions::new_logical_call_id();
    let mut resp = embeddings_inner(&st, &ctx, &headers, body, &id).await;
    ensure_request_id(resp.headers_mut(), &id);
    resp
}

async fn embeddings_inner(
    st: &Arc<AppState>,
    ctx: &Option<Arc<ConnCtx>>,
    headers: &HeaderMap,
    body: Body,
    id: &str,
) -> Response {
    let bytes = match read_body(st, headers, body, ctx).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let parsed = match parse_embeddings(&bytes) {
        Ok(p) => p,
        Err(e) => return error_response(&e),
    };
    drop(bytes);
    let Some(served) = st.scope_for(&parsed.model) else {
        return error_response(&st.unknown_model(&parsed.model));
    };
    let ScopeClient::Embedding(client) = &served.scope.client else {
        return error_response(&st.wrong_kind(&parsed.model, served.scope.kind()));
    };
    if ctx.as_ref().is_some_and(|c| c.client_gone_now()) {
        return client_closed();
    }
    let slot = match enter_gate(st, served, ctx).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let options = CallOptions::default()
        .with_max_wait_named(st.cfg.max_wait, "--max-wait-s")
        .with_logical_call_id(id);
    let r = tokio::select! {
        biased;
        r = client.embed_with(&parsed.input, options) => r,
        () = client_gone(ctx) => return client_closed(),
        () = cut_done(st.cut_signal()) => {
            let mut resp = error_response(&shutting_down());
            set_request_id(resp.headers_mut(), id);
            return resp;
        }
    };
    drop(slot);
    match r {
        Ok(e) => {
            let mut resp = Json(embeddings_json(&e, parsed.encoding)).into_response();
            let h = resp.headers_mut();
            set_request_id(h, &e.logical_call_id);
            if let Some(s) = e.sources.last().and_then(|s| HeaderValue::from_str(s).ok()) {
                h.insert(names::X_SOURCE, s);
            }
            h.insert(names::X_ATTEMPTS, HeaderValue::from(e.call_stats.attempts));
            h.insert(
                names::X_USAGE_SOURCE,
                HeaderValue::from_static(e.usage_source.as_str()),
            );
            resp
        }
        Err(e) => gateway_error(&e, id),
    }
}

fn model_object(id: &str) -> serde_json::Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "polygw"})
}

/// `GET /v1/models`: every served scope name and alias.
pub async fn models(State(st): State<Arc<AppState>>) -> Response {
    let data: Vec<serde_json::Value> = st.known_models().iter().map(|m| model_object(m)).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{id}`: one of them (case-insensitive), else 404.
pub async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match st
        .known_models()
        .into_iter()
        .find(|m| m.eq_ignore_ascii_case(&id))
    {
        Some(m) => Json(model_object(&m)).into_response(),
        None => error_response(&st.unknown_model(&id)),
    }
}

/// `GET /healthz`: the served scopes, their kind and sources (no auth).
pub async fn healthz(State(st): State<Arc<AppState>>) -> Response {
    let scopes: Vec<serde_json::Value> = st
        .scopes
        .iter()
        .map(|s| {
            json!({
                "scope": s.scope.name,
                "kind": s.scope.kind().as_str(),
                "sources": s.scope.sources(),
            })
        })
        .collect();
    Json(json!({"status": "ok", "scopes": scopes})).into_response()
}

/// `GET /metrics`: Prometheus text (no auth).
pub async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let gates: Vec<(String, usize, usize, u64)> = st
        .scopes
        .iter()
        .map(|s| {
            (
                s.scope.name.clone(),
                s.gate.running(st.cfg.max_calls_per_scope),
                s.gate.waiting(),
                s.gate.refused.load(std::sync::atomic::Ordering::Relaxed),
            )
        })
        .collect();
    let mut text = st.metrics.render_prometheus(st.telemetry_dropped());
    text.push_str(&st.counters.render(&gates));
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Unknown routes.
pub async fn not_found(State(st): State<Arc<AppState>>) -> Response {
    st.counters.refused("not_found");
    error_response(&ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        "Unknown route: polygw serves /v1/chat/completions, /v1/embeddings, /v1/models, \
         /v1/models/{id}, /healthz and /metrics",
    ))
}

/// A known route with another method.
pub async fn method_not_allowed() -> Response {
    error_response(&ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        "this route does not accept that method (chat and embeddings are POST; models, \
         healthz and metrics are GET)",
    ))
}
