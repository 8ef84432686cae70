//! Client-key governance on Redis (SPEC §21.1): a key admission, its finish, its heartbeat
//! and its reading are each one atomic script (`lua/key_*.lua`, each prefixed by
//! `lua/key_lib.lua`) over the key's own four keys, which share the key id's hash tag —
//! one cluster slot, apart from every scope's. The scripts mirror
//! [`polygw_core::key_quota::KeyQuotas`]; the contract suite checks they agree.
//!
//! The caller runs the key admission once per client call, before the call's first source
//! admission (a separate script in another slot: the two are never one transaction, and
//! nothing is checked twice — the key's limits only here, the sources' and scope's only in
//! `acquire.lua`). A call the key admits and no source admits finishes its key permit at
//! 0 tokens and 0 cost.
//!
//! Key permits are leases like source permits: the heartbeat renews them (one script per
//! key per beat), a dropped permit's settlement at its reservation goes through the
//! background queue, and an admission whose answer was lost is finished at 0 by the queue.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use polygw_core::error::{GovernanceError, RefusalReason};
use polygw_core::ports::{
    KeyAcquire, KeyAdmission, KeyPermit, KeyPermitBackend, KeyUsage, Refusal,
};
use redis::{Script, ScriptInvocation};

use crate::background::{Background, Lease, LeaseKind, Work};
use crate::keys::KeyKeys;
use crate::{exact, ms, Conn, BACKEND};

macro_rules! key_script {
    ($file:literal) => {
        LazyLock::new(|| {
            Script::new(concat!(
                include_str!("lua/key_lib.lua"),
                include_str!(concat!("lua/", $file))
            ))
        })
    };
}

static ACQUIRE: LazyLock<Script> = key_script!("key_acquire.lua");
static FINISH: LazyLock<Script> = key_script!("key_finish.lua");
static RENEW: LazyLock<Script> = key_script!("key_renew.lua");
static USAGE: LazyLock<Script> = key_script!("key_usage.lua");

fn invocation<'a>(script: &'a Script, keys: &KeyKeys) -> ScriptInvocation<'a> {
    let mut inv = script.prepare_invoke();
    for k in keys.all() {
        inv.key(k);
    }
    inv
}

fn refusal_reason(code: i64) -> Option<RefusalReason> {
    Some(match code {
        1 => RefusalReason::KeyConcurrency,
        2 => RefusalReason::KeyRpm,
        3 => RefusalReason::KeyTpm,
        4 => RefusalReason::KeyBudgetDay,
        5 => RefusalReason::KeyBudgetMonth,
        _ => return None,
    })
}

fn unexpected(reply: &[i64]) -> GovernanceError {
    GovernanceError::new(BACKEND, format!("unexpected key script reply {reply:?}"))
}

/// One key admission under permit id `id` (see the module doc).
pub(crate) async fn acquire(
    bg: &Arc<Background>,
    req: &KeyAcquire<'_>,
    id: String,
) -> Result<KeyAdmission, GovernanceError> {
    let conn = bg.conn();
    let keys = KeyKeys::new(req.key_id)?;
    // A top-up reserves no tokens (key_lib.lua).
    let est = if req.top_up { 0 } else { exact(req.est_tokens) };
    let nanos = exact(req.reserve_nanos);
    let lease_ms = exact(ms(req.lease)).max(1);
    let budget = |b: Option<u64>| b.map(|b| exact(b).to_string()).unwrap_or_default();
    let mut inv = invocation(&ACQUIRE, &keys);
    inv.arg(&id)
        .arg(req.rpm)
        .arg(exact(req.tpm))
        .arg(req.max_concurrency)
        .arg(budget(req.budget_day_nanos))
        .arg(budget(req.budget_month_nanos))
        .arg(est)
        .arg(nanos)
        .arg(lease_ms)
        .arg(conn.window_ms())
        .arg(conn.margin_ms())
        .arg(if req.top_up { "1" } else { "0" });
    // Dropped (or failed) once the script may have run: finish the admission at 0 (the
    // call never started); a no-op if the script refused or never ran.
    let mut pending = Pending {
        bg,
        finish: Some(KeyFinish {
            keys: keys.clone(),
            id: id.clone(),
            est,
            nanos,
            tokens: 0,
            cost_nanos: 0,
        }),
    };
    let reply: Vec<i64> = conn.run("key acquire", &inv).await?;
    pending.finish = None;
    match reply[..] {
        [1, _] => {
            let lease = bg.register(Lease {
                scope: req.key_id.to_string(),
                source: String::new(),
                kind: LeaseKind::Key {
                    id: id.clone(),
                    nanos,
                    est,
                },
                lease_ms,
            });
            Ok(KeyAdmission::Admitted(KeyPermit::new(
                est,
                nanos,
                Box::new(RedisKeyPermit {
                    bg: bg.clone(),
                    keys,
                    id,
                    est,
                    nanos,
                    lease: Mutex::new(lease),
                    finished: AtomicBool::new(false),
                }),
            )))
        }
        [0, code, hint] => {
            let reason = refusal_reason(code).ok_or_else(|| unexpected(&reply))?;
            Ok(KeyAdmission::Refused(Refusal {
                reason,
                retry_after: u64::try_from(hint).ok().map(Duration::from_millis),
            }))
        }
        _ => Err(unexpected(&reply)),
    }
}

