//! Tests of the round state machine: regression cases for the races found in the
//! imperative engine, and a property test over random interleavings of chunks, ends,
//! admissions, timers, the deadline and the caller's drop (SPEC §13.6).

use super::*;
use crate::ports::{Rng, SplitMix64};
use proptest::prelude::*;
use std::time::Duration;

const ANSWER: &str = "Héllo wörld, the quick brown fox 😀 jumps over the lazy dog.";
const ALT: &str = "Héllo there! A different answer, entirely its own.";

fn t0() -> Instant {
    #[allow(clippy::disallowed_methods)]
    Instant::now()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn err(class: ErrorClass) -> AttemptError {
    let label = match class {
        ErrorClass::RateLimited => ErrorLabel::RateLimited,
        ErrorClass::Rejected => ErrorLabel::Rejected,
        ErrorClass::Dead => ErrorLabel::Dead,
        ErrorClass::Invalid => ErrorLabel::Invalid,
        ErrorClass::Transient => ErrorLabel::Truncated,
    };
    AttemptError::new(class, label, "scripted")
}

fn text(s: &str) -> StreamDelta {
    StreamDelta {
        content: Some(s.into()),
        ..Default::default()
    }
}

fn role() -> StreamDelta {
    StreamDelta {
        role: Some("assistant".into()),
        ..Default::default()
    }
}

fn finish() -> StreamDelta {
    StreamDelta {
        finish_reason: Some("stop".into()),
        ..Default::default()
    }
}

fn policy(after: Option<u64>, stall: Option<u64>, max_extra: u32) -> HedgePolicy {
    HedgePolicy {
        after: after.map(ms),
        stall_after: stall.map(ms),
        max_extra,
    }
}

fn spec(passthrough: bool, p: HedgePolicy) -> RoundSpec {
    RoundSpec {
        policy: p,
        triggers: Vec::new(),
        passthrough,
        resume: ResumeSetting::Auto,
        resumes_left: 2,
        deadline: None,
        primary_source: 0,
        primary_kind: LegKind::Fresh,
        carried: None,
    }
}

fn chunk(leg: LegId, at: Instant, d: StreamDelta) -> Event {
    Event::Chunk {
        leg,
        at,
        incremental: d.is_incremental(),
        delta: Some(d),
    }
}

fn forwarded(actions: &[Action]) -> String {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Forward { delta, .. } => delta.content.clone(),
            _ => None,
        })
        .collect()
}

fn picks(actions: &[Action]) -> usize {
    actions
        .iter()
        .filter(|a| matches!(a, Action::Pick(_)))
        .count()
}

/// Drives a round by hand, keeping every action.
struct Hand {
    r: Round,
    now: Instant,
    log: Vec<Action>,
}

impl Hand {
    fn new(s: RoundSpec) -> Self {
        let now = t0();
        let (r, log) = Round::new(s, now);
        Hand { r, now, log }
    }
    fn at(&mut self, t: u64) -> &mut Self {
        self.now = self.r.legs[0].launched_at + ms(t);
        self
    }
    fn on(&mut self, e: Event) -> Vec<Action> {
        let mut out = Vec::new();
        self.r.on(e, self.now, &mut out);
        self.log.extend(out.iter().cloned());
        out
    }
    fn chunk(&mut self, leg: LegId, d: StreamDelta) -> Vec<Action> {
        let at = self.now;
        self.on(chunk(leg, at, d))
    }
}

// ----- regression tests -------------------------------------------------------------

/// A second leg completing in the same poll that commits the first: the round returns
/// the committed leg, the other is a completed loser, and only the committed leg's
/// text reaches the caller.
#[test]
fn passthrough_co_completion_returns_the_committed_leg() {
    let mut h = Hand::new(spec(true, policy(Some(100), None, 1)));
    h.at(100).on(Event::Tick);
    h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: false,
        prefill_trailing_whitespace: true,
    })));
    assert_eq!(h.r.legs(), 2);
    // One poll: leg 0 sends its whole answer, leg 1 its whole answer.
    h.at(150);
    h.chunk(0, role());
    h.chunk(0, text("Hello"));
    h.chunk(0, finish());
    h.chunk(1, role());
    h.chunk(1, text("Bye"));
    h.on(Event::Ended {
        leg: 0,
        end: LegEnd::Ok,
    });
    h.on(Event::Ended {
        leg: 1,
        end: LegEnd::Ok,
    });
    assert_eq!(h.r.result(), Some(&RoundResult::Won { leg: 0 }));
    assert_eq!(forwarded(&h.log), "Hello");
    assert_eq!(h.r.fate(0), Some(&Fate::Won));
    assert_eq!(h.r.fate(1), Some(&Fate::Succeeded));
}

/// Legs that completed together: the winner keeps `Won` whatever comes after (the
/// deadline or the caller's drop while it is finalized), and the other completed
/// leg keeps its success.
#[test]
fn deadline_after_the_decision_changes_no_fate() {
    let mut s = spec(false, policy(Some(100), None, 1));
    s.deadline = Some(t0() + ms(10_000));
    let mut h = Hand::new(s);
    h.at(100).on(Event::Tick);
    h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: false,
        prefill_trailing_whitespace: true,
    })));
    h.at(500);
    h.on(Event::Ended {
        leg: 1,
        end: LegEnd::Ok,
    });
    h.on(Event::Ended {
        leg: 0,
        end: LegEnd::Ok,
    });
    let out = h.on(Event::Deadline);
    assert!(out.is_empty());
    let out = h.on(Event::CallerDrop);
    assert!(out.is_empty());
    assert_eq!(h.r.result(), Some(&RoundResult::Won { leg: 1 }));
    assert_eq!(h.r.fate(1), Some(&Fate::Won));
    assert_eq!(h.r.fate(0), Some(&Fate::Succeeded));
}

/// STALL_AFTER_S < AFTER_S: the stall trigger fires at its own time, not when the
/// first-token timer is due.
#[test]
fn the_stall_trigger_fires_at_its_own_time() {
    let mut h = Hand::new(spec(false, policy(Some(5000), Some(1000), 2)));
    h.at(200).chunk(0, text("a"));
    assert_eq!(h.r.next_wakeup(), Some(h.r.legs[0].launched_at + ms(1200)));
    let out = h.at(1199).on(Event::Tick);
    assert_eq!(picks(&out), 0);
    let out = h.at(1200).on(Event::Tick);
    assert_eq!(picks(&out), 1, "{out:?}");
}

