//! One round of a logical call as a pure state machine (SPEC §7, §13.6): legs, both
//! hedge triggers, commit and re-commit of a passthrough stream, resume legs, and every
//! leg's final outcome and label — decided here from events, returned as actions. The
//! async engine feeds it events (chunks, leg ends, admission results, timers, the
//! deadline, the caller's drop) and carries the actions out; it decides nothing.
//!
//! Modes:
//! - **aggregated** (library `chat()`): legs race to completion; the first leg that
//!   ends successfully wins (legs ending in the same poll are fed in launch order, so
//!   the earliest launched wins). A stall trigger on a leg with content launches a
//!   prefill continuation of that leg where a prefill-capable source admits (else a
//!   fresh restart); a first-token trigger launches a leg like the late one: a fresh
//!   leg for a fresh leg, a continuation of the same text for a resume leg.
//! - **passthrough** (`polygw serve`, `chat_streaming`, `chat_stream`): the first leg
//!   to deliver an incremental chunk is committed and its chunks are forwarded; the
//!   others are cancelled (`hedge_cancelled`). After a commit, only resume legs start:
//!   when the committed leg goes silent for `STALL_AFTER_S`, a resume leg (prefill, or
//!   replay verified against the delivered text) races it — whichever delivers the next
//!   incremental chunk first is committed for the rest, the other is cancelled. When
//!   the committed leg fails and no resume leg runs, the round fails with a
//!   [`ResumePoint`]: the retry loop starts a continuation round from it.
//!
//! Invariants (checked by the property test below over random interleavings):
//! 1. the forwarded text only grows, and at the end equals the winner's whole answer
//!    (prefix + continuation, or the replayed text), never a character duplicated or
//!    lost;
//! 2. the winner of a passthrough round is its committed leg;
//! 3. every launched leg gets exactly one final fate;
//! 4. legs cancelled because of the deadline or the caller's drop are labelled
//!    `deadline` / `cancelled`, never `hedge_cancelled`;
//! 5. legs ≤ 1 + `MAX_EXTRA` + `MAX_RESUMES`; extra legs ≤ `MAX_EXTRA`; resume legs
//!    (besides a continuation round's primary) ≤ the round's `resumes_left`;
//! 6. each trigger fires at its own due time, whatever other timers are pending;
//! 7. a prefill leg's output is verified before any of it is forwarded (SPEC §17.1):
//!    a target that repeats the delivered text is handled as a replay or ends
//!    `resume_diverged`, never duplicating a character;
//! 8. no chunk of a leg is dropped silently: what an uncommitted leg holds is bounded
//!    in bytes, and a leg over the bound fails (`invalid`).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::error::{AttemptError, ErrorClass, ErrorLabel};
use crate::hedge::{combine_failures, HedgePolicy};
use crate::ports::StreamDelta;
use crate::resume::{
    check_prefill, is_prefill_unsupported, PrefillCheck, ReplayCheck, ResumeMode, ResumeSetting,
    Transcript,
};

/// A leg's position in its round (0 = the primary).
pub type LegId = usize;

/// What a leg sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LegKind {
    /// The original request.
    Fresh,
    /// A continuation of text the caller has (passthrough) or a leg produced
    /// (aggregated).
    Resume {
        /// Prefill or replay.
        mode: ResumeMode,
        /// The content continued (prefill: sent as the assistant prefill; replay: what
        /// the caller had when the leg started).
        prefix: String,
        /// The leg of this round it continues; `None` = the attempt carried in from
        /// the previous round.
        of: Option<LegId>,
    },
}

impl LegKind {
    /// The resume mode, if a resume leg.
    pub fn resume_mode(&self) -> Option<ResumeMode> {
        match self {
            LegKind::Fresh => None,
            LegKind::Resume { mode, .. } => Some(*mode),
        }
    }

    /// The leg a resume leg continues (`None`: a fresh leg, or the attempt carried in
    /// from the previous round).
    pub fn continues(&self) -> Option<LegId> {
        match self {
            LegKind::Fresh => None,
            LegKind::Resume { of, .. } => *of,
        }
    }

    /// The prefill prefix (empty for fresh and replay legs).
    pub fn prefill_prefix(&self) -> &str {
        match self {
            LegKind::Resume {
                mode: ResumeMode::Prefill,
                prefix,
                ..
            } => prefix,
            _ => "",
        }
    }
}

/// What the caller already has when a continuation round starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Carried {
    /// Delivered text (passthrough), or the failed leg's partial answer (aggregated).
    pub delivered: Transcript,
    /// The role chunk was sent.
    pub role_sent: bool,
    /// The failure that ends the call if nothing can resume.
    pub original: AttemptError,
}

/// How a round is set up.
#[derive(Debug, Clone)]
pub struct RoundSpec {
    /// Hedge triggers and `MAX_EXTRA`.
    pub policy: HedgePolicy,
    /// Per source (by index): its own (first-token, stall) thresholds — the `auto` ones
    /// in force for it (SPEC §19.1). A source past the end uses `policy`'s.
    pub triggers: Vec<(Option<Duration>, Option<Duration>)>,
    /// Forward the committed leg's chunks (proxy, streaming API).
    pub passthrough: bool,
    /// `STREAM__RESUME`.
    pub resume: ResumeSetting,
    /// Resume legs this round may still launch (`MAX_RESUMES` minus those used).
    pub resumes_left: u32,
    /// The call deadline, when set.
    pub deadline: Option<Instant>,
    /// The admitted primary's source.
    pub primary_source: usize,
    /// What the primary sends.
    pub primary_kind: LegKind,
    /// Set for a continuation round.
    pub carried: Option<Carried>,
}

/// Why the round cancels a running leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CancelReason {
    /// Another leg won or was committed (`hedge_cancelled`).
    HedgeLoser,
    /// The call deadline passed (`deadline`).
    Deadline,
    /// The caller dropped the call (`cancelled`).
    CallerDrop,
    /// A replay contradicted the delivered text, or a prefill leg repeated it and then
    /// differed (`resume_diverged`).
    Diverged,
    /// The leg sent more before its first deliverable chunk than the round holds
    /// (`invalid`).
    Overflow,
}

impl CancelReason {
    /// The telemetry label.
    pub fn label(self) -> ErrorLabel {
        match self {
            CancelReason::HedgeLoser => ErrorLabel::HedgeCancelled,
            CancelReason::Deadline => ErrorLabel::Deadline,
            CancelReason::CallerDrop => ErrorLabel::Cancelled,
            CancelReason::Diverged => ErrorLabel::ResumeDiverged,
            CancelReason::Overflow => ErrorLabel::Invalid,
        }
    }
}

/// A leg's final outcome.
#[derive(Debug, Clone, PartialEq)]
pub enum Fate {
    /// It is the round's answer.
    Won,
    /// It completed successfully but another leg won (a success row, usage settled).
    Succeeded,
    /// It failed with its own error (or its replay ended diverged).
    Failed(AttemptError),
    /// The round cancelled it.
    Cancelled(CancelReason),
}

