//! Assistant prefill (SPEC §13.2, §13.7): detecting a request that asks the model to
//! continue a final assistant message (dialects `assistant`, `prefix`, `partial`,
//! `vllm`), the [`PrefillPolicy`] saying which dialects a mock honours and what it does
//! with the others (continue, reject with a 400 like real providers, or ignore), and
//! [`continue_from`], which cuts a planned answer at the delivered prefix.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// How a request marks its final assistant message as a prefix to continue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillDialect {
    /// A plain final `{"role":"assistant","content":…}` message.
    Assistant,
    /// `"prefix": true` on the final assistant message (DeepSeek beta, Mistral).
    Prefix,
    /// `"partial": true` on the final assistant message (Moonshot/Kimi, Qwen/DashScope).
    Partial,
    /// A plain final assistant message plus top-level `"continue_final_message": true`
    /// and `"add_generation_prompt": false` (vLLM).
    Vllm,
}

impl PrefillDialect {
    /// Every dialect.
    pub const ALL: [PrefillDialect; 4] = [
        PrefillDialect::Assistant,
        PrefillDialect::Prefix,
        PrefillDialect::Partial,
        PrefillDialect::Vllm,
    ];

    /// Its name in JSON (`assistant`, `prefix`, `partial`, `vllm`).
    pub fn as_str(self) -> &'static str {
        match self {
            PrefillDialect::Assistant => "assistant",
            PrefillDialect::Prefix => "prefix",
            PrefillDialect::Partial => "partial",
            PrefillDialect::Vllm => "vllm",
        }
    }

    /// `error.message` of the 400 a mock that does not support this dialect answers,
    /// modelled on what real providers say.
    pub fn rejection_message(self) -> &'static str {
        match self {
            // Anthropic (and Anthropic-compatible gateways) for models without prefill.
            PrefillDialect::Assistant => {
                "This model does not support assistant message prefill. \
                 The conversation must end with a user message."
            }
            // DeepSeek outside its beta endpoint.
            PrefillDialect::Prefix => {
                "Prefix completion (`prefix: true` on the last assistant message) is not \
                 supported here: it is only supported in the beta API (base_url \
                 https://api.deepseek.com/beta)."
            }
            // Moonshot / DashScope models without partial mode.
            PrefillDialect::Partial => {
                "Partial mode (`partial: true` on the last assistant message) is not \
                 supported by this model."
            }
            // A server without vLLM's chat-template continuation.
            PrefillDialect::Vllm => {
                "continue_final_message is not supported by this server: the final \
                 assistant message cannot be continued."
            }
        }
    }
}

impl std::fmt::Display for PrefillDialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// vLLM's own 400 for `continue_final_message` together with an explicit
/// `add_generation_prompt: true`.
pub const VLLM_CONFLICT_MESSAGE: &str =
    "Cannot set both `continue_final_message` and `add_generation_prompt` to True.";

/// What a mock does with prefill requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillMode {
    /// Honour the dialects of [`PrefillPolicy::dialects`] (default: all four) and reject
    /// the others.
    #[default]
    Accept,
    /// Reject every prefill not in an explicit [`PrefillPolicy::dialects`] list (by
    /// default, every prefill) with a 400.
    Reject,
    /// Treat every prefill not in an explicit [`PrefillPolicy::dialects`] list (by
    /// default, every prefill) as ordinary history and answer from scratch: a provider
    /// that silently does not support it.
    Ignore,
}

/// Which prefill dialects a mock honours, and the fate of the others.
///
/// The honoured set is `dialects` when given, else all four under
/// [`PrefillMode::Accept`] and none otherwise. A request in a dialect outside it is
/// rejected (`accept`, `reject`) or ignored (`ignore`). A final assistant message without
/// any marker counts as an `assistant`-dialect prefill unless `dialects` is given and
/// leaves `assistant` out: then it is plain history.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefillPolicy {
    /// The fate of prefills outside the honoured set (and the default honoured set).
    pub mode: PrefillMode,
    /// The honoured dialects (None = per `mode`).
    pub dialects: Option<Vec<PrefillDialect>>,
}

impl PrefillPolicy {
    /// Every dialect honoured (the default).
    pub fn accept_all() -> Self {
        PrefillPolicy::default()
    }

    /// Only these dialects honoured; the others are rejected.
    pub fn only(dialects: &[PrefillDialect]) -> Self {
        PrefillPolicy {
            mode: PrefillMode::Accept,
            dialects: Some(dialects.to_vec()),
        }
    }

