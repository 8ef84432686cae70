//! One round of the retry loop (SPEC §7): the primary leg, and — when a hedge trigger
//! fires — extra legs on other sources, raced inside this future.
//!
//! - Triggers come from core's [`HedgeWindow`]; the round sleeps on relative durations
//!   until the next one is due, and wakes on chunks (a stall trigger arms on the first).
//! - An extra leg goes through full admission (excluding sources used in the round)
//!   and the scope's hedge budget; if none can be admitted it is silently skipped.
//! - The first leg to complete successfully wins (ties: earliest launched); the legs
//!   still running are cancelled as `hedge_cancelled` (reservation kept, no breaker
//!   feed). A leg that fails while others run is recorded and the round goes on.
//! - All legs failed: core's [`combine_failures`] decides what the round counts as.
//! - Passthrough: the first leg to deliver an incremental chunk is committed; the
//!   others are cancelled and no new leg starts.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::{AbortHandle, Abortable, BoxFuture, FutureExt};
use futures_util::stream::{FuturesUnordered, StreamExt};
use polygw_core::hedge::{combine_failures, HedgePolicy, HedgeStep, HedgeWindow};
use polygw_core::ports::{ChunkObserver, StreamDelta};
use polygw_core::{AttemptError, GovernanceError, ScopeKind};
use tokio::sync::Notify;
use tracing::Instrument;

use super::admission::Picked;
use super::attempt::{AttemptGuard, Leg, LegInfo, SuccessFacts, CANCEL_HEDGE_LOSER, CANCEL_NONE};
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
}

/// Receives the committed leg's chunks in passthrough streaming (`polygw serve`).
pub trait DeltaSink: Send + Sync {
    /// A leg committed (called once, before its first chunk is sent).
    fn committed(&self, _commit: &Commit) {}
    /// One normalized chunk of the committed leg, in order.
    fn send(&self, delta: &StreamDelta);
}

/// The most non-incremental chunks (role, empty deltas) buffered per leg before commit.
const MAX_BUFFERED_DELTAS: usize = 16;

#[derive(Default)]
struct Passthrough {
    committed: Option<usize>,
    buffers: Vec<Vec<StreamDelta>>,
    /// Per leg: its commit description.
    legs: Vec<Commit>,
}

/// State shared by the round and its legs' observers.
pub(crate) struct RoundShared {
    window: Mutex<HedgeWindow>,
    notify: Notify,
    sink: Option<Arc<dyn DeltaSink>>,
    pass: Mutex<Passthrough>,
}

impl RoundShared {
    fn window(&self) -> std::sync::MutexGuard<'_, HedgeWindow> {
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pass(&self) -> std::sync::MutexGuard<'_, Passthrough> {
        self.pass.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn committed(&self) -> Option<usize> {
        self.pass().committed
    }
}

/// The observer of one leg.
struct LegObserver {
    shared: Arc<RoundShared>,
    leg: usize,
}

impl ChunkObserver for LegObserver {
    fn on_chunk(&self, at: Instant) {
        self.shared.window().on_chunk(self.leg, at);
        self.shared.notify.notify_one();
    }

    fn wants_deltas(&self) -> bool {
        self.shared.sink.is_some()
    }

    fn on_delta(&self, delta: &StreamDelta) {
        let Some(sink) = &self.shared.sink else {
            return;
        };
        let mut p = self.shared.pass();
        match p.committed {
            Some(c) if c == self.leg => sink.send(delta),
            Some(_) => {}
            None if delta.is_incremental() => {
                p.committed = Some(self.leg);
                if let Some(c) = p.legs.get(self.leg) {
                    sink.committed(c);
                }
                if let Some(buf) = p.buffers.get_mut(self.leg) {
                    for d in buf.drain(..) {
                        sink.send(&d);
                    }
                }
                sink.send(delta);
                drop(p);
                self.shared.window().commit();
                self.shared.notify.notify_one();
            }
            None => {
                if p.buffers.len() <= self.leg {
                    p.buffers.resize_with(self.leg + 1, Vec::new);
                }
                let buf = &mut p.buffers[self.leg];
                if buf.len() < MAX_BUFFERED_DELTAS {
                    buf.push(delta.clone());
                }
            }
        }
    }
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
}

/// How a round ended.
#[derive(Debug)]
pub(crate) enum RoundOutcome<T> {
    Won(Won<T>),
    Failed {
        error: AttemptError,
        /// Every leg was rate-limited: no budget.
        refunded: bool,
        /// Passthrough: content of the failed leg is already on the wire.
        committed: bool,
    },
}

type LegFuture<'a, T> = Abortable<BoxFuture<'a, LegDone<T>>>;

