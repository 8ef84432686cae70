//! The legs of a logical call from its decision trace (SPEC §19.4): when each leg was
//! launched and why, its first token and commit, the stalls that fired the stall trigger
//! while it led (an extra leg launched, or none because the budget was spent), and how it
//! ended — for the HTML report's timeline chart and `polygw report
//! --call`. Pure functions over rows; definitions: docs/REPORT.md.

use std::collections::{HashMap, HashSet};

use polygw::core::trace::{CallTrace, TraceEvent};
use polygw::core::{RowKind, TelemetryRow};

/// Calls the HTML timeline chart and the "Slowest calls" table show at most.
pub const MAX_TIMELINE_CALLS: usize = 20;

/// How a leg ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LegEnd {
    /// Its answer is the call's.
    Won,
    /// It failed (its label).
    Failed(String),
    /// The round cancelled it (its label: `hedge_cancelled`, `deadline`, …).
    Cancelled(String),
    /// Its row says it ended without being the answer and the trace says nothing more
    /// (an `ok` leg another leg beat, or a row the trace lost).
    Ended,
    /// Neither the trace nor a row says how (a trace cut at [`polygw::core::trace::MAX_EVENTS`]).
    Unknown,
}

impl LegEnd {
    /// The CSS class suffix and legend key.
    pub fn class(&self) -> &'static str {
        match self {
            LegEnd::Won => "won",
            LegEnd::Failed(_) => "failed",
            LegEnd::Cancelled(_) => "cancelled",
            LegEnd::Ended => "ended",
            LegEnd::Unknown => "unknown",
        }
    }

    /// In words.
    pub fn text(&self) -> String {
        match self {
            LegEnd::Won => "won".into(),
            LegEnd::Failed(l) => format!("failed ({l})"),
            LegEnd::Cancelled(l) => format!("cancelled ({l})"),
            LegEnd::Ended => "ended, not the answer".into(),
            LegEnd::Unknown => "end unknown".into(),
        }
    }
}

/// What a leg's attempt row adds to the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct LegRow {
    /// The row's `call_id`.
    pub call_id: String,
    /// `latency_ms`.
    pub latency_ms: Option<u64>,
    /// `ttft_ms`.
    pub ttft_ms: Option<u64>,
    /// `stall_count` (gaps over the metering threshold).
    pub stall_count: Option<u32>,
    /// Tokens in words (`prompt/completion`, `… (est.)`, `—`).
    pub tokens: String,
    /// `cost`.
    pub cost: Option<f64>,
}

/// One leg of a call.
#[derive(Debug, Clone, PartialEq)]
pub struct LegSpan {
    /// Its round (1-based).
    pub round: u32,
    /// Its index within the round.
    pub leg: usize,
    /// Source.
    pub src: String,
    /// Why it was launched: `primary`, `retry`, `hedge`, `resume`.
    pub why: String,
    /// The trigger that fired it (`first_token`, `stall`).
    pub by: Option<String>,
    /// Resume mode (`prefill`, `replay`).
    pub mode: Option<String>,
    /// Launch, ms since the call's start.
    pub start: u64,
    /// End, ms since the call's start.
    pub end: u64,
    /// The end is known (a trace event or the row's latency), not the trace's last event.
    pub end_known: bool,
    /// First incremental chunk.
    pub first_token: Option<u64>,
    /// Its chunks reached the caller from here on.
    pub commit: Option<u64>,
    /// When a stall of this leg fired the stall trigger (an extra leg launched `by`
    /// `stall` while it led the round, or the trigger's first refusal in that silence).
    pub stalls: Vec<u64>,
    /// How it ended.
    pub outcome: LegEnd,
    /// Its attempt row, when the rows and the trace agree on it.
    pub row: Option<LegRow>,
}

impl LegSpan {
    /// `r1·L0 a-0 primary`, `r1·L1 b-0 hedge (first token)`, `… resume by prefill (stall)`.
    pub fn label(&self) -> String {
        let mode = self
            .mode
            .as_deref()
            .map(|m| format!(" by {m}"))
            .unwrap_or_default();
        let by = self
            .by
            .as_deref()
            .map(|b| format!(" ({})", b.replace('_', " ")))
            .unwrap_or_default();
        format!(
            "r{}·L{} {} {}{mode}{by}",
            self.round, self.leg, self.src, self.why
        )
    }
}

