//! polygw-mock-upstream: a scriptable OpenAI-compatible upstream simulator on loopback,
//! for polygw's tests, the `polygw demo` and `polygw mock-upstream` commands, and the
//! benchmarks (SPEC §1, §11, §12).
//!
//! - [`MockUpstream::start`] binds (127.0.0.1:0 by default) and serves
//!   `POST /v1/chat/completions` (plain JSON or SSE per the request's `stream`, vision
//!   requests included), `POST /v1/embeddings` and `GET /v1/models`.
//! - Each request plays one [`Behavior`]: the next queued [`Script`]
//!   ([`MockUpstream::push_script`]), else the default behavior, else a draw from the
//!   [`Profile`] (seeded; `fast`, `long-tail`, `flaky`, `stall`, or a JSON file).
//! - A request whose final assistant message is a prefix to continue (dialects
//!   `assistant`, `prefix`, `partial`, `vllm`) gets the continuation of the planned
//!   answer, a 400, or an answer from scratch, per the [`PrefillPolicy`].
//! - Every request is recorded ([`RecordedRequest`]): what arrived, when, how its
//!   response ended ([`EndKind`]) and the usage it reported.
//! - A simulated provider prefix cache ([`PrefixCache`], off unless configured) reports
//!   cached prompt tokens in a provider's dialect and answers hits sooner (SPEC §20.3).
//! - A billing log ([`BillingEntry`], [`Invoice`]) records what a real provider would
//!   bill for each accepted chat request — cut streams included — at the mock's
//!   [`Prices`].
//! - [`TlsFront`] serves a running mock over HTTPS with a caller's certificate.
//! - Tasks are owned: [`MockUpstream::shutdown`] (or dropping the handle) stops the
//!   accept loop and every connection.
//!
//! The script and profile formats are documented in `docs/MOCK_UPSTREAM.md`.

mod behavior;
mod billing;
mod cache;
mod play;
mod prefill;
mod profile;
mod record;
mod responses_wire;
mod server;
mod signing;
mod text;
mod tls;

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use behavior::{
    Behavior, Fault, ReasoningField, RetryAfter, Script, Stall, ToolCallSpec, UsageMode,
};
pub use billing::{BillingEntry, Invoice, Prices};
pub use cache::{CacheDialect, PrefixCache, PromptCacheSeen};
pub use prefill::{
    continue_from, PrefillDialect, PrefillMode, PrefillOutcome, PrefillPolicy, PrefillSeen,
    THINKING_PREFILL_MESSAGE, TRAILING_WHITESPACE_MESSAGE, VLLM_CONFLICT_MESSAGE,
};
pub use profile::{
    exponential, lognormal, LongTail, PairedDraws, Profile, ProfileError, ProfileFile, ProfileKind,
    Weighted, PROFILE_NAMES,
};
pub use record::{EndKind, ImageSeen, RecordedRequest};
pub use signing::{encrypted_content, thinking_signature};
pub use text::embedding_of;
pub use tls::TlsFront;

use record::Log;
use serde::{Deserialize, Serialize};
use server::{CacheState, DefaultPlay, Shared};

/// How to start a mock.
#[derive(Clone)]
pub struct MockConfig {
    /// Where to listen (default 127.0.0.1:0, an ephemeral loopback port).
    pub addr: SocketAddr,
    /// When set, requests must carry `Authorization: Bearer <key>` (else 401).
    pub require_key: Option<String>,
    /// A fixed default behavior (wins over `profile`).
    pub default: Option<Behavior>,
    /// The profile sampled when no script is queued and no default is set.
    pub profile: Option<Profile>,
    /// The models listed by `GET /v1/models`.
    pub models: Vec<String>,
    /// Dimension of the embedding vectors.
    pub embedding_dim: usize,
    /// Largest request body accepted (bytes).
    pub max_request_bytes: usize,
    /// Keep request bodies in the log (turn off for long benchmarks).
    pub record_bodies: bool,
    /// The log keeps this many most recent requests (a long-running server stays
    /// bounded).
    pub log_capacity: usize,
    /// What the mock does with prefill requests when the behavior played sets no policy
    /// of its own (default: every dialect continued).
    pub prefill: PrefillPolicy,
    /// The simulated provider prefix cache (default: none, off).
    pub prefix_cache: Option<PrefixCache>,
    /// Prices of the billing log's costs (default: none, costs unknown).
    pub prices: Option<Prices>,
    /// The profile is sampled from these draws, keyed by question and shared with other
    /// mocks (default: none, each mock draws from its own RNG in arrival order).
    pub paired: Option<PairedDraws>,
}

