//! The pure stream aggregator: folds parsed `chat.completion.chunk` frames (and plain
//! `chat.completion` messages) into one answer, following the rules of the recorded
//! fixtures' `derive_expected.py` (SPEC §5):
//!
//! - only choice 0 counts (a choice's `index`, or its position when it has none);
//! - `content` concatenates `delta.content` strings, and the text of Mistral's typed
//!   `{"type":"text"}` parts; `reasoning` concatenates `reasoning_content`, then
//!   `reasoning`, and the text of `{"type":"thinking"}` parts;
//! - tool calls are assembled by their `index` (else their position in the delta's
//!   array); id and name are the first non-empty values, arguments are concatenated;
//! - `finish_reason` is the last non-null value;
//! - usage is the last non-null usage object, top-level `usage` or `choices[0].usage`
//!   (within one frame the top-level one wins);
//! - a frame is *incremental* when choice 0's delta carries non-empty content, reasoning,
//!   or a tool call with a non-empty name or arguments.
//!
//! Nothing here allocates per frame unless the caller asks for a [`StreamDelta`].
//!
//! Frames come in two ways: [`StreamAggregator::feed_typed`] takes the frame's JSON text
//! and parses the common shape (string fields, no usage, no error) into borrowed typed
//! structs — no `serde_json::Value` tree, the strings without escapes not copied; it
//! declines anything else, untouched, and the caller then parses a `Value` and calls
//! [`StreamAggregator::feed`], the general path. Both give the same result for every
//! frame the typed path accepts (property-tested, and on every recorded fixture).

use std::collections::BTreeMap;

use polygw_core::ports::{RawText, StreamDelta, ToolCallDelta};
use polygw_core::{ToolCall, Usage};
use serde_json::{Map, Value};

/// Where the final usage object was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageLocation {
    /// The frame's top-level `usage`.
    TopLevel,
    /// `choices[0].usage` (Moonshot).
    Choice,
}

impl UsageLocation {
    /// The name used by the fixtures' `expected.json`.
    pub fn as_str(self) -> &'static str {
        match self {
            UsageLocation::TopLevel => "top-level",
            UsageLocation::Choice => "choice",
        }
    }
}

/// What one frame contributed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FrameOutcome {
    /// The frame carried new content, reasoning or tool-call text.
    pub incremental: bool,
    /// The normalized chunk, when asked for.
    pub delta: Option<StreamDelta>,
}

/// The aggregate of a stream (or of a plain message).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Aggregate {
    /// Answer text.
    pub content: String,
    /// Reasoning text (empty when none).
    pub reasoning: String,
    /// Tool calls sorted by index.
    pub tool_calls: Vec<ToolCall>,
    /// Last non-null finish_reason.
    pub finish_reason: Option<String>,
    /// Last non-null usage.
    pub usage: Option<Usage>,
    /// Where that usage was.
    pub usage_location: Option<UsageLocation>,
    /// The first non-empty top-level `model`.
    pub model: Option<String>,
    /// Incremental frames seen.
    pub incremental_chunks: u32,
    /// Frames fed.
    pub frames: u32,
    /// Some `delta.content` was an array of typed parts.
    pub content_parts_array: bool,
}

impl Aggregate {
    /// Whether anything was generated: content, reasoning or a tool call.
    pub fn generated_anything(&self) -> bool {
        !self.content.is_empty() || !self.reasoning.is_empty() || !self.tool_calls.is_empty()
    }
}

#[derive(Debug, Clone, Default)]
struct ToolSlot {
    id: Option<String>,
    name: Option<String>,
    arguments: String,
}

/// Folds frames one at a time.
#[derive(Debug, Clone, Default)]
pub struct StreamAggregator {
    content: String,
    reasoning: String,
    tools: BTreeMap<u32, ToolSlot>,
    args_bytes: usize,
    finish_reason: Option<String>,
    usage: Option<Usage>,
    usage_location: Option<UsageLocation>,
    model: Option<String>,
    incremental_chunks: u32,
    frames: u32,
    content_parts_array: bool,
}

/// Choice 0 of a frame or completion: the choice whose `index` is 0, or, for a choice
/// without `index`, the one at position 0.
pub fn choice0(obj: &Map<String, Value>) -> Option<&Map<String, Value>> {
    let choices = obj.get("choices")?.as_array()?;
    choices.iter().enumerate().find_map(|(pos, c)| {
        let c = c.as_object()?;
        let is0 = match c.get("index") {
            None => pos == 0,
            Some(v) => v.as_u64() == Some(0) || v.as_f64() == Some(0.0),
        };
        is0.then_some(c)
    })
}

/// The largest token count read from an upstream (2^53 − 1: exact in every JSON
/// client). A larger figure is clamped to it (SPEC §17.6: no wrap reachable from input).
pub const MAX_TOKENS: u64 = (1 << 53) - 1;

fn tokens(v: Option<&Value>) -> Option<u64> {
    let v = v?;
    v.as_u64()
        .or_else(|| {
            v.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0)
                .map(|f| f as u64)
        })
        .map(|n| n.min(MAX_TOKENS))
}

