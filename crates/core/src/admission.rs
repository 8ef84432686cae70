//! Admission decisions (SPEC §4.1), pure: the order in which candidates are tried, and
//! what to do when none is admitted. The async pick that asks the breaker store and the
//! limiter lives in the facade and follows these decisions.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::ports::limiter::Refusal;
use crate::ports::Rng;
use crate::settings::OnNoRunnable;
use crate::source::SourceConfig;

/// The order in which to try the scope's sources (indices into `sources`).
///
/// Sources in `exclude` are left out (they record no reason). Sources that have not
/// failed in this logical call come first; inside each group, priority tiers
/// ascending; inside a tier, weighted random by `WEIGHT`.
pub fn order_candidates(
    sources: &[SourceConfig],
    exclude: &BTreeSet<String>,
    failed_in_call: &BTreeSet<String>,
    rng: &dyn Rng,
) -> Vec<usize> {
    order_candidates_preferring(sources, exclude, failed_in_call, &|_| true, rng)
}

/// [`order_candidates`] with a preference (SPEC §13.3: a resume prefers
/// prefill-capable sources): inside the not-failed and the failed groups, sources for
/// which `preferred` holds come first, then priority tiers, then weighted random.
pub fn order_candidates_preferring(
    sources: &[SourceConfig],
    exclude: &BTreeSet<String>,
    failed_in_call: &BTreeSet<String>,
    preferred: &dyn Fn(usize) -> bool,
    rng: &dyn Rng,
) -> Vec<usize> {
    let mut groups: Vec<((bool, bool, u32), Vec<usize>)> = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        if exclude.contains(&s.name) {
            continue;
        }
        let key = (failed_in_call.contains(&s.name), !preferred(i), s.priority);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some(g) => g.1.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    groups.sort_by_key(|(k, _)| *k);
    let mut out = Vec::with_capacity(sources.len());
    for (_, mut members) in groups {
        // Sequential weighted draws without replacement.
        while !members.is_empty() {
            let total: u64 = members
                .iter()
                .map(|&i| sources[i].weight.max(1) as u64)
                .sum();
            let mut r = rng.below(total);
            let mut pick = 0;
            for (j, &i) in members.iter().enumerate() {
                let w = sources[i].weight.max(1) as u64;
                if r < w {
                    pick = j;
                    break;
                }
                r -= w;
            }
            out.push(members.remove(pick));
        }
    }
    out
}

/// SPEC §17.9 (revises §14.9): where a context-length rejection by source `rejecting`
/// may go: every source not yet tried in the call whose `CONTEXT_WINDOW` is larger —
/// the smallest such window first — then, where the windows are not both known, the
/// sources with another `MODEL` (each tried once, as the tried set grows). Empty: the
/// rejection is final.
pub fn larger_context_candidates(
    sources: &[SourceConfig],
    rejecting: usize,
    tried: &BTreeSet<usize>,
) -> Vec<usize> {
    let r = &sources[rejecting];
    let mut known: Vec<(u64, usize)> = Vec::new();
    let mut other_model: Vec<usize> = Vec::new();
    for (i, c) in sources.iter().enumerate() {
        if i == rejecting || tried.contains(&i) {
            continue;
        }
        match (r.context_window, c.context_window) {
            (Some(rw), Some(cw)) => {
                if cw > rw {
                    known.push((cw, i));
                }
            }
            _ => {
                if c.model != r.model {
                    other_model.push(i);
                }
            }
        }
    }
    known.sort();
    known
        .into_iter()
        .map(|(_, i)| i)
        .chain(other_model)
        .collect()
}

/// SPEC §17.9: the sources whose known `CONTEXT_WINDOW` is smaller than a request
/// needs (`need` = its estimated prompt plus its `max_tokens`), skipped before any
/// request is sent. When every source's window is known and too small, the largest
/// stay candidates (the estimate is an estimate: the upstream has the last word).
pub fn too_small_for(sources: &[SourceConfig], need: u64) -> BTreeSet<usize> {
    let small: BTreeSet<usize> = sources
        .iter()
        .enumerate()
        .filter(|(_, s)| s.context_window.is_some_and(|w| w < need))
        .map(|(i, _)| i)
        .collect();
    if small.len() < sources.len() {
        return small;
    }
    let largest = sources
        .iter()
        .filter_map(|s| s.context_window)
        .max()
        .unwrap_or(0);
    small
        .into_iter()
        .filter(|&i| sources[i].context_window != Some(largest))
        .collect()
}