impl std::fmt::Debug for MockConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockConfig")
            .field("addr", &self.addr)
            .field(
                "require_key",
                &self
                    .require_key
                    .as_ref()
                    .map(|_| polygw_core::secret::REDACTED),
            )
            .field("default", &self.default.is_some())
            .field("profile", &self.profile.as_ref().map(|p| &p.name))
            .field("models", &self.models)
            .field("embedding_dim", &self.embedding_dim)
            .field("max_request_bytes", &self.max_request_bytes)
            .field("record_bodies", &self.record_bodies)
            .field("log_capacity", &self.log_capacity)
            .field("prefill", &self.prefill)
            .field("prefix_cache", &self.prefix_cache)
            .field("prices", &self.prices)
            .field("paired", &self.paired.is_some())
            .finish()
    }
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            require_key: None,
            default: None,
            profile: None,
            models: vec!["mock-model".into()],
            embedding_dim: 16,
            max_request_bytes: 32 * 1024 * 1024,
            record_bodies: true,
            log_capacity: 100_000,
            prefill: PrefillPolicy::default(),
            prefix_cache: None,
            prices: None,
            paired: None,
        }
    }
}

impl MockConfig {
    /// The default configuration playing `profile`.
    pub fn with_profile(profile: Profile) -> Self {
        MockConfig {
            profile: Some(profile),
            ..MockConfig::default()
        }
    }

    /// This configuration with the server-wide settings of a profile file.
    pub fn with_settings(mut self, settings: MockSettings) -> Self {
        if settings.prefix_cache.is_some() {
            self.prefix_cache = settings.prefix_cache;
        }
        if settings.prices.is_some() {
            self.prices = settings.prices;
        }
        self
    }
}

/// Server-wide settings a profile file may carry besides its behaviors (top-level
/// `prefix_cache` and `prices`; `Profile::from_json` accepts and ignores them).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MockSettings {
    /// The prefix cache to turn on.
    pub prefix_cache: Option<PrefixCache>,
    /// The prices of the billing log.
    pub prices: Option<Prices>,
}

impl MockSettings {
    /// The settings of a JSON profile document (validated).
    pub fn from_profile_json(text: &str) -> Result<MockSettings, ProfileError> {
        let f: ProfileFile = serde_json::from_str(text)
            .map_err(|e| ProfileError(format!("invalid profile: {e}")))?;
        let s = MockSettings {
            prefix_cache: f.prefix_cache,
            prices: f.prices,
        };
        if let Some(c) = &s.prefix_cache {
            c.validate().map_err(ProfileError)?;
        }
        if let Some(p) = &s.prices {
            p.validate().map_err(ProfileError)?;
        }
        Ok(s)
    }

    /// The settings of a command-line `NAME|FILE` (see [`Profile::from_arg`]): none
    /// for a built-in name, else the file's.
    pub fn from_profile_arg(arg: &str) -> Result<MockSettings, ProfileError> {
        if PROFILE_NAMES.contains(&arg) || arg == "long_tail" {
            return Ok(MockSettings::default());
        }
        let text = std::fs::read_to_string(arg)
            .map_err(|e| ProfileError(format!("cannot read {arg}: {e}")))?;
        MockSettings::from_profile_json(&text).map_err(|e| ProfileError(format!("{arg}: {e}")))
    }
}

/// A running mock upstream.
pub struct MockUpstream {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MockUpstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockUpstream")
            .field("addr", &self.addr)
            .field("running", &self.task.is_some())
            .finish()
    }
}

