//! `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}` (SPEC §18.1): the
//! OpenAI Responses API over the same engine as chat completions. The translation is
//! `polygw_dialects::responses`; this module only runs its phases: parse, load the
//! stored conversation of `previous_response_id`, translate, call, answer (a `response`
//! object or its typed event stream), store.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures_util::future::BoxFuture;
use polygw::core::ports::{
    answered_input, conversation, BrokenChain, ResponseStore, StoredResponse,
};
use polygw::{CallOptions, GatewayClient, LlmResponse, StreamDelta};
use polygw_dialects::responses::{self as wire, ResponsesStream};
use polygw_dialects::{DialectError, SseEvent};
use serde_json::{json, Value};

use crate::errors::{error_response, from_gateway, ApiError};
use crate::http::{
    answer_headers, call_options, chat_scope, close_after, ensure_request_id, enter_gate,
    failure_headers, forwarded_or_estimate, list_header, read_body, run_plain, set_request_id,
    sources_speaking, unix_now, Conn, Stopped,
};
use crate::names;
use crate::scope::ScopeClient;
use crate::state::State as AppState;
use crate::stream::{respond, Encoder, Ending, Passing};
use polygw::core::client_key::{may_use_scope, ClientKey};
use polygw::core::native::NativeRequest;
use polygw::core::source::SourceApi;

/// A dialect error as OpenAI's error (400 naming the field).
pub(crate) fn dialect_error(e: DialectError) -> ApiError {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    ApiError {
        status,
        param: e.param,
        ..ApiError::new(
            status,
            "invalid_request_error",
            "invalid_request",
            e.message,
        )
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        format!("No response with id '{id}' found (it was not stored, expired, or was deleted)."),
    )
    .with_param("previous_response_id")
}

/// A stored response whose conversation lost a turn (404: the conversation cannot be
/// continued as it was).
fn broken_chain(id: &str, broken: &BrokenChain) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        format!("The conversation of response '{id}' cannot be rebuilt: {broken}."),
    )
    .with_param("previous_response_id")
}

fn store_error(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "response_store",
        format!("the response store failed: {e}"),
    )
}

/// `POST /v1/responses`.
pub async fn create(
    State(st): State<Arc<AppState>>,
    conn: Conn,
    key: Option<Extension<Arc<ClientKey>>>,
    proxy: Option<Extension<crate::guard::ProxyCredential>>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let ctx = conn.map(|Extension(c)| c);
    let proxy = proxy.map(|Extension(p)| p);
    let key = key.map(|Extension(k)| k);
    let id = CallOptions::new_logical_call_id();
    let caller = crate::http::Caller {
        key: key.as_ref(),
        proxy,
        query: uri.query(),
    };
    let mut resp = create_inner(&st, &ctx, caller, &headers, body, &id).await;
    ensure_request_id(resp.headers_mut(), &id);
    resp
}

