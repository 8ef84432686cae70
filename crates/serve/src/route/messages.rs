//! `POST /v1/messages` and `POST /v1/messages/count_tokens` (SPEC §18.2): the Anthropic
//! Messages API over the same engine. The translation is `polygw_dialects::messages`;
//! this module runs its phases (parse, translate, call, answer a `message` or its event
//! stream) and answers every error in Anthropic's shape and statuses.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use polygw::{CallOptions, LlmResponse, StreamDelta};
use polygw_dialects::messages::{self as wire, MessagesStream};
use polygw_dialects::SseEvent;
use serde_json::json;

use crate::errors::{anthropic_error, from_gateway, ApiError};
use crate::http::{
    answer_headers, call_options, chat_scope, close_after, ensure_request_id, enter_gate,
    failure_headers, forwarded_or_estimate, list_header, read_body_up_to, run_plain,
    set_request_id, sources_speaking, Conn, Stopped,
};
use crate::names;
use crate::route::responses::dialect_error;
use crate::state::State as AppState;
use crate::stream::{respond, Encoder, Ending, Passing};
use polygw::core::client_key::ClientKey;
use polygw::core::native::NativeRequest;
use polygw::core::source::SourceApi;

/// Anthropic's request size limit: `/v1/messages` takes bodies up to it whatever
/// `--max-body-bytes` says, when that is smaller (SPEC §23.2).
pub const MESSAGES_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// `POST /v1/messages` (also with `?beta=true`).
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
    // Anthropic's SDKs read `request-id`.
    if let Some(v) = resp.headers().get(names::X_REQUEST_ID).cloned() {
        resp.headers_mut().insert("request-id", v);
    }
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
        let mut r = anthropic_error(&e.error);
        if e.close {
            close_after(ctx, r.headers_mut());
        }
        r
    };
    let limit = st.cfg.max_body_bytes.max(MESSAGES_MAX_BODY_BYTES);
    let bytes = match read_body_up_to(st, headers, body, ctx, limit).await {
        Ok(b) => b,
        Err(e) => return early(e),
    };
    if let Err(e) = crate::openai::check_json_values(&bytes) {
        return anthropic_error(&e);
    }
    let parsed = wire::parse_request(&bytes).and_then(|r| {
        let t = wire::to_chat(&r)?;
        Ok((r, t))
    });
    let model = match &parsed {
        Ok((r, _)) => r.model().to_string(),
        Err(_) => crate::http::model_in(&bytes).unwrap_or_default(),
    };
    let scopes = st.scopes();
    let (served, client) = match chat_scope(&scopes, &model) {
        Ok(x) => x,
        Err(e) => match parsed {
            Err(d) => return anthropic_error(&dialect_error(d)),
            Ok(_) => return anthropic_error(&e),
        },
    };
    // Sources that speak Messages get the client's own request (SPEC §23.2), also one
    // the translation to chat refuses (then only they are sent it).
    let native_sources = sources_speaking(client, SourceApi::Messages);
    let (req, mut t, native_only) = match parsed {
        Ok((r, t)) => (r, t, false),
        Err(d) => {
            let stand_in = (!native_sources.is_empty())
                .then(|| crate::http::stand_in_body(SourceApi::Messages, &bytes))
                .flatten()
                .and_then(|b| wire::parse_request(&b).ok())
                .and_then(|r| wire::to_chat(&r).ok().map(|t| (r, t)));
            match stand_in {
                Some((r, t)) => (r, t, true),
                None => return anthropic_error(&dialect_error(d)),
            }
        }
    };
    if !native_sources.is_empty() {
        t.request.native = native_request(&bytes, query, headers).map(Arc::new);
        t.request.native_only = native_only;
    }
    t.request.client_credential = crate::http::credential_for(client, headers, proxy);
    drop(bytes);
    // The scope's `responses` sources get the request in their API (SPEC §23.3).
    let untranslated =
        crate::http::translate_for_sources(client, &mut t.request, SourceApi::Messages);
    if !req.unsupported_tools().is_empty() {
        tracing::info!(tools = %req.unsupported_tools().join(", "), "server tools not sent upstream");
    }
    // The client key's scopes, models, limits and budgets (SPEC §21.1), before a slot.
    let charge = match crate::keys::admit(key, &served.scope.name, req.model(), async |k| {
        client.admit_key(k, &t.request).await
    })
    .await
    {
        Ok(c) => c,
        Err(e) => return anthropic_error(&e),
    };
    let slot = match enter_gate(st, served, ctx).await {
        Ok(s) => s,
        Err(e) => return early(e),
    };
    let message_id = format!("msg_{id}");
    let mut options = call_options(st, id, headers);
    if let Some(c) = charge {
        options = options.with_client_key(c);
    }
    options.api = Some("messages");
    options.model = Some(model.clone());
    options.affinity_key = crate::affinity::messages_key(headers, &req, &t.request);
    options.attribution = crate::attribution::of(headers, None);
    let mut resp = if t.request.stream {
        let estimate = t.meta.prompt_estimate();
        let enc = MessagesEncoder {
            stream: MessagesStream::new(&message_id, t.meta, estimate),
            passing: Passing::new(
                SourceApi::Messages,
                t.request.native.is_some(),
                &["message_stop"],
            ),
        };
        respond(
            st.clone(),
            client.clone(),
            t.request,
            options,
            slot,
            ctx.clone(),
            enc,
            anthropic_error,
        )
        .await
    } else {
        match run_plain(st, ctx, client, t.request, options, slot).await {
            Ok(mut r) => {
                crate::http::drop_foreign_body(client, &mut r, SourceApi::Messages);
                let mut resp = match r.upstream_body.as_ref() {
                    // A `messages` source's answer, as it sent it.
                    Some(b) if native_sources.contains(&r.source) => (
                        [(
                            header::CONTENT_TYPE,
                            HeaderValue::from_static("application/json"),
                        )],
                        b.clone(),
                    )
                        .into_response(),
                    _ => Json(wire::message_object(
                        &message_id,
                        &t.meta,
                        &crate::http::as_shown(&r),
                    ))
                    .into_response(),
                };
                answer_headers(resp.headers_mut(), &r);
                resp
            }
            Err(Stopped::Failed(e)) => {
                let api = from_gateway(&e);
                crate::route::chat::log_failure(&api, &e);
                let mut resp = anthropic_error(&api);
                failure_headers(resp.headers_mut(), &e, id);
                resp
            }
            Err(s) => {
                let mut resp = anthropic_error(&s.error());
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

/// `POST /v1/messages/count_tokens` (SPEC §23.7): forwarded to the scope's `messages`
/// source (outside its quotas) and answered as it answers; without one, or when it has
/// no such endpoint (404) or cannot be reached, the estimate polygw reserves for TPM
/// (`x-polygw-usage-source: estimated`).
pub async fn count_tokens(
    State(st): State<Arc<AppState>>,
    conn: Conn,
    proxy: Option<Extension<crate::guard::ProxyCredential>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let ctx = conn.map(|Extension(c)| c);
    let proxy = proxy.map(|Extension(p)| p);
    let limit = st.cfg.max_body_bytes.max(MESSAGES_MAX_BODY_BYTES);
    let bytes =
        match crate::http::json_body(&st, &headers, body, &ctx, limit, anthropic_error).await {
            Ok(b) => b,
            Err(r) => return r,
        };
    let estimate = match wire::count_tokens(&bytes) {
        Ok(n) => n,
        Err(e) => return anthropic_error(&dialect_error(e)),
    };
    let forwarded = match native_request(&bytes, None, &headers) {
        Some(n) => {
            let model = n
                .body
                .get("model")
                .and_then(|m| m.as_str())
                .unwrap_or_default();
            match chat_scope(&st.scopes(), model) {
                Ok((_, client)) => {
                    let credential = crate::http::credential_for(client, &headers, proxy);
                    client
                        .native_call(
                            SourceApi::Messages,
                            "count_tokens",
                            &n.body,
                            &n.headers,
                            credential.as_ref(),
                        )
                        .await
                }
                // A model no scope serves: the estimate, as without a source.
                Err(_) => None,
            }
        }
        None => None,
    };
    forwarded_or_estimate("count_tokens", forwarded, json!({"input_tokens": estimate}))
}

/// The client's request as a `messages` source gets it: its body, its `anthropic-*`
/// headers and its query string (`None` when the body is no JSON object, which
/// parsing it already refused).
fn native_request(bytes: &[u8], query: Option<&str>, headers: &HeaderMap) -> Option<NativeRequest> {
    let body = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(bytes).ok()?;
    let headers = headers
        .iter()
        .filter(|(k, _)| k.as_str().starts_with("anthropic-"))
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect();
    Some(NativeRequest {
        api: SourceApi::Messages,
        body,
        headers,
        query: query.map(str::to_string),
    })
}

/// The Messages event stream, over [`MessagesStream`]; `ping` as the keepalive. A
/// `messages` source's events pass unchanged ([`Passing`]).
struct MessagesEncoder {
    stream: MessagesStream,
    passing: Passing,
}

fn write(out: &mut Vec<u8>, events: Vec<SseEvent>) {
    for e in events {
        e.write_to(out);
    }
}

impl Encoder for MessagesEncoder {
    fn open(&mut self, out: &mut Vec<u8>) {
        if self.passing.open_translated() {
            write(out, self.stream.start());
        }
    }

    fn committed(&mut self, c: &polygw::Commit) {
        // A leg continues the source's cut stream (SPEC §23.6): the encoder follows
        // what was passed, and writes the rest.
        for (name, data) in self.passing.continue_after(c).unwrap_or_default() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&data) {
                self.stream.observe(&name, &v);
            }
        }
    }

    fn delta(&mut self, d: StreamDelta, out: &mut Vec<u8>) {
        if let Some(d) = self.passing.pass(d, out) {
            write(out, self.stream.delta(&d));
        }
    }

    fn done(&mut self, r: &LlmResponse, out: &mut Vec<u8>) {
        match self.passing.ending() {
            Ending::Ended => {}
            // Accepted without `message_stop` (it broke after its stop reason).
            Ending::Unended => {
                SseEvent::new("message_stop", json!({"type": "message_stop"})).write_to(out)
            }
            Ending::Translate => write(out, self.stream.finish(&crate::http::as_shown(r))),
        }
    }

    fn fail(&mut self, e: &ApiError, out: &mut Vec<u8>) {
        let (_, body) = wire::error_body(e.status.as_u16(), &e.message);
        let kind = body["error"]["type"]
            .as_str()
            .unwrap_or("overloaded_error")
            .to_string();
        write(out, self.stream.fail(&kind, &e.message));
    }

    fn keepalive(&mut self, out: &mut Vec<u8>) {
        self.stream.ping().write_to(out);
    }
}
