//! Builds the default port implementations from settings, with the adapters the cargo
//! features enable: `memory` (limiter, breaker store, cache), `redis` (shared limiter
//! and breaker store), `sqlite` / `postgres` (telemetry). A setting that needs an
//! adapter this build lacks is a configuration error naming the key and the feature.

use std::sync::Arc;

use polygw_core::ports::{
    AffinityStore, BreakerStore, Clock, EmbeddingTransport, LatencyStore, NullCache, NullRecorder,
    OcrTransport, RateLimiter, ResponseCache, ResponseStore, TelemetryRecorder, Transport,
};
use polygw_core::secret::redact_url;
use polygw_core::{ConfigError, GatewayError, ScopeSettings};
use polygw_transport_openai::OpenAiTransport;

fn needs(key: String, value: String, expected: &str) -> GatewayError {
    GatewayError::Config(ConfigError::Invalid {
        key,
        value,
        expected: expected.to_string(),
    })
}

/// The HTTP transport shared by chat, embeddings and OCR (one pooled client).
pub(crate) type Http = Arc<OpenAiTransport>;

/// The process variable naming a PEM file of extra trusted CA certificates for
/// upstream HTTPS (on top of the webpki roots and the system's trust store).
pub const CA_FILE_VAR: &str = "POLYGW_CA_FILE";

/// The extra CA bundle of `POLYGW_CA_FILE`, when set; an unreadable or empty file is
/// a configuration error naming the variable (never a silent fallback).
fn extra_roots() -> Result<Option<Vec<u8>>, GatewayError> {
    let Some(path) = std::env::var_os(CA_FILE_VAR) else {
        return Ok(None);
    };
    let shown = path.to_string_lossy().into_owned();
    let expected = "a readable PEM file of CA certificates";
    let pem = std::fs::read(&path).map_err(|e| {
        needs(
            CA_FILE_VAR.into(),
            shown.clone(),
            &format!("{expected} ({e})"),
        )
    })?;
    Ok(Some(pem))
}

pub(crate) fn http_transport(clock: Arc<dyn Clock>) -> Result<Http, GatewayError> {
    let cfg = polygw_transport_openai::TransportConfig {
        extra_roots_pem: extra_roots()?,
        ..Default::default()
    };
    let from_file = cfg.extra_roots_pem.is_some();
    OpenAiTransport::with_config(cfg, clock)
        .map(Arc::new)
        .map_err(|e| {
            if from_file {
                let shown = std::env::var_os(CA_FILE_VAR)
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_default();
                needs(
                    CA_FILE_VAR.into(),
                    shown,
                    &format!("a PEM file of CA certificates ({e})"),
                )
            } else {
                needs(
                    "transport".into(),
                    String::new(),
                    &format!("a working HTTP client ({e})"),
                )
            }
        })
}

fn http(h: Option<&Http>) -> Result<Http, GatewayError> {
    h.cloned()
        .ok_or_else(|| needs("transport".into(), String::new(), "an HTTP transport"))
}

pub(crate) fn as_chat(h: Option<&Http>) -> Result<Arc<dyn Transport>, GatewayError> {
    Ok(http(h)?)
}

pub(crate) fn as_embedding(h: Option<&Http>) -> Result<Arc<dyn EmbeddingTransport>, GatewayError> {
    Ok(http(h)?)
}

pub(crate) fn as_ocr(h: Option<&Http>) -> Result<Arc<dyn OcrTransport>, GatewayError> {
    Ok(http(h)?)
}

/// A scope's governance: limiter, breaker store, (Redis) the shared latency store, and
/// the affinity store (Redis: shared by every process; memory: this process's).
pub(crate) type Governance = (
    Arc<dyn RateLimiter>,
    Arc<dyn BreakerStore>,
    Option<Arc<dyn LatencyStore>>,
    Arc<dyn AffinityStore>,
);

