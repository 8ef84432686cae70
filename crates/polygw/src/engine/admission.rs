//! The async pick (SPEC §4.1): candidates in core's order (a fresh round's primary with
//! its affinity source first in its tier, SPEC §20.2), each asked of the breaker store
//! then the limiter; the first admitted wins. Refused candidates record their reason;
//! excluded ones record nothing.
//!
//! A half-open probe granted by the breaker store is freed on every path that does not
//! lead to an attempt — the limiter refuses, fails, or the pick's future is dropped while
//! the limiter is asked (SPEC §14.7) — through the store's non-blocking release.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use polygw_core::admission::order_candidates_preferring;
use polygw_core::affinity::affinity_order;
use polygw_core::breaker::BreakerAdmit;
use polygw_core::ports::{AcquireRequest, Admission, Permit, Refusal};
use polygw_core::{GovernanceError, ScopeKind, SourceConfig};

use super::Engine;
use crate::client_keys::{KeyCharge, LegHold};

/// What the breaker said when it admitted an attempt: the epoch its outcome counts in
/// (SPEC §14.7) and whether it is the source's half-open probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct BreakerTicket {
    pub epoch: u64,
    pub probe: bool,
}

/// An admitted source.
#[derive(Debug)]
pub(crate) struct Picked {
    pub source_idx: usize,
    pub permit: Permit,
    /// The reservation its leg holds against the call's client key (SPEC §24.1).
    pub leg: Option<LegHold>,
    /// The breaker ticket (epoch; whether this attempt is the half-open probe).
    pub probe: BreakerTicket,
}

/// Frees a granted probe unless disarmed (the attempt then owns it).
struct ProbeGuard<'a> {
    engine: &'a Engine,
    source: &'a str,
    ticket: BreakerTicket,
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        if self.ticket.probe {
            self.engine.ports.breakers.release_probe(
                &self.engine.scope.name,
                self.source,
                self.ticket.epoch,
            );
        }
    }
}

/// What a pick may choose from, beyond the round's exclusions.
#[derive(Debug, Clone, Default)]
pub(crate) struct PickPrefs {
    /// Only this source.
    pub only: Option<usize>,
    /// Only these sources (a context-length rejection routed to larger windows).
    pub allowed: Option<BTreeSet<usize>>,
    /// Where a prefill of the call's delivered text may go (the request's and the
    /// text's rules, [`Engine::prefills`]); `None`: any source that takes prefill.
    pub prefill_to: Option<BTreeSet<usize>>,
    /// This source first, although it failed in the call (`RETRY__PREFER=same`).
    pub first: Option<usize>,
    /// Prefill-capable sources first.
    pub prefer_prefill: bool,
    /// Prefill-capable sources only.
    pub require_prefill: bool,
    /// The source the call's affinity key last went to (SPEC §20.2): tried first within
    /// its priority tier, unless it failed in the call (core's `affinity_order`). Only a
    /// fresh round's primary pick sets it (with none of the preferences above).
    pub sticky: Option<usize>,
    /// Sources of this signature family first (SPEC §23.5: hedge and resume legs of a
    /// conversation prefer its family; a cross-family leg costs a cache miss and loses
    /// the thinking another family signed).
    pub family: Option<std::sync::Arc<str>>,
}

/// The result of one pass over the candidates.
#[derive(Debug)]
pub(crate) struct Pick {
    pub admitted: Option<Picked>,
    /// Every candidate refused before the admitted one (or all, when none was).
    pub refusals: Vec<(String, Refusal)>,
}

impl Engine {
    /// Funds a leg on source `idx` against the call's client key, if its legs are funded
    /// one by one (see [`KeyCharge::fund_leg`]).
    async fn fund_leg(
        &self,
        key: Option<&Arc<KeyCharge>>,
        idx: usize,
    ) -> Result<Result<Option<LegHold>, Refusal>, GovernanceError> {
        let Some(k) = key else { return Ok(Ok(None)) };
        let Some((prompt, cap, margin)) = k.leg_pricing() else {
            return Ok(Ok(None));
        };
        let nanos = polygw_core::key_funds::leg_reserve_nanos(
            prompt,
            cap,
            margin,
            &self.scope.sources[idx],
            &self.scope.sources,
            self.scope.limits.tpm,
        );
        // A refused top-up ends nothing but this leg: no wait for it (the budget's hint
        // is the period's end).
        Ok(k.fund_leg(nanos).await?.map_err(|r| Refusal {
            reason: r.reason,
            retry_after: None,
        }))
    }

    /// The lease of an in-flight slot, a reservation and a half-open probe
    /// (`LIMITS__LEASE_S`, 30 s by default): the backend renews it while the attempt is
    /// alive, so it only bounds how long a crashed process holds capacity (SPEC §14.4).
    pub(crate) fn lease(&self, _src: &SourceConfig, _stream: bool) -> Duration {
        self.scope.limits.lease
    }