/// The first-token trigger fires at its threshold; when its pick launches nothing (no
/// budget, no source) it fires again every [`REARM_DIVISOR`]-th of the threshold while
/// the leg has no chunk; never after the leg's first chunk, not again once a leg
/// launched, and not again after a failed governance backend.
#[test]
fn first_token_trigger_fires_at_its_threshold_and_again_when_refused() {
    let th = 800;
    let again = th / u64::from(REARM_DIVISOR);
    let mut h = Hand::new(spec(false, policy(Some(th), None, 1)));
    let start = h.r.legs[0].launched_at;
    assert_eq!(h.r.next_wakeup(), Some(start + ms(th)));
    assert_eq!(picks(&h.at(50).on(Event::Tick)), 0);
    assert_eq!(picks(&h.at(th).on(Event::Tick)), 1);
    assert_eq!(h.r.next_wakeup(), None, "one pick at a time");
    h.at(th + 3).on(Event::Picked(None));
    assert_eq!(
        h.r.next_wakeup(),
        Some(start + ms(th + 3 + again)),
        "refused: due again a fraction of the threshold after the refusal"
    );
    assert_eq!(picks(&h.at(th + 2 + again).on(Event::Tick)), 0);
    assert_eq!(picks(&h.at(th + 3 + again).on(Event::Tick)), 1);
    h.at(th + 4 + again).on(Event::Picked(None));
    assert_eq!(picks(&h.at(th + 4 + 2 * again).on(Event::Tick)), 1);
    h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: false,
        prefill_trailing_whitespace: true,
    })));
    assert_eq!(h.r.legs(), 2);
    assert_eq!(h.r.next_wakeup(), None, "MAX_EXTRA reached");
    // A failed governance backend is not asked again by the same silence.
    let mut h = Hand::new(spec(false, policy(Some(th), None, 1)));
    assert_eq!(picks(&h.at(th).on(Event::Tick)), 1);
    h.on(Event::PickFailed);
    assert_eq!(h.r.next_wakeup(), None);
    assert_eq!(picks(&h.at(10 * th).on(Event::Tick)), 0);
    // A chunk ends the wait: a refused trigger is not due again.
    let mut h = Hand::new(spec(false, policy(Some(th), None, 2)));
    assert_eq!(picks(&h.at(th).on(Event::Tick)), 1);
    h.on(Event::Picked(None));
    h.at(th + 10).chunk(0, text("x"));
    assert_eq!(h.r.next_wakeup(), None);
    assert_eq!(picks(&h.at(10 * th).on(Event::Tick)), 0);
    let mut h = Hand::new(spec(false, policy(Some(th), None, 1)));
    h.at(20).chunk(0, text("x"));
    assert_eq!(h.r.next_wakeup(), None);
    assert_eq!(picks(&h.at(10 * th).on(Event::Tick)), 0);
}

/// The stall trigger arms on the first chunk and fires once per silence when its leg
/// launches; refused, it fires again every [`REARM_DIVISOR`]-th of the threshold while
/// the silence lasts; the next chunk re-arms it at the full threshold.
#[test]
fn stall_trigger_rearms_on_each_chunk_and_after_a_refusal() {
    let th = 800;
    let again = th / u64::from(REARM_DIVISOR);
    let mut h = Hand::new(spec(false, policy(None, Some(th), 3)));
    assert_eq!(h.r.next_wakeup(), None, "no chunk yet: no stall");
    h.at(1000).chunk(0, text("a"));
    assert_eq!(picks(&h.at(1000 + th - 1).on(Event::Tick)), 0);
    assert_eq!(picks(&h.at(1000 + th).on(Event::Tick)), 1);
    h.on(Event::Picked(None));
    assert_eq!(picks(&h.at(1000 + th + again - 1).on(Event::Tick)), 0);
    assert_eq!(
        picks(&h.at(1000 + th + again).on(Event::Tick)),
        1,
        "refused: asks again a fraction of the threshold later"
    );
    h.on(Event::Picked(None));
    let b = 1000 + th + again + 1;
    h.at(b).chunk(0, text("b"));
    assert_eq!(
        picks(&h.at(b + again).on(Event::Tick)),
        0,
        "the chunk ended that silence"
    );
    assert_eq!(picks(&h.at(b + th).on(Event::Tick)), 1);
    h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: false,
        prefill_trailing_whitespace: true,
    })));
    assert_eq!(h.r.legs(), 2);
    assert!(
        h.r.next_wakeup()
            .is_none_or(|w| w > h.r.legs[0].launched_at + ms(b + 2 * th)),
        "a silence that got its leg does not fire again"
    );
}

/// A ladder of extra legs: each needs its own trigger; MAX_EXTRA stops it.
#[test]
fn ladder_of_extra_legs_stops_at_max() {
    let mut h = Hand::new(spec(false, policy(Some(100), None, 2)));
    h.at(100).on(Event::Tick);
    h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: false,
        prefill_trailing_whitespace: true,
    })));
    // The new leg's own first-token timer is the next trigger.
    assert_eq!(h.r.next_wakeup(), Some(h.r.legs[0].launched_at + ms(200)));
    h.at(200).on(Event::Tick);
    h.on(Event::Picked(Some(Picked {
        source: 2,
        prefill_capable: false,
        prefill_trailing_whitespace: true,
    })));
    assert_eq!(h.r.legs(), 3);
    assert_eq!(h.r.next_wakeup(), None);
    assert_eq!(picks(&h.at(10_000).on(Event::Tick)), 0);
}

/// A first-token trigger due while a stall trigger is pending elsewhere fires at its
/// own time too.
#[test]
fn both_triggers_keep_their_times() {
    let mut h = Hand::new(spec(false, policy(Some(300), Some(1000), 3)));
    h.at(300).on(Event::Tick);
    h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: false,
        prefill_trailing_whitespace: true,
    })));
    h.at(350).chunk(1, text("x")); // leg 1 streams; stall due at 1350
                                   // Leg 1's first-token trigger would be due at 600 but it has a chunk; leg 0's
                                   // first-token trigger fired already. The next one is leg 1's stall at 1350.
    assert_eq!(h.r.next_wakeup(), Some(h.r.legs[0].launched_at + ms(1350)));
}

/// A committed leg that fails in its commit poll: the other legs lost to the commit
/// (hedge_cancelled), not to a caller's drop.
#[test]
fn a_committed_leg_failing_in_its_commit_poll_labels_losers_hedge_cancelled() {
    let mut h = Hand::new(spec(true, policy(Some(100), None, 1)));
    h.at(100).on(Event::Tick);
    h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: false,
        prefill_trailing_whitespace: true,
    })));
    h.at(200);
    h.chunk(0, text("He"));
    h.on(Event::Ended {
        leg: 0,
        end: LegEnd::Err(err(ErrorClass::Transient)),
    });
    assert_eq!(
        h.r.fate(1),
        Some(&Fate::Cancelled(CancelReason::HedgeLoser))
    );
    match h.r.result() {
        Some(RoundResult::Failed {
            resume: Some(p), ..
        }) => {
            assert_eq!(p.delivered.content, "He");
            assert!(p.resumable && p.delivered_to_caller);
            assert_eq!(p.of, Some(0));
        }
        other => panic!("{other:?}"),
    }
}

