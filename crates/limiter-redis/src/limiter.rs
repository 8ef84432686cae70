//! [`RedisLimiter`]: acquire and settle as atomic Lua scripts; permits whose leases the
//! heartbeat renews and whose drop-time settlement goes through the background queue.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::error::{GovernanceError, RefusalReason};
use polygw_core::ports::{
    AcquireRequest, Admission, KeyAcquire, KeyAdmission, KeyUsage, Permit, PermitBackend,
    RateLimiter, Refusal,
};
use redis::Script;

use crate::background::{settle, Background, Lease, LeaseKind, Settlement, Work};
use crate::keys::{self, SourceKeys};
use crate::{exact, ms, Owner, BACKEND};

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/acquire.lua")));
static WINDOW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/window.lua")));
static IN_FLIGHT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/in_flight.lua")));

/// Redis [`RateLimiter`]: RPM, TPM (reserve until settled, then one window from the
/// settlement) and concurrency per source, scope-wide RPM/TPM in the same script (SPEC
/// §4.2, §14.3). Cheap to clone; clones share the connection, the queue and the heartbeat.
#[derive(Clone)]
pub struct RedisLimiter {
    bg: Arc<Background>,
    _owner: Arc<Owner>,
}

impl fmt::Debug for RedisLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLimiter")
            .field("conn", self.bg.conn())
            .finish()
    }
}

impl RedisLimiter {
    pub(crate) fn new(bg: Arc<Background>, owner: Arc<Owner>) -> Self {
        RedisLimiter { bg, _owner: owner }
    }

    pub(crate) fn background(&self) -> &Arc<Background> {
        &self.bg
    }

    /// `(requests, tokens)` in a source's rolling window now (tests, metrics).
    pub async fn source_window(
        &self,
        scope: &str,
        source: &str,
    ) -> Result<(u64, u64), GovernanceError> {
        let k = SourceKeys::new(scope, source)?;
        self.window([&k.win, &k.ledger], source).await
    }

    /// `(requests, tokens)` in a scope's rolling window now (tests, metrics).
    pub async fn scope_window(&self, scope: &str) -> Result<(u64, u64), GovernanceError> {
        let [win, ledger, _] = keys::scope_keys(scope)?;
        self.window([&win, &ledger], "").await
    }

    /// `source` empty: the whole scope.
    async fn window(
        &self,
        keys: [&String; 2],
        source: &str,
    ) -> Result<(u64, u64), GovernanceError> {
        let conn = self.bg.conn();
        let mut inv = WINDOW.prepare_invoke();
        for k in keys {
            inv.key(k);
        }
        inv.arg(conn.window_ms()).arg(source);
        let (requests, tokens): (u64, u64) = conn.run("window", &inv).await?;
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
        self.bg.conn().run("in_flight", &inv).await
    }

    async fn acquire_key<'r>(&self, req: &KeyAcquire<'r>) -> Result<KeyAdmission, GovernanceError> {
        // A top-up's id starts with '+' (key_lib.lua: money only, no slot).
        let id = uuid::Uuid::new_v4().simple().to_string();
        let id = if req.top_up { format!("+{id}") } else { id };
        crate::client_keys::acquire(&self.bg, req, id).await
    }

    async fn key_usage(&self, key_id: &str) -> Result<KeyUsage, GovernanceError> {
        crate::client_keys::usage(self.bg.conn(), key_id).await
    }

    /// One `EXISTS` on the scope's totals key: a command routed like the scope's
    /// scripts (on a cluster, to the node that holds the scope's slot), so it fails
    /// when that node is down or the cluster refuses commands (`CLUSTERDOWN`), not only
    /// when no node answers a `PING`. Bounded by the operation timeout.
    async fn ping(&self, scope: &str) -> Result<(), GovernanceError> {
        let [_, _, totals] = keys::scope_keys(scope)?;
        let _: i64 = self
            .bg
            .conn()
            .query("ping", redis::cmd("EXISTS").arg(&totals))
            .await?;
        Ok(())
    }

    /// Waits until every settlement queued so far has been applied (bounded by
    /// [`crate::RedisOptions::flush_timeout`]); errors if some is still waiting, or some
    /// was dropped (queue full) since the last flush.
    async fn flush(&self) -> Result<(), GovernanceError> {
        self.bg.flush().await
    }

    fn settlements_dropped(&self) -> u64 {
        self.bg.dropped()
    }
}

impl RedisLimiter {
    /// Acquire under a given permit id.
    pub(crate) async fn acquire_as(
        &self,
        req: &AcquireRequest<'_>,
        id: String,
    ) -> Result<Admission, GovernanceError> {
        let conn = self.bg.conn();
        let keys = SourceKeys::new(req.scope, req.source)?;
        let est = exact(req.est_tokens);
        let lease_ms = exact(ms(req.lease)).max(1);
        let mut inv = ACQUIRE.prepare_invoke();
        inv.key(&keys.win)
            .key(&keys.inflight)
            .key(&keys.scope_win)
            .key(&keys.ledger)
            .key(&keys.totals)
            .arg(&id)
            .arg(req.rpm)
            .arg(exact(req.tpm))
            .arg(req.max_concurrency)
            .arg(req.scope_rpm)
            .arg(exact(req.scope_tpm))
            .arg(est)
            .arg(lease_ms)
            .arg(conn.window_ms())
            .arg(conn.margin_ms())
            .arg(&keys.source);
        // If this future is dropped (caller drop, deadline) once the script may have
        // been sent, the admission would hold its slot until the lease ends: queue an
        // idempotent release of this id (a no-op if the script refused or never ran).
        // Disarmed once the reply says what happened.
        let mut pending = PendingAcquire {
            bg: &self.bg,
            settlement: Some(Settlement {
                keys: keys.clone(),
                id: id.clone(),
                est,
                tokens: Some(0),
                release: true,
            }),
        };
        let reply: Vec<i64> = conn.run("acquire", &inv).await?;
        pending.settlement = None;
        match reply[..] {
            [1, _] => {
                let lease = self.bg.register(Lease {
                    scope: req.scope.to_string(),
                    source: req.source.to_string(),
                    kind: LeaseKind::Permit {
                        id: id.clone(),
                        est,
                    },
                    lease_ms,
                });
                Ok(Admission::Admitted(Permit::new(
                    est,
                    Box::new(RedisPermit {
                        bg: self.bg.clone(),
                        keys,
                        id,
                        est,
                        lease: Mutex::new(lease),
                        settled: AtomicBool::new(false),
                        released: AtomicBool::new(false),
                    }),
                )))
            }
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
    bg: &'a Background,
    settlement: Option<Settlement>,
}

impl Drop for PendingAcquire<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.settlement.take() {
            self.bg.enqueue(Work::Settle(Box::new(s)));
        }
    }
}

