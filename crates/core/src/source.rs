//! [`SourceConfig`]: one upstream of a scope, and its derived token reservation.

use std::time::Duration;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::resume::PrefillDialect;
use crate::secret::Secret;

/// Default whole-request timeout (`TIMEOUT_S`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default embedding batch size (`BATCH_SIZE`).
pub const DEFAULT_BATCH_SIZE: u32 = 64;

/// One source (`{SCOPE}__{PROVIDER}__{N}__…`). Build with [`SourceConfig::new`] and the
/// `with_*` methods, or load from the environment.
///
/// `Debug` never shows the API key, a query string of `BASE_URL` (some providers take a
/// token there) or the values of `EXTRA_BODY` (which may carry credentials).
#[derive(Clone, PartialEq, Serialize)]
pub struct SourceConfig {
    /// `{provider}-{n}` lower-case.
    pub name: String,
    /// The provider segment, lower-case (e.g. `deepseek`).
    pub provider: String,
    /// e.g. `https://api.deepseek.com/v1` (no trailing slash).
    #[serde(serialize_with = "ser_url")]
    pub base_url: String,
    /// Never printed; may be empty for local servers.
    pub api_key: Secret,
    /// The upstream model id.
    pub model: String,
    /// Requests per rolling 60 s; 0 = unlimited.
    pub rpm: u32,
    /// Tokens per rolling 60 s; 0 = unlimited.
    pub tpm: u64,
    /// Tokens reserved at admission; 0 = derive (see [`SourceConfig::effective_est_tokens`]).
    pub est_tokens: u64,
    /// In-flight cap; 0 = unlimited.
    pub max_concurrency: u32,
    /// Whole-request timeout (plain); stream fallback.
    #[serde(with = "crate::durations::secs")]
    pub timeout: Duration,
    /// Stream: time to the first incremental chunk.
    #[serde(with = "crate::durations::opt_secs")]
    pub ttft_timeout: Option<Duration>,
    /// Stream: max gap between incremental chunks (falls back to `timeout`).
    #[serde(with = "crate::durations::opt_secs")]
    pub inter_token_timeout: Option<Duration>,
    /// Lower = preferred tier.
    pub priority: u32,
    /// Weighted choice inside a tier (≥ 1).
    pub weight: u32,
    /// Currency units per 1M input tokens.
    pub input_price: Option<f64>,
    /// Currency units per 1M output tokens (reasoning included).
    pub output_price: Option<f64>,
    /// Currency units per 1M prompt tokens read from the provider's prompt cache
    /// (`CACHED_INPUT_PRICE`; `None` = `input_price`: SPEC §20.1).
    pub cached_input_price: Option<f64>,
    /// Currency units per 1M prompt tokens written to the provider's prompt cache
    /// (`CACHE_WRITE_PRICE`; `None` = `input_price`).
    pub cache_write_price: Option<f64>,
    /// Currency units per 1M prompt tokens written to the cache for an hour
    /// (`CACHE_WRITE_1H_PRICE`, Anthropic's `ttl: "1h"`; `None` = `cache_write_price`).
    pub cache_write_1h_price: Option<f64>,
    /// Price of one call (OCR sources).
    pub price_per_call: Option<f64>,
    /// Embedding batch size.
    pub batch_size: u32,
    /// Merged into every request body (after the caller's overlay).
    pub extra_body: Map<String, Value>,
    /// How this source continues an assistant prefill (`PREFILL`; `None` = it does not:
    /// a resume on it replays).
    pub prefill: Option<PrefillDialect>,
    /// The model's context window in tokens (`CONTEXT_WINDOW`): a context-length
    /// rejection elsewhere may be routed here when it is larger (SPEC §14.9).
    pub context_window: Option<u64>,
    /// The API the source speaks (`API`; SPEC §23.1).
    pub api: SourceApi,
    /// How the source authenticates (`AUTH`; `None` = the API's own way: a bearer token
    /// for `chat`, `x-api-key` for `messages`).
    pub auth: Option<SourceAuth>,
    /// The source takes the output cap only as `max_completion_tokens`
    /// (`MAX_TOKENS_FIELD=max_completion_tokens`, or learned from its 400: SPEC §24.4).
    pub max_completion_tokens: bool,
    /// The most output tokens one call may ask of the source (`MAX_OUTPUT_TOKENS`): what
    /// a budgeted client key's call without a cap of its own reserves and is sent (SPEC
    /// §24.1); unset: [`crate::key_funds::DEFAULT_MAX_OUTPUT_TOKENS`].
    pub max_output_tokens: Option<u64>,
    /// The source's signature family (`SIGNATURE_GROUP`; SPEC §23.5): sources that
    /// share one can verify each other's thinking signatures and encrypted reasoning.
    /// `None`: the source alone ([`SourceConfig::family`]).
    pub signature_group: Option<String>,
}