impl MockUpstream {
    /// Binds and starts serving (needs a tokio runtime).
    pub async fn start(cfg: MockConfig) -> io::Result<MockUpstream> {
        let listener = TcpListener::bind(cfg.addr).await?;
        let addr = listener.local_addr()?;
        let default = match (&cfg.default, &cfg.profile) {
            (Some(b), _) => DefaultPlay::Fixed(Box::new(b.clone())),
            (None, Some(p)) => DefaultPlay::Profile {
                rng: p.rng(),
                profile: Box::new(p.clone()),
            },
            (None, None) => DefaultPlay::Fixed(Box::default()),
        };
        let log = Log::new(cfg.log_capacity);
        let mut cache = CacheState::default();
        cache.set(cfg.prefix_cache.clone());
        let shared = Arc::new(Shared {
            prefill: Mutex::new(cfg.prefill.clone()),
            cache: Mutex::new(cache),
            prices: Mutex::new(cfg.prices),
            cfg,
            log,
            scripts: Mutex::new(VecDeque::new()),
            default: Mutex::new(default),
        });
        let (tx, rx) = watch::channel(false);
        let task = tokio::spawn(server::accept_loop(listener, shared.clone(), rx));
        Ok(MockUpstream {
            addr,
            shared,
            shutdown: tx,
            task: Some(task),
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR/v1`, the base URL a source should use.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Queues a script for the next request without one (FIFO, one per request).
    pub fn push_script(&self, script: Script) {
        self.shared
            .scripts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(script);
    }

    /// Queues several scripts.
    pub fn push_scripts(&self, scripts: impl IntoIterator<Item = Script>) {
        let mut q = self
            .shared
            .scripts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        q.extend(scripts);
    }

    /// Scripts still queued.
    pub fn queued_scripts(&self) -> usize {
        self.shared
            .scripts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Plays `behavior` whenever no script is queued (replaces any profile).
    pub fn set_default(&self, behavior: Behavior) {
        *self
            .shared
            .default
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = DefaultPlay::Fixed(Box::new(behavior));
    }

    /// Samples `profile` whenever no script is queued (replaces any default).
    pub fn set_profile(&self, profile: Profile) {
        *self
            .shared
            .default
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = DefaultPlay::Profile {
            rng: profile.rng(),
            profile: Box::new(profile),
        };
    }

    /// Sets the server's prefill policy (for behaviors that set none of their own).
    pub fn set_prefill(&self, policy: PrefillPolicy) {
        *self
            .shared
            .prefill
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = policy;
    }

    /// Turns the simulated prefix cache on with these settings (`None`: off). The
    /// blocks held are kept unless `block_tokens` changes (turning it off and on
    /// again with the same block size keeps them too; see
    /// [`MockUpstream::clear_prefix_cache`]).
    pub fn set_prefix_cache(&self, cache: impl Into<Option<PrefixCache>>) {
        self.shared.cache_state().set(cache.into());
    }

    /// The prefix-cache settings in force (`None`: off).
    pub fn prefix_cache(&self) -> Option<PrefixCache> {
        self.shared.cache_state().cfg.clone()
    }

    /// Forgets every cached block (the settings stay).
    pub fn clear_prefix_cache(&self) {
        self.shared.cache_state().store.clear();
    }

    /// Blocks the prefix cache holds (expired ones may still count until the next
    /// request purges them).
    pub fn prefix_cache_blocks(&self) -> usize {
        self.shared.cache_state().store.len()
    }

    /// Sets the prices of the billing log (`None`: costs unknown); applies to requests
    /// accepted from now on.
    pub fn set_prices(&self, prices: impl Into<Option<Prices>>) {
        *self.shared.prices.lock().unwrap_or_else(|e| e.into_inner()) = prices.into();
    }

    /// The prices in force.
    pub fn prices(&self) -> Option<Prices> {
        self.shared.current_prices()
    }

    /// What a provider would bill: one entry per accepted chat request whose response
    /// has ended, in the order they ended.
    pub fn billing(&self) -> Vec<BillingEntry> {
        self.shared.log.billing()
    }

    /// The billing log with each entry's cost and the total.
    pub fn invoice(&self) -> Invoice {
        Invoice::of(self.billing())
    }

    /// Waits (event-driven) until the billing log has at least `n` entries, or
    /// `timeout` passes; returns it either way.
    pub async fn wait_for_billed(&self, n: usize, timeout: Duration) -> Vec<BillingEntry> {
        self.log().wait_for_billed(n, timeout).await
    }

    /// Forgets the billing log (the request log stays).
    pub fn reset_billing(&self) {
        self.shared.log.clear_billing();
    }

    /// Every request received so far (since the last [`MockUpstream::reset_log`]).
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.log.snapshot()
    }

    /// Forgets the recorded requests (the billing log stays).
    pub fn reset_log(&self) {
        self.shared.log.clear();
    }

    /// Waits (event-driven) until at least `n` recorded requests have ended, or
    /// `timeout` passes; returns the log either way.
    pub async fn wait_for_ended(&self, n: usize, timeout: Duration) -> Vec<RecordedRequest> {
        self.log().wait_for_ended(n, timeout).await
    }

    /// A handle on the request log that stays usable after [`MockUpstream::shutdown`].
    pub fn log(&self) -> RequestLog {
        RequestLog(self.shared.log.clone())
    }

    /// Stops accepting, aborts every connection (their requests are recorded as
    /// [`EndKind::ServerShutdown`]) and waits until nothing of the mock runs.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

/// A cloneable handle on a mock's request log.
#[derive(Debug, Clone)]
pub struct RequestLog(Arc<Log>);

impl RequestLog {
    /// Every request received so far.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.0.snapshot()
    }

    /// Forgets the recorded requests (the billing log stays).
    pub fn reset(&self) {
        self.0.clear();
    }

    /// The billing log (see [`MockUpstream::billing`]).
    pub fn billing(&self) -> Vec<BillingEntry> {
        self.0.billing()
    }

    /// The billing log with costs and total (see [`MockUpstream::invoice`]).
    pub fn invoice(&self) -> Invoice {
        Invoice::of(self.0.billing())
    }

    /// Forgets the billing log.
    pub fn reset_billing(&self) {
        self.0.clear_billing();
    }

    /// Waits (event-driven) until the billing log has at least `n` entries, or
    /// `timeout` passes; returns it either way.
    pub async fn wait_for_billed(&self, n: usize, timeout: Duration) -> Vec<BillingEntry> {
        let mut rx = self.0.subscribe();
        let wait = async {
            loop {
                if self.0.bills_len() >= n {
                    return self.0.billing();
                }
                if rx.changed().await.is_err() {
                    return self.0.billing();
                }
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(v) => v,
            Err(_) => self.0.billing(),
        }
    }

    /// Waits (event-driven) until at least `n` recorded requests have ended, or
    /// `timeout` passes; returns the log either way.
    pub async fn wait_for_ended(&self, n: usize, timeout: Duration) -> Vec<RecordedRequest> {
        let mut rx = self.0.subscribe();
        let wait = async {
            loop {
                let snap = self.0.snapshot();
                if snap.iter().filter(|r| r.ended()).count() >= n {
                    return snap;
                }
                if rx.changed().await.is_err() {
                    return self.0.snapshot();
                }
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(v) => v,
            Err(_) => self.0.snapshot(),
        }
    }
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A mock upstream served by a tokio runtime on a thread of its own (see
/// [`MockUpstream::start_on_own_thread`]); it dereferences to the [`MockUpstream`], and
/// dropping it stops the server and joins the thread.
#[derive(Debug)]
pub struct MockThread {
    mock: Option<MockUpstream>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MockUpstream {
    /// Starts a mock on a thread of its own with its own runtime: what it does then
    /// (allocations, CPU time) stays off the caller's threads — a memory test counts
    /// only the code under test.
    pub fn start_on_own_thread(cfg: MockConfig) -> io::Result<MockThread> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("mock-upstream".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    let started = MockUpstream::start(cfg).await;
                    let ok = started.is_ok();
                    let _ = tx.send(started);
                    if ok {
                        let _ = stopped.await;
                    }
                });
            })?;
        let mock = rx
            .recv()
            .map_err(|_| io::Error::other("the mock's thread ended before it started"))??;
        Ok(MockThread {
            mock: Some(mock),
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl std::ops::Deref for MockThread {
    type Target = MockUpstream;

    fn deref(&self) -> &MockUpstream {
        self.mock.as_ref().expect("present until dropped")
    }
}

impl Drop for MockThread {
    fn drop(&mut self) {
        drop(self.mock.take());
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