/// Parses an OpenAI usage object (`prompt_tokens`, `completion_tokens`,
/// `completion_tokens_details.reasoning_tokens`); null or missing counts are 0, a
/// missing reasoning count is `None`.
///
/// Prompt-cache figures (SPEC §20.1), the first one present:
/// `prompt_tokens_details.cached_tokens` (OpenAI, DashScope/Qwen, vLLM, xAI),
/// `prompt_cache_hit_tokens` (DeepSeek), `cache_read_input_tokens` (Anthropic-style),
/// a top-level `cached_tokens` (Moonshot); cache writes from
/// `cache_creation_input_tokens`. They are part of `prompt_tokens`, as OpenAI counts
/// them; a source whose `total_tokens` counts Anthropic-style fields apart from its
/// `prompt_tokens` (Anthropic's own convention) — or, without a total, reports them
/// larger than it — has them added to it. Cached
/// figures are clamped to the prompt (docs/DECISIONS.md).
///
/// Reasoning tokens are part of `completion_tokens`, as OpenAI counts them. A source
/// that reports them outside it — xAI: `total_tokens = prompt + completion + reasoning`
/// — has them added to it, so `completion_tokens` is always every output token billed
/// (docs/DECISIONS.md); so is a reasoning count larger than the completion, which cannot
/// be part of it.
pub fn parse_usage(u: &Map<String, Value>) -> Usage {
    let reported_prompt = tokens(u.get("prompt_tokens")).unwrap_or(0);
    let mut prompt = reported_prompt;
    let details = u.get("prompt_tokens_details").and_then(Value::as_object);
    let anthropic_read = tokens(u.get("cache_read_input_tokens"));
    let write = tokens(u.get("cache_creation_input_tokens"));
    let cached = details
        .and_then(|d| tokens(d.get("cached_tokens")))
        .or_else(|| tokens(u.get("prompt_cache_hit_tokens")))
        .or(anthropic_read)
        .or_else(|| tokens(u.get("cached_tokens")));
    let anthropic = anthropic_read
        .unwrap_or(0)
        .saturating_add(write.unwrap_or(0));
    // Whether Anthropic-style cache figures are counted apart from `prompt_tokens`
    // (Anthropic's convention) or inside it (the OpenAI-compatible one): `total_tokens`
    // says so when it adds up one way or the other (reasoning reported outside the
    // completion allowed for); without it, figures larger than the prompt cannot be
    // inside it (issue 39: a guess alone missed a cache read smaller than the prompt).
    let disjoint = {
        let raw_completion = tokens(u.get("completion_tokens")).unwrap_or(0);
        let raw_reasoning = u
            .get("completion_tokens_details")
            .and_then(Value::as_object)
            .and_then(|d| tokens(d.get("reasoning_tokens")))
            .unwrap_or(0);
        let base = reported_prompt.saturating_add(raw_completion);
        let sums = |extra: u64| {
            [
                base.saturating_add(extra),
                base.saturating_add(extra).saturating_add(raw_reasoning),
            ]
        };
        match tokens(u.get("total_tokens")) {
            Some(t) if anthropic > 0 && sums(anthropic).contains(&t) => true,
            Some(t) if anthropic > 0 && sums(0).contains(&t) => false,
            _ => anthropic > prompt,
        }
    };
    if disjoint {
        prompt = prompt.saturating_add(anthropic);
    }
    let cached = cached.map(|c| c.min(prompt));
    let write = write.map(|w| w.min(prompt.saturating_sub(cached.unwrap_or(0))));
    let completion = tokens(u.get("completion_tokens")).unwrap_or(0);
    let reasoning = u
        .get("completion_tokens_details")
        .and_then(Value::as_object)
        .and_then(|d| tokens(d.get("reasoning_tokens")));
    let completion = match (reasoning, tokens(u.get("total_tokens"))) {
        (Some(r), _) if r > completion => completion.saturating_add(r).min(MAX_TOKENS),
        (Some(r), Some(total))
            if r > 0
                && total != reported_prompt.saturating_add(completion)
                && total == reported_prompt.saturating_add(completion).saturating_add(r) =>
        {
            completion.saturating_add(r).min(MAX_TOKENS)
        }
        _ => completion,
    };
    Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        reasoning_tokens: reasoning,
        cached_prompt_tokens: cached,
        cache_write_tokens: write,
        cache_write_1h_tokens: None,
    }
}

/// The usage a frame carries: top-level `usage` wins over `choices[0].usage`.
pub fn frame_usage(obj: &Map<String, Value>) -> Option<(Usage, UsageLocation)> {
    if let Some(u) = obj.get("usage").and_then(Value::as_object) {
        return Some((parse_usage(u), UsageLocation::TopLevel));
    }
    choice0(obj)
        .and_then(|c| c.get("usage"))
        .and_then(Value::as_object)
        .map(|u| (parse_usage(u), UsageLocation::Choice))
}

/// The common shape of a chunk, parsed with its strings borrowed from the frame's text
/// (see [`StreamAggregator::feed_typed`]). A field of another JSON type than the one
/// declared here (typed content parts, a numeric `model`, a fractional tool index…), a
/// duplicate key, or a choice, delta, tool call or function that is not a JSON object
/// fails the parse: such a frame goes the general way. (Every struct is read through
/// [`typed::MapOnly`]: serde's derived structs would also accept a JSON array.)
mod typed {
    use std::borrow::Cow;
    use std::fmt;
    use std::marker::PhantomData;
    use std::ops::Deref;

    use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
    use serde::Deserialize;

    /// A struct read from a JSON object only (never from an array).
    pub(super) struct MapOnly<T>(pub T);

    impl<T> Deref for MapOnly<T> {
        type Target = T;
        fn deref(&self) -> &T {
            &self.0
        }
    }