async fn create_inner(
    st: &Arc<AppState>,
    ctx: &Option<Arc<crate::conn::ConnCtx>>,
    caller: crate::http::Caller<'_>,
    headers: &HeaderMap,
    body: Body,
    id: &str,
) -> Response {
    let crate::http::Caller { key, proxy, query } = caller;
    let early = |e: crate::http::Early| {
        let mut r = error_response(&e.error);
        if e.close {
            close_after(ctx, r.headers_mut());
        }
        r
    };
    let bytes = match read_body(st, headers, body, ctx).await {
        Ok(b) => b,
        Err(e) => return early(e),
    };
    if let Err(e) = crate::openai::check_json_values(&bytes) {
        return error_response(&e);
    }
    let parsed = wire::parse_request(&bytes);
    let model = match &parsed {
        Ok(r) => r.model().to_string(),
        Err(_) => crate::http::model_in(&bytes).unwrap_or_default(),
    };
    let scopes = st.scopes();
    let (served, client) = match chat_scope(&scopes, &model) {
        Ok(x) => x,
        Err(e) => match parsed {
            Err(d) => return error_response(&dialect_error(d)),
            Ok(_) => return error_response(&e),
        },
    };
    // Sources that speak Responses get the client's own request (SPEC §23.2), also one
    // the translation to chat refuses (then only they are sent it).
    let native_sources = sources_speaking(client, SourceApi::Responses);
    let stand_in = || {
        (!native_sources.is_empty())
            .then(|| crate::http::stand_in_body(SourceApi::Responses, &bytes))
            .flatten()
            .and_then(|b| wire::parse_request(&b).ok())
    };
    let mut native_only = false;
    let req = match parsed {
        Ok(r) => r,
        Err(d) => match stand_in() {
            Some(r) => {
                native_only = true;
                r
            }
            None => return error_response(&dialect_error(d)),
        },
    };
    let native_body = (!native_sources.is_empty())
        .then(|| serde_json::from_slice::<serde_json::Map<String, Value>>(&bytes).ok())
        .flatten();
    let store = client.response_store();
    let scope = served.scope.name.clone();
    let owner = owner_scope(&scope, key.map(|k| &**k));
    // The conversation so far, when the request continues a stored response. One
    // polygw did not store goes as sent to the scope's `responses` sources, which may
    // hold it (DECISIONS 173).
    let mut passes_state = false;
    let history: Vec<Value> = match req.previous_response_id() {
        None => Vec::new(),
        Some(prev) => match store.chain(&owner, prev, now_ms()).await {
            Ok(chain) => match conversation(&chain) {
                Ok(h) if !chain.is_empty() => h,
                // Not stored, or stored with a turn gone: a `responses` source may hold
                // it; no source is ever sent a shortened conversation.
                _ if native_body.is_some() => {
                    passes_state = true;
                    Vec::new()
                }
                Ok(_) => return error_response(&not_found(prev)),
                Err(broken) => return error_response(&broken_chain(prev, &broken)),
            },
            Err(e) => return error_response(&store_error(e)),
        },
    };
    // Expanded from polygw's store: the answer says which response it continues.
    let restore_previous = (!history.is_empty())
        .then(|| req.previous_response_id().map(str::to_string))
        .flatten();
    let native = native_body.map(|mut body| {
        if !history.is_empty() {
            // Responses state expanded from polygw's store (SPEC §23.2's edit list):
            // the stored conversation, then this request's input.
            body.remove("previous_response_id");
            let input = match body.remove("input") {
                Some(Value::Array(items)) => items,
                Some(Value::String(text)) => {
                    vec![json!({"type": "message", "role": "user", "content": text})]
                }
                Some(other) => vec![other],
                None => Vec::new(),
            };
            body.insert(
                "input".into(),
                Value::Array(history.iter().cloned().chain(input).collect()),
            );
        }
        if !passes_state {
            stateless(&mut body);
        }
        Arc::new(NativeRequest {
            api: SourceApi::Responses,
            body,
            headers: Vec::new(),
            query: query.map(str::to_string),
        })
    });
    let (req, mut t) = match wire::to_chat(&req, &history) {
        Ok(t) => (req, t),
        Err(e) => {
            let translated = stand_in().and_then(|r| wire::to_chat(&r, &[]).ok().map(|t| (r, t)));
            match translated {
                Some(x) if native.is_some() => {
                    native_only = true;
                    x
                }
                _ => return error_response(&dialect_error(e)),
            }
        }
    };
    t.request.native_only = native_only;
    drop(bytes);
    t.request.native = native;
    t.request.client_credential = crate::http::credential_for(client, headers, proxy);
    if passes_state {
        // Only the sources that may hold the state can continue it.
        t.request.native_only = true;
    }
    // The scope's `messages` sources get the request in their API (SPEC §23.3).
    let untranslated =
        crate::http::translate_for_sources(client, &mut t.request, SourceApi::Responses);
    if !req.unsupported_tools().is_empty() {
        tracing::info!(tools = %req.unsupported_tools().join(", "), "hosted tools not sent upstream");
    }
    // The client key's scopes, models, limits and budgets (SPEC §21.1), before a slot.
    let charge = match crate::keys::admit(key, &served.scope.name, req.model(), async |k| {
        client.admit_key(k, &t.request).await
    })
    .await
    {
        Ok(c) => c,
        Err(e) => return error_response(&e),
    };
    let slot = match enter_gate(st, served, ctx).await {
        Ok(s) => s,
        Err(e) => return early(e),
    };
    let response_id = format!("resp_{id}");
    let created_at = unix_now();
    let mut options = call_options(st, id, headers);
    if let Some(c) = charge {
        options = options.with_client_key(c);
    }
    options.api = Some("responses");
    options.model = Some(model.clone());
    options.affinity_key = crate::affinity::responses_key(headers, &req, &t.request);
    options.attribution = crate::attribution::of(
        headers,
        req.affinity_key()
            .or_else(|| crate::attribution::chat_cache_key(&t.request)),
    );
    drop(history);
    // One turn: this request's input, linked to the turn it continues (SPEC §24.5).
    let saving = Saving {
        store: req.store().then(|| store.clone()),
        scope: owner,
        ttl_ms: ttl_ms(client),
        max_bytes: client.settings().responses_max_bytes_per_key,
        input_items: t.meta.input_items().to_vec(),
        previous_id: req.previous_response_id().map(str::to_string),
    };
    let mut resp = if t.request.stream {
        let enc = ResponsesEncoder {
            restore_previous: restore_previous.clone(),
            passing: Passing::new(
                SourceApi::Responses,
                t.request.native.is_some(),
                &[
                    "response.completed",
                    "response.incomplete",
                    "response.failed",
                ],
            ),
            stream: ResponsesStream::new(&response_id, created_at, t.meta),
            saving: Some(saving),
        };
        respond(
            st.clone(),
            client.clone(),
            t.request,
            options,
            slot,
            ctx.clone(),
            enc,
            error_response,
        )
        .await
    } else {
        match run_plain(st, ctx, client, t.request, options, slot).await {
            Ok(mut r) => {
                crate::http::drop_foreign_body(client, &mut r, SourceApi::Responses);
                let mut resp = match r.upstream_body.as_ref() {
                    // A `responses` source's answer, as it sent it (its id is the
                    // source's: polygw does not store it).
                    Some(b) if native_sources.contains(&r.source) => {
                        // Stored under the source's id, so that a later
                        // `previous_response_id` continues it on any source.
                        let mut body = b.clone();
                        if let Some(mut obj) = r.upstream.clone() {
                            if let Some(prev) = &restore_previous {
                                restore_previous_id(&mut obj, prev);
                                body = serde_json::to_vec(&obj).unwrap_or(body);
                            }
                            if let Some(f) = saving.save(&Value::Object(obj)) {
                                f.await;
                            }
                        }
                        (
                            [(
                                header::CONTENT_TYPE,
                                HeaderValue::from_static("application/json"),
                            )],
                            body,
                        )
                            .into_response()
                    }
                    _ => {
                        let shown = crate::http::as_shown(&r);
                        let obj = wire::response_object(&response_id, created_at, &t.meta, &shown);
                        if let Some(f) = saving.save(&obj) {
                            f.await;
                        }
                        Json(obj).into_response()
                    }
                };
                answer_headers(resp.headers_mut(), &r);
                resp
            }
            Err(Stopped::Failed(e)) => {
                let api = from_gateway(&e);
                crate::route::chat::log_failure(&api, &e);
                let mut resp = error_response(&api);
                failure_headers(resp.headers_mut(), &e, id);
                resp
            }
            Err(s) => {
                let mut resp = error_response(&s.error());
                set_request_id(resp.headers_mut(), id);
                resp
            }
        }
    };
    let h = resp.headers_mut();
    list_header(h, names::X_UNSUPPORTED_TOOLS, req.unsupported_tools());
    list_header(h, names::X_IGNORED_PARAMS, req.ignored());
    list_header(h, names::X_UNTRANSLATED, &untranslated);
    resp
}

