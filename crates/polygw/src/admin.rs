//! An operator's view of a scope and actions on its sources (SPEC §26.3): the live state
//! of every source — breaker, cooldown, quota use, the `auto` thresholds and the
//! evidence they come from, affinity — and the breaker reset and the drain. The
//! actions go through the governance backend (the breaker store), so with Redis every
//! replica sees them at its next admission.

use serde::Serialize;

use polygw_core::breaker::BreakerState;
use polygw_core::hedge::ThresholdInForce;
use polygw_core::GovernanceError;

use crate::GatewayClient;

/// A scope as an operator sees it ([`GatewayClient::status`]).
#[derive(Debug, Clone, Serialize)]
pub struct ScopeStatus {
    /// The scope's name.
    pub scope: String,
    /// How it hedges (the line of `polygw config check`).
    pub hedging: String,
    /// The retry throttle's tokens now, and its size (SPEC §25.4).
    pub retry_throttle: (f64, u32),
    /// Prompt-cache affinity.
    pub affinity: AffinityStatus,
    /// Its sources, in configuration order.
    pub sources: Vec<SourceStatus>,
}

/// Affinity's setting and what it did (successful calls since start).
#[derive(Debug, Clone, Serialize)]
pub struct AffinityStatus {
    /// `session` or `off`.
    pub mode: String,
    /// `AFFINITY__TTL_S`.
    pub ttl_s: f64,
    /// Calls whose key's source served it again.
    pub hits: u64,
    /// Calls whose key had no source yet.
    pub misses: u64,
    /// Calls whose key moved to another source.
    pub moved: u64,
}

/// One source's live state.
#[derive(Debug, Clone, Serialize)]
pub struct SourceStatus {
    /// `{provider}-{n}`.
    pub name: String,
    /// The upstream model.
    pub model: String,
    /// The base URL, credentials redacted.
    pub address: String,
    /// `PRIORITY` and `WEIGHT`.
    pub priority: u32,
    /// `WEIGHT`.
    pub weight: u32,
    /// `closed`, `open`, `half_open`, `dead`, `cooling_down` or `drained`.
    pub state: &'static str,
    /// How long it stays open, dead or cooling down (seconds); none when closed or
    /// drained.
    pub for_s: Option<f64>,
    /// Consecutive breaker-feeding failures.
    pub consecutive_failures: u32,
    /// Attempts in flight (the limiter's count: every process's, with Redis).
    pub in_flight: u32,
    /// `RPM`, `TPM`, `MAX_CONCURRENCY` (0 = unlimited).
    pub limits: (u32, u64, u32),
    /// The first-token threshold in force for a streamed request (ms, origin, the
    /// prior's weight in basis points).
    pub first_token: ThresholdInForce,
    /// The stall threshold in force.
    pub stall: ThresholdInForce,
    /// The evidence of streamed legs in this process's book (observed and censored
    /// first tokens, legs; gap samples).
    pub evidence: Evidence,
}

/// What an upstream's `auto` thresholds are read from (this process's view).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Evidence {
    /// First tokens observed.
    pub first_tokens: u64,
    /// Legs that ended before their first token (censored samples).
    pub cut_before_first_token: u64,
    /// Streamed legs with a gap sample (their longest gap).
    pub gaps: u64,
}

/// An admin action that could not be done.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// No source of the scope has this name.
    #[error("the scope has no source `{name}` (its sources: {known})")]
    UnknownSource {
        /// The name asked for.
        name: String,
        /// The scope's sources.
        known: String,
    },
    /// The governance backend failed.
    #[error(transparent)]
    Backend(#[from] GovernanceError),
}

/// The state name and how long it lasts, from a breaker's state and the store's clock.
pub fn state_of(b: &BreakerState, now_ms: u64) -> (&'static str, Option<f64>) {
    let left = |until: u64| Some(until.saturating_sub(now_ms) as f64 / 1000.0);
    if b.drained {
        ("drained", None)
    } else if b.dead_until > now_ms {
        ("dead", left(b.dead_until))
    } else if b.cooldown_until > now_ms {
        ("cooling_down", left(b.cooldown_until))
    } else if b.open_until > now_ms {
        ("open", left(b.open_until))
    } else if b.open_until > 0 {
        ("half_open", None)
    } else {
        ("closed", None)
    }
}

