//! `polygw serve`: an OpenAI-compatible proxy over several scopes (SPEC §11).
//!
//! Routes: `POST /v1/chat/completions` (plain, and streamed passthrough),
//! `POST /v1/embeddings`, `GET /v1/models`, `GET /healthz`, `GET /metrics`
//! (Prometheus text). The request's `model` picks the scope by name (case-insensitive)
//! or alias. Client keys come from `POLYGW_PROXY_KEYS` (comma-separated; compared in
//! constant time); without it the proxy is open (a warning says so).

mod openai;
mod stream;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use polygw::core::ports::TelemetryRecorder;
use polygw::{GatewayClient, Metrics, ScopeClients};
use serde_json::json;
use subtle::ConstantTimeEq;

use crate::env;
use openai::ApiError;

/// Arguments of `polygw serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Scopes to serve (repeatable; default: every scope configured).
    #[arg(long)]
    pub scope: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// On SIGTERM/Ctrl-C, how long in-flight calls may take to finish (seconds).
    #[arg(long, default_value_t = 30.0)]
    pub grace_s: f64,
    /// Largest request body accepted (bytes).
    #[arg(long, default_value_t = 10 * 1024 * 1024)]
    pub max_body_bytes: usize,
}

/// One served scope.
pub struct ServedScope {
    pub name: String,
    pub aliases: Vec<String>,
    pub clients: ScopeClients,
}

/// Shared state of the proxy.
pub struct AppState {
    pub scopes: Vec<ServedScope>,
    pub keys: Vec<Vec<u8>>,
    pub metrics: Arc<Metrics>,
    pub recorders: Vec<Arc<dyn TelemetryRecorder>>,
    pub max_body_bytes: usize,
}

impl AppState {
    fn scope_for(&self, model: &str) -> Option<&ServedScope> {
        self.scopes.iter().find(|s| {
            s.name.eq_ignore_ascii_case(model)
                || s.aliases.iter().any(|a| a.eq_ignore_ascii_case(model))
        })
    }

    fn known_models(&self) -> Vec<String> {
        self.scopes
            .iter()
            .flat_map(|s| std::iter::once(s.name.clone()).chain(s.aliases.iter().cloned()))
            .collect()
    }

    fn unknown_model(&self, model: &str) -> ApiError {
        ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!(
                    "The model `{model}` does not exist. Known models: {}",
                    self.known_models().join(", ")
                ),
            )
        }
    }
}

/// Seconds since the Unix epoch (OpenAI's `created`).
pub fn unix_now() -> u64 {
    // The proxy's only wall-clock reading: the `created` field of responses.
    #[allow(clippy::disallowed_methods)]
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// An OpenAI error response.
pub fn api_error_response(e: &ApiError) -> Response {
    let mut resp = (e.status, Json(e.body())).into_response();
    if let Some(s) = e.retry_after {
        if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
            resp.headers_mut().insert(header::RETRY_AFTER, v);
        }
    }
    resp
}

fn read_body(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|rej| {
        if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                ..ApiError::bad_request("body", format!("the request body exceeds {limit} bytes"))
            }
        } else {
            ApiError::bad_request("body", format!("the request body could not be read: {rej}"))
        }
    })
}

fn call_headers(h: &mut HeaderMap, logical_call_id: &str, source: &str, hedged: bool, hedges: u32) {
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
    if let Ok(v) = HeaderValue::from_str(&hedges.to_string()) {
        h.insert("x-polygw-hedges", v);
    }
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match read_body(body, st.max_body_bytes) {
        Ok(b) => b,
        Err(e) => return api_error_response(&e),
    };
    let parsed = match openai::parse_chat(&body) {
        Ok(p) => p,
        Err(e) => return api_error_response(&e),
    };
    let Some(scope) = st.scope_for(&parsed.model) else {
        return api_error_response(&st.unknown_model(&parsed.model));
    };
    let client: GatewayClient = scope.clients.chat.clone();
    if parsed.request.stream {
        return stream::respond(client, parsed.request, parsed.include_usage).await;
    }
    match client.chat(parsed.request).await {
        Ok(r) => {
            let mut resp = Json(openai::completion_json(&r, unix_now())).into_response();
            call_headers(
                resp.headers_mut(),
                &r.logical_call_id,
                &r.source,
                r.call_stats.hedge_won,
                r.call_stats.hedges,
            );
            resp
        }
        Err(e) => api_error_response(&ApiError::from_gateway(&e)),
    }
}

async fn embeddings(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match read_body(body, st.max_body_bytes) {
        Ok(b) => b,
        Err(e) => return api_error_response(&e),
    };
    let (model, input) = match openai::parse_embeddings(&body) {
        Ok(x) => x,
        Err(e) => return api_error_response(&e),
    };
    let Some(scope) = st.scope_for(&model) else {
        return api_error_response(&st.unknown_model(&model));
    };
    match scope.clients.embedding.embed(&input).await {
        Ok(e) => {
            let data: Vec<serde_json::Value> = e
                .vectors
                .iter()
                .enumerate()
                .map(|(i, v)| json!({"object": "embedding", "index": i, "embedding": v}))
                .collect();
            let mut resp = Json(json!({
                "object": "list",
                "data": data,
                "model": e.model,
                "usage": {"prompt_tokens": e.usage.prompt_tokens, "total_tokens": e.usage.total()},
            }))
            .into_response();
            let source = e.sources.last().cloned().unwrap_or_default();
            call_headers(resp.headers_mut(), &e.logical_call_id, &source, false, 0);
            resp
        }
        Err(e) => api_error_response(&ApiError::from_gateway(&e)),
    }
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    let data: Vec<serde_json::Value> = st
        .known_models()
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "polygw"}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn healthz(State(st): State<Arc<AppState>>) -> Response {
    let scopes: Vec<serde_json::Value> = st
        .scopes
        .iter()
        .map(|s| {
            json!({
                "scope": s.name,
                "sources": s.clients.chat.settings().sources.iter().map(|x| x.name.clone()).collect::<Vec<_>>(),
            })
        })
        .collect();
    Json(json!({"status": "ok", "scopes": scopes})).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let dropped: u64 = st.recorders.iter().map(|r| r.dropped()).sum();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.metrics.render_prometheus(dropped),
    )
        .into_response()
}