/// `POST /v1/responses/input_tokens` (SPEC §23.7): forwarded to the scope's
/// `responses` source (outside its quotas) and answered as it answers; without one, or
/// on its 404 or a failure, polygw's estimate (`x-polygw-usage-source: estimated`).
pub async fn input_tokens(
    State(st): State<Arc<AppState>>,
    conn: Conn,
    proxy: Option<Extension<crate::guard::ProxyCredential>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let ctx = conn.map(|Extension(c)| c);
    let proxy = proxy.map(|Extension(p)| p);
    let limit = st.cfg.max_body_bytes;
    let bytes = match crate::http::json_body(&st, &headers, body, &ctx, limit, error_response).await
    {
        Ok(b) => b,
        Err(r) => return r,
    };
    let req = match wire::parse_request(&bytes) {
        Ok(r) => r,
        Err(e) => return error_response(&dialect_error(e)),
    };
    let estimate = match wire::to_chat(&req, &[]) {
        Ok(t) => polygw::core::resume::estimate_prompt_tokens(&t.request),
        Err(e) => return error_response(&dialect_error(e)),
    };
    let scopes = st.scopes();
    let forwarded = match (
        chat_scope(&scopes, req.model()),
        serde_json::from_slice::<serde_json::Map<String, Value>>(&bytes),
    ) {
        (Ok((_, client)), Ok(body)) => {
            let credential = crate::http::credential_for(client, &headers, proxy);
            client
                .native_call(
                    SourceApi::Responses,
                    "input_tokens",
                    &body,
                    &[],
                    credential.as_ref(),
                )
                .await
        }
        _ => None,
    };
    forwarded_or_estimate(
        "input_tokens",
        forwarded,
        json!({"object": "response.input_tokens", "input_tokens": estimate}),
    )
}

