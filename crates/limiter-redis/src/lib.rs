//! polygw's shared governance on Redis (SPEC §4.2, §4.4, §14): a [`RedisLimiter`]
//! (`RateLimiter`) and a [`RedisBreakerStore`] (`BreakerStore`) over one connection, for
//! several processes sharing quotas and breaker state.
//!
//! - Every acquire, every settle/release, every breaker admit and record is one atomic Lua
//!   script (EVALSHA; on NOSCRIPT the script is loaded and run again), and time inside
//!   a script is the server's `TIME`, so process clocks never matter.
//! - The scripts mirror core's reference models ([`polygw_core::window`],
//!   [`polygw_core::breaker`]); the contract suite in `polygw-testkit` checks they agree.
//! - Keys: `polygw:{SCOPE}:source:<name>:{win,inflight,breaker}` and
//!   `polygw:{SCOPE}:scope:{win,ledger,totals}` (see `keys.rs`; the ledger holds the
//!   token entries of the scope and all its sources). The braces are a Redis Cluster
//!   hash tag: every key a script touches is in one slot, and every script declares its
//!   keys, so a cluster routes it to that slot's node. Every key has a TTL: the limiter's
//!   keys of a scope (or of a source) share a deadline covering the longest lease + the
//!   window + [`RedisOptions::key_margin`], moved a margin further when it falls short,
//!   so none outlives what it remembers by more than a lease and two margins.
//! - Prompt-cache affinity (SPEC §20.2, [`RedisAffinityStore`]): `polygw:{SCOPE}:aff:<digest>`,
//!   one string per session naming the source that last served it, expiring (`PX`).
//! - Client keys (SPEC §21.1, [`RateLimiter::acquire_key`](polygw_core::ports::RateLimiter::acquire_key)):
//!   `polygw:key:{K}:{win,inflight,ledger,state}` under the key id's own hash tag, one
//!   script per admission, finish, heartbeat and reading (`lua/key_*.lua`, mirroring
//!   [`polygw_core::key_quota::KeyQuotas`]). The window keys expire like a scope's; the
//!   state and in-flight keys hold the day's and the month's spend and expire a margin
//!   after the month's end (or the latest lease, if later).
//! - Connections (`REDIS__URL`): `redis://` and `rediss://` (TLS through rustls with the
//!   ring provider; a private CA with [`RedisOptions::ca_file`]) on one multiplexed
//!   connection that reconnects by itself, and a Redis Cluster
//!   (`redis+cluster://h1:p1,h2:p2,…`, `rediss+cluster://…`) through the redis crate's
//!   cluster connection, which follows the slot map (MOVED/ASK).
//! - Leases (SPEC §14.4): in-flight slots, reservations and half-open probes are leases
//!   (`AcquireRequest::lease`). A background heartbeat, started on the first lease and
//!   stopped when the governance is dropped or shut down, renews every live lease of the
//!   process each third of the shortest lease — one script per scope per beat — so a
//!   long stream keeps its slot and a crashed process's slots free within one lease.
//!   Permit ids are random 128-bit values, unique across processes.
//! - Background queue (SPEC §14.5): settlements and releases that cannot be awaited (a
//!   dropped permit, a hedge loser, an acquire or probe admission whose answer was lost)
//!   are queued and applied in order, each retried with backoff while Redis is failing —
//!   never discarded while the governance lives. The queue is bounded
//!   ([`RedisOptions::queue_capacity`]); what does not fit is counted
//!   ([`RedisLimiter::settlements_dropped`](polygw_core::ports::RateLimiter::settlements_dropped))
//!   and logged, and its slot ends with its lease. [`RateLimiter::flush`](polygw_core::ports::RateLimiter::flush)
//!   and [`RedisGovernance::shutdown`] wait for the queue (bounded by
//!   [`RedisOptions::flush_timeout`]).
//! - Redis unreachable, slow or failing → [`GovernanceError`] (fail closed), within
//!   [`RedisOptions::operation_timeout`]; never an admission. Errors name the target with
//!   its password redacted.

mod affinity;
mod background;
mod breaker;
mod client_keys;
mod keys;
mod latency;
mod limiter;

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use polygw_core::error::GovernanceError;
use polygw_core::secret::redact_url;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue, Pipeline, RedisFuture, ScriptInvocation, Value};

pub use affinity::RedisAffinityStore;
pub use breaker::RedisBreakerStore;
pub use latency::RedisLatencyStore;
pub use limiter::RedisLimiter;

