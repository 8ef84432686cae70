//! [`RedisLimiter`]: acquire and settle as atomic Lua scripts, and the background queue
//! that applies drop-time settlements.

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::error::{GovernanceError, RefusalReason};
use polygw_core::ports::{AcquireRequest, Admission, Permit, PermitBackend, RateLimiter, Refusal};
use redis::Script;
use tokio::sync::{mpsc, oneshot};

use crate::keys::{self, SourceKeys};
use crate::{exact, ms, Conn, BACKEND};

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/acquire.lua")));
static SETTLE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/settle.lua")));
static WINDOW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/window.lua")));
static IN_FLIGHT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/in_flight.lua")));

/// Redis [`RateLimiter`]: RPM, TPM (reserve then settle) and concurrency per source,
/// scope-wide RPM/TPM in the same script (SPEC §4.2). Cheap to clone; clones share the
/// connection and the settlement queue.
#[derive(Clone)]
pub struct RedisLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Conn,
    queue: mpsc::UnboundedSender<Job>,
}

impl fmt::Debug for RedisLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLimiter")
            .field("conn", &self.inner.conn)
            .finish()
    }
}

/// A settlement (and/or release) of one permit.
#[derive(Debug, Clone)]
struct Settlement {
    keys: SourceKeys,
    id: String,
    tokens: Option<u64>,
    release: bool,
}

/// Work for the background task.
enum Job {
    Settle(Settlement),
    /// Answered once every job queued before it is done: the settlements that failed
    /// since the previous flush, if any.
    Flush(oneshot::Sender<Result<(), GovernanceError>>),
}

impl RedisLimiter {
    /// A limiter over `conn`; spawns its settlement task on the current tokio runtime
    /// (the task ends once the limiter and all its permits are gone and the queue is
    /// drained).
    pub(crate) fn new(conn: Conn) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(drain(conn.clone(), rx));
        RedisLimiter {
            inner: Arc::new(Inner { conn, queue: tx }),
        }
    }

    /// Waits for the settlement queue (see [`RateLimiter::flush`]).
    pub(crate) async fn flush_queue(&self) -> Result<(), GovernanceError> {
        let (tx, rx) = oneshot::channel();
        self.inner
            .queue
            .send(Job::Flush(tx))
            .map_err(|_| GovernanceError::new(BACKEND, "settlement queue task is gone"))?;
        rx.await
            .map_err(|_| GovernanceError::new(BACKEND, "settlement queue task is gone"))?
    }

    /// `(requests, tokens)` in a source's rolling window now (tests, metrics).
    pub async fn source_window(
        &self,
        scope: &str,
        source: &str,
    ) -> Result<(u64, u64), GovernanceError> {
        let k = SourceKeys::new(scope, source)?;
        self.window(&k.win, &k.tok).await
    }

    /// `(requests, tokens)` in a scope's rolling window now (tests, metrics).
    pub async fn scope_window(&self, scope: &str) -> Result<(u64, u64), GovernanceError> {
        let (win, tok) = keys::scope_window(scope)?;
        self.window(&win, &tok).await
    }

    async fn window(&self, win: &str, tok: &str) -> Result<(u64, u64), GovernanceError> {
        let mut inv = WINDOW.prepare_invoke();
        inv.key(win).key(tok).arg(self.inner.conn.window_ms());
        let (requests, tokens): (u64, u64) = self.inner.conn.run("window", &inv).await?;
        Ok((requests, tokens))
    }
}

fn refusal_reason(code: i64) -> Option<RefusalReason> {
    Some(match code {
        1 => RefusalReason::Concurrency,
        2 => RefusalReason::Rpm,
        3 => RefusalReason::Tpm,
        4 => RefusalReason::ScopeRpm,
        5 => RefusalReason::ScopeTpm,
        _ => return None,
    })
}

