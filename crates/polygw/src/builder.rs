//! [`GatewayBuilder`]: assembles a client from settings and any port implementations.
//! Ports not given are built from the settings by [`crate::wiring`] (the adapters the
//! cargo features enable). Every path runs the same configuration guards.

use std::sync::Arc;

use polygw_core::config::guards;
use polygw_core::ports::{
    AffinityStore, BreakerStore, Clock, EmbeddingTransport, LatencyStore, OcrTransport,
    RateLimiter, ResponseCache, ResponseStore, Rng, TelemetryRecorder, Transport,
};
use polygw_core::{ConfigWarning, GatewayError, ScopeKind, ScopeSettings};

use crate::client::GatewayClient;
use crate::clock::{default_clock, EntropyRng};
use crate::embedding::EmbeddingClient;
use crate::engine::{Engine, Ports};
use crate::metrics::Metrics;
use crate::ocr::OcrClient;
use crate::wiring;

/// The clients of one scope sharing their ports (see [`GatewayBuilder::build_all`]).
#[derive(Debug, Clone)]
pub struct ScopeClients {
    /// Chat.
    pub chat: GatewayClient,
    /// Embeddings.
    pub embedding: EmbeddingClient,
}

/// Builds a [`GatewayClient`] (or the engine of an embedding/OCR client).
#[derive(Debug)]
pub struct GatewayBuilder {
    settings: ScopeSettings,
    kind: ScopeKind,
    transport: Option<Arc<dyn Transport>>,
    embedder: Option<Arc<dyn EmbeddingTransport>>,
    ocr: Option<Arc<dyn OcrTransport>>,
    limiter: Option<Arc<dyn RateLimiter>>,
    breakers: Option<Arc<dyn BreakerStore>>,
    telemetry: Option<Arc<dyn TelemetryRecorder>>,
    cache: Option<Arc<dyn ResponseCache>>,
    responses: Option<Arc<dyn ResponseStore>>,
    clock: Option<Arc<dyn Clock>>,
    latency: Option<Arc<dyn LatencyStore>>,
    affinity: Option<Arc<dyn AffinityStore>>,
    rng: Option<Arc<dyn Rng>>,
    metrics: Option<Arc<Metrics>>,
    evidence: Option<Arc<crate::UpstreamEvidence>>,
    otel: Option<Arc<dyn polygw_core::ports::OtelExporter>>,
}

impl GatewayBuilder {
    /// A builder for a chat scope.
    pub fn new(settings: ScopeSettings) -> Self {
        GatewayBuilder {
            settings,
            kind: ScopeKind::Chat,
            transport: None,
            embedder: None,
            ocr: None,
            limiter: None,
            breakers: None,
            telemetry: None,
            cache: None,
            responses: None,
            clock: None,
            latency: None,
            affinity: None,
            rng: None,
            metrics: None,
            evidence: None,
            otel: None,
        }
    }

    pub(crate) fn kind(mut self, kind: ScopeKind) -> Self {
        self.kind = kind;
        self
    }

    /// The chat transport.
    pub fn transport(mut self, t: Arc<dyn Transport>) -> Self {
        self.transport = Some(t);
        self
    }
    /// The embedding transport.
    pub fn embedding_transport(mut self, t: Arc<dyn EmbeddingTransport>) -> Self {
        self.embedder = Some(t);
        self
    }
    /// The OCR transport.
    pub fn ocr_transport(mut self, t: Arc<dyn OcrTransport>) -> Self {
        self.ocr = Some(t);
        self
    }
    /// The rate limiter.
    pub fn limiter(mut self, l: Arc<dyn RateLimiter>) -> Self {
        self.limiter = Some(l);
        self
    }
    /// The breaker store.
    pub fn breakers(mut self, b: Arc<dyn BreakerStore>) -> Self {
        self.breakers = Some(b);
        self
    }
    /// The telemetry recorder.
    pub fn telemetry(mut self, t: Arc<dyn TelemetryRecorder>) -> Self {
        self.telemetry = Some(t);
        self
    }
    /// The response cache.
    pub fn cache(mut self, c: Arc<dyn ResponseCache>) -> Self {
        self.cache = Some(c);
        self
    }
    /// The store of OpenAI Responses answers (`polygw serve`'s `/v1/responses` with
    /// `store`; default: the scope's telemetry database, else a bounded in-process
    /// store shared by the process's clients of the scope).
    pub fn responses(mut self, r: Arc<dyn ResponseStore>) -> Self {
        self.responses = Some(r);
        self
    }
    /// The store that shares the sources' latency distributions across processes
    /// (SPEC §19.2; with Redis governance, the default is the Redis one).
    pub fn latency_store(mut self, l: Arc<dyn LatencyStore>) -> Self {
        self.latency = Some(l);
        self
    }

