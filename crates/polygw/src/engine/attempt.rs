//! One attempt: an HTTP request to one source, and what follows it — settlement of the
//! permit (SPEC §4.3), the breaker outcome (§4.4), the telemetry row (§8).
//!
//! An [`AttemptGuard`] is armed for the whole attempt. Its outcome is *decided*
//! synchronously when the round's state machine decides the leg's fate
//! ([`AttemptGuard::decide_success`], [`AttemptGuard::decide_failure`]) and *carried
//! out* asynchronously ([`AttemptGuard::finish`]). Dropped at any point, it completes
//! without awaiting: a decided outcome keeps its row and settlement; an undecided one
//! is a cancellation whose label the round set on the leg's [`LegControl`]
//! (`hedge_cancelled`, `deadline`, `cancelled`, `resume_diverged`) — the reservation is
//! settled through the permit's non-blocking path and the half-open probe freed
//! through the breaker store's non-blocking release.
//!
//! Every end of an attempt (finalized or dropped) wakes one call waiting for a runnable
//! source (SPEC §14.6): a freed slot or settled reservation serves one waiter, not all.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use polygw_core::breaker::BreakerOutcome;
use polygw_core::latency::GapTally;
use polygw_core::ports::{ChunkObserver, Permit};
use polygw_core::round::LegKind;
use polygw_core::settlement::{settle, AttemptOutcome};
use polygw_core::stall::{ms, StreamFigures};
use polygw_core::telemetry::{cost, CostBasis, RowKind, TelemetryRow};
use polygw_core::usage::{LegEstimate, LegUsage};
use polygw_core::{AttemptError, ErrorLabel, SourceConfig, Usage, UsageSource};

use super::admission::BreakerTicket;
use super::call::CallShared;
use super::Engine;

/// What a successful attempt tells settlement and telemetry.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SuccessFacts {
    pub usage: Usage,
    pub usage_source: UsageSource,
    pub figures: Option<StreamFigures>,
    pub http_status: u16,
    pub model: Option<String>,
    /// Priced per call (OCR) instead of per token.
    pub per_call_cost: bool,
    /// Settle this instead of the usage rule (OCR settles 0).
    pub settle_override: Option<u64>,
    /// The gateway's estimate of the attempt, when the provider reported no usage
    /// (SPEC §20.4): set by the round, never by [`Leg::facts`].
    pub estimate: Option<LegEstimate>,
}

/// One kind of attempt (chat, embedding batch, OCR image).
pub(crate) trait Leg: Send + Sync {
    /// What a successful attempt returns.
    type Output: Send;
    /// Whether the upstream is read as a stream.
    fn stream(&self) -> bool;
    /// Sends the request to `source`; `kind` says whether it is the original request
    /// or a resume (only chat legs resume).
    fn call<'a>(
        &'a self,
        engine: &'a Engine,
        source: &'a SourceConfig,
        call_id: &'a str,
        traceparent: Option<&'a str>,
        observer: &'a dyn ChunkObserver,
        kind: &'a LegKind,
    ) -> BoxFuture<'a, Result<Self::Output, AttemptError>>;
    /// The facts of a success.
    fn facts(&self, out: &Self::Output) -> SuccessFacts;
    /// Estimated prompt tokens of the request (usage of a leg cut before its usage
    /// frame, marked estimated).
    fn estimate_prompt_tokens(&self) -> u64 {
        0
    }
    /// The request's reasoning effort, when it sets one (the first-token prior grows
    /// with it: SPEC §25.1).
    fn reasoning_effort(&self) -> Option<&str> {
        None
    }
    /// Whether the request asks for one choice (`n` ≤ 1): only then may hedge and
    /// resume legs join it.
    fn single_choice(&self) -> bool {
        true
    }
    /// The most tokens the request asks to generate (`max_tokens` /
    /// `max_completion_tokens`; 0 when not set), for context-window routing.
    fn max_output_tokens(&self) -> u64 {
        0
    }
    /// Whether `source` can be sent this request (SPEC §23.1: a native source takes a
    /// request in its own API; `AUTH=client` one that carries the client's credential).
    fn servable_by(&self, _source: &SourceConfig) -> bool {
        true
    }
    /// Whether a streamed answer of this request may be resumed on another leg once it
    /// reached the caller.
    fn resumable(&self) -> bool {
        true
    }
    /// Whether a resume of this request on `source` may continue by prefill (else it
    /// replays: SPEC §23.6 — not with thinking on, never on a `responses` source).
    fn prefill_allowed(&self, _source: &SourceConfig) -> bool {
        true
    }
    /// Whether rows of this kind of attempt carry the gateway's estimate when the
    /// provider reports no usage (SPEC §20.4: chat attempts).
    fn estimates_usage(&self) -> bool {
        false
    }
    /// Bytes of text (content, reasoning, tool calls) a successful attempt returned, as
    /// [`polygw_core::usage::received_bytes`] counts them.
    fn received_bytes(&self, _out: &Self::Output) -> usize {
        0
    }
}

