use super::*;
use crate::client_key::BudgetPeriod;
use crate::key_quota::{period_end_ms, KeyQuotas};
use crate::ports::KeyAcquire;
use proptest::prelude::*;
use std::time::Duration;

#[test]
fn a_leg_is_covered_by_what_the_call_holds_or_topped_up() {
    let mut f = CallFunds::new(1_000);
    assert_eq!(f.shortfall(800), 0);
    f.hold(800);
    // A hedge of 700 while the first leg holds 800: 500 to top up.
    assert_eq!(f.shortfall(700), 500);
    f.topped_up(500);
    assert_eq!(f.shortfall(700), 0);
    f.hold(700);
    // The first leg failed before any body (cost 0): a retry of 700 is covered again.
    f.end(800, Some(0));
    assert_eq!(f.shortfall(700), 0);
    // The hedge ended with its usage unknown: it settles at its reservation.
    f.end(700, None);
    assert_eq!((f.settlement(), f.reserved()), (700, 1_500));
    f.hold(300);
    f.release(300);
    assert_eq!(f.settlement(), 700);
    assert_eq!(settle_legs([(Some(0), 800), (None, 700)]), 700);
}

#[test]
fn a_cap_shrinks_to_what_the_budget_pays_down_to_its_floor() {
    use crate::key_quota::ScopePrices;
    // 1 nano per input token, 2 per output token (0.001 and 0.002 per 1M).
    let p = ScopePrices {
        input: Some(1_000_000),
        output: Some(2_000_000),
        per_call: None,
    };
    // 100 prompt tokens + 25 % = 125 nanos; 10 125 nanos left pay 5000 output tokens.
    assert_eq!(shrunk_cap(10_125, 100, 25, &p, 8192, 1024), Some(5_000));
    // Never above what the call wanted.
    assert_eq!(shrunk_cap(1_000_000, 100, 25, &p, 4096, 1024), Some(4096));
    // Below the floor (the smaller of its own cap and the minimum): refused.
    assert_eq!(shrunk_cap(2_000, 100, 25, &p, 8192, 1024), None);
    // A call that wanted less than the minimum keeps its own as the floor.
    assert_eq!(shrunk_cap(1_125, 100, 25, &p, 500, 1024), Some(500));
    assert_eq!(shrunk_cap(1_124, 100, 25, &p, 500, 1024), None);
    // Not even the prompt fits.
    assert_eq!(shrunk_cap(100, 100, 25, &p, 500, 1), None);
}

proptest! {
    /// A shrunk cap is one the remaining budget pays for, never above the wanted cap,
    /// and the largest such (one more token would not fit, unless it is the wanted cap).
    #[test]
    fn a_shrunk_cap_is_the_largest_the_budget_pays(
        remaining in 0u64..50_000_000,
        prompt in 0u64..20_000,
        input in 1u64..20_000_000,
        output in 1u64..80_000_000,
        wanted in 1u64..100_000,
        floor in 1u64..5_000,
    ) {
        let p = crate::key_quota::ScopePrices { input: Some(input), output: Some(output), per_call: None };
        if let Some(c) = shrunk_cap(remaining, prompt, 25, &p, wanted, floor) {
            prop_assert!(c <= wanted && c >= floor.min(wanted));
            prop_assert!(p.reserve_nanos(with_margin(prompt, 25), c).unwrap() <= remaining);
            if c < wanted {
                prop_assert!(p.reserve_nanos(with_margin(prompt, 25), c + 1).unwrap() > remaining);
            }
        } else if let Some(n) = p.reserve_nanos(with_margin(prompt, 25), floor.min(wanted)) {
            prop_assert!(n > remaining, "refused although {n} ≤ {remaining}");
        }
    }
}

#[test]
fn a_legs_reservation_prices_its_source_with_the_margin() {
    let cheap = SourceConfig::new("a", 0, "http://a", "", "m").with_prices(1.0, 2.0);
    let dear = SourceConfig::new("b", 0, "http://b", "", "m")
        .with_prices(3.0, 15.0)
        .with_cache_write_price(3.75);
    let free = SourceConfig::new("c", 0, "http://c", "", "m");
    let all = [cheap.clone(), dear.clone(), free.clone()];
    // 1000 prompt tokens + 25 % at 1.0/M, 100 out at 2.0/M.
    assert_eq!(
        leg_reserve_nanos(1000, Some(100), 25, &cheap, &all, 0),
        1_250_000 + 200_000
    );
    // The dearest input side is the cache write.
    assert_eq!(
        leg_reserve_nanos(1000, Some(100), 25, &dear, &all, 0),
        1250 * 3_750 + 100 * 15_000
    );
    // An unpriced source reserves what the scope's dearest prices would.
    assert_eq!(
        leg_reserve_nanos(1000, Some(100), 25, &free, &all, 0),
        1250 * 3_750 + 100 * 15_000
    );
    assert_eq!(with_margin(3, 25), 4);
    assert_eq!(with_margin(3, 0), 3);
    let mut capped = cheap.clone();
    capped.max_output_tokens = Some(1000);
    assert_eq!(default_cap(&all), DEFAULT_MAX_OUTPUT_TOKENS);
    assert_eq!(default_cap(&[capped, dear]), 1000);
}