/// A key's figures now.
pub(crate) async fn usage(conn: &Conn, key_id: &str) -> Result<KeyUsage, GovernanceError> {
    let keys = KeyKeys::new(key_id)?;
    let mut inv = invocation(&USAGE, &keys);
    inv.arg(conn.window_ms());
    let v: Vec<i64> = conn.run("key usage", &inv).await?;
    let u = |i: usize| v.get(i).and_then(|x| u64::try_from(*x).ok()).unwrap_or(0);
    if v.len() != 7 {
        return Err(unexpected(&v));
    }
    Ok(KeyUsage {
        now_unix_ms: u(0),
        in_flight: u32::try_from(u(1)).unwrap_or(u32::MAX),
        requests: u(2),
        tokens: u(3),
        reserved_nanos: u(4),
        day_nanos: u(5),
        month_nanos: u(6),
    })
}

/// A finish of one key permit (what the queue applies).
#[derive(Debug, Clone)]
pub(crate) struct KeyFinish {
    pub keys: KeyKeys,
    pub id: String,
    /// The reservations (part of the permit's entries' names).
    pub est: u64,
    pub nanos: u64,
    pub tokens: u64,
    pub cost_nanos: u64,
}

/// Finishes one key permit (one script; idempotent on the server).
pub(crate) async fn finish(conn: &Conn, f: &KeyFinish) -> Result<(), GovernanceError> {
    let mut inv = invocation(&FINISH, &f.keys);
    inv.arg(&f.id)
        .arg(exact(f.tokens))
        .arg(exact(f.cost_nanos))
        .arg(f.est)
        .arg(f.nanos)
        .arg(conn.window_ms())
        .arg(conn.margin_ms());
    let _: i64 = conn.run("key finish", &inv).await?;
    Ok(())
}

/// Renews the leases of one key in one script; returns the registry keys of the leases
/// that had ended.
pub(crate) async fn renew(
    conn: &Conn,
    key_id: &str,
    leases: &[&(u64, Lease)],
) -> Result<Vec<u64>, GovernanceError> {
    let keys = KeyKeys::new(key_id)?;
    let mut inv = invocation(&RENEW, &keys);
    inv.arg(conn.window_ms()).arg(conn.margin_ms());
    for (_, l) in leases.iter().map(|x| (&x.0, &x.1)) {
        if let LeaseKind::Key { id, nanos, est } = &l.kind {
            inv.arg(id).arg(*nanos).arg(*est).arg(exact(l.lease_ms));
        }
    }
    let ended: Vec<usize> = conn.run("key lease heartbeat", &inv).await?;
    Ok(ended
        .into_iter()
        .filter_map(|i| leases.get(i.checked_sub(1)?).map(|l| l.0))
        .collect())
}

/// Finishes an admission whose reply never arrived (see [`acquire`]).
struct Pending<'a> {
    bg: &'a Background,
    finish: Option<KeyFinish>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(f) = self.finish.take() {
            self.bg.enqueue(Work::FinishKey(Box::new(f)));
        }
    }
}

/// The backend of a Redis key permit: idempotent server-side (the first finish removes
/// the entries later ones look for); renewed by the heartbeat until finished or dropped.
struct RedisKeyPermit {
    bg: Arc<Background>,
    keys: KeyKeys,
    id: String,
    est: u64,
    nanos: u64,
    lease: Mutex<Option<u64>>,
    finished: AtomicBool,
}

impl fmt::Debug for RedisKeyPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisKeyPermit")
            .field("key", &self.keys.state)
            .field("id", &self.id)
            .finish()
    }
}

impl RedisKeyPermit {
    fn stop_renewing(&self) {
        let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.bg.deregister(lease);
    }

    fn finishing(&self, tokens: u64, cost_nanos: u64) -> KeyFinish {
        KeyFinish {
            keys: self.keys.clone(),
            id: self.id.clone(),
            est: self.est,
            nanos: self.nanos,
            tokens,
            cost_nanos,
        }
    }
}

#[async_trait::async_trait]
impl KeyPermitBackend for RedisKeyPermit {
    async fn finish(&self, tokens: u64, cost_nanos: u64) -> Result<(), GovernanceError> {
        finish(self.bg.conn(), &self.finishing(tokens, cost_nanos)).await?;
        self.finished.store(true, Ordering::Release);
        self.stop_renewing();
        Ok(())
    }

    fn finish_on_drop(&self, tokens: u64, cost_nanos: u64) {
        // Never blocks; the queue retries until Redis takes it. If the queue is full, the
        // lease (no longer renewed) ends and settles the reservation then.
        self.stop_renewing();
        if !self.finished.swap(true, Ordering::AcqRel) {
            self.bg.enqueue(Work::FinishKey(Box::new(
                self.finishing(tokens, cost_nanos),
            )));
        }
    }
}