/// Shared by a leg's future (its guard and observer) and its round: the label the
/// round decided for a cancellation, what its row records when it ends without an
/// answer of its own, and whether a chunk must wake the round.
#[derive(Debug, Default)]
pub(crate) struct LegControl {
    /// 0 = none; `i + 1` = `ErrorLabel::ALL[i]`.
    label: AtomicU8,
    /// The next incremental chunk changes the round's timers (or must be forwarded).
    pub wake_on_chunk: AtomicBool,
    /// Set by the round when it cancels the leg: the usage its row records when the
    /// answer holds its text (SPEC §17.8), and its time to first token.
    ended: Mutex<Ended>,
    /// The upstream's headers a proxy passes on, once its answer started.
    headers: Mutex<Vec<(String, String)>>,
    /// Incremental chunks seen without their text (the transport passes no deltas when
    /// the round keeps no text: resume off and no sink): a received-token estimate of
    /// one token per chunk (SPEC §20.4).
    bare_chunks: AtomicU32,
    /// The gaps between its incremental chunks, tallied as they arrive (SPEC §19.1:
    /// the live stall distribution) with the floor below which they are only counted;
    /// `None` when the scope keeps no distributions.
    pub gaps: Mutex<Option<(Duration, GapTally)>>,
}

/// What the round knows of a leg that ends without a success of its own.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Ended {
    /// Estimated usage of a leg whose text the answer holds.
    pub usage: Option<LegUsage>,
    /// Its first incremental chunk, after its launch.
    pub ttft_ms: Option<u64>,
    /// The gateway's estimate of the leg, when its row records one (SPEC §20.4): the
    /// provider reported no usage and may have billed the request. A leg whose `usage`
    /// is estimated carries the same figures here.
    pub estimate: Option<LegEstimate>,
}

