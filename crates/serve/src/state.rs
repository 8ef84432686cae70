//! What every request shares ([`State`]): the served scopes and their gates, the client
//! keys, the metrics, the signal that ends open streams when a shutdown's grace period
//! is over, and the readiness state (draining, the last checks); and how a request's `model` selects a scope (SPEC §11, §18.3).

use std::sync::Arc;

use arc_swap::ArcSwap;

use axum::http::StatusCode;
use polygw::core::ports::TelemetryRecorder;
use polygw::{Metrics, ScopeKind};
use tokio::sync::watch;

use crate::config::ProxyConfig;
use crate::errors::ApiError;
use crate::metrics::ProxyCounters;
use crate::ready::Readiness;
use crate::scope::{Gate, Scope, ScopeClient};

/// A scope and its gate (shared by the snapshots a reload makes, while the scope is
/// served: calls running and waiting count across a reload).
#[derive(Debug)]
pub(crate) struct Served {
    pub scope: Scope,
    pub gate: Arc<Gate>,
}

/// The served scopes: one snapshot, replaced whole by a reload (SPEC §26.2). A request
/// works with the snapshot it loaded when it began, so a call in flight finishes with the
/// configuration it started with.
#[derive(Debug, Default)]
pub(crate) struct Scopes(pub Vec<Served>);

impl Scopes {
    /// The served scope `model` names, of any kind: a scope's name or an exact alias
    /// first (case-insensitive), then the `*` glob aliases, the most specific (longest)
    /// pattern first (SPEC §18.3).
    pub fn scope_for(&self, model: &str) -> Option<&Served> {
        self.0
            .iter()
            .find(|s| s.scope.names_exactly(model))
            .or_else(|| {
                self.0
                    .iter()
                    .filter_map(|s| s.scope.glob_match(model).map(|len| (len, s)))
                    .max_by_key(|(len, _)| *len)
                    .map(|(_, s)| s)
            })
    }

    /// Every model name served (scope names and aliases; glob patterns as written).
    pub fn known_models(&self) -> Vec<String> {
        self.0
            .iter()
            .flat_map(|s| {
                std::iter::once(s.scope.name.clone()).chain(s.scope.aliases.iter().cloned())
            })
            .collect()
    }

    /// The 404 of an unknown model, listing the known ones.
    pub fn unknown_model(&self, model: &str) -> ApiError {
        State::unknown_model_among(model, &self.known_models())
    }

    /// The served scopes.
    pub fn iter(&self) -> std::slice::Iter<'_, Served> {
        self.0.iter()
    }
}

/// Shared by every request.
pub(crate) struct State {
    pub cfg: ProxyConfig,
    /// The served scopes now ([`State::scopes`]).
    pub scopes: ArcSwap<Scopes>,
    pub keys: Vec<Vec<u8>>,
    pub metrics: Arc<Metrics>,
    pub recorders: Vec<Arc<dyn TelemetryRecorder>>,
    pub counters: Arc<ProxyCounters>,
    pub cut: watch::Sender<bool>,
    /// `/readyz`: the drain flag and the last run of the checks.
    pub ready: Readiness,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("scopes", &self.scopes.load())
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

impl State {
    /// Whether clients must present a key (static keys, or a key store).
    pub fn asks_keys(&self) -> bool {
        !self.keys.is_empty() || self.cfg.key_ring.is_some()
    }

    /// The served scopes now: a snapshot, which a reload does not change.
    pub fn scopes(&self) -> Arc<Scopes> {
        self.scopes.load_full()
    }

    /// The 404 of a model not among `known` (a client key's own, say), listing those.
    pub fn unknown_model_among(model: &str, known: &[String]) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!(
                "The model `{model}` does not exist. Known models: {}",
                known.join(", ")
            ),
        )
        .with_param("model")
    }

    /// The 404 of a model served on another endpoint.
    pub fn wrong_kind(model: &str, kind: ScopeKind) -> ApiError {
        let endpoint = match kind {
            ScopeKind::Chat => "/v1/chat/completions, /v1/responses and /v1/messages",
            _ => "/v1/embeddings",
        };
        ApiError::new(
            StatusCode::NOT_FOUND,
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
        self.scopes()
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

/// Resolves once the grace period is over ([`crate::Proxy::cut`]).
pub(crate) async fn cut_done(mut rx: watch::Receiver<bool>) {
    // A dropped sender (the proxy is gone) counts as the end too.
    let _ = rx.wait_for(|cut| *cut).await;
}
