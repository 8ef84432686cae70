//! The routes about the proxy itself: `GET /v1/models[/{id}]`, `/healthz` (liveness),
//! `/readyz` (readiness, [`crate::ready`]), `/metrics`, and the JSON answers to an
//! unknown route or method.

use std::sync::Arc;

use axum::extract::{Extension, Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use polygw::core::client_key::{may_use_scope, ClientKey};

use crate::errors::{error_response, ApiError};
use crate::state::State as AppState;

fn model_object(id: &str) -> serde_json::Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "polygw"})
}

/// Whether the request is an Anthropic client's (it sends `anthropic-version`): it gets
/// Anthropic's shapes (SPEC §23.7; Claude Code discovers a gateway's models this way).
fn is_anthropic(headers: &HeaderMap) -> bool {
    headers.contains_key("anthropic-version")
}

/// A model in Anthropic's shape.
fn anthropic_model(id: &str) -> serde_json::Value {
    json!({"type": "model", "id": id, "display_name": id, "created_at": "1970-01-01T00:00:00Z"})
}

/// The scope names and aliases a client key may use (no key: every one) — issue 39: a
/// key is shown only its own scopes' models.
fn models_for(st: &AppState, key: Option<&ClientKey>) -> Vec<String> {
    st.scopes()
        .iter()
        .filter(|s| key.is_none_or(|k| may_use_scope(k, &s.scope.name)))
        .flat_map(|s| std::iter::once(s.scope.name.clone()).chain(s.scope.aliases.iter().cloned()))
        .collect()
}

/// `GET /v1/models`: every served scope name and alias (a client key's scopes only).
pub async fn models(
    State(st): State<Arc<AppState>>,
    key: Option<Extension<Arc<ClientKey>>>,
    headers: HeaderMap,
) -> Response {
    let key = key.map(|Extension(k)| k);
    if is_anthropic(&headers) {
        // Concrete names only: a glob is no model id.
        let ids: Vec<String> = models_for(&st, key.as_deref())
            .into_iter()
            .filter(|m| !m.contains('*'))
            .collect();
        let data: Vec<serde_json::Value> = ids.iter().map(|m| anthropic_model(m)).collect();
        return Json(json!({"data": data, "has_more": false,
            "first_id": ids.first(), "last_id": ids.last()}))
        .into_response();
    }
    let data: Vec<serde_json::Value> = models_for(&st, key.as_deref())
        .iter()
        .map(|m| model_object(m))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{id}`: a model the proxy serves (by name, alias or glob alias) and
/// the client key may use, else 404.
pub async fn model(
    State(st): State<Arc<AppState>>,
    key: Option<Extension<Arc<ClientKey>>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let key = key.map(|Extension(k)| k);
    let model_object = |id: &str| {
        if is_anthropic(&headers) {
            anthropic_model(id)
        } else {
            model_object(id)
        }
    };
    let mine = models_for(&st, key.as_deref());
    // A configured name (or alias) as configured; a name a glob alias matches as asked.
    if let Some(m) = mine
        .iter()
        .find(|m| !m.contains('*') && m.eq_ignore_ascii_case(&id))
    {
        return Json(model_object(m)).into_response();
    }
    match st.scopes().scope_for(&id) {
        Some(s)
            if key
                .as_deref()
                .is_none_or(|k| may_use_scope(k, &s.scope.name)) =>
        {
            Json(model_object(&id)).into_response()
        }
        // Another scope's model is as unknown to this key as a model that does not exist.
        _ if is_anthropic(&headers) => {
            crate::errors::anthropic_error(&AppState::unknown_model_among(&id, &mine))
        }
        _ => error_response(&AppState::unknown_model_among(&id, &mine)),
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
        .scopes()
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
        .scopes()
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
    // The process's OpenTelemetry exporter (SPEC §26.1): what it dropped.
    if let Ok(otel) = polygw::otel::from_env() {
        if otel.enabled() {
            text.push_str(&format!(
                "# HELP polygw_otel_dropped_total Finished calls the OpenTelemetry exporter dropped (queue full or export failed).\n# TYPE polygw_otel_dropped_total counter\npolygw_otel_dropped_total {}\n",
                otel.dropped()
            ));
        }
    }
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