impl LegControl {
    /// An incremental chunk arrived at `at` (tallied when the scope keeps gaps).
    pub(crate) fn on_incremental(&self, at: Instant) {
        if let Some((floor, tally)) = self.gaps.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            tally.on_chunk(at, *floor);
        }
    }

    /// The leg's gap tally, taken (empty when none was kept).
    pub(crate) fn take_gaps(&self) -> GapTally {
        self.gaps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .map(|(_, t)| t)
            .unwrap_or_default()
    }

    pub(crate) fn set_label(&self, label: ErrorLabel) {
        let i = ErrorLabel::ALL
            .iter()
            .position(|l| *l == label)
            .map_or(0, |i| i + 1);
        self.label.store(i as u8, Ordering::SeqCst);
    }

    pub(crate) fn label(&self) -> Option<ErrorLabel> {
        match self.label.load(Ordering::SeqCst) {
            0 => None,
            i => ErrorLabel::ALL.get(i as usize - 1).copied(),
        }
    }

    pub(crate) fn set_headers(&self, h: &[(String, String)]) {
        *self.headers.lock().unwrap_or_else(|p| p.into_inner()) = h.to_vec();
    }

    pub(crate) fn headers(&self) -> Vec<(String, String)> {
        self.headers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// One incremental chunk arrived without its text.
    pub(crate) fn count_bare_chunk(&self) {
        self.bare_chunks.fetch_add(1, Ordering::Relaxed);
    }

    /// Incremental chunks that arrived without their text.
    pub(crate) fn bare_chunks(&self) -> u32 {
        self.bare_chunks.load(Ordering::Relaxed)
    }

    pub(crate) fn set_ended(&self, e: Ended) {
        *self.ended.lock().unwrap_or_else(|p| p.into_inner()) = e;
    }

    pub(crate) fn ended(&self) -> Ended {
        *self.ended.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A row's usage and cost for an estimate the round made (a cut leg's text).
fn record_estimate(row: &mut TelemetryRow, u: &LegUsage, src: &SourceConfig) {
    row.set_usage(&u.usage, u.source);
    row.cost = cost(
        CostBasis::Tokens {
            usage: &u.usage,
            source: u.source,
        },
        src,
    );
}

/// Identity of one leg.
#[derive(Debug, Clone)]
pub(crate) struct LegInfo {
    /// Position in the round (0 = primary).
    pub index: usize,
    /// Position in the logical call.
    pub attempt_index: u32,
    pub is_hedge: bool,
    pub source_idx: usize,
    pub call_id: String,
    pub launched_at: Instant,
    /// The breaker ticket the attempt was admitted with.
    pub probe: BreakerTicket,
    /// What it sends.
    pub kind: LegKind,
    /// A resume leg: the call_id of the attempt it continues.
    pub resume_of: Option<String>,
}

/// A decided outcome, not yet carried out.
struct Decided {
    tokens: u64,
    /// Boxed, as in the base: a row is large and a guard moves with its leg's answer
    /// (issue 27: each move a `memcpy` of the whole row).
    row: Box<TelemetryRow>,
    outcome: BreakerOutcome,
    /// A cooldown on top of the outcome (a 503 with a `Retry-After` hint).
    cooldown: Option<BreakerOutcome>,
    ttft: Option<u64>,
}

/// Armed for the whole attempt; see the module doc.
pub(crate) struct AttemptGuard {
    engine: Arc<Engine>,
    call: Arc<CallShared>,
    control: Arc<LegControl>,
    permit: Option<Permit>,
    /// The reservation its leg holds against the call's client key (SPEC §24.1).
    leg: Option<crate::client_keys::LegHold>,
    probe: BreakerTicket,
    source_idx: usize,
    started: Instant,
    /// The row's fixed part; taken (not cloned) by the one decision, or by the drop of
    /// an undecided attempt.
    base: Option<Box<TelemetryRow>>,
    /// A resume leg's mode (its metric label).
    resume_mode: Option<&'static str>,
    decided: Option<Decided>,
    armed: bool,
    /// Its answer is the call's: its row carries the call's trace (SPEC §19.4).
    winner: bool,
}

impl std::fmt::Debug for AttemptGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let row = self.base.as_ref().or(self.decided.as_ref().map(|d| &d.row));
        f.debug_struct("AttemptGuard")
            .field("call_id", &row.map(|r| r.call_id.as_str()))
            .field("armed", &self.armed)
            .finish()
    }
}

impl AttemptGuard {
    pub(crate) fn new(
        engine: Arc<Engine>,
        call: Arc<CallShared>,
        control: Arc<LegControl>,
        permit: Permit,
        leg: Option<crate::client_keys::LegHold>,
        info: &LegInfo,
        stream: bool,
    ) -> Self {
        let mut base = TelemetryRow::new(
            RowKind::Attempt,
            info.call_id.clone(),
            call.logical_call_id.clone(),
            engine.row_names.scope.clone(),
            engine.row_names.operation.clone(),
            0,
        );
        let [name, provider, model] = &engine.row_names.sources[info.source_idx];
        base.source = Some(name.clone());
        base.provider = Some(provider.clone());
        base.model = Some(model.clone());
        base.attempt_index = Some(info.attempt_index);
        base.is_hedge = info.is_hedge;
        base.stream = stream;
        base.api = call.api().map(str::to_string);
        call.label_row(&mut base);
        let mut resume_mode = None;
        if let LegKind::Resume { mode, prefix, .. } = &info.kind {
            base.resume_of = info.resume_of.clone();
            base.resume_mode = Some(mode.as_str().to_string());
            base.prefix_chars = Some(prefix.chars().count() as u64);
            resume_mode = Some(mode.as_str());
        }
        AttemptGuard {
            source_idx: info.source_idx,
            started: info.launched_at,
            engine,
            call,
            control,
            permit: Some(permit),
            leg,
            probe: info.probe,
            base: Some(Box::new(base)),
            resume_mode,
            decided: None,
            armed: true,
            winner: false,
        }
    }

