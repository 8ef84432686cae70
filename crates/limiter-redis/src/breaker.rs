//! [`RedisBreakerStore`]: the breaker state machine of core as two atomic Lua scripts on
//! one hash per source.

use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::breaker::{BreakerAdmit, BreakerOutcome, BreakerState};
use polygw_core::error::{GovernanceError, RefusalReason};
use polygw_core::ports::BreakerStore;
use polygw_core::settings::BreakerSettings;
use redis::Script;

use crate::{exact, keys, ms, Conn, BACKEND};

static ADMIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/breaker_admit.lua")));
static RECORD: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/breaker_record.lua")));

/// Redis [`BreakerStore`] (SPEC §4.4): consecutive-failure threshold, doubling open time
/// up to 10×, one half-open probe under a lease, 429 cooldowns, dead sources — shared by
/// every process on the server. Timestamps in [`BreakerStore::state`] are the server's
/// Unix milliseconds. Cheap to clone.
#[derive(Clone)]
pub struct RedisBreakerStore {
    conn: Conn,
}

impl fmt::Debug for RedisBreakerStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBreakerStore")
            .field("conn", &self.conn)
            .finish()
    }
}

impl RedisBreakerStore {
    pub(crate) fn new(conn: Conn) -> Self {
        RedisBreakerStore { conn }
    }

    fn idle_ttl_ms(&self) -> u64 {
        exact(ms(self.conn.opts.breaker_idle_ttl)).max(1)
    }
}

#[async_trait]
impl BreakerStore for RedisBreakerStore {
    async fn admit(
        &self,
        scope: &str,
        source: &str,
        probe_lease: Duration,
    ) -> Result<BreakerAdmit, GovernanceError> {
        let key = keys::breaker(scope, source)?;
        let mut inv = ADMIT.prepare_invoke();
        inv.key(&key)
            .arg(exact(ms(probe_lease)))
            .arg(self.idle_ttl_ms());
        let reply: Vec<i64> = self.conn.run("breaker admit", &inv).await?;
        let unexpected =
            || GovernanceError::new(BACKEND, format!("unexpected breaker reply {reply:?}"));
        match reply[..] {
            [1, probe] => Ok(BreakerAdmit::Allowed { probe: probe == 1 }),
            [0, code, hint] => Ok(BreakerAdmit::Refused {
                reason: match code {
                    1 => RefusalReason::CircuitOpen,
                    2 => RefusalReason::Dead,
                    3 => RefusalReason::Cooldown,
                    _ => return Err(unexpected()),
                },
                retry_after_ms: u64::try_from(hint).map_err(|_| unexpected())?,
            }),
            _ => Err(unexpected()),
        }
    }

    async fn record(
        &self,
        scope: &str,
        source: &str,
        outcome: BreakerOutcome,
        probe: bool,
        settings: &BreakerSettings,
    ) -> Result<(), GovernanceError> {
        let key = keys::breaker(scope, source)?;
        let (name, cooldown_ms) = match outcome {
            BreakerOutcome::Success => ("success", 0),
            BreakerOutcome::Failure => ("failure", 0),
            BreakerOutcome::Neutral => ("neutral", 0),
            BreakerOutcome::Dead => ("dead", 0),
            BreakerOutcome::RateLimited { cooldown_ms } => ("rate_limited", cooldown_ms),
        };
        let mut inv = RECORD.prepare_invoke();
        inv.key(&key)
            .arg(name)
            .arg(if probe { "1" } else { "0" })
            .arg(exact(cooldown_ms))
            .arg(settings.failures)
            .arg(exact(ms(settings.open)))
            .arg(exact(ms(settings.dead)))
            .arg(self.idle_ttl_ms());
        let _: i64 = self.conn.run("breaker record", &inv).await?;
        Ok(())
    }

    async fn state(&self, scope: &str, source: &str) -> Result<BreakerState, GovernanceError> {
        let key = keys::breaker(scope, source)?;
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(&key).arg(&["cf", "ou", "ro", "pu", "du", "cd"][..]);
        let v: Vec<Option<u64>> = self.conn.query("breaker state", &cmd).await?;
        let at = |i: usize| v.get(i).copied().flatten().unwrap_or(0);
        let small = |i: usize| u32::try_from(at(i)).unwrap_or(u32::MAX);
        Ok(BreakerState {
            consecutive_failures: small(0),
            open_until: at(1),
            reopens: small(2),
            probe_until: at(3),
            dead_until: at(4),
            cooldown_until: at(5),
        })
    }
}
