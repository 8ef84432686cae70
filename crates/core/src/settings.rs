//! [`ScopeSettings`]: one logical endpoint and its sources, retry, limits, breaker,
//! hedge, stream, cache, telemetry and governance settings (SPEC §2).

use std::time::Duration;

use serde::Serialize;

use crate::hedge::{
    Bounds, ThresholdSetting, DEFAULT_AFTER_BOUNDS, DEFAULT_BUDGET_PCT, DEFAULT_BURST,
    DEFAULT_MIN_SAMPLES, DEFAULT_STALL_BOUNDS,
};
use crate::resume::ResumeSetting;
use crate::secret::{redact_url, Secret};
use crate::source::SourceConfig;

/// What kind of client uses a scope (hedging is chat-only; OCR is RPM-governed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScopeKind {
    /// `GatewayClient::chat`.
    Chat,
    /// `EmbeddingClient::embed`.
    Embedding,
    /// `OcrClient::recognize`.
    Ocr,
}

impl ScopeKind {
    /// Every kind, in `{S}__KIND` order.
    pub const ALL: [ScopeKind; 3] = [ScopeKind::Chat, ScopeKind::Embedding, ScopeKind::Ocr];

    /// The `{S}__KIND` value (also the telemetry `operation`).
    pub fn as_str(self) -> &'static str {
        self.operation()
    }

    /// The telemetry `operation` value.
    pub fn operation(self) -> &'static str {
        match self {
            ScopeKind::Chat => "chat",
            ScopeKind::Embedding => "embedding",
            ScopeKind::Ocr => "ocr",
        }
    }
}

impl std::fmt::Display for ScopeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ScopeKind {
    type Err = ();

    /// `chat`, `embedding` or `ocr` (case-insensitive, surrounding blanks ignored).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        ScopeKind::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(t))
            .ok_or(())
    }
}

/// `RETRY__ON_NO_RUNNABLE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnNoRunnable {
    /// Wait for the earliest hint (bounded by deadline and stall window).
    #[default]
    Wait,
    /// Fail with `no_runnable_source` at once.
    Fail,
}

/// `{S}__RETRY__*`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RetrySettings {
    /// Budget of budget-consuming rounds.
    pub max_attempts: u32,
    /// Max time without progress.
    #[serde(with = "crate::durations::secs")]
    pub stall_window: Duration,
    /// Backoff base.
    #[serde(with = "crate::durations::secs")]
    pub backoff_base: Duration,
    /// Backoff cap.
    #[serde(with = "crate::durations::secs")]
    pub backoff_max: Duration,
    /// What to do when no source can be admitted.
    pub on_no_runnable: OnNoRunnable,
    /// Which source a retry round tries first (`RETRY__PREFER`).
    pub prefer: RetryPrefer,
    /// `RETRY__THROTTLE_MAX` / `RETRY__THROTTLE_RATIO` (SPEC §25.4).
    pub throttle: crate::retry_throttle::ThrottleSettings,
}

/// `RETRY__PREFER` (SPEC §14.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryPrefer {
    /// The next round tries a source that has not failed in the call first.
    #[default]
    Other,
    /// A transient failure (5xx, reset, timeout, 429 with a hint ≤ `BACKOFF_MAX_S`)
    /// retries the same source once, after its hint or backoff, while its breaker
    /// stays closed.
    Same,
}

impl Default for RetrySettings {
    fn default() -> Self {
        RetrySettings {
            max_attempts: 3,
            stall_window: Duration::from_secs(60),
            backoff_base: Duration::from_millis(500),
            backoff_max: Duration::from_secs(8),
            on_no_runnable: OnNoRunnable::Wait,
            prefer: RetryPrefer::Other,
            throttle: crate::retry_throttle::ThrottleSettings::default(),
        }
    }
}

/// The default lease of an in-flight slot, a reservation and a half-open probe.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// `{S}__LIMITS__*`: scope-wide limits on top of each source's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ScopeLimits {
    /// Scope requests per rolling 60 s; 0 = unlimited.
    pub rpm: u32,
    /// Scope tokens per rolling 60 s; 0 = unlimited.
    pub tpm: u64,
    /// Lease of in-flight slots, reservations and half-open probes (SPEC §14.4): renewed
    /// every third of it while the attempt is alive; a crashed process's slots free
    /// within one lease.
    #[serde(with = "crate::durations::secs")]
    pub lease: Duration,
}