fn unexpected(reply: &[i64]) -> GovernanceError {
    GovernanceError::new(BACKEND, format!("unexpected script reply {reply:?}"))
}

/// The backend of a Redis permit. Idempotency is server-side (first settlement wins,
/// release is a set removal), so a retried or duplicated script changes nothing. Its
/// lease is renewed by the heartbeat until it is settled and released (or dropped).
struct RedisPermit {
    bg: Arc<Background>,
    keys: SourceKeys,
    id: String,
    /// The reservation (part of its ledger entry's name).
    est: u64,
    lease: Mutex<Option<u64>>,
    settled: AtomicBool,
    released: AtomicBool,
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
            est: self.est,
            tokens,
            release,
        }
    }

    fn stop_renewing(&self) {
        let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.bg.deregister(lease);
    }

    /// Marks what landed; a permit settled and released needs no more renewal.
    fn landed(&self, settled: bool, released: bool) {
        if settled {
            self.settled.store(true, Ordering::Release);
        }
        if released {
            self.released.store(true, Ordering::Release);
        }
        if self.settled.load(Ordering::Acquire) && self.released.load(Ordering::Acquire) {
            self.stop_renewing();
        }
    }

    async fn run(&self, tokens: Option<u64>, release: bool) -> Result<(), GovernanceError> {
        settle(self.bg.conn(), &self.settlement(tokens, release)).await?;
        self.landed(tokens.is_some(), release);
        Ok(())
    }
}

#[async_trait]
impl PermitBackend for RedisPermit {
    async fn settle(&self, tokens: u64) -> Result<(), GovernanceError> {
        self.run(Some(tokens), false).await
    }

    async fn release(&self) -> Result<(), GovernanceError> {
        self.run(None, true).await
    }

    async fn settle_and_release(&self, tokens: u64) -> Result<(), GovernanceError> {
        self.run(Some(tokens), true).await
    }

    fn settle_on_drop(&self, tokens: Option<u64>) {
        // Never blocks. The queue retries until Redis takes it; if the queue is full the
        // lease (no longer renewed) frees the slot and the reservation counts until its
        // lease end + a window.
        self.stop_renewing();
        self.bg
            .enqueue(Work::Settle(Box::new(self.settlement(tokens, true))));
    }
}

impl Drop for RedisPermit {
    fn drop(&mut self) {
        self.stop_renewing();
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
            est: 400,
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
        let conn = l.bg.conn();
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
        assert_eq!(l.bg.leases(), 2, "forgotten permits are still renewed");
        g.stop_heartbeat();
        assert_eq!(l.bg.leases(), 0);
    }

    /// A reservation whose lease ended a window ago is gone: a late settlement does not
    /// revive it (but the release still applies).
    #[tokio::test]
    async fn settlement_after_the_window_changes_nothing() {
        let Some(url) = redis_url() else { return };
        let opts = RedisOptions {
            window: Duration::from_millis(300),
            ..RedisOptions::default()
        };
        let g = RedisGovernance::connect(&url, opts).await.unwrap();
        g.stop_heartbeat();
        let l = g.limiter();
        let sc = unique_name("LATE");
        let r = AcquireRequest {
            lease: Duration::from_millis(200),
            ..req(&sc)
        };
        admitted(&l, &r, "late").await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        let conn = l.bg.conn();
        settle(conn, &settlement(&sc, "late", Some(999), true))
            .await
            .unwrap();
        let k = SourceKeys::new(&sc, "a").unwrap();
        let mut cmd = redis::cmd("ZSCORE");
        cmd.arg(&k.ledger).arg("late|s999|a");
        let score: Option<f64> = conn.query("zscore", &cmd).await.unwrap();
        assert_eq!(score, None, "not settled");
        assert_eq!(l.source_window(&sc, "a").await.unwrap(), (0, 0));
        assert_eq!(l.in_flight(&sc, "a").await.unwrap(), 0);
        // the next acquire prunes the stale entry and its tokens
        admitted(&l, &req(&sc), "next").await;
        let mut cmd = redis::cmd("ZRANGE");
        cmd.arg(&k.ledger).arg(0).arg(-1);
        let entries: Vec<String> = conn.query("zrange", &cmd).await.unwrap();
        assert_eq!(entries, ["next|r400|a"]);
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(&k.totals).arg("t").arg("t:a").arg("n");
        let totals: Vec<Option<i64>> = conn.query("hmget", &cmd).await.unwrap();
        assert_eq!(totals, [Some(400), Some(400), Some(1)]);
    }
}
