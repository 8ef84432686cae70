//! [`Proxy`]: the proxy over its scopes ([`crate::state::State`]); its
//! [`Proxy::router`] is the axum `Router` of every route: server and connection →
//! guard (keys, loopback checks, request ids) → one route module per API → engine.

use std::sync::Arc;

use arc_swap::ArcSwap;

use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use polygw::core::ports::TelemetryRecorder;
use polygw::Metrics;
use tokio::sync::watch;

use crate::config::ProxyConfig;
use crate::guard;
use crate::metrics::ProxyCounters;
use crate::ready::Readiness;
use crate::route::{admin, chat, embeddings, messages, meta, responses};
use crate::scope::{Gate, Scope, ScopeClient};
use crate::state::{Scopes, Served, State};

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
        let scopes = served(&config, &Scopes::default(), scopes);
        let (cut, _) = watch::channel(false);
        Proxy {
            state: Arc::new(State {
                cfg: config,
                scopes: ArcSwap::from_pointee(scopes),
                keys,
                metrics,
                recorders,
                counters: Arc::new(ProxyCounters::default()),
                cut,
                ready: Readiness::default(),
            }),
        }
    }

    /// The router of every route (see the crate documentation).
    pub fn router(&self) -> Router {
        let st = self.state.clone();
        let api = Router::new()
            .route("/v1/chat/completions", post(chat::handle))
            .route("/v1/responses", post(responses::create))
            .route("/v1/responses/input_tokens", post(responses::input_tokens))
            .route(
                "/v1/responses/{id}",
                get(responses::get).delete(responses::delete),
            )
            .route(
                "/v1/responses/{id}/input_items",
                get(responses::input_items),
            )
            .route("/v1/messages", post(messages::create))
            .route("/v1/messages/count_tokens", post(messages::count_tokens))
            .route("/v1/embeddings", post(embeddings::handle))
            .route("/v1/models", get(meta::models))
            .route("/v1/models/{id}", get(meta::model));
        Router::new()
            .merge(api)
            .route("/", get(meta::root).head(meta::root))
            .route("/healthz", get(meta::healthz))
            .route("/readyz", get(meta::readyz))
            .route("/metrics", get(meta::metrics))
            .route("/admin", get(admin::page))
            .route("/admin/status", get(admin::status))
            .route(
                "/admin/scopes/{scope}/sources/{source}/{action}",
                post(admin::act),
            )
            .fallback(meta::not_found)
            .method_not_allowed_fallback(meta::method_not_allowed)
            .layer(middleware::from_fn_with_state(st.clone(), guard::front))
            .with_state(st)
    }

    /// The scopes served now.
    pub fn scopes(&self) -> std::vec::IntoIter<Scope> {
        self.state
            .scopes()
            .iter()
            .map(|s| s.scope.clone())
            .collect::<Vec<_>>()
            .into_iter()
    }

    /// Every model name served (scope names and aliases).
    pub fn known_models(&self) -> Vec<String> {
        self.state.scopes().known_models()
    }

    /// Serves `scopes` from now on, in place of the scopes served until now (SPEC §26.2,
    /// a reload): requests that began before keep the scopes they found, so a call in
    /// flight finishes with the configuration it started with; a scope served before
    /// and now (by name) keeps its gate, with the calls running and waiting in it. What
    /// each scope's sources keep (breakers, quotas, latency evidence) is the clients'
    /// affair: clients of a scope built in one process share its governance state.
    pub fn replace_scopes(&self, scopes: Vec<Scope>) {
        let old = self.state.scopes();
        let new = served(&self.state.cfg, &old, scopes);
        self.state.scopes.store(Arc::new(new));
    }

    /// Whether client keys are required.
    pub fn has_client_keys(&self) -> bool {
        self.state.asks_keys()
    }

    /// The proxy's counters (also in `/metrics`).
    pub fn counters(&self) -> &Arc<ProxyCounters> {
        &self.state.counters
    }

    /// A shutdown has begun: from now on `/readyz` answers 503 `draining`, so a load
    /// balancer takes this replica out while its calls finish ([`crate::serve`] does
    /// this when its `shutdown` future resolves; call it yourself when the router is
    /// mounted in another server). `/healthz` stays 200. Irreversible.
    pub fn start_draining(&self) {
        self.state.ready.start_draining();
    }

    /// Whether [`Proxy::start_draining`] was called.
    pub fn is_draining(&self) -> bool {
        self.state.ready.is_draining()
    }

    /// Calls running now, over every scope (a shutdown says how many it waits for or
    /// cuts).
    pub fn calls_running(&self) -> usize {
        self.state
            .scopes()
            .iter()
            .map(|s| s.gate.running(self.state.cfg.max_calls_per_scope))
            .sum()
    }

    /// The shutdown's grace period is over: open streams end with an error event
    /// (`server_shutdown`), plain calls still running answer 503. Irreversible.
    pub fn cut(&self) {
        self.state.cut.send_replace(true);
    }
}

/// `scopes` as served, each with the gate of the scope of the same name in `old` (else a
/// new one).
fn served(config: &ProxyConfig, old: &Scopes, scopes: Vec<Scope>) -> Scopes {
    Scopes(
        scopes
            .into_iter()
            .map(|scope| {
                let gate = old
                    .iter()
                    .find(|s| s.scope.name == scope.name)
                    .map(|s| s.gate.clone())
                    .unwrap_or_else(|| {
                        Arc::new(Gate::new(
                            config.max_calls_per_scope,
                            config.max_queued_per_scope,
                        ))
                    });
                Served { scope, gate }
            })
            .collect(),
    )
}