/// The API a source speaks (`{S}__{P}__{i}__API`, SPEC §23.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum SourceApi {
    /// OpenAI's chat completions (`/chat/completions`).
    #[default]
    Chat,
    /// Anthropic's Messages API (`/v1/messages`).
    Messages,
    /// OpenAI's Responses API (`/v1/responses`).
    Responses,
}

impl SourceApi {
    /// Its name in configuration and telemetry.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceApi::Chat => "chat",
            SourceApi::Messages => "messages",
            SourceApi::Responses => "responses",
        }
    }

    /// The path of its requests under a source's `base_url`.
    ///
    /// `chat` appends `chat/completions` to the base URL as given: OpenAI-compatible
    /// base URLs carry their own version path (`/v1`, GLM's `/api/paas/v4`, …), and
    /// adding one would break them (DECISIONS 172). `messages` and `responses` append
    /// their name to a base URL whose path ends in `/v1`, else `v1/<name>`: vendors
    /// document their Anthropic endpoints without it (`https://api.deepseek.com/anthropic`).
    pub fn path(self, base_url: &str) -> &'static str {
        let v1 = base_url
            .split(['?', '#'])
            .next()
            .unwrap_or(base_url)
            .trim_end_matches('/')
            .ends_with("/v1");
        match (self, v1) {
            (SourceApi::Chat, _) => "chat/completions",
            (SourceApi::Messages, true) => "messages",
            (SourceApi::Messages, false) => "v1/messages",
            (SourceApi::Responses, true) => "responses",
            (SourceApi::Responses, false) => "v1/responses",
        }
    }

    /// The request URL of a source of this API at `base_url` ([`endpoint_url`]).
    pub fn url(self, base_url: &str) -> String {
        endpoint_url(base_url, self.path(base_url))
    }
}

/// `{base_url}/{path}`, keeping a query string of the base URL (some gateways take
/// their key there: `https://host/v1?key=…`) after the path, where it belongs.
pub fn endpoint_url(base_url: &str, path: &str) -> String {
    // A fragment is never sent.
    let base = base_url.split_once('#').map_or(base_url, |(b, _)| b);
    match base.split_once('?') {
        Some((b, q)) => format!("{}/{path}?{q}", b.trim_end_matches('/')),
        None => format!("{}/{path}", base.trim_end_matches('/')),
    }
}

impl std::str::FromStr for SourceApi {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s.trim().to_ascii_lowercase().as_str() {
            "chat" => Ok(SourceApi::Chat),
            "messages" => Ok(SourceApi::Messages),
            "responses" => Ok(SourceApi::Responses),
            _ => Err(()),
        }
    }
}

/// How a source authenticates (`{S}__{P}__{i}__AUTH`, SPEC §23.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SourceAuth {
    /// `x-api-key: <API_KEY>` (Anthropic's way).
    XApiKey,
    /// `Authorization: Bearer <API_KEY>` (OpenAI's way).
    Bearer,
    /// The client's own credential, forwarded (bring your own key, subscription
    /// tokens: SPEC §23.1); the source's `API_KEY` is not sent.
    Client,
}

impl SourceAuth {
    /// The auth a source of `api` uses when `AUTH` is not set.
    pub fn default_for(api: SourceApi) -> Self {
        match api {
            SourceApi::Chat | SourceApi::Responses => SourceAuth::Bearer,
            SourceApi::Messages => SourceAuth::XApiKey,
        }
    }
}

impl std::str::FromStr for SourceAuth {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s.trim().to_ascii_lowercase().as_str() {
            "x-api-key" => Ok(SourceAuth::XApiKey),
            "bearer" => Ok(SourceAuth::Bearer),
            "client" => Ok(SourceAuth::Client),
            _ => Err(()),
        }
    }
}