use background::Background;

/// The `backend` name in every [`GovernanceError`] of this crate.
pub const BACKEND: &str = "redis";

/// Connection, key and background settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisOptions {
    /// Bound on establishing a connection (default 1 s).
    pub connect_timeout: Duration,
    /// Bound on one command's response (default 1 s).
    pub response_timeout: Duration,
    /// Bound on one governance operation, reconnection included (default 2 s): past it
    /// the operation fails with a [`GovernanceError`].
    pub operation_timeout: Duration,
    /// Length of the rolling window. Always 60 s in use (SPEC §4.2); **tests only**
    /// shorten it, since Redis `TIME` cannot be faked.
    pub window: Duration,
    /// How long keys outlive the last entry or lease they hold (default 10 s).
    pub key_margin: Duration,
    /// How long a breaker hash is kept after its last deadline has passed (default 24 h):
    /// a source idle that long starts again closed, with no failures counted.
    pub breaker_idle_ttl: Duration,
    /// Attempts for a queued settlement once the governance is gone (dropped while Redis
    /// fails): after them it is given up, counted and logged. While the governance lives,
    /// queued work is retried until it lands. Default 3.
    pub settle_attempts: u32,
    /// Most queued settlements, releases and probe releases (default 10 000); beyond it
    /// new ones are counted as dropped and their slots end with their leases.
    pub queue_capacity: usize,
    /// Longest backoff between two tries of a queued settlement (default 2 s; the first
    /// retry comes after 50 ms, doubling, with jitter).
    pub max_backoff: Duration,
    /// How long `flush` / `shutdown` wait for the queue (default 5 s).
    pub flush_timeout: Duration,
    /// A PEM file of the CA certificates that TLS connections (`rediss://`) trust instead
    /// of the system's roots (`{S}__TLS__CA_FILE`).
    pub ca_file: Option<PathBuf>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
            operation_timeout: Duration::from_secs(2),
            window: Duration::from_millis(polygw_core::window::WINDOW_MS),
            key_margin: Duration::from_secs(10),
            breaker_idle_ttl: Duration::from_secs(24 * 3600),
            settle_attempts: 3,
            queue_capacity: 10_000,
            max_backoff: Duration::from_secs(2),
            flush_timeout: Duration::from_secs(5),
            ca_file: None,
        }
    }
}

/// The limiter and the breaker store over one connection, one background queue and one
/// heartbeat.
#[derive(Debug, Clone)]
pub struct RedisGovernance {
    limiter: RedisLimiter,
    breakers: RedisBreakerStore,
}

impl RedisGovernance {
    /// Connects to `url` (see the crate doc for the forms) and fails if the server cannot
    /// be reached within the timeouts. Must run inside a tokio runtime.
    pub async fn connect(url: &str, opts: RedisOptions) -> Result<Self, GovernanceError> {
        let target = Target::parse(url, &opts)?;
        let connect = target.connect();
        let manager = match tokio::time::timeout(opts.operation_timeout, connect).await {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return Err(target.error("connect", &e)),
            Err(_) => {
                return Err(timeout_error(
                    &format!("connect to {}", target.shown),
                    opts.operation_timeout,
                ))
            }
        };
        Ok(Self::over(Conn::new(manager, opts, target.shown)))
    }

