//! The machinery every API route shares (the phases of a proxied call that do not
//! depend on the API's wire format): reading the body under its limits, resolving the
//! request's `model` to a chat scope, the scope's gate, running a plain call while
//! watching the client and the shutdown, and the `x-request-id` / `x-polygw-*` /
//! passed-through upstream headers of an answer. Routes (`crate::route`) parse, call
//! these, and render in their own API's shape.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::Extension;
use http_body_util::BodyExt;
use polygw::{CallOptions, ChatRequest, Commit, GatewayClient, GatewayError, LlmResponse};

use crate::conn::ConnCtx;
use crate::errors::{from_gateway, ApiError};
use crate::names;
use crate::scope::{GateRefusal, ScopeClient, Slot};
use crate::state::{cut_done, Scopes, Served, State};

/// The connection of a request, when served by [`crate::serve`].
pub type Conn = Option<Extension<Arc<ConnCtx>>>;

/// Seconds since the Unix epoch (`created` of a synthesized answer).
pub fn unix_now() -> u64 {
    unix_now_ms() / 1000
}

/// The wall clock in milliseconds since the Unix epoch.
pub fn unix_now_ms() -> u64 {
    // The proxy's only wall-clock reading: the `created` fields of answers it writes and
    // the reset instants its refusals name.
    #[allow(clippy::disallowed_methods)]
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Resolves when the client ends its side of the connection (never without one).
pub async fn client_gone(ctx: &Option<Arc<ConnCtx>>) {
    match ctx {
        Some(c) => c.closed().await,
        None => std::future::pending().await,
    }
}

/// The error of a client that ended its side of the connection before its answer:
/// the call is cancelled (or was never made). Written in case it only half-closed.
pub fn client_closed() -> ApiError {
    ApiError::new(
        StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        "invalid_request_error",
        "client_closed_request",
        "the client closed its side of the connection before the answer: polygw cancelled \
         the call (keep the connection open until the answer arrives)",
    )
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

/// A request that ends before its call: the error to render, and whether the
/// connection must close after the answer (its body was not read whole).
#[derive(Debug)]
pub struct Early {
    /// What to answer.
    pub error: ApiError,
    /// Close the connection after the answer.
    pub close: bool,
}

impl From<ApiError> for Early {
    fn from(error: ApiError) -> Self {
        Early {
            error,
            close: false,
        }
    }
}

/// Marks an answer as the connection's last (its request body was not read whole).
pub fn close_after(ctx: &Option<Arc<ConnCtx>>, h: &mut HeaderMap) {
    if let Some(c) = ctx {
        c.close_after_answer();
    }
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
}

/// Reads a request body under the size limit and the body timeout, into one buffer
/// sized by `Content-Length` (no intermediate copies).
pub async fn read_body(
    st: &State,
    headers: &HeaderMap,
    body: Body,
    ctx: &Option<Arc<ConnCtx>>,
) -> Result<Bytes, Early> {
    read_body_up_to(st, headers, body, ctx, st.cfg.max_body_bytes).await
}

/// [`read_body`] with its own limit (`/v1/messages` takes Anthropic's 32 MiB).
pub async fn read_body_up_to(
    st: &State,
    headers: &HeaderMap,
    body: Body,
    ctx: &Option<Arc<ConnCtx>>,
    limit: usize,
) -> Result<Bytes, Early> {
    let too_large = |st: &State| {
        st.counters.refused("body_too_large");
        Early {
            error: ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                ..ApiError::bad_request(
                    "body",
                    format!("the request body exceeds {limit} bytes (--max-body-bytes)"),
                )
            },
            close: true,
        }
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
        Ok(Err(msg)) => Err(Early {
            error: ApiError::bad_request("body", msg),
            close: true,
        }),
        Err(_) => {
            st.counters.closed("body_timeout");
            Err(Early {
                error: ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    "request_timeout",
                    format!(
                        "the request body did not arrive within {} s",
                        st.cfg.body_timeout.as_secs_f64()
                    ),
                ),
                close: true,
            })
        }
    }
}