/// A stall after the commit launches a prefill resume on another source; its first
/// chunk wins the race, the stalled leg is cancelled, and the text continues exactly.
#[test]
fn a_stalled_committed_leg_is_resumed_by_prefill() {
    let mut h = Hand::new(spec(true, policy(None, Some(1000), 1)));
    h.at(10);
    h.chunk(0, role());
    h.chunk(0, text("Hello, "));
    let out = h.at(1010).on(Event::Tick);
    let Some(Action::Pick(req)) = out.first() else {
        panic!("{out:?}")
    };
    assert!(req.exclude.contains(&0) && req.prefer_prefill && req.hedge_budget);
    let out = h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: true,
        prefill_trailing_whitespace: true,
    })));
    assert_eq!(
        out,
        vec![Action::Launch {
            leg: 1,
            source: 1,
            kind: LegKind::Resume {
                mode: ResumeMode::Prefill,
                prefix: "Hello, ".into(),
                of: Some(0)
            }
        }]
    );
    h.at(1100);
    h.chunk(1, role());
    h.chunk(1, text("world"));
    h.chunk(1, finish());
    h.on(Event::Ended {
        leg: 1,
        end: LegEnd::Ok,
    });
    assert_eq!(forwarded(&h.log), "Hello, world");
    assert_eq!(h.r.result(), Some(&RoundResult::Won { leg: 1 }));
    assert_eq!(
        h.r.fate(0),
        Some(&Fate::Cancelled(CancelReason::HedgeLoser))
    );
    // The role chunk reached the caller once.
    let roles = h
        .log
        .iter()
        .filter(|a| matches!(a, Action::Forward { delta, .. } if delta.role.is_some()))
        .count();
    assert_eq!(roles, 1);
}

/// The committed leg answering again before the resume leg's first chunk wins the
/// race: the resume leg is cancelled.
#[test]
fn the_committed_leg_can_win_the_race_back() {
    let mut h = Hand::new(spec(true, policy(None, Some(1000), 1)));
    h.at(10).chunk(0, text("Hello, "));
    h.at(1010).on(Event::Tick);
    h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: true,
        prefill_trailing_whitespace: true,
    })));
    h.at(1020).chunk(0, text("wor"));
    assert_eq!(
        h.r.fate(1),
        Some(&Fate::Cancelled(CancelReason::HedgeLoser))
    );
    assert_eq!(forwarded(&h.log), "Hello, wor");
}

/// A replay is held back until it has reproduced the delivered text, then only the
/// remainder is forwarded; a replay that contradicts it is cancelled as diverged.
#[test]
fn replay_is_verified_then_forwards_only_the_remainder() {
    let mut s = spec(true, policy(None, None, 1));
    s.carried = Some(Carried {
        delivered: {
            let mut t = Transcript::default();
            t.absorb(&text("Hello, wo"));
            t
        },
        role_sent: true,
        original: err(ErrorClass::Transient),
    });
    s.primary_kind = LegKind::Resume {
        mode: ResumeMode::Replay,
        prefix: "Hello, wo".into(),
        of: None,
    };
    let mut h = Hand::new(s.clone());
    h.at(10);
    h.chunk(0, role());
    h.chunk(0, text("Hel"));
    h.chunk(0, text("lo, w"));
    assert_eq!(forwarded(&h.log), "");
    h.chunk(0, text("orld"));
    assert_eq!(forwarded(&h.log), "rld");
    h.chunk(0, finish());
    h.on(Event::Ended {
        leg: 0,
        end: LegEnd::Ok,
    });
    assert_eq!(h.r.result(), Some(&RoundResult::Won { leg: 0 }));
    assert_eq!(h.r.delivered().content, "Hello, world");
    assert!(!h
        .log
        .iter()
        .any(|a| matches!(a, Action::Forward { delta, .. } if delta.role.is_some())));

    let mut h = Hand::new(s);
    h.at(10);
    h.chunk(0, text("Hello! "));
    assert_eq!(h.r.fate(0), Some(&Fate::Cancelled(CancelReason::Diverged)));
    match h.r.result() {
        Some(RoundResult::Failed {
            error,
            resume: Some(p),
            ..
        }) => {
            assert_eq!(error.label, ErrorLabel::ResumeDiverged);
            assert_eq!(p.original.label, ErrorLabel::Truncated);
            assert_eq!(p.of, None);
        }
        other => panic!("{other:?}"),
    }
}

/// A prefill the target refuses: the source is marked, and retried in replay mode.
#[test]
fn a_prefill_rejection_is_retried_in_replay() {
    let mut s = spec(true, policy(None, None, 1));
    s.carried = Some(Carried {
        delivered: {
            let mut t = Transcript::default();
            t.absorb(&text("Hi"));
            t
        },
        role_sent: true,
        original: err(ErrorClass::Transient),
    });
    s.primary_source = 2;
    s.primary_kind = LegKind::Resume {
        mode: ResumeMode::Prefill,
        prefix: "Hi".into(),
        of: None,
    };
    let mut h = Hand::new(s);
    let rejection = AttemptError::new(ErrorClass::Rejected, ErrorLabel::Rejected, "HTTP 400")
        .with_provider(
            None,
            Some("This model does not support assistant message prefill".into()),
        );
    let out = h.on(Event::Ended {
        leg: 0,
        end: LegEnd::Err(rejection),
    });
    assert!(out.contains(&Action::MarkNoPrefill { source: 2 }));
    let Some(Action::Pick(req)) = out.iter().find(|a| matches!(a, Action::Pick(_))) else {
        panic!("{out:?}")
    };
    assert_eq!(req.only, Some(2));
    assert!(!req.hedge_budget);
    let out = h.on(Event::Picked(Some(Picked {
        source: 2,
        prefill_capable: false,
        prefill_trailing_whitespace: true,
    })));
    assert!(matches!(
        out.as_slice(),
        [Action::Launch {
            leg: 1,
            source: 2,
            kind: LegKind::Resume {
                mode: ResumeMode::Replay,
                ..
            }
        }]
    ));
    // If the replay fails too, the round's error is not a rejection and the
    // original failure is what the caller gets.
    h.on(Event::Ended {
        leg: 1,
        end: LegEnd::Err(err(ErrorClass::Transient)),
    });
    match h.r.result() {
        Some(RoundResult::Failed {
            error,
            resume: Some(p),
            ..
        }) => {
            assert_ne!(error.class, ErrorClass::Rejected);
            assert_eq!(p.original.label, ErrorLabel::Truncated);
        }
        other => panic!("{other:?}"),
    }
}