    /// Like [`RedisGovernance::connect`] but connects on first use: building never fails
    /// for an unreachable server (operations do, fail closed). Must be called inside a
    /// tokio runtime.
    pub fn connect_lazy(url: &str, opts: RedisOptions) -> Result<Self, GovernanceError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(GovernanceError::new(
                BACKEND,
                "connect_lazy needs a tokio runtime",
            ));
        }
        let target = Target::parse(url, &opts)?;
        let manager = target
            .connect_lazy()
            .map_err(|e| target.error("connect", &e))?;
        Ok(Self::over(Conn::new(manager, opts, target.shown)))
    }

    fn over(conn: Conn) -> Self {
        let bg = Background::start(conn);
        let owner = Arc::new(Owner(bg.clone()));
        RedisGovernance {
            limiter: RedisLimiter::new(bg.clone(), owner.clone()),
            breakers: RedisBreakerStore::new(bg, owner),
        }
    }

    /// The rate limiter (cheap to clone; clones share the connection and the queue).
    pub fn limiter(&self) -> RedisLimiter {
        self.limiter.clone()
    }

    /// The breaker store (cheap to clone).
    pub fn breakers(&self) -> RedisBreakerStore {
        self.breakers.clone()
    }

    /// The shared latency distributions (SPEC §19.2), on the same connection.
    pub fn latency_store(&self) -> RedisLatencyStore {
        RedisLatencyStore::new(self.limiter.background().conn().clone())
    }

    /// The shared prompt-cache affinity keys (SPEC §20.2), on the same connection.
    pub fn affinity_store(&self) -> RedisAffinityStore {
        RedisAffinityStore::new(self.limiter.background().conn().clone())
    }

    /// Stops renewing this governance's leases (what a crashed process looks like; the
    /// heartbeat also stops when every handle is dropped). Their slots, reservations and
    /// probes end with their leases unless released first.
    pub fn stop_heartbeat(&self) {
        self.limiter.background().stop_heartbeat();
    }

    /// Waits until every queued settlement has been applied (bounded by
    /// [`RedisOptions::flush_timeout`]), then stops the heartbeat; call on shutdown.
    /// Errors if some could not be applied in time or were dropped since the last flush.
    pub async fn shutdown(&self) -> Result<(), GovernanceError> {
        let r = self.limiter.background().flush().await;
        self.stop_heartbeat();
        r
    }
}

/// Held by every limiter and breaker store handle (not by permits or the background
/// tasks): when the last handle goes, the heartbeat stops.
struct Owner(Arc<Background>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.stop_heartbeat();
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Owner")
    }
}

/// A parsed `REDIS__URL`: single server or cluster seeds, and how to show it.
struct Target {
    nodes: Vec<String>,
    cluster: bool,
    /// The URL with its password redacted: what errors name.
    shown: String,
    tls: Option<redis::TlsCertificates>,
    opts: RedisOptions,
}

impl Target {
    fn parse(url: &str, opts: &RedisOptions) -> Result<Target, GovernanceError> {
        let shown = redact_url(url);
        let (nodes, cluster) = polygw_core::config::guards::redis_nodes(url).ok_or_else(|| {
            GovernanceError::new(
                BACKEND,
                format!(
                    "invalid url {shown}: expected {}",
                    polygw_core::config::guards::REDIS_URL_FORMS
                ),
            )
        })?;
        let tls_url = nodes.iter().any(|n| n.starts_with("rediss://"));
        let tls = match &opts.ca_file {
            Some(path) if tls_url => {
                let pem = std::fs::read(path).map_err(|e| {
                    GovernanceError::new(
                        BACKEND,
                        format!(
                            "cannot read the CA file {} for {shown}: {e}",
                            path.display()
                        ),
                    )
                })?;
                Some(redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                })
            }
            _ => None,
        };
        if tls_url {
            install_crypto_provider();
        }
        Ok(Target {
            nodes,
            cluster,
            shown,
            tls,
            opts: opts.clone(),
        })
    }

    fn error(&self, what: &str, e: &redis::RedisError) -> GovernanceError {
        // The error's text may echo the URL it was built from: show the redacted one, and
        // of the error only what cannot carry the password.
        let detail = if matches!(e.kind(), redis::ErrorKind::InvalidClientConfig) {
            format!("invalid configuration ({:?})", e.kind())
        } else {
            e.to_string()
        };
        GovernanceError::new(BACKEND, format!("{what} to {}: {detail}", self.shown))
    }

    fn single_client(&self) -> redis::RedisResult<redis::Client> {
        let node = self.nodes[0].as_str();
        match &self.tls {
            Some(certs) => redis::Client::build_with_tls(node, certs.clone()),
            None => redis::Client::open(node),
        }
    }

    fn cluster_client(&self) -> redis::RedisResult<redis::cluster::ClusterClient> {
        let mut b = ClusterClientBuilder::new(self.nodes.clone())
            .connection_timeout(self.opts.connect_timeout)
            .response_timeout(self.opts.response_timeout)
            .retries(1)
            .min_retry_wait(20)
            .max_retry_wait(200);
        if let Some(certs) = &self.tls {
            b = b.certs(certs.clone());
        }
        b.build()
    }

    fn manager_config(&self) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.opts.connect_timeout))
            .set_response_timeout(Some(self.opts.response_timeout))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(200))
    }

    fn cluster_config(&self) -> redis::cluster::ClusterConfig {
        redis::cluster::ClusterConfig::new()
            .set_connection_timeout(self.opts.connect_timeout)
            .set_response_timeout(self.opts.response_timeout)
    }

    async fn connect(&self) -> redis::RedisResult<Manager> {
        if self.cluster {
            let c = self.cluster_client()?;
            Ok(Manager::Cluster(
                c.get_async_connection_with_config(self.cluster_config())
                    .await?,
            ))
        } else {
            let c = self.single_client()?;
            Ok(Manager::Single(
                ConnectionManager::new_with_config(c, self.manager_config()).await?,
            ))
        }
    }

    fn connect_lazy(&self) -> redis::RedisResult<Manager> {
        if self.cluster {
            let c = self.cluster_client()?;
            Ok(Manager::Cluster(
                c.get_pending_async_connection_with_config(self.cluster_config()),
            ))
        } else {
            let c = self.single_client()?;
            Ok(Manager::Single(ConnectionManager::new_lazy_with_config(
                c,
                self.manager_config(),
            )?))
        }
    }
}

