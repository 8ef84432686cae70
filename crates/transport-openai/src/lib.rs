//! polygw-transport-openai: the chat, embedding and OCR transport ports of polygw-core
//! over reqwest (rustls, one pooled client), for any OpenAI-compatible upstream.
//!
//! - [`OpenAiTransport`] implements [`Transport`](polygw_core::ports::Transport),
//!   [`EmbeddingTransport`](polygw_core::ports::EmbeddingTransport) and
//!   [`OcrTransport`](polygw_core::ports::OcrTransport); it is cheap to clone.
//! - [`sse`] is the incremental SSE parser and [`aggregate`] the pure stream
//!   aggregator; both are public so fuzzers and benchmarks can drive them.
//! - [`failure`] maps HTTP and stream events to core's `Failure` (classified by
//!   `polygw_core::classify::classify`, the one classification function).
//!
//! How HTTP and stream events map to outcomes is written down in `docs/TRANSPORT.md`.

pub mod aggregate;
mod chat;
mod embed;
pub mod failure;
pub mod sse;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use polygw_core::native::NativeRequest;
use polygw_core::ports::Clock;
use polygw_core::request::ClientCredential;
use polygw_core::source::{SourceApi, SourceAuth};
use polygw_core::SourceConfig;
use reqwest::header::{HeaderName, HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE};

/// Default cap of a response body and of accumulated content (16 MiB).
pub const DEFAULT_MAX_BYTES: usize = 16 * 1024 * 1024;

/// Default cap of one SSE line / event in a stream (1 MiB).
pub const DEFAULT_MAX_SSE_LINE_BYTES: usize = 1024 * 1024;

/// Default bound of a whole stream attempt, in multiples of the source's `TIMEOUT_S`.
pub const DEFAULT_STREAM_TIME_FACTOR: u32 = 10;

pub use polygw_core::source::endpoint_url;

/// Tuning of the transport. `Default` gives the documented values.
#[derive(Debug, Clone, PartialEq)]
pub struct TransportConfig {
    /// Cap of a plain response body, and of one SSE line/event (bytes). Over it the
    /// attempt fails as result-invalid (`TooLarge`).
    pub max_body_bytes: usize,
    /// Cap of the accumulated content + reasoning + tool-call arguments (bytes).
    pub max_content_bytes: usize,
    /// Cap of the bytes of a whole stream (framing included); defence against an
    /// upstream that streams without end.
    pub max_stream_bytes: u64,
    /// Cap of one SSE line, and of one event's data, in a stream (bytes). Over it the
    /// attempt fails as result-invalid (`TooLarge`). Real frames are a few KiB; the
    /// bound keeps an upstream that sends bytes without a line end from holding more
    /// than this much of the process's memory (a whole SSE body received for a plain
    /// request is bounded by `max_body_bytes` instead).
    pub max_sse_line_bytes: usize,
    /// A stream attempt runs at most this many times its source's `TIMEOUT_S` in total
    /// (connect to the last byte), whatever its pace: an upstream that trickles one
    /// chunk just inside the inter-token budget cannot hold an attempt forever when no
    /// `CALL_DEADLINE_S` is set. Reaching it is a `timeout` (salvaged when the answer
    /// had already finished). `0` = no bound.
    pub stream_time_factor: u32,
    /// How much of a non-2xx body is read to find the provider's error (bytes).
    pub max_error_body_bytes: usize,
    /// TCP/TLS connect timeout.
    pub connect_timeout: Duration,
    /// After a `finish_reason`, how long the stream may stay silent before it is taken
    /// as broken off (salvaged) instead of waiting for a usage frame, `[DONE]` or the
    /// end of the body. Never longer than the inter-token budget.
    pub finish_grace: Duration,
    /// Idle pooled connections are closed after this.
    pub pool_idle_timeout: Duration,
    /// Idle pooled connections kept per host. Above the calls one host may have in
    /// flight: a cap below them closes a connection after each call past the cap and
    /// opens a new one for the next (at 32, 64 concurrent plain calls ran at 0.41×
    /// the bare client's rate against 0.49× at 1024; docs/BENCHMARKS.md). Idle ones
    /// still close after `pool_idle_timeout`.
    pub pool_max_idle_per_host: usize,
    /// The `User-Agent` header.
    pub user_agent: String,
    /// Extra trusted CA certificates (a PEM bundle), on top of the webpki roots and
    /// the system's trust store: upstreams behind a private CA (`POLYGW_CA_FILE`).
    pub extra_roots_pem: Option<Vec<u8>>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            max_body_bytes: DEFAULT_MAX_BYTES,
            max_content_bytes: DEFAULT_MAX_BYTES,
            max_stream_bytes: 256 * 1024 * 1024,
            max_sse_line_bytes: DEFAULT_MAX_SSE_LINE_BYTES,
            stream_time_factor: DEFAULT_STREAM_TIME_FACTOR,
            max_error_body_bytes: 64 * 1024,
            connect_timeout: Duration::from_secs(10),
            finish_grace: Duration::from_secs(5),
            pool_idle_timeout: Duration::from_secs(90),
            pool_max_idle_per_host: 1024,
            user_agent: format!("polygw/{}", env!("CARGO_PKG_VERSION")),
            extra_roots_pem: None,
        }
    }
}