#[async_trait]
impl RateLimiter for RedisLimiter {
    async fn acquire<'r>(&self, req: &AcquireRequest<'r>) -> Result<Admission, GovernanceError> {
        // 128 random bits: unique across processes without coordination.
        let id = uuid::Uuid::new_v4().simple().to_string();
        self.acquire_as(req, id).await
    }

    async fn in_flight(&self, scope: &str, source: &str) -> Result<u32, GovernanceError> {
        let k = SourceKeys::new(scope, source)?;
        let mut inv = IN_FLIGHT.prepare_invoke();
        inv.key(&k.inflight);
        self.inner.conn.run("in_flight", &inv).await
    }

    /// Waits until every drop-time settlement queued so far has been applied (or given up
    /// after [`crate::RedisOptions::settle_attempts`]); errors if any was given up since
    /// the last flush.
    async fn flush(&self) -> Result<(), GovernanceError> {
        self.flush_queue().await
    }
}

impl RedisLimiter {
    /// Acquire under a given permit id.
    async fn acquire_as(
        &self,
        req: &AcquireRequest<'_>,
        id: String,
    ) -> Result<Admission, GovernanceError> {
        let conn = &self.inner.conn;
        let keys = SourceKeys::new(req.scope, req.source)?;
        let est = exact(req.est_tokens);
        let mut inv = ACQUIRE.prepare_invoke();
        inv.key(&keys.win)
            .key(&keys.tok)
            .key(&keys.inflight)
            .key(&keys.scope_win)
            .key(&keys.scope_tok)
            .arg(&id)
            .arg(req.rpm)
            .arg(exact(req.tpm))
            .arg(req.max_concurrency)
            .arg(req.scope_rpm)
            .arg(exact(req.scope_tpm))
            .arg(est)
            .arg(exact(ms(req.lease)))
            .arg(conn.window_ms())
            .arg(exact(ms(conn.opts.key_margin)));
        // If this future is dropped (caller drop, deadline) once the script may have
        // been sent, the admission would hold its slot until the lease ends: queue an
        // idempotent release of this id behind it on the same connection (a no-op if the
        // script refused or never ran). Disarmed once the reply says what happened.
        let mut pending = PendingAcquire {
            queue: &self.inner.queue,
            settlement: Some(Settlement {
                keys: keys.clone(),
                id: id.clone(),
                tokens: Some(0),
                release: true,
            }),
        };
        let reply: Vec<i64> = conn.run("acquire", &inv).await?;
        pending.settlement = None;
        match reply[..] {
            [1, _] => Ok(Admission::Admitted(Permit::new(
                est,
                Box::new(RedisPermit {
                    conn: conn.clone(),
                    queue: self.inner.queue.clone(),
                    keys,
                    id,
                }),
            ))),
            [0, code, hint] => {
                let reason = refusal_reason(code).ok_or_else(|| unexpected(&reply))?;
                Ok(Admission::Refused(Refusal {
                    reason,
                    retry_after: u64::try_from(hint).ok().map(Duration::from_millis),
                }))
            }
            _ => Err(unexpected(&reply)),
        }
    }
}

/// Releases an admission whose reply never arrived (see `acquire_as`). An error reply
/// (a timeout, say) leaves it armed too: the script may have run on the server.
struct PendingAcquire<'a> {
    queue: &'a mpsc::UnboundedSender<Job>,
    settlement: Option<Settlement>,
}

impl Drop for PendingAcquire<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.settlement.take() {
            let _ = self.queue.send(Job::Settle(s));
        }
    }
}

fn unexpected(reply: &[i64]) -> GovernanceError {
    GovernanceError::new(BACKEND, format!("unexpected script reply {reply:?}"))
}

async fn settle(conn: &Conn, s: &Settlement) -> Result<(), GovernanceError> {
    let mut inv = SETTLE.prepare_invoke();
    inv.key(&s.keys.win)
        .key(&s.keys.tok)
        .key(&s.keys.inflight)
        .key(&s.keys.scope_tok)
        .arg(&s.id)
        .arg(s.tokens.map(|t| exact(t).to_string()).unwrap_or_default())
        .arg(if s.release { "1" } else { "0" })
        .arg(conn.window_ms());
    let _: i64 = conn.run("settle", &inv).await?;
    Ok(())
}