    impl<'de, T: Deserialize<'de>> Deserialize<'de> for MapOnly<T> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V<T>(PhantomData<T>);
            impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
                type Value = MapOnly<T>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<MapOnly<T>, A::Error> {
                    T::deserialize(de::value::MapAccessDeserializer::new(map)).map(MapOnly)
                }
            }
            d.deserialize_map(V(PhantomData))
        }
    }

    /// A JSON string, borrowed from the input when it has no escapes.
    pub(super) struct Str<'a>(Cow<'a, str>);

    impl Deref for Str<'_> {
        type Target = str;
        fn deref(&self) -> &str {
            &self.0
        }
    }

    impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V<'a>(PhantomData<&'a ()>);
            impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
                type Value = Str<'a>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a string")
                }
                fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Str<'a>, E> {
                    Ok(Str(Cow::Borrowed(v)))
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<Str<'a>, E> {
                    Ok(Str(Cow::Owned(v.to_owned())))
                }
                fn visit_string<E: de::Error>(self, v: String) -> Result<Str<'a>, E> {
                    Ok(Str(Cow::Owned(v)))
                }
            }
            d.deserialize_str(V(PhantomData))
        }
    }

    /// A choice's `index` as [`super::choice0`] reads it: absent, zero (integer or
    /// float), or anything else (another number, or `null`).
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    pub(super) enum Index {
        #[default]
        Missing,
        Zero,
        Other,
    }

    impl<'de> Deserialize<'de> for Index {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl Visitor<'_> for V {
                type Value = Index;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a number or null")
                }
                fn visit_u64<E: de::Error>(self, v: u64) -> Result<Index, E> {
                    Ok(if v == 0 { Index::Zero } else { Index::Other })
                }
                fn visit_i64<E: de::Error>(self, v: i64) -> Result<Index, E> {
                    Ok(if v == 0 { Index::Zero } else { Index::Other })
                }
                fn visit_f64<E: de::Error>(self, v: f64) -> Result<Index, E> {
                    Ok(if v == 0.0 { Index::Zero } else { Index::Other })
                }
                fn visit_unit<E: de::Error>(self) -> Result<Index, E> {
                    Ok(Index::Other)
                }
            }
            d.deserialize_any(V)
        }
    }

    /// Any JSON value, keeping it when it is a string (borrowed when it has no escapes);
    /// other values are skipped without being built.
    pub(super) struct AnyStr<'a>(pub Option<Cow<'a, str>>);

    impl<'de: 'a, 'a> Deserialize<'de> for AnyStr<'a> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V<'a>(PhantomData<&'a ()>);
            impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
                type Value = AnyStr<'a>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("any JSON value")
                }
                fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<AnyStr<'a>, E> {
                    Ok(AnyStr(Some(Cow::Borrowed(v))))
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<AnyStr<'a>, E> {
                    Ok(AnyStr(Some(Cow::Owned(v.to_string()))))
                }
                fn visit_string<E: de::Error>(self, v: String) -> Result<AnyStr<'a>, E> {
                    Ok(AnyStr(Some(Cow::Owned(v))))
                }
                fn visit_bool<E: de::Error>(self, _: bool) -> Result<AnyStr<'a>, E> {
                    Ok(AnyStr(None))
                }
                fn visit_i64<E: de::Error>(self, _: i64) -> Result<AnyStr<'a>, E> {
                    Ok(AnyStr(None))
                }
                fn visit_u64<E: de::Error>(self, _: u64) -> Result<AnyStr<'a>, E> {
                    Ok(AnyStr(None))
                }
                fn visit_f64<E: de::Error>(self, _: f64) -> Result<AnyStr<'a>, E> {
                    Ok(AnyStr(None))
                }
                fn visit_unit<E: de::Error>(self) -> Result<AnyStr<'a>, E> {
                    Ok(AnyStr(None))
                }
                fn visit_seq<A: de::SeqAccess<'de>>(
                    self,
                    mut a: A,
                ) -> Result<AnyStr<'a>, A::Error> {
                    while a.next_element::<IgnoredAny>()?.is_some() {}
                    Ok(AnyStr(None))
                }
                fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<AnyStr<'a>, A::Error> {
                    while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                    Ok(AnyStr(None))
                }
            }
            d.deserialize_any(V(PhantomData))
        }
    }

    #[derive(Deserialize)]
    pub(super) struct Frame<'a> {
        // The envelope, read for a frame kept as text (any JSON type, as the `Value`
        // path would take it: these never decline a frame).
        #[serde(borrow, default)]
        pub id: Option<AnyStr<'a>>,
        #[serde(default)]
        pub created: Option<serde_json::Value>,
        #[serde(default)]
        pub object: Option<IgnoredAny>,
        #[serde(borrow, default)]
        pub model: Option<Str<'a>>,
        #[serde(borrow, default)]
        pub choices: Option<Choices<'a>>,
        #[serde(default)]
        pub usage: Option<IgnoredAny>,
        #[serde(default)]
        pub error: Option<IgnoredAny>,
    }

    /// A frame's `choices` as the fold needs them, without a vector: how many, choice
    /// 0 (the first whose `index` is 0, or the first element without an `index` when
    /// it is the first element), and whether any has usage. Every element must be an
    /// object (else the parse fails, as for a vector of [`MapOnly`]).
    pub(super) struct Choices<'a> {
        pub len: usize,
        pub c0: Option<Choice<'a>>,
        pub any_usage: bool,
    }

    impl<'de: 'a, 'a> Deserialize<'de> for Choices<'a> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V<'a>(PhantomData<&'a ()>);
            impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
                type Value = Choices<'a>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("an array of choice objects")
                }
                fn visit_seq<A: de::SeqAccess<'de>>(
                    self,
                    mut a: A,
                ) -> Result<Choices<'a>, A::Error> {
                    let mut out = Choices {
                        len: 0,
                        c0: None,
                        any_usage: false,
                    };
                    while let Some(MapOnly(c)) = a.next_element::<MapOnly<Choice<'a>>>()? {
                        let pos = out.len;
                        out.len += 1;
                        out.any_usage |= c.usage.is_some();
                        let is0 = match c.index {
                            Index::Missing => pos == 0,
                            Index::Zero => true,
                            Index::Other => false,
                        };
                        if is0 && out.c0.is_none() {
                            out.c0 = Some(c);
                        }
                    }
                    Ok(out)
                }
            }
            d.deserialize_seq(V(PhantomData))
        }
    }

    /// A plain completion in the common shape (see
    /// [`super::StreamAggregator::absorb_completion_typed`]); every other field is
    /// skipped without being built.
    #[derive(Deserialize)]
    pub(super) struct Completion<'a> {
        #[serde(borrow, default)]
        pub model: Option<Str<'a>>,
        #[serde(borrow, default)]
        pub choices: Option<Vec<MapOnly<CompletionChoice<'a>>>>,
        #[serde(default)]
        pub usage: Option<serde_json::Value>,
        #[serde(default)]
        pub error: Option<IgnoredAny>,
    }

    #[derive(Deserialize)]
    pub(super) struct CompletionChoice<'a> {
        #[serde(default)]
        pub index: Index,
        #[serde(borrow, default)]
        pub message: Option<MapOnly<Delta<'a>>>,
        #[serde(default)]
        pub delta: Option<IgnoredAny>,
        #[serde(borrow, default)]
        pub finish_reason: Option<Str<'a>>,
        #[serde(default)]
        pub usage: Option<IgnoredAny>,
    }

    #[derive(Deserialize)]
    pub(super) struct Choice<'a> {
        #[serde(default)]
        pub index: Index,
        #[serde(borrow, default)]
        pub delta: Option<MapOnly<Delta<'a>>>,
        #[serde(borrow, default)]
        pub finish_reason: Option<Str<'a>>,
        #[serde(default)]
        pub usage: Option<IgnoredAny>,
    }

    #[derive(Deserialize)]
    pub(super) struct Delta<'a> {
        #[serde(borrow, default)]
        pub role: Option<Str<'a>>,
        #[serde(borrow, default)]
        pub content: Option<Str<'a>>,
        #[serde(borrow, default)]
        pub reasoning_content: Option<Str<'a>>,
        #[serde(borrow, default)]
        pub reasoning: Option<Str<'a>>,
        #[serde(borrow, default)]
        pub tool_calls: Option<Vec<MapOnly<ToolCall<'a>>>>,
    }

    #[derive(Deserialize)]
    pub(super) struct ToolCall<'a> {
        #[serde(default)]
        pub index: Option<u64>,
        #[serde(borrow, default)]
        pub id: Option<Str<'a>>,
        #[serde(borrow, default)]
        pub function: Option<MapOnly<Function<'a>>>,
    }

    #[derive(Deserialize)]
    pub(super) struct Function<'a> {
        #[serde(borrow, default)]
        pub name: Option<Str<'a>>,
        #[serde(borrow, default)]
        pub arguments: Option<Str<'a>>,
    }
}

/// Text pieces of one delta (or message), before they are appended.
#[derive(Default)]
struct Pieces {
    content: Option<String>,
    reasoning: Option<String>,
}

impl StreamAggregator {
    /// An empty aggregator.
    pub fn new() -> Self {
        StreamAggregator::default()
    }

    /// Bytes of content, reasoning and tool-call arguments accumulated (the content cap).
    pub fn content_bytes(&self) -> usize {
        self.content.len() + self.reasoning.len() + self.args_bytes
    }