impl Engine {
    fn launch<'a, L: Leg>(
        self: &'a Arc<Self>,
        leg: &'a L,
        call: &Arc<CallShared>,
        shared: &Arc<RoundShared>,
        picked: Picked,
        index: usize,
        is_hedge: bool,
    ) -> (LegFuture<'a, L::Output>, Arc<AtomicU8>, AbortHandle) {
        let now = self.ports.clock.now();
        let info = LegInfo {
            index,
            attempt_index: call.next_attempt(is_hedge),
            is_hedge,
            source_idx: picked.source_idx,
            call_id: new_id(),
            launched_at: now,
            probe: picked.probe,
        };
        let cancel = Arc::new(AtomicU8::new(CANCEL_NONE));
        let guard = AttemptGuard::new(
            self.clone(),
            call.clone(),
            cancel.clone(),
            picked.permit,
            &info,
            leg.stream(),
        );
        let engine: &'a Arc<Engine> = self;
        let src = &engine.scope.sources[info.source_idx];
        {
            let mut p = shared.pass();
            if p.legs.len() <= index {
                p.legs.resize_with(index + 1, || Commit {
                    logical_call_id: String::new(),
                    source: String::new(),
                    model: String::new(),
                    is_hedge: false,
                });
            }
            p.legs[index] = Commit {
                logical_call_id: call.logical_call_id.clone(),
                source: src.name.clone(),
                model: src.model.clone(),
                is_hedge,
            };
        }
        let shared = shared.clone();
        let span = tracing::info_span!(
            "polygw.attempt",
            gen_ai.operation.name = engine.kind.operation(),
            gen_ai.system = "openai",
            gen_ai.request.model = %src.model,
            server.address = %src.base_url,
            polygw.source = %src.name,
            polygw.hedge = is_hedge,
            polygw.attempt_index = info.attempt_index,
            polygw.call_id = %info.call_id,
            polygw.logical_call_id = %call.logical_call_id,
            error.type = tracing::field::Empty,
        );
        let fut = async move {
            let observer = LegObserver {
                shared,
                leg: info.index,
            };
            let result = leg
                .call(engine, src, &info.call_id, &observer)
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
        (Abortable::new(fut, reg), cancel, handle)
    }

    /// Runs one round from an admitted primary.
    pub(crate) async fn run_round<L: Leg>(
        self: &Arc<Self>,
        leg: &L,
        call: &Arc<CallShared>,
        primary: Picked,
        policy: HedgePolicy,
        sink: Option<Arc<dyn DeltaSink>>,
        fallback_cooldown: Duration,
    ) -> Result<RoundOutcome<L::Output>, GovernanceError> {
        let clock = self.ports.clock.clone();
        let now = clock.now();
        let shared = Arc::new(RoundShared {
            window: Mutex::new(HedgeWindow::new(policy, now)),
            notify: Notify::new(),
            sink,
            pass: Mutex::new(Passthrough::default()),
        });
        let mut used: BTreeSet<String> = BTreeSet::new();
        used.insert(self.scope.sources[primary.source_idx].name.clone());
        let mut legs: FuturesUnordered<LegFuture<'_, L::Output>> = FuturesUnordered::new();
        let mut controls: Vec<(Arc<AtomicU8>, AbortHandle)> = Vec::new();
        let (f, c, h) = self.launch(leg, call, &shared, primary, 0, false);
        legs.push(f);
        controls.push((c, h));
        let mut failures: Vec<(usize, AttemptError)> = Vec::new();
        let mut aborted_for_commit = false;

        loop {
            // Passthrough commit: cancel every other leg once, no new leg after it.
            if let (Some(c), false) = (shared.committed(), aborted_for_commit) {
                aborted_for_commit = true;
                for (i, (flag, handle)) in controls.iter().enumerate() {
                    if i != c {
                        flag.store(CANCEL_HEDGE_LOSER, Ordering::SeqCst);
                        handle.abort();
                    }
                }
            }
            // Launch what the triggers ask for.
            let mut timer: Option<Instant> = None;
            // Chunks only matter to the round when they can arm a trigger (Idle: a
            // stall timer starts with the first chunk) or commit a passthrough stream;
            // otherwise a due timer re-reads the state, so no wake-up per chunk.
            let mut listen = shared.sink.is_some() && shared.committed().is_none();
            loop {
                let step = shared.window().poll(clock.now());
                match step {
                    HedgeStep::Launch => {
                        if let Some(p) = self.hedge_pick(&used, call, leg.stream()).await? {
                            used.insert(self.scope.sources[p.source_idx].name.clone());
                            let index = controls.len();
                            let (f, c, h) = self.launch(leg, call, &shared, p, index, true);
                            legs.push(f);
                            controls.push((c, h));
                            shared.window().on_extra_launched(clock.now());
                            self.metrics.hedge(&self.scope.name);
                        }
                    }
                    HedgeStep::Wait(t) => {
                        timer = Some(t);
                        break;
                    }
                    HedgeStep::Idle => {
                        listen = true;
                        break;
                    }
                    HedgeStep::Stop => break,
                }
            }
            let sleep = timer.map(|t| t.saturating_duration_since(clock.now()));
            tokio::select! {
                biased;
                next = legs.next() => {
                    let done = match next {
                        Some(Ok(done)) => done,
                        Some(Err(_aborted)) => {
                            if legs.is_empty() {
                                // Only reachable if the committed leg was aborted: never.
                                return Ok(self.combine(failures, shared.committed().is_some()));
                            }
                            continue;
                        }
                        None => return Ok(self.combine(failures, shared.committed().is_some())),
                    };
                    shared.window().on_leg_finished(done.info.index);
                    if done.result.is_ok() {
                        let mut ready = vec![done];
                        while let Some(Some(next)) = legs.next().now_or_never() {
                            if let Ok(d) = next {
                                ready.push(d);
                            }
                        }
                        return Ok(self
                            .settle_round(leg, ready, legs, &controls, call, fallback_cooldown)
                            .await);
                    }
                    let committed = shared.committed() == Some(done.info.index);
                    let LegDone { info, guard, result, wall } = done;
                    let Err(error) = result else { continue };
                    guard.fail(&error, wall, fallback_cooldown).await;
                    call.note_failure(&self.scope.sources[info.source_idx].name, &error);
                    if committed {
                        drop(legs);
                        return Ok(RoundOutcome::Failed { error, refunded: false, committed: true });
                    }
                    failures.push((info.index, error));
                    if legs.is_empty() {
                        return Ok(self.combine(failures, false));
                    }
                }
                _ = async { tokio::time::sleep(sleep.unwrap_or_default()).await }, if sleep.is_some() => {}
                _ = shared.notify.notified(), if listen => {}
            }
        }
    }

    /// Admission for an extra leg: never waits; budget first, then the full pick.
    async fn hedge_pick(
        &self,
        used: &BTreeSet<String>,
        call: &Arc<CallShared>,
        stream: bool,
    ) -> Result<Option<Picked>, GovernanceError> {
        if self.kind != ScopeKind::Chat {
            return Ok(None);
        }
        let now = self.ports.clock.now();
        if !self.budget().try_take(now, self.scope.hedge.budget_pct) {
            tracing::debug!("hedge skipped: budget");
            return Ok(None);
        }
        let pick = self.try_pick(used, &call.failed_sources(), stream).await;
        match pick {
            Ok(p) if p.admitted.is_some() => Ok(p.admitted),
            Ok(_) => {
                self.budget().give_back(now);
                tracing::debug!("hedge skipped: no other source admitted");
                Ok(None)
            }
            Err(e) => {
                self.budget().give_back(now);
                Err(e)
            }
        }
    }

    /// A leg succeeded: the earliest-launched success among the legs that completed
    /// together wins, the running legs are cancelled as hedge losers, the others that
    /// completed are finalized as what they were.
    async fn settle_round<'a, L: Leg>(
        &self,
        leg: &L,
        mut ready: Vec<LegDone<L::Output>>,
        running: FuturesUnordered<LegFuture<'a, L::Output>>,
        controls: &[(Arc<AtomicU8>, AbortHandle)],
        call: &Arc<CallShared>,
        fallback_cooldown: Duration,
    ) -> RoundOutcome<L::Output> {
        let win_pos = ready
            .iter()
            .enumerate()
            .filter(|(_, d)| d.result.is_ok())
            .min_by_key(|(_, d)| d.info.index)
            .map(|(i, _)| i)
            .unwrap_or(0);
        let winner = ready.swap_remove(win_pos);
        for (flag, _) in controls {
            flag.store(CANCEL_HEDGE_LOSER, Ordering::SeqCst);
        }
        // Dropping the running legs fires their guards: `hedge_cancelled`.
        drop(running);
        for d in ready {
            let LegDone {
                info,
                guard,
                result,
                wall,
            } = d;
            match result {
                // Completed in the same instant but launched later: not cancelled, so a
                // normal success row with its usage settled.
                Ok(out) => guard.succeed(&leg.facts(&out), wall).await,
                Err(e) => {
                    guard.fail(&e, wall, fallback_cooldown).await;
                    call.note_failure(&self.scope.sources[info.source_idx].name, &e);
                }
            }
        }
        let LegDone {
            info,
            guard,
            result,
            wall,
        } = winner;
        match result {
            Ok(output) => {
                let facts = leg.facts(&output);
                guard.succeed(&facts, wall).await;
                RoundOutcome::Won(Won {
                    output,
                    facts,
                    wall,
                    info,
                })
            }
            Err(error) => {
                guard.fail(&error, wall, fallback_cooldown).await;
                RoundOutcome::Failed {
                    error,
                    refunded: false,
                    committed: false,
                }
            }
        }
    }

    fn combine<T>(&self, failures: Vec<(usize, AttemptError)>, committed: bool) -> RoundOutcome<T> {
        let refs: Vec<(usize, &AttemptError)> = failures.iter().map(|(i, e)| (*i, e)).collect();
        match combine_failures(&refs) {
            Some(c) => RoundOutcome::Failed {
                error: failures[c.index].1.clone(),
                refunded: c.refunded,
                committed,
            },
            None => RoundOutcome::Failed {
                error: AttemptError::new(
                    polygw_core::ErrorClass::Transient,
                    polygw_core::ErrorLabel::Cancelled,
                    "the round ended without an attempt",
                ),
                refunded: false,
                committed,
            },
        }
    }
}
