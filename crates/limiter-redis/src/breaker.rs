//! [`RedisBreakerStore`]: the breaker state machine of core as atomic Lua scripts on one
//! hash per source, with epochs (SPEC §14.7) and half-open probes renewed by the
//! heartbeat and released on every path.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::breaker::{BreakerAdmit, BreakerOutcome, BreakerState};
use polygw_core::error::{GovernanceError, RefusalReason};
use polygw_core::ports::BreakerStore;
use polygw_core::settings::BreakerSettings;
use redis::Script;

use crate::background::{Background, Lease, LeaseKind, Work};
use crate::{exact, keys, ms, Owner, BACKEND};

static ADMIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/breaker_admit.lua")));
static RECORD: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/breaker_record.lua")));
static RESET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/breaker_reset.lua")));

type ProbeKey = (String, String, u64);

/// Redis [`BreakerStore`] (SPEC §4.4, §14.7): consecutive-failure threshold, doubling
/// open time up to 10×, one half-open probe under a lease renewed by the heartbeat, 429
/// cooldowns, dead sources — shared by every process on the server; outcomes count only
/// in the epoch they were admitted under. Timestamps in [`BreakerStore::state`] are the
/// server's Unix milliseconds. Cheap to clone.
#[derive(Clone)]
pub struct RedisBreakerStore {
    bg: Arc<Background>,
    /// The heartbeat registrations of the probes this store granted.
    probes: Arc<Mutex<HashMap<ProbeKey, Option<u64>>>>,
    _owner: Arc<Owner>,
}

impl fmt::Debug for RedisBreakerStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBreakerStore")
            .field("conn", self.bg.conn())
            .finish()
    }
}

impl RedisBreakerStore {
    pub(crate) fn new(bg: Arc<Background>, owner: Arc<Owner>) -> Self {
        RedisBreakerStore {
            bg,
            probes: Arc::new(Mutex::new(HashMap::new())),
            _owner: owner,
        }
    }

    fn idle_ttl_ms(&self) -> u64 {
        exact(ms(self.bg.conn().opts.breaker_idle_ttl)).max(1)
    }

    fn stop_renewing(&self, scope: &str, source: &str, epoch: u64) {
        let reg = self
            .probes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(scope.to_string(), source.to_string(), epoch));
        self.bg.deregister(reg.flatten());
    }
}

/// Frees a probe an admission may have been granted if its answer never arrived (the
/// admission's future was dropped, or the reply was an error: the script may have run).
struct PendingAdmit<'a> {
    bg: &'a Background,
    release: Option<(String, String)>,
}