    fn acquire_request<'a>(&'a self, src: &'a SourceConfig, stream: bool) -> AcquireRequest<'a> {
        // OCR sources are RPM-governed only: no token reservation.
        let tokens = self.kind != ScopeKind::Ocr;
        AcquireRequest {
            scope: &self.scope.name,
            source: &src.name,
            rpm: src.rpm,
            tpm: if tokens { src.tpm } else { 0 },
            max_concurrency: src.max_concurrency,
            scope_rpm: self.scope.limits.rpm,
            scope_tpm: if tokens { self.scope.limits.tpm } else { 0 },
            est_tokens: if tokens {
                self.scope.est_tokens(src)
            } else {
                0
            },
            lease: self.lease(src, stream),
        }
    }

    /// One pass over the candidates, in core's order with these preferences; never
    /// waits for capacity.
    pub(crate) async fn try_pick_with(
        &self,
        exclude: &BTreeSet<String>,
        failed_in_call: &BTreeSet<String>,
        stream: bool,
        prefs: PickPrefs,
        key: Option<&Arc<KeyCharge>>,
    ) -> Result<Pick, GovernanceError> {
        let capable = |i: usize| {
            self.prefill_capable(i) && prefs.prefill_to.as_ref().is_none_or(|t| t.contains(&i))
        };
        let first = prefs.first.map(|i| self.scope.sources[i].name.as_str());
        let failed: BTreeSet<String> = match first {
            Some(f) => failed_in_call.iter().filter(|n| *n != f).cloned().collect(),
            None => failed_in_call.clone(),
        };
        let mut order = order_candidates_preferring(
            &self.scope.sources,
            exclude,
            &failed,
            &|i| match prefs.first {
                Some(f) => i == f,
                None => {
                    (!prefs.prefer_prefill || capable(i))
                        && prefs
                            .family
                            .as_deref()
                            .is_none_or(|f| self.scope.sources[i].family() == f)
                }
            },
            self.ports.rng.as_ref(),
        );
        if prefs.first.is_none() && !prefs.prefer_prefill {
            order = affinity_order(order, &self.scope.sources, &failed, prefs.sticky);
        }
        order.retain(|&i| {
            prefs.only.is_none_or(|o| o == i)
                && prefs.allowed.as_ref().is_none_or(|a| a.contains(&i))
                && (!prefs.require_prefill || capable(i))
        });
        let mut refusals = Vec::new();
        for idx in order {
            let src = &self.scope.sources[idx];
            // The client key's budget first (SPEC §24.1): a leg it cannot fund is not
            // launched; a hold is released if the source does not admit the leg.
            let leg = match self.fund_leg(key, idx).await? {
                Ok(leg) => leg,
                Err(refusal) => {
                    refusals.push((src.name.clone(), refusal));
                    continue;
                }
            };
            let lease = self.lease(src, stream);
            let ticket = match self
                .ports
                .breakers
                .admit(&self.scope.name, &src.name, lease)
                .await?
            {
                BreakerAdmit::Refused {
                    reason,
                    retry_after_ms,
                } => {
                    refusals.push((
                        src.name.clone(),
                        Refusal {
                            reason,
                            retry_after: Some(Duration::from_millis(retry_after_ms)),
                        },
                    ));
                    continue;
                }
                BreakerAdmit::Allowed { probe, epoch } => BreakerTicket { epoch, probe },
            };
            // From here the probe is freed on every path but an admission, this future
            // being dropped included.
            let mut guard = ProbeGuard {
                engine: self,
                source: &src.name,
                ticket,
            };
            let acquired = self
                .ports
                .limiter
                .acquire(&self.acquire_request(src, stream))
                .await;
            match acquired {
                Ok(Admission::Admitted(permit)) => {
                    guard.ticket.probe = false;
                    return Ok(Pick {
                        admitted: Some(Picked {
                            source_idx: idx,
                            permit,
                            leg,
                            probe: ticket,
                        }),
                        refusals,
                    });
                }
                Ok(Admission::Refused(r)) => refusals.push((src.name.clone(), r)),
                Err(e) => return Err(e),
            }
        }
        Ok(Pick {
            admitted: None,
            refusals,
        })
    }

    /// Frees a half-open probe that no attempt used (non-blocking).
    pub(crate) fn release_unused_probe(&self, source: usize, ticket: BreakerTicket) {
        if ticket.probe {
            self.ports.breakers.release_probe(
                &self.scope.name,
                &self.scope.sources[source].name,
                ticket.epoch,
            );
        }
    }
}