    /// Every prefill rejected with a 400.
    pub fn reject() -> Self {
        PrefillPolicy {
            mode: PrefillMode::Reject,
            dialects: None,
        }
    }

    /// Every prefill treated as ordinary history.
    pub fn ignore() -> Self {
        PrefillPolicy {
            mode: PrefillMode::Ignore,
            dialects: None,
        }
    }

    /// Whether `dialect` is continued.
    pub fn honours(&self, dialect: PrefillDialect) -> bool {
        match &self.dialects {
            Some(d) => d.contains(&dialect),
            None => self.mode == PrefillMode::Accept,
        }
    }

    /// Whether a final assistant message without markers counts as a prefill.
    fn plain_assistant_is_prefill(&self) -> bool {
        self.dialects.is_none() || self.honours(PrefillDialect::Assistant)
    }
}

/// What happened to a prefill request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillOutcome {
    /// The planned answer was continued from the prefix.
    Continued,
    /// A 400 was answered.
    Rejected,
    /// The final assistant message was treated as history; the answer started afresh.
    Ignored,
}

/// A prefill request as the mock saw it (the request log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillSeen {
    /// The dialect detected.
    pub dialect: PrefillDialect,
    /// Characters (Unicode scalar values, not bytes) of the prefix.
    pub prefix_chars: usize,
    /// Whether the planned answer started with the prefix (only when continued; a
    /// mismatch sends the whole planned content as the continuation).
    pub matched: bool,
    /// Continued, rejected or ignored.
    pub outcome: PrefillOutcome,
}

/// A detected prefill: its dialect and the prefix text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Prefill {
    pub(crate) dialect: PrefillDialect,
    pub(crate) prefix: String,
}

/// What to do with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// No prefill: answer as usual.
    None,
    /// Continue the planned answer from the prefix.
    Continue(Prefill),
    /// Answer from scratch.
    Ignore(Prefill),
    /// Answer a 400 with this message.
    Reject(Prefill, &'static str),
}

/// The text of a message content: a string, or the concatenated text parts.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// The prefill a request carries, if any, under `policy` (which decides whether a
/// marker-less final assistant message is one). Only the last message is looked at;
/// markers win in the order `prefix`, `partial`, `vllm`.
pub(crate) fn detect(body: &Value, policy: &PrefillPolicy) -> Option<Prefill> {
    let last = body.get("messages")?.as_array()?.last()?;
    if last.get("role").and_then(Value::as_str) != Some("assistant") {
        return None;
    }
    let flag = |v: Option<&Value>| v.and_then(Value::as_bool) == Some(true);
    let dialect = if flag(last.get("prefix")) {
        PrefillDialect::Prefix
    } else if flag(last.get("partial")) {
        PrefillDialect::Partial
    } else if flag(body.get("continue_final_message")) {
        PrefillDialect::Vllm
    } else if policy.plain_assistant_is_prefill() {
        PrefillDialect::Assistant
    } else {
        return None;
    };
    Some(Prefill {
        dialect,
        prefix: content_text(last.get("content")),
    })
}

/// What `policy` does with `body`.
pub(crate) fn decide(body: &Value, policy: &PrefillPolicy) -> Decision {
    let Some(p) = detect(body, policy) else {
        return Decision::None;
    };
    if policy.honours(p.dialect) {
        let conflict = p.dialect == PrefillDialect::Vllm
            && body.get("add_generation_prompt").and_then(Value::as_bool) == Some(true);
        if conflict {
            return Decision::Reject(p, VLLM_CONFLICT_MESSAGE);
        }
        return Decision::Continue(p);
    }
    match policy.mode {
        PrefillMode::Ignore => Decision::Ignore(p),
        PrefillMode::Accept | PrefillMode::Reject => {
            let m = p.dialect.rejection_message();
            Decision::Reject(p, m)
        }
    }
}

/// Anthropic's 400 for a prefill that ends in whitespace (SPEC §23.6).
pub const TRAILING_WHITESPACE_MESSAGE: &str =
    "messages: final assistant content cannot end with trailing whitespace";

/// The mock's 400 for a prefill sent with thinking on. Anthropic documents that prefill
/// is never allowed while thinking is on; the wording is the mock's own.
pub const THINKING_PREFILL_MESSAGE: &str =
    "messages: a final `assistant` message (prefill) is not allowed when `thinking` is enabled";

/// What Anthropic's Messages API refuses of a prefill it would otherwise continue: one
/// that ends in whitespace, or one sent with thinking on.
pub(crate) fn messages_refusal(body: &Value, p: &Prefill) -> Option<&'static str> {
    let thinking = body
        .get("thinking")
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str);
    if matches!(thinking, Some("enabled" | "adaptive")) {
        return Some(THINKING_PREFILL_MESSAGE);
    }
    p.prefix
        .ends_with(char::is_whitespace)
        .then_some(TRAILING_WHITESPACE_MESSAGE)
}