impl GatewayClient {
    /// The scope's live state, source by source (SPEC §26.3).
    pub async fn status(&self) -> Result<ScopeStatus, GovernanceError> {
        let e = &self.engine;
        let scope = &e.scope.name;
        let now_ms = e.ports.breakers.clock_ms().await?;
        let thresholds = self.hedge_thresholds(true);
        let evidence = self.hedge_latency(true);
        let mut sources = Vec::with_capacity(e.scope.sources.len());
        for (i, s) in e.scope.sources.iter().enumerate() {
            let b = e.ports.breakers.state(scope, &s.name).await?;
            let (state, for_s) = state_of(&b, now_ms);
            let in_flight = e.ports.limiter.in_flight(scope, &s.name).await?;
            let t = thresholds[i].1;
            let v = &evidence[i].1;
            sources.push(SourceStatus {
                name: s.name.clone(),
                model: s.model.clone(),
                address: e.source_addresses[i].clone(),
                priority: s.priority,
                weight: s.weight,
                state,
                for_s,
                consecutive_failures: b.consecutive_failures,
                in_flight,
                limits: (s.rpm, s.tpm, s.max_concurrency),
                first_token: t.after,
                stall: t.stall_after,
                evidence: Evidence {
                    first_tokens: v.ttft.observed(),
                    cut_before_first_token: v.ttft.censored(),
                    gaps: v.gap.samples(),
                },
            });
        }
        let [hits, misses, moved] = e.scope_metrics.affinity_counts();
        let a = &e.scope.affinity;
        Ok(ScopeStatus {
            scope: scope.clone(),
            hedging: polygw_core::hedge::describe(
                &e.scope.hedge,
                e.kind == polygw_core::ScopeKind::Chat,
                e.scope.sources.len(),
            ),
            retry_throttle: (e.throttle().tokens(), e.scope.retry.throttle.max_tokens),
            affinity: AffinityStatus {
                mode: match a.mode {
                    polygw_core::affinity::AffinityMode::Off => "off",
                    polygw_core::affinity::AffinityMode::Session => "session",
                }
                .to_string(),
                ttl_s: a.ttl.as_secs_f64(),
                hits,
                misses,
                moved,
            },
            sources,
        })
    }

    /// Closes a source's breaker at once (SPEC §26.3): failures, open, dead and
    /// cooldown periods forgotten, for every process sharing the governance backend.
    pub async fn reset_breaker(&self, source: &str) -> Result<(), AdminError> {
        let name = self.source_named(source)?;
        self.engine
            .ports
            .breakers
            .reset(&self.engine.scope.name, name)
            .await?;
        tracing::warn!(scope = %self.engine.scope.name, source = name, "breaker reset by an operator");
        Ok(())
    }

    /// Takes a source out of the scope (`drained`) or brings it back (SPEC §26.3):
    /// admissions refuse it as `drained` until it is brought back, in every process
    /// sharing the governance backend. Calls already running on it finish.
    pub async fn set_drained(&self, source: &str, drained: bool) -> Result<(), AdminError> {
        let name = self.source_named(source)?;
        self.engine
            .ports
            .breakers
            .set_drained(&self.engine.scope.name, name, drained)
            .await?;
        if drained {
            tracing::warn!(scope = %self.engine.scope.name, source = name, "source drained by an operator");
        } else {
            tracing::warn!(scope = %self.engine.scope.name, source = name, "source brought back by an operator");
        }
        Ok(())
    }

    fn source_named(&self, source: &str) -> Result<&str, AdminError> {
        let sources = &self.engine.scope.sources;
        sources
            .iter()
            .find(|s| s.name == source)
            .map(|s| s.name.as_str())
            .ok_or_else(|| AdminError::UnknownSource {
                name: source.chars().take(64).collect(),
                known: sources
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_breaker_state_reads_as_an_operator_says_it() {
        let mut b = BreakerState::default();
        assert_eq!(state_of(&b, 1_000), ("closed", None));
        b.open_until = 3_000;
        assert_eq!(state_of(&b, 1_000), ("open", Some(2.0)));
        assert_eq!(state_of(&b, 3_000), ("half_open", None));
        b.cooldown_until = 1_500;
        assert_eq!(state_of(&b, 1_000), ("cooling_down", Some(0.5)));
        b.dead_until = 9_000;
        assert_eq!(state_of(&b, 1_000), ("dead", Some(8.0)));
        b.drained = true;
        assert_eq!(state_of(&b, 1_000), ("drained", None));
    }
}
