//! One round of the retry loop, executed (SPEC §7, §13): core's
//! [`Round`](polygw_core::round::Round) state machine decides which leg starts, wins,
//! is committed, resumes, and how every leg ends; this module only turns I/O into its
//! events and its actions into I/O.
//!
//! - Legs are futures polled inside the round's future (nothing spawned); their
//!   observers queue chunk events, which the round feeds to the machine in arrival
//!   order. A chunk wakes the round only when the machine says it matters now
//!   (passthrough forwarding, or a stall trigger it arms); other chunks wait in the
//!   queue until the next timer or leg end, so a plain aggregated stream costs no
//!   wake-up per chunk. Since the legs only run inside the round's own poll, a chunk
//!   that matters is seen by that same poll: the queue never wakes the round's task
//!   from inside it (a self-wake is a yield to tokio, which wakes another worker), and
//!   the legs sit in a [`FutureSet`], which does not wake its own task either.
//! - Legs, the hedge admission in flight, the finalization of ended legs and the
//!   timers are polled together: nothing the round awaits stops the legs.
//! - Legs that end in the same poll are fed in launch order, after every chunk that
//!   came before them.
//! - A leg's fate is set on its guard synchronously when the machine decides it, so a
//!   deadline or a drop while fates are being carried out keeps them; dropping the
//!   round feeds the caller's drop (or the deadline) to the machine so that even then
//!   every label comes from it.

use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::future::{AbortHandle, Abortable, BoxFuture, FutureExt};
use futures_util::stream::StreamExt;

use super::future_set::FutureSet;
use polygw_core::hedge::BudgetTicket;
use polygw_core::latency::{GapTally, LegTimes};
use polygw_core::ports::{ChunkObserver, StreamDelta};
use polygw_core::resume::{prefill_takes_trailing_whitespace, ResumeMode, Transcript};
use polygw_core::round::{
    Action, CancelReason, Event, Fate, LegEnd, LegId, LegKind, PickRequest,
    Picked as MachinePicked, ResumePoint, Round, RoundResult, RoundSpec,
};
use polygw_core::telemetry::may_be_billed;
use polygw_core::trace::TraceEvent;
use polygw_core::usage::{cut_leg_usage, leg_prompt_estimate, LegEstimate, LegUsage};
use polygw_core::{AttemptError, GovernanceError, ScopeKind};
use tracing::Instrument;

use super::admission::{Pick, PickPrefs, Picked};
use super::attempt::{AttemptGuard, Ended, Leg, LegControl, LegInfo, SuccessFacts};
use super::call::CallShared;
use super::Engine;
use crate::clock::new_id;

/// Which leg a passthrough stream committed to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// The logical call.
    pub logical_call_id: String,
    /// The committed leg's source.
    pub source: String,
    /// The model asked of that source.
    pub model: String,
    /// The committed leg is an extra hedge leg.
    pub is_hedge: bool,
    /// The call's first commit (a proxy sends its headers then); later commits are
    /// resume legs taking over the stream.
    pub first: bool,
    /// The committed leg continues the stream by this mode, when it is a resume leg.
    pub resume_mode: Option<ResumeMode>,
    /// The committed attempt's upstream headers a proxy passes on (`x-request-id`,
    /// `x-ratelimit-*`: SPEC §17.4).
    pub upstream_headers: Vec<(String, String)>,
}

/// Receives a passthrough stream (`polygw serve`, `chat_streaming`, `chat_stream`):
/// one uninterrupted sequence of chunks, whichever legs produce them.
pub trait DeltaSink: Send + Sync {
    /// A leg was committed (before its first chunk is sent).
    fn committed(&self, _commit: &Commit) {}
    /// The next chunk for the caller, in order (role once, text never repeated).
    fn send(&self, delta: StreamDelta);
    /// How many attempts of the call are running now (0 while it waits for admission
    /// or backs off: a proxy sends keepalives only while one runs, SPEC §17.2).
    fn attempts_running(&self, _n: usize) {}
}

/// A leg whose transport phase ended.
pub(crate) struct LegDone<T> {
    pub info: LegInfo,
    pub guard: AttemptGuard,
    pub result: Result<T, AttemptError>,
    pub wall: Duration,
}

/// The winner of a round.
#[derive(Debug)]
pub(crate) struct Won<T> {
    pub output: T,
    pub facts: SuccessFacts,
    /// The winner's transport wall time (from its own launch).
    pub wall: Duration,
    pub info: LegInfo,
    /// The answer's text when the round's machine holds it (passthrough: what the
    /// caller received; a prefill winner: the text it continued and its continuation).
    pub answer: Option<Transcript>,
    /// Usage of the other legs of this round whose text the answer holds.
    pub parts: Vec<LegUsage>,
    /// The text carried in from the previous round is part of the answer (its legs'
    /// usage counts too).
    pub uses_carried: bool,
}

/// How a round ended.
#[derive(Debug)]
pub(crate) enum RoundOutcome<T> {
    Won(Won<T>),
    Failed {
        error: AttemptError,
        /// The source of the leg whose failure represents the round.
        source: Option<usize>,
        /// Every leg was rate-limited: no budget.
        refunded: bool,
        /// Text to continue from.
        resume: Option<ResumePoint>,
        /// The call_id of the attempt that text came from.
        resume_of: Option<String>,
        /// Usage of the legs whose text the resume point holds (this round's; with
        /// `uses_carried`, the carried text's legs too).
        parts: Vec<LegUsage>,
        /// The resume point's text includes the text carried into this round.
        uses_carried: bool,
        /// Resume legs this round launched besides its primary.
        resumes: u32,
    },
    Deadline,
}

/// What a round starts from (set by the retry loop).
pub(crate) struct RoundStart {
    pub primary: Picked,
    pub spec: RoundSpec,
    /// The call_id the carried text came from (continuation rounds).
    pub carried_from: Option<String>,
    pub sink: Option<Arc<dyn DeltaSink>>,
    pub fallback_cooldown: Duration,
}