impl Default for ScopeLimits {
    fn default() -> Self {
        ScopeLimits {
            rpm: 0,
            tpm: 0,
            lease: DEFAULT_LEASE,
        }
    }
}

/// `{S}__BREAKER__*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BreakerSettings {
    /// Consecutive breaker-feeding failures that open the breaker.
    pub failures: u32,
    /// First open time (doubles on each failed probe, up to `open_max`).
    #[serde(with = "crate::durations::secs")]
    pub open: Duration,
    /// The longest an open period grows to (`BREAKER__OPEN_MAX_S`; never below `open`).
    #[serde(with = "crate::durations::secs")]
    pub open_max: Duration,
    /// How long a dead source (401/403/404) stays out.
    #[serde(with = "crate::durations::secs")]
    pub dead: Duration,
    /// Consecutive 401/403/404 answers that make a source dead (`BREAKER__DEAD_AFTER`):
    /// one transient auth error does not take a source out (SPEC §17.4).
    pub dead_after: u32,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        BreakerSettings {
            failures: 5,
            // SPEC §19.3: a recovered primary is used again within seconds.
            open: Duration::from_secs(2),
            open_max: Duration::from_secs(30),
            dead: Duration::from_secs(300),
            dead_after: 2,
        }
    }
}

/// `{S}__HEDGE__*` (SPEC §7, §19): the two triggers — `off`, a static threshold, or
/// `auto` from the live latency of the scope's sources — and what `auto` and the budget
/// need. Both triggers default to `auto`, which hedges only in a chat scope with two or
/// more sources (a static threshold hedges with one source too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HedgeSettings {
    /// First-token trigger (`HEDGE__AFTER_S`).
    pub after: ThresholdSetting,
    /// Mid-stream stall trigger, streams only (`HEDGE__STALL_AFTER_S`).
    pub stall_after: ThresholdSetting,
    /// Extra legs per round, 1..=3.
    pub max_extra: u32,
    /// The budget's refill: extra legs as % of the scope's calls (0 = no cap).
    pub budget_pct: u32,
    /// `HEDGE__BURST`: the budget's start and least capacity, in legs.
    pub burst: u32,
    /// `HEDGE__BANK_S`: the budget banks what the calls of this long added (0: the
    /// burst only).
    #[serde(with = "crate::durations::secs")]
    pub bank: Duration,
    /// `HEDGE__WINDOW_S`: the live distributions decay over this.
    #[serde(with = "crate::durations::secs")]
    pub window: Duration,
    /// `HEDGE__MIN_SAMPLES`: a source's own distribution from this many legs on (the
    /// scope's pooled one before; no `auto` hedge before the pool has as many).
    pub min_samples: u64,
    /// Bounds of the `auto` first-token threshold (`HEDGE__MIN_S` / `HEDGE__MAX_S`).
    pub after_bounds: Bounds,
    /// Bounds of the `auto` stall threshold (`HEDGE__STALL_MIN_S` / `HEDGE__STALL_MAX_S`).
    pub stall_bounds: Bounds,
    /// Where `auto` thresholds start before there is evidence (`HEDGE__AFTER_PRIOR_S`,
    /// `HEDGE__STALL_PRIOR_S`; SPEC §25.1).
    pub priors: crate::threshold::Priors,
}

impl Default for HedgeSettings {
    fn default() -> Self {
        HedgeSettings {
            after: ThresholdSetting::Auto,
            stall_after: ThresholdSetting::Auto,
            max_extra: 1,
            budget_pct: DEFAULT_BUDGET_PCT,
            burst: DEFAULT_BURST,
            bank: crate::hedge::DEFAULT_BANK,
            window: crate::latency::DEFAULT_WINDOW,
            min_samples: DEFAULT_MIN_SAMPLES,
            after_bounds: DEFAULT_AFTER_BOUNDS,
            stall_bounds: DEFAULT_STALL_BOUNDS,
            priors: crate::threshold::Priors::default(),
        }
    }
}