/// A committed leg that had started a tool call is resumed by replay only.
#[test]
fn tool_call_streams_resume_by_replay_only() {
    let mut h = Hand::new(spec(true, policy(None, Some(1000), 1)));
    h.at(10).chunk(
        0,
        StreamDelta {
            tool_calls: vec![crate::ports::ToolCallDelta {
                index: 0,
                id: Some("c".into()),
                name: Some("f".into()),
                arguments: "{".into(),
            }],
            ..Default::default()
        },
    );
    h.at(1010).on(Event::Tick);
    let out = h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: true,
        prefill_trailing_whitespace: true,
    })));
    assert!(matches!(
        out.as_slice(),
        [Action::Launch {
            kind: LegKind::Resume {
                mode: ResumeMode::Replay,
                ..
            },
            ..
        }]
    ));
}

/// Aggregated: a stall on a leg with content launches a prefill continuation of that
/// leg when a prefill-capable source admits, a fresh restart otherwise.
#[test]
fn aggregated_stall_continues_by_prefill_or_restarts() {
    let mut h = Hand::new(spec(false, policy(None, Some(1000), 2)));
    h.at(10).chunk(0, text("Hello"));
    h.at(1010).on(Event::Tick);
    let out = h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: true,
        prefill_trailing_whitespace: true,
    })));
    assert!(matches!(
        &out[..],
        [Action::Launch { kind: LegKind::Resume { mode: ResumeMode::Prefill, prefix, of: Some(0) }, .. }] if prefix == "Hello"
    ));
    h.at(2010).on(Event::Tick); // leg 0's stall again? no: it fired at this chunk count
    h.at(2020).chunk(1, text(" world"));
    h.at(3020).on(Event::Tick); // leg 1 stalls
    let out = h.on(Event::Picked(Some(Picked {
        source: 2,
        prefill_capable: false,
        prefill_trailing_whitespace: true,
    })));
    assert!(matches!(
        &out[..],
        [Action::Launch {
            kind: LegKind::Fresh,
            ..
        }]
    ));
}

/// Aggregated: a resume leg that is slow to its first token is backed up by another
/// continuation of the same text (what the stalled leg had), not by a restart.
#[test]
fn aggregated_late_resume_is_backed_up_by_a_continuation() {
    let mut h = Hand::new(spec(false, policy(Some(5000), Some(1000), 2)));
    h.at(10).chunk(0, text("Hello"));
    h.at(1010).on(Event::Tick); // leg 0 stalls: resume
    let out = h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: true,
        prefill_trailing_whitespace: true,
    })));
    assert!(matches!(
        &out[..],
        [Action::Launch {
            kind: LegKind::Resume {
                mode: ResumeMode::Prefill,
                of: Some(0),
                ..
            },
            ..
        }]
    ));
    // Leg 1 (launched at 1010) sends nothing for AFTER_S: its first-token trigger.
    h.at(6009).on(Event::Tick);
    assert_eq!(picks(&h.log), 1, "not yet due");
    h.at(6010).on(Event::Tick);
    assert_eq!(picks(&h.log), 2);
    let out = h.on(Event::Picked(Some(Picked {
        source: 2,
        prefill_capable: true,
        prefill_trailing_whitespace: true,
    })));
    assert!(
        matches!(
            &out[..],
            [Action::Launch { kind: LegKind::Resume { mode: ResumeMode::Prefill, prefix, of: Some(0) }, .. }] if prefix == "Hello"
        ),
        "{out:?}"
    );
    // A fresh primary late to its first token still gets a fresh hedge.
    let mut h = Hand::new(spec(false, policy(Some(5000), Some(1000), 2)));
    h.at(5000).on(Event::Tick);
    let out = h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: true,
        prefill_trailing_whitespace: true,
    })));
    assert!(
        matches!(
            &out[..],
            [Action::Launch {
                kind: LegKind::Fresh,
                ..
            }]
        ),
        "{out:?}"
    );
}

/// The hedge budget and MAX_EXTRA bound the legs; a pick that answers after the
/// round moved on is released.
#[test]
fn a_moot_pick_is_released() {
    let mut h = Hand::new(spec(true, policy(Some(100), None, 1)));
    h.at(100).on(Event::Tick);
    h.at(110).chunk(0, text("x")); // commits before the hedge pick answers
    let out = h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: false,
        prefill_trailing_whitespace: true,
    })));
    assert_eq!(out, vec![Action::ReleasePick]);
    assert_eq!(h.r.legs(), 1);
}

/// The deadline cancels running legs as `deadline`, the caller's drop as `cancelled`.
#[test]
fn deadline_and_drop_labels() {
    for (ev, reason, result) in [
        (
            Event::Deadline,
            CancelReason::Deadline,
            RoundResult::Deadline,
        ),
        (
            Event::CallerDrop,
            CancelReason::CallerDrop,
            RoundResult::Dropped,
        ),
    ] {
        let mut h = Hand::new(spec(true, policy(Some(100), None, 1)));
        h.at(100).on(Event::Tick);
        h.on(Event::Picked(Some(Picked {
            source: 1,
            prefill_capable: false,
            prefill_trailing_whitespace: true,
        })));
        h.on(ev);
        assert_eq!(h.r.fate(0), Some(&Fate::Cancelled(reason)));
        assert_eq!(h.r.fate(1), Some(&Fate::Cancelled(reason)));
        assert_eq!(h.r.result(), Some(&result));
    }
}

fn carried(prefix: &str) -> Carried {
    let mut t = Transcript::default();
    t.absorb(&text(prefix));
    Carried {
        delivered: t,
        role_sent: true,
        original: err(ErrorClass::Transient),
    }
}

fn reasoning(s: &str) -> StreamDelta {
    StreamDelta {
        reasoning: Some(s.into()),
        ..Default::default()
    }
}

/// SPEC §17.1 (issue 22, item 1): a target that treats the assistant prefill as history
/// answers from scratch; the round takes it as a replay — only what follows the
/// delivered text is forwarded, never "Mock response Mock response" — and learns that
/// the source ignores prefill.
#[test]
fn a_prefill_the_target_ignores_is_verified_as_a_replay() {
    let mut s = spec(true, policy(None, None, 1));
    s.carried = Some(carried("Mock response "));
    s.primary_source = 1;
    s.primary_kind = LegKind::Resume {
        mode: ResumeMode::Prefill,
        prefix: "Mock response ".into(),
        of: None,
    };
    let mut h = Hand::new(s);
    h.at(10);
    h.chunk(0, role());
    let out = h.chunk(0, text("Mock "));
    assert!(out.is_empty(), "held while undecided: {out:?}");
    let out = h.chunk(0, text("response from"));
    assert!(
        out.contains(&Action::MarkNoPrefill { source: 1 }),
        "{out:?}"
    );
    h.chunk(0, text(" the mock."));
    h.chunk(0, finish());
    h.on(Event::Ended {
        leg: 0,
        end: LegEnd::Ok,
    });
    assert_eq!(forwarded(&h.log), "from the mock.");
    assert_eq!(h.r.delivered().content, "Mock response from the mock.");
    assert_eq!(h.r.result(), Some(&RoundResult::Won { leg: 0 }));
    // A real continuation of the same prefix is forwarded as it is.
    let mut s = spec(true, policy(None, None, 1));
    s.carried = Some(carried("Mock response "));
    s.primary_kind = LegKind::Resume {
        mode: ResumeMode::Prefill,
        prefix: "Mock response ".into(),
        of: None,
    };
    let mut h = Hand::new(s);
    h.at(10).chunk(0, text("from the mock."));
    assert_eq!(forwarded(&h.log), "from the mock.");
    assert!(!h
        .log
        .iter()
        .any(|a| matches!(a, Action::MarkNoPrefill { .. })));
}

