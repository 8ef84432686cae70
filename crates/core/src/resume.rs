//! Resume after commit (SPEC §13), the pure parts: the delivered [`Transcript`] and
//! replay verification against it, the four prefill dialects and the continuation
//! request they build, token estimates for text whose usage is unknown, and the
//! recognition of a target that refuses prefill.
//!
//! The round state machine ([`crate::round`]) decides *when* a leg resumes; this
//! module says *what* a resume leg sends and whether a replayed answer matches what
//! the caller already has.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{AttemptError, ErrorClass};
use crate::native::NativeRequest;
use crate::ports::{StreamDelta, ToolCallDelta};
use crate::request::{ChatRequest, Message};
use crate::source::{SourceApi, SourceConfig};

/// How a source continues an assistant message it is given (`{S}__{P}__{N}__PREFILL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillDialect {
    /// A plain final assistant message.
    Assistant,
    /// `"prefix": true` on the final assistant message (DeepSeek beta, Mistral).
    Prefix,
    /// `"partial": true` on the final assistant message (Moonshot/Kimi, Qwen/DashScope).
    Partial,
    /// Top-level `continue_final_message: true`, `add_generation_prompt: false` (vLLM).
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

    /// The configuration value.
    pub fn as_str(self) -> &'static str {
        match self {
            PrefillDialect::Assistant => "assistant",
            PrefillDialect::Prefix => "prefix",
            PrefillDialect::Partial => "partial",
            PrefillDialect::Vllm => "vllm",
        }
    }
}

impl fmt::Display for PrefillDialect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PrefillDialect {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        PrefillDialect::ALL
            .into_iter()
            .find(|d| d.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or(())
    }
}

/// `{S}__STREAM__RESUME`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeSetting {
    /// Prefill where the target supports it, else replay.
    #[default]
    Auto,
    /// Prefill only (no replay).
    Prefill,
    /// Never resume.
    Off,
}

impl ResumeSetting {
    /// The configuration value.
    pub fn as_str(self) -> &'static str {
        match self {
            ResumeSetting::Auto => "auto",
            ResumeSetting::Prefill => "prefill",
            ResumeSetting::Off => "off",
        }
    }
}

impl FromStr for ResumeSetting {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        [
            ResumeSetting::Auto,
            ResumeSetting::Prefill,
            ResumeSetting::Off,
        ]
        .into_iter()
        .find(|d| d.as_str().eq_ignore_ascii_case(s.trim()))
        .ok_or(())
    }
}

/// How a resume leg continues (telemetry `resume_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    /// The delivered text is sent as an assistant prefill; the output is the remainder.
    Prefill,
    /// The original request again; the output must reproduce the delivered text.
    Replay,
}

impl ResumeMode {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            ResumeMode::Prefill => "prefill",
            ResumeMode::Replay => "replay",
        }
    }
}

impl fmt::Display for ResumeMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One tool call's text as delivered.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ToolText {
    /// The first non-empty id.
    pub id: Option<String>,
    /// The first non-empty function name.
    pub name: Option<String>,
    /// The concatenated arguments.
    pub arguments: String,
}

/// Text of an answer as a caller sees it: content, reasoning, tool calls by index.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Transcript {
    /// Answer text.
    pub content: String,
    /// Reasoning text (never part of a prefill, never verified).
    pub reasoning: String,
    /// Tool calls by index.
    pub tools: BTreeMap<u32, ToolText>,
    /// Output only a replay can reproduce was delivered: a native event that is
    /// neither text, reasoning nor a call of the client's ([`NativeEvent::opaque`]:
    /// a server tool's call or result, a hosted tool's item).
    ///
    /// [`NativeEvent::opaque`]: crate::native::NativeEvent::opaque
    pub opaque: bool,
}

/// Where a replayed answer stands against the delivered transcript.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayCheck {
    /// Everything so far agrees, but the delivered text is not reproduced yet.
    Behind,
    /// The delivered text is reproduced exactly (the replay may be ahead of it).
    Covered,
    /// The replay contradicts the delivered text (at this char of content, or in a
    /// tool call).
    Diverged,
}

fn prefix_compatible(a: &str, b: &str) -> bool {
    if a.len() <= b.len() {
        b.starts_with(a)
    } else {
        a.starts_with(b)
    }
}

impl Transcript {
    /// Appends one chunk's text.
    pub fn absorb(&mut self, d: &StreamDelta) {
        if let Some(c) = &d.content {
            self.content.push_str(c);
        }
        if let Some(r) = &d.reasoning {
            self.reasoning.push_str(r);
        }
        for t in &d.tool_calls {
            let slot = self.tools.entry(t.index).or_default();
            if slot.id.is_none() {
                slot.id = t.id.clone().filter(|s| !s.is_empty());
            }
            if slot.name.is_none() {
                slot.name = t.name.clone().filter(|s| !s.is_empty());
            }
            slot.arguments.push_str(&t.arguments);
        }
        if d.native.as_ref().is_some_and(|n| n.opaque) {
            self.opaque = true;
        }
    }