    /// The store of prompt-cache affinity keys (SPEC §20.2; default: with Redis
    /// governance the Redis one, shared by every process, else this process's, shared by
    /// its clients of the scope).
    pub fn affinity_store(mut self, a: Arc<dyn AffinityStore>) -> Self {
        self.affinity = Some(a);
        self
    }

    /// The latency evidence per upstream (SPEC §25.1). Default: the process's book for
    /// the scope's `HEDGE__WINDOW_S` and governance backend, shared with every scope
    /// reaching the same upstream; [`crate::UpstreamEvidence::isolated`] keeps a client's
    /// to itself, as another process would.
    pub fn upstream_evidence(mut self, e: Arc<crate::UpstreamEvidence>) -> Self {
        self.evidence = Some(e);
        self
    }

    /// The clock (must agree with tokio's timer; the default reads it).
    pub fn clock(mut self, c: Arc<dyn Clock>) -> Self {
        self.clock = Some(c);
        self
    }
    /// The random source.
    pub fn rng(mut self, r: Arc<dyn Rng>) -> Self {
        self.rng = Some(r);
        self
    }
    /// Where finished calls go as OpenTelemetry spans and metrics (SPEC §26.1).
    /// Default: the process's exporter as its `OTEL_*` variables configure it
    /// ([`crate::otel`]), none when they set no OTLP endpoint.
    pub fn otel(mut self, e: Arc<dyn polygw_core::ports::OtelExporter>) -> Self {
        self.otel = Some(e);
        self
    }
    /// Metrics shared with other clients (e.g. every scope of `polygw serve`).
    pub fn metrics(mut self, m: Arc<Metrics>) -> Self {
        self.metrics = Some(m);
        self
    }

    /// Guards the settings, builds missing ports, and returns the chat client.
    pub async fn build(self) -> Result<GatewayClient, GatewayError> {
        let (engine, warnings) = self.kind(ScopeKind::Chat).build_engine().await?;
        Ok(GatewayClient { engine, warnings })
    }

    /// Builds an [`EmbeddingClient`] (embedding scope).
    pub async fn build_embedding(self) -> Result<EmbeddingClient, GatewayError> {
        let (engine, warnings) = self.kind(ScopeKind::Embedding).build_engine().await?;
        Ok(EmbeddingClient { engine, warnings })
    }

    /// Builds an [`OcrClient`] (OCR scope).
    pub async fn build_ocr(self) -> Result<OcrClient, GatewayError> {
        let (engine, warnings) = self.kind(ScopeKind::Ocr).build_engine().await?;
        Ok(OcrClient { engine, warnings })
    }

    /// Builds a chat client and an embedding client of the same scope sharing every
    /// port (one limiter, breaker store, telemetry recorder): `polygw serve` uses it.
    pub async fn build_all(self) -> Result<ScopeClients, GatewayError> {
        let (chat, warnings) = self.kind(ScopeKind::Chat).build_engine().await?;
        let embedding = Arc::new(Engine::new(
            chat.scope.clone(),
            ScopeKind::Embedding,
            chat.ports.clone(),
            chat.metrics.clone(),
        ));
        Ok(ScopeClients {
            chat: GatewayClient {
                engine: chat,
                warnings: warnings.clone(),
            },
            embedding: EmbeddingClient {
                engine: embedding,
                warnings,
            },
        })
    }