/// The chat scope a request's `model` selects.
pub fn chat_scope<'a>(
    scopes: &'a Scopes,
    model: &str,
) -> Result<(&'a Served, &'a GatewayClient), ApiError> {
    let Some(served) = scopes.scope_for(model) else {
        return Err(scopes.unknown_model(model));
    };
    match &served.scope.client {
        ScopeClient::Chat(c) => Ok((served, c)),
        ScopeClient::Embedding(_) => Err(State::wrong_kind(model, served.scope.kind())),
    }
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

/// A call slot of the scope, unless the client leaves first (or already left: a
/// half-close right after its request makes no call at all).
pub async fn enter_gate(
    st: &State,
    served: &Served,
    ctx: &Option<Arc<ConnCtx>>,
) -> Result<Slot, Early> {
    if ctx.as_ref().is_some_and(|c| c.client_gone_now()) {
        return Err(client_closed().into());
    }
    tokio::select! {
        biased;
        () = client_gone(ctx) => Err(client_closed().into()),
        r = served.gate.enter(st.cfg.max_wait) => r.map_err(|why| {
            gate_refusal(&served.scope.name, why, st.cfg.max_wait).into()
        }),
    }
}

/// The options of a proxied call: the proxy's wait bound, named as its flag, the
/// call's id (known before the call, for `x-request-id`), and the client's W3C
/// `traceparent` (SPEC §26.1: an invalid one is ignored, and the call starts a trace of
/// its own, as Trace Context says).
pub fn call_options(st: &State, id: &str, headers: &HeaderMap) -> CallOptions {
    let mut o = CallOptions::default()
        .with_max_wait_named(st.cfg.max_wait, "--max-wait-s")
        .with_logical_call_id(id);
    o.trace_parent = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(polygw::otel::TraceParent::parse);
    o
}

/// How a plain call ended, besides its answer.
#[derive(Debug)]
pub enum Stopped {
    /// The call failed.
    Failed(GatewayError),
    /// The client left (the call was cancelled).
    ClientGone,
    /// The shutdown's grace period ended (the call was cancelled).
    Cut,
}

impl Stopped {
    /// The error to answer with.
    pub fn error(&self) -> ApiError {
        match self {
            Stopped::Failed(e) => from_gateway(e),
            Stopped::ClientGone => client_closed(),
            Stopped::Cut => shutting_down(),
        }
    }
}

/// Runs a plain chat call while watching the client and the shutdown; frees the gate's
/// slot when it ends.
pub async fn run_plain(
    st: &State,
    ctx: &Option<Arc<ConnCtx>>,
    client: &GatewayClient,
    request: ChatRequest,
    options: CallOptions,
    slot: Slot,
) -> Result<LlmResponse, Stopped> {
    let call = std::pin::pin!(client.chat_with(request, options));
    let r = tokio::select! {
        biased;
        r = call => r,
        () = client_gone(ctx) => return Err(Stopped::ClientGone),
        () = cut_done(st.cut_signal()) => return Err(Stopped::Cut),
    };
    drop(slot);
    r.map_err(Stopped::Failed)
}

/// Sets `x-request-id` (and `x-polygw-logical-call-id`, the same id) on a response.
pub fn set_request_id(h: &mut HeaderMap, id: &str) {
    if let Ok(v) = HeaderValue::from_str(id) {
        h.insert(names::X_REQUEST_ID, v.clone());
        h.insert(names::X_LOGICAL_CALL_ID, v);
    }
}

/// Sets `x-request-id` to `id` unless the response already has one.
pub fn ensure_request_id(h: &mut HeaderMap, id: &str) {
    if !h.contains_key(names::X_REQUEST_ID) {
        if let Ok(v) = HeaderValue::from_str(id) {
            h.insert(names::X_REQUEST_ID, v);
        }
    }
}

/// The upstream headers of the committed attempt (SPEC §17.4, §23.2): its
/// `x-request-id` (or Anthropic's `request-id`) as `x-polygw-upstream-request-id`,
/// `x-ratelimit-*` and `anthropic-ratelimit-*` unchanged.
pub fn upstream_headers(h: &mut HeaderMap, passed: &[(String, String)]) {
    for (n, v) in passed {
        let Ok(value) = HeaderValue::from_str(v) else {
            continue;
        };
        if n == "x-request-id" || n == "request-id" {
            h.insert(names::X_UPSTREAM_REQUEST_ID, value);
        } else if let Ok(name) = HeaderName::from_bytes(n.as_bytes()) {
            h.insert(name, value);
        }
    }
}

/// Response headers of a call that answered.
pub fn answer_headers(h: &mut HeaderMap, r: &LlmResponse) {
    // Room for all of them at once, not regrown on the way (issue 42).
    h.reserve(10 + r.upstream_headers.len());
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
    h.insert(names::X_HEDGES, count_value(r.call_stats.hedges));
    h.insert(names::X_ATTEMPTS, count_value(r.call_stats.attempts));
    if r.call_stats.resumes > 0 {
        h.insert(names::X_RESUMES, count_value(r.call_stats.resumes));
    }
    h.insert(
        names::X_USAGE_SOURCE,
        HeaderValue::from_static(r.usage_source.as_str()),
    );
    upstream_headers(h, &r.upstream_headers);
}

/// A count as a header value: the small counts every answer carries (attempts,
/// hedges, resumes) are static strings, not an allocation each (issue 27).
pub fn count_value(n: u32) -> HeaderValue {
    const SMALL: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    match SMALL.get(n as usize) {
        Some(s) => HeaderValue::from_static(s),
        None => HeaderValue::from(n),
    }
}

/// Response headers of a stream whose first leg committed.
pub fn commit_headers(h: &mut HeaderMap, c: &Commit) {
    if let Ok(v) = HeaderValue::from_str(&c.source) {
        h.insert(names::X_SOURCE, v);
    }
    h.insert(
        names::X_HEDGED,
        HeaderValue::from_static(if c.is_hedge { "true" } else { "false" }),
    );
    upstream_headers(h, &c.upstream_headers);
}

/// The `x-polygw-*` headers known on a failed call (`logical-call-id`, `attempts`,
/// `terminal-reason`).
pub fn failure_headers(h: &mut HeaderMap, e: &GatewayError, id: &str) {
    let id = e.context().map_or(id, |c| c.logical_call_id.as_str());
    set_request_id(h, id);
    if let Some(ctx) = e.context() {
        h.insert(names::X_ATTEMPTS, count_value(ctx.attempts));
    }
    if let Some(r) = e.terminal_reason() {
        h.insert(
            names::X_TERMINAL_REASON,
            HeaderValue::from_static(r.as_str()),
        );
    }
}

/// A comma-separated header of names (tools not sent upstream, parameters ignored),
/// when there are any.
pub fn list_header(h: &mut HeaderMap, name: HeaderName, items: &[String]) {
    if items.is_empty() {
        return;
    }
    if let Ok(v) = HeaderValue::from_str(&items.join(", ")) {
        h.insert(name, v);
    }
}

/// SPEC §23.3: `request` (the chat form of a client's request in `client_api`)
/// translated for the scope's sources of the other native APIs, each translation made
/// once and carried on the request; what a target cannot express is logged and given
/// back as `api: field` entries for `x-polygw-untranslated`.
pub fn translate_for_sources(
    client: &GatewayClient,
    request: &mut polygw::ChatRequest,
    client_api: polygw::core::source::SourceApi,
) -> Vec<String> {
    use polygw::core::source::SourceApi;
    use polygw_dialects::source::{for_messages, for_responses};
    let mut named = Vec::new();
    if request.native_only {
        return named;
    }
    let sources = &client.settings().sources;
    for api in [SourceApi::Messages, SourceApi::Responses] {
        if api == client_api || request.native_for(api).is_some() {
            continue;
        }
        let cap = sources
            .iter()
            .filter(|s| s.api == api)
            .map(|s| {
                s.max_output_tokens
                    .unwrap_or(polygw::core::key_funds::DEFAULT_MAX_OUTPUT_TOKENS)
            })
            .min();
        let Some(cap) = cap else {
            continue;
        };
        let out = match api {
            SourceApi::Messages => for_messages(request, cap),
            _ => for_responses(request),
        };
        if !out.unexpressed.is_empty() {
            tracing::info!(
                target_api = api.as_str(),
                client_api = client_api.as_str(),
                fields = %out.unexpressed.join(", "),
                "what the source's API cannot express is not sent to its sources"
            );
            named.extend(
                out.unexpressed
                    .iter()
                    .map(|f| format!("{}: {f}", api.as_str())),
            );
        }
        request
            .translated
            .push(std::sync::Arc::new(out.into_native(api)));
    }
    named
}

/// The answer as a Messages or Responses client is shown it (SPEC §23.6): a resumed
/// answer's usage is the last leg's context and the output delivered (agents size
/// their context from it); what every leg billed is in telemetry and the `polygw`
/// headers.
pub fn as_shown(r: &polygw::LlmResponse) -> std::borrow::Cow<'_, polygw::LlmResponse> {
    match r.answer_usage {
        Some(u) => std::borrow::Cow::Owned(polygw::LlmResponse {
            usage: u,
            ..r.clone()
        }),
        None => std::borrow::Cow::Borrowed(r),
    }
}