impl Fate {
    /// The telemetry label (`None` = ok).
    pub fn label(&self) -> Option<ErrorLabel> {
        match self {
            Fate::Won | Fate::Succeeded => None,
            Fate::Failed(e) => Some(e.label),
            Fate::Cancelled(r) => Some(r.label()),
        }
    }
}

/// An admission the engine must try (never waiting); answer with [`Event::Picked`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickRequest {
    /// Sources that must not be picked.
    pub exclude: BTreeSet<usize>,
    /// Only this source (retrying a prefill rejection in replay).
    pub only: Option<usize>,
    /// Order prefill-capable sources first.
    pub prefer_prefill: bool,
    /// Only prefill-capable sources.
    pub require_prefill: bool,
    /// Take one extra leg from the scope's hedge budget (stall/first-token triggers).
    pub hedge_budget: bool,
    /// The leg whose trigger asks, and which trigger (`first_token`, `stall`); `None`
    /// for a pick that no trigger asked for (a continuation after a failure).
    pub fired_by: Option<(LegId, &'static str)>,
}

/// An admitted source, answering a [`PickRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Picked {
    /// The source.
    pub source: usize,
    /// It accepts an assistant prefill (configured and not learned otherwise).
    pub prefill_capable: bool,
    /// It takes a prefill that ends in whitespace (Anthropic does not: SPEC §23.6,
    /// [`crate::resume::prefill_takes_trailing_whitespace`]).
    pub prefill_trailing_whitespace: bool,
}

impl Picked {
    /// Whether a leg on this source may continue `delivered` by prefill.
    fn prefills(&self, delivered: &Transcript) -> bool {
        crate::resume::prefill_possible(
            self.prefill_capable,
            self.prefill_trailing_whitespace,
            delivered,
        )
    }
}

/// How a leg's transport phase ended.
#[derive(Debug, Clone, PartialEq)]
pub enum LegEnd {
    /// A complete answer.
    Ok,
    /// A classified failure.
    Err(AttemptError),
}

/// What happens to a round.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A parsed chunk of a running leg. `incremental` chunks move the triggers;
    /// `delta` is present when the engine asked for deltas (passthrough, resume).
    Chunk {
        /// The leg.
        leg: LegId,
        /// Arrival time (monotonic).
        at: Instant,
        /// It carries new content, reasoning or tool-call text.
        incremental: bool,
        /// The chunk.
        delta: Option<StreamDelta>,
    },
    /// A leg's transport phase ended.
    Ended {
        /// The leg.
        leg: LegId,
        /// How.
        end: LegEnd,
    },
    /// The answer to the outstanding [`Action::Pick`]: `None` = nothing admitted.
    Picked(Option<Picked>),
    /// The outstanding [`Action::Pick`] failed in the governance backend: no leg is
    /// launched for it (fail closed), and the legs already running go on — a backend
    /// error never cuts a healthy stream (SPEC §17, docs/DECISIONS.md).
    PickFailed,
    /// Time passed (a timer the round asked for via [`Round::next_wakeup`]).
    Tick,
    /// The call deadline passed.
    Deadline,
    /// The caller dropped the call.
    CallerDrop,
}

/// What the engine must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Try an admission now; answer with [`Event::Picked`].
    Pick(PickRequest),
    /// The admission just answered is not used: release it (0 tokens) and give its
    /// hedge budget back.
    ReleasePick,
    /// Start a leg on the admitted source.
    Launch {
        /// Its id.
        leg: LegId,
        /// Its source.
        source: usize,
        /// What it sends.
        kind: LegKind,
    },
    /// A leg is committed: its chunks reach the caller from now on. `first` is the
    /// call's first commit (the proxy sends its headers then).
    Commit {
        /// The leg.
        leg: LegId,
        /// No earlier leg of the call was committed.
        first: bool,
    },
    /// Send this chunk to the caller.
    Forward {
        /// The leg it comes from.
        leg: LegId,
        /// The chunk (role stripped after the first, text cut to what is new).
        delta: StreamDelta,
    },
    /// Stop a running leg; its fate is `Cancelled(reason)`.
    Cancel {
        /// The leg.
        leg: LegId,
        /// Why.
        reason: CancelReason,
    },
    /// Record an ended leg's fate (settlement, breaker, telemetry).
    Finalize {
        /// The leg.
        leg: LegId,
        /// Its fate.
        fate: Fate,
    },
    /// The source refused prefill: not prefill-capable for the rest of the process.
    MarkNoPrefill {
        /// The source.
        source: usize,
    },
    /// The round has its result ([`Round::result`]).
    Done,
}

/// Where a failed stream stands, for the continuation round.
#[derive(Debug, Clone, PartialEq)]
pub struct ResumePoint {
    /// What the caller has (passthrough) or the best partial answer (aggregated).
    pub delivered: Transcript,
    /// The role chunk was sent.
    pub role_sent: bool,
    /// The leg whose text it is (`None` = carried from an earlier round).
    pub of: Option<LegId>,
    /// The failure that ends the call if nothing can resume.
    pub original: AttemptError,
    /// Content already reached the caller (passthrough).
    pub delivered_to_caller: bool,
    /// A continuation round may be started (settings and budgets allow it).
    pub resumable: bool,
}

/// How a round ended.
#[derive(Debug, Clone, PartialEq)]
pub enum RoundResult {
    /// This leg's answer is the round's.
    Won {
        /// The winner.
        leg: LegId,
    },
    /// Every leg failed.
    Failed {
        /// The round's failure for the retry loop (combined over its legs).
        error: AttemptError,
        /// The leg whose failure represents the round.
        leg: Option<LegId>,
        /// Every leg was rate-limited: no budget.
        refunded: bool,
        /// Text to continue from, when any was produced.
        resume: Option<Box<ResumePoint>>,
    },
    /// The deadline passed.
    Deadline,
    /// The caller dropped the call.
    Dropped,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LegState {
    Running,
    /// Cancelled by the round; an end the engine already had in hand may still come.
    Cancelled,
    Ended,
}

#[derive(Debug, Clone)]
struct Leg {
    source: usize,
    /// Launched by a trigger (counts against `MAX_EXTRA` and the hedge budget).
    extra: bool,
    kind: LegKind,
    launched_at: Instant,
    state: LegState,
    fate: Option<Fate>,
    chunks: u32,
    last_chunk: Option<Instant>,
    first_token_fired: bool,
    stall_fired_at: Option<u32>,
    /// A trigger of this leg that fired but got no leg (the hedge budget was empty, no
    /// other source admitted): it fires again at `due` if the leg is still silent
    /// ([`REARM_DIVISOR`]).
    rearm: Option<Rearm>,
    /// The leg's own output.
    text: Transcript,
    /// Chunks held until the leg is committed (non-incremental ones; for a prefill leg
    /// also its output until it is verified).
    buffered: Vec<StreamDelta>,
    /// Bytes held in `buffered` (bounded by [`MAX_BUFFERED_BYTES`]).
    buffered_bytes: usize,
    /// Reasoning of the text a prefill leg continues (aggregated answers).
    base_reasoning: String,
    /// Where a prefill leg's output stands against its prefix.
    verify: Verify,
    /// Arrival of its first incremental chunk.
    first_chunk: Option<Instant>,
    /// Some of its incremental text reached the caller.
    delivered_text: bool,
    /// The trigger that launched it (an extra leg).
    fired_by: Option<Trigger>,
    /// The silent leg whose trigger launched it, that trigger's threshold and when the
    /// silence began (SPEC §25.2: the trace explains a launch later than its threshold).
    fired_from: Option<FiredFrom>,
}

/// What launched an extra leg: the leg that went silent, the threshold in force for its
/// trigger, and when its silence began (its launch, for a first-token trigger; its last
/// incremental chunk, for a stall). The launch came `launched_at − silent_since` into the
/// silence; beyond `threshold`, the trace says why (the budget, no source, admission).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FiredFrom {
    /// The silent leg.
    pub leg: LegId,
    /// Its trigger's threshold in force.
    pub threshold: Duration,
    /// When its silence began.
    pub silent_since: Instant,
}