/// The HTTP client could not be built (TLS backend initialisation).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot build the HTTP client: {0}")]
pub struct TransportBuildError(String);

/// The OpenAI-compatible transport. Cheap to clone (one shared, pooled client).
#[derive(Clone)]
pub struct OpenAiTransport {
    inner: Arc<Inner>,
}

struct Inner {
    client: reqwest::Client,
    cfg: TransportConfig,
    clock: Arc<dyn Clock>,
    urls: UrlCache,
}

/// Endpoint URLs parsed once per (base URL, path) instead of on every request
/// (parsing and IDNA-checking a URL is ≈ 3 000 instructions: a visible share of what
/// a call adds to a bare request, docs/BENCHMARKS.md "Call overhead").
#[derive(Default)]
struct UrlCache(std::sync::RwLock<std::collections::HashMap<String, Vec<(String, reqwest::Url)>>>);

impl UrlCache {
    /// Bases remembered at most; past it the cache starts over (a library user who
    /// builds sources on the fly must not grow it without bound).
    const MAX_BASES: usize = 256;

    /// The parsed endpoint, or `None` when it does not parse (the request is then
    /// built from the string, and reqwest reports the error as before).
    fn get(&self, base_url: &str, path: &str) -> Option<reqwest::Url> {
        {
            let map = self.0.read().unwrap_or_else(|e| e.into_inner());
            if let Some(u) = map
                .get(base_url)
                .and_then(|paths| paths.iter().find(|(p, _)| p == path))
            {
                return Some(u.1.clone());
            }
        }
        let url = reqwest::Url::parse(&endpoint_url(base_url, path)).ok()?;
        let mut map = self.0.write().unwrap_or_else(|e| e.into_inner());
        if map.len() >= Self::MAX_BASES && !map.contains_key(base_url) {
            map.clear();
        }
        let paths = map.entry(base_url.to_string()).or_default();
        if !paths.iter().any(|(p, _)| p == path) {
            paths.push((path.to_string(), url.clone()));
        }
        Some(url)
    }
}