impl SourceConfig {
    /// A source with defaults for everything but its identity, URL, key and model.
    pub fn new(
        provider: impl Into<String>,
        index: u32,
        base_url: impl Into<String>,
        api_key: impl Into<Secret>,
        model: impl Into<String>,
    ) -> Self {
        let provider = provider.into().to_lowercase();
        SourceConfig {
            name: format!("{provider}-{index}"),
            provider,
            base_url: base_url.into().trim_end_matches('/').to_string(),
            api_key: api_key.into(),
            model: model.into(),
            rpm: 0,
            tpm: 0,
            est_tokens: 0,
            max_concurrency: 0,
            timeout: DEFAULT_TIMEOUT,
            ttft_timeout: None,
            inter_token_timeout: None,
            priority: 0,
            weight: 1,
            input_price: None,
            output_price: None,
            cached_input_price: None,
            cache_write_price: None,
            cache_write_1h_price: None,
            price_per_call: None,
            batch_size: DEFAULT_BATCH_SIZE,
            extra_body: Map::new(),
            prefill: None,
            context_window: None,
            api: SourceApi::Chat,
            auth: None,
            max_completion_tokens: false,
            max_output_tokens: None,
            signature_group: None,
        }
    }

    /// The source's signature family: its `SIGNATURE_GROUP`, else its own name.
    pub fn family(&self) -> &str {
        self.signature_group.as_deref().unwrap_or(&self.name)
    }

    /// Sets the API the source speaks (`API`).
    pub fn with_api(mut self, api: SourceApi) -> Self {
        self.api = api;
        self
    }

    /// Sets how the source authenticates (`AUTH`).
    pub fn with_auth(mut self, auth: SourceAuth) -> Self {
        self.auth = Some(auth);
        self
    }

    /// How the source authenticates: `AUTH`, else its API's way.
    pub fn effective_auth(&self) -> SourceAuth {
        self.auth.unwrap_or(SourceAuth::default_for(self.api))
    }

    /// The URL its requests go to ([`SourceApi::url`]).
    pub fn request_url(&self) -> String {
        self.api.url(&self.base_url)
    }

    /// Sets the prefill dialect (`PREFILL`).
    pub fn with_prefill(mut self, dialect: PrefillDialect) -> Self {
        self.prefill = Some(dialect);
        self
    }

    /// Sets the context window (`CONTEXT_WINDOW`, tokens).
    pub fn with_context_window(mut self, tokens: u64) -> Self {
        self.context_window = Some(tokens);
        self
    }

    /// Sets RPM.
    pub fn with_rpm(mut self, rpm: u32) -> Self {
        self.rpm = rpm;
        self
    }
    /// Sets TPM.
    pub fn with_tpm(mut self, tpm: u64) -> Self {
        self.tpm = tpm;
        self
    }
    /// Sets EST_TOKENS.
    pub fn with_est_tokens(mut self, est: u64) -> Self {
        self.est_tokens = est;
        self
    }
    /// Sets MAX_CONCURRENCY.
    pub fn with_max_concurrency(mut self, n: u32) -> Self {
        self.max_concurrency = n;
        self
    }
    /// Sets TIMEOUT_S.
    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
    /// Sets TTFT_TIMEOUT_S.
    pub fn with_ttft_timeout(mut self, t: Duration) -> Self {
        self.ttft_timeout = Some(t);
        self
    }
    /// Sets INTER_TOKEN_TIMEOUT_S.
    pub fn with_inter_token_timeout(mut self, t: Duration) -> Self {
        self.inter_token_timeout = Some(t);
        self
    }
    /// Sets PRIORITY.
    pub fn with_priority(mut self, p: u32) -> Self {
        self.priority = p;
        self
    }
    /// Sets WEIGHT.
    pub fn with_weight(mut self, w: u32) -> Self {
        self.weight = w;
        self
    }
    /// Sets INPUT_PRICE and OUTPUT_PRICE (per 1M tokens).
    pub fn with_prices(mut self, input: f64, output: f64) -> Self {
        self.input_price = Some(input);
        self.output_price = Some(output);
        self
    }
    /// Sets CACHED_INPUT_PRICE (per 1M prompt tokens read from the provider's cache).
    pub fn with_cached_input_price(mut self, p: f64) -> Self {
        self.cached_input_price = Some(p);
        self
    }
    /// Sets CACHE_WRITE_PRICE (per 1M prompt tokens written to the provider's cache).
    pub fn with_cache_write_price(mut self, p: f64) -> Self {
        self.cache_write_price = Some(p);
        self
    }
    /// Sets CACHE_WRITE_1H_PRICE (per 1M prompt tokens written to the cache for an hour).
    pub fn with_cache_write_1h_price(mut self, p: f64) -> Self {
        self.cache_write_1h_price = Some(p);
        self
    }
    /// Sets PRICE_PER_CALL.
    pub fn with_price_per_call(mut self, p: f64) -> Self {
        self.price_per_call = Some(p);
        self
    }
    /// Sets BATCH_SIZE.
    pub fn with_batch_size(mut self, n: u32) -> Self {
        self.batch_size = n;
        self
    }
    /// Sets EXTRA_BODY.
    pub fn with_extra_body(mut self, body: Map<String, Value>) -> Self {
        self.extra_body = body;
        self
    }

