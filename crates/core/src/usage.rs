//! A logical call's usage over its legs (SPEC §13.4, §17.8), pure: what a leg whose
//! usage frame never came is counted as, and how the legs whose text the answer holds
//! add up. The round state machine ([`crate::round`]) says which legs those are; the
//! engine writes each leg's figure in its telemetry row and the sum in the answer, so
//! the two always agree.

use crate::response::{Usage, UsageSource};
use crate::resume::{estimate_bytes, estimate_tokens, Transcript};

/// The usage of one leg, as its row records it and the answer counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LegUsage {
    /// Tokens.
    pub usage: Usage,
    /// Where they come from.
    pub source: UsageSource,
}

impl LegUsage {
    /// Usage as the transport measured (or salvaged) it.
    pub fn new(usage: Usage, source: UsageSource) -> Self {
        LegUsage { usage, source }
    }

    /// No usage known.
    pub fn unavailable() -> Self {
        LegUsage::default()
    }
}

/// Bytes of text a leg produced: content, reasoning and tool-call names and arguments
/// (what its estimate counts).
pub fn received_bytes(t: &Transcript) -> usize {
    t.content.len()
        + t.reasoning.len()
        + t.tools
            .values()
            .map(|x| x.arguments.len() + x.name.as_ref().map_or(0, String::len))
            .sum::<usize>()
}

/// The estimated prompt of a leg: the request's (`request_prompt`, estimated) plus, for
/// a prefill leg, the prefix it sent as an assistant message.
pub fn leg_prompt_estimate(request_prompt: u64, prefill_prefix: &str) -> u64 {
    if prefill_prefix.is_empty() {
        request_prompt
    } else {
        request_prompt.saturating_add(estimate_tokens(prefill_prefix) + 4)
    }
}

/// The gateway's own estimate of what a leg cost, for a row whose usage the provider did
/// not report (SPEC §20.4): the prompt it sent ([`leg_prompt_estimate`]) and the text
/// and reasoning it received before the end (a token per 4 bytes of
/// [`received_bytes`]). Its row keeps the figures in `est_prompt_tokens` /
/// `est_received_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LegEstimate {
    /// Estimated prompt tokens sent.
    pub prompt_tokens: u64,
    /// Estimated tokens received (content, reasoning, tool calls).
    pub received_tokens: u64,
}

impl LegEstimate {
    /// The estimate of a leg that sent a prompt of `prompt_estimate` tokens and received
    /// `received`.
    pub fn of(prompt_estimate: u64, received: &Transcript) -> Self {
        LegEstimate::from_bytes(prompt_estimate, received_bytes(received))
    }

    /// The estimate of a leg that received `bytes` bytes of text.
    pub fn from_bytes(prompt_estimate: u64, bytes: usize) -> Self {
        LegEstimate {
            prompt_tokens: prompt_estimate,
            received_tokens: estimate_bytes(bytes),
        }
    }
}

/// The usage of a leg that produced text but whose usage is unknown (cut, stalled and
/// displaced, or failed after its first chunk): its prompt and the text it received,
/// estimated — exactly its [`LegEstimate`]. `None` when it received nothing (then its
/// usage is unavailable).
pub fn cut_leg_usage(prompt_estimate: u64, received: &Transcript) -> Option<LegUsage> {
    let bytes = received_bytes(received);
    (bytes > 0).then(|| {
        let e = LegEstimate::from_bytes(prompt_estimate, bytes);
        LegUsage {
            usage: Usage::new(e.prompt_tokens, e.received_tokens),
            source: UsageSource::Estimated,
        }
    })
}

/// The answer's usage: the winner's plus that of every other leg whose text the answer
/// holds (`parts`). Counts add up (details known in any part are summed); the source is
/// the weakest of all (a part without usage makes the whole unavailable, an estimated
/// part makes it estimated).
pub fn call_usage(winner: LegUsage, parts: &[LegUsage]) -> LegUsage {
    parts.iter().fold(winner, |acc, p| LegUsage {
        usage: acc.usage.add(&p.usage),
        source: acc.source.merge(p.source),
    })
}