/// A round's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundStart {
    /// Round number.
    pub n: u32,
    /// Its start, ms since the call's start.
    pub t: u64,
}

/// A call's legs, from its trace and rows.
#[derive(Debug, Clone, PartialEq)]
pub struct CallTimeline {
    /// `logical_call_id`.
    pub logical_call_id: String,
    /// Scope.
    pub scope: String,
    /// The legs, in launch order.
    pub legs: Vec<LegSpan>,
    /// The rounds' starts.
    pub rounds: Vec<RoundStart>,
    /// The call ended without an answer: when and why.
    pub end: Option<(u64, String)>,
    /// The call's length in the trace (its last event or leg end), ms.
    pub duration: u64,
    /// Events the trace left out.
    pub dropped: u32,
}

impl CallTimeline {
    /// The call's outcome in words: `answered by r1·L1 (b-0, hedge)`, `failed: …`.
    pub fn outcome(&self) -> String {
        if let Some((_, why)) = &self.end {
            return format!("failed: {why}");
        }
        match self.legs.iter().find(|l| l.outcome == LegEnd::Won) {
            Some(l) => format!("answered by r{}·L{} ({}, {})", l.round, l.leg, l.src, l.why),
            None => "no outcome in the trace".into(),
        }
    }

    /// Builds the timeline of `trace`, the trace of the call whose rows are `rows`.
    pub fn of(trace: &CallTrace, rows: &[&TelemetryRow]) -> CallTimeline {
        let (logical_call_id, scope) = rows
            .first()
            .map(|r| (r.logical_call_id.clone(), r.scope.to_string()))
            .unwrap_or_default();
        let mut legs: Vec<LegSpan> = Vec::new();
        let mut rounds = Vec::new();
        let mut end = None;
        let mut round = 0u32;
        let mut last_t = 0u64;
        // Ends found in the trace (indices into `legs`).
        let mut ended: Vec<bool> = Vec::new();
        // The events are in time order (the engine sorts them before it writes them).
        let mut events: Vec<_> = trace.events.iter().collect();
        events.sort_by_key(|e| e.t);
        for e in events {
            last_t = last_t.max(e.t);
            match &e.event {
                TraceEvent::Round { n, .. } => {
                    round = *n;
                    rounds.push(RoundStart { n: *n, t: e.t });
                }
                TraceEvent::Launch {
                    leg,
                    src,
                    why,
                    by,
                    mode,
                    ..
                } => {
                    if round == 0 {
                        round = 1;
                    }
                    if by.as_deref() == Some("stall") {
                        // The leg that stalled: the round's committed leg still running,
                        // else its latest open one.
                        let open = |s: &(usize, &LegSpan)| s.1.round == round && !ended[s.0];
                        let stalled = legs
                            .iter()
                            .enumerate()
                            .filter(open)
                            .rfind(|(_, s)| s.commit.is_some())
                            .or_else(|| legs.iter().enumerate().rfind(open))
                            .map(|(i, _)| i);
                        if let Some(i) = stalled {
                            legs[i].stalls.push(e.t);
                        }
                    }
                    legs.push(LegSpan {
                        round,
                        leg: *leg,
                        src: src.clone(),
                        why: why.clone(),
                        by: by.clone(),
                        mode: mode.clone(),
                        start: e.t,
                        end: e.t,
                        end_known: false,
                        first_token: None,
                        commit: None,
                        stalls: Vec::new(),
                        outcome: LegEnd::Unknown,
                        row: None,
                    });
                    ended.push(false);
                }
                TraceEvent::NoLeg { leg, by, .. } => {
                    // A stall detected that no leg could rescue yet: marked on the leg.
                    if by == "stall" {
                        if let Some(i) = find(&legs, round, *leg) {
                            legs[i].stalls.push(e.t);
                        }
                    }
                }
                TraceEvent::FirstToken { leg } => {
                    if let Some(i) = find(&legs, round, *leg) {
                        legs[i].first_token.get_or_insert(e.t);
                    }
                }
                TraceEvent::Commit { leg } => {
                    if let Some(i) = find(&legs, round, *leg) {
                        legs[i].commit.get_or_insert(e.t);
                    }
                }
                TraceEvent::Cancel { leg, .. }
                | TraceEvent::Fail { leg, .. }
                | TraceEvent::Won { leg } => {
                    let Some(i) = find(&legs, round, *leg) else {
                        continue;
                    };
                    if ended[i] {
                        continue;
                    }
                    ended[i] = true;
                    legs[i].end = e.t.max(legs[i].start);
                    legs[i].end_known = true;
                    legs[i].outcome = match &e.event {
                        TraceEvent::Fail { why, .. } => LegEnd::Failed(why.clone()),
                        TraceEvent::Cancel { why, .. } => LegEnd::Cancelled(why.clone()),
                        _ => LegEnd::Won,
                    };
                }
                TraceEvent::End { why } => end = Some((e.t, why.clone())),
            }
        }
        attach_rows(&mut legs, rows);
        for (i, s) in legs.iter_mut().enumerate() {
            // A leg cancelled after its first token may have no first-token event (the
            // trace was written before it ended): its row's TTFT says when.
            if s.first_token.is_none() {
                s.first_token = s
                    .row
                    .as_ref()
                    .and_then(|r| r.ttft_ms)
                    .map(|t| s.start.saturating_add(t));
            }
            if ended[i] {
                continue;
            }
            // No end in the trace: the row's latency, else the trace's last event.
            match s.row.as_ref().and_then(|r| r.latency_ms) {
                Some(l) => {
                    s.end = s.start.saturating_add(l);
                    s.end_known = true;
                }
                None => s.end = last_t.max(s.start),
            }
        }
        let duration = legs.iter().map(|s| s.end).fold(last_t, u64::max);
        CallTimeline {
            logical_call_id,
            scope,
            legs,
            rounds,
            end,
            duration,
            dropped: trace.dropped,
        }
    }
}