/// A plain answer from a source of another API than the client's (SPEC §23.3) is
/// written from what the engine read of it, never from its own body: that body is
/// dropped here.
pub fn drop_foreign_body(
    client: &GatewayClient,
    r: &mut polygw::LlmResponse,
    client_api: polygw::core::source::SourceApi,
) {
    let api = client
        .settings()
        .sources
        .iter()
        .find(|s| s.name == r.source)
        .map(|s| s.api);
    let foreign = match api {
        Some(polygw::core::source::SourceApi::Chat) | None => false,
        Some(a) => a != client_api,
    };
    if foreign {
        r.upstream = None;
        r.upstream_body = None;
    }
}

/// The names of the scope's sources that speak `api` (SPEC §23.1): a request of that
/// API reaches them as the client sent it.
pub fn sources_speaking(
    client: &GatewayClient,
    api: polygw::core::source::SourceApi,
) -> Vec<String> {
    client
        .settings()
        .sources
        .iter()
        .filter(|s| s.api == api)
        .map(|s| s.name.clone())
        .collect()
}

/// A request body within `limit` whose JSON values polygw accepts, or the answer to
/// give, rendered by the route (`render`: its API's error shape).
pub async fn json_body(
    st: &State,
    headers: &HeaderMap,
    body: Body,
    ctx: &Option<Arc<ConnCtx>>,
    limit: usize,
    render: fn(&ApiError) -> axum::response::Response,
) -> Result<Bytes, axum::response::Response> {
    let bytes = match read_body_up_to(st, headers, body, ctx, limit).await {
        Ok(b) => b,
        Err(e) => {
            let mut r = render(&e.error);
            if e.close {
                close_after(ctx, r.headers_mut());
            }
            return Err(r);
        }
    };
    crate::openai::check_json_values(&bytes).map_err(|e| render(&e))?;
    Ok(bytes)
}

