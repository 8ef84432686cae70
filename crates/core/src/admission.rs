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

/// SPEC §14.9: where a context-length rejection by source `rejecting` may go once:
/// sources not yet tried in the call whose `CONTEXT_WINDOW` is larger — or, when the
/// windows are not both set, whose `MODEL` differs. Empty: the rejection is final.
pub fn larger_context_candidates(
    sources: &[SourceConfig],
    rejecting: usize,
    tried: &BTreeSet<usize>,
) -> BTreeSet<usize> {
    let r = &sources[rejecting];
    sources
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != rejecting && !tried.contains(i))
        .filter(|(_, c)| match (r.context_window, c.context_window) {
            (Some(rw), Some(cw)) => cw > rw,
            _ => c.model != r.model,
        })
        .map(|(i, _)| i)
        .collect()
}

/// What to do when no candidate was admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRunnable {
    /// Wait this long (then bound by deadline and stall window) and pick again.
    Wait(Duration),
    /// Fail with `no_runnable_source`.
    Fail,
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
        assert_eq!(larger_context_candidates(&s, 0, &none), BTreeSet::from([1]));
        assert_eq!(
            larger_context_candidates(&s, 0, &BTreeSet::from([1])),
            BTreeSet::new(),
            "tried already"
        );
        s[3].model = "bigger".into();
        assert_eq!(
            larger_context_candidates(&s, 0, &none),
            BTreeSet::from([1, 3])
        );
        assert!(larger_context_candidates(&s, 1, &none).contains(&3));
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
}