/// The span of `leg` in `round`, else its latest one (a trace that lost the round's
/// start).
fn find(legs: &[LegSpan], round: u32, leg: usize) -> Option<usize> {
    legs.iter()
        .rposition(|s| s.leg == leg && s.round == round)
        .or_else(|| legs.iter().rposition(|s| s.leg == leg))
}

/// Tokens of a row in words: `prompt/completion`, `(est.)` when estimated, `—` when
/// unavailable.
pub fn tokens_text(r: &TelemetryRow) -> String {
    use polygw::UsageSource;
    let pair = || {
        format!(
            "{}/{}",
            r.prompt_tokens.unwrap_or(0),
            r.completion_tokens.unwrap_or(0)
        )
    };
    match r.usage_source {
        UsageSource::Measured => pair(),
        UsageSource::Estimated => format!("{} (est.)", pair()),
        UsageSource::Unavailable => "—".into(),
    }
}

/// The attempt rows onto the legs: the engine numbers attempts (`attempt_index`) in launch
/// order, so the k-th launch is attempt k — taken only when the sources agree (a trace
/// that lost events, or rows cut by `--since`, keep the legs without rows).
fn attach_rows(legs: &mut [LegSpan], rows: &[&TelemetryRow]) {
    let by_index: HashMap<u32, &TelemetryRow> = rows
        .iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .filter_map(|r| r.attempt_index.map(|i| (i, *r)))
        .collect();
    for (k, s) in legs.iter_mut().enumerate() {
        let Some(r) = u32::try_from(k).ok().and_then(|k| by_index.get(&k)) else {
            continue;
        };
        if r.source.as_deref() != Some(s.src.as_str()) {
            continue;
        }
        s.row = Some(LegRow {
            call_id: r.call_id.clone(),
            latency_ms: r.latency_ms,
            ttft_ms: r.ttft_ms,
            stall_count: r.stall_count,
            tokens: tokens_text(r),
            cost: r.cost,
        });
        if s.outcome == LegEnd::Unknown {
            s.outcome = match &r.error {
                None if r.ok => LegEnd::Ended,
                Some(l) if l.ends_with("cancelled") => LegEnd::Cancelled(l.clone()),
                Some(l) => LegEnd::Failed(l.clone()),
                None => LegEnd::Unknown,
            };
        }
    }
}