    /// Tokens reserved at admission (SPEC §4.2): `EST_TOKENS` if > 0; else, over the
    /// non-zero TPM limits that apply (the source's and the scope's), `max(1, min/60)`;
    /// else 0. "One call ≈ one second of quota": every quota size allows ≈ 60 in flight.
    pub fn effective_est_tokens(&self, scope_tpm: u64) -> u64 {
        effective_est_tokens(self.est_tokens, self.tpm, scope_tpm)
    }

    /// The stream watchdog's budget before the first incremental chunk.
    pub fn ttft_budget(&self) -> Duration {
        self.ttft_timeout.unwrap_or(self.timeout)
    }

    /// The stream watchdog's budget between incremental chunks.
    pub fn inter_token_budget(&self) -> Duration {
        self.inter_token_timeout.unwrap_or(self.timeout)
    }

    /// Whether any token price is configured.
    pub fn has_token_prices(&self) -> bool {
        self.input_price.is_some()
            || self.output_price.is_some()
            || self.cached_input_price.is_some()
            || self.cache_write_price.is_some()
            || self.cache_write_1h_price.is_some()
    }

    /// The price of a cached prompt token: `CACHED_INPUT_PRICE`, else `INPUT_PRICE`.
    pub fn effective_cached_input_price(&self) -> Option<f64> {
        self.cached_input_price.or(self.input_price)
    }

    /// The price of a prompt token written to the cache: `CACHE_WRITE_PRICE`, else
    /// `INPUT_PRICE`.
    pub fn effective_cache_write_price(&self) -> Option<f64> {
        self.cache_write_price.or(self.input_price)
    }
}

fn ser_url<S: serde::Serializer>(u: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&crate::secret::redact_url(u))
}

impl std::fmt::Debug for SourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceConfig")
            .field("name", &self.name)
            .field("base_url", &crate::secret::redact_url(&self.base_url))
            .field("api_key", &self.api_key)
            .field("model", &self.model)
            .field("rpm", &self.rpm)
            .field("tpm", &self.tpm)
            .field("est_tokens", &self.est_tokens)
            .field("max_concurrency", &self.max_concurrency)
            .field("timeout", &self.timeout)
            .field("ttft_timeout", &self.ttft_timeout)
            .field("inter_token_timeout", &self.inter_token_timeout)
            .field("priority", &self.priority)
            .field("weight", &self.weight)
            .field("input_price", &self.input_price)
            .field("output_price", &self.output_price)
            .field("cached_input_price", &self.cached_input_price)
            .field("cache_write_price", &self.cache_write_price)
            .field("cache_write_1h_price", &self.cache_write_1h_price)
            .field("price_per_call", &self.price_per_call)
            .field("batch_size", &self.batch_size)
            .field(
                "extra_body_keys",
                &self.extra_body.keys().collect::<Vec<_>>(),
            )
            .field("prefill", &self.prefill)
            .field("context_window", &self.context_window)
            .field("api", &self.api)
            .field("auth", &self.auth)
            .field("max_completion_tokens", &self.max_completion_tokens)
            .field("max_output_tokens", &self.max_output_tokens)
            .field("signature_group", &self.signature_group)
            .finish()
    }
}