    /// Whether a tool call has started.
    pub fn has_tool_call(&self) -> bool {
        !self.tools.is_empty()
    }

    /// Whether a prefill can carry everything delivered: text only (with reasoning,
    /// never part of a prefill) — no tool call, nothing opaque (SPEC §23.6).
    pub fn prefillable(&self) -> bool {
        self.tools.is_empty() && !self.opaque
    }

    /// Whether nothing (content or tool call) has been produced.
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.tools.is_empty()
    }

    /// Characters of content (the `prefix_chars` of a resume).
    pub fn content_chars(&self) -> usize {
        self.content.chars().count()
    }

    /// Checks this transcript (a replay) against `delivered`. Reasoning is ignored;
    /// content must agree char for char; a tool call must agree on its name and its
    /// arguments as a prefix; tool ids may differ (they are generated per response).
    pub fn check_replay(&self, delivered: &Transcript) -> ReplayCheck {
        let (r, d) = (self, delivered);
        if !prefix_compatible(&r.content, &d.content) {
            return ReplayCheck::Diverged;
        }
        // Delivered content that was followed by a tool call is final.
        if r.content.len() > d.content.len() && d.has_tool_call() {
            return ReplayCheck::Diverged;
        }
        if r.has_tool_call() && r.content.len() < d.content.len() {
            return ReplayCheck::Diverged;
        }
        let r_max = r.tools.keys().next_back().copied();
        for (i, rt) in &r.tools {
            match d.tools.get(i) {
                Some(dt) => {
                    if let (Some(a), Some(b)) = (&rt.name, &dt.name) {
                        if a != b {
                            return ReplayCheck::Diverged;
                        }
                    }
                    if !prefix_compatible(&rt.arguments, &dt.arguments) {
                        return ReplayCheck::Diverged;
                    }
                    // The replay moved on to a later call: this one is final there.
                    let moved_on = r_max.is_some_and(|m| m > *i);
                    if moved_on && rt.arguments.len() < dt.arguments.len() {
                        return ReplayCheck::Diverged;
                    }
                }
                None => {
                    // A call the caller never saw: everything delivered must be
                    // reproduced before it, and no delivered call may come after it.
                    if d.tools.keys().any(|k| k > i) {
                        return ReplayCheck::Diverged;
                    }
                    for (k, dt) in &d.tools {
                        match r.tools.get(k) {
                            Some(rt2) if rt2.arguments.len() >= dt.arguments.len() => {}
                            _ => return ReplayCheck::Diverged,
                        }
                    }
                }
            }
        }
        let covered = r.content.len() >= d.content.len()
            && d.tools.iter().all(|(k, dt)| {
                r.tools.get(k).is_some_and(|rt| {
                    rt.arguments.len() >= dt.arguments.len()
                        && (dt.name.is_none() || rt.name == dt.name)
                })
            });
        if covered {
            ReplayCheck::Covered
        } else {
            ReplayCheck::Behind
        }
    }

    /// What a covering replay has beyond `delivered`: the content remainder and the
    /// tool-call fragments the caller has not seen (whole calls keep id and name).
    pub fn excess_over(&self, delivered: &Transcript) -> (Option<String>, Vec<ToolCallDelta>) {
        let content = self
            .content
            .get(delivered.content.len()..)
            .filter(|s| !s.is_empty())
            .map(str::to_string);
        let mut tools = Vec::new();
        for (i, t) in &self.tools {
            match delivered.tools.get(i) {
                Some(dt) => {
                    let rest = t.arguments.get(dt.arguments.len()..).unwrap_or("");
                    if !rest.is_empty() {
                        tools.push(ToolCallDelta {
                            index: *i,
                            id: None,
                            name: None,
                            arguments: rest.to_string(),
                        });
                    }
                }
                None => tools.push(ToolCallDelta {
                    index: *i,
                    id: t.id.clone(),
                    name: t.name.clone(),
                    arguments: t.arguments.clone(),
                }),
            }
        }
        (content, tools)
    }

    /// The char index (in content) where this replay first differs from `delivered`,
    /// for error details.
    pub fn divergence_char(&self, delivered: &Transcript) -> usize {
        self.content
            .chars()
            .zip(delivered.content.chars())
            .take_while(|(a, b)| a == b)
            .count()
    }
}

/// How many leading characters of the delivered prefix a prefill leg may repeat before
/// it counts as having echoed it (SPEC §17.1): 16, or the whole of a shorter prefix.
pub const PREFILL_ECHO_CHARS: usize = 16;