/// One step of the interleaving.
#[derive(Debug, Clone)]
enum Op {
    /// A client call is admitted (if the key takes it).
    Admit,
    /// Call `call` launches a leg reserving `legs[leg]`.
    Leg { call: usize, leg: usize },
    /// One of a call's legs ends: at `pct` % of its reservation, or unknown.
    End {
        call: usize,
        pick: usize,
        pct: Option<u64>,
    },
    /// A call ends (its legs still held settle at their reservation).
    Finish { call: usize },
    /// Time passes.
    Advance { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Admit),
        4 => (0usize..8, 0usize..4).prop_map(|(call, leg)| Op::Leg { call, leg }),
        3 => (0usize..8, 0usize..4, proptest::option::weighted(0.7, 0u64..=100))
            .prop_map(|(call, pick, pct)| Op::End { call, pick, pct }),
        1 => (0usize..8).prop_map(|call| Op::Finish { call }),
        1 => (0u64..400_000).prop_map(|ms| Op::Advance { ms }),
    ]
}

struct Call {
    permit: u64,
    funds: CallFunds,
    legs: Vec<u64>,
    top_ups: Vec<u64>,
}

fn acquire(budget: u64, nanos: u64, top_up: bool) -> KeyAcquire<'static> {
    KeyAcquire {
        key_id: "k",
        rpm: 0,
        tpm: 0,
        max_concurrency: 0,
        budget_day_nanos: Some(budget),
        budget_month_nanos: None,
        est_tokens: 0,
        reserve_nanos: nanos,
        // Longer than any run: a holder's heartbeat renews its lease; an expired one
        // would settle at its reservation (the model's crash rule), not at its cost.
        lease: Duration::from_secs(30 * 86_400),
        top_up,
    }
}

/// Settles call `c` at `now`: its own permit at its settlement, its top-ups at 0.
fn finish(model: &mut KeyQuotas, now: u64, c: Call) -> u64 {
    let s = c.funds.settlement();
    model.finish(now, c.permit, 0, s);
    for t in c.top_ups {
        model.finish(now, t, 0, 0);
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// SPEC §24.1's invariant over random interleavings of calls, legs (first legs,
    /// hedges, retries on sources of any price), top-ups, ends and settlements, across
    /// a day's end: the key's spend (settled + reserved) never exceeds its budget, no
    /// call settles more than its funds, and what the key settled is what its calls
    /// settled.
    #[test]
    fn the_budget_is_never_exceeded(
        budget in 10_000u64..200_000,
        legs in proptest::collection::vec(1u64..40_000, 4),
        start_before_midnight in 0u64..600_000,
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        // The admission reserves at the scope's dearest prices: every first leg fits.
        let admission = *legs.iter().max().unwrap();
        let day_end = period_end_ms(BudgetPeriod::Day, 1_767_225_600_000);
        let mut now = day_end - start_before_midnight;
        let mut model = KeyQuotas::new();
        let mut calls: Vec<Call> = Vec::new();
        let mut settled_by_day: std::collections::BTreeMap<u64, u64> = Default::default();
        for op in ops {
            match op {
                Op::Admit => {
                    if let Ok(permit) = model.acquire(now, &acquire(budget, admission, false)) {
                        calls.push(Call {
                            permit,
                            funds: CallFunds::new(admission),
                            legs: vec![],
                            top_ups: vec![],
                        });
                    }
                }
                Op::Leg { call, leg } if !calls.is_empty() => {
                    let n = calls.len();
                    let c = &mut calls[call % n];
                    let r = legs[leg];
                    let need = c.funds.shortfall(r);
                    let covered = need == 0
                        || match model.acquire(now, &acquire(budget, need, true)) {
                            Ok(id) => {
                                c.top_ups.push(id);
                                c.funds.topped_up(need);
                                true
                            }
                            Err(_) => false,
                        };
                    if covered {
                        prop_assert_eq!(c.funds.shortfall(r), 0);
                        c.funds.hold(r);
                        c.legs.push(r);
                    }
                }
                Op::End { call, pick, pct } if !calls.is_empty() => {
                    let n = calls.len();
                    let c = &mut calls[call % n];
                    if !c.legs.is_empty() {
                        let r = c.legs.remove(pick % c.legs.len());
                        c.funds.end(r, pct.map(|p| r * p / 100));
                    }
                }
                Op::Finish { call } if !calls.is_empty() => {
                    let n = calls.len();
                    let c = calls.remove(call % n);
                    prop_assert!(c.funds.settlement() <= c.funds.reserved());
                    let s = finish(&mut model, now, c);
                    *settled_by_day.entry(now / 86_400_000).or_default() += s;
                }
                Op::Advance { ms } => now += ms,
                _ => {}
            }
            let u = model.usage(now, "k");
            prop_assert!(u.day_nanos <= budget, "spend {} over the budget {}", u.day_nanos, budget);
        }
        for c in std::mem::take(&mut calls) {
            prop_assert!(c.funds.settlement() <= c.funds.reserved());
            let s = finish(&mut model, now, c);
            *settled_by_day.entry(now / 86_400_000).or_default() += s;
        }
        let u = model.usage(now, "k");
        prop_assert_eq!(u.reserved_nanos, 0);
        prop_assert_eq!(u.day_nanos, settled_by_day.get(&(now / 86_400_000)).copied().unwrap_or(0));
        for (_, s) in settled_by_day {
            prop_assert!(s <= budget);
        }
    }
}
