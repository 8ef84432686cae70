//! The retry loop (SPEC §6, §13): admission (waiting for a runnable source within the
//! stall window), a round, then core's [`RetryState`] decides — retry after a backoff,
//! or end with a terminal reason. A streamed answer that failed after its first chunk
//! continues in the next round from the round's resume point (prefill on a capable
//! source, else replay; a plain restart in aggregated calls); if nothing can resume,
//! the call ends with that stream's original failure. The call deadline wraps this
//! future from outside and is also the rounds' own deadline.

use std::collections::BTreeSet;
use std::sync::Arc;

use polygw_core::admission::{
    jittered, larger_context_candidates, on_no_runnable, too_small_for, NoRunnable,
};
use polygw_core::classify::is_context_length;
use polygw_core::hedge::HedgePolicy;
use polygw_core::resume::{ResumeBudget, ResumeMode, ResumeSetting};
use polygw_core::retry::{RetryState, RoundVerdict};
use polygw_core::round::gate::{leg_gate, Gate, GateAsk, RoundKind};
use polygw_core::round::{Carried, LegKind, RoundSpec};
use polygw_core::usage::LegUsage;
use polygw_core::{AttemptError, GatewayError, RetryPrefer, ScopeKind, TerminalReason};

use super::admission::{PickPrefs, Picked};
use super::attempt::Leg;
use super::call::CallShared;
use super::round::{DeltaSink, RoundOutcome, RoundStart, Won};
use super::Engine;