/// The `model` a JSON body names, read without the API's other rules.
pub fn model_in(raw: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Model {
        model: String,
    }
    serde_json::from_slice::<Model>(raw).ok().map(|m| m.model)
}

/// A stand-in for a request the chat translation refuses, when the scope has sources
/// of the request's own API (SPEC §23.2: they take it as sent): the same model, stream
/// flag and output cap, and one user message holding the body's text, so that the
/// engine's estimates read the request's size. Only the native sources are sent the
/// request (`native_only`); `None` when the body names no model.
pub fn stand_in_body(api: polygw::core::source::SourceApi, raw: &[u8]) -> Option<Vec<u8>> {
    let body: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(raw).ok()?;
    let model = body.get("model")?.as_str()?;
    let stream = body
        .get("stream")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false);
    let text = String::from_utf8_lossy(raw);
    let v = match api {
        polygw::core::source::SourceApi::Messages => serde_json::json!({
            "model": model, "stream": stream,
            "max_tokens": body.get("max_tokens").and_then(serde_json::Value::as_u64).unwrap_or(4096),
            "messages": [{"role": "user", "content": text}],
        }),
        _ => serde_json::json!({"model": model, "stream": stream, "input": text}),
    };
    serde_json::to_vec(&v).ok()
}

/// Who calls a native-capable route, and how: its client key, the header that held the
/// proxy's key, the query string.
pub(crate) struct Caller<'a> {
    pub key: Option<&'a Arc<polygw::core::client_key::ClientKey>>,
    pub proxy: Option<crate::guard::ProxyCredential>,
    pub query: Option<&'a str>,
}

/// The client's own credential, when the scope has sources with `AUTH=client` (SPEC
/// §23.1; the proxy's own key, `proxy`, never goes upstream).
pub fn credential_for(
    client: &GatewayClient,
    headers: &HeaderMap,
    proxy: Option<crate::guard::ProxyCredential>,
) -> Option<polygw::core::request::ClientCredential> {
    let wanted = client
        .settings()
        .sources
        .iter()
        .any(|s| s.auth == Some(polygw::core::source::SourceAuth::Client));
    wanted
        .then(|| crate::guard::client_credential(headers, proxy))
        .flatten()
}

/// The answer to a counting endpoint (SPEC §23.7): the native source's, as it gave it
/// (a success or the request's fault), else polygw's `estimate` marked as such.
pub fn forwarded_or_estimate(
    what: &str,
    forwarded: Option<Result<polygw::core::ports::NativeAnswer, polygw::core::AttemptError>>,
    estimate: serde_json::Value,
) -> axum::response::Response {
    match forwarded {
        Some(Ok(a)) if a.status != 404 && a.status < 500 => {
            let status = StatusCode::from_u16(a.status).unwrap_or(StatusCode::BAD_GATEWAY);
            let ct = [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )];
            axum::response::IntoResponse::into_response((status, ct, a.body))
        }
        other => {
            if let Some(Err(e)) = &other {
                tracing::info!(error = %e, "{what}: the source could not be asked; polygw's estimate answers");
            }
            let mut r = axum::response::IntoResponse::into_response(axum::Json(estimate));
            r.headers_mut().insert(
                crate::names::X_USAGE_SOURCE,
                HeaderValue::from_static("estimated"),
            );
            r
        }
    }
}

/// A header map of `pairs` (unit tests).
#[cfg(test)]
pub(crate) fn test_headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, axum::http::HeaderValue::from_str(v).unwrap());
    }
    h
}

#[cfg(test)]
mod tests {
    use super::count_value;

    #[test]
    fn counts_are_written_as_decimals() {
        for n in [0, 1, 9, 10, 11, 4_000_000_000] {
            assert_eq!(count_value(n).to_str().unwrap(), n.to_string());
        }
    }
}
