//! The retry loop (SPEC §6): admission (waiting for a runnable source within the stall
//! window), a round, then core's [`RetryState`] decides — retry after a backoff, or end
//! with a terminal reason. The call deadline wraps this future from outside.

use std::collections::BTreeSet;
use std::sync::Arc;

use polygw_core::admission::{jittered, on_no_runnable, NoRunnable};
use polygw_core::backoff::backoff_cap;
use polygw_core::hedge::HedgePolicy;
use polygw_core::retry::{RetryState, RoundVerdict};
use polygw_core::{GatewayError, TerminalReason};

use super::admission::Picked;
use super::attempt::Leg;
use super::call::CallShared;
use super::round::{DeltaSink, RoundOutcome, Won};
use super::Engine;

impl Engine {
    /// Waits for an admitted source: `ON_NO_RUNNABLE=wait` waits for the earliest hint
    /// (with jitter), bounded by the stall window, or until an attempt of this client
    /// frees a slot (one waiter per freed slot, SPEC §14.6); `fail` (or nothing that
    /// passes with time) ends the call with `no_runnable_source`.
    async fn admit(
        &self,
        call: &Arc<CallShared>,
        retry: &mut RetryState,
        stream: bool,
    ) -> Result<Picked, GatewayError> {
        let none = BTreeSet::new();
        loop {
            // A slot freed meanwhile is not missed: `notify_one` keeps a permit for the
            // next waiter when none is waiting.
            let freed = self.freed.notified();
            let pick = self
                .try_pick(&none, &call.failed_sources(), stream)
                .await
                .map_err(|e| {
                    call.terminal(TerminalReason::GovernanceBackend, Some(e.to_string()))
                })?;
            call.note_refusals(&pick.refusals);
            if let Some(p) = pick.admitted {
                return Ok(p);
            }
            match on_no_runnable(&pick.refusals, self.scope.retry.on_no_runnable) {
                NoRunnable::Fail => {
                    return Err(call.terminal(TerminalReason::NoRunnableSource, None));
                }
                NoRunnable::Wait(hint) => {
                    let now = self.ports.clock.now();
                    match retry.on_no_runnable(now) {
                        None => {
                            return Err(call.terminal(
                                TerminalReason::Stalled,
                                Some(
                                    "no source could be admitted within RETRY__STALL_WINDOW_S"
                                        .into(),
                                ),
                            ))
                        }
                        Some(left) => {
                            let wait = jittered(hint, self.ports.rng.as_ref()).min(left);
                            tracing::debug!(
                                wait_ms = wait.as_millis() as u64,
                                "no runnable source; waiting"
                            );
                            // Until the hint, or until an attempt of ours frees a slot.
                            tokio::select! {
                                _ = tokio::time::sleep(wait) => {}
                                _ = freed => {}
                            }
                        }
                    }
                }
            }
        }
    }

    /// Runs rounds until one wins or the loop ends the call.
    pub(crate) async fn run_call<L: Leg>(
        self: &Arc<Self>,
        leg: &L,
        call: &Arc<CallShared>,
        policy: HedgePolicy,
        sink: Option<Arc<dyn DeltaSink>>,
    ) -> Result<Won<L::Output>, GatewayError> {
        let mut retry = RetryState::new(&self.scope.retry);
        loop {
            let picked = self.admit(call, &mut retry, leg.stream()).await?;
            let round_started = self.ports.clock.now();
            // A 429 without Retry-After cools its source down for the current backoff.
            let cooldown = backoff_cap(
                retry.budget_used(),
                self.scope.retry.backoff_base,
                self.scope.retry.backoff_max,
            );
            let outcome = self
                .run_round(leg, call, picked, policy, sink.clone(), cooldown)
                .await
                .map_err(|e| {
                    call.terminal(TerminalReason::GovernanceBackend, Some(e.to_string()))
                })?;
            match outcome {
                RoundOutcome::Won(w) => return Ok(w),
                RoundOutcome::Failed {
                    error,
                    refunded,
                    committed,
                } => {
                    call.progress().last_error = Some(error.clone());
                    if committed {
                        // Its content is already on the wire: never retried elsewhere.
                        return Err(call.terminal(
                            TerminalReason::RetryExhausted,
                            Some("the streamed answer failed after its first chunk reached the client; it cannot be retried".into()),
                        ));
                    }
                    let now = self.ports.clock.now();
                    match retry.on_round_failed(
                        now,
                        round_started,
                        &error,
                        refunded,
                        self.ports.rng.as_ref(),
                    ) {
                        RoundVerdict::Retry { backoff } => {
                            if !backoff.is_zero() {
                                tokio::time::sleep(backoff).await;
                            }
                        }
                        RoundVerdict::Fail(reason) => return Err(call.terminal(reason, None)),
                    }
                }
            }
        }
    }
}