impl HedgeSettings {
    /// Hedging off (both triggers `off`).
    pub fn off() -> Self {
        HedgeSettings {
            after: ThresholdSetting::Off,
            stall_after: ThresholdSetting::Off,
            ..HedgeSettings::default()
        }
    }

    /// Whether any trigger is on (`auto` or static).
    pub fn enabled(&self) -> bool {
        self.after != ThresholdSetting::Off || self.stall_after != ThresholdSetting::Off
    }

    /// Whether hedging can fire for a request streamed (`stream`) or not.
    pub fn enabled_for(&self, stream: bool) -> bool {
        self.after != ThresholdSetting::Off || (stream && self.stall_after != ThresholdSetting::Off)
    }

    /// Whether a trigger is `auto` (the live distributions are consulted).
    pub fn uses_auto(&self) -> bool {
        self.after == ThresholdSetting::Auto || self.stall_after == ThresholdSetting::Auto
    }
}

/// `{S}__STREAM__*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StreamSettings {
    /// A gap between incremental chunks longer than this counts as a stall in metering.
    #[serde(with = "crate::durations::millis")]
    pub stall_threshold: Duration,
    /// `STREAM__RESUME`: how a stream that fails or stalls after its first chunk is
    /// continued on another source (SPEC §13).
    pub resume: ResumeSetting,
    /// `STREAM__MAX_RESUMES`: resume legs per logical call (0 = off).
    pub max_resumes: u32,
}

/// Default `STREAM__MAX_RESUMES`.
pub const DEFAULT_MAX_RESUMES: u32 = 2;

impl Default for StreamSettings {
    fn default() -> Self {
        StreamSettings {
            stall_threshold: Duration::from_millis(1000),
            resume: ResumeSetting::Auto,
            max_resumes: DEFAULT_MAX_RESUMES,
        }
    }
}

impl StreamSettings {
    /// Whether a stream may be resumed at all.
    pub fn resume_enabled(&self) -> bool {
        self.resume != ResumeSetting::Off && self.max_resumes > 0
    }
}

/// `{S}__CACHE__*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CacheSettings {
    /// Entry lifetime; `None` = cache off.
    #[serde(with = "crate::durations::opt_secs")]
    pub ttl: Option<Duration>,
    /// Max entries.
    pub capacity: usize,
}

impl Default for CacheSettings {
    fn default() -> Self {
        CacheSettings {
            ttl: None,
            capacity: 10_000,
        }
    }
}

/// The built-in OCR instruction (`{S}__OCR__PROMPT` overrides it).
pub const DEFAULT_OCR_PROMPT: &str = "Transcribe all text in this image exactly as written. \
Keep the reading order and line breaks. Output only the text, without commentary.";

/// Default re-asks for structured output.
pub const DEFAULT_MAX_REASKS: u32 = 2;

/// One scope: a logical endpoint made of several sources.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScopeSettings {
    /// Upper-case scope name (`LLM`).
    pub name: String,
    /// The sources, in configuration order.
    pub sources: Vec<SourceConfig>,
    /// Bound on the whole logical call.
    #[serde(with = "crate::durations::opt_secs")]
    pub call_deadline: Option<Duration>,
    /// Retry loop.
    pub retry: RetrySettings,
    /// Scope-wide limits.
    pub limits: ScopeLimits,
    /// Breaker.
    pub breaker: BreakerSettings,
    /// Hedging.
    pub hedge: HedgeSettings,
    /// Stream metering.
    pub stream: StreamSettings,
    /// Response cache.
    pub cache: CacheSettings,
    /// `sqlite://path.db` or `postgres://…`; `None` = telemetry off.
    #[serde(serialize_with = "ser_opt_url")]
    pub telemetry_url: Option<Secret>,
    /// Redis URL for limiter + breaker (`redis://`, `rediss://`, `redis+cluster://`,
    /// `rediss+cluster://`); `None` = in-memory governance.
    #[serde(serialize_with = "ser_opt_url")]
    pub redis_url: Option<Secret>,
    /// `{S}__TLS__CA_FILE`: a PEM file of the CA certificates the scope's TLS connections
    /// to Redis trust instead of the system's roots (a private CA).
    pub tls_ca_file: Option<String>,
    /// Extra model names that select this scope in `polygw serve`.
    pub model_aliases: Vec<String>,
    /// Structured-output re-asks.
    pub max_reasks: u32,
    /// OCR instruction.
    pub ocr_prompt: String,
    /// How long a stored Responses API answer is kept (`RESPONSES__TTL_S`, SPEC §18.1).
    #[serde(with = "crate::durations::secs")]
    pub responses_ttl: Duration,
    /// Bytes of stored Responses each client key holds at most
    /// (`RESPONSES__MAX_BYTES_PER_KEY`, SPEC §24.5).
    pub responses_max_bytes_per_key: u64,
    /// Prompt-cache affinity (`AFFINITY`, `AFFINITY__TTL_S`, SPEC §20.2).
    pub affinity: crate::affinity::AffinitySettings,
    /// How long the signature family of a signed blob the scope passed is remembered
    /// (`SIGNATURE__TTL_S`, SPEC §23.5; default 7 days).
    #[serde(with = "crate::durations::secs")]
    pub signature_ttl: Duration,
    /// Client keys' money (`KEYS__ESTIMATE_MARGIN`, `KEYS__MIN_OUTPUT_TOKENS`, SPEC §24.1).
    pub keys: crate::key_funds::KeySettings,
}

