//! The decision trace of a logical call (SPEC §19.4): what the engine did and why, as
//! events with their offset from the call's start, and the hedge thresholds in force
//! with their origin. The call's last row carries it as compact JSON (`trace`);
//! `polygw report --call ID` prints it as a timeline and the HTML report draws it.
//!
//! Bounded: at most [`MAX_EVENTS`] events are kept (a call that does more says how many
//! it left out), so a trace stays a few KB whatever happens.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::hedge::{ThresholdInForce, ThresholdOrigin};

/// Events a trace keeps at most.
pub const MAX_EVENTS: usize = 64;

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "e", rename_all = "snake_case")]
pub enum TraceEvent {
    /// A round began; the thresholds in force for its primary's source.
    Round {
        /// Round number (1-based).
        n: u32,
        /// First-token threshold, ms (absent: off or not yet).
        #[serde(skip_serializing_if = "Option::is_none")]
        after_ms: Option<u64>,
        /// Where it comes from.
        after_from: ThresholdOrigin,
        /// Stall threshold, ms.
        #[serde(skip_serializing_if = "Option::is_none")]
        stall_ms: Option<u64>,
        /// Where it comes from.
        stall_from: ThresholdOrigin,
    },
    /// A leg was launched.
    Launch {
        /// Leg (per round).
        leg: usize,
        /// Source.
        src: String,
        /// Why: `primary`, `retry`, `hedge`, `resume` (a continuation or resume leg).
        why: String,
        /// The trigger that fired it, for an extra leg: `first_token` or `stall`.
        #[serde(skip_serializing_if = "Option::is_none")]
        by: Option<String>,
        /// Resume mode: `prefill` or `replay`.
        #[serde(skip_serializing_if = "Option::is_none")]
        mode: Option<String>,
        /// For an extra leg: the silent leg whose trigger launched it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        of: Option<usize>,
        /// That trigger's threshold in force, ms.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        thr_ms: Option<u64>,
        /// How far into the silence the leg launched, ms.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        silent_ms: Option<u64>,
        /// Why it launched later than the threshold (SPEC §25.2): the refusal of this
        /// silence (`hedge_budget`, `no_source`, `governance`), or `admission` (the
        /// pick itself took the time).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        late: Option<String>,
    },
    /// A leg's trigger fired but no extra leg could start: `why` is `hedge_budget` (the
    /// scope's budget was empty), `no_source` (no other source admitted) or
    /// `governance` (the governance backend failed). The trigger asks again while the
    /// leg stays silent; the trace keeps the first refusal of a run of them.
    NoLeg {
        /// The leg whose trigger fired.
        leg: usize,
        /// `first_token` or `stall`.
        by: String,
        /// Why no leg started.
        why: String,
    },
    /// A leg's first incremental chunk.
    FirstToken {
        /// Leg.
        leg: usize,
    },
    /// A leg's chunks reach the caller from now on.
    Commit {
        /// Leg.
        leg: usize,
    },
    /// The round cancelled a leg.
    Cancel {
        /// Leg.
        leg: usize,
        /// Its label (`hedge_cancelled`, `deadline`, …).
        why: String,
    },
    /// A leg failed.
    Fail {
        /// Leg.
        leg: usize,
        /// Its label.
        why: String,
    },
    /// A leg's answer is the call's.
    Won {
        /// Leg.
        leg: usize,
    },
    /// The call ended without an answer.
    End {
        /// The terminal reason.
        why: String,
    },
}

/// One event and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// Milliseconds since the call started.
    pub t: u64,
    /// The event.
    #[serde(flatten)]
    pub event: TraceEvent,
}

/// A call's trace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallTrace {
    /// Events, in order.
    pub events: Vec<TraceEntry>,
    /// Events left out beyond [`MAX_EVENTS`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dropped: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl CallTrace {
    /// Records `event` at `at`, for a call that started at `started`.
    pub fn push(&mut self, started: Instant, at: Instant, event: TraceEvent) {
        if self.events.len() >= MAX_EVENTS {
            self.dropped = self.dropped.saturating_add(1);
            return;
        }
        let t =
            u64::try_from(at.saturating_duration_since(started).as_millis()).unwrap_or(u64::MAX);
        self.events.push(TraceEntry { t, event });
    }

    /// The compact JSON of the `trace` column.
    pub fn to_json(&self) -> String {
        // A plain call's trace is 300–500 bytes: one buffer, no regrowth.
        let mut out = Vec::with_capacity(512);
        match serde_json::to_writer(&mut out, self) {
            // serde_json writes UTF-8.
            Ok(()) => String::from_utf8(out).unwrap_or_else(|_| "{}".to_string()),
            Err(_) => "{}".to_string(),
        }
    }

    /// Reads a `trace` column back.
    pub fn from_json(s: &str) -> Result<CallTrace, serde_json::Error> {
        serde_json::from_str(s)
    }

    /// The trace as a timeline, one line per event (`polygw report --call`).
    pub fn timeline(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .events
            .iter()
            .map(|e| format!("{:>8} ms  {}", e.t, describe(&e.event)))
            .collect();
        if self.dropped > 0 {
            out.push(format!(
                "          … {} more event(s) not kept",
                self.dropped
            ));
        }
        out
    }
}

fn origin(o: ThresholdOrigin) -> &'static str {
    match o {
        ThresholdOrigin::Off => "off",
        ThresholdOrigin::Configured => "configured",
        ThresholdOrigin::Source => "from the source's latency",
        ThresholdOrigin::Pooled => "from the scope's pooled latency",
        ThresholdOrigin::NotYet => "auto, too few samples yet",
        ThresholdOrigin::Prior => "auto, from the prior: no evidence yet",
    }
}

