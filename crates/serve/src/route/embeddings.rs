//! `POST /v1/embeddings` (SPEC §10, §15, §17.5): strings or token arrays, vectors back
//! as floats or base64 (the OpenAI SDKs' default).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use polygw::CallOptions;

use crate::errors::{error_response, from_gateway};
use crate::http::{
    call_options, client_closed, client_gone, close_after, ensure_request_id, enter_gate,
    failure_headers, read_body, set_request_id, shutting_down, Conn,
};
use crate::names;
use crate::openai::{embeddings_json, parse_embeddings};
use crate::scope::ScopeClient;
use crate::state::{cut_done, State as AppState};
use polygw::core::client_key::ClientKey;

/// `POST /v1/embeddings`.
pub async fn handle(
    State(st): State<Arc<AppState>>,
    conn: Conn,
    key: Option<Extension<Arc<ClientKey>>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let ctx = conn.map(|Extension(c)| c);
    let key = key.map(|Extension(k)| k);
    let id = CallOptions::new_logical_call_id();
    let mut resp = inner(&st, &ctx, key.as_ref(), &headers, body, &id).await;
    ensure_request_id(resp.headers_mut(), &id);
    resp
}

async fn inner(
    st: &Arc<AppState>,
    ctx: &Option<Arc<crate::conn::ConnCtx>>,
    key: Option<&Arc<ClientKey>>,
    headers: &HeaderMap,
    body: Body,
    id: &str,
) -> Response {
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
    let parsed = match parse_embeddings(&bytes) {
        Ok(p) => p,
        Err(e) => return error_response(&e),
    };
    drop(bytes);
    let scopes = st.scopes();
    let Some(served) = scopes.scope_for(&parsed.model) else {
        return error_response(&scopes.unknown_model(&parsed.model));
    };
    let ScopeClient::Embedding(client) = &served.scope.client else {
        return error_response(&AppState::wrong_kind(&parsed.model, served.scope.kind()));
    };
    // The client key's scopes, models, limits and budgets (SPEC §21.1), before a slot.
    let charge = match crate::keys::admit(key, &served.scope.name, &parsed.model, async |k| {
        client.admit_key(k, &parsed.input).await
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
    let mut options = call_options(st, id, headers);
    if let Some(c) = charge {
        options = options.with_client_key(c);
    }
    options.api = Some("embeddings");
    options.model = Some(parsed.model.clone());
    let r = tokio::select! {
        biased;
        r = client.embed_inputs_with(&parsed.input, options) => r,
        () = client_gone(ctx) => return error_response(&client_closed()),
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
            h.insert(
                names::X_ATTEMPTS,
                crate::http::count_value(e.call_stats.attempts),
            );
            h.insert(
                names::X_USAGE_SOURCE,
                HeaderValue::from_static(e.usage_source.as_str()),
            );
            resp
        }
        Err(e) => {
            let api = from_gateway(&e);
            crate::route::chat::log_failure(&api, &e);
            let mut resp = error_response(&api);
            failure_headers(resp.headers_mut(), &e, id);
            resp
        }
    }
}