/// A `responses` source is called stateless (SPEC §23.5): `store: false`, and the
/// reasoning's encrypted content included, so that the conversation — kept by polygw's
/// store, or by the client — can continue on any source of the scope. A background
/// response (which the source must store) is left as sent, and so is a request that
/// continues a response polygw does not hold (the source may).
fn stateless(body: &mut serde_json::Map<String, Value>) {
    if body.get("background").and_then(Value::as_bool) == Some(true) {
        return;
    }
    body.insert("store".into(), Value::Bool(false));
    const ENCRYPTED: &str = "reasoning.encrypted_content";
    match body.get_mut("include") {
        Some(Value::Array(list)) => {
            if !list.iter().any(|v| v.as_str() == Some(ENCRYPTED)) {
                list.push(json!(ENCRYPTED));
            }
        }
        Some(_) => {}
        None => {
            body.insert("include".into(), json!([ENCRYPTED]));
        }
    }
}

fn now_ms() -> i64 {
    i64::try_from(unix_now()).unwrap_or(i64::MAX / 1000) * 1000
}

/// `RESPONSES__TTL_S` of the client's scope, in ms.
fn ttl_ms(client: &GatewayClient) -> i64 {
    i64::try_from(client.settings().responses_ttl.as_millis()).unwrap_or(i64::MAX)
}

/// What storing an answered response needs.
struct Saving {
    /// `None`: `store: false`.
    store: Option<Arc<dyn ResponseStore>>,
    scope: String,
    ttl_ms: i64,
    /// `RESPONSES__MAX_BYTES_PER_KEY`.
    max_bytes: u64,
    /// This turn's input items.
    input_items: Vec<Value>,
    /// The response this turn continues.
    previous_id: Option<String>,
}

impl Saving {
    /// Stores the response (bounded: a store that does not answer within 5 s is
    /// logged, the answer goes out anyway).
    fn save(self, response: &Value) -> Option<BoxFuture<'static, ()>> {
        let store = self.store?;
        let id = response.get("id").and_then(Value::as_str)?.to_string();
        let now = now_ms();
        let entry = StoredResponse {
            id,
            scope: self.scope,
            response: response.clone(),
            input_items: self.input_items,
            previous_id: self.previous_id,
            created_at_ms: now,
            expires_at_ms: now.saturating_add(self.ttl_ms),
        };
        let max_bytes = self.max_bytes;
        Some(Box::pin(async move {
            match tokio::time::timeout(
                std::time::Duration::from_secs(5),
                store.put(entry, max_bytes),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "storing a response failed"),
                Err(_) => tracing::warn!("storing a response took more than 5 s; given up"),
            }
        }))
    }
}