/// The default `RESPONSES__TTL_S`: 30 days, as OpenAI keeps stored responses.
pub const DEFAULT_RESPONSES_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// The default `RESPONSES__MAX_BYTES_PER_KEY`: 64 MiB (an agent's day of turns, each
/// stored once).
pub const DEFAULT_RESPONSES_MAX_BYTES_PER_KEY: u64 = 64 << 20;

impl ScopeSettings {
    /// A scope with these sources and defaults everywhere else.
    pub fn new(name: impl Into<String>, sources: Vec<SourceConfig>) -> Self {
        ScopeSettings {
            name: name.into().to_uppercase(),
            sources,
            call_deadline: None,
            retry: RetrySettings::default(),
            limits: ScopeLimits::default(),
            breaker: BreakerSettings::default(),
            hedge: HedgeSettings::default(),
            stream: StreamSettings::default(),
            cache: CacheSettings::default(),
            telemetry_url: None,
            redis_url: None,
            tls_ca_file: None,
            model_aliases: Vec::new(),
            max_reasks: DEFAULT_MAX_REASKS,
            ocr_prompt: DEFAULT_OCR_PROMPT.to_string(),
            responses_ttl: DEFAULT_RESPONSES_TTL,
            responses_max_bytes_per_key: DEFAULT_RESPONSES_MAX_BYTES_PER_KEY,
            affinity: crate::affinity::AffinitySettings::default(),
            signature_ttl: crate::native::family::DEFAULT_SIGNATURE_TTL,
            keys: crate::key_funds::KeySettings::default(),
        }
    }

    /// The source with this name.
    pub fn source(&self, name: &str) -> Option<&SourceConfig> {
        self.sources.iter().find(|s| s.name == name)
    }

    /// `effective_est_tokens` of a source under this scope's limits.
    pub fn est_tokens(&self, source: &SourceConfig) -> u64 {
        source.effective_est_tokens(self.limits.tpm)
    }
}

fn ser_opt_url<S: serde::Serializer>(v: &Option<Secret>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(u) => s.serialize_some(&redact_url(u.expose())),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialized_settings_hide_secrets() {
        let mut s = ScopeSettings::new(
            "llm",
            vec![SourceConfig::new("a", 0, "http://x", "sk-123", "m")],
        );
        s.telemetry_url = Some(Secret::new("postgres://u:pw@h/db"));
        s.redis_url = Some(Secret::new("redis://:pw2@h:6379"));
        let json = serde_json::to_string(&s).unwrap();
        assert!(!json.contains("sk-123"), "{json}");
        assert!(!json.contains("pw@") && !json.contains("pw2"), "{json}");
        assert_eq!(s.name, "LLM");
    }

    #[test]
    fn hedge_enabled_for_plain_needs_first_token_trigger() {
        let h = HedgeSettings {
            stall_after: ThresholdSetting::Static(Duration::from_secs(1)),
            ..HedgeSettings::off()
        };
        assert!(h.enabled());
        assert!(!h.enabled_for(false));
        assert!(h.enabled_for(true));
    }
}