/// The background task: applies queued settlements in order, retrying each a few times.
/// While the server is failing (a settlement was given up less than one operation timeout
/// ago) queued settlements are given up at once, so an outage cannot pile up work: a
/// settlement that never lands only means the slot frees itself at its lease end and the
/// reservation stays as reserved.
async fn drain(conn: Conn, mut rx: mpsc::UnboundedReceiver<Job>) {
    let mut failed = 0u64;
    let mut last: Option<GovernanceError> = None;
    let mut failing_since: Option<tokio::time::Instant> = None;
    while let Some(job) = rx.recv().await {
        match job {
            Job::Settle(s) => {
                if failing_since.is_some_and(|t| t.elapsed() < conn.opts.operation_timeout) {
                    failed += 1;
                    continue;
                }
                let attempts = conn.opts.settle_attempts.max(1);
                for attempt in 1..=attempts {
                    match settle(&conn, &s).await {
                        Ok(()) => {
                            failing_since = None;
                            break;
                        }
                        Err(e) if attempt == attempts => {
                            tracing::warn!(
                                error = %e,
                                "drop-time settlement given up; the slot frees itself when its lease ends"
                            );
                            failed += 1;
                            last = Some(e);
                            failing_since = Some(tokio::time::Instant::now());
                        }
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(50 << attempt.min(5))).await
                        }
                    }
                }
            }
            Job::Flush(reply) => {
                let result = match last.take() {
                    None if failed == 0 => Ok(()),
                    None => Err(GovernanceError::new(
                        BACKEND,
                        format!("{failed} drop-time settlement(s) could not be applied"),
                    )),
                    Some(e) => Err(GovernanceError::new(
                        BACKEND,
                        format!(
                            "{failed} drop-time settlement(s) could not be applied; last: {}",
                            e.message
                        ),
                    )),
                };
                failed = 0;
                // The flusher may have given up waiting; nothing to do then.
                let _ = reply.send(result);
            }
        }
    }
}

/// The backend of a Redis permit. Idempotency is server-side (first settlement wins,
/// release is a set removal), so a retried or duplicated script changes nothing.
struct RedisPermit {
    conn: Conn,
    queue: mpsc::UnboundedSender<Job>,
    keys: SourceKeys,
    id: String,
}

impl fmt::Debug for RedisPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPermit")
            .field("source", &self.keys.win)
            .field("id", &self.id)
            .finish()
    }
}

impl RedisPermit {
    fn settlement(&self, tokens: Option<u64>, release: bool) -> Settlement {
        Settlement {
            keys: self.keys.clone(),
            id: self.id.clone(),
            tokens,
            release,
        }
    }
}

#[async_trait]
impl PermitBackend for RedisPermit {
    async fn settle(&self, tokens: u64) -> Result<(), GovernanceError> {
        settle(&self.conn, &self.settlement(Some(tokens), false)).await
    }

    async fn release(&self) -> Result<(), GovernanceError> {
        settle(&self.conn, &self.settlement(None, true)).await
    }

    async fn settle_and_release(&self, tokens: u64) -> Result<(), GovernanceError> {
        settle(&self.conn, &self.settlement(Some(tokens), true)).await
    }

    fn settle_on_drop(&self, tokens: Option<u64>) {
        // Never blocks. If the queue task is gone (runtime shut down), the lease frees the
        // slot and the reservation stays as reserved.
        let _ = self.queue.send(Job::Settle(self.settlement(tokens, true)));
    }
}

#[cfg(test)]
mod tests {
    //! Server-side idempotency of settlements (a retried or duplicated script must change
    //! nothing), which the `Permit` type's own idempotency hides from the contract suite.

    use super::*;
    use crate::{RedisGovernance, RedisOptions};
    use polygw_testkit::services::{redis_url, unique_name};