/// What a prefill leg's output is, checked against the prefix it was sent (SPEC §17.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillCheck {
    /// Too little output to tell (it is still the prefix's own start): hold it back.
    Undecided,
    /// A real continuation: the output follows the prefix.
    Continuation,
    /// The target ignored the prefill and reproduced the whole prefix: the leg is a
    /// replay (only what comes after the prefix is new).
    Replay,
    /// The target repeated the prefix's start and then differed: neither a
    /// continuation nor a replay (`resume_diverged`).
    Diverged,
}

impl PrefillCheck {
    /// The target treated the prefill as history (replayed or echoed it).
    pub fn ignores_prefill(self) -> bool {
        matches!(self, PrefillCheck::Replay | PrefillCheck::Diverged)
    }
}

/// Checks a prefill leg's `output` so far against its `prefix` (SPEC §17.1); `ended`:
/// the leg's answer is complete (then never [`PrefillCheck::Undecided`]).
///
/// Let `t` = min([`PREFILL_ECHO_CHARS`], the prefix's chars) and `k` the characters the
/// output's content shares with the prefix's start:
/// - the content starts with the whole prefix → `Replay`;
/// - it differs from the prefix at a char `k < t` → `Continuation` (a continuation
///   may begin like the prefix for a few characters, never for `t`);
/// - it differs at `k ≥ t` → `Diverged`;
/// - it is all the prefix's own start: `Undecided` while it runs (a tool call with no
///   content before it → `Continuation`); at the end, `Continuation` when empty and
///   `Diverged` otherwise (it repeated part of the prefix and stopped).
pub fn check_prefill(prefix: &str, output: &Transcript, ended: bool) -> PrefillCheck {
    let o = output.content.as_str();
    if prefix.is_empty() || (o.is_empty() && (ended || output.has_tool_call())) {
        return PrefillCheck::Continuation;
    }
    if o.starts_with(prefix) {
        return PrefillCheck::Replay;
    }
    let t = prefix.chars().take(PREFILL_ECHO_CHARS).count();
    let mut shared = 0usize;
    let mut ochars = o.chars();
    let mut pchars = prefix.chars();
    loop {
        match (ochars.next(), pchars.next()) {
            (Some(a), Some(b)) if a == b => shared += 1,
            (None, _) => {
                // The output is the prefix's own start so far.
                return if shared >= t {
                    if ended || output.has_tool_call() {
                        PrefillCheck::Diverged
                    } else {
                        PrefillCheck::Undecided
                    }
                } else if ended {
                    PrefillCheck::Diverged
                } else if output.has_tool_call() {
                    PrefillCheck::Continuation
                } else {
                    PrefillCheck::Undecided
                };
            }
            // Differs at `shared` (or the prefix ended: covered by `starts_with`).
            _ => {
                return if shared >= t {
                    PrefillCheck::Diverged
                } else {
                    PrefillCheck::Continuation
                };
            }
        }
    }
}

/// The answer text of a prefill leg: the prefix and its continuation, or, when the
/// target replayed the prefix, its own output; `None` when it diverged.
pub fn prefill_answer(prefix: &str, output: &str) -> Option<String> {
    let t = Transcript {
        content: output.to_string(),
        ..Transcript::default()
    };
    match check_prefill(prefix, &t, true) {
        PrefillCheck::Continuation => Some(format!("{prefix}{output}")),
        PrefillCheck::Replay => Some(output.to_string()),
        PrefillCheck::Undecided | PrefillCheck::Diverged => None,
    }
}

/// The per-call resume budget across rounds (SPEC §13.5, §17.8): `MAX_RESUMES` resume
/// legs in the whole logical call — the primary of each continuation round and the
/// resume legs launched inside rounds alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumeBudget {
    max: u32,
    used: u32,
}

impl ResumeBudget {
    /// A budget of `max` resume legs.
    pub fn new(max: u32) -> Self {
        ResumeBudget { max, used: 0 }
    }

    /// Resume legs used so far.
    pub fn used(&self) -> u32 {
        self.used
    }

    /// Resume legs still allowed.
    pub fn left(&self) -> u32 {
        self.max.saturating_sub(self.used)
    }

    /// A continuation round's primary (a resume leg) is launched: it takes one.
    /// `false` (nothing taken) when none is left.
    pub fn take_primary(&mut self) -> bool {
        if self.left() == 0 {
            return false;
        }
        self.used += 1;
        true
    }

    /// A round ended having launched `resumes` resume legs besides its primary (it
    /// was given [`ResumeBudget::left`] after its primary, and never launches more).
    pub fn on_round(&mut self, resumes: u32) {
        self.used = self.used.saturating_add(resumes);
    }
}

/// A rough token count for text whose usage is unknown (a cut leg's delivered text,
/// a prompt): one token per four bytes, at least one for non-empty text. Used only
/// where the usage is marked `estimated`.
pub fn estimate_tokens(text: &str) -> u64 {
    estimate_bytes(text.len())
}