impl fmt::Debug for OpenAiTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The client holds no key (keys travel per request); still, print only config.
        f.debug_struct("OpenAiTransport")
            .field("config", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

impl OpenAiTransport {
    /// A transport with the default configuration.
    pub fn new(clock: Arc<dyn Clock>) -> Result<Self, TransportBuildError> {
        OpenAiTransport::with_config(TransportConfig::default(), clock)
    }

    /// A transport with this configuration.
    pub fn with_config(
        cfg: TransportConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, TransportBuildError> {
        let mut builder = reqwest::Client::builder();
        if let Some(pem) = &cfg.extra_roots_pem {
            let certs = reqwest::Certificate::from_pem_bundle(pem)
                .map_err(|e| TransportBuildError(format!("the extra CA bundle: {e}")))?;
            if certs.is_empty() {
                return Err(TransportBuildError(
                    "the extra CA bundle holds no PEM certificate".into(),
                ));
            }
            for c in certs {
                builder = builder.add_root_certificate(c);
            }
        }
        let client = builder
            .connect_timeout(cfg.connect_timeout)
            .pool_idle_timeout(cfg.pool_idle_timeout)
            .pool_max_idle_per_host(cfg.pool_max_idle_per_host)
            .user_agent(cfg.user_agent.clone())
            .tcp_nodelay(true)
            // A redirect would resend the Authorization header elsewhere; a 3xx is a
            // misbehaving source (classified invalid).
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| TransportBuildError(failure::describe(&e, "")))?;
        Ok(OpenAiTransport {
            inner: Arc::new(Inner {
                client,
                cfg,
                clock,
                urls: UrlCache::default(),
            }),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &TransportConfig {
        &self.inner.cfg
    }

    /// A POST to `{base_url}/{path}` with the JSON body, the call id and, when the key
    /// is non-empty, the bearer header (marked sensitive).
    fn post(
        &self,
        source: &SourceConfig,
        path: &str,
        body: Vec<u8>,
        call_id: &str,
        stream: bool,
    ) -> reqwest::RequestBuilder {
        let rb = match self.inner.urls.get(&source.base_url, path) {
            Some(url) => self.inner.client.post(url),
            None => self.inner.client.post(endpoint_url(&source.base_url, path)),
        };
        let key = source.api_key.expose();
        self.headers(rb, Some((true, key)), body, call_id, stream)
    }

    /// The POST of a chat attempt to its source's API (SPEC §23.1–23.2): the API's
    /// path, the client's query string and `anthropic-*` headers for a native request,
    /// the source's auth, and `anthropic-version` on a `messages` source unless the
    /// client sent one.
    fn post_attempt(
        &self,
        source: &SourceConfig,
        native: Option<&NativeRequest>,
        client: Option<&ClientCredential>,
        body: Vec<u8>,
        call_id: &str,
        stream: bool,
    ) -> reqwest::RequestBuilder {
        let path = source.api.path(&source.base_url);
        let query = native
            .and_then(|n| n.query.as_deref())
            .filter(|q| !q.is_empty());
        let rb = match (query, self.inner.urls.get(&source.base_url, path)) {
            (None, Some(url)) => self.inner.client.post(url),
            (None, None) => self.inner.client.post(endpoint_url(&source.base_url, path)),
            (Some(q), _) => {
                let url = endpoint_url(&source.base_url, path);
                let sep = if url.contains('?') { '&' } else { '?' };
                self.inner.client.post(format!("{url}{sep}{q}"))
            }
        };
        let rb = self.headers(rb, credential(source, client), body, call_id, stream);
        self.anthropic_headers(rb, source, native)
    }

    /// A POST to `endpoint` under a native source's API path (`count_tokens`), with the
    /// client's `anthropic-*` headers and the source's auth.
    fn post_native(
        &self,
        source: &SourceConfig,
        native: &NativeRequest,
        client: Option<&ClientCredential>,
        endpoint: &str,
        body: Vec<u8>,
        call_id: &str,
    ) -> reqwest::RequestBuilder {
        let path = format!("{}/{endpoint}", source.api.path(&source.base_url));
        let rb = self
            .inner
            .client
            .post(endpoint_url(&source.base_url, &path));
        let rb = self.headers(rb, credential(source, client), body, call_id, false);
        self.anthropic_headers(rb, source, Some(native))
    }

    /// On a `messages` source: the client's `anthropic-*` headers, and
    /// `anthropic-version` when it sent none.
    fn anthropic_headers(
        &self,
        mut rb: reqwest::RequestBuilder,
        source: &SourceConfig,
        native: Option<&NativeRequest>,
    ) -> reqwest::RequestBuilder {
        if source.api != SourceApi::Messages {
            return rb;
        }
        let mut version = false;
        for (k, v) in native.map_or(&[][..], |n| &n.headers[..]) {
            version |= k == "anthropic-version";
            if let Ok(v) = HeaderValue::from_str(v) {
                rb = rb.header(k.as_str(), v);
            }
        }
        if !version {
            rb = rb.header(
                "anthropic-version",
                HeaderValue::from_static(ANTHROPIC_VERSION),
            );
        }
        rb
    }

    /// The headers every request carries: JSON in, the stream or JSON accepted, the
    /// call id, and the credential (`(bearer, value)`: `Authorization: Bearer` or
    /// `x-api-key`; marked sensitive; none when empty).
    fn headers(
        &self,
        rb: reqwest::RequestBuilder,
        cred: Option<(bool, &str)>,
        body: Vec<u8>,
        call_id: &str,
        stream: bool,
    ) -> reqwest::RequestBuilder {
        let mut rb = rb
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(
                ACCEPT,
                HeaderValue::from_static(if stream {
                    "text/event-stream"
                } else {
                    "application/json"
                }),
            )
            .body(body);
        // Header names as `HeaderName`s, not strings parsed again per request.
        if let Ok(v) = HeaderValue::from_str(call_id) {
            rb = rb.header(HeaderName::from_static("x-polygw-call-id"), v);
        }
        if let Some((bearer, key)) = cred.filter(|(_, k)| !k.is_empty()) {
            // An invalid key (control characters) is sent as no header at all rather
            // than risking the key in an error message; the upstream answers 401.
            let (name, value) = if bearer {
                (AUTHORIZATION, format!("Bearer {key}"))
            } else {
                (HeaderName::from_static("x-api-key"), key.to_string())
            };
            if let Ok(mut v) = HeaderValue::from_str(&value) {
                v.set_sensitive(true);
                rb = rb.header(name, v);
            }
        }
        rb
    }
}

/// The credential a source is sent, as `(bearer, value)`: its own `API_KEY` the way
/// `AUTH` says, or with `AUTH=client` the client's, the way the client presented it.
fn credential<'a>(
    source: &'a SourceConfig,
    client: Option<&'a ClientCredential>,
) -> Option<(bool, &'a str)> {
    let key = source.api_key.expose();
    match source.effective_auth() {
        SourceAuth::Bearer => Some((true, key)),
        SourceAuth::XApiKey => Some((false, key)),
        SourceAuth::Client => client.map(|c| (c.bearer, c.secret.expose())),
    }
}

/// The `anthropic-version` a `messages` source gets when the client sent none.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

#[cfg(test)]
mod tests {
    use super::{endpoint_url, UrlCache};

    #[test]
    fn url_cache_parses_once_per_base_and_path_and_stays_bounded() {
        let c = UrlCache::default();
        let a = c.get("http://h:1/v1/", "chat/completions").unwrap();
        assert_eq!(a.as_str(), "http://h:1/v1/chat/completions");
        assert_eq!(c.get("http://h:1/v1/", "chat/completions").unwrap(), a);
        assert_eq!(
            c.get("http://h:1/v1/", "embeddings").unwrap().as_str(),
            "http://h:1/v1/embeddings"
        );
        assert_eq!(c.0.read().unwrap().len(), 1);
        // Not a URL: no entry, the caller falls back to the string.
        assert!(c.get("no scheme here", "chat/completions").is_none());
        for i in 0..(UrlCache::MAX_BASES + 10) {
            c.get(&format!("http://h{i}/v1"), "chat/completions")
                .unwrap();
        }
        assert!(c.0.read().unwrap().len() <= UrlCache::MAX_BASES);
    }

    #[test]
    fn endpoint_keeps_the_query_after_the_path() {
        assert_eq!(
            endpoint_url("https://h/v1", "chat/completions"),
            "https://h/v1/chat/completions"
        );
        assert_eq!(
            endpoint_url("https://h/v1?key=s3cr3t&x=1", "chat/completions"),
            "https://h/v1/chat/completions?key=s3cr3t&x=1"
        );
        assert_eq!(
            endpoint_url("https://h/v1/?key=k#frag", "embeddings"),
            "https://h/v1/embeddings?key=k"
        );
    }
}