/// The continuation of `planned` (content chunks, in order) after `prefix`: `Some` when
/// the concatenated planned content starts with `prefix`, holding exactly the remainder
/// — the chunk the prefix ends in is cut there (mid-chunk, even mid-word; never inside a
/// UTF-8 character, since the prefix is itself valid UTF-8), the later chunks are kept as
/// planned (empty ones included). `None` when the planned content does not start with
/// `prefix`.
///
/// For every char-boundary prefix `p` of `planned.concat()`,
/// `p + continue_from(planned, p).concat() == planned.concat()`.
pub fn continue_from(planned: &[String], prefix: &str) -> Option<Vec<String>> {
    let cut = prefix.len();
    let mut rest = Vec::new();
    let mut start = 0usize;
    let mut matched = 0usize;
    for c in planned {
        let end = start + c.len();
        if start >= cut {
            rest.push(c.clone());
        } else {
            // This chunk overlaps the prefix: its head must equal the prefix's bytes.
            let upto = end.min(cut);
            if c.as_bytes()[..upto - start] != prefix.as_bytes()[start..upto] {
                return None;
            }
            matched = upto;
            if end > cut {
                // `cut` is a char boundary of the planned content: the matched bytes
                // end a complete UTF-8 sequence of the (valid) prefix.
                rest.push(c[cut - start..].to_string());
            }
        }
        start = end;
    }
    (matched == cut).then_some(rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn messages_refuses_a_prefill_ending_in_whitespace_or_under_thinking() {
        let p = |prefix: &str| Prefill {
            dialect: PrefillDialect::Assistant,
            prefix: prefix.into(),
        };
        let plain = json!({"messages": []});
        assert_eq!(messages_refusal(&plain, &p("Hello")), None);
        for ws in ["Hello ", "Hello\n", "Hello\t"] {
            assert_eq!(
                messages_refusal(&plain, &p(ws)),
                Some(TRAILING_WHITESPACE_MESSAGE),
                "{ws:?}"
            );
        }
        for kind in ["enabled", "adaptive"] {
            let thinking = json!({"thinking": {"type": kind}});
            assert_eq!(
                messages_refusal(&thinking, &p("Hello")),
                Some(THINKING_PREFILL_MESSAGE)
            );
        }
        let off = json!({"thinking": {"type": "disabled"}});
        assert_eq!(messages_refusal(&off, &p("Hello")), None);
    }

    #[test]
    fn continues_mid_chunk_and_mid_word() {
        let planned = s(&["Héllo", " wörld", "", " ✓ok"]);
        assert_eq!(
            continue_from(&planned, "Hé").unwrap(),
            s(&["llo", " wörld", "", " ✓ok"])
        );
        assert_eq!(
            continue_from(&planned, "Héllo").unwrap(),
            s(&[" wörld", "", " ✓ok"])
        );
        assert_eq!(
            continue_from(&planned, "Héllo wö").unwrap(),
            s(&["rld", "", " ✓ok"])
        );
        assert_eq!(continue_from(&planned, "").unwrap(), planned);
        assert_eq!(
            continue_from(&planned, "Héllo wörld ✓ok").unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(continue_from(&planned, "Hello"), None);
        assert_eq!(continue_from(&planned, "Héllo wörld ✓ok!"), None);
        assert_eq!(continue_from(&[], "x"), None);
    }

    fn body(last: Value, extra: Value) -> Value {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}, last]});
        if let Value::Object(m) = extra {
            for (k, v) in m {
                b[k] = v;
            }
        }
        b
    }

    #[test]
    fn detection_per_dialect() {
        let all = PrefillPolicy::accept_all();
        let d = |b: &Value, p: &PrefillPolicy| detect(b, p).map(|x| (x.dialect, x.prefix));
        let plain = body(json!({"role": "assistant", "content": "Ab"}), json!({}));
        assert_eq!(
            d(&plain, &all),
            Some((PrefillDialect::Assistant, "Ab".into()))
        );
        let prefix = body(
            json!({"role": "assistant", "content": "Ab", "prefix": true}),
            json!({}),
        );
        assert_eq!(d(&prefix, &all).unwrap().0, PrefillDialect::Prefix);
        let partial = body(
            json!({"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "b"}], "partial": true}),
            json!({}),
        );
        assert_eq!(
            d(&partial, &all),
            Some((PrefillDialect::Partial, "Ab".into()))
        );
        let vllm = body(
            json!({"role": "assistant", "content": "Ab"}),
            json!({"continue_final_message": true, "add_generation_prompt": false}),
        );
        assert_eq!(d(&vllm, &all).unwrap().0, PrefillDialect::Vllm);
        // Not last, or not assistant: no prefill.
        let user_last = json!({"messages": [{"role": "assistant", "content": "x", "prefix": true}, {"role": "user", "content": "y"}]});
        assert_eq!(d(&user_last, &all), None);
        assert_eq!(d(&json!({}), &all), None);
        // A plain final assistant message is history when the dialects are listed
        // without `assistant`, a prefill otherwise.
        let only_prefix = PrefillPolicy::only(&[PrefillDialect::Prefix]);
        assert_eq!(d(&plain, &only_prefix), None);
        assert_eq!(d(&prefix, &only_prefix).unwrap().0, PrefillDialect::Prefix);
        assert_eq!(
            d(&plain, &PrefillPolicy::reject()).unwrap().0,
            PrefillDialect::Assistant
        );
    }

    #[test]
    fn decisions() {
        let plain = body(json!({"role": "assistant", "content": "Ab"}), json!({}));
        let partial = body(
            json!({"role": "assistant", "content": "Ab", "partial": true}),
            json!({}),
        );
        let kind = |d: Decision| match d {
            Decision::None => "none",
            Decision::Continue(_) => "continue",
            Decision::Ignore(_) => "ignore",
            Decision::Reject(..) => "reject",
        };
        let only = PrefillPolicy::only(&[PrefillDialect::Prefix]);
        assert_eq!(
            kind(decide(&partial, &PrefillPolicy::default())),
            "continue"
        );
        assert_eq!(kind(decide(&partial, &only)), "reject");
        assert_eq!(kind(decide(&plain, &only)), "none");
        assert_eq!(kind(decide(&partial, &PrefillPolicy::reject())), "reject");
        assert_eq!(kind(decide(&plain, &PrefillPolicy::ignore())), "ignore");
        let ignore_but_prefix = PrefillPolicy {
            mode: PrefillMode::Ignore,
            dialects: Some(vec![PrefillDialect::Prefix]),
        };
        assert_eq!(kind(decide(&partial, &ignore_but_prefix)), "ignore");
        match decide(&partial, &only) {
            Decision::Reject(p, m) => {
                assert_eq!(p.dialect, PrefillDialect::Partial);
                assert!(m.contains("not supported"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        let conflict = body(
            json!({"role": "assistant", "content": "Ab"}),
            json!({"continue_final_message": true, "add_generation_prompt": true}),
        );
        assert_eq!(
            decide(&conflict, &PrefillPolicy::default()),
            Decision::Reject(
                Prefill {
                    dialect: PrefillDialect::Vllm,
                    prefix: "Ab".into()
                },
                VLLM_CONFLICT_MESSAGE
            )
        );
        let p: PrefillPolicy =
            serde_json::from_value(json!({"mode": "ignore", "dialects": ["vllm"]})).unwrap();
        assert!(p.honours(PrefillDialect::Vllm) && !p.honours(PrefillDialect::Prefix));
    }

    fn chunks() -> impl Strategy<Value = Vec<String>> {
        prop::collection::vec("[a-zé✓🦀 ]{0,6}", 0..8)
    }

    proptest! {
        #[test]
        fn prefix_plus_continuation_is_the_planned_content(
            planned in chunks(),
            frac in 0.0f64..=1.0,
        ) {
            let all = planned.concat();
            let n = all.chars().count();
            let k = ((n as f64) * frac).round() as usize;
            let prefix: String = all.chars().take(k).collect();
            let rest = continue_from(&planned, &prefix).expect("a prefix of the plan");
            prop_assert_eq!(format!("{prefix}{}", rest.concat()), all);
            // At most one chunk is cut; the later ones are kept as planned.
            prop_assert!(rest.len() <= planned.len());
            let tail = &planned[planned.len() - rest.len()..];
            if rest.len() > 1 {
                prop_assert_eq!(&rest[1..], &tail[1..]);
            }
            if let Some(first) = rest.first() {
                prop_assert!(tail[0].ends_with(first.as_str()));
            }
        }

        #[test]
        fn a_non_prefix_does_not_match(planned in chunks(), other in "[a-zé✓🦀 ]{1,12}") {
            let all = planned.concat();
            prop_assume!(!all.starts_with(other.as_str()));
            prop_assert_eq!(continue_from(&planned, &other), None);
        }
    }
}
