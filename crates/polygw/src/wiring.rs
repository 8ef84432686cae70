//! Builds the default port implementations from settings, with the adapters the cargo
//! features enable.

use std::sync::Arc;

use polygw_core::ports::{
    BreakerStore, Clock, EmbeddingTransport, NullCache, NullRecorder, OcrTransport, RateLimiter,
    ResponseCache, TelemetryRecorder, Transport,
};
use polygw_core::{ConfigError, GatewayError, ScopeSettings};

fn unavailable(key: &str, what: &str) -> GatewayError {
    GatewayError::Config(ConfigError::Invalid {
        key: key.to_string(),
        value: String::new(),
        expected: what.to_string(),
    })
}

/// The HTTP transport shared by chat, embeddings and OCR.
#[derive(Debug, Clone)]
pub(crate) struct Http;

pub(crate) fn http_transport(_clock: Arc<dyn Clock>) -> Result<Http, GatewayError> {
    Err(unavailable(
        "transport",
        "the OpenAI transport adapter (being wired)",
    ))
}

pub(crate) fn as_chat(_h: Option<&Http>) -> Result<Arc<dyn Transport>, GatewayError> {
    Err(unavailable(
        "transport",
        "the OpenAI transport adapter (being wired)",
    ))
}

pub(crate) fn as_embedding(_h: Option<&Http>) -> Result<Arc<dyn EmbeddingTransport>, GatewayError> {
    Err(unavailable(
        "transport",
        "the OpenAI transport adapter (being wired)",
    ))
}

pub(crate) fn as_ocr(_h: Option<&Http>) -> Result<Arc<dyn OcrTransport>, GatewayError> {
    Err(unavailable(
        "transport",
        "the OpenAI transport adapter (being wired)",
    ))
}

pub(crate) async fn governance(
    s: &ScopeSettings,
    _clock: Arc<dyn Clock>,
) -> Result<(Arc<dyn RateLimiter>, Arc<dyn BreakerStore>), GatewayError> {
    Err(unavailable(
        &format!("{}__REDIS__URL", s.name),
        "a governance adapter (being wired)",
    ))
}

pub(crate) async fn telemetry(
    s: &ScopeSettings,
) -> Result<Arc<dyn TelemetryRecorder>, GatewayError> {
    match &s.telemetry_url {
        None => Ok(Arc::new(NullRecorder)),
        Some(_) => Err(unavailable(
            &format!("{}__TELEMETRY__URL", s.name),
            "the SQL telemetry adapter (being wired)",
        )),
    }
}

pub(crate) fn cache(
    s: &ScopeSettings,
    _clock: Arc<dyn Clock>,
) -> Result<Arc<dyn ResponseCache>, GatewayError> {
    match s.cache.ttl {
        None => Ok(Arc::new(NullCache)),
        Some(_) => Err(unavailable(
            &format!("{}__CACHE__TTL_S", s.name),
            "the memory cache adapter (being wired)",
        )),
    }
}