    fn req<'a>(scope: &'a str) -> AcquireRequest<'a> {
        AcquireRequest {
            scope,
            source: "a",
            rpm: 0,
            tpm: 1000,
            max_concurrency: 0,
            scope_rpm: 0,
            scope_tpm: 1000,
            est_tokens: 400,
            lease: Duration::from_secs(60),
        }
    }

    async fn admitted(l: &RedisLimiter, r: &AcquireRequest<'_>, id: &str) {
        match l.acquire_as(r, id.to_string()).await.unwrap() {
            Admission::Admitted(p) => std::mem::forget(p),
            Admission::Refused(f) => panic!("{f:?}"),
        }
    }

    fn settlement(scope: &str, id: &str, tokens: Option<u64>, release: bool) -> Settlement {
        Settlement {
            keys: SourceKeys::new(scope, "a").unwrap(),
            id: id.to_string(),
            tokens,
            release,
        }
    }

    #[tokio::test]
    async fn first_settlement_wins_and_release_is_idempotent() {
        let Some(url) = redis_url() else { return };
        let g = RedisGovernance::connect(&url, RedisOptions::default())
            .await
            .unwrap();
        let l = g.limiter();
        let sc = unique_name("IDEM");
        let r = req(&sc);
        admitted(&l, &r, "p1").await;
        admitted(&l, &r, "p2").await;
        let conn = &l.inner.conn;
        settle(conn, &settlement(&sc, "p1", Some(100), false))
            .await
            .unwrap();
        settle(conn, &settlement(&sc, "p1", Some(900), true))
            .await
            .unwrap();
        settle(conn, &settlement(&sc, "p1", Some(100), true))
            .await
            .unwrap();
        settle(conn, &settlement(&sc, "p1", None, true))
            .await
            .unwrap();
        assert_eq!(l.source_window(&sc, "a").await.unwrap(), (2, 500));
        assert_eq!(l.scope_window(&sc).await.unwrap(), (2, 500));
        assert_eq!(
            l.in_flight(&sc, "a").await.unwrap(),
            1,
            "p2 still holds its slot"
        );
        // an unknown permit changes nothing
        settle(conn, &settlement(&sc, "nope", Some(7), true))
            .await
            .unwrap();
        assert_eq!(l.source_window(&sc, "a").await.unwrap(), (2, 500));
        assert_eq!(l.in_flight(&sc, "a").await.unwrap(), 1);
    }

    #[tokio::test]
    async fn settlement_after_the_window_changes_nothing() {
        let Some(url) = redis_url() else { return };
        let opts = RedisOptions {
            window: Duration::from_millis(300),
            ..RedisOptions::default()
        };
        let g = RedisGovernance::connect(&url, opts).await.unwrap();
        let l = g.limiter();
        let sc = unique_name("LATE");
        admitted(&l, &req(&sc), "late").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let conn = &l.inner.conn;
        settle(conn, &settlement(&sc, "late", Some(999), true))
            .await
            .unwrap();
        let k = SourceKeys::new(&sc, "a").unwrap();
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(&k.tok);
        let fields: std::collections::HashMap<String, String> =
            conn.query("hgetall", &cmd).await.unwrap();
        assert_eq!(fields.get("late").map(String::as_str), Some("400"));
        assert!(
            !fields.contains_key("s:late"),
            "no settled mark: {fields:?}"
        );
        assert_eq!(l.source_window(&sc, "a").await.unwrap(), (0, 0));
        assert_eq!(
            l.in_flight(&sc, "a").await.unwrap(),
            0,
            "the release still applies"
        );
        // the next acquire prunes the stale entry and its tokens
        admitted(&l, &req(&sc), "next").await;
        let fields: std::collections::HashMap<String, String> =
            conn.query("hgetall", &cmd).await.unwrap();
        assert_eq!(fields.get("sum").map(String::as_str), Some("400"));
        assert!(!fields.contains_key("late"));
    }
}