    fn source(&self) -> &SourceConfig {
        &self.engine.scope.sources[self.source_idx]
    }

    /// The label a cancellation gets now: the round's decision, else the deadline or
    /// the caller's drop.
    fn cancel_label(&self) -> ErrorLabel {
        match self.control.label() {
            Some(l) => l,
            None if self.call.deadline_hit() => ErrorLabel::Deadline,
            None => ErrorLabel::Cancelled,
        }
    }

    /// The attempt's row, from the base. `None` once decided: the round decides a leg
    /// once and then finishes its guard, so a second decision is a bug that must not
    /// overwrite the first (it is logged and ignored).
    fn row(&mut self, wall: Duration) -> Option<Box<TelemetryRow>> {
        let Some(mut r) = self.base.take() else {
            tracing::error!("an attempt was decided twice; the first decision stands");
            return None;
        };
        r.created_at_ms = self.engine.ports.clock.unix_ms();
        r.latency_ms = Some(ms(wall));
        Some(r)
    }

    /// Decides a success: tokens to settle, breaker success, the row.
    pub(crate) fn decide_success(&mut self, facts: &SuccessFacts, wall: Duration) {
        let Some(row) = self.row(wall) else { return };
        self.engine.throttle().on_attempt(Ok(()));
        let src = &self.engine.scope.sources[self.source_idx];
        let est = self.engine.scope.est_tokens(src);
        let tokens = facts.settle_override.unwrap_or_else(|| {
            settle(
                AttemptOutcome::Success {
                    usage: &facts.usage,
                    source: facts.usage_source,
                },
                est,
            )
            .tokens()
        });
        let mut row = row;
        row.set_usage(&facts.usage, facts.usage_source);
        row.ok = true;
        row.http_status = Some(facts.http_status);
        if let Some(m) = &facts.model {
            if row.model.as_deref() != Some(m.as_str()) {
                row.model = Some(m.as_str().into());
            }
        }
        row.cost = cost(
            if facts.per_call_cost {
                CostBasis::PerCall
            } else {
                CostBasis::Tokens {
                    usage: &facts.usage,
                    source: facts.usage_source,
                }
            },
            src,
        );
        if let Some(e) = &facts.estimate {
            row.set_estimate(e);
        }
        if let Some(f) = facts.figures {
            row.ttft_ms = f.ttft_ms;
            row.max_inter_token_ms = f.max_inter_token_ms;
            row.stall_ms = f.stall_ms;
            row.stall_count = f.stall_count;
        }
        self.decided = Some(Decided {
            tokens,
            row,
            outcome: BreakerOutcome::Success,
            cooldown: None,
            ttft: facts.figures.and_then(|f| f.ttft_ms),
        });
    }