/// Events queued by the legs' observers.
///
/// The observers run inside the legs' polls, which happen inside the round's own poll
/// (nothing is spawned): an event that asks for the round (`wake`) is seen by the
/// round's [`QueueReady`] branch in that same poll, so no waker is called then. Waking
/// the round's task from inside its own poll would make tokio treat it as a yield and
/// wake another worker thread: a context switch per streamed chunk.
///
/// Chunks that do not wake the round (an aggregated call's) are folded into the last
/// queued chunk of the same leg while it waits, so a call's queue holds its text, not
/// one event per chunk (SPEC §17.7: 200 000 one-character chunks stay a few MB). A
/// leg's first incremental chunk is kept as its own event (its time is the leg's time
/// to first token).
#[derive(Default)]
struct EventQueue {
    events: Mutex<Queued>,
    /// An event asked for the round since [`QueueReady`] last returned.
    wanted: AtomicBool,
    /// The round is being polled ([`Polling`]).
    in_poll: AtomicBool,
    waker: futures_util::task::AtomicWaker,
}

/// The queued events, and whether the last one may take later chunks of its leg.
#[derive(Default)]
struct Queued {
    events: Vec<Event>,
    /// The last event is a foldable chunk of this leg.
    foldable: Option<LegId>,
}

impl EventQueue {
    /// Queues an event; `fold`: it is a chunk that may be folded into the last queued
    /// chunk of its leg (see the type's doc).
    fn push(&self, e: Event, wake: bool, fold: bool) {
        {
            let mut q = self.events.lock().unwrap_or_else(|e| e.into_inner());
            let leg = match &e {
                Event::Chunk { leg, .. } => Some(*leg),
                _ => None,
            };
            let can_fold = fold && leg.is_some() && q.foldable == leg;
            let folded = match (q.events.last_mut(), e) {
                (
                    Some(Event::Chunk {
                        at,
                        incremental,
                        delta,
                        ..
                    }),
                    Event::Chunk {
                        at: at2,
                        incremental: inc2,
                        delta: d2,
                        ..
                    },
                ) if can_fold => {
                    *at = (*at).max(at2);
                    *incremental |= inc2;
                    match (delta.as_mut(), d2) {
                        (Some(d), Some(d2)) => d.append(d2),
                        (None, d2) => *delta = d2,
                        (Some(_), None) => {}
                    }
                    None
                }
                (_, e) => Some(e),
            };
            if let Some(e) = folded {
                q.events.push(e);
                q.foldable = if fold { leg } else { None };
            }
        }
        if wake {
            self.wanted.store(true, Ordering::SeqCst);
            if !self.in_poll.load(Ordering::SeqCst) {
                self.waker.wake();
            }
        }
    }

    /// Moves the queued events into `into` (empty), leaving the queue `into`'s buffer:
    /// both keep their capacity.
    fn take_into(&self, into: &mut Vec<Event>) {
        debug_assert!(into.is_empty());
        let mut q = self.events.lock().unwrap_or_else(|e| e.into_inner());
        q.foldable = None;
        std::mem::swap(&mut q.events, into);
    }
}

/// Ready once an event asked for the round (the `select!` branch after the legs').
struct QueueReady<'q>(&'q EventQueue);

impl Future for QueueReady<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.waker.register(cx.waker());
        if self.0.wanted.swap(false, Ordering::SeqCst) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// Marks the queue's round as being polled for the duration of each poll.
struct Polling<'q, F> {
    queue: &'q EventQueue,
    inner: Pin<&'q mut F>,
}

impl<F: Future> Future for Polling<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.queue.in_poll.store(true, Ordering::SeqCst);
        let r = self.inner.as_mut().poll(cx);
        self.queue.in_poll.store(false, Ordering::SeqCst);
        // An event pushed at the very end of the poll, after the round last looked:
        // the round must run again (never the case while the legs are polled only in
        // the round's `select!`, which looks at the queue last).
        if r.is_pending() && self.queue.wanted.load(Ordering::SeqCst) {
            cx.waker().wake_by_ref();
        }
        r
    }
}

/// The observer of one leg.
struct LegObserver {
    queue: Arc<EventQueue>,
    leg: LegId,
    control: Arc<LegControl>,
    deltas: bool,
    raw: bool,
    /// Its first incremental chunk was queued.
    first_seen: AtomicBool,
}

impl LegObserver {
    /// Whether this chunk may be folded into the last queued one: it does not wake the
    /// round, frames are not forwarded, and it is not the leg's first incremental chunk.
    fn foldable(&self, wake: bool, incremental: bool) -> bool {
        let first = incremental && !self.first_seen.swap(true, Ordering::Relaxed);
        !wake && !self.raw && !first
    }
}

impl ChunkObserver for LegObserver {
    fn on_chunk(&self, at: Instant) {
        self.control.count_bare_chunk();
        self.control.on_incremental(at);
        let wake = self.control.wake_on_chunk.load(Ordering::Relaxed);
        let fold = self.foldable(wake, true);
        self.queue.push(
            Event::Chunk {
                leg: self.leg,
                at,
                incremental: true,
                delta: None,
            },
            wake,
            fold,
        );
    }

    fn wants_deltas(&self) -> bool {
        self.deltas
    }

    fn wants_raw(&self) -> bool {
        self.raw
    }

    fn on_headers(&self, headers: &[(String, String)]) {
        self.control.set_headers(headers);
    }

    fn on_delta(&self, at: Instant, delta: StreamDelta) {
        let incremental = delta.is_incremental();
        if incremental {
            self.control.on_incremental(at);
        }
        // Passthrough (`raw`) forwards every chunk; otherwise only a chunk that arms
        // a trigger needs the round now.
        let wake = self.raw || (incremental && self.control.wake_on_chunk.load(Ordering::Relaxed));
        let fold = self.foldable(wake, incremental);
        self.queue.push(
            Event::Chunk {
                leg: self.leg,
                at,
                incremental,
                delta: Some(delta),
            },
            wake,
            fold,
        );
    }
}