/// A prefill leg that repeats 16 characters of the prefix and then differs ends
/// `resume_diverged` (nothing of it forwarded), and the source is learned.
#[test]
fn a_prefill_that_echoes_and_differs_ends_diverged() {
    let prefix = "The quick brown fox jumps over";
    let mut s = spec(true, policy(None, None, 1));
    s.carried = Some(carried(prefix));
    s.primary_kind = LegKind::Resume {
        mode: ResumeMode::Prefill,
        prefix: prefix.into(),
        of: None,
    };
    let mut h = Hand::new(s);
    h.at(10).chunk(0, text("The quick brown f"));
    let out = h.chunk(0, text("ish swims"));
    assert!(out.contains(&Action::MarkNoPrefill { source: 0 }));
    assert_eq!(h.r.fate(0), Some(&Fate::Cancelled(CancelReason::Diverged)));
    assert_eq!(forwarded(&h.log), "");
    match h.r.result() {
        Some(RoundResult::Failed {
            error,
            resume: Some(p),
            ..
        }) => {
            assert_eq!(error.label, ErrorLabel::ResumeDiverged);
            assert!(
                error.detail.contains("repeated the first 17"),
                "{}",
                error.detail
            );
            assert_eq!(p.delivered.content, prefix);
        }
        other => panic!("{other:?}"),
    }
}

/// Aggregated: a prefill continuation's answer is the continued text (with its
/// reasoning) followed by the continuation (item 7); a target that replayed from
/// scratch gives its own answer, not the prefix twice.
#[test]
fn aggregated_prefill_answers_keep_the_reasoning_and_never_duplicate() {
    let mut h = Hand::new(spec(false, policy(None, Some(1000), 2)));
    h.at(10).chunk(0, reasoning("think "));
    h.chunk(0, text("Hello"));
    h.at(1010).on(Event::Tick);
    h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: true,
        prefill_trailing_whitespace: true,
    })));
    h.at(1020).chunk(1, reasoning("more "));
    h.chunk(1, text(" world"));
    h.on(Event::Ended {
        leg: 1,
        end: LegEnd::Ok,
    });
    assert_eq!(h.r.result(), Some(&RoundResult::Won { leg: 1 }));
    let a = h.r.answer(1);
    assert_eq!(a.content, "Hello world");
    assert_eq!(a.reasoning, "think more ");
    assert_eq!(
        h.r.answer_chain(1),
        (vec![0], false),
        "leg 0's usage counts"
    );

    let mut h = Hand::new(spec(false, policy(None, Some(1000), 2)));
    h.at(10).chunk(0, text("Hello"));
    h.at(1010).on(Event::Tick);
    h.on(Event::Picked(Some(Picked {
        source: 1,
        prefill_capable: true,
        prefill_trailing_whitespace: true,
    })));
    let out = h.at(1020).chunk(1, text("Hello world"));
    assert!(out.contains(&Action::MarkNoPrefill { source: 1 }));
    h.on(Event::Ended {
        leg: 1,
        end: LegEnd::Ok,
    });
    assert_eq!(h.r.answer(1).content, "Hello world");
    assert_eq!(
        h.r.answer_chain(1),
        (vec![], false),
        "a replay stands alone"
    );
}

/// Item 7: an uncommitted leg's chunks are never dropped: far more than 16
/// non-content chunks are all forwarded at its commit, and a leg over the byte bound
/// fails as `invalid` instead of losing chunks.
#[test]
fn held_chunks_are_never_dropped_silently() {
    let mut h = Hand::new(spec(true, policy(None, None, 1)));
    h.at(10).chunk(0, role());
    for _ in 0..40 {
        let mut raw = serde_json::Map::new();
        raw.insert("citations".into(), serde_json::json!(["https://x"]));
        h.chunk(
            0,
            StreamDelta {
                raw: Some(raw),
                ..Default::default()
            },
        );
    }
    h.chunk(0, text("hi"));
    let forwards = h
        .log
        .iter()
        .filter(|a| matches!(a, Action::Forward { .. }))
        .count();
    assert_eq!(forwards, 42, "the role, 40 held chunks and the text");

    let mut h = Hand::new(spec(true, policy(None, None, 1)));
    let big = StreamDelta {
        raw_text: Some(Box::new(crate::ports::RawText {
            json: "x".repeat(1 << 20),
            ..Default::default()
        })),
        ..Default::default()
    };
    for _ in 0..8 {
        h.at(10).chunk(0, big.clone());
    }
    assert_eq!(h.r.fate(0), Some(&Fate::Cancelled(CancelReason::Overflow)));
    match h.r.result() {
        Some(RoundResult::Failed { error, .. }) => {
            assert_eq!(error.label, ErrorLabel::Invalid);
            assert!(error.detail.contains("bytes of chunks"), "{}", error.detail);
        }
        other => panic!("{other:?}"),
    }
}

/// Item 6: a governance error on a hedge or resume pick launches nothing and cuts
/// nothing: the running leg goes on and wins.
#[test]
fn a_failed_pick_never_cuts_the_running_legs() {
    let mut h = Hand::new(spec(true, policy(None, Some(1000), 1)));
    h.at(10).chunk(0, text("Hel"));
    let out = h.at(1010).on(Event::Tick);
    assert_eq!(picks(&out), 1);
    let out = h.on(Event::PickFailed);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(h.r.result(), None);
    h.at(2000).chunk(0, text("lo"));
    h.on(Event::Ended {
        leg: 0,
        end: LegEnd::Ok,
    });
    assert_eq!(h.r.result(), Some(&RoundResult::Won { leg: 0 }));
    assert_eq!(forwarded(&h.log), "Hello");
    assert_eq!(h.r.first_chunk(0), Some(h.r.legs[0].launched_at + ms(10)));
    assert!(h.r.delivered_text(0));
}