    /// The last non-null finish_reason so far.
    pub fn finish_reason(&self) -> Option<&str> {
        self.finish_reason.as_deref()
    }

    /// The last usage so far.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Incremental frames so far.
    pub fn incremental_chunks(&self) -> u32 {
        self.incremental_chunks
    }

    /// Folds one frame (a JSON object). With `want_delta`, also returns the frame as a
    /// [`StreamDelta`] (for passthrough streaming).
    pub fn feed(&mut self, frame: &Map<String, Value>, want_delta: bool) -> FrameOutcome {
        self.frames = self.frames.saturating_add(1);
        if self.model.is_none() {
            if let Some(m) = frame.get("model").and_then(Value::as_str) {
                if !m.is_empty() {
                    self.model = Some(m.to_string());
                }
            }
        }
        let mut delta_out = want_delta.then(StreamDelta::default);
        let mut incremental = false;
        let c0 = choice0(frame);
        if let Some(c) = c0 {
            if let Some(delta) = c.get("delta").and_then(Value::as_object) {
                incremental = self.absorb(delta, delta_out.as_mut());
            }
            if let Some(fr) = c.get("finish_reason").and_then(Value::as_str) {
                self.finish_reason = Some(fr.to_string());
                if let Some(d) = delta_out.as_mut() {
                    d.finish_reason = Some(fr.to_string());
                }
            }
        }
        if let Some((u, loc)) = frame_usage(frame) {
            self.usage = Some(u);
            self.usage_location = Some(loc);
            if let Some(d) = delta_out.as_mut() {
                d.usage = Some(u);
            }
        }
        if let Some(d) = delta_out.as_mut() {
            d.model = frame
                .get("model")
                .and_then(Value::as_str)
                .filter(|m| !m.is_empty())
                .map(str::to_string);
        }
        if incremental {
            self.incremental_chunks = self.incremental_chunks.saturating_add(1);
        }
        FrameOutcome {
            incremental,
            delta: delta_out,
        }
    }

    /// Folds one frame given as its JSON text, when it has the common shape: a JSON
    /// object whose `model`, choices' `finish_reason` and delta fields (`role`,
    /// `content`, `reasoning_content`, `reasoning`, tool calls' `id`, `name`,
    /// `arguments`) are strings or null, with no `error` and no usage (top-level or in
    /// choice 0). Parsed into borrowed typed structs, not a `Value` tree. Returns
    /// `None`, with nothing folded, for any other text: the caller then parses it as a
    /// `Value` (checking in-band errors) and calls [`StreamAggregator::feed`], which
    /// gives the same outcome as this would for the frames this accepts.
    pub fn feed_typed(&mut self, data: &str, want_delta: bool) -> Option<FrameOutcome> {
        self.feed_typed_keeping(data, want_delta, false)
    }

    /// [`Self::feed_typed`]; with `keep_text` (and `want_delta`), the delta carries the
    /// frame's text and envelope ([`StreamDelta::raw_text`]) for a proxy to pass
    /// through. Such a frame must need no edit but the envelope's, so with `keep_text`
    /// a frame whose JSON spans several lines or that has usage in any choice is
    /// declined too (the `Value` path gives the caller its `raw` object instead).
    pub fn feed_typed_keeping(
        &mut self,
        data: &str,
        want_delta: bool,
        keep_text: bool,
    ) -> Option<FrameOutcome> {
        let mut out = self.fold_typed(data, want_delta, keep_text)?;
        if let Some(t) = out.delta.as_mut().and_then(|d| d.raw_text.as_mut()) {
            t.json = data.to_string();
        }
        Some(out)
    }

    /// [`Self::feed_typed_keeping`] of a frame's text that the caller owns (trimmed):
    /// a kept text is `data` itself, not a copy. A declined frame's text is given back.
    pub fn feed_typed_owned(
        &mut self,
        data: String,
        want_delta: bool,
        keep_text: bool,
    ) -> Result<FrameOutcome, String> {
        match self.fold_typed(&data, want_delta, keep_text) {
            Some(mut out) => {
                if let Some(t) = out.delta.as_mut().and_then(|d| d.raw_text.as_mut()) {
                    t.json = data;
                }
                Ok(out)
            }
            None => Err(data),
        }
    }

    /// The typed fold of [`Self::feed_typed_keeping`]; a kept text's `json` is left
    /// empty for the caller.
    fn fold_typed(
        &mut self,
        data: &str,
        want_delta: bool,
        keep_text: bool,
    ) -> Option<FrameOutcome> {
        let keep_text = keep_text && want_delta;
        if keep_text && data.contains(['\n', '\r']) {
            return None;
        }
        let frame: typed::MapOnly<typed::Frame<'_>> = serde_json::from_str(data).ok()?;
        if frame.error.is_some() || frame.usage.is_some() {
            return None;
        }
        let (n_choices, any_usage) = frame
            .choices
            .as_ref()
            .map_or((0, false), |c| (c.len, c.any_usage));
        if keep_text && any_usage {
            return None;
        }
        let c0 = frame.choices.as_ref().and_then(|c| c.c0.as_ref());
        if c0.is_some_and(|c| c.usage.is_some()) {
            return None;
        }
        self.frames = self.frames.saturating_add(1);
        let model = frame.model.as_deref().filter(|m| !m.is_empty());
        if self.model.is_none() {
            if let Some(m) = model {
                self.model = Some(m.to_string());
            }
        }
        let mut delta_out = want_delta.then(StreamDelta::default);
        let mut incremental = false;
        if let Some(c) = c0 {
            if let Some(delta) = &c.delta {
                incremental = self.absorb_typed(delta, delta_out.as_mut());
            }
            if let Some(fr) = c.finish_reason.as_deref() {
                self.finish_reason = Some(fr.to_string());
                if let Some(d) = delta_out.as_mut() {
                    d.finish_reason = Some(fr.to_string());
                }
            }
        }
        if let Some(d) = delta_out.as_mut() {
            d.model = model.map(str::to_string);
            if keep_text {
                d.raw_text = Some(Box::new(RawText {
                    // Filled by the caller: a copy of `data`, or `data` itself.
                    json: String::new(),
                    id: frame
                        .id
                        .as_ref()
                        .and_then(|i| i.0.as_deref())
                        .map(str::to_string),
                    created: frame.created.as_ref().and_then(Value::as_u64),
                    has_object: frame.object.is_some(),
                    choices: n_choices,
                }));
            }
        }
        if incremental {
            self.incremental_chunks = self.incremental_chunks.saturating_add(1);
        }
        Some(FrameOutcome {
            incremental,
            delta: delta_out,
        })
    }