/// What to do when no candidate was admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRunnable {
    /// Wait this long (then bound by deadline and stall window) and pick again.
    Wait(Duration),
    /// Fail with `no_runnable_source`.
    Fail,
    /// Nothing can be admitted within the call's bound: end the call now; the earliest
    /// admission is this far away (SPEC §17.2).
    Beyond(Duration),
}

/// Wait for a refusal that passes with time but carries no hint (no backend refuses so:
/// every such refusal has one; this only bounds the case).
pub const NO_HINT_WAIT: Duration = Duration::from_secs(1);

/// The most jitter added to a hint.
pub const MAX_JITTER: Duration = Duration::from_secs(1);

/// SPEC §4.1, §14.6: with `wait` and at least one refusal that passes with time, wait
/// until the earliest hint — the earliest time a refusal can clear: the window expiry of
/// the oldest entries (RPM, TPM), the earliest lease end (concurrency), the end of a
/// cooldown or open period (breakers); otherwise fail.
///
/// A hint is when the refusal clears if nothing else happens. Slots and tokens may clear
/// sooner (a release, a settlement below the reservation): within the process the engine
/// wakes one waiter for each slot an attempt frees, so the hint only bounds how long a
/// waiter misses what other processes free.
pub fn on_no_runnable(refusals: &[(String, Refusal)], policy: OnNoRunnable) -> NoRunnable {
    if policy == OnNoRunnable::Fail {
        return NoRunnable::Fail;
    }
    refusals
        .iter()
        .filter(|(_, r)| r.reason.passes_with_time())
        .map(|(_, r)| r.retry_after.unwrap_or(NO_HINT_WAIT))
        .min()
        .map(|d| NoRunnable::Wait(d.max(Duration::from_millis(1))))
        .unwrap_or(NoRunnable::Fail)
}

impl NoRunnable {
    /// SPEC §17.2: [`on_no_runnable`] when the call may wait at most `left` more: when
    /// every refusal is one that cannot clear before its hint — a cooldown, an open
    /// breaker, a dead source, a requests-per-minute window — and the earliest hint is
    /// after `left`, the call cannot be served within its bound: [`NoRunnable::Beyond`]
    /// with that earliest admission, at once, instead of holding the caller. Refusals
    /// that can clear sooner (a freed slot, tokens settled below their reservation) keep
    /// the call waiting.
    ///
    /// SPEC §25.4: while every source is known to be failing — each refused for an open
    /// breaker or as dead — the call is answered at once from that knowledge, whatever
    /// its bound: waiting for a half-open probe would only hold the caller while its
    /// own library (or agent) waits to retry anyway.
    pub fn within(refusals: &[(String, Refusal)], policy: OnNoRunnable, left: Duration) -> Self {
        match on_no_runnable(refusals, policy) {
            NoRunnable::Wait(hint) if hint > left && refusals.iter().all(|(_, r)| is_firm(r)) => {
                NoRunnable::Beyond(hint)
            }
            NoRunnable::Wait(hint) if all_failing(refusals) => NoRunnable::Beyond(hint),
            other => other,
        }
    }
}

/// Whether every refusal says its source is failing (an open breaker, a dead source):
/// see [`NoRunnable::within`].
pub fn all_failing(refusals: &[(String, Refusal)]) -> bool {
    use crate::error::RefusalReason as R;
    !refusals.is_empty()
        && refusals
            .iter()
            .all(|(_, r)| matches!(r.reason, R::CircuitOpen | R::Dead))
}

