//! [`Proxy`]: the served scopes, their gates, the client keys, the metrics, and the
//! signal that ends open streams when a shutdown's grace period is over; its
//! [`Proxy::router`] is the axum `Router` of every route.

use std::sync::Arc;

use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use polygw::core::ports::TelemetryRecorder;
use polygw::{Metrics, ScopeKind};
use tokio::sync::watch;

use crate::config::ProxyConfig;
use crate::metrics::ProxyCounters;
use crate::openai::ApiError;
use crate::scope::{Gate, Scope, ScopeClient};
use crate::{guard, handlers};

/// A scope and its gate.
#[derive(Debug)]
pub(crate) struct Served {
    pub scope: Scope,
    pub gate: Gate,
}

/// Shared by every request.
pub(crate) struct State {
    pub cfg: ProxyConfig,
    pub scopes: Vec<Served>,
    pub keys: Vec<Vec<u8>>,
    pub metrics: Arc<Metrics>,
    pub recorders: Vec<Arc<dyn TelemetryRecorder>>,
    pub counters: Arc<ProxyCounters>,
    pub cut: watch::Sender<bool>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("scopes", &self.scopes)
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

impl State {
    /// The served scope `model` names, of any kind.
    pub fn scope_for(&self, model: &str) -> Option<&Served> {
        self.scopes.iter().find(|s| s.scope.answers_to(model))
    }

    /// Every model name served (scope names and aliases).
    pub fn known_models(&self) -> Vec<String> {
        self.scopes
            .iter()
            .flat_map(|s| {
                std::iter::once(s.scope.name.clone()).chain(s.scope.aliases.iter().cloned())
            })
            .collect()
    }

    /// The 404 of an unknown model, listing the known ones.
    pub fn unknown_model(&self, model: &str) -> ApiError {
        ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!(
                "The model `{model}` does not exist. Known models: {}",
                self.known_models().join(", ")
            ),
        )
        .with_param("model")
    }

    /// The 404 of a model served on another endpoint.
    pub fn wrong_kind(&self, model: &str, kind: ScopeKind) -> ApiError {
        let endpoint = match kind {
            ScopeKind::Chat => "/v1/chat/completions",
            _ => "/v1/embeddings",
        };
        ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!(
                "The model `{model}` is a {kind} model: it is served on {endpoint} ({{S}}__KIND={kind})"
            ),
        )
        .with_param("model")
    }

    /// Telemetry rows dropped: the recorders given, else every scope's own count.
    pub fn telemetry_dropped(&self) -> u64 {
        if !self.recorders.is_empty() {
            return self.recorders.iter().map(|r| r.dropped()).sum();
        }
        self.scopes
            .iter()
            .map(|s| match &s.scope.client {
                ScopeClient::Chat(c) => c.telemetry_dropped(),
                ScopeClient::Embedding(c) => c.telemetry_dropped(),
            })
            .sum()
    }

    /// A receiver of the end-of-grace signal.
    pub fn cut_signal(&self) -> watch::Receiver<bool> {
        self.cut.subscribe()
    }
}

/// Resolves once the grace period is over ([`Proxy::cut`]).
pub(crate) async fn cut_done(mut rx: watch::Receiver<bool>) {
    // A dropped sender (the proxy is gone) counts as the end too.
    let _ = rx.wait_for(|cut| *cut).await;
}

/// The OpenAI-compatible proxy over a set of scopes. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Proxy {
    pub(crate) state: Arc<State>,
}

impl Proxy {
    /// A proxy over `scopes`. `/metrics` renders the first scope's metrics registry
    /// (build every scope with one shared `Metrics`, as `polygw serve` does) and the
    /// scopes' own telemetry drop counts.
    pub fn new(config: ProxyConfig, scopes: Vec<Scope>) -> Proxy {
        Proxy::with_telemetry(config, scopes, None, Vec::new())
    }

    /// A proxy with an explicit metrics registry and the telemetry recorders whose drop
    /// counts `/metrics` sums (one per database, shared by several scopes).
    pub fn with_telemetry(
        config: ProxyConfig,
        scopes: Vec<Scope>,
        metrics: Option<Arc<Metrics>>,
        recorders: Vec<Arc<dyn TelemetryRecorder>>,
    ) -> Proxy {
        let metrics = metrics
            .or_else(|| {
                scopes.first().map(|s| match &s.client {
                    ScopeClient::Chat(c) => c.metrics(),
                    ScopeClient::Embedding(c) => c.metrics(),
                })
            })
            .unwrap_or_else(|| Arc::new(Metrics::new()));
        let keys = config
            .client_keys
            .iter()
            .map(|k| k.expose().trim().as_bytes().to_vec())
            .filter(|k| !k.is_empty())
            .collect();
        let scopes = scopes
            .into_iter()
            .map(|scope| Served {
                scope,
                gate: Gate::new(config.max_calls_per_scope, config.max_queued_per_scope),
            })
            .collect();
        let (cut, _) = watch::channel(false);
        Proxy {
            state: Arc::new(State {
                cfg: config,
                scopes,
                keys,
                metrics,
                recorders,
                counters: Arc::new(ProxyCounters::default()),
                cut,
            }),
        }
    }

    /// The router of every route (see the crate documentation).
    pub fn router(&self) -> Router {
        let st = self.state.clone();
        let api = Router::new()
            .route("/v1/chat/completions", post(handlers::chat))
            .route("/v1/embeddings", post(handlers::embeddings))
            .route("/v1/models", get(handlers::models))
            .route("/v1/models/{id}", get(handlers::model))
            .route_layer(middleware::from_fn_with_state(st.clone(), guard::auth));
        Router::new()
            .merge(api)
            .route("/healthz", get(handlers::healthz))
            .route("/metrics", get(handlers::metrics))
            .fallback(handlers::not_found)
            .method_not_allowed_fallback(handlers::method_not_allowed)
            .layer(middleware::from_fn_with_state(st.clone(), guard::keyless))
            .layer(middleware::from_fn_with_state(st.clone(), guard::outer))
            .with_state(st)
    }

    /// The scopes served.
    pub fn scopes(&self) -> impl Iterator<Item = &Scope> {
        self.state.scopes.iter().map(|s| &s.scope)
    }

    /// Every model name served (scope names and aliases).
    pub fn known_models(&self) -> Vec<String> {
        self.state.known_models()
    }

    /// Whether client keys are required.
    pub fn has_client_keys(&self) -> bool {
        !self.state.keys.is_empty()
    }

    /// The proxy's counters (also in `/metrics`).
    pub fn counters(&self) -> &Arc<ProxyCounters> {
        &self.state.counters
    }

    /// The shutdown's grace period is over: open streams end with an error event
    /// (`server_shutdown`), plain calls still running answer 503. Irreversible.
    pub fn cut(&self) {
        self.state.cut.send_replace(true);
    }
}