// ----- property test ----------------------------------------------------------------

#[derive(Debug)]
struct SimLeg {
    kind: LegKind,
    pieces: Vec<String>,
    next: usize,
    /// Fails after this many pieces.
    fail_at: Option<(usize, AttemptError)>,
    role_sent: bool,
    finish_sent: bool,
    /// The machine has not stopped it and it has not ended.
    alive: bool,
    output: String,
}

impl SimLeg {
    fn ready_to_end(&self) -> bool {
        match &self.fail_at {
            Some((k, _)) => self.next >= *k,
            None => self.next >= self.pieces.len(),
        }
    }
}

struct Sim {
    rng: SplitMix64,
    r: Round,
    now: Instant,
    legs: Vec<SimLeg>,
    sources: usize,
    forwarded: String,
    pending: Option<PickRequest>,
    bound: usize,
    carried_text: String,
    /// Per leg: cancels and finalizes seen.
    cancels: Vec<u32>,
    finals: Vec<u32>,
    in_hand: Vec<LegId>,
    /// The legs without a fate when the deadline or the caller's drop arrived.
    undecided_at_end: Vec<LegId>,
    /// Sources the machine learned do not honour prefill.
    marked: std::collections::BTreeSet<usize>,
    /// The leg whose end is being fed.
    ending: Option<LegId>,
    /// The last source admitted, and whether it takes a prefill ending in whitespace.
    picked: Option<Picked>,
}

fn split(rng: &SplitMix64, s: &str) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut at = 0;
    while at < chars.len() {
        let n = 1 + rng.below(6) as usize;
        let end = (at + n).min(chars.len());
        out.push(chars[at..end].iter().collect());
        at = end;
    }
    out
}

/// The answer a prefix belongs to (a diverged replay that covered the delivered text
/// before it diverged makes a delivered text of neither: its continuation is free text).
fn world_of(prefix: &str) -> Option<&'static str> {
    [ANSWER, ALT].into_iter().find(|w| w.starts_with(prefix))
}

impl Sim {
    fn plan(&mut self, kind: &LegKind) -> SimLeg {
        let rng = &self.rng;
        let full: String = match kind {
            LegKind::Fresh => {
                if rng.below(5) == 0 {
                    ALT.into()
                } else {
                    ANSWER.into()
                }
            }
            LegKind::Resume {
                mode: ResumeMode::Prefill,
                prefix,
                ..
            } => {
                let chars = prefix.chars().count();
                match (world_of(prefix), rng.below(8)) {
                    // A target that ignores the prefill: the whole answer from scratch.
                    (Some(w), 0 | 1) => w.to_string(),
                    // One that repeats the prefix's start, then goes its own way.
                    (_, 2) if chars > crate::resume::PREFILL_ECHO_CHARS => {
                        let k = crate::resume::PREFILL_ECHO_CHARS
                            + rng.below((chars - crate::resume::PREFILL_ECHO_CHARS) as u64)
                                as usize;
                        let head: String = prefix.chars().take(k).collect();
                        format!("{head}#echo#")
                    }
                    (Some(w), _) => w[prefix.len()..].to_string(),
                    (None, _) => " and so on.".to_string(),
                }
            }
            LegKind::Resume {
                mode: ResumeMode::Replay,
                prefix,
                ..
            } => {
                let w = world_of(prefix).unwrap_or(ANSWER);
                if rng.below(4) == 0 {
                    // A replay that diverges somewhere.
                    let cut = rng.below(w.chars().count() as u64) as usize;
                    let head: String = w.chars().take(cut).collect();
                    format!("{head}#divergent#")
                } else {
                    w.to_string()
                }
            }
        };
        let pieces = split(rng, &full);
        if kind.resume_mode() == Some(ResumeMode::Prefill) && rng.below(6) == 0 {
            // A target that refuses the prefill at once (SPEC §13.2).
            let refusal = AttemptError::new(ErrorClass::Rejected, ErrorLabel::Rejected, "HTTP 400")
                .with_provider(
                    None,
                    Some("This model does not support assistant message prefill".into()),
                );
            return SimLeg {
                kind: kind.clone(),
                pieces,
                next: 0,
                fail_at: Some((0, refusal)),
                role_sent: false,
                finish_sent: false,
                alive: true,
                output: String::new(),
            };
        }
        let fail_at = (rng.below(3) == 0).then(|| {
            let k = rng.below(pieces.len() as u64 + 1) as usize;
            let class = [
                ErrorClass::Transient,
                ErrorClass::RateLimited,
                ErrorClass::Rejected,
                ErrorClass::Invalid,
                ErrorClass::Transient,
            ][rng.below(5) as usize];
            (k, err(class))
        });
        SimLeg {
            kind: kind.clone(),
            pieces,
            next: 0,
            fail_at,
            role_sent: false,
            finish_sent: false,
            alive: true,
            output: String::new(),
        }
    }

    fn apply(&mut self, ev: Event) -> Vec<Action> {
        let is_deadline = ev == Event::Deadline;
        let is_drop = ev == Event::CallerDrop;
        let was_tick_at_wakeup = ev == Event::Tick
            && self.r.next_wakeup() == Some(self.now)
            && self.r.spec.deadline != Some(self.now);
        // Any event may be the one that ends the round by the deadline (one fed at or
        // after it), so the snapshot is taken before each event while the round runs.
        if self.r.result().is_none() {
            self.undecided_at_end = (0..self.legs.len())
                .filter(|l| self.r.fate(*l).is_none())
                .collect();
        }
        let mut out = Vec::new();
        self.r.on(ev, self.now, &mut out);
        for a in &out {
            match a {
                Action::Launch { leg, source, kind } => {
                    assert_eq!(*leg, self.legs.len());
                    if *leg > 0 {
                        let req = self.pending.take().expect("a launch answers a pick");
                        assert!(!req.exclude.contains(source));
                        if let Some(o) = req.only {
                            assert_eq!(o, *source);
                        }
                    }
                    if let LegKind::Resume {
                        mode: ResumeMode::Prefill,
                        prefix,
                        ..
                    } = kind
                    {
                        if let Some(p) = self.picked.filter(|p| *leg > 0 && p.source == *source) {
                            assert!(
                                p.prefill_capable
                                    && (p.prefill_trailing_whitespace
                                        || !prefix.ends_with(char::is_whitespace)),
                                "a prefill goes only to a source that takes it: {prefix:?} to {p:?}"
                            );
                        }
                        if self.r.spec.passthrough {
                            let delivered = format!("{}{}", self.carried_text, self.forwarded);
                            assert_eq!(
                                prefix, &delivered,
                                "a prefill continues the delivered text"
                            );
                        }
                    }
                    let plan = self.plan(kind);
                    self.legs.push(plan);
                    self.cancels.push(0);
                    self.finals.push(0);
                }
                Action::Pick(req) => {
                    assert!(self.pending.is_none(), "one admission at a time");
                    self.pending = Some(req.clone());
                }
                Action::ReleasePick => {
                    self.pending = None;
                }
                Action::Forward { delta, .. } => {
                    if let Some(c) = &delta.content {
                        self.forwarded.push_str(c);
                    }
                }
                Action::Cancel { leg, reason } => {
                    self.cancels[*leg] += 1;
                    if is_deadline {
                        assert_eq!(*reason, CancelReason::Deadline);
                    }
                    if is_drop {
                        assert_eq!(*reason, CancelReason::CallerDrop);
                    }
                    if self.ending == Some(*leg) {
                        continue;
                    }
                    let l = &mut self.legs[*leg];
                    assert!(l.alive, "cancel of a leg that ended");
                    l.alive = false;
                    // Sometimes the engine already had its end in hand.
                    if l.ready_to_end() && self.rng.below(3) == 0 {
                        self.in_hand.push(*leg);
                    }
                }
                Action::Finalize { leg, .. } => {
                    self.finals[*leg] += 1;
                    assert!(self.finals[*leg] <= 1, "leg {leg} finalized twice");
                }
                Action::MarkNoPrefill { source } => {
                    self.marked.insert(*source);
                }
                Action::Commit { .. } | Action::Done => {}
            }
        }
        if was_tick_at_wakeup && self.r.result().is_none() {
            assert!(
                out.iter().any(|a| matches!(a, Action::Pick(_))),
                "a wake-up for a trigger fires it: {out:?}"
            );
        }
        self.check(&out);
        out
    }