impl Drop for PendingAdmit<'_> {
    fn drop(&mut self) {
        if let Some((key, token)) = self.release.take() {
            self.bg.enqueue(Work::ReleaseProbeByToken { key, token });
        }
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
        let token = uuid::Uuid::new_v4().simple().to_string();
        let lease_ms = exact(ms(probe_lease)).max(1);
        let mut inv = ADMIT.prepare_invoke();
        inv.key(&key)
            .key(keys::drained(scope, source)?)
            .arg(lease_ms)
            .arg(self.idle_ttl_ms())
            .arg(&token);
        let mut pending = PendingAdmit {
            bg: &self.bg,
            release: Some((key.clone(), token)),
        };
        let reply: Vec<i64> = self.bg.conn().run("breaker admit", &inv).await?;
        let unexpected =
            || GovernanceError::new(BACKEND, format!("unexpected breaker reply {reply:?}"));
        let admit = match reply[..] {
            [1, probe, epoch] => BreakerAdmit::Allowed {
                probe: probe == 1,
                epoch: u64::try_from(epoch).map_err(|_| unexpected())?,
            },
            [0, code, hint] => BreakerAdmit::Refused {
                reason: match code {
                    1 => RefusalReason::CircuitOpen,
                    2 => RefusalReason::Dead,
                    3 => RefusalReason::Cooldown,
                    4 => RefusalReason::Drained,
                    _ => return Err(unexpected()),
                },
                retry_after_ms: u64::try_from(hint).map_err(|_| unexpected())?,
            },
            _ => return Err(unexpected()),
        };
        pending.release = None;
        if let BreakerAdmit::Allowed { probe: true, epoch } = admit {
            let reg = self.bg.register(Lease {
                scope: scope.to_string(),
                source: source.to_string(),
                kind: LeaseKind::Probe { epoch },
                lease_ms,
            });
            self.probes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert((scope.to_string(), source.to_string(), epoch), reg);
        }
        Ok(admit)
    }

    async fn record(
        &self,
        scope: &str,
        source: &str,
        outcome: BreakerOutcome,
        epoch: u64,
        probe: bool,
        settings: &BreakerSettings,
    ) -> Result<(), GovernanceError> {
        let key = keys::breaker(scope, source)?;
        if probe {
            self.stop_renewing(scope, source, epoch);
        }
        let (name, cooldown_ms) = match outcome {
            BreakerOutcome::Success => ("success", 0),
            BreakerOutcome::Failure => ("failure", 0),
            BreakerOutcome::FastFailure => ("fast_failure", 0),
            BreakerOutcome::Neutral => ("neutral", 0),
            BreakerOutcome::Dead => ("dead", 0),
            BreakerOutcome::RateLimited { cooldown_ms } => (
                "rate_limited",
                // Bounded as the memory store bounds it (SPEC §17.6).
                cooldown_ms.min(polygw_core::classify::millis(
                    polygw_core::classify::MAX_RETRY_HINT,
                )),
            ),
        };
        let mut inv = RECORD.prepare_invoke();
        inv.key(&key)
            .arg(name)
            .arg(if probe { "1" } else { "0" })
            .arg(exact(cooldown_ms))
            .arg(settings.failures)
            .arg(exact(ms(settings.open)))
            .arg(exact(ms(settings.dead)))
            .arg(self.idle_ttl_ms())
            .arg(epoch)
            .arg(settings.dead_after)
            .arg(exact(ms(settings.open_max)));
        let r: Result<i64, _> = self.bg.conn().run("breaker record", &inv).await;
        if let Err(e) = r {
            if probe {
                // The probe must not stay out until its lease ends: free it when Redis
                // takes it.
                self.bg.enqueue(Work::ReleaseProbe { key, epoch });
            }
            return Err(e);
        }
        Ok(())
    }

    fn release_probe(&self, scope: &str, source: &str, epoch: u64) {
        self.stop_renewing(scope, source, epoch);
        match keys::breaker(scope, source) {
            Ok(key) => self.bg.enqueue(Work::ReleaseProbe { key, epoch }),
            Err(e) => tracing::warn!(error = %e, "cannot release a probe"),
        }
    }

    async fn state(&self, scope: &str, source: &str) -> Result<BreakerState, GovernanceError> {
        let key = keys::breaker(scope, source)?;
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(&key)
            .arg(&["cf", "ou", "ro", "pu", "du", "cd", "ep", "dd"][..]);
        let v: Vec<Option<u64>> = self.bg.conn().query("breaker state", &cmd).await?;
        let mut exists = redis::cmd("EXISTS");
        exists.arg(keys::drained(scope, source)?);
        let drained: i64 = self.bg.conn().query("breaker state", &exists).await?;
        let at = |i: usize| v.get(i).copied().flatten().unwrap_or(0);
        let small = |i: usize| u32::try_from(at(i)).unwrap_or(u32::MAX);
        Ok(BreakerState {
            consecutive_failures: small(0),
            open_until: at(1),
            reopens: small(2),
            probe_until: at(3),
            dead_until: at(4),
            cooldown_until: at(5),
            epoch: at(6),
            consecutive_dead: small(7),
            drained: drained == 1,
        })
    }

    async fn clock_ms(&self) -> Result<u64, GovernanceError> {
        let (secs, micros): (u64, u64) = self
            .bg
            .conn()
            .query("read the server's clock", &redis::cmd("TIME"))
            .await?;
        Ok(secs.saturating_mul(1000).saturating_add(micros / 1000))
    }

    async fn reset(&self, scope: &str, source: &str) -> Result<(), GovernanceError> {
        let key = keys::breaker(scope, source)?;
        let mut inv = RESET.prepare_invoke();
        inv.key(&key).arg(self.idle_ttl_ms());
        let _: i64 = self.bg.conn().run("breaker reset", &inv).await?;
        Ok(())
    }

    async fn set_drained(
        &self,
        scope: &str,
        source: &str,
        drained: bool,
    ) -> Result<(), GovernanceError> {
        let key = keys::drained(scope, source)?;
        let cmd = if drained {
            let mut c = redis::cmd("SET");
            c.arg(&key).arg(1);
            c
        } else {
            let mut c = redis::cmd("DEL");
            c.arg(&key);
            c
        };
        let what = if drained {
            "drain a source"
        } else {
            "bring a source back"
        };
        let _: redis::Value = self.bg.conn().query(what, &cmd).await?;
        Ok(())
    }

    async fn flush(&self) -> Result<(), GovernanceError> {
        self.bg.flush().await
    }
}