/// Makes ring the process's rustls provider if none is installed yet (the redis crate's
/// TLS config asks rustls for the process default; this build has ring only).
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn timeout_error(what: &str, after: Duration) -> GovernanceError {
    GovernanceError::new(BACKEND, format!("{what}: no answer within {after:?}"))
}

/// A single-server connection manager or a cluster connection.
#[derive(Clone)]
enum Manager {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Manager {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Manager::Single(m) => m.req_packed_command(cmd),
            Manager::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Manager::Single(m) => m.req_packed_commands(cmd, offset, count),
            Manager::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Manager::Single(m) => m.get_db(),
            Manager::Cluster(c) => c.get_db(),
        }
    }
}

/// One connection and the options, shared by the limiter, its permits, the background
/// tasks and the breaker store.
#[derive(Clone)]
struct Conn {
    manager: Manager,
    opts: RedisOptions,
    /// The URL, password redacted (errors).
    shown: Arc<str>,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The manager's own Debug shows the connection info: keep it out of logs.
        f.debug_struct("Conn")
            .field("target", &self.shown)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl Conn {
    fn new(manager: Manager, opts: RedisOptions, shown: String) -> Self {
        Conn {
            manager,
            opts,
            shown: shown.into(),
        }
    }

    fn error(&self, what: &str, e: &redis::RedisError) -> GovernanceError {
        GovernanceError::new(BACKEND, format!("{what} on {}: {e}", self.shown))
    }

    /// Runs a script invocation within the operation timeout.
    async fn run<T: FromRedisValue>(
        &self,
        what: &str,
        inv: &ScriptInvocation<'_>,
    ) -> Result<T, GovernanceError> {
        let mut con = self.manager.clone();
        let limit = self.opts.operation_timeout;
        match tokio::time::timeout(limit, inv.invoke_async(&mut con)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.error(what, &e)),
            Err(_) => Err(timeout_error(&format!("{what} on {}", self.shown), limit)),
        }
    }

    /// Runs a command within the operation timeout.
    async fn query<T: FromRedisValue>(&self, what: &str, cmd: &Cmd) -> Result<T, GovernanceError> {
        let mut con = self.manager.clone();
        let limit = self.opts.operation_timeout;
        match tokio::time::timeout(limit, cmd.query_async(&mut con)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.error(what, &e)),
            Err(_) => Err(timeout_error(&format!("{what} on {}", self.shown), limit)),
        }
    }

    /// Runs a pipeline within the operation timeout (its non-ignored replies).
    async fn query_pipe<T: FromRedisValue>(
        &self,
        what: &str,
        pipe: &Pipeline,
    ) -> Result<T, GovernanceError> {
        let mut con = self.manager.clone();
        let limit = self.opts.operation_timeout;
        match tokio::time::timeout(limit, pipe.query_async(&mut con)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.error(what, &e)),
            Err(_) => Err(timeout_error(&format!("{what} on {}", self.shown), limit)),
        }
    }

    fn window_ms(&self) -> u64 {
        ms(self.opts.window)
    }

    fn margin_ms(&self) -> u64 {
        exact(ms(self.opts.key_margin))
    }
}

/// Whole milliseconds, saturating.
fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Largest integer Lua (IEEE double) numbers hold exactly: token figures and times are
/// clamped to it.
const MAX_EXACT: u64 = (1 << 53) - 1;

fn exact(n: u64) -> u64 {
    n.min(MAX_EXACT)
}