/// The row of a call that carries its trace: the last one that has one.
pub fn trace_row<'a>(rows: &[&'a TelemetryRow]) -> Option<&'a TelemetryRow> {
    rows.iter()
        .filter(|r| r.trace.is_some())
        .max_by(|a, b| {
            a.created_at_ms
                .cmp(&b.created_at_ms)
                .then_with(|| a.call_id.cmp(&b.call_id))
        })
        .copied()
}

/// The timelines of the calls `ids` (in that order), from `rows`; a call whose trace is
/// missing or unreadable is left out.
pub fn timelines_of(rows: &[TelemetryRow], ids: &[String]) -> Vec<CallTimeline> {
    let wanted: HashSet<&str> = ids.iter().map(String::as_str).collect();
    let mut by_call: HashMap<&str, Vec<&TelemetryRow>> = HashMap::new();
    for r in rows {
        if wanted.contains(r.logical_call_id.as_str()) {
            by_call.entry(&r.logical_call_id).or_default().push(r);
        }
    }
    ids.iter()
        .filter_map(|id| {
            let rows = by_call.get(id.as_str())?;
            let trace = CallTrace::from_json(trace_row(rows)?.trace.as_deref()?).ok()?;
            Some(CallTimeline::of(&trace, rows))
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use polygw::core::hedge::ThresholdOrigin;
    use polygw::core::trace::TraceEntry;
    use polygw::UsageSource;

    fn ev(t: u64, event: TraceEvent) -> TraceEntry {
        TraceEntry { t, event }
    }

    fn round(n: u32) -> TraceEvent {
        TraceEvent::Round {
            n,
            after_ms: Some(200),
            after_from: ThresholdOrigin::Configured,
            stall_ms: Some(500),
            stall_from: ThresholdOrigin::Configured,
        }
    }

    pub(crate) fn launch(leg: usize, src: &str, why: &str, by: Option<&str>) -> TraceEvent {
        TraceEvent::Launch {
            leg,
            src: src.into(),
            why: why.into(),
            by: by.map(str::to_string),
            mode: (why == "resume").then(|| "prefill".to_string()),
            of: None,
            thr_ms: None,
            silent_ms: None,
            late: None,
        }
    }

    /// A hedged call whose primary stalled after its commit; the resume leg won.
    pub(crate) fn stalled_trace() -> CallTrace {
        CallTrace {
            events: vec![
                ev(0, round(1)),
                ev(0, launch(0, "a-0", "primary", None)),
                ev(120, TraceEvent::FirstToken { leg: 0 }),
                ev(120, TraceEvent::Commit { leg: 0 }),
                ev(900, launch(1, "b-0", "resume", Some("stall"))),
                ev(950, TraceEvent::FirstToken { leg: 1 }),
                ev(950, TraceEvent::Commit { leg: 1 }),
                ev(
                    950,
                    TraceEvent::Cancel {
                        leg: 0,
                        why: "hedge_cancelled".into(),
                    },
                ),
                ev(1_400, TraceEvent::Won { leg: 1 }),
            ],
            dropped: 0,
        }
    }

    fn row(call: &str, id: &str, i: u32, src: &str) -> TelemetryRow {
        let mut r = TelemetryRow::new(RowKind::Attempt, id, call, "LLM", "chat", 10_000);
        r.source = Some(src.into());
        r.attempt_index = Some(i);
        r
    }

    #[test]
    fn legs_from_a_stalled_and_resumed_call() {
        let mut a = row("c", "c-a", 0, "a-0");
        a.error = Some("hedge_cancelled".into());
        let mut b = row("c", "c-b", 1, "b-0");
        b.ok = true;
        b.usage_source = UsageSource::Measured;
        b.prompt_tokens = Some(10);
        b.completion_tokens = Some(5);
        b.latency_ms = Some(500);
        let t = CallTimeline::of(&stalled_trace(), &[&a, &b]);
        assert_eq!(t.logical_call_id, "c");
        assert_eq!(t.duration, 1_400);
        assert_eq!(t.legs.len(), 2);
        let (l0, l1) = (&t.legs[0], &t.legs[1]);
        assert_eq!(
            (l0.start, l0.end, l0.first_token, l0.commit),
            (0, 950, Some(120), Some(120))
        );
        assert_eq!(l0.stalls, [900], "the committed leg stalled");
        assert_eq!(l0.outcome, LegEnd::Cancelled("hedge_cancelled".into()));
        assert_eq!((l1.start, l1.end), (900, 1_400));
        assert_eq!(l1.outcome, LegEnd::Won);
        assert_eq!(l1.label(), "r1·L1 b-0 resume by prefill (stall)");
        assert_eq!(l1.row.as_ref().unwrap().tokens, "10/5");
        assert_eq!(l0.row.as_ref().unwrap().call_id, "c-a");
        assert_eq!(t.outcome(), "answered by r1·L1 (b-0, resume)");
    }

    #[test]
    fn rounds_keep_their_legs_apart_and_a_failed_call_ends() {
        let trace = CallTrace {
            events: vec![
                ev(0, round(1)),
                ev(0, launch(0, "a-0", "primary", None)),
                ev(
                    30,
                    TraceEvent::Fail {
                        leg: 0,
                        why: "server_error".into(),
                    },
                ),
                ev(130, round(2)),
                ev(130, launch(0, "b-0", "retry", None)),
                ev(
                    160,
                    TraceEvent::Fail {
                        leg: 0,
                        why: "rate_limited".into(),
                    },
                ),
                ev(
                    161,
                    TraceEvent::End {
                        why: "retry_exhausted".into(),
                    },
                ),
            ],
            dropped: 0,
        };
        // Rows whose sources disagree with the launches are not attached.
        let a = row("f", "f-a", 0, "a-0");
        let wrong = row("f", "f-b", 1, "z-0");
        let t = CallTimeline::of(&trace, &[&a, &wrong]);
        assert_eq!(t.rounds.len(), 2);
        assert_eq!(
            t.legs
                .iter()
                .map(|l| (l.round, l.leg, l.start, l.end))
                .collect::<Vec<_>>(),
            [(1, 0, 0, 30), (2, 0, 130, 160)]
        );
        assert!(t.legs[0].row.is_some() && t.legs[1].row.is_none());
        assert_eq!(t.legs[1].outcome, LegEnd::Failed("rate_limited".into()));
        assert_eq!(t.end, Some((161, "retry_exhausted".into())));
        assert_eq!(t.outcome(), "failed: retry_exhausted");
        assert_eq!(t.duration, 161);
    }

    #[test]
    fn a_leg_without_an_end_event_ends_with_its_row_or_the_trace() {
        let trace = CallTrace {
            events: vec![
                ev(0, launch(0, "a-0", "primary", None)),
                ev(10, launch(1, "b-0", "hedge", Some("first_token"))),
                ev(700, TraceEvent::Won { leg: 1 }),
            ],
            dropped: 3,
        };
        let mut a = row("o", "o-a", 0, "a-0");
        a.ok = true;
        a.latency_ms = Some(800);
        let t = CallTimeline::of(&trace, &[&a]);
        assert_eq!(t.legs[0].round, 1, "no round event: round 1");
        assert_eq!((t.legs[0].end, t.legs[0].end_known), (800, true));
        assert_eq!(t.legs[0].outcome, LegEnd::Ended);
        assert_eq!(t.duration, 800);
        assert_eq!(t.dropped, 3);
        let t = CallTimeline::of(&trace, &[]);
        assert_eq!((t.legs[0].end, t.legs[0].end_known), (700, false));
        assert_eq!(t.legs[0].outcome, LegEnd::Unknown);
    }

    #[test]
    fn the_trace_row_and_the_timelines_of_some_calls() {
        let mut a = row("c", "c-a", 0, "a-0");
        a.error = Some("hedge_cancelled".into());
        let mut b = row("c", "c-b", 1, "b-0");
        b.ok = true;
        b.created_at_ms = 20_000;
        b.trace = Some(stalled_trace().to_json());
        let mut old = row("old", "old-a", 0, "a-0");
        old.ok = true;
        let mut bad = row("bad", "bad-a", 0, "a-0");
        bad.trace = Some("{not json".into());
        let rows = vec![a, b, old, bad];
        let refs: Vec<&TelemetryRow> = rows.iter().take(2).collect();
        assert_eq!(trace_row(&refs).map(|r| r.call_id.as_str()), Some("c-b"));
        let got = timelines_of(
            &rows,
            &["c".to_string(), "old".to_string(), "bad".to_string()],
        );
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].legs.len(), 2);
    }
}
