//! polygw's shared governance on Redis (SPEC §4.2, §4.4): a [`RedisLimiter`]
//! (`RateLimiter`) and a [`RedisBreakerStore`] (`BreakerStore`) over one connection
//! manager, for several processes sharing quotas and breaker state.
//!
//! - Every acquire, every settle/release, every breaker admit and record is one atomic Lua
//!   script (EVALSHA; on NOSCRIPT the script is loaded and run again), and time inside
//!   a script is the server's `TIME`, so process clocks never matter.
//! - The scripts mirror core's reference models ([`polygw_core::window`],
//!   [`polygw_core::breaker`]); the contract suite in `polygw-testkit` checks they agree.
//! - Keys: `polygw:{SCOPE}:source:<name>:{win,tok,inflight,breaker}` and
//!   `polygw:{SCOPE}:scope:{win,tok}`. The braces are a Redis Cluster hash tag, so every
//!   key a script touches is in one slot. Every key has a TTL: window keys live one window
//!   past their newest entry, in-flight keys one lease past their longest lease, breaker
//!   hashes [`RedisOptions::breaker_idle_ttl`] past their last deadline.
//! - In-flight slots are leases (`AcquireRequest::lease`): a crashed holder's slot frees
//!   itself. Permit ids are random 128-bit values, unique across processes.
//! - A permit dropped without settlement queues its settlement for a background task
//!   (drop cannot await); [`RateLimiter::flush`] / [`RedisGovernance::shutdown`] wait for
//!   the queue to drain.
//! - Redis unreachable, slow or failing → [`GovernanceError`] (fail closed), within
//!   [`RedisOptions::operation_timeout`]; never an admission.

mod breaker;
mod keys;
mod limiter;

use std::fmt;
use std::time::Duration;

use polygw_core::error::GovernanceError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{FromRedisValue, ScriptInvocation};

pub use breaker::RedisBreakerStore;
pub use limiter::RedisLimiter;

/// The `backend` name in every [`GovernanceError`] of this crate.
pub const BACKEND: &str = "redis";

/// Connection and key settings.
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
    /// Attempts for a queued drop-time settlement before it is given up and counted as
    /// failed (its slot then frees itself when the lease ends). Default 3.
    pub settle_attempts: u32,
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
        }
    }
}

/// The limiter and the breaker store over one connection manager.
#[derive(Debug, Clone)]
pub struct RedisGovernance {
    limiter: RedisLimiter,
    breakers: RedisBreakerStore,
}

impl RedisGovernance {
    /// Connects to `url` (`redis://[user:password@]host:port[/db]`) and fails if the
    /// server cannot be reached within the timeouts. Must run inside a tokio runtime.
    pub async fn connect(url: &str, opts: RedisOptions) -> Result<Self, GovernanceError> {
        let (client, config) = client(url, &opts)?;
        let connect = ConnectionManager::new_with_config(client, config);
        let manager = match tokio::time::timeout(opts.operation_timeout, connect).await {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return Err(redis_error("connect", &e)),
            Err(_) => return Err(timeout_error("connect", opts.operation_timeout)),
        };
        Ok(Self::over(Conn { manager, opts }))
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
        let (client, config) = client(url, &opts)?;
        let manager = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|e| redis_error("connect", &e))?;
        Ok(Self::over(Conn { manager, opts }))
    }

    fn over(conn: Conn) -> Self {
        RedisGovernance {
            limiter: RedisLimiter::new(conn.clone()),
            breakers: RedisBreakerStore::new(conn),
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

    /// Waits until every queued drop-time settlement has been applied (or given up);
    /// call on shutdown. Errors if some could not be applied since the last flush.
    pub async fn shutdown(&self) -> Result<(), GovernanceError> {
        self.limiter.flush_queue().await
    }
}

fn client(
    url: &str,
    opts: &RedisOptions,
) -> Result<(redis::Client, ConnectionManagerConfig), GovernanceError> {
    // The error's category only: its detail may echo the URL and its password.
    let client = redis::Client::open(url)
        .map_err(|e| GovernanceError::new(BACKEND, format!("invalid url ({:?})", e.kind())))?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(opts.connect_timeout))
        .set_response_timeout(Some(opts.response_timeout))
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(20))
        .set_max_delay(Duration::from_millis(200));
    Ok((client, config))
}

fn redis_error(what: &str, e: &redis::RedisError) -> GovernanceError {
    GovernanceError::new(BACKEND, format!("{what}: {e}"))
}

fn timeout_error(what: &str, after: Duration) -> GovernanceError {
    GovernanceError::new(BACKEND, format!("{what}: no answer within {after:?}"))
}

/// One connection manager and the options, shared by the limiter, its permits, the
/// settlement queue and the breaker store.
#[derive(Clone)]
struct Conn {
    manager: ConnectionManager,
    opts: RedisOptions,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The manager's own Debug shows the connection info: keep it out of logs.
        f.debug_struct("Conn")
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl Conn {
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
            Ok(Err(e)) => Err(redis_error(what, &e)),
            Err(_) => Err(timeout_error(what, limit)),
        }
    }

    /// Runs a command within the operation timeout.
    async fn query<T: FromRedisValue>(
        &self,
        what: &str,
        cmd: &redis::Cmd,
    ) -> Result<T, GovernanceError> {
        let mut con = self.manager.clone();
        let limit = self.opts.operation_timeout;
        match tokio::time::timeout(limit, cmd.query_async(&mut con)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(redis_error(what, &e)),
            Err(_) => Err(timeout_error(what, limit)),
        }
    }

    fn window_ms(&self) -> u64 {
        ms(self.opts.window)
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