    /// Decides a failure: settlement per class, the breaker outcome, the row with its
    /// label. `fallback_cooldown` is the cooldown of a 429 without Retry-After.
    pub(crate) fn decide_failure(
        &mut self,
        error: &AttemptError,
        wall: Duration,
        fallback_cooldown: Duration,
        ended: Ended,
    ) {
        let Some(mut row) = self.row(wall) else {
            return;
        };
        self.engine.throttle().on_attempt(Err(error));
        let est = self.engine.scope.est_tokens(self.source());
        let tokens = settle(AttemptOutcome::Failed(error), est).tokens();
        row.error = Some(error.label.as_str().to_string());
        row.error_detail = Some(error.short_detail());
        row.http_status = error.http_status;
        row.cost = None;
        row.ttft_ms = ended.ttft_ms;
        if let Some(u) = &ended.usage {
            // A cut leg: its estimate, as the answer counts it (SPEC §17.8).
            record_estimate(&mut row, u, self.source());
        }
        if let Some(e) = &ended.estimate {
            row.set_estimate(e);
        }
        // SPEC §14.1: a hint cools the source down (429 and 503 alike), never for less
        // than the current backoff; without one, the backoff is the cooldown of a 429.
        let cooldown = error
            .retry_after
            .map_or(fallback_cooldown, |h| h.max(fallback_cooldown));
        let outcome = match error.label {
            // A replay that did not reproduce the text says nothing about the source.
            ErrorLabel::ResumeDiverged => BreakerOutcome::Neutral,
            _ => {
                BreakerOutcome::of_failure(error.class, cooldown, wall, &self.engine.scope.breaker)
            }
        };
        let extra = (error.class == polygw_core::ErrorClass::Transient
            && error.retry_after.is_some())
        .then_some(BreakerOutcome::RateLimited {
            cooldown_ms: polygw_core::classify::millis(polygw_core::classify::clamp_hint(cooldown)),
        });
        self.decided = Some(Decided {
            tokens,
            row,
            outcome,
            cooldown: extra,
            ttft: None,
        });
    }

    /// Carries out the decided outcome: settle, breaker, row. If this future is
    /// dropped half-way, the guard's drop completes it without awaiting.
    pub(crate) async fn finish(mut self) {
        let Some(d) = self.decided.as_ref() else {
            // Nothing decided: the drop records a cancellation.
            return;
        };
        let (tokens, outcome, extra, ttft) = (d.tokens, d.outcome, d.cooldown, d.ttft);
        let engine = self.engine.clone();
        let scope = engine.scope.name.as_str();
        let src_name = engine.scope.sources[self.source_idx].name.clone();
        if let Some(permit) = self.permit.as_mut() {
            if let Err(e) = permit.finish(tokens).await {
                tracing::warn!(source = %src_name, error = %e, "settlement failed; handed to the background path");
                if let Some(p) = self.permit.take() {
                    p.finish_in_background(tokens);
                }
            }
        }
        self.permit = None;
        if let Err(e) = engine
            .ports
            .breakers
            .record(
                scope,
                &src_name,
                outcome,
                self.probe.epoch,
                self.probe.probe,
                &engine.scope.breaker,
            )
            .await
        {
            tracing::warn!(source = %src_name, error = %e, "breaker update failed");
        }
        self.probe.probe = false;
        if let Some(c) = extra {
            if let Err(e) = engine
                .ports
                .breakers
                .record(
                    scope,
                    &src_name,
                    c,
                    self.probe.epoch,
                    false,
                    &engine.scope.breaker,
                )
                .await
            {
                tracing::warn!(source = %src_name, error = %e, "cooldown update failed");
            }
        }
        if let Some(mut d) = self.decided.take() {
            self.count(d.row.error.as_deref().unwrap_or("ok"), ttft);
            self.call.charge(
                d.tokens,
                polygw_core::telemetry::key_cost(&d.row),
                self.leg.take(),
            );
            if self.winner && engine.ports.telemetry.keeps_rows() {
                d.row.trace = Some(self.call.trace_json());
            }
            self.trace_attempt(&d.row);
            engine.ports.telemetry.record(*d.row);
        }
        self.armed = false;
        engine.freed.notify_one();
    }

    /// The attempt's span (SPEC §26.1), when the call is traced.
    fn trace_attempt(&self, row: &TelemetryRow) {
        if let Some(o) = self.call.otel() {
            let now = self.engine.ports.clock.now();
            o.attempt(
                row,
                self.started,
                now,
                &self.engine.source_servers[self.source_idx],
            );
        }
    }

    /// The tokens its permit reserved (what an undecided attempt settles).
    fn permit_est(&self) -> u64 {
        self.permit.as_ref().map_or(0, Permit::est_tokens)
    }

    /// This attempt's answer is the call's.
    pub(crate) fn mark_winner(&mut self) {
        self.winner = true;
    }