/// [`estimate_tokens`] of a text of `bytes` bytes.
pub fn estimate_bytes(bytes: usize) -> u64 {
    (bytes as u64).div_ceil(4)
}

/// The estimated prompt tokens of a request (SPEC §24.3: every part of it, images by
/// the providers' formulas; [`crate::estimate::request_tokens`]).
pub fn estimate_prompt_tokens(req: &ChatRequest) -> u64 {
    crate::estimate::request_tokens(req)
}

/// The continuation request of a prefill resume: the original request plus one final
/// assistant message with `prefix` (the delivered content, reasoning excluded) in the
/// target's dialect; `max_tokens` / `max_completion_tokens` reduced by the tokens
/// already delivered (`delivered_tokens`, estimated when unknown), never below 1.
pub fn prefill_request(
    original: &ChatRequest,
    dialect: PrefillDialect,
    prefix: &str,
    delivered_tokens: u64,
) -> ChatRequest {
    let mut req = original.clone();
    req.wire = None;
    let mut msg = Message::assistant(prefix);
    match dialect {
        PrefillDialect::Assistant => {}
        PrefillDialect::Prefix => {
            msg.extra.insert("prefix".into(), Value::Bool(true));
        }
        PrefillDialect::Partial => {
            msg.extra.insert("partial".into(), Value::Bool(true));
        }
        PrefillDialect::Vllm => {
            let o = req.overlay.get_or_insert_with(Map::new);
            o.insert("continue_final_message".into(), Value::Bool(true));
            o.insert("add_generation_prompt".into(), Value::Bool(false));
        }
    }
    req.messages.push(msg);
    let reduce = |n: u64| n.saturating_sub(delivered_tokens).max(1);
    if let Some(m) = req.max_tokens {
        req.max_tokens = Some(reduce(u64::from(m)).min(u64::from(u32::MAX)) as u32);
    }
    if let Some(o) = req.overlay.as_mut() {
        for key in ["max_completion_tokens", "max_tokens"] {
            if let Some(n) = o.get(key).and_then(Value::as_u64) {
                o.insert(key.into(), Value::from(reduce(n)));
            }
        }
    }
    // A Messages body — the client's own (SPEC §23.6) or a translation into Messages
    // (§23.3) — continues the same way: the delivered text as the last assistant turn
    // (Anthropic's prefill).
    let extend = |t: &std::sync::Arc<NativeRequest>| {
        if t.api != SourceApi::Messages {
            return t.clone();
        }
        let mut t = (**t).clone();
        if let Some(Value::Array(messages)) = t.body.get_mut("messages") {
            messages.push(serde_json::json!({"role": "assistant", "content": prefix}));
        }
        if let Some(n) = t.body.get("max_tokens").and_then(Value::as_u64) {
            t.body.insert("max_tokens".into(), Value::from(reduce(n)));
        }
        std::sync::Arc::new(t)
    };
    req.native = req.native.as_ref().map(extend);
    req.translated = req.translated.iter().map(extend).collect();
    req
}

/// Whether a resume of `request` on `source` can continue by prefill as far as the
/// request goes (SPEC §23.6; the source's own `PREFILL` and what it refused are the
/// engine's to add): a chat source always; a `messages` source when thinking is off in
/// the body it is sent — the client's body or its translation, with the source's
/// `EXTRA_BODY` merged on top (Anthropic never takes a prefill with thinking on); a
/// `responses` source never (the API has no assistant prefill).
pub fn prefill_expressible(request: &ChatRequest, source: &SourceConfig) -> bool {
    match source.api {
        SourceApi::Chat => true,
        SourceApi::Responses => false,
        SourceApi::Messages => request.native_for(SourceApi::Messages).is_some_and(|n| {
            // `thinking` as `NativeRequest::body_for` sends it.
            let mut sent = Map::new();
            if let Some(t) = n.body.get("thinking") {
                sent.insert("thinking".into(), t.clone());
            }
            if let Some(t) = source.extra_body.get("thinking") {
                let patch = Map::from_iter([("thinking".to_string(), t.clone())]);
                crate::body::merge_patch(&mut sent, &patch);
            }
            !matches!(
                sent.get("thinking")
                    .and_then(|t| t.get("type"))
                    .and_then(Value::as_str),
                Some("enabled" | "adaptive")
            )
        }),
    }
}

/// Whether a source of `api` takes a prefill that ends in whitespace (SPEC §23.6):
/// Anthropic refuses one ("final assistant content cannot end with trailing
/// whitespace"), so a `messages` source does not.
pub fn prefill_takes_trailing_whitespace(api: SourceApi) -> bool {
    api != SourceApi::Messages
}

