//! The async engine: carries out core's decisions for one scope.
//!
//! A logical call is one future, polled by the caller; its legs are futures polled
//! inside it (no spawned tasks), so dropping the call drops every leg, and each leg's
//! [`attempt::AttemptGuard`] settles its permit and queues its telemetry row without
//! awaiting. Stages, one module each: [`admission`] (pick a source; [`affinity`]: the
//! source a session last used first), [`attempt`] (one
//! HTTP request and its settlement), [`round`] (one step of the retry loop, hedged or
//! not), [`retry`] (the loop), [`emit`] (telemetry rows).

pub(crate) mod admission;
pub(crate) mod affinity;
pub(crate) mod attempt;
pub(crate) mod call;
mod capability;
pub(crate) mod emit;
mod future_set;
mod key_admission;
pub(crate) mod latency;
pub(crate) mod retry;
pub(crate) mod round;
pub(crate) mod signatures;

use std::sync::{Arc, Mutex};

use polygw_core::hedge::HedgeBudget;
use polygw_core::ports::{
    AffinityStore, BreakerStore, Clock, EmbeddingTransport, LatencyStore, OcrTransport,
    RateLimiter, ResponseCache, ResponseStore, Rng, TelemetryRecorder, Transport,
};
use polygw_core::retry_throttle::RetryThrottle;
use polygw_core::{ScopeKind, ScopeSettings};

use crate::metrics::{Metrics, ScopeMetrics, SourceMetrics};

/// The port implementations a client runs on.
#[derive(Clone, Debug)]
pub struct Ports {
    /// Chat transport.
    pub transport: Arc<dyn Transport>,
    /// Embedding transport (embedding clients).
    pub embedder: Option<Arc<dyn EmbeddingTransport>>,
    /// OCR transport (OCR clients).
    pub ocr: Option<Arc<dyn OcrTransport>>,
    /// Rate limiter.
    pub limiter: Arc<dyn RateLimiter>,
    /// Breaker, cooldown and dead-source store.
    pub breakers: Arc<dyn BreakerStore>,
    /// Telemetry recorder.
    pub telemetry: Arc<dyn TelemetryRecorder>,
    /// Response cache.
    pub cache: Arc<dyn ResponseCache>,
    /// Stored OpenAI Responses answers (`polygw serve`).
    pub responses: Arc<dyn ResponseStore>,
    /// The latency distributions shared across processes (SPEC §19.2), when any.
    pub latency: Option<Arc<dyn LatencyStore>>,
    /// Which source last served each prompt-cache affinity key (SPEC §20.2).
    pub affinity: Arc<dyn AffinityStore>,
    /// The latency evidence per upstream this client records into and reads its `auto`
    /// thresholds from (SPEC §25.1): by default the process's book for the scope's
    /// window and governance backend, shared by every scope reaching the same upstream.
    pub evidence: Arc<latency::UpstreamEvidence>,
    /// Monotonic and wall time.
    pub clock: Arc<dyn Clock>,
    /// Randomness (weighted choice, jitter).
    pub rng: Arc<dyn Rng>,
    /// Where finished calls go as OpenTelemetry spans and metrics (SPEC §26.1).
    pub otel: Arc<dyn polygw_core::ports::OtelExporter>,
}

/// Everything a client of one scope shares between its calls.
#[derive(Debug)]
pub(crate) struct Engine {
    pub scope: ScopeSettings,
    pub kind: ScopeKind,
    pub ports: Ports,
    pub hedge_budget: Mutex<HedgeBudget>,
    /// The scope's retry throttle (SPEC §25.4): every attempt's outcome feeds it; a
    /// retry round asks core's leg gate with it.
    pub retry_throttle: Mutex<RetryThrottle>,
    /// The live latency of the scope's sources, and the `auto` thresholds from it.
    pub latency: latency::EngineLatency,
    pub metrics: Arc<Metrics>,
    /// This scope's counters in `metrics`, looked up once here (no lookup per call).
    pub scope_metrics: Arc<ScopeMetrics>,
    /// Each source's counters, indexed like `scope.sources`.
    pub source_metrics: Vec<Arc<SourceMetrics>>,
    /// Each source's base URL with its credentials redacted (an attempt span's
    /// `server.address`), computed once: 6 000 instructions per attempt otherwise
    /// (issue 27).
    pub source_addresses: Vec<String>,
    /// Each source's host and port (the spans' `server.address`/`server.port`).
    pub source_servers: Vec<(Option<String>, Option<u16>)>,
    /// The names a telemetry row carries, shared by every row (issue 42: not copied per
    /// call): the scope's, the operation's, and each source's name, provider and model.
    pub row_names: RowNames,
    /// Signalled (`notify_one`) whenever an attempt of this client ends, freeing its slot
    /// and settling its reservation: one call waiting for a runnable source looks again
    /// at once (SPEC §14.6).
    pub freed: tokio::sync::Notify,
}