/// The usage that describes an answer joined from several legs (SPEC §23.6: agents
/// size their context from it): the last leg's context — its prompt, cache fields
/// included — and the output delivered. A replay (or a restart) made the whole answer
/// again, so its own output is the answer's; a prefill continuation made only the rest,
/// so the earlier legs' output is added. `None` when one leg made the answer (the
/// call's usage then describes it). What every leg billed stays in [`call_usage`].
pub fn answer_usage(
    winner: Usage,
    parts: &[LegUsage],
    mode: Option<crate::resume::ResumeMode>,
) -> Option<Usage> {
    if parts.is_empty() {
        return None;
    }
    let mut u = winner;
    if mode == Some(crate::resume::ResumeMode::Prefill) {
        for p in parts {
            u.completion_tokens += p.usage.completion_tokens;
            if let Some(r) = p.usage.reasoning_tokens {
                u.reasoning_tokens = Some(u.reasoning_tokens.unwrap_or(0) + r);
            }
        }
    }
    Some(u)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::{StreamDelta, ToolCallDelta};

    #[test]
    fn a_joined_answer_shows_its_last_context_and_its_output() {
        let cut = measured(100, 7);
        let winner = Usage::new(110, 20);
        assert_eq!(
            answer_usage(winner, &[], None),
            None,
            "one leg: the call's usage"
        );
        let replay = answer_usage(winner, &[cut], Some(crate::resume::ResumeMode::Replay));
        assert_eq!(
            replay,
            Some(Usage::new(110, 20)),
            "the replay made the whole answer"
        );
        let prefill = answer_usage(winner, &[cut], Some(crate::resume::ResumeMode::Prefill));
        assert_eq!(
            prefill,
            Some(Usage::new(110, 27)),
            "the prefix's output, then the rest"
        );
        // What was billed is every leg's.
        assert_eq!(
            call_usage(LegUsage::new(winner, UsageSource::Measured), &[cut]).usage,
            Usage::new(210, 27)
        );
    }
    use proptest::prelude::*;

    fn measured(p: u64, c: u64) -> LegUsage {
        LegUsage::new(Usage::new(p, c), UsageSource::Measured)
    }

    #[test]
    fn a_cut_leg_counts_its_prompt_and_what_it_received() {
        let mut t = Transcript::default();
        assert_eq!(cut_leg_usage(10, &t), None, "nothing received");
        t.absorb(&StreamDelta {
            content: Some("abcdefgh".into()),
            reasoning: Some("abcd".into()),
            tool_calls: vec![ToolCallDelta {
                index: 0,
                id: Some("c".into()),
                name: Some("fn".into()),
                arguments: "{}".into(),
            }],
            ..Default::default()
        });
        let u = cut_leg_usage(10, &t).unwrap();
        assert_eq!(u.source, UsageSource::Estimated);
        assert_eq!(u.usage, Usage::new(10, 4), "16 bytes → 4 tokens");
        assert_eq!(
            LegEstimate::of(10, &t),
            LegEstimate {
                prompt_tokens: 10,
                received_tokens: 4
            },
            "the estimate holds the same figures"
        );
        assert_eq!(
            LegEstimate::of(7, &Transcript::default()).received_tokens,
            0
        );
        assert_eq!(leg_prompt_estimate(10, ""), 10);
        assert_eq!(leg_prompt_estimate(10, "abcdefgh"), 16);
    }

    #[test]
    fn the_call_is_the_sum_and_the_weakest_source() {
        let w = measured(5, 7);
        assert_eq!(call_usage(w, &[]), w);
        let est = LegUsage::new(Usage::new(5, 3), UsageSource::Estimated);
        let c = call_usage(w, &[est]);
        assert_eq!(c.usage, Usage::new(10, 10));
        assert_eq!(c.source, UsageSource::Estimated);
        let c = call_usage(w, &[est, LegUsage::unavailable()]);
        assert_eq!(c.source, UsageSource::Unavailable);
    }

    fn arb_usage() -> impl Strategy<Value = Usage> {
        (
            0u64..1_000_000,
            0u64..1_000_000,
            proptest::option::of(0u64..1000),
            proptest::option::of(0u64..1000),
        )
            .prop_map(|(p, c, r, cached)| Usage {
                reasoning_tokens: r,
                cached_prompt_tokens: cached.map(|x| x.min(p)),
                ..Usage::new(p, c)
            })
    }

    proptest! {
        /// SPEC §17.8: a resumed call whose delivered legs all reported usage has a
        /// measured total equal to the sum of their reported usage, in any order;
        /// counting the winner twice, or leaving a part out, changes the total.
        #[test]
        fn a_measured_total_is_the_sum_of_the_delivered_legs(
            winner in arb_usage(),
            parts in proptest::collection::vec(arb_usage(), 0..5),
        ) {
            let w = LegUsage::new(winner, UsageSource::Measured);
            let ps: Vec<LegUsage> =
                parts.iter().map(|u| LegUsage::new(*u, UsageSource::Measured)).collect();
            let total = call_usage(w, &ps);
            prop_assert_eq!(total.source, UsageSource::Measured);
            let prompt: u64 = winner.prompt_tokens + parts.iter().map(|u| u.prompt_tokens).sum::<u64>();
            let completion: u64 =
                winner.completion_tokens + parts.iter().map(|u| u.completion_tokens).sum::<u64>();
            prop_assert_eq!(total.usage.prompt_tokens, prompt);
            prop_assert_eq!(total.usage.completion_tokens, completion);
            let mut rev = ps.clone();
            rev.reverse();
            prop_assert_eq!(call_usage(w, &rev), total, "order does not matter");
            let cached: Option<u64> = std::iter::once(winner.cached_prompt_tokens)
                .chain(parts.iter().map(|u| u.cached_prompt_tokens))
                .fold(None, |a, b| match (a, b) {
                    (None, None) => None,
                    (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
                });
            prop_assert_eq!(total.usage.cached_prompt_tokens, cached);
        }
    }
}