    async fn build_engine(self) -> Result<(Arc<Engine>, Arc<Vec<ConfigWarning>>), GatewayError> {
        let warnings = guards::check(&self.settings, self.kind)?;
        let s = &self.settings;
        let clock: Arc<dyn Clock> = self.clock.unwrap_or_else(default_clock);
        let rng: Arc<dyn Rng> = self.rng.unwrap_or_else(|| Arc::new(EntropyRng::new()));
        let needs_http = self.transport.is_none()
            || (self.kind == ScopeKind::Embedding && self.embedder.is_none())
            || (self.kind == ScopeKind::Ocr && self.ocr.is_none());
        let http = if needs_http {
            Some(wiring::http_transport(clock.clone())?)
        } else {
            None
        };
        let transport = match self.transport {
            Some(t) => t,
            None => wiring::as_chat(http.as_ref())?,
        };
        // The HTTP transport serves every operation; embedding and OCR engines need theirs.
        let embedder = match (self.embedder, &http) {
            (Some(t), _) => Some(t),
            (None, Some(_)) => Some(wiring::as_embedding(http.as_ref())?),
            (None, None) if self.kind == ScopeKind::Embedding => {
                Some(wiring::as_embedding(http.as_ref())?)
            }
            (None, None) => None,
        };
        let ocr = match (self.ocr, &http) {
            (Some(t), _) => Some(t),
            (None, Some(_)) => Some(wiring::as_ocr(http.as_ref())?),
            (None, None) if self.kind == ScopeKind::Ocr => Some(wiring::as_ocr(http.as_ref())?),
            (None, None) => None,
        };
        let (limiter, breakers, latency, affinity) = match (self.limiter, self.breakers) {
            (Some(l), Some(b)) => {
                let a = self
                    .affinity
                    .unwrap_or_else(|| wiring::memory_affinity(s, clock.clone()));
                (l, b, self.latency, a)
            }
            (l, b) => {
                let (dl, db, dlat, da) = wiring::governance(s, clock.clone()).await?;
                (
                    l.unwrap_or(dl),
                    b.unwrap_or(db),
                    self.latency.or(dlat),
                    self.affinity.unwrap_or(da),
                )
            }
        };
        let (telemetry, sql_store) = match self.telemetry {
            Some(t) => (t, None),
            None => wiring::telemetry(s).await?,
        };
        let responses = match (self.responses, sql_store) {
            (Some(r), _) => r,
            (None, Some(r)) => r,
            (None, None) => wiring::memory_responses(s)?,
        };
        let cache = match self.cache {
            Some(c) => c,
            None => wiring::cache(s, clock.clone())?,
        };
        let evidence = self.evidence.unwrap_or_else(|| {
            crate::UpstreamEvidence::shared(
                s.hedge.window,
                crate::engine::latency::backend_key(s.redis_url.as_ref()),
            )
        });
        let otel = match self.otel {
            Some(o) => o,
            None => crate::otel::from_env()?,
        };
        let ports = Ports {
            otel,
            transport,
            embedder,
            ocr,
            limiter,
            breakers,
            telemetry,
            cache,
            responses,
            latency,
            affinity,
            clock,
            rng,
            evidence,
        };
        let metrics: Arc<Metrics> = self.metrics.unwrap_or_default();
        metrics.watch_limiter(&s.name, &ports.limiter);
        let engine = Arc::new(Engine::new(self.settings, self.kind, ports, metrics));
        if engine.ports.latency.is_some() && engine.latency.keeps() {
            tokio::spawn(crate::engine::latency::exchange_loop(Arc::downgrade(
                &engine,
            )));
        }
        Ok((engine, Arc::new(warnings)))
    }
}