/// Names shared by the rows of an engine ([`Engine::row_names`]).
#[derive(Debug)]
pub struct RowNames {
    /// The scope's name.
    pub scope: Arc<str>,
    /// `chat`, `embedding` or `ocr`.
    pub operation: Arc<str>,
    /// Each source's name, provider and model, indexed like `scope.sources`.
    pub sources: Vec<[Arc<str>; 3]>,
}

impl Engine {
    pub(crate) fn new(
        mut scope: ScopeSettings,
        kind: ScopeKind,
        ports: Ports,
        metrics: Arc<Metrics>,
    ) -> Self {
        scope.hedge = polygw_core::hedge::effective(
            scope.hedge,
            kind == ScopeKind::Chat,
            scope.sources.len(),
        );
        let budget = HedgeBudget::banking(scope.hedge.burst, scope.hedge.bank);
        let throttle = RetryThrottle::new(scope.retry.throttle);
        let latency =
            latency::EngineLatency::new(scope.hedge, &scope.sources, ports.evidence.clone());
        let scope_metrics = metrics.scope(&scope.name);
        let source_metrics = scope
            .sources
            .iter()
            .map(|s| scope_metrics.source(&s.name))
            .collect();
        let source_addresses = scope
            .sources
            .iter()
            .map(|s| polygw_core::secret::redact_url(&s.base_url))
            .collect();
        let source_servers = scope
            .sources
            .iter()
            .map(|s| crate::otel::server_of(&s.base_url))
            .collect();
        let row_names = RowNames {
            scope: scope.name.as_str().into(),
            operation: kind.operation().into(),
            sources: scope
                .sources
                .iter()
                .map(|s| {
                    [
                        s.name.as_str().into(),
                        s.provider.as_str().into(),
                        s.model.as_str().into(),
                    ]
                })
                .collect(),
        };
        Engine {
            row_names,
            scope,
            kind,
            ports,
            hedge_budget: Mutex::new(budget),
            retry_throttle: Mutex::new(throttle),
            latency,
            metrics,
            scope_metrics,
            source_metrics,
            source_servers,
            source_addresses,
            freed: tokio::sync::Notify::new(),
        }
    }

    /// Flushes background settlements and telemetry (on shutdown).
    pub(crate) async fn shutdown(&self) -> polygw_core::ports::FlushReport {
        if let Err(e) = self.ports.limiter.flush().await {
            tracing::warn!(error = %e, "flushing the limiter's background settlements failed");
        }
        if let Err(e) = self.ports.breakers.flush().await {
            tracing::warn!(error = %e, "flushing the breaker store's background work failed");
        }
        if self.ports.otel.enabled() {
            // Spans and metrics of the calls so far (SPEC §26.1); the exporter's flush
            // blocks its caller, so it runs off the runtime's threads.
            let otel = self.ports.otel.clone();
            let shipped =
                tokio::task::spawn_blocking(move || otel.flush(std::time::Duration::from_secs(5)))
                    .await
                    .unwrap_or(false);
            if !shipped {
                tracing::warn!(
                    dropped = self.ports.otel.dropped(),
                    "OpenTelemetry: the final export did not complete"
                );
            }
        }
        match self.ports.telemetry.flush().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "flushing telemetry failed");
                polygw_core::ports::FlushReport {
                    dropped: self.ports.telemetry.dropped(),
                    ..Default::default()
                }
            }
        }
    }

    pub(crate) fn budget(&self) -> std::sync::MutexGuard<'_, HedgeBudget> {
        self.hedge_budget.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The scope's retry throttle.
    pub(crate) fn throttle(&self) -> std::sync::MutexGuard<'_, RetryThrottle> {
        self.retry_throttle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}