    /// Folds a chunk a native API's reader made of its event
    /// ([`polygw_core::native::messages::MessagesReader`]): its text, tool-call
    /// fragments, finish reason, usage and model. Returns whether it was a content
    /// event.
    pub fn fold_delta(&mut self, d: &StreamDelta) -> bool {
        self.frames = self.frames.saturating_add(1);
        if self.model.is_none() {
            self.model.clone_from(&d.model);
        }
        if let Some(s) = &d.content {
            self.content.push_str(s);
        }
        if let Some(s) = &d.reasoning {
            self.reasoning.push_str(s);
        }
        for t in &d.tool_calls {
            self.fold_tool_call(
                t.index,
                t.id.as_deref(),
                t.name.as_deref(),
                Some(t.arguments.as_str()),
                false,
            );
        }
        if let Some(f) = &d.finish_reason {
            self.finish_reason = Some(f.clone());
        }
        if let Some(u) = d.usage {
            self.usage = Some(u);
            self.usage_location = Some(UsageLocation::TopLevel);
        }
        let incremental = d.is_incremental();
        if incremental {
            self.incremental_chunks = self.incremental_chunks.saturating_add(1);
        }
        incremental
    }

    /// Folds one tool-call fragment, from either path: the call's first non-empty id
    /// and name are kept, its arguments appended. Returns whether the fragment carried
    /// text (a name or arguments) and, when `want`, the fragment as a delta.
    fn fold_tool_call(
        &mut self,
        idx: u32,
        id: Option<&str>,
        name: Option<&str>,
        args: Option<&str>,
        want: bool,
    ) -> (bool, Option<ToolCallDelta>) {
        let slot = self.tools.entry(idx).or_default();
        let mut td = want.then(|| ToolCallDelta {
            index: idx,
            ..ToolCallDelta::default()
        });
        let mut text = false;
        if let Some(id) = id.filter(|id| !id.is_empty()) {
            if slot.id.is_none() {
                slot.id = Some(id.to_string());
            }
            if let Some(td) = td.as_mut() {
                td.id = Some(id.to_string());
            }
        }
        if let Some(name) = name.filter(|n| !n.is_empty()) {
            text = true;
            if slot.name.is_none() {
                slot.name = Some(name.to_string());
            }
            if let Some(td) = td.as_mut() {
                td.name = Some(name.to_string());
            }
        }
        if let Some(args) = args {
            slot.arguments.push_str(args);
            self.args_bytes += args.len();
            text |= !args.is_empty();
            if let Some(td) = td.as_mut() {
                td.arguments.push_str(args);
            }
        }
        (text, td)
    }

    /// [`Self::absorb`] for a typed delta (string content only).
    fn absorb_typed(&mut self, delta: &typed::Delta<'_>, out: Option<&mut StreamDelta>) -> bool {
        let want = out.is_some();
        let mut incremental = false;
        let mut pieces = Pieces::default();
        if let Some(s) = delta.content.as_deref() {
            self.content.push_str(s);
            incremental |= !s.is_empty();
            if want {
                pieces.content = Some(s.to_string());
            }
        }
        for s in [&delta.reasoning_content, &delta.reasoning]
            .into_iter()
            .flatten()
        {
            self.reasoning.push_str(s);
            incremental |= !s.is_empty();
            if want {
                pieces.reasoning.get_or_insert_with(String::new).push_str(s);
            }
        }
        let mut tool_deltas = Vec::new();
        for (pos, tc) in delta.tool_calls.iter().flatten().enumerate() {
            let idx = tc
                .index
                .and_then(|i| u32::try_from(i).ok())
                .unwrap_or(pos as u32);
            let f = tc.function.as_ref();
            let (text, td) = self.fold_tool_call(
                idx,
                tc.id.as_deref(),
                f.and_then(|f| f.name.as_deref()),
                f.and_then(|f| f.arguments.as_deref()),
                want,
            );
            incremental |= text;
            tool_deltas.extend(td);
        }
        if let Some(d) = out {
            d.role = delta.role.as_deref().map(str::to_string);
            d.content = pieces.content;
            d.reasoning = pieces.reasoning;
            d.tool_calls = tool_deltas;
        }
        incremental
    }