/// Limiter and breaker store: Redis when `{S}__REDIS__URL` is set (TLS trusting
/// `{S}__TLS__CA_FILE` when given), else the process's in-memory state of the scope —
/// shared by every client of that scope built with the same clock (SPEC §14.11).
pub(crate) async fn governance(
    s: &ScopeSettings,
    clock: Arc<dyn Clock>,
) -> Result<Governance, GatewayError> {
    let _ = &clock;
    if let Some(url) = &s.redis_url {
        #[cfg(feature = "redis")]
        {
            // Lazy: the client builds while Redis is down; calls then fail closed
            // (`governance_backend`) until it is back.
            let opts = polygw_limiter_redis::RedisOptions {
                ca_file: s.tls_ca_file.as_ref().map(std::path::PathBuf::from),
                ..polygw_limiter_redis::RedisOptions::default()
            };
            let g = polygw_limiter_redis::RedisGovernance::connect_lazy(url.expose(), opts)
                .map_err(|e| {
                    needs(
                        format!("{}__REDIS__URL", s.name),
                        redact_url(url.expose()),
                        &format!("a reachable Redis ({e})"),
                    )
                })?;
            return Ok((
                Arc::new(g.limiter()),
                Arc::new(g.breakers()),
                Some(Arc::new(g.latency_store())),
                Arc::new(g.affinity_store()),
            ));
        }
        #[cfg(not(feature = "redis"))]
        return Err(needs(
            format!("{}__REDIS__URL", s.name),
            redact_url(url.expose()),
            "a build with the `redis` feature of polygw",
        ));
    }
    #[cfg(feature = "memory")]
    {
        let (limiter, breakers) = polygw_limiter_memory::shared(&s.name, clock.clone());
        Ok((
            Arc::new(limiter),
            Arc::new(breakers),
            None,
            memory_affinity(s, clock),
        ))
    }
    #[cfg(not(feature = "memory"))]
    Err(needs(
        format!("{}__REDIS__URL", s.name),
        String::new(),
        "a Redis URL, or a build with the `memory` feature, or limiter and breakers given to the builder",
    ))
}

/// The process's affinity store of the scope (SPEC §20.2), shared by its clients built
/// with the same clock; without the `memory` feature, one that remembers nothing.
pub(crate) fn memory_affinity(s: &ScopeSettings, clock: Arc<dyn Clock>) -> Arc<dyn AffinityStore> {
    #[cfg(feature = "memory")]
    {
        polygw_limiter_memory::shared_affinity(&s.name, clock)
    }
    #[cfg(not(feature = "memory"))]
    {
        let _ = (s, clock);
        Arc::new(polygw_core::ports::NullAffinity)
    }
}

/// The telemetry recorder of `{S}__TELEMETRY__URL` (off when unset), and the store of
/// Responses answers in the same database.
pub(crate) async fn telemetry(
    s: &ScopeSettings,
) -> Result<(Arc<dyn TelemetryRecorder>, Option<Arc<dyn ResponseStore>>), GatewayError> {
    let Some(url) = &s.telemetry_url else {
        return Ok((Arc::new(NullRecorder), None));
    };
    let key = format!("{}__TELEMETRY__URL", s.name);
    let raw = url.expose();
    let (feature, enabled) = if raw.starts_with("sqlite:") {
        ("sqlite", cfg!(feature = "sqlite"))
    } else {
        ("postgres", cfg!(feature = "postgres"))
    };
    if !enabled {
        return Err(needs(
            key,
            redact_url(raw),
            &format!("a build with the `{feature}` feature of polygw"),
        ));
    }
    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    {
        let r = polygw_telemetry_sql::SqlRecorder::connect(
            raw,
            polygw_telemetry_sql::RecorderConfig::default(),
        )
        .await
        .map_err(|e| needs(key, redact_url(raw), &format!("a reachable database ({e})")))?;
        let store: Arc<dyn ResponseStore> = Arc::new(r.response_store());
        Ok((Arc::new(r), Some(store)))
    }
    #[cfg(not(any(feature = "sqlite", feature = "postgres")))]
    unreachable!("checked above")
}

/// The store of Responses answers when the scope has no telemetry database: a bounded
/// in-process store shared by every client of the scope in this process.
pub(crate) fn memory_responses(s: &ScopeSettings) -> Result<Arc<dyn ResponseStore>, GatewayError> {
    #[cfg(feature = "memory")]
    {
        Ok(polygw_limiter_memory::shared_responses(&s.name))
    }
    #[cfg(not(feature = "memory"))]
    {
        let _ = s;
        Ok(Arc::new(polygw_core::ports::NullStore))
    }
}

/// The response cache of `{S}__CACHE__TTL_S` (off when unset).
pub(crate) fn cache(
    s: &ScopeSettings,
    clock: Arc<dyn Clock>,
) -> Result<Arc<dyn ResponseCache>, GatewayError> {
    let _ = &clock;
    let Some(_ttl) = s.cache.ttl else {
        return Ok(Arc::new(NullCache));
    };
    #[cfg(feature = "memory")]
    {
        Ok(Arc::new(polygw_limiter_memory::MemoryCache::new(
            s.cache.capacity,
            clock,
        )))
    }
    #[cfg(not(feature = "memory"))]
    Err(needs(
        format!("{}__CACHE__TTL_S", s.name),
        format!("{}", _ttl.as_secs_f64()),
        "a build with the `memory` feature (or a cache given to the builder)",
    ))
}