    fn check(&mut self, _out: &[Action]) {
        let r = &self.r;
        assert!(
            r.legs() <= self.bound,
            "{} legs > bound {}",
            r.legs(),
            self.bound
        );
        let extras = (0..r.legs()).filter(|l| r.is_extra(*l)).count();
        assert!(
            extras <= r.spec.policy.max_extra as usize,
            "{extras} extra legs > MAX_EXTRA {}",
            r.spec.policy.max_extra
        );
        let resume_legs = (1..r.legs())
            .filter(|l| r.kind(*l).resume_mode().is_some() || !r.is_extra(*l))
            .count();
        assert!(
            resume_legs <= r.spec.resumes_left as usize,
            "{resume_legs} resume legs > resumes_left {}",
            r.spec.resumes_left
        );
        assert_eq!(r.resumes() as usize, resume_legs, "resumes() counts them");
        if r.spec.passthrough {
            assert_eq!(
                format!("{}{}", self.carried_text, self.forwarded),
                r.delivered().content,
                "forwarded text is the delivered text"
            );
        }
        if r.result().is_none() {
            if let Some(t) = r.next_wakeup() {
                assert!(t > self.now, "a due timer was left behind");
            }
        }
        if let Some(RoundResult::Won { leg }) = r.result() {
            let l = &self.legs[*leg];
            assert!(l.ready_to_end() && l.fail_at.is_none());
            assert!(
                !l.output.contains("#echo#"),
                "a prefill leg that echoed its prefix and then differed never wins: {:?}",
                l.output
            );
            let whole = match &l.kind {
                LegKind::Resume {
                    mode: ResumeMode::Prefill,
                    prefix,
                    ..
                } if l.output.starts_with(prefix.as_str()) && !prefix.is_empty() => {
                    assert!(
                        self.marked.contains(&r.source(*leg)),
                        "a target that ignored the prefill is learned"
                    );
                    l.output.clone()
                }
                LegKind::Resume {
                    mode: ResumeMode::Prefill,
                    prefix,
                    ..
                } => format!("{prefix}{}", l.output),
                _ => l.output.clone(),
            };
            if r.spec.passthrough {
                assert_eq!(r.committed(), Some(*leg));
                let delivered = format!("{}{}", self.carried_text, self.forwarded);
                assert_eq!(
                    delivered, whole,
                    "the caller has exactly the winner's answer"
                );
            } else {
                assert_eq!(
                    r.answer(*leg).content,
                    whole,
                    "the aggregated answer is the winner's whole text"
                );
                assert!(
                    world_of(&whole).is_some_and(|w| w == whole),
                    "an aggregated answer is one whole answer, not a piece: {whole:?}"
                );
            }
        }
    }

    fn feed_in_hand(&mut self) {
        while let Some(leg) = self.in_hand.pop() {
            let end = match &self.legs[leg].fail_at {
                Some((_, e)) => LegEnd::Err(e.clone()),
                None => LegEnd::Ok,
            };
            self.apply(Event::Ended { leg, end });
        }
    }

    /// One step chosen by `op`.
    fn step(&mut self, op: u8) {
        let alive: Vec<LegId> = (0..self.legs.len())
            .filter(|i| self.legs[*i].alive)
            .collect();
        match op % 8 {
            0..=2 if !alive.is_empty() => {
                let leg = alive[self.rng.below(alive.len() as u64) as usize];
                self.send(leg);
            }
            3 if !alive.is_empty() => {
                let leg = alive[self.rng.below(alive.len() as u64) as usize];
                if self.legs[leg].ready_to_end() {
                    self.end(leg);
                } else {
                    self.send(leg);
                }
            }
            4 | 5 => {
                let jump = ms(self.rng.below(2500));
                let mut to = self.now + jump;
                if let Some(w) = self.r.next_wakeup() {
                    to = to.min(w);
                }
                self.now = to;
                let ev = if self.r.spec.deadline.is_some_and(|d| self.now >= d) {
                    Event::Deadline
                } else {
                    Event::Tick
                };
                self.apply(ev);
            }
            6 if self.pending.is_some() => {
                let req = self.pending.clone().unwrap_or_else(|| unreachable!());
                let candidates: Vec<usize> = (0..self.sources)
                    .filter(|s| !req.exclude.contains(s) && req.only.is_none_or(|o| o == *s))
                    .collect();
                let picked = if candidates.is_empty() || self.rng.below(4) == 0 {
                    None
                } else {
                    Some(Picked {
                        source: candidates[self.rng.below(candidates.len() as u64) as usize],
                        prefill_capable: req.require_prefill || self.rng.below(2) == 0,
                        prefill_trailing_whitespace: self.rng.below(2) == 0,
                    })
                };
                if picked.is_none() {
                    self.pending = None;
                }
                self.picked = picked;
                self.apply(Event::Picked(picked));
            }
            7 if self.rng.below(16) == 0 => {
                self.apply(Event::CallerDrop);
            }
            7 if !alive.is_empty() => {
                // A chunk or an end that the engine feeds at or after the deadline,
                // before the deadline's own event: the machine ends the round by the
                // deadline all the same.
                if let Some(d) = self.r.spec.deadline {
                    self.now = self.now.max(d) + ms(self.rng.below(3));
                    let leg = alive[self.rng.below(alive.len() as u64) as usize];
                    if self.legs[leg].ready_to_end() && self.rng.below(2) == 0 {
                        self.end(leg);
                    } else {
                        self.send(leg);
                    }
                }
            }
            _ => {}
        }
        self.feed_in_hand();
    }