    /// Folds a plain completion's `choices[0].message` (same rules as a delta), its
    /// finish_reason and the completion's usage and model.
    pub fn absorb_completion(
        &mut self,
        completion: &Map<String, Value>,
        choice: &Map<String, Value>,
    ) {
        if let Some(m) = completion.get("model").and_then(Value::as_str) {
            if !m.is_empty() {
                self.model = Some(m.to_string());
            }
        }
        let msg = choice
            .get("message")
            .or_else(|| choice.get("delta"))
            .and_then(Value::as_object);
        if let Some(msg) = msg {
            if self.absorb(msg, None) {
                self.incremental_chunks = self.incremental_chunks.saturating_add(1);
            }
        }
        if let Some(fr) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(fr.to_string());
        }
        if let Some((u, loc)) = frame_usage(completion) {
            self.usage = Some(u);
            self.usage_location = Some(loc);
        }
    }

    /// Folds a plain completion given as its body, when it has the common shape: a
    /// JSON object with no `error`, a non-empty `choices` array of objects whose choice
    /// 0 has a `message` (no usage of its own) with the fields
    /// [`StreamAggregator::feed_typed`] reads, a string `model`, and `usage` absent,
    /// null or an object. Parsed into borrowed typed structs — the message's text, the
    /// logprobs and every other field are not built into a `Value` tree (issue 27).
    /// Returns `None`, with nothing folded, for any other body: the caller then parses
    /// it as a `Value` and calls [`StreamAggregator::absorb_completion`], which gives
    /// the same aggregate for the bodies this accepts.
    pub fn absorb_completion_typed(&mut self, body: &[u8]) -> Option<()> {
        let c: typed::MapOnly<typed::Completion<'_>> = serde_json::from_slice(body).ok()?;
        if c.error.is_some() {
            return None;
        }
        let usage = match &c.usage {
            None => None,
            Some(Value::Object(u)) => Some(parse_usage(u)),
            Some(_) => return None,
        };
        let choices = c.choices.as_deref().filter(|c| !c.is_empty())?;
        let c0 = choices
            .iter()
            .enumerate()
            .find(|(pos, c)| match c.index {
                typed::Index::Missing => *pos == 0,
                typed::Index::Zero => true,
                typed::Index::Other => false,
            })
            .map(|(_, c)| c)?;
        if c0.usage.is_some() || (c0.message.is_none() && c0.delta.is_some()) {
            return None;
        }
        if let Some(m) = c.model.as_deref().filter(|m| !m.is_empty()) {
            self.model = Some(m.to_string());
        }
        if let Some(msg) = &c0.message {
            if self.absorb_typed(msg, None) {
                self.incremental_chunks = self.incremental_chunks.saturating_add(1);
            }
        }
        if let Some(fr) = c0.finish_reason.as_deref() {
            self.finish_reason = Some(fr.to_string());
        }
        if let Some(u) = usage {
            self.usage = Some(u);
            self.usage_location = Some(UsageLocation::TopLevel);
        }
        Some(())
    }

    /// Appends one delta's text; returns whether it was incremental.
    fn absorb(&mut self, delta: &Map<String, Value>, out: Option<&mut StreamDelta>) -> bool {
        let want = out.is_some();
        let mut incremental = false;
        let mut pieces = Pieces::default();
        match delta.get("content") {
            Some(Value::String(s)) => {
                self.content.push_str(s);
                incremental |= !s.is_empty();
                if want {
                    pieces.content = Some(s.clone());
                }
            }
            Some(Value::Array(parts)) => {
                self.content_parts_array = true;
                for part in parts {
                    let Some(part) = part.as_object() else {
                        continue;
                    };
                    match part.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            if let Some(s) = part.get("text").and_then(Value::as_str) {
                                self.content.push_str(s);
                                incremental |= !s.is_empty();
                                if want {
                                    pieces.content.get_or_insert_with(String::new).push_str(s);
                                }
                            }
                        }
                        Some("thinking") => {
                            let th = part.get("thinking");
                            let items: &[Value] = match th {
                                Some(Value::Array(a)) => a,
                                Some(v) => std::slice::from_ref(v),
                                None => &[],
                            };
                            for it in items {
                                let s = match it {
                                    Value::Object(o) => o.get("text").and_then(Value::as_str),
                                    Value::String(s) => Some(s.as_str()),
                                    _ => None,
                                };
                                if let Some(s) = s {
                                    self.reasoning.push_str(s);
                                    incremental |= !s.is_empty();
                                    if want {
                                        pieces
                                            .reasoning
                                            .get_or_insert_with(String::new)
                                            .push_str(s);
                                    }
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
        for key in ["reasoning_content", "reasoning"] {
            if let Some(s) = delta.get(key).and_then(Value::as_str) {
                self.reasoning.push_str(s);
                incremental |= !s.is_empty();
                if want {
                    pieces.reasoning.get_or_insert_with(String::new).push_str(s);
                }
            }
        }
        let mut tool_deltas = Vec::new();
        if let Some(tcs) = delta.get("tool_calls").and_then(Value::as_array) {
            for (pos, tc) in tcs.iter().enumerate() {
                let Some(tc) = tc.as_object() else {
                    continue;
                };
                let idx = tc
                    .get("index")
                    .and_then(Value::as_u64)
                    .and_then(|i| u32::try_from(i).ok())
                    .unwrap_or(pos as u32);
                let f = tc.get("function").and_then(Value::as_object);
                let field = |k: &str| f.and_then(|f| f.get(k)).and_then(Value::as_str);
                let (text, td) = self.fold_tool_call(
                    idx,
                    tc.get("id").and_then(Value::as_str),
                    field("name"),
                    field("arguments"),
                    want,
                );
                incremental |= text;
                tool_deltas.extend(td);
            }
        }
        if let Some(d) = out {
            d.role = delta
                .get("role")
                .and_then(Value::as_str)
                .map(str::to_string);
            d.content = pieces.content;
            d.reasoning = pieces.reasoning;
            d.tool_calls = tool_deltas;
        }
        incremental
    }

    /// The aggregate so far.
    pub fn finish(self) -> Aggregate {
        Aggregate {
            content: self.content,
            reasoning: self.reasoning,
            tool_calls: self
                .tools
                .into_iter()
                .map(|(index, s)| ToolCall {
                    index,
                    id: s.id,
                    name: s.name,
                    arguments: s.arguments,
                })
                .collect(),
            finish_reason: self.finish_reason,
            usage: self.usage,
            usage_location: self.usage_location,
            model: self.model,
            incremental_chunks: self.incremental_chunks,
            frames: self.frames,
            content_parts_array: self.content_parts_array,
        }
    }
}

/// An error object found in a body or a frame (`{"error":{...}}`, `{"error":"..."}`,
/// or a top-level `{"message","code"}` shape for bodies that are known to be errors).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProviderError {
    /// A numeric HTTP-like status inside the object (`status`, or an integer `code`).
    pub status: Option<u16>,
    /// `code` (string or integer), else `type`.
    pub code: Option<String>,
    /// `message` (or `detail`).
    pub message: Option<String>,
}

impl ProviderError {
    fn is_empty(&self) -> bool {
        self.status.is_none() && self.code.is_none() && self.message.is_none()
    }
}

fn status_of(v: Option<&Value>) -> Option<u16> {
    let n = v?.as_u64()?;
    (100..=599).contains(&n).then_some(n as u16)
}

fn string_of(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn from_error_fields(o: &Map<String, Value>) -> ProviderError {
    let status = status_of(o.get("status")).or_else(|| status_of(o.get("code")));
    // Anthropic names a spend cap in `details.error_code` under a generic `type`.
    let code = string_of(o.get("details").and_then(|d| d.get("error_code")))
        .or_else(|| string_of(o.get("code")))
        .or_else(|| string_of(o.get("type")));
    let message = string_of(o.get("message")).or_else(|| string_of(o.get("detail")));
    ProviderError {
        status,
        code,
        message,
    }
}

/// The in-band error of a 200 body or an SSE frame: a non-null `error` member.
pub fn in_band_error(obj: &Map<String, Value>) -> Option<ProviderError> {
    match obj.get("error")? {
        Value::Object(e) => {
            let pe = from_error_fields(e);
            Some(if pe.is_empty() {
                ProviderError {
                    message: Some("error object without a message".into()),
                    ..pe
                }
            } else {
                pe
            })
        }
        Value::String(s) if !s.trim().is_empty() => Some(ProviderError {
            message: Some(s.trim().to_string()),
            ..ProviderError::default()
        }),
        Value::Null | Value::Bool(false) => None,
        Value::String(_) => None,
        other => Some(ProviderError {
            message: Some(format!("error: {other}")),
            ..ProviderError::default()
        }),
    }
}

/// The error described by a non-2xx body: `{"error":{...}}`, `{"error":"..."}`, a
/// top-level `{"message","code","type"}` or `{"detail": ...}`; plain text becomes the
/// message. `None` for an empty body.
pub fn error_body(body: &[u8]) -> Option<ProviderError> {
    let text = String::from_utf8_lossy(body);
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return None;
    }
    if let Ok(Value::Object(o)) = serde_json::from_str::<Value>(trimmed) {
        if let Some(e) = in_band_error(&o) {
            return Some(e);
        }
        let pe = from_error_fields(&o);
        return (!pe.is_empty()).then_some(pe);
    }
    Some(ProviderError {
        message: Some(polygw_core::error::shorten(
            trimmed.to_string(),
            polygw_core::error::MAX_PROVIDER_MESSAGE,
        )),
        ..ProviderError::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn usage_of(v: Value) -> Usage {
        parse_usage(v.as_object().unwrap())
    }

    /// (prompt, completion, reasoning, cached, write)
    fn figures(u: Usage) -> (u64, u64, Option<u64>, Option<u64>, Option<u64>) {
        (
            u.prompt_tokens,
            u.completion_tokens,
            u.reasoning_tokens,
            u.cached_prompt_tokens,
            u.cache_write_tokens,
        )
    }

    #[test]
    fn cache_figures_in_every_dialect() {
        let rows = [
            // OpenAI, DashScope/Qwen, vLLM, xAI.
            (
                json!({"prompt_tokens": 322, "completion_tokens": 104,
                       "prompt_tokens_details": {"cached_tokens": 256}}),
                (322, 104, None, Some(256), None),
            ),
            // DeepSeek: hit + miss = prompt (the details too, in newer answers).
            (
                json!({"prompt_tokens": 374, "completion_tokens": 61,
                       "prompt_cache_hit_tokens": 256, "prompt_cache_miss_tokens": 118}),
                (374, 61, None, Some(256), None),
            ),
            // Anthropic-style inside the prompt (the OpenAI-compatible convention).
            (
                json!({"prompt_tokens": 110, "completion_tokens": 5,
                       "cache_read_input_tokens": 64, "cache_creation_input_tokens": 32}),
                (110, 5, None, Some(64), Some(32)),
            ),
            // Anthropic-style outside it (Anthropic's own convention): added.
            (
                json!({"prompt_tokens": 30, "completion_tokens": 7,
                       "cache_read_input_tokens": 60, "cache_creation_input_tokens": 10}),
                (100, 7, None, Some(60), Some(10)),
            ),
            // Outside it, smaller than the prompt: `total_tokens` tells (issue 39).
            (
                json!({"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 145,
                       "cache_read_input_tokens": 30, "cache_creation_input_tokens": 10}),
                (140, 5, None, Some(30), Some(10)),
            ),
            // Inside it, and the total says so too.
            (
                json!({"prompt_tokens": 110, "completion_tokens": 5, "total_tokens": 115,
                       "cache_read_input_tokens": 64, "cache_creation_input_tokens": 32}),
                (110, 5, None, Some(64), Some(32)),
            ),
            // Moonshot: a top-level cached_tokens.
            (
                json!({"prompt_tokens": 90, "completion_tokens": 50, "cached_tokens": 90}),
                (90, 50, None, Some(90), None),
            ),
            // No cache field: unknown, not 0.
            (
                json!({"prompt_tokens": 9, "completion_tokens": 1}),
                (9, 1, None, None, None),
            ),
            // A cached figure above the prompt is clamped to it.
            (
                json!({"prompt_tokens": 10, "completion_tokens": 1,
                       "prompt_tokens_details": {"cached_tokens": 50}}),
                (10, 1, None, Some(10), None),
            ),
        ];
        for (v, want) in rows {
            assert_eq!(figures(usage_of(v.clone())), want, "{v}");
        }
    }

    #[test]
    fn reasoning_reported_outside_the_completion_is_added_to_it() {
        let rows = [
            // OpenAI: inside (total = prompt + completion).
            (
                json!({"prompt_tokens": 15, "completion_tokens": 78, "total_tokens": 93,
                       "completion_tokens_details": {"reasoning_tokens": 64}}),
                78,
            ),
            // xAI: outside (total = prompt + completion + reasoning).
            (
                json!({"prompt_tokens": 291, "completion_tokens": 26, "total_tokens": 513,
                       "completion_tokens_details": {"reasoning_tokens": 196}}),
                222,
            ),
            // More reasoning than completion, no total: it cannot be inside.
            (
                json!({"prompt_tokens": 12, "completion_tokens": 1,
                       "completion_tokens_details": {"reasoning_tokens": 290}}),
                291,
            ),
            // Less reasoning than completion, no total: inside.
            (
                json!({"prompt_tokens": 12, "completion_tokens": 100,
                       "completion_tokens_details": {"reasoning_tokens": 40}}),
                100,
            ),
            // A total that fits neither: the completion as reported.
            (
                json!({"prompt_tokens": 12, "completion_tokens": 100, "total_tokens": 7,
                       "completion_tokens_details": {"reasoning_tokens": 40}}),
                100,
            ),
        ];
        for (v, want) in rows {
            let u = usage_of(v.clone());
            assert_eq!(u.completion_tokens, want, "{v}");
            assert!(u.reasoning_tokens.is_some());
        }
    }

    #[test]
    fn a_frame_kept_as_text_carries_its_envelope_and_needs_no_edit() {
        let line = r#"{"model":"m","id":"c1","object":"chat.completion.chunk","created":7,"choices":[{"index":0,"delta":{"content":"hi"},"logprobs":null}],"usage":null}"#;
        let mut agg = StreamAggregator::default();
        let out = agg.feed_typed_keeping(line, true, true).unwrap();
        let d = out.delta.unwrap();
        assert_eq!(d.content.as_deref(), Some("hi"));
        assert!(d.raw.is_none());
        let t = d.raw_text.unwrap();
        assert_eq!(t.json, line);
        assert_eq!(t.id.as_deref(), Some("c1"));
        assert_eq!(t.created, Some(7));
        assert!(t.has_object);
        assert_eq!(t.choices, 1);
        // Not asked for: no text.
        let d = agg.feed_typed(line, true).unwrap().delta.unwrap();
        assert!(d.raw_text.is_none());
        // An envelope of another type is not a reason to decline (the `Value` path
        // takes it alike), it is just not the stream's.
        let odd = r#"{"id":5,"created":"x","choices":[{"delta":{"content":"a"}}]}"#;
        let t = agg
            .feed_typed_keeping(odd, true, true)
            .unwrap()
            .delta
            .unwrap()
            .raw_text
            .unwrap();
        assert_eq!((&t.id, t.created, t.has_object), (&None, None, false));
        // Kept as text only when it can go out as is: one line, no usage in any choice.
        let before = format!("{agg:?}");
        for declined in [
            "{\"id\":\"c1\",\n\"choices\":[{\"delta\":{\"content\":\"a\"}}]}",
            r#"{"choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{},"usage":{"prompt_tokens":1}}]}"#,
        ] {
            assert!(
                agg.feed_typed_keeping(declined, true, true).is_none(),
                "{declined}"
            );
            assert_eq!(format!("{agg:?}"), before, "a declined frame folds nothing");
            assert!(
                agg.clone().feed_typed(declined, true).is_some(),
                "{declined}"
            );
        }
    }

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(o) => o,
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn content_reasoning_and_incremental_rule() {
        let mut a = StreamAggregator::new();
        let role = a.feed(
            &obj(json!({"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]})),
            false,
        );
        assert!(!role.incremental);
        let r = a.feed(
            &obj(json!({"choices":[{"delta":{"reasoning_content":"think","reasoning":"!"}}]})),
            false,
        );
        assert!(r.incremental);
        let c = a.feed(
            &obj(json!({"choices":[{"delta":{"content":"hi"},"finish_reason":null}]})),
            false,
        );
        assert!(c.incremental);
        let f = a.feed(
            &obj(json!({"choices":[{"delta":{},"finish_reason":"stop"}]})),
            false,
        );
        assert!(!f.incremental);
        let u = a.feed(&obj(json!({"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"completion_tokens_details":{"reasoning_tokens":1}}})), false);
        assert!(!u.incremental);
        let agg = a.finish();
        assert_eq!(agg.content, "hi");
        assert_eq!(agg.reasoning, "think!");
        assert_eq!(agg.finish_reason.as_deref(), Some("stop"));
        assert_eq!(
            agg.usage,
            Some(Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                reasoning_tokens: Some(1),
                ..Usage::default()
            })
        );
        assert_eq!(agg.incremental_chunks, 2);
    }

    #[test]
    fn only_choice_zero_counts() {
        let mut a = StreamAggregator::new();
        a.feed(&obj(json!({"choices":[{"index":1,"delta":{"content":"B"}},{"index":0,"delta":{"content":"A"}}]})), false);
        a.feed(
            &obj(json!({"choices":[{"delta":{"content":"C"}},{"delta":{"content":"D"}}]})),
            false,
        );
        assert_eq!(a.finish().content, "AC");
    }

    #[test]
    fn tool_calls_by_index_first_non_empty_id_and_name() {
        let mut a = StreamAggregator::new();
        a.feed(&obj(json!({"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":""}}]}}]})), false);
        let o = a.feed(&obj(json!({"choices":[{"delta":{"tool_calls":[{"index":0,"id":"","function":{"name":"","arguments":"{\"a\""}}]}}]})), true);
        assert!(o.incremental);
        let d = o.delta.unwrap();
        assert_eq!(
            d.tool_calls,
            vec![ToolCallDelta {
                index: 0,
                id: None,
                name: None,
                arguments: "{\"a\"".into()
            }]
        );
        a.feed(&obj(json!({"choices":[{"delta":{"tool_calls":[{"function":{"arguments":":1}"}},{"function":{"name":"g","arguments":"{}"}}]}}]})), false);
        let agg = a.finish();
        assert_eq!(agg.tool_calls.len(), 2);
        assert_eq!(agg.tool_calls[0].id.as_deref(), Some("call_1"));
        assert_eq!(agg.tool_calls[0].name.as_deref(), Some("f"));
        assert_eq!(agg.tool_calls[0].arguments, "{\"a\":1}");
        assert_eq!(agg.tool_calls[1].name.as_deref(), Some("g"));
    }

    #[test]
    fn mistral_typed_parts() {
        let mut a = StreamAggregator::new();
        let o = a.feed(
            &obj(json!({"choices":[{"delta":{"content":[
            {"type":"thinking","thinking":[{"type":"text","text":"hmm"}]},
            {"type":"text","text":"ok"}]}}]})),
            true,
        );
        assert!(o.incremental);
        let d = o.delta.unwrap();
        assert_eq!(
            (d.content.as_deref(), d.reasoning.as_deref()),
            (Some("ok"), Some("hmm"))
        );
        let agg = a.finish();
        assert!(agg.content_parts_array);
        assert_eq!(
            (agg.content.as_str(), agg.reasoning.as_str()),
            ("ok", "hmm")
        );
    }

    #[test]
    fn usage_top_level_wins_within_a_frame_and_last_wins_overall() {
        let mut a = StreamAggregator::new();
        a.feed(&obj(json!({"choices":[{"delta":{},"usage":{"prompt_tokens":1,"completion_tokens":1}}],"usage":{"prompt_tokens":9,"completion_tokens":9}})), false);
        assert_eq!(a.usage().map(|u| u.prompt_tokens), Some(9));
        a.feed(&obj(json!({"choices":[{"delta":{},"usage":{"prompt_tokens":5,"completion_tokens":null}}],"usage":null})), false);
        let agg = a.finish();
        assert_eq!(agg.usage, Some(Usage::new(5, 0)));
        assert_eq!(agg.usage_location, Some(UsageLocation::Choice));
    }

    #[test]
    fn deltas_for_every_frame_including_usage_only() {
        let mut a = StreamAggregator::new();
        let o = a.feed(
            &obj(
                json!({"model":"m","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3}}),
            ),
            true,
        );
        let d = o.delta.unwrap();
        assert!(!o.incremental && !d.is_incremental());
        assert_eq!(d.usage, Some(Usage::new(2, 3)));
        assert_eq!(d.model.as_deref(), Some("m"));
        let o = a.feed(
            &obj(json!({"choices":[{"delta":{"role":"assistant"}}]})),
            false,
        );
        assert!(o.delta.is_none(), "no delta work unless asked");
    }

    #[test]
    fn error_shapes() {
        let e = error_body(br#"{"error":{"message":"too long","type":"invalid_request_error","code":"context_length_exceeded"}}"#).unwrap();
        assert_eq!(e.code.as_deref(), Some("context_length_exceeded"));
        assert_eq!(e.message.as_deref(), Some("too long"));
        let e =
            error_body(br#"{"error":{"message":"m","type":"server_error","code":null}}"#).unwrap();
        assert_eq!(e.code.as_deref(), Some("server_error"));
        let e = error_body(br#"{"error":{"message":"slow","code":429}}"#).unwrap();
        assert_eq!((e.status, e.code.as_deref()), (Some(429), Some("429")));
        let e = error_body(br#"{"message":"bad","code":"invalid_prompt"}"#).unwrap();
        assert_eq!(
            (e.code.as_deref(), e.message.as_deref()),
            (Some("invalid_prompt"), Some("bad"))
        );
        let e = error_body(br#"{"detail":"Not Found"}"#).unwrap();
        assert_eq!(e.message.as_deref(), Some("Not Found"));
        let e = error_body(b"<html>Bad Gateway</html>").unwrap();
        assert_eq!(e.message.as_deref(), Some("<html>Bad Gateway</html>"));
        assert_eq!(error_body(b"  "), None);
        assert_eq!(error_body(b"{}"), None);
        assert!(in_band_error(&obj(json!({"error":null,"choices":[]}))).is_none());
        assert_eq!(
            in_band_error(&obj(json!({"error":"boom"})))
                .unwrap()
                .message
                .as_deref(),
            Some("boom")
        );
    }
}