impl Drop for RedisKeyPermit {
    fn drop(&mut self) {
        self.stop_renewing();
    }
}

#[cfg(test)]
mod tests {
    //! The scripts' calendar against core's, and server-side idempotency of a finish.

    use super::*;
    use crate::{RedisGovernance, RedisOptions};
    use polygw_core::client_key::BudgetPeriod;
    use polygw_core::key_quota::{period_end_ms, period_id, DAY_MS};
    use polygw_core::ports::RateLimiter;
    use polygw_testkit::services::{redis_url, unique_name};

    /// The Lua periods (`key_lib.lua`) agree with `key_quota`'s for random times across
    /// 1970–2200 and for every month end of 1999–2101 (leap years, century rules).
    #[tokio::test]
    async fn lua_periods_match_core() {
        let Some(url) = redis_url() else { return };
        let g = RedisGovernance::connect(&url, RedisOptions::default())
            .await
            .unwrap();
        let conn = g.limiter.background().conn().clone();
        let script = Script::new(concat!(
            include_str!("lua/key_lib.lua"),
            "local out = {}\n",
            "for i = 1, #ARGV do\n",
            "  local ms = tonumber(ARGV[i])\n",
            "  out[#out + 1] = {day_of(ms), month_of(ms), month_end(ms), day_end(ms)}\n",
            "end\n",
            "return out\n"
        ));
        let mut times: Vec<u64> = vec![0, 1, DAY_MS - 1, DAY_MS];
        let mut rng = fastrand::Rng::with_seed(26);
        for _ in 0..2000 {
            times.push(rng.u64(0..7_258_118_400_000)); // to 2200
        }
        // every month start of 1999–2101, and the ms before it
        let mut t = 915_148_800_000u64; // 1999-01-01
        while t < 4_133_980_800_000 {
            times.extend([t - 1, t]);
            t = period_end_ms(BudgetPeriod::Month, t);
        }
        let key = KeyKeys::new("periods").unwrap();
        for chunk in times.chunks(500) {
            let mut inv = invocation(&script, &key);
            for t in chunk {
                inv.arg(*t);
            }
            let got: Vec<Vec<u64>> = conn.run("periods", &inv).await.unwrap();
            for (t, g) in chunk.iter().zip(got) {
                let want = vec![
                    period_id(BudgetPeriod::Day, *t),
                    period_id(BudgetPeriod::Month, *t),
                    period_end_ms(BudgetPeriod::Month, *t),
                    period_end_ms(BudgetPeriod::Day, *t),
                ];
                assert_eq!(g, want, "at {t}");
            }
        }
    }

    fn req(key_id: &str) -> KeyAcquire<'_> {
        KeyAcquire {
            key_id,
            rpm: 0,
            tpm: 1000,
            max_concurrency: 2,
            budget_day_nanos: Some(10_000),
            budget_month_nanos: None,
            est_tokens: 400,
            reserve_nanos: 3_000,
            lease: Duration::from_secs(60),
            top_up: false,
        }
    }

    /// A retried or duplicated finish changes nothing (which `KeyPermit`'s own
    /// idempotency hides from the contract suite); an unknown permit changes nothing.
    #[tokio::test]
    async fn first_finish_wins_on_the_server() {
        let Some(url) = redis_url() else { return };
        let g = RedisGovernance::connect(&url, RedisOptions::default())
            .await
            .unwrap();
        let l = g.limiter();
        let k = unique_name("KIDEM");
        let bg = l.background().clone();
        match acquire(&bg, &req(&k), "p1".into()).await.unwrap() {
            KeyAdmission::Admitted(p) => std::mem::forget(p),
            KeyAdmission::Refused(r) => panic!("{r:?}"),
        }
        let f = |tokens, cost_nanos| KeyFinish {
            keys: KeyKeys::new(&k).unwrap(),
            id: "p1".into(),
            est: 400,
            nanos: 3_000,
            tokens,
            cost_nanos,
        };
        finish(bg.conn(), &f(100, 1_000)).await.unwrap();
        finish(bg.conn(), &f(900, 9_000)).await.unwrap();
        finish(
            bg.conn(),
            &KeyFinish {
                id: "nope".into(),
                ..f(7, 7)
            },
        )
        .await
        .unwrap();
        let u = l.key_usage(&k).await.unwrap();
        assert_eq!(
            (
                u.in_flight,
                u.requests,
                u.tokens,
                u.reserved_nanos,
                u.day_nanos
            ),
            (0, 1, 100, 0, 1_000)
        );
        assert_eq!(u.month_nanos, 1_000);
        g.stop_heartbeat();
    }

    #[tokio::test]
    async fn braces_in_key_ids_are_rejected() {
        let Some(url) = redis_url() else { return };
        let g = RedisGovernance::connect(&url, RedisOptions::default())
            .await
            .unwrap();
        let l = g.limiter();
        for bad in ["", "a{b", "x}"] {
            let e = l.acquire_key(&req(bad)).await.unwrap_err();
            assert!(e.message.contains("cannot be used in a key"), "{e}");
            assert!(l.key_usage(bad).await.is_err());
        }
    }
}