fn threshold(ms: Option<u64>, o: ThresholdOrigin) -> String {
    match ms {
        Some(ms) => format!("{ms} ms ({})", origin(o)),
        None => origin(o).to_string(),
    }
}

/// One event in words.
pub fn describe(e: &TraceEvent) -> String {
    match e {
        TraceEvent::Round {
            n,
            after_ms,
            after_from,
            stall_ms,
            stall_from,
        } => format!(
            "round {n}: hedge after first token {}, after a stall {}",
            threshold(*after_ms, *after_from),
            threshold(*stall_ms, *stall_from)
        ),
        TraceEvent::Launch {
            leg,
            src,
            why,
            by,
            mode,
            of,
            thr_ms,
            silent_ms,
            late,
        } => {
            let by = by
                .as_deref()
                .map(|b| format!(" on its {} trigger", b.replace('_', " ")))
                .unwrap_or_default();
            let mode = mode
                .as_deref()
                .map(|m| format!(" by {m}"))
                .unwrap_or_default();
            let when = match (silent_ms, thr_ms) {
                (Some(s), Some(t)) => {
                    let late = match late.as_deref() {
                        Some("hedge_budget") => {
                            " — later than it: the hedge budget was spent until then"
                        }
                        Some("no_source") => {
                            " — later than it: no other source admitted it until then"
                        }
                        Some("governance") => {
                            " — later than it: the governance backend failed until then"
                        }
                        Some("admission") => " — later than it: the admission took that long",
                        _ => "",
                    };
                    let of = of.map(|o| format!("leg {o}'s ")).unwrap_or_default();
                    format!(", {s} ms into {of}silence (threshold {t} ms){late}")
                }
                _ => String::new(),
            };
            format!("leg {leg} launched on {src}: {why}{mode}{by}{when}")
        }
        TraceEvent::NoLeg { leg, by, why } => {
            let why = match why.as_str() {
                "hedge_budget" => "the hedge budget is spent",
                "no_source" => "no other source admits it",
                "governance" => "the governance backend failed",
                other => other,
            };
            format!(
                "leg {leg}: its {} trigger fired, no extra leg ({why}); it asks again while the leg is silent",
                by.replace('_', " ")
            )
        }
        TraceEvent::FirstToken { leg } => format!("leg {leg}: first token"),
        TraceEvent::Commit { leg } => format!("leg {leg} committed: its chunks reach the caller"),
        TraceEvent::Cancel { leg, why } => format!("leg {leg} cancelled ({why})"),
        TraceEvent::Fail { leg, why } => format!("leg {leg} failed ({why})"),
        TraceEvent::Won { leg } => format!("leg {leg} won"),
        TraceEvent::End { why } => format!("call ended: {why}"),
    }
}

/// A threshold in force as the trace's (ms, origin).
pub fn threshold_parts(t: &ThresholdInForce) -> (Option<u64>, ThresholdOrigin) {
    (
        t.value
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        t.origin,
    )
}

/// A static policy's threshold as a trace's (ms, origin).
pub fn static_parts(d: Option<Duration>) -> (Option<u64>, ThresholdOrigin) {
    match d {
        Some(d) => (
            Some(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            ThresholdOrigin::Configured,
        ),
        None => (None, ThresholdOrigin::Off),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_round_trips_and_reads_as_a_timeline() {
        #[allow(clippy::disallowed_methods)]
        let s = Instant::now();
        let mut t = CallTrace::default();
        t.push(
            s,
            s,
            TraceEvent::Round {
                n: 1,
                after_ms: Some(1_800),
                after_from: ThresholdOrigin::Source,
                stall_ms: None,
                stall_from: ThresholdOrigin::NotYet,
            },
        );
        t.push(
            s,
            s,
            TraceEvent::Launch {
                leg: 0,
                src: "a-0".into(),
                why: "primary".into(),
                by: None,
                mode: None,
                of: None,
                thr_ms: None,
                silent_ms: None,
                late: None,
            },
        );
        t.push(
            s,
            s + Duration::from_millis(1_800),
            TraceEvent::Launch {
                leg: 1,
                src: "b-0".into(),
                why: "hedge".into(),
                by: Some("first_token".into()),
                mode: None,
                of: Some(0),
                thr_ms: Some(1_800),
                silent_ms: Some(1_800),
                late: None,
            },
        );
        t.push(
            s,
            s + Duration::from_millis(1_900),
            TraceEvent::Won { leg: 1 },
        );
        let json = t.to_json();
        assert!(json.len() < 440, "compact: {json}");
        assert!(
            json.contains(
                r#"{"t":1800,"e":"launch","leg":1,"src":"b-0","why":"hedge","by":"first_token","of":0,"thr_ms":1800,"silent_ms":1800}"#
            ),
            "{json}"
        );
        assert_eq!(CallTrace::from_json(&json).unwrap(), t);
        let lines = t.timeline();
        assert_eq!(lines.len(), 4);
        assert!(
            lines[0].contains("1800 ms (from the source's latency)"),
            "{}",
            lines[0]
        );
        assert!(
            lines[2].contains("leg 1 launched on b-0: hedge on its first token trigger"),
            "{}",
            lines[2]
        );
    }

    #[test]
    fn a_trace_is_bounded() {
        #[allow(clippy::disallowed_methods)]
        let s = Instant::now();
        let mut t = CallTrace::default();
        for leg in 0..(MAX_EVENTS + 10) {
            t.push(s, s, TraceEvent::FirstToken { leg });
        }
        assert_eq!((t.events.len(), t.dropped), (MAX_EVENTS, 10));
        assert!(t.timeline().last().unwrap().contains("10 more"));
    }
}