/// The pure rule behind [`SourceConfig::effective_est_tokens`].
pub fn effective_est_tokens(est_tokens: u64, source_tpm: u64, scope_tpm: u64) -> u64 {
    if est_tokens > 0 {
        return est_tokens;
    }
    let tightest = [source_tpm, scope_tpm].into_iter().filter(|&t| t > 0).min();
    match tightest {
        Some(tpm) => (tpm / 60).max(1),
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_urls_follow_the_api_and_the_base_urls_version() {
        let table = [
            (
                SourceApi::Chat,
                "https://api.x.com/v1",
                "https://api.x.com/v1/chat/completions",
            ),
            (
                SourceApi::Chat,
                "https://glm.cn/api/paas/v4/",
                "https://glm.cn/api/paas/v4/chat/completions",
            ),
            (
                SourceApi::Messages,
                "https://api.anthropic.com/v1",
                "https://api.anthropic.com/v1/messages",
            ),
            (
                SourceApi::Messages,
                "https://api.anthropic.com",
                "https://api.anthropic.com/v1/messages",
            ),
            (
                SourceApi::Messages,
                "https://api.deepseek.com/anthropic",
                "https://api.deepseek.com/anthropic/v1/messages",
            ),
            (
                SourceApi::Messages,
                "http://h/v1?k=1",
                "http://h/v1/messages?k=1",
            ),
        ];
        for (api, base, want) in table {
            assert_eq!(api.url(base), want, "{api:?} {base}");
        }
        assert_eq!("Messages".parse::<SourceApi>(), Ok(SourceApi::Messages));
        assert!("responses2".parse::<SourceApi>().is_err());
        assert_eq!(
            SourceApi::Responses.url("https://api.openai.com/v1"),
            "https://api.openai.com/v1/responses"
        );
        assert_eq!(
            SourceApi::Responses.url("http://h:1"),
            "http://h:1/v1/responses"
        );
        assert_eq!(
            SourceAuth::default_for(SourceApi::Messages),
            SourceAuth::XApiKey
        );
        assert_eq!("bearer".parse::<SourceAuth>(), Ok(SourceAuth::Bearer));
        assert_eq!("Client".parse::<SourceAuth>(), Ok(SourceAuth::Client));
    }

    #[test]
    fn effective_est_tokens_table() {
        // (est, source tpm, scope tpm, expected)
        let table = [
            (0, 0, 0, 0),
            (400, 0, 0, 400),
            (400, 6000, 0, 400),
            (0, 6000, 0, 100),
            (0, 600_000, 0, 10_000),
            (0, 30, 0, 1),
            (0, 0, 6000, 100), // scope TPM alone is not toothless
            (0, 600_000, 6000, 100),
            (0, 6000, 600_000, 100),
            (0, 59, 0, 1),
            (0, 120, 0, 2),
        ];
        for (est, tpm, scope, want) in table {
            assert_eq!(
                effective_est_tokens(est, tpm, scope),
                want,
                "est={est} tpm={tpm} scope={scope}"
            );
        }
    }

    #[test]
    fn debug_hides_credentials_outside_the_key_too() {
        let mut extra = Map::new();
        extra.insert("x_token".into(), Value::String("tok-123".into()));
        let s = SourceConfig::new("p", 0, "https://h/v1?key=qq-999", "sk-1", "m")
            .with_extra_body(extra);
        let d = format!("{s:?}");
        for secret in ["sk-1", "qq-999", "tok-123"] {
            assert!(!d.contains(secret), "{secret} in {d}");
        }
        assert!(d.contains("x_token"), "keys are shown: {d}");
        let j = serde_json::to_string(&s).unwrap();
        assert!(!j.contains("qq-999") && !j.contains("sk-1"), "{j}");
    }

    #[test]
    fn new_normalizes_name_and_url() {
        let s = SourceConfig::new("DeepSeek", 2, "https://x/v1/", "k", "m");
        assert_eq!(s.name, "deepseek-2");
        assert_eq!(s.base_url, "https://x/v1");
        assert!(!format!("{s:?}").contains("\"k\""));
    }
}