/// The most a leg may hold, in bytes of chunks, before it is committed: far above what
/// a role chunk, a finish and a usage frame take, or a prefill's first 16 characters
/// behind a long reasoning; a leg that needs more fails (`invalid`), it is never cut
/// silently.
pub const MAX_BUFFERED_BYTES: usize = 8 << 20;

/// What a prefill leg's output has shown so far (SPEC §17.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verify {
    /// Not a prefill leg.
    NotPrefill,
    /// Not known yet (its output is held).
    Pending,
    /// A real continuation.
    Continuation,
    /// The target answered from scratch: handled as a replay of the prefix.
    Replay,
}

/// The bytes a held chunk takes (its text, its raw frame, and a fixed overhead).
fn held_bytes(d: &StreamDelta) -> usize {
    d.content.as_ref().map_or(0, String::len)
        + d.reasoning.as_ref().map_or(0, String::len)
        + d.tool_calls
            .iter()
            .map(|t| t.arguments.len() + 64)
            .sum::<usize>()
        + d.raw_text.as_ref().map_or(0, |t| t.json.len())
        + d.raw.as_ref().map_or(0, |m| 64 * m.len())
        + 256
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trigger {
    FirstToken,
    Stall,
}

impl Trigger {
    /// As the trace names it.
    fn name(self) -> &'static str {
        match self {
            Trigger::FirstToken => "first_token",
            Trigger::Stall => "stall",
        }
    }
}

/// A trigger due again after its pick launched nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rearm {
    trigger: Trigger,
    /// The leg's chunk count when it fired (a chunk since ends the silence: no re-fire).
    chunks: u32,
    due: Instant,
}

/// A trigger whose pick launched nothing (the hedge budget was empty, no other source
/// admitted) fires again after this fraction (an eighth) of its
/// threshold, as long as its leg stays silent: a budget that refills or a quota that
/// frees still rescues a long stall, and the longer a silence lasts the more often it
/// asks (a short stall ends before it asks again). Without it a stall that met an
/// empty bucket went unrescued to its end — the tail a budget-capped hedge is for.
pub const REARM_DIVISOR: u32 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    /// A fresh hedge leg before any commit.
    Hedge,
    /// A passthrough resume leg of the delivered text.
    Resume,
    /// Aggregated: continue leg `of` (or the carried partial) by prefill, else restart.
    Continue { of: Option<LegId> },
    /// A prefill leg was rejected: try its source again without prefill.
    AfterReject { source: usize, of: Option<LegId> },
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    purpose: Purpose,
    /// The leg whose trigger asked, and its chunk count then (progress since makes the
    /// pick moot).
    trigger: Option<(LegId, u32)>,
    /// The trigger that fired.
    fired: Option<Trigger>,
}

fn overflow_error() -> AttemptError {
    AttemptError::new(
        ErrorClass::Invalid,
        ErrorLabel::Invalid,
        format!(
            "the leg sent more than {MAX_BUFFERED_BYTES} bytes of chunks before anything \
             could be forwarded"
        ),
    )
}

/// The state of one round. See the module documentation.
#[derive(Debug, Clone)]
pub struct Round {
    spec: RoundSpec,
    legs: Vec<Leg>,
    committed: Option<LegId>,
    /// Something was forwarded to the caller (in this round or before it).
    delivered_any: bool,
    delivered: Transcript,
    role_sent: bool,
    /// The leg whose chunks carried the role (`None`: carried from an earlier round).
    role_leg: Option<LegId>,
    extras: u32,
    resumes: u32,
    pending: Option<Pending>,
    result: Option<RoundResult>,
    /// The failure of the last committed leg that failed (passthrough).
    original: Option<(LegId, AttemptError)>,
    failures: Vec<(LegId, AttemptError)>,
}

impl Round {
    /// A round whose primary (already admitted) launches at `now`. The returned
    /// actions hold its [`Action::Launch`].
    pub fn new(spec: RoundSpec, now: Instant) -> (Round, Vec<Action>) {
        let (delivered, role_sent, delivered_any) = match &spec.carried {
            Some(c) if spec.passthrough => (c.delivered.clone(), c.role_sent, true),
            _ => (Transcript::default(), false, false),
        };
        let mut r = Round {
            legs: Vec::new(),
            committed: None,
            delivered_any,
            delivered,
            role_sent,
            role_leg: None,
            extras: 0,
            resumes: 0,
            pending: None,
            result: None,
            original: None,
            failures: Vec::new(),
            spec,
        };
        let mut out = Vec::new();
        let (source, kind) = (r.spec.primary_source, r.spec.primary_kind.clone());
        let base_reasoning = match (&r.spec.carried, kind.resume_mode()) {
            (Some(c), Some(ResumeMode::Prefill)) => c.delivered.reasoning.clone(),
            _ => String::new(),
        };
        r.launch(source, kind, false, base_reasoning, now, &mut out);
        (r, out)
    }

    /// The result, once decided.
    pub fn result(&self) -> Option<&RoundResult> {
        self.result.as_ref()
    }

    /// Legs launched so far.
    pub fn legs(&self) -> usize {
        self.legs.len()
    }

    /// A leg's source.
    pub fn source(&self, leg: LegId) -> usize {
        self.legs[leg].source
    }

    /// What a leg sends.
    pub fn kind(&self, leg: LegId) -> &LegKind {
        &self.legs[leg].kind
    }

    /// Whether a leg was launched by a hedge trigger (an extra leg: `is_hedge`).
    pub fn is_extra(&self, leg: LegId) -> bool {
        self.legs[leg].extra
    }

    /// A leg's final fate, once decided.
    pub fn fate(&self, leg: LegId) -> Option<&Fate> {
        self.legs.get(leg).and_then(|l| l.fate.as_ref())
    }

    /// The committed leg (passthrough).
    pub fn committed(&self) -> Option<LegId> {
        self.committed
    }

    /// The text forwarded to the caller so far (passthrough; carried text included).
    pub fn delivered(&self) -> &Transcript {
        &self.delivered
    }

    /// A leg's own output so far (when the engine passes deltas).
    pub fn leg_text(&self, leg: LegId) -> &Transcript {
        &self.legs[leg].text
    }