    fn send(&mut self, leg: LegId) {
        let now = self.now;
        let l = &mut self.legs[leg];
        if !l.role_sent {
            l.role_sent = true;
            self.apply(chunk(leg, now, role()));
            return;
        }
        if l.ready_to_end() {
            if l.fail_at.is_none() && !l.finish_sent {
                l.finish_sent = true;
                self.apply(chunk(leg, now, finish()));
            } else {
                self.end(leg);
            }
            return;
        }
        let piece = l.pieces[l.next].clone();
        l.next += 1;
        l.output.push_str(&piece);
        self.apply(chunk(leg, now, text(&piece)));
    }

    fn end(&mut self, leg: LegId) {
        let l = &self.legs[leg];
        let end = match &l.fail_at {
            Some((_, e)) => LegEnd::Err(e.clone()),
            None => LegEnd::Ok,
        };
        // The machine may cancel it while taking this very end (the deadline passed).
        self.ending = Some(leg);
        self.apply(Event::Ended { leg, end });
        self.ending = None;
        self.legs[leg].alive = false;
    }

    /// Runs every remaining leg to its end and answers picks with nothing.
    fn drain(&mut self) {
        for _ in 0..10_000 {
            if self.r.result().is_some() {
                break;
            }
            if self.pending.take().is_some() {
                self.apply(Event::Picked(None));
                self.feed_in_hand();
                continue;
            }
            let alive: Vec<LegId> = (0..self.legs.len())
                .filter(|i| self.legs[*i].alive)
                .collect();
            match alive.first() {
                Some(&leg) => {
                    if self.legs[leg].ready_to_end() {
                        self.end(leg);
                    } else {
                        self.send(leg);
                    }
                }
                None => panic!("no leg alive, no pick pending, and no result"),
            }
            self.feed_in_hand();
        }
        assert!(self.r.result().is_some(), "the round ends");
        for leg in 0..self.legs.len() {
            assert!(self.r.fate(leg).is_some(), "leg {leg} has no fate");
            assert!(self.cancels[leg] <= 1);
            assert!(
                self.cancels[leg] + self.finals[leg] >= 1,
                "leg {leg} got no outcome action"
            );
        }
        // Legs still undecided when the deadline or the drop ended the round never say
        // hedge_cancelled: they are cancelled for that reason, or keep the outcome the
        // engine already had in hand (an end of their own).
        match self.r.result() {
            Some(r @ (RoundResult::Deadline | RoundResult::Dropped)) => {
                let reason = if matches!(r, RoundResult::Deadline) {
                    CancelReason::Deadline
                } else {
                    CancelReason::CallerDrop
                };
                for leg in &self.undecided_at_end {
                    match self.r.fate(*leg) {
                        Some(Fate::Cancelled(c)) => assert_eq!(
                            *c,
                            reason,
                            "leg {leg}, running at the end, labelled {:?}",
                            c.label()
                        ),
                        Some(Fate::Won) => panic!("leg {leg} won a round that ended in {r:?}"),
                        Some(_) => {}
                        None => panic!("leg {leg} has no fate"),
                    }
                }
            }
            Some(RoundResult::Won { .. }) => {
                let won = (0..self.legs.len())
                    .filter(|l| self.r.fate(*l) == Some(&Fate::Won))
                    .count();
                assert_eq!(won, 1);
            }
            _ => {}
        }
    }
}

fn arb_spec() -> impl Strategy<Value = (RoundSpec, usize, String)> {
    (
        any::<bool>(),
        proptest::option::of(100u64..2000),
        proptest::option::of(100u64..2000),
        1u32..=3,
        0u8..3,
        0u32..=3,
        proptest::option::of(3000u64..20_000),
        0u8..4,
        0usize..20,
    )
        .prop_map(
            |(pass, after, stall, max_extra, resume, left, deadline, carried, cut)| {
                let resume = [
                    ResumeSetting::Auto,
                    ResumeSetting::Prefill,
                    ResumeSetting::Off,
                ][resume as usize];
                let mut s = spec(pass, policy(after, stall, max_extra));
                s.resume = resume;
                s.resumes_left = left;
                s.deadline = deadline.map(|d| t0() + ms(d));
                let mut carried_text = String::new();
                if carried == 0 && resume != ResumeSetting::Off {
                    let prefix: String = ANSWER.chars().take(cut + 1).collect();
                    let mut t = Transcript::default();
                    t.absorb(&text(&prefix));
                    s.carried = Some(Carried {
                        delivered: t,
                        role_sent: true,
                        original: err(ErrorClass::Transient),
                    });
                    let mode = if pass && resume == ResumeSetting::Auto && cut % 2 == 0 {
                        ResumeMode::Replay
                    } else {
                        ResumeMode::Prefill
                    };
                    s.primary_kind = LegKind::Resume {
                        mode,
                        prefix: prefix.clone(),
                        of: None,
                    };
                    if pass {
                        carried_text = prefix;
                    }
                }
                let bound = 1 + max_extra as usize + left as usize;
                (s, bound, carried_text)
            },
        )
}

/// Cases of the interleaving property: 2000 by default, `POLYGW_ROUND_CASES` for a
/// longer search.
fn round_cases() -> u32 {
    std::env::var("POLYGW_ROUND_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(round_cases()))]

    /// SPEC §13.6: random interleavings keep every invariant of the module doc.
    #[test]
    fn random_interleavings_keep_the_invariants(
        (s, bound, carried_text) in arb_spec(),
        seed in any::<u64>(),
        ops in proptest::collection::vec(any::<u8>(), 0..160),
    ) {
        let now = t0();
        let (r, out) = Round::new(s, now);
        let mut sim = Sim {
            rng: SplitMix64::new(seed),
            r,
            now,
            legs: Vec::new(),
            sources: 4,
            forwarded: String::new(),
            pending: None,
            bound,
            carried_text,
            cancels: Vec::new(),
            finals: Vec::new(),
            in_hand: Vec::new(),
            undecided_at_end: Vec::new(),
            marked: Default::default(),
            ending: None,
            picked: None,
        };
        for a in &out {
            if let Action::Launch { kind, .. } = a {
                let plan = sim.plan(kind);
                sim.legs.push(plan);
                sim.cancels.push(0);
                sim.finals.push(0);
            }
        }
        for op in ops {
            if sim.r.result().is_some() {
                break;
            }
            sim.step(op);
        }
        sim.drain();
    }
}
