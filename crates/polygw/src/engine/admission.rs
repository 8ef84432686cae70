//! The async pick (SPEC §4.1): candidates in core's order, each asked of the breaker
//! store then the limiter; the first admitted wins. Refused candidates record their
//! reason; excluded ones record nothing.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use polygw_core::admission::order_candidates_preferring;
use polygw_core::breaker::{BreakerAdmit, BreakerOutcome};
use polygw_core::ports::{AcquireRequest, Admission, Permit, Refusal};
use polygw_core::{GovernanceError, ScopeKind, SourceConfig};

use super::Engine;

/// Margin added to leases so a slow but healthy attempt keeps its slot.
const LEASE_MARGIN: Duration = Duration::from_secs(30);

/// An admitted source.
#[derive(Debug)]
pub(crate) struct Picked {
    pub source_idx: usize,
    pub permit: Permit,
    /// This attempt is the source's half-open probe.
    pub probe: bool,
}

/// What a pick may choose from, beyond the round's exclusions.
#[derive(Debug, Clone, Default)]
pub(crate) struct PickPrefs {
    /// Only this source.
    pub only: Option<usize>,
    /// Only these sources (a context-length rejection routed to larger windows).
    pub allowed: Option<BTreeSet<usize>>,
    /// This source first, although it failed in the call (`RETRY__PREFER=same`).
    pub first: Option<usize>,
    /// Prefill-capable sources first.
    pub prefer_prefill: bool,
    /// Prefill-capable sources only.
    pub require_prefill: bool,
}

/// The result of one pass over the candidates.
#[derive(Debug)]
pub(crate) struct Pick {
    pub admitted: Option<Picked>,
    /// Every candidate refused before the admitted one (or all, when none was).
    pub refusals: Vec<(String, Refusal)>,
}

impl Engine {
    /// How long an in-flight slot and a half-open probe may be held if their holder
    /// vanishes (crash safety): the call deadline when set, else the source's timeout
    /// (ten times it for streams, which have no whole-request timeout), plus a margin.
    pub(crate) fn lease(&self, src: &SourceConfig, stream: bool) -> Duration {
        let base = match self.scope.call_deadline {
            Some(d) => d,
            None if stream => src.timeout.saturating_mul(10),
            None => src.timeout,
        };
        base + LEASE_MARGIN
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
    ) -> Result<Pick, GovernanceError> {
        let capable = |i: usize| self.prefill_capable(i);
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
                None => !prefs.prefer_prefill || capable(i),
            },
            self.ports.rng.as_ref(),
        );
        order.retain(|&i| {
            prefs.only.is_none_or(|o| o == i)
                && prefs.allowed.as_ref().is_none_or(|a| a.contains(&i))
                && (!prefs.require_prefill || capable(i))
        });
        let mut refusals = Vec::new();
        for idx in order {
            let src = &self.scope.sources[idx];
            let lease = self.lease(src, stream);
            let probe = match self
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
                BreakerAdmit::Allowed { probe } => probe,
            };
            let acquired = self
                .ports
                .limiter
                .acquire(&self.acquire_request(src, stream))
                .await;
            match acquired {
                Ok(Admission::Admitted(permit)) => {
                    return Ok(Pick {
                        admitted: Some(Picked {
                            source_idx: idx,
                            permit,
                            probe,
                        }),
                        refusals,
                    });
                }
                Ok(Admission::Refused(r)) => {
                    self.release_probe(idx, probe).await;
                    refusals.push((src.name.clone(), r));
                }
                Err(e) => {
                    self.release_probe(idx, probe).await;
                    return Err(e);
                }
            }
        }
        Ok(Pick {
            admitted: None,
            refusals,
        })
    }

    /// Frees a half-open probe that no attempt used (a neutral outcome).
    pub(crate) async fn release_probe(&self, source: usize, probe: bool) {
        if probe {
            let src = &self.scope.sources[source];
            let _ = self
                .ports
                .breakers
                .record(
                    &self.scope.name,
                    &src.name,
                    BreakerOutcome::Neutral,
                    true,
                    &self.scope.breaker,
                )
                .await;
        }
    }

    /// [`Engine::release_probe`] from a `Drop` (a short task; nothing if no runtime).
    pub(crate) fn release_probe_in_background(self: &Arc<Self>, source: usize) {
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let engine = self.clone();
            handle.spawn(async move { engine.release_probe(source, true).await });
        }
    }
}