/// The Responses event stream, over [`ResponsesStream`].
struct ResponsesEncoder {
    /// A `responses` source's events pass unchanged (but `restore_previous`).
    passing: Passing,
    /// The `previous_response_id` polygw expanded from its store: the source never saw
    /// it, the client's answer carries it back.
    restore_previous: Option<String>,
    stream: ResponsesStream,
    saving: Option<Saving>,
}

fn write(out: &mut Vec<u8>, events: Vec<SseEvent>) {
    for e in events {
        e.write_to(out);
    }
}

impl Encoder for ResponsesEncoder {
    fn open(&mut self, out: &mut Vec<u8>) {
        if self.passing.open_translated() {
            write(out, self.stream.start());
        }
    }

    fn committed(&mut self, c: &polygw::Commit) {
        // A leg continues the source's cut stream (SPEC §23.6): the encoder follows
        // what was passed (the previous response id as the client saw it), and writes
        // the rest.
        for (_, data) in self.passing.continue_after(c).unwrap_or_default() {
            if let Ok(v) = serde_json::from_str::<Value>(&data) {
                self.stream.observe(&v);
            }
        }
    }

    fn delta(&mut self, d: StreamDelta, out: &mut Vec<u8>) {
        let prev = self.restore_previous.as_deref();
        let edited = self.passing.pass_edited(d, out, |ev| {
            if let Some(prev) = prev {
                restore_previous_in_event(ev, prev);
            }
        });
        if let Some(d) = edited {
            write(out, self.stream.delta(&d));
        }
    }

    fn done(&mut self, r: &LlmResponse, out: &mut Vec<u8>) {
        if let Ending::Translate = self.passing.ending() {
            write(out, self.stream.finish(&crate::http::as_shown(r)));
        }
        // Native: the source's terminal event carried the whole response.
    }

    fn finished(&mut self) -> Option<BoxFuture<'static, ()>> {
        let response = if self.passing.is_native() {
            // The source's terminal event carries its whole response.
            let last: Value = serde_json::from_str(self.passing.last_event()?).ok()?;
            last.get("response")?.clone()
        } else {
            self.stream.response()?.clone()
        };
        self.saving.take()?.save(&response)
    }

    fn fail(&mut self, e: &ApiError, out: &mut Vec<u8>) {
        let code = e.code.clone().unwrap_or_else(|| "server_error".into());
        if self.passing.is_native() {
            // Native: Responses' `error` event, numbered after the source's last.
            let seq = self
                .passing
                .last_event()
                .and_then(|l| serde_json::from_str::<Value>(l).ok())
                .and_then(|v| v.get("sequence_number").and_then(Value::as_u64))
                .map_or(0, |n| n + 1);
            SseEvent::new(
                "error",
                json!({"type": "error", "code": code, "message": e.message, "param": null,
                    "sequence_number": seq}),
            )
            .write_to(out);
            return;
        }
        write(out, self.stream.fail(&code, &e.message));
    }
}

/// Sets `previous_response_id` on a response object.
fn restore_previous_id(response: &mut serde_json::Map<String, Value>, prev: &str) {
    response.insert(
        "previous_response_id".into(),
        Value::String(prev.to_string()),
    );
}

/// In a native event that carries the response (`response.created`, `…completed`, …):
/// its `previous_response_id`, as the client sent it.
fn restore_previous_in_event(ev: &mut polygw::core::native::NativeEvent, prev: &str) {
    if !ev.event.as_deref().is_some_and(|e| {
        matches!(
            e,
            "response.created"
                | "response.in_progress"
                | "response.completed"
                | "response.incomplete"
        )
    }) {
        return;
    }
    if let Ok(Value::Object(mut v)) = serde_json::from_str::<Value>(&ev.data) {
        if let Some(Value::Object(r)) = v.get_mut("response") {
            restore_previous_id(r, prev);
            ev.data = Value::Object(v).to_string();
        }
    }
}

