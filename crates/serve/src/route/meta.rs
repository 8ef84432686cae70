//! The routes about the proxy itself: `GET /v1/models[/{id}]`, `/healthz` (liveness),
//! `/readyz` (readiness, [`crate::ready`]), `/metrics`, and the JSON answers to an
//! unknown route or method.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::errors::{error_response, ApiError};
use crate::state::State as AppState;

fn model_object(id: &str) -> serde_json::Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "polygw"})
}

/// `GET /v1/models`: every served scope name and alias.
pub async fn models(State(st): State<Arc<AppState>>) -> Response {
    let data: Vec<serde_json::Value> = st.known_models().iter().map(|m| model_object(m)).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{id}`: a model the proxy serves (by name, alias or glob alias),
/// else 404.
pub async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    // A configured name (or alias) as configured; a name a glob alias matches as asked.
    if let Some(m) = st
        .known_models()
        .into_iter()
        .find(|m| !m.contains('*') && m.eq_ignore_ascii_case(&id))
    {
        return Json(model_object(&m)).into_response();
    }
    match st.scope_for(&id) {
        Some(_) => Json(model_object(&id)).into_response(),
        None => error_response(&st.unknown_model(&id)),
    }
}

/// `GET /readyz` (no auth): 200 `{"status": "ready", …}` when every served scope's
/// governance backend answers and every telemetry database is writable; 503 naming
/// what is not (`not_ready`), or `{"status": "draining"}` once a shutdown began
/// (SPEC §21.2). `Cache-Control: no-store`.
pub async fn readyz(State(st): State<Arc<AppState>>) -> Response {
    let (status, body) = if st.ready.is_draining() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            crate::ready::draining_body(),
        )
    } else {
        let c = st.ready.checked(&st).await;
        // A drain that began during the checks wins.
        if st.ready.is_draining() {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                crate::ready::draining_body(),
            )
        } else if c.ready {
            (StatusCode::OK, c.body.clone())
        } else {
            (StatusCode::SERVICE_UNAVAILABLE, c.body.clone())
        }
    };
    (status, [(header::CACHE_CONTROL, "no-store")], Json(body)).into_response()
}

/// `GET /healthz` (liveness: the process serves; no auth, no backend checked): the
/// served scopes, their kind and sources. 200 while draining too.
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

/// `HEAD /` and `GET /`: 200 (clients probe the base URL, SPEC §18.2).
pub async fn root() -> Response {
    Json(json!({"service": "polygw"})).into_response()
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
        "Unknown route: polygw serves /v1/chat/completions, /v1/responses, /v1/messages, \
         /v1/messages/count_tokens, /v1/embeddings, /v1/models, /v1/models/{id}, /healthz, \
         /readyz and /metrics",
    ))
}

/// A known route with another method.
pub async fn method_not_allowed() -> Response {
    error_response(&ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        "this route does not accept that method (chat, responses, messages and embeddings are \
         POST; models, healthz, readyz and metrics are GET; a stored response is GET or DELETE)",
    ))
}