/// Whether a refusal cannot clear before its hint (see [`NoRunnable::within`]).
pub fn is_firm(r: &Refusal) -> bool {
    use crate::error::RefusalReason as R;
    match r.reason {
        R::Cooldown
        | R::CircuitOpen
        | R::Dead
        | R::Rpm
        | R::ScopeRpm
        | R::KeyRpm
        | R::KeyBudgetUnpriced
        | R::Drained => true,
        // A key's budget can clear before the period ends: reservations in flight may
        // settle below what they reserved.
        R::Tpm
        | R::ScopeTpm
        | R::Concurrency
        | R::KeyTpm
        | R::KeyConcurrency
        | R::KeyBudgetDay
        | R::KeyBudgetMonth => false,
    }
}

/// The wait before looking again after a hint: the hint plus a jitter of up to a tenth of
/// it (at least 1 ms, at most [`MAX_JITTER`]), so the calls waiting on one hint do not all
/// come back in the same instant. Never shorter than the hint: a refusal does not clear
/// before it.
pub fn jittered(hint: Duration, rng: &dyn Rng) -> Duration {
    let spread = (hint / 10).clamp(Duration::from_millis(1), MAX_JITTER);
    let us = u64::try_from(spread.as_micros()).unwrap_or(u64::MAX);
    hint + Duration::from_micros(rng.below(us + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RefusalReason;
    use crate::ports::SplitMix64;

    fn src(name: &str, prio: u32, weight: u32) -> SourceConfig {
        let mut s = SourceConfig::new("p", 0, "http://x", "", "m");
        s.name = name.to_string();
        s.priority = prio;
        s.weight = weight;
        s
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn tiers_then_failed_last_and_exclude() {
        let s = vec![
            src("a", 1, 1),
            src("b", 0, 1),
            src("c", 0, 1),
            src("d", 2, 1),
        ];
        let rng = SplitMix64::new(3);
        for _ in 0..50 {
            let o = order_candidates(&s, &set(&["d"]), &set(&["b"]), &rng);
            let names: Vec<&str> = o.iter().map(|&i| s[i].name.as_str()).collect();
            assert_eq!(names, ["c", "a", "b"]);
        }
    }

    /// A resume prefers prefill-capable sources over priority, but a source that
    /// failed in this call still comes last.
    #[test]
    fn preferred_sources_come_first_within_failed_groups() {
        let s = vec![
            src("a", 0, 1),
            src("b", 1, 1),
            src("c", 2, 1),
            src("d", 0, 1),
        ];
        let rng = SplitMix64::new(5);
        let prefill = |i: usize| i == 1 || i == 2;
        for _ in 0..20 {
            let o = order_candidates_preferring(&s, &set(&[]), &set(&["c"]), &prefill, &rng);
            let names: Vec<&str> = o.iter().map(|&i| s[i].name.as_str()).collect();
            assert_eq!(names[0], "b");
            assert_eq!(names[3], "c");
        }
    }

    #[test]
    fn context_length_goes_to_a_larger_window_or_another_model() {
        let mut s = vec![
            src("a", 0, 1),
            src("b", 0, 1),
            src("c", 0, 1),
            src("d", 0, 1),
        ];
        s[0].context_window = Some(8_000);
        s[1].context_window = Some(32_000);
        s[2].context_window = Some(4_000);
        // d: no window, same model as a
        let none = BTreeSet::new();
        assert_eq!(larger_context_candidates(&s, 0, &none), vec![1]);
        assert_eq!(
            larger_context_candidates(&s, 0, &BTreeSet::from([1])),
            Vec::<usize>::new(),
            "tried already"
        );
        s[3].model = "bigger".into();
        assert_eq!(larger_context_candidates(&s, 0, &none), vec![1, 3]);
        assert!(larger_context_candidates(&s, 1, &none).contains(&3));
    }

    /// Issue 22, item 19: windows of 8k, 16k and 200k and a 25k prompt: the 8k one
    /// rejects, the next is the smallest larger (16k), then 200k; sources known to be too
    /// small are skipped up front, but never all of them.
    #[test]
    fn context_routing_goes_as_far_as_the_windows_allow() {
        let mut s = vec![src("a", 0, 1), src("b", 0, 1), src("c", 0, 1)];
        s[0].context_window = Some(8_000);
        s[1].context_window = Some(200_000);
        s[2].context_window = Some(16_000);
        let mut tried = BTreeSet::from([0]);
        assert_eq!(larger_context_candidates(&s, 0, &tried), vec![2, 1]);
        tried.insert(2);
        assert_eq!(larger_context_candidates(&s, 2, &tried), vec![1]);
        tried.insert(1);
        assert!(larger_context_candidates(&s, 1, &tried).is_empty());
        assert_eq!(too_small_for(&s, 25_000), BTreeSet::from([0, 2]));
        assert_eq!(too_small_for(&s, 1_000), BTreeSet::new());
        assert_eq!(
            too_small_for(&s, 300_000),
            BTreeSet::from([0, 2]),
            "the largest stays"
        );
        // Unknown windows are never skipped.
        s[1].context_window = None;
        assert_eq!(too_small_for(&s, 300_000), BTreeSet::from([0, 2]));
    }

    /// SPEC §17.2: firm refusals whose earliest hint lies beyond the bound end the
    /// call at once; a refusal that may clear sooner keeps it waiting.
    #[test]
    fn beyond_the_bound_ends_at_once() {
        let r = |reason, s: u64| {
            (
                "x".to_string(),
                Refusal {
                    reason,
                    retry_after: Some(Duration::from_secs(s)),
                },
            )
        };
        let left = Duration::from_secs(10);
        let w = OnNoRunnable::Wait;
        let cooling = vec![r(RefusalReason::Cooldown, 30)];
        assert_eq!(
            NoRunnable::within(&cooling, w, left),
            NoRunnable::Beyond(Duration::from_secs(30))
        );
        assert_eq!(
            NoRunnable::within(&cooling, w, Duration::from_secs(40)),
            NoRunnable::Wait(Duration::from_secs(30))
        );
        let open = vec![
            r(RefusalReason::CircuitOpen, 12),
            r(RefusalReason::Dead, 300),
        ];
        assert_eq!(
            NoRunnable::within(&open, w, left),
            NoRunnable::Beyond(Duration::from_secs(12))
        );
        let busy = vec![
            r(RefusalReason::Cooldown, 30),
            r(RefusalReason::Concurrency, 60),
        ];
        assert_eq!(
            NoRunnable::within(&busy, w, left),
            NoRunnable::Wait(Duration::from_secs(30)),
            "a slot may free sooner"
        );
        assert_eq!(
            NoRunnable::within(&cooling, OnNoRunnable::Fail, left),
            NoRunnable::Fail
        );
        // SPEC §25.4: every source known to be failing (open, dead) ends the call at
        // once, even when a probe is due within the bound.
        let failing = vec![
            r(RefusalReason::CircuitOpen, 2),
            r(RefusalReason::Dead, 300),
        ];
        assert!(all_failing(&failing));
        assert_eq!(
            NoRunnable::within(&failing, w, left),
            NoRunnable::Beyond(Duration::from_secs(2))
        );
        // One source merely cooling down (a 429's hint) keeps the call waiting.
        let mixed = vec![
            r(RefusalReason::CircuitOpen, 2),
            r(RefusalReason::Cooldown, 3),
        ];
        assert!(!all_failing(&mixed) && !all_failing(&[]));
        assert_eq!(
            NoRunnable::within(&mixed, w, left),
            NoRunnable::Wait(Duration::from_secs(2))
        );
    }

    #[test]
    fn weights_shape_the_choice() {
        let s = vec![src("a", 0, 1), src("b", 0, 3)];
        let rng = SplitMix64::new(11);
        let n = 4000;
        let b_first = (0..n)
            .filter(|_| order_candidates(&s, &set(&[]), &set(&[]), &rng)[0] == 1)
            .count();
        let share = b_first as f64 / n as f64;
        assert!((0.70..0.80).contains(&share), "share {share}");
    }

    #[test]
    fn no_runnable_table() {
        let r = |reason, ms: Option<u64>| Refusal {
            reason,
            retry_after: ms.map(Duration::from_millis),
        };
        let dead_only = vec![("a".to_string(), r(RefusalReason::Dead, Some(1000)))];
        assert_eq!(
            on_no_runnable(&dead_only, OnNoRunnable::Wait),
            NoRunnable::Fail
        );
        let mixed = vec![
            ("a".to_string(), r(RefusalReason::Dead, Some(10))),
            ("b".to_string(), r(RefusalReason::Rpm, Some(700))),
            ("c".to_string(), r(RefusalReason::Cooldown, Some(300))),
        ];
        assert_eq!(
            on_no_runnable(&mixed, OnNoRunnable::Wait),
            NoRunnable::Wait(Duration::from_millis(300))
        );
        assert_eq!(on_no_runnable(&mixed, OnNoRunnable::Fail), NoRunnable::Fail);
        let conc = vec![("a".to_string(), r(RefusalReason::Concurrency, None))];
        assert_eq!(
            on_no_runnable(&conc, OnNoRunnable::Wait),
            NoRunnable::Wait(NO_HINT_WAIT)
        );
        // SPEC §14.6: every reason waits for its hint — no fixed polling (slots and
        // tokens freed in the process wake a waiter sooner).
        for reason in [
            RefusalReason::Concurrency,
            RefusalReason::Tpm,
            RefusalReason::ScopeTpm,
            RefusalReason::Rpm,
            RefusalReason::ScopeRpm,
            RefusalReason::Cooldown,
            RefusalReason::CircuitOpen,
        ] {
            let long = vec![("a".to_string(), r(reason, Some(60_000)))];
            assert_eq!(
                on_no_runnable(&long, OnNoRunnable::Wait),
                NoRunnable::Wait(Duration::from_secs(60)),
                "{reason}"
            );
        }
        assert_eq!(on_no_runnable(&[], OnNoRunnable::Wait), NoRunnable::Fail);
    }

    #[test]
    fn jitter_stays_within_a_tenth_of_the_hint() {
        let rng = SplitMix64::new(7);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..2000 {
            let w = jittered(Duration::from_secs(20), &rng);
            assert!(
                w >= Duration::from_secs(20) && w <= Duration::from_secs(21),
                "{w:?}"
            );
            seen.insert(w.as_millis());
        }
        assert!(seen.len() > 500, "spread: {}", seen.len());
        let w = jittered(Duration::from_millis(3), &rng);
        assert!(w >= Duration::from_millis(3) && w <= Duration::from_millis(4));
        let w = jittered(Duration::from_secs(3600), &rng);
        assert!(w <= Duration::from_secs(3601));
    }

    /// The boundaries: a window equal to the one that rejected is no larger; a window
    /// equal to what the request needs is not too small; a hint equal to the wait left
    /// is still within it.
    #[test]
    fn context_and_wait_boundaries() {
        let mut s = vec![src("a", 0, 1), src("b", 0, 1), src("c", 0, 1)];
        s[0].context_window = Some(8_000);
        s[1].context_window = Some(8_000);
        s[2].context_window = Some(8_001);
        assert_eq!(larger_context_candidates(&s, 0, &BTreeSet::new()), vec![2]);
        assert_eq!(too_small_for(&s, 8_000), BTreeSet::new());
        assert_eq!(too_small_for(&s, 8_001), BTreeSet::from([0, 1]));
        let cooling = vec![(
            "x".to_string(),
            Refusal {
                reason: RefusalReason::Cooldown,
                retry_after: Some(Duration::from_secs(10)),
            },
        )];
        assert_eq!(
            NoRunnable::within(&cooling, OnNoRunnable::Wait, Duration::from_secs(10)),
            NoRunnable::Wait(Duration::from_secs(10))
        );
    }

    /// The jitter reaches its whole spread: with the highest draw, the hint plus a
    /// tenth of it (at least 1 ms, at most [`MAX_JITTER`]), to the microsecond.
    #[test]
    fn the_jitter_spans_a_tenth_of_the_hint_exactly() {
        #[derive(Debug)]
        struct Highest;
        impl Rng for Highest {
            fn next_u64(&self) -> u64 {
                u64::MAX
            }
            fn below(&self, n: u64) -> u64 {
                n.saturating_sub(1)
            }
        }
        assert_eq!(
            jittered(Duration::from_secs(20), &Highest),
            Duration::from_secs(21),
            "a tenth, at most MAX_JITTER"
        );
        assert_eq!(
            jittered(Duration::from_millis(5), &Highest),
            Duration::from_millis(6)
        );
    }
}