/// Where a response is stored: under its scope and, when the call came with a client key
/// of the key store, under that key too (`SCOPE/key_…`; scope names have no `/`) — a
/// stored response is read, continued and deleted only with the key that stored it,
/// as OpenAI keeps a project's responses to that project. Static proxy keys
/// (`POLYGW_PROXY_KEYS`) and unauthenticated proxies share the scope's.
fn owner_scope(scope: &str, key: Option<&ClientKey>) -> String {
    match key {
        Some(k) => format!("{scope}/{}", k.id),
        None => scope.to_string(),
    }
}

/// The chat clients' stores, as each holds `key`'s responses — of the scopes the key
/// may use now (a key whose scopes changed reads and deletes no other scope's).
fn stores(st: &AppState, key: Option<&ClientKey>) -> Vec<(String, Arc<dyn ResponseStore>)> {
    st.scopes()
        .iter()
        .filter(|s| key.is_none_or(|k| may_use_scope(k, &s.scope.name)))
        .filter_map(|s| match &s.scope.client {
            ScopeClient::Chat(c) => Some((owner_scope(&s.scope.name, key), c.response_store())),
            ScopeClient::Embedding(_) => None,
        })
        .collect()
}

/// The stored response `id` of `key` and the turns it continues (newest first), from
/// whichever scope stored it; the answer to give when there is none (404) or a store
/// failed.
async fn find_stored(
    st: &AppState,
    key: Option<&ClientKey>,
    id: &str,
    whole: bool,
) -> Result<Vec<StoredResponse>, Response> {
    for (scope, store) in stores(st, key) {
        let found = if whole {
            store.chain(&scope, id, now_ms()).await
        } else {
            store.get(&scope, id, now_ms()).await.map(Vec::from_iter)
        };
        match found {
            Ok(v) if v.is_empty() => {}
            Ok(v) => return Ok(v),
            Err(e) => return Err(error_response(&store_error(e))),
        }
    }
    Err(error_response(&not_found(id).with_param("response_id")))
}

/// `GET /v1/responses/{id}`: a stored response, from whichever scope stored it.
pub async fn get(
    State(st): State<Arc<AppState>>,
    key: Option<Extension<Arc<ClientKey>>>,
    Path(id): Path<String>,
) -> Response {
    let key = key.map(|Extension(k)| k);
    match find_stored(&st, key.as_deref(), &id, false).await {
        Ok(mut v) => Json(v.swap_remove(0).response).into_response(),
        Err(r) => r,
    }
}

/// `GET /v1/responses/{id}/input_items`: the input items a stored response answered.
pub async fn input_items(
    State(st): State<Arc<AppState>>,
    key: Option<Extension<Arc<ClientKey>>>,
    Path(id): Path<String>,
) -> Response {
    let key = key.map(|Extension(k)| k);
    let chain = match find_stored(&st, key.as_deref(), &id, true).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let items = match answered_input(&chain) {
        Ok(items) => items,
        Err(broken) => {
            return error_response(&broken_chain(&id, &broken).with_param("response_id"))
        }
    };
    let first = items.first().and_then(|i| i.get("id")).cloned();
    let last = items.last().and_then(|i| i.get("id")).cloned();
    Json(json!({
        "object": "list",
        "data": items,
        "first_id": first,
        "last_id": last,
        "has_more": false,
    }))
    .into_response()
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(st): State<Arc<AppState>>,
    key: Option<Extension<Arc<ClientKey>>>,
    Path(id): Path<String>,
) -> Response {
    let key = key.map(|Extension(k)| k);
    for (scope, store) in stores(&st, key.as_deref()) {
        match store.delete(&scope, &id).await {
            Ok(true) => {
                return Json(json!({"id": id, "object": "response", "deleted": true}))
                    .into_response()
            }
            Ok(false) => {}
            Err(e) => return error_response(&store_error(e)),
        }
    }
    error_response(&not_found(&id).with_param("response_id"))
}