/// Client authentication of `/v1/*` (constant-time comparison of bearer keys).
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if st.keys.is_empty() {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|s| s.trim().as_bytes().to_vec())
        .unwrap_or_default();
    let mut ok = subtle::Choice::from(0u8);
    for k in &st.keys {
        ok |= k.as_slice().ct_eq(given.as_slice());
    }
    if bool::from(ok) && !given.is_empty() {
        next.run(req).await
    } else {
        api_error_response(&ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "Missing or invalid API key: send Authorization: Bearer <key> (one of POLYGW_PROXY_KEYS)",
        ))
    }
}

/// The proxy's router over prepared state.
pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(api)
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
        .fallback(|| async {
            api_error_response(&ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "not_found",
                "Unknown route: polygw serves /v1/chat/completions, /v1/embeddings, /v1/models, /healthz and /metrics",
            ))
        })
        .with_state(state)
}

/// Builds the clients of the named scopes (default: all configured), sharing one
/// metrics registry and one telemetry recorder per database URL.
pub async fn prepare(scopes: &[String], max_body_bytes: usize) -> Result<Arc<AppState>> {
    let names = env::scopes(scopes)?;
    let metrics = Arc::new(Metrics::new());
    let mut recorders: HashMap<String, Arc<dyn TelemetryRecorder>> = HashMap::new();
    let mut served = Vec::new();
    for name in names {
        let loaded =
            env::load(&name, polygw::ScopeKind::Chat).with_context(|| format!("scope {name}"))?;
        env::print_warnings(&name, &loaded.warnings);
        let mut b = GatewayClient::builder(loaded.settings.clone()).metrics(metrics.clone());
        if let Some(url) = &loaded.settings.telemetry_url {
            let key = url.expose().to_string();
            let rec = match recorders.get(&key) {
                Some(r) => r.clone(),
                None => {
                    let r: Arc<dyn TelemetryRecorder> = Arc::new(
                        polygw::telemetry::SqlRecorder::connect(
                            url.expose(),
                            polygw::telemetry::RecorderConfig::default(),
                        )
                        .await
                        .with_context(|| {
                            format!(
                                "{name}__TELEMETRY__URL={}",
                                polygw::core::secret::redact_url(url.expose())
                            )
                        })?,
                    );
                    recorders.insert(key, r.clone());
                    r
                }
            };
            b = b.telemetry(rec);
        }
        let clients = b
            .build_all()
            .await
            .with_context(|| format!("scope {name}"))?;
        served.push(ServedScope {
            aliases: loaded.settings.model_aliases.clone(),
            name,
            clients,
        });
    }
    let keys: Vec<Vec<u8>> = std::env::var("POLYGW_PROXY_KEYS")
        .unwrap_or_default()
        .split(',')
        .map(|k| k.trim().as_bytes().to_vec())
        .filter(|k| !k.is_empty())
        .collect();
    Ok(Arc::new(AppState {
        scopes: served,
        keys,
        metrics,
        recorders: recorders.into_values().collect(),
        max_body_bytes,
    }))
}

pub async fn run(args: ServeArgs) -> Result<ExitCode> {
    if !args.grace_s.is_finite() || args.grace_s < 0.0 {
        anyhow::bail!(
            "--grace-s {}: expected a number of seconds ≥ 0",
            args.grace_s
        );
    }
    // Everything that can stop the proxy from starting is configuration: exit 2.
    let state = match prepare(&args.scope, args.max_body_bytes).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e:#}");
            return Ok(ExitCode::from(2));
        }
    };
    if state.keys.is_empty() {
        eprintln!("warning: POLYGW_PROXY_KEYS is not set: the proxy accepts any client");
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    println!(
        "polygw serving {} on http://{addr}/v1 (models: {})",
        state
            .scopes
            .iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        state.known_models().join(", ")
    );
    let stop = Arc::new(tokio::sync::Notify::new());
    // Streams are many small writes: without TCP_NODELAY, Nagle's algorithm holds chunks
    // back until the client's delayed ACK (~40 ms on Linux).
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY could not be set");
        }
    });
    let server = axum::serve(listener, router(state.clone())).with_graceful_shutdown({
        let stop = stop.clone();
        async move { stop.notified().await }
    });
    let mut server = std::pin::pin!(std::future::IntoFuture::into_future(server));
    tokio::select! {
        r = &mut server => r.context("serving")?,
        _ = crate::mock::shutdown_signal() => {
            eprintln!("shutting down: finishing in-flight calls (up to {} s)", args.grace_s);
            stop.notify_one();
            match tokio::time::timeout(Duration::from_secs_f64(args.grace_s), &mut server).await {
                Ok(r) => r.context("serving")?,
                Err(_) => eprintln!("grace period over: cancelling the calls still running"),
            }
        }
    }
    for s in &state.scopes {
        let r = s.clients.chat.shutdown().await;
        eprintln!(
            "scope {}: telemetry written {}, dropped {}, pending {}",
            s.name, r.written, r.dropped, r.pending
        );
    }
    Ok(ExitCode::SUCCESS)
}