/// The stream a continuation round resumes.
struct Continuation {
    carried: Carried,
    /// The call_id of the attempt whose text it is.
    from: Option<String>,
    /// The text reached the caller (passthrough).
    delivered_to_caller: bool,
    /// The usage of the legs that produced the text (counted in the answer when the
    /// next winner's answer holds it).
    parts: Vec<LegUsage>,
}

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
        prefs: &PickPrefs,
    ) -> Result<Picked, GatewayError> {
        loop {
            // A slot freed meanwhile is not missed: `notify_one` keeps a permit for the
            // next waiter when none is waiting.
            let freed = self.freed.notified();
            let pick = self
                .try_pick_with(
                    &call.excluded_sources(),
                    &call.failed_sources(),
                    stream,
                    prefs.clone(),
                    call.key().as_ref(),
                )
                .await
                .map_err(|e| {
                    call.terminal(TerminalReason::GovernanceBackend, Some(e.to_string()))
                })?;
            call.note_refusals(&pick.refusals);
            if let Some(p) = pick.admitted {
                retry.on_admitted(self.ports.clock.now());
                return Ok(p);
            }
            if on_no_runnable(&pick.refusals, self.scope.retry.on_no_runnable) == NoRunnable::Fail {
                return Err(call.terminal(TerminalReason::NoRunnableSource, None));
            }
            let now = self.ports.clock.now();
            // The bound on waiting: what is left of the stall window (or the call's own
            // max wait), or of the deadline when that is nearer; named in the error.
            let bound = call.wait_bound_name(&self.scope.retry);
            let (left, bound) = match (
                retry.on_no_runnable(now),
                self.scope
                    .call_deadline
                    .map(|d| (call.started + d).saturating_duration_since(now)),
            ) {
                (None, _) => {
                    return Err(call.terminal(
                        TerminalReason::Stalled,
                        Some(format!("no source could be admitted within {bound}")),
                    ))
                }
                (Some(w), Some(d)) if d < w => (d, "CALL_DEADLINE_S".to_string()),
                (Some(w), _) => (w, bound),
            };
            match NoRunnable::within(&pick.refusals, self.scope.retry.on_no_runnable, left) {
                NoRunnable::Fail => {
                    return Err(call.terminal(TerminalReason::NoRunnableSource, None));
                }
                NoRunnable::Beyond(hint) => {
                    // SPEC §17.2: known at once; the caller is not held for nothing.
                    return Err(call.terminal(
                        TerminalReason::Stalled,
                        Some(format!(
                            "no source can take the call within {bound} ({:.1} s left): the \
                             earliest admission is in {:.1} s",
                            left.as_secs_f64(),
                            hint.as_secs_f64()
                        )),
                    ));
                }
                NoRunnable::Wait(hint) => {
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

    /// What the primary of a round sends: the original request, or a continuation
    /// of the carried text by prefill (capable source, no tool call) or replay.
    fn primary_kind<L: Leg>(
        &self,
        leg: &L,
        cont: Option<&Continuation>,
        source: usize,
    ) -> Option<LegKind> {
        let Some(c) = cont else {
            return Some(LegKind::Fresh);
        };
        let text = &c.carried.delivered;
        if self.prefills(leg, text, source) && !text.content.is_empty() {
            return Some(LegKind::Resume {
                mode: ResumeMode::Prefill,
                prefix: text.content.clone(),
                of: None,
            });
        }
        if !c.delivered_to_caller {
            // Aggregated: nothing reached the caller, a replay is a plain restart.
            return Some(LegKind::Fresh);
        }
        (self.scope.stream.resume == ResumeSetting::Auto).then(|| LegKind::Resume {
            mode: ResumeMode::Replay,
            prefix: text.content.clone(),
            of: None,
        })
    }

    /// Ends a call whose stream reached the caller and cannot be continued: the
    /// stream's original failure is the error.
    fn unresumable(
        &self,
        call: &CallShared,
        original: AttemptError,
        reason: TerminalReason,
        why: &str,
    ) -> GatewayError {
        call.progress().last_error = Some(original);
        call.terminal(
            reason,
            Some(format!(
                "the streamed answer failed after its first chunk reached the client; {why}"
            )),
        )
    }

    /// Runs rounds until one wins or the loop ends the call.
    pub(crate) async fn run_call<L: Leg>(
        self: &Arc<Self>,
        leg: &L,
        call: &Arc<CallShared>,
        policy: HedgePolicy,
        sink: Option<Arc<dyn DeltaSink>>,
    ) -> Result<Won<L::Output>, GatewayError> {
        let mut retry = RetryState::new(&call.retry_settings(&self.scope.retry));
        let stream_settings = self.scope.stream;
        let resume_setting = if leg.stream()
            && self.kind == ScopeKind::Chat
            && leg.single_choice()
            && leg.resumable()
        {
            stream_settings.resume
        } else {
            ResumeSetting::Off
        };
        let passthrough = sink.is_some();
        let mut cont: Option<Continuation> = None;
        // MAX_RESUMES over the whole call: continuation primaries and the resume legs
        // rounds launch alike (SPEC §17.8).
        let mut resumes = ResumeBudget::new(stream_settings.max_resumes);
        // RETRY__PREFER=same: the source the next round tries first, once each.
        let mut prefer_same: Option<usize> = None;
        let mut retried_same: BTreeSet<usize> = BTreeSet::new();
        // A context-length rejection routed to larger windows (SPEC §17.9): the next
        // round's candidates, the smallest larger window first.
        let mut restrict: Option<(BTreeSet<usize>, usize)> = None;
        if self.kind == ScopeKind::Chat {
            // Sources whose known window cannot hold the request are never sent it.
            let need = leg
                .estimate_prompt_tokens()
                .saturating_add(leg.max_output_tokens());
            let small = too_small_for(&self.scope.sources, need);
            if !small.is_empty() {
                tracing::debug!(
                    need,
                    skipped = small.len(),
                    "sources with too small a CONTEXT_WINDOW skipped"
                );
                call.exclude(
                    small
                        .into_iter()
                        .map(|i| self.scope.sources[i].name.clone()),
                );
            }
        }
        // Sources of another API than the request's are not sent it (SPEC §23.1).
        let foreign: Vec<String> = self
            .scope
            .sources
            .iter()
            .filter(|s| !leg.servable_by(s))
            .map(|s| s.name.clone())
            .collect();
        if !foreign.is_empty() {
            if foreign.len() == self.scope.sources.len() {
                let apis: BTreeSet<&str> =
                    self.scope.sources.iter().map(|s| s.api.as_str()).collect();
                let client_auth = self
                    .scope
                    .sources
                    .iter()
                    .all(|s| s.auth == Some(polygw_core::source::SourceAuth::Client));
                let message = if client_auth {
                    format!(
                        "every source of scope {} takes the client's own credential \
                         (AUTH=client): send it as Authorization: Bearer or x-api-key (besides \
                         the proxy's key, when the proxy asks for one)",
                        self.scope.name
                    )
                } else {
                    format!(
                        "every source of scope {} speaks the {} API, and a request in another \
                         API cannot be sent to it yet (send it to that API's route)",
                        self.scope.name,
                        apis.into_iter().collect::<Vec<_>>().join(" / ")
                    )
                };
                return Err(GatewayError::InvalidRequest {
                    field: "model".into(),
                    message,
                });
            }
            call.exclude(foreign);
        }
        // The source the call's affinity key last went to (SPEC §20.2).
        let recall = self.recall(call).await;
        // After a failed round: the backoff before the next, and whether that round
        // first tries a failover to a source the call has not tried, at once (SPEC
        // §25.4; only if one admits now, else the backoff applies as before).
        let mut pending: Option<(std::time::Duration, bool)> = None;
        // The retry throttle allows only failovers to untried sources (core's leg gate).
        let mut only_untried = false;
        loop {
            let mut prefs = match &cont {
                Some(c) => PickPrefs {
                    prefer_prefill: true,
                    require_prefill: c.delivered_to_caller
                        && resume_setting == ResumeSetting::Prefill,
                    prefill_to: Some(self.prefill_targets(leg, &c.carried.delivered)),
                    family: call.family(),
                    ..PickPrefs::default()
                },
                None => PickPrefs::default(),
            };
            prefs.first = prefer_same.take();
            if let Some((allowed, first)) = restrict.take() {
                prefs.allowed = Some(allowed);
                prefs.first = prefs.first.or(Some(first));
            }
            // A fresh round's primary goes to the key's source first; a continuation, a
            // retry of the same source or a context-length route keeps its own order.
            if cont.is_none() && prefs.first.is_none() && prefs.allowed.is_none() {
                prefs.sticky = recall.as_ref().and_then(|r| r.sticky);
            }
            if prefs.require_prefill && prefs.prefill_to.as_ref().is_some_and(|t| t.is_empty()) {
                let original = cont.map(|c| c.carried.original).unwrap_or_else(|| {
                    AttemptError::new(
                        polygw_core::ErrorClass::Transient,
                        polygw_core::ErrorLabel::Truncated,
                        "the stream failed",
                    )
                });
                return Err(self.unresumable(
                    call,
                    original,
                    TerminalReason::RetryExhausted,
                    "STREAM__RESUME=prefill and no source of the scope can continue this answer by prefill",
                ));
            }
            if std::mem::take(&mut only_untried) {
                self.restrict_to_untried(call, &mut prefs);
            }
            let mut prepicked = None;
            if let Some((wait, failover)) = pending.take() {
                if failover {
                    prepicked = self
                        .failover_now(call, &mut retry, leg.stream(), &prefs)
                        .await?;
                }
                if prepicked.is_none() && !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
            }
            let admitted = match prepicked {
                Some(p) => Ok(p),
                None => self.admit(call, &mut retry, leg.stream(), &prefs).await,
            };
            let picked = match admitted {
                Ok(p) => p,
                Err(e) => {
                    // A continuation that cannot be admitted ends with the stream's
                    // own failure as the last error.
                    if let (Some(c), Some(reason)) = (&cont, e.terminal_reason()) {
                        if c.delivered_to_caller {
                            let why = format!("no source could take it over ({reason})");
                            return Err(self.unresumable(
                                call,
                                c.carried.original.clone(),
                                reason,
                                &why,
                            ));
                        }
                    }
                    return Err(e);
                }
            };
            let Some(kind) = self.primary_kind(leg, cont.as_ref(), picked.source_idx) else {
                // STREAM__RESUME=prefill admitted only capable sources: not reached.
                let c = cont.take().map(|c| c.carried.original);
                return Err(self.unresumable(
                    call,
                    c.unwrap_or_else(|| {
                        AttemptError::new(
                            polygw_core::ErrorClass::Transient,
                            polygw_core::ErrorLabel::Truncated,
                            "the stream failed",
                        )
                    }),
                    TerminalReason::RetryExhausted,
                    "no source can continue it",
                ));
            };
            if kind.resume_mode().is_some() && !resumes.take_primary() {
                // A continuation is only set up while the budget allows one.
                let original = cont.take().map(|c| c.carried.original);
                return Err(self.unresumable(
                    call,
                    original.unwrap_or_else(|| {
                        AttemptError::new(
                            polygw_core::ErrorClass::Transient,
                            polygw_core::ErrorLabel::Truncated,
                            "the stream failed",
                        )
                    }),
                    TerminalReason::RetryExhausted,
                    "STREAM__MAX_RESUMES is spent",
                ));
            }
            let round_started = self.ports.clock.now();
            // A source that answers 429 (or a hinted 503) cools down for at least the
            // current backoff, refunded rounds included: no tight loop (SPEC §14.1).
            let fallback_cooldown = retry.cooldown();
            let carried_from = cont.as_ref().and_then(|c| c.from.clone());
            // The `auto` thresholds in force per source (static ones are the policy's).
            let thresholds = (self.scope.hedge.uses_auto() && policy.max_extra > 0).then(|| {
                let fill = self
                    .budget()
                    .fill(round_started, self.scope.hedge.budget_pct);
                let t = self.latency.thresholds(leg.stream(), round_started, fill);
                self.latency.for_request(
                    t,
                    leg.stream(),
                    leg.estimate_prompt_tokens(),
                    leg.reasoning_effort(),
                )
            });
            let ((after_ms, after_from), (stall_ms, stall_from)) =
                match thresholds.as_ref().and_then(|t| t.get(picked.source_idx)) {
                    Some(t) => (
                        polygw_core::trace::threshold_parts(&t.after),
                        polygw_core::trace::threshold_parts(&t.stall_after),
                    ),
                    None => (
                        polygw_core::trace::static_parts(policy.after),
                        polygw_core::trace::static_parts(policy.stall_after),
                    ),
                };
            call.trace(
                round_started,
                polygw_core::trace::TraceEvent::Round {
                    n: call.next_round(),
                    after_ms,
                    after_from,
                    stall_ms,
                    stall_from,
                },
            );
            let triggers = thresholds
                .map(|t| super::latency::triggers(&t))
                .unwrap_or_default();
            let spec = RoundSpec {
                policy,
                triggers,
                passthrough,
                resume: resume_setting,
                resumes_left: resumes.left(),
                deadline: self.scope.call_deadline.map(|d| call.started + d),
                primary_source: picked.source_idx,
                primary_kind: kind,
                carried: cont.as_ref().map(|c| c.carried.clone()),
            };
            let outcome = self
                .run_round(
                    leg,
                    call,
                    RoundStart {
                        primary: picked,
                        spec,
                        carried_from,
                        sink: sink.clone(),
                        fallback_cooldown,
                    },
                )
                .await;
            match outcome {
                RoundOutcome::Won(mut w) => {
                    if w.uses_carried {
                        if let Some(c) = cont.as_mut() {
                            w.parts.append(&mut c.parts);
                        }
                    }
                    // The winner's source becomes the key's source.
                    if let Some(r) = &recall {
                        self.remember(r, w.info.source_idx).await;
                    }
                    return Ok(w);
                }
                RoundOutcome::Deadline => {
                    call.mark_deadline();
                    return Err(self.deadline_error(call));
                }
                RoundOutcome::Failed {
                    error,
                    source,
                    refunded,
                    resume,
                    resume_of,
                    parts: mut p,
                    uses_carried,
                    resumes: round_resumes,
                } => {
                    resumes.on_round(round_resumes);
                    if uses_carried {
                        if let Some(c) = cont.as_mut() {
                            p.append(&mut c.parts);
                        }
                    }
                    call.progress().last_error = Some(error.clone());
                    // SPEC §14.9: a context-length rejection goes once to a source with
                    // a larger window (or another model) not yet tried.
                    if let (Some(src), None) = (source, &resume) {
                        if is_context_length(&error) {
                            let tried = call.tried_sources(&self.scope.sources);
                            let excluded = call.excluded_sources();
                            let to: Vec<usize> =
                                larger_context_candidates(&self.scope.sources, src, &tried)
                                    .into_iter()
                                    .filter(|&i| !excluded.contains(&self.scope.sources[i].name))
                                    .collect();
                            if let Some(&first) = to.first() {
                                tracing::info!(
                                    rejected_by = %self.scope.sources[src].name,
                                    next = %self.scope.sources[first].name,
                                    "context length exceeded: trying a source with a larger window"
                                );
                                restrict = Some((to.into_iter().collect(), first));
                                continue;
                            }
                        }
                    }
                    if let Some(rp) = resume {
                        let resumable = rp.resumable
                            && resumes.left() > 0
                            && resume_setting != ResumeSetting::Off;
                        if rp.delivered_to_caller && !resumable {
                            let why = if resume_setting == ResumeSetting::Off {
                                "STREAM__RESUME=off"
                            } else {
                                "STREAM__MAX_RESUMES is spent"
                            };
                            return Err(self.unresumable(
                                call,
                                rp.original,
                                TerminalReason::RetryExhausted,
                                why,
                            ));
                        }
                        cont = resumable.then_some(Continuation {
                            carried: Carried {
                                delivered: rp.delivered,
                                role_sent: rp.role_sent,
                                original: rp.original,
                            },
                            from: resume_of,
                            delivered_to_caller: rp.delivered_to_caller,
                            parts: p,
                        });
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
                            // SPEC §25.4: retries do not multiply an outage.
                            let untried_left = !self.untried(call).is_empty();
                            let gate = leg_gate(GateAsk {
                                round: RoundKind::Retry,
                                throttle_allows: self.throttle().allows_retry(),
                                untried_left,
                            });
                            match gate {
                                Gate::Throttled => {
                                    let why = format!(
                                        "retries are throttled (the scope's retry bucket is at {:.1} of {} tokens: too many attempts failed lately; RETRY__THROTTLE_MAX) and every source was tried",
                                        self.throttle().tokens(),
                                        self.scope.retry.throttle.max_tokens
                                    );
                                    tracing::info!(scope = %self.scope.name, "{why}");
                                    if let Some(c) = cont.filter(|c| c.delivered_to_caller) {
                                        return Err(self.unresumable(
                                            call,
                                            c.carried.original,
                                            TerminalReason::RetryExhausted,
                                            &why,
                                        ));
                                    }
                                    return Err(
                                        call.terminal(TerminalReason::RetryExhausted, Some(why))
                                    );
                                }
                                Gate::UntriedOnly => {
                                    // A failover, never throttled: at once.
                                    only_untried = true;
                                    prefer_same = None;
                                    pending = Some((std::time::Duration::ZERO, false));
                                    continue;
                                }
                                Gate::Launch => {}
                            }
                            let mut wait = backoff;
                            // A stream that broke after its first chunk resumes on
                            // another source, prefill-capable first (docs/HEDGING.md),
                            // never first on the one that cut it (issue 22, item 16).
                            if let Some(src) = source.filter(|s| {
                                self.scope.retry.prefer == RetryPrefer::Same
                                    && cont.is_none()
                                    && !retried_same.contains(s)
                                    && self.retries_same(&error)
                            }) {
                                retried_same.insert(src);
                                prefer_same = Some(src);
                                // The same source "after its hint or backoff" (SPEC
                                // §14.8): wait out the cooldown its failure recorded,
                                // or admission would pass it over for the next source.
                                wait = wait.max(same_source_cooldown(&error, fallback_cooldown));
                            }
                            // A failover to a source the call has not tried goes at
                            // once when one admits; otherwise the backoff applies.
                            let failover =
                                prefer_same.is_none() && restrict.is_none() && untried_left;
                            pending = Some((wait, failover));
                        }
                        RoundVerdict::Fail(reason) => {
                            if let Some(c) = cont.filter(|c| c.delivered_to_caller) {
                                return Err(self.unresumable(
                                    call,
                                    c.carried.original,
                                    reason,
                                    "the retry budget is spent",
                                ));
                            }
                            return Err(call.terminal(reason, None));
                        }
                    }
                }
            }
        }
    }

    /// The sources the call has not tried and may still pick.
    fn untried(&self, call: &CallShared) -> BTreeSet<usize> {
        let tried = call.tried_sources(&self.scope.sources);
        let excluded = call.excluded_sources();
        (0..self.scope.sources.len())
            .filter(|i| !tried.contains(i) && !excluded.contains(&self.scope.sources[*i].name))
            .collect()
    }

    /// Narrows `prefs` to the sources the call has not tried (within any restriction
    /// it already has); a preferred first source outside them is dropped.
    fn restrict_to_untried(&self, call: &CallShared, prefs: &mut PickPrefs) {
        let untried = self.untried(call);
        prefs.allowed = Some(match prefs.allowed.take() {
            Some(a) => a.intersection(&untried).copied().collect(),
            None => untried,
        });
        prefs.first = prefs
            .first
            .filter(|f| prefs.allowed.as_ref().is_some_and(|a| a.contains(f)));
    }

    /// One pick without waiting among the sources the call has not tried (SPEC §25.4:
    /// a failover goes at once): the admitted source, or none (the backoff then
    /// applies and admission goes on as usual).
    async fn failover_now(
        &self,
        call: &Arc<CallShared>,
        retry: &mut RetryState,
        stream: bool,
        prefs: &PickPrefs,
    ) -> Result<Option<Picked>, GatewayError> {
        let mut p = prefs.clone();
        self.restrict_to_untried(call, &mut p);
        if p.allowed.as_ref().is_some_and(BTreeSet::is_empty) {
            return Ok(None);
        }
        p.sticky = None;
        let pick = self
            .try_pick_with(
                &call.excluded_sources(),
                &call.failed_sources(),
                stream,
                p,
                call.key().as_ref(),
            )
            .await
            .map_err(|e| call.terminal(TerminalReason::GovernanceBackend, Some(e.to_string())))?;
        call.note_refusals(&pick.refusals);
        if pick.admitted.is_some() {
            retry.on_admitted(self.ports.clock.now());
        }
        Ok(pick.admitted)
    }

    /// `RETRY__PREFER=same` retries the source after a transient failure: 5xx, reset,
    /// timeout, or a 429 whose hint is at most `BACKOFF_MAX_S`.
    fn retries_same(&self, e: &AttemptError) -> bool {
        match e.class {
            polygw_core::ErrorClass::Transient => true,
            polygw_core::ErrorClass::RateLimited => e
                .retry_after
                .is_none_or(|h| h <= self.scope.retry.backoff_max),
            _ => false,
        }
    }

    /// The terminal error of a call whose deadline passed.
    pub(crate) fn deadline_error(&self, call: &CallShared) -> GatewayError {
        let d = self.scope.call_deadline.unwrap_or_default();
        call.terminal(
            TerminalReason::DeadlineExceeded,
            Some(format!("CALL_DEADLINE_S of {:.3}s passed", d.as_secs_f64())),
        )
    }
}

/// The cooldown a failure recorded on its source (see `attempt.rs`): a 429 cools down
/// for its hint or at least the current backoff; a hinted 503 for its hint; other
/// failures record none.
fn same_source_cooldown(e: &AttemptError, fallback: std::time::Duration) -> std::time::Duration {
    match (e.class, e.retry_after) {
        (polygw_core::ErrorClass::RateLimited, h) => h.map_or(fallback, |h| h.max(fallback)),
        (_, Some(h)) => h,
        (_, None) => std::time::Duration::ZERO,
    }
}