type LegFuture<'a, T> = Abortable<BoxFuture<'a, LegDone<T>>>;

type LegResult<T> = Result<LegDone<T>, futures_util::future::Aborted>;

enum Wake<T> {
    Leg(Option<Box<LegResult<T>>>),
    Finalized,
    Pick(Result<Pick, GovernanceError>),
    Timer,
    Chunks,
}

/// The executor of one round.
struct Exec<'a, L: Leg> {
    engine: &'a Arc<Engine>,
    leg: &'a L,
    call: &'a Arc<CallShared>,
    machine: Round,
    queue: Arc<EventQueue>,
    sink: Option<Arc<dyn DeltaSink>>,
    deltas: bool,
    legs: FutureSet<LegFuture<'a, L::Output>>,
    controls: Vec<(Arc<LegControl>, AbortHandle)>,
    infos: Vec<LegInfo>,
    primary: Option<Picked>,
    carried_from: Option<String>,
    pick: Option<BoxFuture<'a, Result<Pick, GovernanceError>>>,
    ticket: Option<BudgetTicket>,
    picked: Option<Picked>,
    /// The trigger that asked for the pick in flight (leg, `first_token`/`stall`).
    pick_for: Option<(LegId, &'static str)>,
    /// The last refusal traced: (leg, trigger, the leg's last chunk then) — a trigger
    /// that asks again in the same silence is not traced again.
    refusal_traced: Option<(LegId, &'static str, Option<Instant>)>,
    /// The reason of that refusal (a later launch in the same silence names it).
    refusal_why: Option<&'static str>,
    finalizing: FutureSet<BoxFuture<'static, ()>>,
    /// Ended legs waiting for their fate (within one feed), in launch order. A round
    /// has a handful of legs: a vector searched by leg, not a map (a `BTreeMap` node
    /// holds room for eleven of these: a 20 KB allocation per call, issue 27).
    ended: Vec<LegDone<L::Output>>,
    /// Outputs of legs that ended successfully, kept for the winner.
    outputs: Vec<(LegId, L::Output, SuccessFacts, Duration)>,
    /// Per leg: the usage its row records (SPEC §17.8; `None` = unavailable).
    usage: Vec<Option<LegUsage>>,
    fallback_cooldown: Duration,
    events: VecDeque<Event>,
    /// Per leg: its first token is in the call's trace.
    first_traced: Vec<bool>,
    /// Buffers kept between events (their capacity: no allocation per chunk, issue 27):
    /// the machine's actions, and the queue's events being drained.
    actions: Vec<Action>,
    drained: Vec<Event>,
}

impl<'a, L: Leg> Exec<'a, L> {
    fn now(&self) -> Instant {
        self.engine.ports.clock.now()
    }

    /// Feeds an event and everything that follows from it.
    fn feed(&mut self, event: Event) {
        self.events.push_back(event);
        // Taken, so that a nested feed (from an action) gets its own buffer.
        let mut out = std::mem::take(&mut self.actions);
        while let Some(e) = self.events.pop_front() {
            let now = self.now();
            let chunk_of = match &e {
                Event::Chunk { leg, .. } => Some(*leg),
                _ => None,
            };
            self.machine.on(e, now, &mut out);
            // A leg's first token in the trace as it arrives (SPEC §19.4), before a
            // winner's row takes the trace.
            if let Some(leg) = chunk_of {
                if self.first_traced.get(leg) == Some(&false) {
                    if let Some(first) = self.machine.first_chunk(leg) {
                        self.first_traced[leg] = true;
                        self.call.trace(first, TraceEvent::FirstToken { leg });
                    }
                }
            }
            for a in out.drain(..) {
                self.apply(a);
            }
        }
        self.actions = out;
        for (i, (c, _)) in self.controls.iter().enumerate() {
            c.wake_on_chunk
                .store(self.machine.chunk_wakes(i), Ordering::Relaxed);
        }
    }

    fn drain_queue(&mut self) {
        let mut batch = std::mem::take(&mut self.drained);
        self.queue.take_into(&mut batch);
        for e in batch.drain(..) {
            self.feed(e);
        }
        self.drained = batch;
    }

    fn apply(&mut self, action: Action) {
        match action {
            Action::Launch { leg, source, kind } => {
                let picked = if leg == 0 {
                    self.primary.take()
                } else {
                    self.ticket = None;
                    self.picked.take()
                };
                match picked {
                    Some(p) if p.source_idx == source => self.launch(leg, p, kind),
                    other => {
                        // The machine launches only what was admitted: never reached.
                        tracing::error!(leg, source, "launch without a matching admission");
                        if let Some(p) = other {
                            self.release(p);
                        }
                    }
                }
            }
            Action::Pick(req) => self.start_pick(req),
            Action::ReleasePick => {
                if let Some(p) = self.picked.take() {
                    self.release(p);
                }
                if let Some(t) = self.ticket.take() {
                    self.engine.budget().give_back(t);
                }
            }
            Action::Commit { leg, first } => {
                self.call.trace_now(TraceEvent::Commit { leg });
                let info = &self.infos[leg];
                let src = &self.engine.scope.sources[info.source_idx];
                if let Some(mode) = info.kind.resume_mode() {
                    tracing::info!(
                        source = %src.name,
                        resume_mode = %mode,
                        call_id = %info.call_id,
                        "a resume leg took over the stream"
                    );
                }
                if let Some(sink) = &self.sink {
                    sink.committed(&Commit {
                        logical_call_id: self.call.logical_call_id.clone(),
                        source: src.name.clone(),
                        model: src.model.clone(),
                        is_hedge: info.is_hedge,
                        first,
                        resume_mode: info.kind.resume_mode(),
                        upstream_headers: self
                            .controls
                            .get(leg)
                            .map(|(c, _)| c.headers())
                            .unwrap_or_default(),
                    });
                }
            }
            Action::Forward { delta, .. } => {
                if let Some(sink) = &self.sink {
                    sink.send(delta);
                }
            }
            Action::Cancel { leg, reason } => {
                self.call.trace_now(TraceEvent::Cancel {
                    leg,
                    why: reason.label().as_str().to_string(),
                });
                self.record_latency(leg, false);
                let ended = self.cancelled_leg(leg, reason);
                if let Some((c, h)) = self.controls.get(leg) {
                    c.set_label(reason.label());
                    c.set_ended(ended);
                    h.abort();
                }
            }
            Action::Finalize { leg, fate } => self.finalize(leg, fate),
            Action::MarkNoPrefill { source } => self.engine.mark_no_prefill(source),
            Action::Done => {}
        }
    }

    fn launch(&mut self, index: LegId, picked: Picked, kind: LegKind) {
        let engine = self.engine;
        let now = self.now();
        let is_hedge = self.machine.is_extra(index);
        let resume_of = match &kind {
            LegKind::Fresh => None,
            LegKind::Resume { of: Some(l), .. } => self.infos.get(*l).map(|i| i.call_id.clone()),
            LegKind::Resume { of: None, .. } => self.carried_from.clone(),
        };
        let info = LegInfo {
            index,
            attempt_index: self
                .call
                .next_attempt(is_hedge, kind.resume_mode().is_some()),
            is_hedge,
            source_idx: picked.source_idx,
            call_id: new_id(),
            launched_at: now,
            probe: picked.probe,
            kind,
            resume_of,
        };
        if is_hedge {
            engine.scope_metrics.hedge();
        }
        self.call
            .note_tried(&engine.scope.sources[info.source_idx].name);
        let why = if info.kind.resume_mode().is_some() {
            "resume"
        } else if is_hedge {
            "hedge"
        } else if self.call.round_no() > 1 {
            "retry"
        } else {
            "primary"
        };
        // SPEC §25.2: an extra leg says how far into its silence it launched, against
        // the threshold in force, and why when later (a refusal of this silence, or the
        // admission's own time).
        let fired = self.machine.fired_from(index);
        let (of, thr_ms, silent_ms, late) = match fired {
            Some(f) => {
                let silent = now.saturating_duration_since(f.silent_since);
                let this_silence = self.refusal_traced.is_some_and(|(l, _, last)| {
                    l == f.leg && last == self.machine.last_chunk(f.leg)
                });
                let late = (silent > f.threshold + LATE_TOLERANCE).then(|| {
                    match self.refusal_why.filter(|_| this_silence) {
                        Some(w) => w.to_string(),
                        None => "admission".to_string(),
                    }
                });
                (
                    Some(f.leg),
                    Some(ms_u64(f.threshold)),
                    Some(ms_u64(silent)),
                    late,
                )
            }
            None => (None, None, None, None),
        };
        self.call.trace(
            now,
            TraceEvent::Launch {
                leg: index,
                src: engine.scope.sources[info.source_idx].name.clone(),
                why: why.to_string(),
                by: self.machine.fired_by(index).map(str::to_string),
                mode: info.kind.resume_mode().map(|m| m.as_str().to_string()),
                of,
                thr_ms,
                silent_ms,
                late,
            },
        );
        let info_copy = info.clone();
        let control = Arc::new(LegControl::default());
        control
            .wake_on_chunk
            .store(self.machine.chunk_wakes(index), Ordering::Relaxed);
        if self.leg.stream() && engine.latency.keeps() {
            *control.gaps.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((engine.latency.gap_floor(), GapTally::default()));
        }
        let guard = AttemptGuard::new(
            engine.clone(),
            self.call.clone(),
            control.clone(),
            picked.permit,
            picked.leg,
            &info,
            self.leg.stream(),
        );
        let src = &engine.scope.sources[info.source_idx];
        if let LegKind::Resume { mode, prefix, .. } = &info.kind {
            tracing::info!(
                source = %src.name,
                resume_mode = %mode,
                prefix_chars = prefix.chars().count(),
                resume_of = info.resume_of.as_deref().unwrap_or(""),
                "resuming the stream on another attempt"
            );
        }
        let span = tracing::info_span!(
            "polygw.attempt",
            gen_ai.operation.name = engine.kind.operation(),
            gen_ai.system = "openai",
            gen_ai.request.model = %src.model,
            server.address = %engine.source_addresses[info.source_idx],
            polygw.source = %src.name,
            polygw.hedge = is_hedge,
            polygw.attempt_index = info.attempt_index,
            polygw.call_id = %info.call_id,
            polygw.logical_call_id = %self.call.logical_call_id,
            polygw.resume_mode = info.kind.resume_mode().map(|m| m.as_str()),
            error.type = tracing::field::Empty,
        );
        let observer = LegObserver {
            queue: self.queue.clone(),
            leg: index,
            control: control.clone(),
            deltas: self.deltas,
            raw: self.sink.is_some(),
            first_seen: AtomicBool::new(false),
        };
        let leg = self.leg;
        // The upstream request continues the call's trace under the attempt's span.
        let traceparent = self
            .call
            .otel()
            .and_then(|o| o.upstream_header(&info.call_id));
        let fut = async move {
            let result = leg
                .call(
                    engine,
                    src,
                    &info.call_id,
                    traceparent.as_deref(),
                    &observer,
                    &info.kind,
                )
                .instrument(span.clone())
                .await;
            if let Err(e) = &result {
                span.record("error.type", e.label.as_str());
            }
            let wall = engine
                .ports
                .clock
                .now()
                .saturating_duration_since(info.launched_at);
            LegDone {
                info,
                guard,
                result,
                wall,
            }
        }
        .boxed();
        let (handle, reg) = AbortHandle::new_pair();
        self.legs.push(Abortable::new(fut, reg));
        self.controls.push((control, handle));
        self.infos.push(info_copy);
        self.usage.push(None);
        self.first_traced.push(false);
        self.report_running();
    }

    /// Tells the sink how many legs run now.
    fn report_running(&self) {
        if let Some(sink) = &self.sink {
            sink.attempts_running(self.legs.len());
        }
    }

    /// The estimated prompt of a leg (a prefill leg sends its prefix too).
    fn prompt_estimate(&self, leg: LegId) -> u64 {
        leg_prompt_estimate(
            self.leg.estimate_prompt_tokens(),
            self.machine.kind(leg).prefill_prefix(),
        )
    }

    /// The gateway's estimate of a leg from what the round holds of it (SPEC §20.4):
    /// its prompt and the text it received; `None` for legs whose rows carry no
    /// estimate (embeddings, OCR).
    fn leg_estimate(&self, leg: LegId) -> Option<LegEstimate> {
        if !self.leg.estimates_usage() {
            return None;
        }
        let mut e = LegEstimate::of(self.prompt_estimate(leg), self.machine.leg_text(leg));
        if e.received_tokens == 0 {
            // No text kept (no deltas): a token per incremental chunk.
            let bare = self.controls.get(leg).map_or(0, |(c, _)| c.bare_chunks());
            e.received_tokens = u64::from(bare);
        }
        Some(e)
    }

    /// The estimate of a leg that returned `out` without usage.
    fn output_estimate(&self, leg: LegId, out: &L::Output) -> Option<LegEstimate> {
        self.leg.estimates_usage().then(|| {
            LegEstimate::from_bytes(self.prompt_estimate(leg), self.leg.received_bytes(out))
        })
    }

    fn ttft_ms(&self, leg: LegId) -> Option<u64> {
        let first = self.machine.first_chunk(leg)?;
        let launched = self.infos.get(leg)?.launched_at;
        Some(polygw_core::stall::ms(
            first.saturating_duration_since(launched),
        ))
    }

    /// What the row of a leg the round cancels records: its first token, and — when
    /// the answer holds its text (it reached the caller, or the winner continues it)
    /// — its estimated usage, as the answer counts it.
    fn cancelled_leg(&mut self, leg: LegId, reason: CancelReason) -> Ended {
        let in_answer = self.machine.delivered_text(leg)
            || match self.machine.result() {
                Some(RoundResult::Won { leg: w }) => self.machine.answer_chain(*w).0.contains(&leg),
                _ => false,
            };
        let usage = if in_answer && reason == CancelReason::HedgeLoser {
            cut_leg_usage(self.prompt_estimate(leg), self.machine.leg_text(leg))
        } else {
            None
        };
        if let Some(u) = self.usage.get_mut(leg) {
            *u = usage;
        }
        // A cancelled leg was sent: its provider may bill it (its row's estimate holds
        // the same figures as its usage when the answer counts it).
        Ended {
            usage,
            ttft_ms: self.ttft_ms(leg),
            estimate: self.leg_estimate(leg),
        }
    }

    /// A trigger's pick launched nothing (SPEC §19.4: the call says why); the first
    /// refusal of a silence is traced, not the trigger's repeats.
    fn trace_refusal(&mut self, why: &'static str) {
        let Some((leg, by)) = self.pick_for.take() else {
            return;
        };
        let key = (leg, by, self.machine.last_chunk(leg));
        self.refusal_why = Some(why);
        if self.refusal_traced == Some(key) {
            return;
        }
        self.refusal_traced = Some(key);
        self.call.trace_now(TraceEvent::NoLeg {
            leg,
            by: by.to_string(),
            why: why.to_string(),
        });
    }

    fn start_pick(&mut self, req: PickRequest) {
        self.pick_for = req.fired_by;
        let engine = self.engine;
        if engine.kind != ScopeKind::Chat {
            self.events.push_back(Event::Picked(None));
            return;
        }
        if req.hedge_budget {
            match engine
                .budget()
                .try_take(self.now(), engine.scope.hedge.budget_pct)
            {
                Some(t) => self.ticket = Some(t),
                None => {
                    tracing::debug!("extra leg skipped: hedge budget");
                    self.trace_refusal("hedge_budget");
                    self.events.push_back(Event::Picked(None));
                    return;
                }
            }
        }
        let mut exclude: BTreeSet<String> = req
            .exclude
            .iter()
            .map(|&i| engine.scope.sources[i].name.clone())
            .collect();
        exclude.extend(self.call.excluded_sources());
        let failed = self.call.failed_sources();
        let prefill_to = (req.prefer_prefill || req.require_prefill)
            .then(|| engine.prefill_targets(self.leg, self.machine.delivered()));
        let prefs = PickPrefs {
            only: req.only,
            prefer_prefill: req.prefer_prefill,
            require_prefill: req.require_prefill,
            prefill_to,
            family: self.call.family(),
            ..PickPrefs::default()
        };
        let stream = self.leg.stream();
        let key = self.call.key();
        self.pick = Some(
            async move {
                engine
                    .try_pick_with(&exclude, &failed, stream, prefs, key.as_ref())
                    .await
            }
            .boxed(),
        );
    }

    fn on_pick(&mut self, r: Result<Pick, GovernanceError>) {
        match r {
            Ok(Pick {
                admitted: Some(p), ..
            }) => {
                let picked = MachinePicked {
                    source: p.source_idx,
                    prefill_capable: self.engine.prefill_capable(p.source_idx)
                        && self
                            .leg
                            .prefill_allowed(&self.engine.scope.sources[p.source_idx]),
                    prefill_trailing_whitespace: prefill_takes_trailing_whitespace(
                        self.engine.scope.sources[p.source_idx].api,
                    ),
                };
                self.picked = Some(p);
                self.pick_for = None;
                self.feed(Event::Picked(Some(picked)));
            }
            Ok(_) => {
                tracing::debug!("extra leg skipped: no other source admitted");
                self.trace_refusal("no_source");
                if let Some(t) = self.ticket.take() {
                    self.engine.budget().give_back(t);
                }
                self.feed(Event::Picked(None));
            }
            Err(e) => {
                // Fail closed: no extra leg; the legs running go on (a backend error
                // never cuts a healthy stream).
                tracing::warn!(error = %e, "governance backend failed on an extra leg's admission: no extra leg");
                self.trace_refusal("governance");
                if let Some(t) = self.ticket.take() {
                    self.engine.budget().give_back(t);
                }
                self.feed(Event::PickFailed);
            }
        }
    }

    /// Frees an admission that no leg uses: settles nothing, frees the slot and a
    /// half-open probe.
    fn release(&mut self, p: Picked) {
        let engine = self.engine.clone();
        let src = engine.scope.sources[p.source_idx].name.clone();
        let p_source = p.source_idx;
        let mut permit = p.permit;
        let probe = p.probe;
        self.finalizing.push(
            async move {
                if let Err(e) = permit.finish(0).await {
                    tracing::warn!(source = %src, error = %e, "releasing an unused admission failed; handed to the background path");
                    permit.finish_in_background(0);
                }
                engine.release_unused_probe(p_source, probe);
                engine.freed.notify_one();
            }
            .boxed(),
        );
    }

    /// The leg's samples into its source's live distributions (SPEC §19.1), once per
    /// leg: when it ends, or — a cancelled leg — when it is cancelled (a censored
    /// sample: dropping cancelled legs would leave only the survivors, which pulls every
    /// quantile down and closes the feedback loop the censoring guards against).
    fn record_latency(&self, leg: LegId, completed: bool) {
        let engine = self.engine;
        if !engine.latency.keeps() {
            return;
        }
        let Some(info) = self.infos.get(leg) else {
            return;
        };
        let gaps = self
            .controls
            .get(leg)
            .map(|(c, _)| c.take_gaps())
            .unwrap_or_default();
        let times = LegTimes {
            launched: info.launched_at,
            first_chunk: self.machine.first_chunk(leg),
            last_chunk: self.machine.last_chunk(leg),
            ended: self.now(),
            completed,
            continues: info.kind.resume_mode().is_some(),
        };
        engine
            .latency
            .leg_ended(self.leg.stream(), info.source_idx, self.now(), times, &gaps);
    }

    fn finalize(&mut self, leg: LegId, fate: Fate) {
        let Some(at) = self.ended.iter().position(|d| d.info.index == leg) else {
            tracing::error!(leg, "a fate for a leg that has not ended");
            return;
        };
        let done = self.ended.remove(at);
        let LegDone {
            info,
            mut guard,
            result,
            wall,
        } = done;
        if !matches!(fate, Fate::Cancelled(_)) {
            // (A cancelled leg gave its samples when it was cancelled.)
            self.record_latency(
                leg,
                matches!(fate, Fate::Won | Fate::Succeeded) && result.is_ok(),
            );
        }
        match &fate {
            Fate::Won => {
                guard.mark_winner();
                self.call.trace_now(TraceEvent::Won { leg });
            }
            Fate::Failed(e) => self.call.trace_now(TraceEvent::Fail {
                leg,
                why: e.label.as_str().to_string(),
            }),
            Fate::Succeeded | Fate::Cancelled(_) => {}
        }
        match (fate, result) {
            (Fate::Won | Fate::Succeeded, Ok(out)) => {
                let mut facts = self.leg.facts(&out);
                if facts.usage_source == polygw_core::UsageSource::Unavailable {
                    facts.estimate = self.output_estimate(leg, &out);
                }
                guard.decide_success(&facts, wall);
                self.usage[leg] = Some(LegUsage::new(facts.usage, facts.usage_source));
                self.outputs.push((leg, out, facts, wall));
                self.infos[leg] = info;
            }
            (Fate::Failed(e), result) => {
                let (e, ended) = match result {
                    // An answer the machine rejected (a diverged replay) keeps its
                    // measured usage.
                    Ok(out) => {
                        let f = self.leg.facts(&out);
                        let u = LegUsage::new(f.usage, f.usage_source);
                        let e = e.with_usage(f.usage, f.usage_source);
                        let known = u.source != polygw_core::UsageSource::Unavailable;
                        let estimate = if known {
                            None
                        } else {
                            self.output_estimate(leg, &out)
                        };
                        (
                            e,
                            Ended {
                                usage: known.then_some(u),
                                ttft_ms: self.ttft_ms(leg),
                                estimate,
                            },
                        )
                    }
                    // A cut leg: its prompt and the text it received, estimated; a
                    // leg that received nothing keeps the estimate of its prompt when
                    // its provider may have billed it.
                    Err(err) => {
                        let usage =
                            cut_leg_usage(self.prompt_estimate(leg), self.machine.leg_text(leg));
                        let estimate =
                            if usage.is_some() || may_be_billed(err.label, err.http_status) {
                                self.leg_estimate(leg)
                            } else {
                                None
                            };
                        (
                            e,
                            Ended {
                                usage,
                                ttft_ms: self.ttft_ms(leg),
                                estimate,
                            },
                        )
                    }
                };
                self.usage[leg] = ended.usage;
                guard.decide_failure(&e, wall, self.fallback_cooldown, ended);
                let src = &self.engine.scope.sources[info.source_idx].name;
                self.call.note_failure(src, &e);
                self.infos[leg] = info;
            }
            (fate, Err(e)) => {
                // Never decided by the machine (a success fate for a failed leg).
                tracing::error!(leg, ?fate, "inconsistent fate for a failed leg");
                let ended = Ended {
                    usage: None,
                    ttft_ms: self.ttft_ms(leg),
                    estimate: None,
                };
                guard.decide_failure(&e, wall, self.fallback_cooldown, ended);
                self.infos[leg] = info;
            }
            (Fate::Cancelled(reason), Ok(out)) => {
                guard_label(&self.controls, leg, reason.label());
                // Its answer came but the round does not take it: the provider billed
                // it; its row records the estimate of what it returned.
                if let Some((c, _)) = self.controls.get(leg) {
                    let mut ended = c.ended();
                    if ended.estimate.is_none() {
                        ended.estimate = self.output_estimate(leg, &out);
                    }
                    c.set_ended(ended);
                }
                self.infos[leg] = info;
                drop(guard);
                return;
            }
        }
        self.finalizing.push(guard.finish().boxed());
    }

    /// Ended legs of one poll: chunks first, then the ends in launch order.
    fn on_legs(
        &mut self,
        first: Option<Result<LegDone<L::Output>, futures_util::future::Aborted>>,
    ) {
        let mut batch = std::mem::take(&mut self.ended);
        batch.clear();
        let mut next = first;
        loop {
            match next {
                Some(Ok(d)) => batch.push(d),
                Some(Err(_aborted)) => {}
                None => break,
            }
            next = match self.legs.next().now_or_never() {
                Some(Some(x)) => Some(x),
                _ => None,
            };
        }
        self.drain_queue();
        batch.sort_by_key(|d| d.info.index);
        let order: Vec<(LegId, LegEnd)> = batch
            .iter()
            .map(|d| {
                (
                    d.info.index,
                    match &d.result {
                        Ok(_) => LegEnd::Ok,
                        Err(e) => LegEnd::Err(e.clone()),
                    },
                )
            })
            .collect();
        self.ended = batch;
        for (leg, end) in order {
            self.feed(Event::Ended { leg, end });
        }
        // Anything the machine did not decide (never expected) records as cancelled.
        self.ended.clear();
        self.report_running();
    }

    fn on_timer(&mut self) {
        self.drain_queue();
        let now = self.now();
        let deadline = self.machine_deadline();
        if deadline.is_some_and(|d| now >= d) {
            self.call.mark_deadline();
            self.feed(Event::Deadline);
        } else {
            self.feed(Event::Tick);
        }
    }

    fn machine_deadline(&self) -> Option<Instant> {
        self.engine
            .scope
            .call_deadline
            .map(|d| self.call.started + d)
    }

    /// The recorded usage of these legs (unknown = unavailable).
    fn parts_of(&self, legs: &[LegId]) -> Vec<LegUsage> {
        legs.iter()
            .map(|&l| {
                self.usage
                    .get(l)
                    .copied()
                    .flatten()
                    .unwrap_or_else(LegUsage::unavailable)
            })
            .collect()
    }

    fn outcome(&mut self) -> RoundOutcome<L::Output> {
        match self.machine.result().cloned() {
            Some(RoundResult::Won { leg }) => {
                let Some((_, output, facts, wall)) = self
                    .outputs
                    .iter()
                    .position(|o| o.0 == leg)
                    .map(|at| self.outputs.swap_remove(at))
                else {
                    return RoundOutcome::Failed {
                        error: AttemptError::new(
                            polygw_core::ErrorClass::Invalid,
                            polygw_core::ErrorLabel::Invalid,
                            "the winner's answer was lost",
                        ),
                        source: None,
                        refunded: false,
                        resume: None,
                        resume_of: None,
                        parts: Vec::new(),
                        uses_carried: false,
                        resumes: self.machine.resumes(),
                    };
                };
                let (chain, uses_carried) = self.machine.answer_chain(leg);
                let info = self.infos[leg].clone();
                // The machine holds the answer's text when it forwarded it, or when
                // the winner continued a prefix (verified: SPEC §17.1).
                let answer = (self.sink.is_some() || info.kind.resume_mode().is_some())
                    .then(|| self.machine.answer(leg));
                RoundOutcome::Won(Won {
                    output,
                    facts,
                    wall,
                    info,
                    answer,
                    parts: self.parts_of(&chain),
                    uses_carried,
                })
            }
            Some(RoundResult::Failed {
                error,
                leg,
                refunded,
                resume,
            }) => {
                let resume_of = resume.as_ref().and_then(|p| match p.of {
                    Some(l) => self.infos.get(l).map(|i| i.call_id.clone()),
                    None => self.carried_from.clone(),
                });
                // The legs whose text the resume point holds.
                let (legs, uses_carried) = match resume.as_ref() {
                    None => (Vec::new(), false),
                    Some(_) if self.sink.is_some() => {
                        let legs: Vec<LegId> = (0..self.machine.legs())
                            .filter(|&l| self.machine.delivered_text(l))
                            .collect();
                        (legs, true)
                    }
                    Some(p) => match p.of {
                        Some(of) => {
                            let (mut chain, carried) = self.machine.answer_chain(of);
                            chain.push(of);
                            (chain, carried)
                        }
                        None => (Vec::new(), true),
                    },
                };
                RoundOutcome::Failed {
                    error,
                    source: leg.and_then(|l| self.infos.get(l)).map(|i| i.source_idx),
                    refunded,
                    resume: resume.map(|b| *b),
                    resume_of,
                    parts: self.parts_of(&legs),
                    uses_carried,
                    resumes: self.machine.resumes(),
                }
            }
            Some(RoundResult::Deadline) | Some(RoundResult::Dropped) | None => {
                RoundOutcome::Deadline
            }
        }
    }

    async fn run(mut self, initial: Vec<Action>) -> RoundOutcome<L::Output> {
        for a in initial {
            self.apply(a);
        }
        // The deadline may already have passed.
        self.on_timer_if_due();
        loop {
            self.drain_queue();
            if self.machine.result().is_some() && self.pick.take().is_some() {
                // An extra leg's admission still in flight when the round is decided:
                // dropped (the admission is cancel-safe), its budget given back.
                if let Some(t) = self.ticket.take() {
                    self.engine.budget().give_back(t);
                }
            }
            if self.machine.result().is_some()
                && self.finalizing.is_empty()
                && self.pick.is_none()
                && self.picked.is_none()
            {
                return self.outcome();
            }
            let wake_at = if self.machine.result().is_none() {
                self.machine.next_wakeup()
            } else {
                None
            };
            let queue = self.queue.clone();
            let notified = QueueReady(&queue);
            let sleep = wake_at.map(|t| tokio::time::sleep_until(t.into()));
            let pick = &mut self.pick;
            let wake = tokio::select! {
                biased;
                r = self.legs.next(), if !self.legs.is_empty() => Wake::Leg(r.map(Box::new)),
                _ = self.finalizing.next(), if !self.finalizing.is_empty() => Wake::Finalized,
                r = async { match pick.as_mut() { Some(f) => f.await, None => std::future::pending().await } }, if pick.is_some() => Wake::Pick(r),
                _ = async { match sleep { Some(s) => s.await, None => std::future::pending().await } }, if wake_at.is_some() => Wake::Timer,
                _ = notified => Wake::Chunks,
            };
            match wake {
                Wake::Leg(first) => {
                    if let Some(first) = first {
                        self.on_legs(Some(*first));
                    }
                }
                Wake::Finalized | Wake::Chunks => {}
                Wake::Pick(r) => {
                    self.pick = None;
                    self.drain_queue();
                    self.on_pick(r);
                }
                Wake::Timer => self.on_timer(),
            }
        }
    }

    fn on_timer_if_due(&mut self) {
        if let Some(d) = self.machine_deadline() {
            if self.now() >= d && self.machine.result().is_none() {
                self.call.mark_deadline();
                self.feed(Event::Deadline);
            }
        }
    }
}

fn guard_label(
    controls: &[(Arc<LegControl>, AbortHandle)],
    leg: LegId,
    label: polygw_core::ErrorLabel,
) {
    if let Some((c, _)) = controls.get(leg) {
        c.set_label(label);
    }
}

impl<L: Leg> Drop for Exec<'_, L> {
    fn drop(&mut self) {
        if let Some(sink) = &self.sink {
            sink.attempts_running(0);
        }
        if self.machine.result().is_none() {
            // The round's future is dropped: the deadline (the wrapper marked it) or
            // the caller. The machine labels every running leg.
            let ev = if self.call.deadline_hit() {
                Event::Deadline
            } else {
                Event::CallerDrop
            };
            let mut out = Vec::new();
            let now = self.engine.ports.clock.now();
            self.machine.on(ev, now, &mut out);
            for a in out {
                if let Action::Cancel { leg, reason } = a {
                    guard_label(&self.controls, leg, reason.label());
                    self.record_latency(leg, false);
                    // What the round holds of it: its row's estimate (SPEC §20.4).
                    let estimate = self.leg_estimate(leg);
                    if let Some((c, _)) = self.controls.get(leg) {
                        let mut ended = c.ended();
                        if ended.estimate.is_none() {
                            ended.estimate = estimate;
                        }
                        c.set_ended(ended);
                    }
                }
            }
        }
        if let Some(p) = self.picked.take() {
            // An admission in hand that no leg used: nothing was sent on it.
            p.permit.finish_in_background(0);
            self.engine.release_unused_probe(p.source_idx, p.probe);
        }
        if let Some(t) = self.ticket.take() {
            self.engine.budget().give_back(t);
        }
    }
}

