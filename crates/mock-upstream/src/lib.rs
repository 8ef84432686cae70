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
//! - [`TlsFront`] serves a running mock over HTTPS with a caller's certificate.
//! - Tasks are owned: [`MockUpstream::shutdown`] (or dropping the handle) stops the
//!   accept loop and every connection.
//!
//! The script and profile formats are documented in `docs/MOCK_UPSTREAM.md`.

mod behavior;
mod play;
mod prefill;
mod profile;
mod record;
mod server;
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
pub use prefill::{
    continue_from, PrefillDialect, PrefillMode, PrefillOutcome, PrefillPolicy, PrefillSeen,
    VLLM_CONFLICT_MESSAGE,
};
pub use profile::{
    exponential, lognormal, LongTail, Profile, ProfileError, ProfileFile, ProfileKind, Weighted,
    PROFILE_NAMES,
};
pub use record::{EndKind, ImageSeen, RecordedRequest};
pub use text::embedding_of;
pub use tls::TlsFront;

use record::Log;
use server::{DefaultPlay, Shared};

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
        let shared = Arc::new(Shared {
            prefill: Mutex::new(cfg.prefill.clone()),
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

    /// Every request received so far (since the last [`MockUpstream::reset_log`]).
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.log.snapshot()
    }

    /// Forgets the recorded requests.
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

    /// Forgets the recorded requests.
    pub fn reset(&self) {
        self.0.clear();
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