/// Whether `prefix` may be sent as a prefill to a source that takes a trailing
/// whitespace or not: a source that does not is resumed by replay when the delivered
/// text ends in whitespace. (Trimming it would leave the continuation to guess whether
/// the whitespace it starts with repeats the trimmed one: text duplicated or lost;
/// DECISIONS 186.)
pub fn prefill_fits(prefix: &str, takes_trailing_whitespace: bool) -> bool {
    takes_trailing_whitespace || !prefix.ends_with(char::is_whitespace)
}

/// Whether `delivered` may be continued by prefill on a source that takes prefill
/// (`capable`: configured, not refused, the request's body can carry one) and takes a
/// trailing whitespace or not: text only ([`Transcript::prefillable`]) whose end suits
/// the source ([`prefill_fits`]). The one rule of the round and the engine.
pub fn prefill_possible(
    capable: bool,
    takes_trailing_whitespace: bool,
    delivered: &Transcript,
) -> bool {
    capable
        && delivered.prefillable()
        && prefill_fits(&delivered.content, takes_trailing_whitespace)
}

/// Whether a failed prefill leg says its target does not support assistant prefill
/// (then the source is marked not prefill-capable for the rest of the process): a
/// rejection whose provider message or code mentions the prefill mechanism.
pub fn is_prefill_unsupported(e: &AttemptError) -> bool {
    if e.class != ErrorClass::Rejected {
        return false;
    }
    let text = format!(
        "{} {} {}",
        e.provider_code.as_deref().unwrap_or(""),
        e.provider_message.as_deref().unwrap_or(""),
        e.detail
    )
    .to_ascii_lowercase();
    let mentions = [
        "prefill",
        "prefix",
        "partial",
        "continue_final_message",
        "assistant message",
        "final message",
        "last message",
    ]
    .iter()
    .any(|k| text.contains(k));
    let refuses = [
        "not support",
        "unsupported",
        "only supported",
        "not allowed",
        "must be",
        "invalid",
        "cannot",
        "can't",
    ]
    .iter()
    .any(|k| text.contains(k));
    mentions && refuses
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorLabel;
    use proptest::prelude::*;

    fn d(content: &str) -> StreamDelta {
        StreamDelta {
            content: Some(content.into()),
            ..Default::default()
        }
    }

    fn tool(index: u32, name: Option<&str>, args: &str) -> StreamDelta {
        StreamDelta {
            tool_calls: vec![ToolCallDelta {
                index,
                id: name.map(|_| format!("call_{index}")),
                name: name.map(str::to_string),
                arguments: args.into(),
            }],
            ..Default::default()
        }
    }

    fn tr(parts: &[StreamDelta]) -> Transcript {
        let mut t = Transcript::default();
        for p in parts {
            t.absorb(p);
        }
        t
    }

    #[test]
    fn settings_are_named_as_configured_and_parse_back() {
        let dialects: Vec<String> = PrefillDialect::ALL.iter().map(|d| d.to_string()).collect();
        assert_eq!(dialects, ["assistant", "prefix", "partial", "vllm"]);
        for d in PrefillDialect::ALL {
            assert_eq!(d.to_string(), d.as_str());
            assert_eq!(format!(" {} ", d.as_str().to_uppercase()).parse(), Ok(d));
        }
        assert_eq!("xyzzy".parse::<PrefillDialect>(), Err(()));
        assert_eq!("".parse::<PrefillDialect>(), Err(()));
        for (s, name) in [
            (ResumeSetting::Auto, "auto"),
            (ResumeSetting::Prefill, "prefill"),
            (ResumeSetting::Off, "off"),
        ] {
            assert_eq!(s.as_str(), name);
            assert_eq!(format!(" {} ", name.to_uppercase()).parse(), Ok(s));
        }
        assert_eq!("".parse::<ResumeSetting>(), Err(()));
        assert_eq!("xyzzy".parse::<ResumeSetting>(), Err(()));
        for (m, name) in [
            (ResumeMode::Prefill, "prefill"),
            (ResumeMode::Replay, "replay"),
        ] {
            assert_eq!((m.as_str(), m.to_string()), (name, name.to_string()));
            // the stored name is the serialized one
            assert_eq!(serde_json::to_value(m).unwrap(), name);
        }
    }

    #[test]
    fn replay_of_content() {
        let delivered = tr(&[d("Hello, "), d("wor")]);
        assert_eq!(
            tr(&[d("Hel")]).check_replay(&delivered),
            ReplayCheck::Behind
        );
        assert_eq!(
            tr(&[d("Hello, wor")]).check_replay(&delivered),
            ReplayCheck::Covered
        );
        let ahead = tr(&[d("Hello, world!")]);
        assert_eq!(ahead.check_replay(&delivered), ReplayCheck::Covered);
        assert_eq!(ahead.excess_over(&delivered).0.as_deref(), Some("ld!"));
        assert_eq!(
            tr(&[d("Hello! ")]).check_replay(&delivered),
            ReplayCheck::Diverged
        );
        assert_eq!(tr(&[d("Hello! ")]).divergence_char(&delivered), 5);
    }

    #[test]
    fn replay_of_tool_calls() {
        let delivered = tr(&[d("ok"), tool(0, Some("f"), "{\"a\":"), tool(0, None, "1")]);
        // Same call, other id: fine.
        let r = tr(&[d("ok"), tool(0, Some("f"), "{\"a\":1")]);
        assert_eq!(r.check_replay(&delivered), ReplayCheck::Covered);
        let r = tr(&[d("ok"), tool(0, Some("f"), "{\"a\":12}")]);
        let (c, t) = r.excess_over(&delivered);
        assert_eq!(c, None);
        assert_eq!(t[0].arguments, "2}");
        assert_eq!(t[0].name, None);
        // Another function, other arguments, more content before the call: diverged.
        for bad in [
            tr(&[d("ok"), tool(0, Some("g"), "{")]),
            tr(&[d("ok"), tool(0, Some("f"), "{\"b\"")]),
            tr(&[d("ok!")]),
            tr(&[d("o"), tool(0, Some("f"), "{")]),
        ] {
            assert_eq!(
                bad.check_replay(&delivered),
                ReplayCheck::Diverged,
                "{bad:?}"
            );
        }
        // A second call before the first is complete: diverged.
        let r = tr(&[d("ok"), tool(0, Some("f"), "{"), tool(1, Some("g"), "{")]);
        assert_eq!(r.check_replay(&delivered), ReplayCheck::Diverged);
        // A second call after the first is reproduced: covered, the new call whole.
        let r = tr(&[
            d("ok"),
            tool(0, Some("f"), "{\"a\":1"),
            tool(1, Some("g"), "{"),
        ]);
        assert_eq!(r.check_replay(&delivered), ReplayCheck::Covered);
        let (_, t) = r.excess_over(&delivered);
        assert_eq!(t.len(), 1);
        assert_eq!(
            (t[0].index, t[0].name.as_deref(), t[0].id.as_deref()),
            (1, Some("g"), Some("call_1"))
        );
    }

    #[test]
    fn prefill_requests_per_dialect() {
        let mut orig = ChatRequest::user("q").with_max_tokens(100);
        orig = orig.with_overlay("max_completion_tokens", Value::from(50u64));
        for dialect in PrefillDialect::ALL {
            let r = prefill_request(&orig, dialect, "Hel", 30);
            let last = r.messages.last().unwrap();
            assert_eq!(last.role, "assistant");
            assert_eq!(last.text(), Some("Hel"));
            assert_eq!(r.max_tokens, Some(70));
            let o = r.overlay.clone().unwrap();
            assert_eq!(o["max_completion_tokens"], 20);
            assert_eq!(
                last.extra.get("prefix").is_some(),
                dialect == PrefillDialect::Prefix
            );
            assert_eq!(
                last.extra.get("partial").is_some(),
                dialect == PrefillDialect::Partial
            );
            assert_eq!(
                o.get("continue_final_message").is_some(),
                dialect == PrefillDialect::Vllm
            );
            if dialect == PrefillDialect::Vllm {
                assert_eq!(o["add_generation_prompt"], false);
            }
        }
        // Never below 1.
        assert_eq!(
            prefill_request(&orig, PrefillDialect::Prefix, "x", 1000).max_tokens,
            Some(1)
        );
    }

    fn messages_body(thinking: Option<&str>) -> ChatRequest {
        let mut body = serde_json::json!({"model": "claude", "max_tokens": 100,
            "messages": [{"role": "user", "content": "q"}]});
        if let Some(kind) = thinking {
            body["thinking"] = serde_json::json!({"type": kind, "budget_tokens": 1024});
        }
        let mut req = ChatRequest::user("q");
        req.native = Some(std::sync::Arc::new(NativeRequest {
            api: SourceApi::Messages,
            body: body.as_object().cloned().unwrap_or_default(),
            headers: Vec::new(),
            query: None,
        }));
        req
    }

    /// SPEC §23.6: a Messages client's own body continues by prefill like a
    /// translation into Messages: the delivered text as its last assistant turn,
    /// `max_tokens` reduced; the chat form is extended too (chat sources).
    #[test]
    fn a_native_messages_body_takes_the_prefill() {
        let r = prefill_request(&messages_body(None), PrefillDialect::Assistant, "Hel", 30);
        let n = r.native.as_deref().unwrap();
        let messages = n.body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 2);
        assert_eq!(
            messages[1],
            serde_json::json!({"role": "assistant", "content": "Hel"})
        );
        assert_eq!(n.body["max_tokens"], 70);
        assert_eq!(r.messages.last().unwrap().text(), Some("Hel"));
    }

    /// SPEC §23.6: prefill on a `messages` source only with thinking off, never on a
    /// `responses` source, always on a chat source; never ending in whitespace where
    /// Anthropic refuses it.
    #[test]
    fn prefill_is_expressible_only_where_the_source_takes_it() {
        let at = |api| SourceConfig::new("p", 0, "http://x", "k", "m").with_api(api);
        let m = at(SourceApi::Messages);
        assert!(prefill_expressible(&messages_body(None), &m));
        assert!(prefill_expressible(&messages_body(Some("disabled")), &m));
        assert!(!prefill_expressible(&messages_body(Some("enabled")), &m));
        assert!(!prefill_expressible(&messages_body(Some("adaptive")), &m));
        // Thinking turned on (or off) by the source's `EXTRA_BODY`, merged on top.
        let mut on = m.clone();
        on.extra_body.insert(
            "thinking".into(),
            serde_json::json!({"type": "enabled", "budget_tokens": 2048}),
        );
        assert!(!prefill_expressible(&messages_body(None), &on));
        let mut off = m.clone();
        off.extra_body
            .insert("thinking".into(), serde_json::json!({"type": "disabled"}));
        assert!(prefill_expressible(&messages_body(Some("enabled")), &off));
        let mut removed = m.clone();
        removed.extra_body.insert("thinking".into(), Value::Null);
        assert!(prefill_expressible(
            &messages_body(Some("enabled")),
            &removed
        ));
        // No body in Messages (no translation): nothing to continue.
        assert!(!prefill_expressible(&ChatRequest::user("q"), &m));
        assert!(!prefill_expressible(
            &messages_body(None),
            &at(SourceApi::Responses)
        ));
        assert!(prefill_expressible(
            &messages_body(None),
            &at(SourceApi::Chat)
        ));
        let ws = prefill_takes_trailing_whitespace(SourceApi::Messages);
        assert!(!ws);
        assert!(prefill_fits("Hello", ws));
        for tail in ["Hello ", "Hello\n\n", "Hello\t", "Hello\u{a0}"] {
            assert!(!prefill_fits(tail, ws), "{tail:?}");
        }
        assert!(prefill_fits(
            "Hello\n",
            prefill_takes_trailing_whitespace(SourceApi::Chat)
        ));
    }

    #[test]
    fn prefill_rejections_are_recognized() {
        let rej = |msg: &str| {
            AttemptError::new(ErrorClass::Rejected, ErrorLabel::Rejected, "HTTP 400")
                .with_provider(Some("invalid_request_error".into()), Some(msg.into()))
        };
        assert!(is_prefill_unsupported(&rej(
            "This model does not support assistant message prefill."
        )));
        assert!(is_prefill_unsupported(&rej(
            "Prefix completion is only supported in the beta API"
        )));
        assert!(is_prefill_unsupported(&rej(
            "The last message must be a user message"
        )));
        assert!(!is_prefill_unsupported(&rej(
            "This model's maximum context length is 8192 tokens"
        )));
        let server = AttemptError::new(
            ErrorClass::Transient,
            ErrorLabel::ServerError,
            "prefix not supported",
        );
        assert!(!is_prefill_unsupported(&server));
    }

    #[test]
    fn prefill_output_is_verified_against_its_prefix() {
        use PrefillCheck::*;
        let long = "Mock response from the mock, long enough";
        let out = |s: &str| tr(&[d(s)]);
        let table: &[(&str, &str, bool, PrefillCheck)] = &[
            // A real continuation.
            ("Hello wor", "ld!", false, Continuation),
            ("Hello wor", "ld!", true, Continuation),
            // The whole prefix again (a target that takes it as history): a replay.
            ("Hello wor", "Hello world!", false, Replay),
            ("Hello wor", "Hello wor", true, Replay),
            (
                long,
                "Mock response from the mock, long enough and more",
                false,
                Replay,
            ),
            // Still the prefix's own start: wait.
            ("Hello wor", "Hel", false, Undecided),
            (long, "Mock response from the", false, Undecided),
            ("Hello wor", "", false, Undecided),
            // 16 characters repeated, then something else: diverged.
            (long, "Mock response from another", false, Diverged),
            (long, "Mock response from the", true, Diverged),
            // Fewer than 16 shared before it differs: a continuation that begins like
            // the prefix.
            (long, "Mock, continued", false, Continuation),
            // A short prefix counts whole: repeated whole is a replay.
            ("Hi", "Hi there", false, Replay),
            ("Hi", "H", false, Undecided),
            ("Hi", "H", true, Diverged),
            ("Hi", "!", false, Continuation),
            // Nothing at the end: an empty continuation.
            ("Hello", "", true, Continuation),
            ("", "anything", false, Continuation),
        ];
        for (prefix, o, ended, want) in table {
            assert_eq!(
                check_prefill(prefix, &out(o), *ended),
                *want,
                "{prefix:?} / {o:?} / ended {ended}"
            );
        }
        // A tool call with no content before it continues; after an echo it diverged.
        assert_eq!(
            check_prefill("Let me check", &tr(&[tool(0, Some("f"), "{")]), false),
            Continuation
        );
        assert_eq!(
            check_prefill(
                long,
                &tr(&[d("Mock response from the"), tool(0, Some("f"), "{")]),
                false
            ),
            Diverged
        );
        assert_eq!(
            prefill_answer("Hello wor", "ld!").as_deref(),
            Some("Hello world!")
        );
        assert_eq!(
            prefill_answer("Hello wor", "Hello world!").as_deref(),
            Some("Hello world!")
        );
        assert_eq!(prefill_answer(long, "Mock response from another"), None);
        assert!(Replay.ignores_prefill() && Diverged.ignores_prefill());
        assert!(!Continuation.ignores_prefill() && !Undecided.ignores_prefill());
    }

    #[test]
    fn the_resume_budget_holds_across_rounds() {
        let mut b = ResumeBudget::new(2);
        assert_eq!(b.left(), 2);
        assert!(b.take_primary());
        assert_eq!(b.left(), 1, "the round gets what is left after its primary");
        b.on_round(1);
        assert_eq!((b.used(), b.left()), (2, 0));
        assert!(!b.take_primary(), "a third resume is refused");
        assert_eq!(b.used(), 2);
        let mut z = ResumeBudget::new(0);
        assert!(!z.take_primary());
        assert_eq!(z.left(), 0);
    }

    proptest! {
        /// However rounds spend their share, the call never uses more than its budget,
        /// as long as each round launches at most the `left()` it was given.
        #[test]
        fn resume_budget_never_overspends(
            max in 0u32..5,
            rounds in proptest::collection::vec((any::<bool>(), 0u32..4), 0..8),
        ) {
            let mut b = ResumeBudget::new(max);
            for (continuation, want) in rounds {
                if continuation && !b.take_primary() {
                    continue;
                }
                let inside = want.min(b.left());
                b.on_round(inside);
                prop_assert!(b.used() <= max);
            }
        }
    }

    #[test]
    fn estimates() {
        assert_eq!(estimate_tokens(""), 0);
        assert_eq!(estimate_tokens("a"), 1);
        assert_eq!(estimate_tokens("abcdefgh"), 2);
        assert!(estimate_prompt_tokens(&ChatRequest::user("hello world")) >= 3);
    }

    fn chunks_of(s: &str, cuts: &[usize]) -> Vec<String> {
        let chars: Vec<char> = s.chars().collect();
        let mut out = Vec::new();
        let mut at = 0;
        for c in cuts {
            let end = (at + c).min(chars.len());
            out.push(chars[at..end].iter().collect());
            at = end;
        }
        out.push(chars[at..].iter().collect());
        out
    }

    proptest! {
        /// A replay of the same answer, split differently, is Behind then Covered, and
        /// delivered + excess is the replay's text; a replay that differs at some char
        /// is Diverged as soon as it passes that char.
        #[test]
        fn replay_agrees_with_prefixes(
            answer in "[a-cé😀 ]{1,30}",
            delivered_chars in 0usize..30,
            cuts in proptest::collection::vec(1usize..5, 0..10),
            flip in proptest::option::of(0usize..30),
        ) {
            let chars: Vec<char> = answer.chars().collect();
            let k = delivered_chars.min(chars.len());
            let delivered = tr(&[d(&chars[..k].iter().collect::<String>())]);
            let mut replay_text: Vec<char> = chars.clone();
            let flipped = flip.filter(|f| *f < replay_text.len());
            if let Some(f) = flipped {
                replay_text[f] = if replay_text[f] == 'z' { 'y' } else { 'z' };
            }
            let replay: String = replay_text.iter().collect();
            let mut r = Transcript::default();
            let mut seen_chars = 0usize;
            for piece in chunks_of(&replay, &cuts) {
                seen_chars += piece.chars().count();
                r.absorb(&d(&piece));
                let check = r.check_replay(&delivered);
                match flipped {
                    Some(f) if f < k && seen_chars > f => prop_assert_eq!(check, ReplayCheck::Diverged),
                    _ if seen_chars >= k => {
                        prop_assert_eq!(check, ReplayCheck::Covered);
                        let (excess, _) = r.excess_over(&delivered);
                        let joined = format!("{}{}", delivered.content, excess.unwrap_or_default());
                        prop_assert_eq!(joined, r.content.clone());
                    }
                    _ => prop_assert_eq!(check, ReplayCheck::Behind),
                }
            }
        }
    }
}