impl Engine {
    /// Runs one round.
    pub(crate) async fn run_round<L: Leg>(
        self: &Arc<Self>,
        leg: &L,
        call: &Arc<CallShared>,
        start: RoundStart,
    ) -> RoundOutcome<L::Output> {
        let now = self.ports.clock.now();
        let resume_on = start.spec.resume != polygw_core::resume::ResumeSetting::Off
            && (start.spec.resumes_left > 0 || start.spec.carried.is_some());
        let deltas = start.sink.is_some() || (leg.stream() && resume_on);
        let (machine, initial) = Round::new(start.spec, now);
        let exec = Exec {
            engine: self,
            leg,
            call,
            machine,
            queue: Arc::new(EventQueue::default()),
            sink: start.sink,
            deltas,
            legs: FutureSet::default(),
            controls: Vec::new(),
            infos: Vec::new(),
            primary: Some(start.primary),
            carried_from: start.carried_from,
            pick: None,
            ticket: None,
            picked: None,
            pick_for: None,
            refusal_traced: None,
            refusal_why: None,
            finalizing: FutureSet::default(),
            ended: Vec::new(),
            outputs: Vec::new(),
            usage: Vec::new(),
            fallback_cooldown: start.fallback_cooldown,
            events: VecDeque::new(),
            first_traced: Vec::new(),
            actions: Vec::new(),
            drained: Vec::new(),
        };
        let queue = exec.queue.clone();
        let run = std::pin::pin!(exec.run(initial));
        Polling {
            queue: &queue,
            inner: run,
        }
        .await
    }
}

/// A launch within this much of its threshold is on time (timer granularity, the
/// pick's own round trip): the trace names no reason for it.
const LATE_TOLERANCE: std::time::Duration = std::time::Duration::from_millis(50);

fn ms_u64(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use polygw_core::ports::transport::TransportResult;

    /// Issue 27: an ended leg moves by value (out of its future, into the round's list,
    /// out again); with the telemetry row inline in its guard that was 1.8 KB copied at
    /// each step. The row is boxed, so a guard stays small.
    #[test]
    fn an_ended_leg_is_small_enough_to_move() {
        assert!(std::mem::size_of::<AttemptGuard>() <= 256);
        assert!(std::mem::size_of::<LegDone<TransportResult>>() <= 768);
    }
}