    /// Extra legs launched in this round.
    pub fn extras(&self) -> u32 {
        self.extras
    }

    /// When a leg's first incremental chunk arrived (its time to first token, also for
    /// legs that did not complete).
    pub fn first_chunk(&self, leg: LegId) -> Option<Instant> {
        self.legs.get(leg).and_then(|l| l.first_chunk)
    }

    /// The trigger that launched a leg, when a trigger did: `first_token` or `stall`.
    pub fn fired_by(&self, leg: LegId) -> Option<&'static str> {
        self.legs
            .get(leg)
            .and_then(|l| l.fired_by)
            .map(Trigger::name)
    }

    /// What launched an extra leg (see [`FiredFrom`]).
    pub fn fired_from(&self, leg: LegId) -> Option<FiredFrom> {
        self.legs.get(leg).and_then(|l| l.fired_from)
    }

    /// Arrival of a leg's latest incremental chunk.
    pub fn last_chunk(&self, leg: LegId) -> Option<Instant> {
        self.legs.get(leg).and_then(|l| l.last_chunk)
    }

    /// Whether some of a leg's incremental text reached the caller (passthrough).
    pub fn delivered_text(&self, leg: LegId) -> bool {
        self.legs.get(leg).is_some_and(|l| l.delivered_text)
    }

    /// A leg's answer: the delivered text (passthrough), or (aggregated) its own output
    /// — after the prefix it continued, with that text's reasoning first, when it is a
    /// verified prefill continuation.
    pub fn answer(&self, leg: LegId) -> Transcript {
        if self.spec.passthrough {
            self.delivered.clone()
        } else {
            self.effective_text(leg)
        }
    }

    /// The other legs whose text `leg`'s answer holds, so that their usage counts in
    /// the answer's (SPEC §13.4, §17.8): in passthrough every other leg of this round
    /// whose text reached the caller; aggregated, the legs a verified prefill chain
    /// continues. The flag: the text carried in from an earlier round is part of it too.
    pub fn answer_chain(&self, leg: LegId) -> (Vec<LegId>, bool) {
        if self.spec.passthrough {
            let legs = (0..self.legs.len())
                .filter(|&i| i != leg && self.legs[i].delivered_text)
                .collect();
            return (legs, self.spec.carried.is_some());
        }
        let mut chain = Vec::new();
        let mut cur = leg;
        loop {
            let l = &self.legs[cur];
            let continues_prefix = !l.kind.prefill_prefix().is_empty()
                && self.prefill_verdict(cur, true) == PrefillCheck::Continuation;
            if !continues_prefix {
                return (chain, false);
            }
            match l.kind.continues() {
                Some(of) if of < cur && !chain.contains(&of) => {
                    chain.push(of);
                    cur = of;
                }
                Some(_) => return (chain, false),
                None => return (chain, self.spec.carried.is_some()),
            }
        }
    }

    /// Resume legs launched in this round (the primary of a continuation round not
    /// included: the retry loop counted it).
    pub fn resumes(&self) -> u32 {
        self.resumes
    }

    /// Whether the next chunk of `leg` must wake the engine at once: it is forwarded
    /// (passthrough), or its arrival arms a stall trigger (the leg's first chunk, or
    /// the first after its stall trigger fired) that may be due before any timer the
    /// engine sleeps on. Other chunks wait in the engine's queue until it wakes.
    pub fn chunk_wakes(&self, leg: LegId) -> bool {
        if self.spec.passthrough {
            return true;
        }
        let Some(l) = self.legs.get(leg) else {
            return false;
        };
        l.state == LegState::Running
            && self.triggers_for(l.source).1.is_some()
            && self.extras < self.spec.policy.max_extra
            && (l.chunks == 0 || l.stall_fired_at == Some(l.chunks))
    }

    /// When the engine must feed [`Event::Tick`] (or [`Event::Deadline`] when that is
    /// the deadline): the earliest due trigger or the deadline.
    pub fn next_wakeup(&self) -> Option<Instant> {
        if self.result.is_some() {
            return None;
        }
        let t = self.next_trigger().map(|(_, _, due)| due);
        match (t, self.spec.deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Feeds one event at `now`; appends the resulting actions to `out`.
    pub fn on(&mut self, event: Event, now: Instant, out: &mut Vec<Action>) {
        // An event fed at or after the deadline finds the round ended by it first: no
        // chunk of that instant commits (and so hedge-cancels) anything, and a leg end
        // in hand keeps its own outcome.
        if self.result.is_none() && event != Event::CallerDrop {
            if let Some(d) = self.spec.deadline {
                if now >= d {
                    self.cancel_running(CancelReason::Deadline, None, out);
                    self.finish(RoundResult::Deadline, out);
                }
            }
        }
        match event {
            Event::Chunk {
                leg,
                at,
                incremental,
                delta,
            } => self.on_chunk(leg, at, incremental, delta, out),
            Event::Ended { leg, end } => self.on_ended(leg, end, out),
            Event::Picked(p) => self.on_picked(p, now, out),
            Event::PickFailed => {
                // Fail closed: nothing launched for it; whatever runs goes on. Its
                // trigger does not ask again in this silence: a backend that failed is
                // not polled by every silent leg (a refusal is: `on_picked`).
                if self.pending.take().is_none() {
                    return;
                }
            }
            Event::Tick => {}
            Event::Deadline => {
                if self.result.is_none() {
                    self.cancel_running(CancelReason::Deadline, None, out);
                    self.finish(RoundResult::Deadline, out);
                }
                return;
            }
            Event::CallerDrop => {
                if self.result.is_none() {
                    self.cancel_running(CancelReason::CallerDrop, None, out);
                    self.finish(RoundResult::Dropped, out);
                }
                return;
            }
        }
        if self.result.is_none() {
            self.fire_triggers(now, out);
            self.check_end(out);
        }
    }

    // ----- legs -------------------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &mut self,
        source: usize,
        kind: LegKind,
        extra: bool,
        base_reasoning: String,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        let leg = self.legs.len();
        let verify = if kind.resume_mode() == Some(ResumeMode::Prefill) {
            Verify::Pending
        } else {
            Verify::NotPrefill
        };
        self.legs.push(Leg {
            source,
            extra,
            kind: kind.clone(),
            launched_at: now,
            state: LegState::Running,
            fate: None,
            chunks: 0,
            last_chunk: None,
            first_token_fired: false,
            stall_fired_at: None,
            rearm: None,
            text: Transcript::default(),
            buffered: Vec::new(),
            buffered_bytes: 0,
            base_reasoning,
            verify,
            first_chunk: None,
            delivered_text: false,
            fired_by: None,
            fired_from: None,
        });
        out.push(Action::Launch { leg, source, kind });
    }

    fn running(&self) -> impl Iterator<Item = LegId> + '_ {
        self.legs
            .iter()
            .enumerate()
            .filter(|(_, l)| l.state == LegState::Running)
            .map(|(i, _)| i)
    }

    fn cancel(&mut self, leg: LegId, reason: CancelReason, out: &mut Vec<Action>) {
        let l = &mut self.legs[leg];
        if l.state != LegState::Running {
            return;
        }
        l.state = LegState::Cancelled;
        l.fate = Some(Fate::Cancelled(reason));
        out.push(Action::Cancel { leg, reason });
    }

    fn cancel_running(
        &mut self,
        reason: CancelReason,
        except: Option<LegId>,
        out: &mut Vec<Action>,
    ) {
        let legs: Vec<LegId> = self.running().filter(|i| Some(*i) != except).collect();
        for leg in legs {
            self.cancel(leg, reason, out);
        }
    }

    fn finalize(&mut self, leg: LegId, fate: Fate, out: &mut Vec<Action>) {
        let l = &mut self.legs[leg];
        l.state = LegState::Ended;
        l.fate = Some(fate.clone());
        out.push(Action::Finalize { leg, fate });
    }

    fn finish(&mut self, result: RoundResult, out: &mut Vec<Action>) {
        if self.result.is_none() {
            self.result = Some(result);
            out.push(Action::Done);
        }
    }

    // ----- passthrough ------------------------------------------------------------

    /// Passthrough after something reached the caller: only resume legs start.
    fn continuation_phase(&self) -> bool {
        self.spec.passthrough && (self.committed.is_some() || self.delivered_any)
    }

    /// Whether one more resume leg may start.
    fn resume_possible(&self) -> bool {
        match self.spec.resume {
            ResumeSetting::Off => false,
            ResumeSetting::Prefill if self.spec.passthrough && !self.delivered.prefillable() => {
                false
            }
            _ => self.resumes < self.spec.resumes_left,
        }
    }

    fn forward(&mut self, leg: LegId, mut d: StreamDelta, out: &mut Vec<Action>) {
        // The role reaches the caller from one leg only: a resume leg's role chunk is
        // dropped; the first leg's own chunks pass unchanged (some providers repeat
        // the role on every chunk).
        if self.role_sent {
            if self.role_leg != Some(leg) {
                d.strip_role();
            }
        } else if d.role.is_some() {
            self.role_sent = true;
            self.role_leg = Some(leg);
        }
        if d.is_empty_chunk() {
            return;
        }
        self.delivered.absorb(&d);
        if d.is_incremental() {
            self.delivered_any = true;
            self.legs[leg].delivered_text = true;
        }
        out.push(Action::Forward { leg, delta: d });
    }

    fn commit(&mut self, leg: LegId, out: &mut Vec<Action>) {
        debug_assert!(
            self.legs[leg].kind.resume_mode() != Some(ResumeMode::Prefill)
                || self.legs[leg].kind.prefill_prefix() == self.delivered.content,
            "a prefill leg commits only while the delivered text is its prefix"
        );
        let first = !self.delivered_any && self.committed.is_none();
        // Whoever was committed or racing loses.
        self.cancel_running(CancelReason::HedgeLoser, Some(leg), out);
        self.committed = Some(leg);
        out.push(Action::Commit { leg, first });
        let buffered = std::mem::take(&mut self.legs[leg].buffered);
        for d in buffered {
            self.forward(leg, d, out);
        }
    }

    /// Holds a chunk of an uncommitted leg; a leg over [`MAX_BUFFERED_BYTES`] fails
    /// (`invalid`) instead of losing chunks.
    fn buffer(&mut self, leg: LegId, d: StreamDelta, out: &mut Vec<Action>) {
        let n = held_bytes(&d);
        let l = &mut self.legs[leg];
        if l.buffered_bytes + n > MAX_BUFFERED_BYTES {
            l.buffered.clear();
            l.buffered_bytes = 0;
            self.cancel(leg, CancelReason::Overflow, out);
            self.failures.push((leg, overflow_error()));
            return;
        }
        l.buffered_bytes += n;
        l.buffered.push(d);
    }

    /// The verdict on a prefill leg's output (`Continuation` for other legs).
    fn prefill_verdict(&self, leg: LegId, ended: bool) -> PrefillCheck {
        let l = &self.legs[leg];
        match l.verify {
            Verify::NotPrefill | Verify::Continuation => PrefillCheck::Continuation,
            Verify::Replay => PrefillCheck::Replay,
            Verify::Pending => check_prefill(l.kind.prefill_prefix(), &l.text, ended),
        }
    }

    /// Applies a prefill leg's verdict; returns it. A target that ignored the prefill
    /// is learned as such (one `MarkNoPrefill`); a replay verdict drops the echo the leg
    /// held (only what follows the prefix is new); a divergence cuts the leg.
    fn verify_prefill(&mut self, leg: LegId, ended: bool, out: &mut Vec<Action>) -> PrefillCheck {
        if self.legs[leg].verify != Verify::Pending {
            return self.prefill_verdict(leg, ended);
        }
        let v = self.prefill_verdict(leg, ended);
        if v.ignores_prefill() {
            out.push(Action::MarkNoPrefill {
                source: self.legs[leg].source,
            });
        }
        match v {
            PrefillCheck::Undecided => {}
            PrefillCheck::Continuation => self.legs[leg].verify = Verify::Continuation,
            PrefillCheck::Replay => {
                let l = &mut self.legs[leg];
                l.verify = Verify::Replay;
                l.buffered.retain(|d| !d.is_incremental());
                l.buffered_bytes = l.buffered.iter().map(held_bytes).sum();
            }
            PrefillCheck::Diverged => {
                if !ended {
                    self.cancel(leg, CancelReason::Diverged, out);
                    let e = self.diverged_error(leg);
                    self.failures.push((leg, e));
                }
            }
        }
        v
    }

    fn on_chunk(
        &mut self,
        leg: LegId,
        at: Instant,
        incremental: bool,
        delta: Option<StreamDelta>,
        out: &mut Vec<Action>,
    ) {
        if self.result.is_some() || self.legs.get(leg).map(|l| l.state) != Some(LegState::Running) {
            return;
        }
        {
            let l = &mut self.legs[leg];
            if incremental {
                l.chunks = l.chunks.saturating_add(1);
                l.last_chunk = Some(l.last_chunk.map_or(at, |p| p.max(at)));
                l.first_chunk.get_or_insert(at);
            }
            if let Some(d) = &delta {
                l.text.absorb(d);
            }
        }
        if !self.spec.passthrough {
            if delta.is_some() && self.legs[leg].verify == Verify::Pending {
                // A prefill that ignores its prefix is learned (and a divergent one
                // cut) as soon as it shows.
                self.verify_prefill(leg, false, out);
            }
            return;
        }
        let Some(d) = delta else { return };
        if self.committed == Some(leg) {
            if incremental {
                // The committed leg delivered first: racing resume legs lose.
                self.cancel_running(CancelReason::HedgeLoser, Some(leg), out);
            }
            self.forward(leg, d, out);
            return;
        }
        let replay = match self.legs[leg].kind.resume_mode() {
            None => false,
            Some(ResumeMode::Replay) => true,
            Some(ResumeMode::Prefill) => match self.verify_prefill(leg, false, out) {
                PrefillCheck::Undecided => {
                    // Held until the output shows what it is (at most 16 characters
                    // of content, and whatever comes before them).
                    self.buffer(leg, d, out);
                    return;
                }
                PrefillCheck::Diverged => return,
                PrefillCheck::Continuation => false,
                PrefillCheck::Replay => true,
            },
        };
        if !replay {
            if incremental {
                self.commit(leg, out);
                self.forward(leg, d, out);
            } else {
                self.buffer(leg, d, out);
            }
            return;
        }
        match self.legs[leg].text.check_replay(&self.delivered) {
            ReplayCheck::Diverged => {
                self.cancel(leg, CancelReason::Diverged, out);
                let e = self.diverged_error(leg);
                self.failures.push((leg, e));
            }
            ReplayCheck::Behind => {}
            ReplayCheck::Covered => {
                let (content, tools) = self.legs[leg].text.excess_over(&self.delivered);
                if content.is_some() || !tools.is_empty() {
                    let mut d = d;
                    d.set_text(content, tools);
                    self.commit(leg, out);
                    self.forward(leg, d, out);
                } else if !incremental {
                    // Covered exactly: later chunks (finish, usage) are held.
                    self.buffer(leg, d, out);
                }
            }
        }
    }

    fn diverged_error(&self, leg: LegId) -> AttemptError {
        let l = &self.legs[leg];
        let prefix = l.kind.prefill_prefix();
        let detail = if l.verify == Verify::Pending && !prefix.is_empty() {
            let shared = l
                .text
                .content
                .chars()
                .zip(prefix.chars())
                .take_while(|(a, b)| a == b)
                .count();
            format!(
                "the prefill continuation repeated the first {shared} of the {} delivered \
                 characters and then differed (the target ignores assistant prefill)",
                prefix.chars().count()
            )
        } else {
            let at = l.text.divergence_char(&self.delivered);
            format!(
                "the replayed answer diverged from the {} delivered characters at character {at}",
                self.delivered.content_chars()
            )
        };
        AttemptError::new(ErrorClass::Invalid, ErrorLabel::ResumeDiverged, detail)
    }

    // ----- ends -------------------------------------------------------------------

    fn on_ended(&mut self, leg: LegId, end: LegEnd, out: &mut Vec<Action>) {
        let Some(state) = self.legs.get(leg).map(|l| l.state) else {
            return;
        };
        match state {
            LegState::Ended => {}
            LegState::Cancelled => {
                // Ended on its own in the same poll the round cancelled it: it keeps
                // its real outcome (a completed loser's usage is real).
                let fate = match (end, &self.legs[leg].fate) {
                    (LegEnd::Ok, Some(Fate::Cancelled(CancelReason::Diverged))) => {
                        Fate::Failed(self.diverged_error(leg))
                    }
                    (LegEnd::Ok, Some(Fate::Cancelled(CancelReason::Overflow))) => {
                        Fate::Failed(overflow_error())
                    }
                    (LegEnd::Ok, _) => Fate::Succeeded,
                    (LegEnd::Err(e), _) => Fate::Failed(e),
                };
                self.finalize(leg, fate, out);
            }
            LegState::Running => match end {
                LegEnd::Ok => self.on_success(leg, out),
                LegEnd::Err(e) => self.on_failure(leg, e, out),
            },
        }
    }

    fn on_success(&mut self, leg: LegId, out: &mut Vec<Action>) {
        if self.result.is_some() {
            self.finalize(leg, Fate::Succeeded, out);
            return;
        }
        let verdict = if self.legs[leg].verify == Verify::Pending {
            self.verify_prefill(leg, true, out)
        } else {
            self.prefill_verdict(leg, true)
        };
        if matches!(verdict, PrefillCheck::Diverged | PrefillCheck::Undecided) {
            let e = self.diverged_error(leg);
            self.on_failure(leg, e, out);
            return;
        }
        if !self.spec.passthrough || self.committed == Some(leg) {
            self.win(leg, out);
            return;
        }
        let replay = match self.legs[leg].kind.resume_mode() {
            None => false,
            Some(ResumeMode::Prefill) => verdict == PrefillCheck::Replay,
            Some(ResumeMode::Replay) => true,
        };
        if !replay || self.legs[leg].text.check_replay(&self.delivered) == ReplayCheck::Covered {
            // An answer without any incremental chunk (e.g. a `length` stop with
            // nothing generated), a prefill whose continuation is empty, or a replay
            // that reproduced exactly the delivered text.
            self.commit(leg, out);
            self.win(leg, out);
        } else {
            let e = self.diverged_error(leg);
            self.on_failure(leg, e, out);
        }
    }

    fn win(&mut self, leg: LegId, out: &mut Vec<Action>) {
        self.cancel_running(CancelReason::HedgeLoser, Some(leg), out);
        self.finalize(leg, Fate::Won, out);
        self.finish(RoundResult::Won { leg }, out);
    }

    fn on_failure(&mut self, leg: LegId, e: AttemptError, out: &mut Vec<Action>) {
        self.finalize(leg, Fate::Failed(e.clone()), out);
        if self.result.is_some() {
            return;
        }
        if self.committed == Some(leg) {
            self.committed = None;
            self.original = Some((leg, e.clone()));
        }
        let prefill = self.legs[leg].kind.resume_mode() == Some(ResumeMode::Prefill);
        if prefill && e.class == ErrorClass::Rejected {
            let source = self.legs[leg].source;
            if is_prefill_unsupported(&e) {
                out.push(Action::MarkNoPrefill { source });
            }
            let replay_allowed = !self.spec.passthrough || self.spec.resume == ResumeSetting::Auto;
            if replay_allowed && self.pending.is_none() && self.resumes < self.spec.resumes_left {
                let of = match &self.legs[leg].kind {
                    LegKind::Resume { of, .. } => *of,
                    LegKind::Fresh => None,
                };
                self.pending = Some(Pending {
                    purpose: Purpose::AfterReject { source, of },
                    trigger: None,
                    fired: None,
                });
                out.push(Action::Pick(PickRequest {
                    exclude: BTreeSet::new(),
                    only: Some(source),
                    prefer_prefill: false,
                    require_prefill: false,
                    hedge_budget: false,
                    fired_by: None,
                }));
            }
        }
        self.failures.push((leg, e));
    }

    /// All legs done and nothing pending: the round failed.
    fn check_end(&mut self, out: &mut Vec<Action>) {
        if self.result.is_some() || self.pending.is_some() || self.running().next().is_some() {
            return;
        }
        let result = self.failed_result();
        self.finish(result, out);
    }

    fn failed_result(&self) -> RoundResult {
        let refs: Vec<(usize, &AttemptError)> =
            self.failures.iter().map(|(i, e)| (*i, e)).collect();
        let (mut error, refunded, leg) = match combine_failures(&refs) {
            Some(c) => (
                self.failures[c.index].1.clone(),
                c.refunded,
                Some(self.failures[c.index].0),
            ),
            None => (
                AttemptError::new(
                    ErrorClass::Transient,
                    ErrorLabel::Cancelled,
                    "the round ended without an attempt",
                ),
                false,
                None,
            ),
        };
        let resume = if self.spec.passthrough {
            self.passthrough_resume_point()
        } else {
            self.aggregated_resume_point()
        };
        // A resume leg's rejection (prefill refused, a longer prompt refused) is not
        // the caller's request being refused: the retry loop may go on.
        if resume.is_some() && error.class == ErrorClass::Rejected {
            error.class = ErrorClass::Invalid;
        }
        RoundResult::Failed {
            error,
            leg,
            refunded,
            resume: resume.map(Box::new),
        }
    }

    fn passthrough_resume_point(&self) -> Option<ResumePoint> {
        if !self.delivered_any {
            return None;
        }
        let (of, original) = match (&self.original, &self.spec.carried) {
            (Some((leg, e)), _) => (Some(*leg), e.clone()),
            (None, Some(c)) => (None, c.original.clone()),
            (None, None) => return None,
        };
        Some(ResumePoint {
            delivered: self.delivered.clone(),
            role_sent: self.role_sent,
            of,
            original,
            delivered_to_caller: true,
            resumable: self.spec.resume != ResumeSetting::Off
                && self.resumes < self.spec.resumes_left
                && (self.spec.resume != ResumeSetting::Prefill || self.delivered.prefillable()),
        })
    }

    /// The effective answer text of a leg: for a prefill leg, the prefix (with the
    /// reasoning of the text it continues) and its verified continuation — or its own
    /// output when it replayed the prefix, or the prefix alone while its output is
    /// unverified or diverged; for other legs, their own output.
    fn effective_text(&self, leg: LegId) -> Transcript {
        let l = &self.legs[leg];
        if l.verify == Verify::NotPrefill {
            return l.text.clone();
        }
        let prefix = l.kind.prefill_prefix();
        match self.prefill_verdict(leg, l.state != LegState::Running) {
            PrefillCheck::Replay => l.text.clone(),
            PrefillCheck::Continuation => Transcript {
                content: format!("{prefix}{}", l.text.content),
                reasoning: format!("{}{}", l.base_reasoning, l.text.reasoning),
                tools: l.text.tools.clone(),
                opaque: l.text.opaque,
            },
            PrefillCheck::Undecided | PrefillCheck::Diverged => Transcript {
                content: prefix.to_string(),
                reasoning: l.base_reasoning.clone(),
                tools: Default::default(),
                // A prefix is never opaque (a prefill is sent only for text).
                opaque: false,
            },
        }
    }

    /// The text a continuation of `of` continues (`None`: the carried text).
    fn continued_text(&self, of: Option<LegId>) -> Transcript {
        match of {
            Some(leg) => self.effective_text(leg),
            None => self
                .spec
                .carried
                .as_ref()
                .map(|c| c.delivered.clone())
                .unwrap_or_default(),
        }
    }

    fn aggregated_resume_point(&self) -> Option<ResumePoint> {
        let mut best: Option<(Option<LegId>, Transcript, AttemptError)> = self
            .spec
            .carried
            .as_ref()
            .map(|c| (None, c.delivered.clone(), c.original.clone()));
        for (leg, e) in &self.failures {
            let t = self.effective_text(*leg);
            if !t.prefillable() || t.content.is_empty() {
                continue;
            }
            if best
                .as_ref()
                .is_none_or(|(_, b, _)| t.content.len() > b.content.len())
            {
                best = Some((Some(*leg), t, e.clone()));
            }
        }
        let (of, delivered, original) = best?;
        Some(ResumePoint {
            resumable: self.spec.resume != ResumeSetting::Off
                && self.resumes < self.spec.resumes_left
                && !delivered.content.is_empty(),
            delivered,
            role_sent: false,
            of,
            original,
            delivered_to_caller: false,
        })
    }

    // ----- triggers ---------------------------------------------------------------

    /// What a due trigger of `leg` would launch, if anything.
    fn trigger_purpose(&self, leg: LegId, trigger: Trigger) -> Option<Purpose> {
        if self.extras >= self.spec.policy.max_extra {
            return None;
        }
        if !self.spec.passthrough {
            return Some(match trigger {
                // A resume leg slow to start is backed up by another continuation of
                // the same text, not by a restart that would make the caller wait a
                // whole answer again; a fresh leg by a fresh one (or, in a continuation
                // round, by a continuation of the carried text).
                Trigger::FirstToken => Purpose::Continue {
                    of: self.legs[leg].kind.continues(),
                },
                Trigger::Stall => Purpose::Continue { of: Some(leg) },
            });
        }
        let l = &self.legs[leg];
        if self.continuation_phase() {
            if !self.resume_possible() {
                return None;
            }
            let committed = self.committed == Some(leg);
            return match (trigger, committed) {
                (Trigger::Stall, true) => Some(Purpose::Resume),
                (_, false) if l.kind.resume_mode().is_some() => Some(Purpose::Resume),
                _ => None,
            };
        }
        (trigger == Trigger::FirstToken && l.kind == LegKind::Fresh).then_some(Purpose::Hedge)
    }

    /// A leg's (first-token, stall) thresholds: its source's, else the policy's.
    fn triggers_for(&self, source: usize) -> (Option<Duration>, Option<Duration>) {
        self.spec
            .triggers
            .get(source)
            .copied()
            .unwrap_or((self.spec.policy.after, self.spec.policy.stall_after))
    }

    /// Whether any trigger can fire in this round.
    fn hedging_enabled(&self) -> bool {
        self.spec.policy.max_extra > 0
            && (self.spec.policy.enabled()
                || self
                    .spec
                    .triggers
                    .iter()
                    .any(|(a, s)| a.is_some() || s.is_some()))
    }

    /// The earliest trigger that can fire: (leg, trigger, due).
    fn next_trigger(&self) -> Option<(LegId, Trigger, Instant)> {
        if self.pending.is_some() || self.result.is_some() || !self.hedging_enabled() {
            return None;
        }
        let mut best: Option<(LegId, Trigger, Instant)> = None;
        let mut consider = |leg: LegId, t: Trigger, due: Instant| {
            if best.is_none_or(|(_, _, b)| due < b) {
                best = Some((leg, t, due));
            }
        };
        for leg in self.running() {
            let l = &self.legs[leg];
            let (after, stall_after) = self.triggers_for(l.source);
            let rearmed = |t: Trigger| {
                l.rearm
                    .filter(|r| r.trigger == t && r.chunks == l.chunks)
                    .map(|r| r.due)
            };
            if let (Some(after), 0) = (after, l.chunks) {
                let due = if l.first_token_fired {
                    rearmed(Trigger::FirstToken)
                } else {
                    Some(l.launched_at + after)
                };
                if let Some(due) = due {
                    if self.trigger_purpose(leg, Trigger::FirstToken).is_some() {
                        consider(leg, Trigger::FirstToken, due);
                    }
                }
            }
            if let (Some(stall), Some(last)) = (stall_after, l.last_chunk) {
                let due = if l.stall_fired_at == Some(l.chunks) {
                    rearmed(Trigger::Stall)
                } else {
                    Some(last + stall)
                };
                if let Some(due) = due {
                    if self.trigger_purpose(leg, Trigger::Stall).is_some() {
                        consider(leg, Trigger::Stall, due);
                    }
                }
            }
        }
        best
    }

    /// A trigger's pick launched nothing: it fires again [`REARM_DIVISOR`]-th of its
    /// threshold from `now`, if its leg is still running and silent.
    fn rearm(&mut self, pending: Pending, now: Instant) {
        let (Some((leg, chunks)), Some(trigger)) = (pending.trigger, pending.fired) else {
            return;
        };
        let Some(l) = self.legs.get(leg) else {
            return;
        };
        if l.state != LegState::Running || l.chunks != chunks {
            return;
        }
        let (after, stall) = self.triggers_for(l.source);
        let threshold = match trigger {
            Trigger::FirstToken => after,
            Trigger::Stall => stall,
        };
        if let Some(th) = threshold {
            let wait = (th / REARM_DIVISOR).max(Duration::from_millis(1));
            self.legs[leg].rearm = Some(Rearm {
                trigger,
                chunks,
                due: now + wait,
            });
        }
    }

    fn fire_triggers(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some((leg, trigger, due)) = self.next_trigger() else {
            return;
        };
        if due > now {
            return;
        }
        let Some(purpose) = self.trigger_purpose(leg, trigger) else {
            return;
        };
        {
            let l = &mut self.legs[leg];
            l.rearm = None;
            match trigger {
                Trigger::FirstToken => l.first_token_fired = true,
                Trigger::Stall => l.stall_fired_at = Some(l.chunks),
            }
        }
        let chunks = self.legs[leg].chunks;
        let mut request = self.pick_request(purpose);
        request.fired_by = Some((leg, trigger.name()));
        self.pending = Some(Pending {
            purpose,
            trigger: Some((leg, chunks)),
            fired: Some(trigger),
        });
        out.push(Action::Pick(request));
    }

    fn pick_request(&self, purpose: Purpose) -> PickRequest {
        let used: BTreeSet<usize> = self.legs.iter().map(|l| l.source).collect();
        let running: BTreeSet<usize> = self.running().map(|i| self.legs[i].source).collect();
        match purpose {
            Purpose::Hedge => PickRequest {
                exclude: used,
                only: None,
                prefer_prefill: false,
                require_prefill: false,
                hedge_budget: true,
                fired_by: None,
            },
            Purpose::Resume => {
                let mut exclude = running;
                if let Some(c) = self.committed {
                    exclude.insert(self.legs[c].source);
                }
                PickRequest {
                    exclude,
                    only: None,
                    prefer_prefill: true,
                    require_prefill: self.spec.resume == ResumeSetting::Prefill,
                    hedge_budget: true,
                    fired_by: None,
                }
            }
            Purpose::Continue { .. } => PickRequest {
                exclude: used,
                only: None,
                prefer_prefill: self.spec.resume != ResumeSetting::Off,
                require_prefill: false,
                hedge_budget: true,
                fired_by: None,
            },
            Purpose::AfterReject { source, .. } => PickRequest {
                exclude: BTreeSet::new(),
                only: Some(source),
                prefer_prefill: false,
                require_prefill: false,
                hedge_budget: false,
                fired_by: None,
            },
        }
    }

    fn on_picked(&mut self, picked: Option<Picked>, now: Instant, out: &mut Vec<Action>) {
        let Some(pending) = self.pending.take() else {
            if picked.is_some() {
                out.push(Action::ReleasePick);
            }
            return;
        };
        let Some(p) = picked else {
            self.rearm(pending, now);
            return;
        };
        let moot = self.result.is_some()
            || pending.trigger.is_some_and(|(leg, chunks)| {
                let l = &self.legs[leg];
                l.state != LegState::Running || l.chunks != chunks
            });
        let kind = if moot {
            None
        } else {
            self.kind_for(pending.purpose, p)
        };
        match kind {
            None => out.push(Action::ReleasePick),
            Some(kind) => {
                // A retry after a prefill rejection counts as a resume whatever it
                // sends; a triggered leg is an extra, and a resume when it is one.
                let extra = !matches!(pending.purpose, Purpose::AfterReject { .. });
                if extra {
                    self.extras += 1;
                }
                if !extra || kind.resume_mode().is_some() {
                    self.resumes += 1;
                }
                let base_reasoning = match (&kind, pending.purpose) {
                    (
                        LegKind::Resume {
                            mode: ResumeMode::Prefill,
                            ..
                        },
                        Purpose::Continue { of },
                    ) => self.continued_text(of).reasoning,
                    _ => String::new(),
                };
                let fired_from = match (pending.trigger, pending.fired) {
                    (Some((from, _)), Some(trigger)) => self.legs.get(from).and_then(|f| {
                        let (after, stall) = self.triggers_for(f.source);
                        let (threshold, since) = match trigger {
                            Trigger::FirstToken => (after, Some(f.launched_at)),
                            Trigger::Stall => (stall, f.last_chunk),
                        };
                        Some(FiredFrom {
                            leg: from,
                            threshold: threshold?,
                            silent_since: since?,
                        })
                    }),
                    _ => None,
                };
                self.launch(p.source, kind, extra, base_reasoning, now, out);
                if let Some(l) = self.legs.last_mut() {
                    l.fired_by = pending.fired;
                    l.fired_from = fired_from;
                }
            }
        }
    }

    /// What a leg on the admitted source sends, for this purpose (`None`: nothing
    /// useful; the admission is released).
    fn kind_for(&self, purpose: Purpose, p: Picked) -> Option<LegKind> {
        let can_resume = self.resume_possible();
        match purpose {
            Purpose::Hedge => (!self.continuation_phase()).then_some(LegKind::Fresh),
            Purpose::Resume => {
                if !self.continuation_phase() || !can_resume {
                    return None;
                }
                let of = self.committed;
                if p.prefills(&self.delivered) {
                    Some(LegKind::Resume {
                        mode: ResumeMode::Prefill,
                        prefix: self.delivered.content.clone(),
                        of,
                    })
                } else if self.spec.resume == ResumeSetting::Auto {
                    Some(LegKind::Resume {
                        mode: ResumeMode::Replay,
                        prefix: self.delivered.content.clone(),
                        of,
                    })
                } else {
                    None
                }
            }
            Purpose::Continue { of } => {
                let prefix = self.continued_text(of);
                if p.prefills(&prefix) && can_resume && !prefix.content.is_empty() {
                    Some(LegKind::Resume {
                        mode: ResumeMode::Prefill,
                        prefix: prefix.content,
                        of,
                    })
                } else {
                    Some(LegKind::Fresh)
                }
            }
            Purpose::AfterReject { of, .. } => {
                if self.spec.passthrough {
                    if !self.continuation_phase() || !can_resume {
                        return None;
                    }
                    Some(LegKind::Resume {
                        mode: ResumeMode::Replay,
                        prefix: self.delivered.content.clone(),
                        of: of.or(self.committed),
                    })
                } else {
                    Some(LegKind::Fresh)
                }
            }
        }
    }
}

pub mod gate;

#[cfg(test)]
mod tests;