    fn count(&self, label: &str, ttft: Option<u64>) {
        self.engine.source_metrics[self.source_idx].attempt(label, ttft);
        if let Some(mode) = self.resume_mode {
            self.engine.scope_metrics.resume(mode, label);
        }
    }
}

impl Drop for AttemptGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let scope = self.engine.scope.name.clone();
        let src_name = self.source().name.clone();
        let (tokens, row, outcome, extra) = match self.decided.take() {
            // Dropped while finishing: the outcome is known, keep it.
            Some(d) => (Some(d.tokens), Some(d.row), d.outcome, d.cooldown),
            None => {
                let label = self.cancel_label();
                let wall = self
                    .engine
                    .ports
                    .clock
                    .now()
                    .saturating_duration_since(self.started);
                // Undecided, so the base is still there.
                let ended = self.control.ended();
                let engine = self.engine.clone();
                let src = &engine.scope.sources[self.source_idx];
                let row = self.row(wall).map(|mut row| {
                    row.ttft_ms = ended.ttft_ms;
                    if let Some(u) = &ended.usage {
                        record_estimate(&mut row, u, src);
                    }
                    if let Some(e) = &ended.estimate {
                        row.set_estimate(e);
                    }
                    row.error = Some(label.as_str().to_string());
                    row.error_detail = Some(match label {
                        ErrorLabel::HedgeCancelled => "another leg of the round won".to_string(),
                        ErrorLabel::Deadline => "the call deadline passed".to_string(),
                        ErrorLabel::ResumeDiverged => {
                            "the replayed answer diverged from the delivered text".to_string()
                        }
                        ErrorLabel::Invalid => {
                            "the leg held too much before anything could be forwarded".to_string()
                        }
                        _ => "the caller dropped the call".to_string(),
                    });
                    row
                });
                (None, row, BreakerOutcome::Neutral, None)
            }
        };
        if let Some(mut row) = row {
            self.count(row.error.as_deref().unwrap_or("ok"), None);
            // Undecided: its reservation is what it settles (and its cost is unknown).
            // Decided (dropped while finishing): what its row charges, as in `finish`.
            self.call.charge(
                tokens.unwrap_or_else(|| self.permit_est()),
                polygw_core::telemetry::key_cost(&row),
                self.leg.take(),
            );
            if self.winner && self.engine.ports.telemetry.keeps_rows() {
                row.trace = Some(self.call.trace_json());
            }
            self.trace_attempt(&row);
            self.engine.ports.telemetry.record(*row);
        }
        if let Some(permit) = self.permit.take() {
            match tokens {
                Some(t) => permit.finish_in_background(t),
                // Cancelled: the reservation (est) settles through the permit's drop.
                None => drop(permit),
            }
        }
        match (outcome, extra) {
            (BreakerOutcome::Neutral, None) => {
                if self.probe.probe {
                    // Free the half-open probe; never a breaker failure (a cancelled
                    // leg is not a dead source). Non-blocking, nothing spawned.
                    self.engine
                        .ports
                        .breakers
                        .release_probe(&scope, &src_name, self.probe.epoch);
                }
            }
            // Dropped while its decided outcome was being recorded (rare): the record
            // needs an await, so a short task carries it.
            (outcome, extra) => {
                if let Ok(handle) = tokio::runtime::Handle::try_current() {
                    let breakers = self.engine.ports.breakers.clone();
                    let settings = self.engine.scope.breaker;
                    let ticket = self.probe;
                    handle.spawn(async move {
                        let _ = breakers
                            .record(
                                &scope,
                                &src_name,
                                outcome,
                                ticket.epoch,
                                ticket.probe,
                                &settings,
                            )
                            .await;
                        if let Some(c) = extra {
                            let _ = breakers
                                .record(&scope, &src_name, c, ticket.epoch, false, &settings)
                                .await;
                        }
                    });
                } else if self.probe.probe {
                    self.engine
                        .ports
                        .breakers
                        .release_probe(&scope, &src_name, self.probe.epoch);
                }
            }
        }
        self.engine.freed.notify_one();
    }
}
