//! The `ChunkObserver` port: a synchronous callback the transport calls for every
//! incremental chunk (hedge triggers, resume, passthrough streaming), and
//! [`StreamDelta`], one parsed chunk as the observer sees it.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::response::Usage;

/// One streamed chunk, built only for observers that ask for it
/// ([`ChunkObserver::wants_deltas`]): the normalized fields the gateway reasons about,
/// plus the upstream's whole frame (`raw`) so a proxy can pass every other field
/// through unchanged (SPEC §15).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StreamDelta {
    /// `delta.role`, when present.
    pub role: Option<String>,
    /// New answer text.
    pub content: Option<String>,
    /// New reasoning text.
    pub reasoning: Option<String>,
    /// Tool-call fragments.
    pub tool_calls: Vec<ToolCallDelta>,
    /// `finish_reason`, when present.
    pub finish_reason: Option<String>,
    /// Usage, when the frame carries it.
    pub usage: Option<Usage>,
    /// The upstream's `model`, when present.
    pub model: Option<String>,
    /// The upstream's frame as received (a `chat.completion.chunk` object), when the
    /// transport had one; edits made by the gateway (see the `set_*` methods) keep it in
    /// step with the normalized fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw: Option<Map<String, Value>>,
    /// The upstream's frame as received, kept as its JSON text instead of `raw` when
    /// the transport read it on its fast path (a common frame: no usage, no error), so
    /// that a proxy can pass it through without building a `Value` tree. At most one
    /// of `raw` and `raw_text` is set; the `set_*`/`strip_*` edits first turn the text
    /// into `raw` ([`StreamDelta::raw_object`] reads either).
    #[serde(skip)]
    pub raw_text: Option<Box<RawText>>,
    /// The upstream event as received, from a source of a native API (SPEC §23.2): the
    /// client of that API receives it unchanged.
    #[serde(skip)]
    pub native: Option<Box<crate::native::NativeEvent>>,
}

/// A frame kept as text ([`StreamDelta::raw_text`]), with the envelope fields a proxy
/// checks before passing it through unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RawText {
    /// The frame's JSON, as the `data:` of its SSE event carried it (trimmed).
    pub json: String,
    /// Its `id`, when a string.
    pub id: Option<String>,
    /// Its `created`, when an unsigned integer.
    pub created: Option<u64>,
    /// Whether it has an `object` field.
    pub has_object: bool,
    /// Its number of choices.
    pub choices: usize,
}

impl StreamDelta {
    /// The upstream's frame as an object, from `raw` or parsed from `raw_text`.
    pub fn raw_object(&self) -> Option<std::borrow::Cow<'_, Map<String, Value>>> {
        match (&self.raw, &self.raw_text) {
            (Some(m), _) => Some(std::borrow::Cow::Borrowed(m)),
            (None, Some(t)) => match serde_json::from_str::<Value>(&t.json) {
                Ok(Value::Object(m)) => Some(std::borrow::Cow::Owned(m)),
                _ => None,
            },
            (None, None) => None,
        }
    }

    /// Turns `raw_text` into `raw` (before an edit of the frame).
    fn materialize_raw(&mut self) {
        if self.raw.is_none() {
            if let Some(m) = self.raw_object().map(std::borrow::Cow::into_owned) {
                self.raw = Some(m);
            }
        }
        self.raw_text = None;
    }

    /// Whether the chunk carries new content, reasoning or tool-call text (SPEC §5).
    pub fn is_incremental(&self) -> bool {
        self.native.as_ref().is_some_and(|n| n.progress)
            || self.content.as_deref().is_some_and(|s| !s.is_empty())
            || self.reasoning.as_deref().is_some_and(|s| !s.is_empty())
            || self.tool_calls.iter().any(|t| {
                !t.arguments.is_empty() || t.name.as_deref().is_some_and(|n| !n.is_empty())
            })
    }

    /// Whether forwarding the chunk would tell a client nothing: no text, no role, no
    /// finish_reason, no usage (and, in the raw frame, no other delta field such as
    /// `refusal` or logprobs on choice 0).
    pub fn is_empty_chunk(&self) -> bool {
        if self.native.is_some() {
            // Every event of a native stream is for its client (pings included).
            return false;
        }
        if self.is_incremental()
            || self.role.is_some()
            || self.finish_reason.is_some()
            || self.usage.is_some()
        {
            return false;
        }
        let Some(raw) = self.raw_object() else {
            return true;
        };
        let raw = raw.as_ref();
        // A frame-level field beyond the envelope (Azure's `prompt_filter_results`,
        // Perplexity's `citations`, …) is information for the client (SPEC §15).
        let frame_other = raw.iter().any(|(k, v)| {
            !matches!(
                k.as_str(),
                "id" | "object"
                    | "created"
                    | "model"
                    | "system_fingerprint"
                    | "service_tier"
                    | "obfuscation"
                    | "choices"
                    | "usage"
            ) && !v.is_null()
        });
        if frame_other {
            return false;
        }
        // Another choice of an `n > 1` answer is for the client too (SPEC §17.5).
        let other_choice = raw
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter().any(|c| {
                    c.get("index")
                        .and_then(Value::as_u64)
                        .is_some_and(|i| i != 0)
                })
            });
        if other_choice {
            return false;
        }
        match choice0_ref(raw) {
            None => true,
            Some(c) => {
                let delta_other = c.get("delta").and_then(Value::as_object).is_some_and(|d| {
                    d.iter().any(|(k, v)| {
                        !matches!(
                            k.as_str(),
                            "role" | "content" | "reasoning_content" | "reasoning" | "tool_calls"
                        ) && !v.is_null()
                    })
                });
                let choice_other = c.iter().any(|(k, v)| {
                    !matches!(k.as_str(), "index" | "delta" | "finish_reason") && !v.is_null()
                });
                !(delta_other || choice_other)
            }
        }
    }

    /// Folds a later chunk of the same leg into this one, for a consumer that keeps
    /// text but not frames (an aggregated call's queued events): texts concatenate,
    /// tool-call fragments are appended (a continuation fragment of the last call is
    /// merged into it), the later finish reason, usage and model win, the first role
    /// stays. The raw frame is dropped: a merged chunk is no single frame.
    pub fn append(&mut self, later: StreamDelta) {
        fn cat(a: &mut Option<String>, b: Option<String>) {
            match (a.as_mut(), b) {
                (Some(x), Some(y)) => x.push_str(&y),
                (None, Some(y)) => *a = Some(y),
                (_, None) => {}
            }
        }
        cat(&mut self.content, later.content);
        cat(&mut self.reasoning, later.reasoning);
        for t in later.tool_calls {
            match self.tool_calls.last_mut() {
                Some(last) if last.index == t.index && t.id.is_none() && t.name.is_none() => {
                    last.arguments.push_str(&t.arguments);
                }
                _ => self.tool_calls.push(t),
            }
        }
        if self.role.is_none() {
            self.role = later.role;
        }
        if later.finish_reason.is_some() {
            self.finish_reason = later.finish_reason;
        }
        if later.usage.is_some() {
            self.usage = later.usage;
        }
        if later.model.is_some() {
            self.model = later.model;
        }
        self.raw = None;
        self.raw_text = None;
        self.native = None;
    }

    /// Removes `delta.role` (a resumed stream sends the role chunk once).
    pub fn strip_role(&mut self) {
        self.role = None;
        self.materialize_raw();
        if let Some(d) = self.raw_delta_mut() {
            d.remove("role");
        }
    }

    /// Removes the usage this frame carries (the gateway sends one summed usage at the
    /// end of a resumed stream).
    pub fn strip_usage(&mut self) {
        self.usage = None;
        self.materialize_raw();
        if let Some(raw) = self.raw.as_mut() {
            raw.remove("usage");
            if let Some(c) = choice0_mut(raw) {
                c.remove("usage");
            }
        }
    }

    /// Replaces the chunk's text: content, no reasoning, these tool-call fragments.
    /// The raw frame's choice-0 delta is rewritten to match (content as a string).
    ///
    /// The new content is the end of the chunk's own (a replay cut to what the caller
    /// does not have yet): choice 0's `logprobs.content` keeps only the tokens that lie
    /// wholly in it, so no token reaches the caller twice; when the tokens do not spell
    /// the chunk's content (nothing to align them with), they are dropped (`null`).
    pub fn set_text(&mut self, content: Option<String>, tool_calls: Vec<ToolCallDelta>) {
        self.reasoning = None;
        self.materialize_raw();
        let old = self.content.clone().unwrap_or_default();
        let new_len = content.as_ref().map_or(0, String::len);
        if let Some(c) = self.raw.as_mut().and_then(choice0_mut) {
            trim_logprobs(c, &old, old.len().saturating_sub(new_len));
        }
        if let Some(d) = self.raw_delta_mut() {
            d.remove("reasoning_content");
            d.remove("reasoning");
            match &content {
                Some(c) => {
                    d.insert("content".into(), Value::String(c.clone()));
                }
                None => {
                    d.remove("content");
                }
            }
            if tool_calls.is_empty() {
                d.remove("tool_calls");
            } else {
                d.insert(
                    "tool_calls".into(),
                    Value::Array(tool_calls.iter().map(ToolCallDelta::to_json).collect()),
                );
            }
        }
        self.content = content;
        self.tool_calls = tool_calls;
    }

    fn raw_delta_mut(&mut self) -> Option<&mut Map<String, Value>> {
        let c = choice0_mut(self.raw.as_mut()?)?;
        let d = c
            .entry("delta")
            .or_insert_with(|| Value::Object(Map::new()));
        if !d.is_object() {
            *d = Value::Object(Map::new());
        }
        d.as_object_mut()
    }
}

/// Choice 0 of a frame: the choice whose `index` is 0, or the first one without index.
fn choice0_pos(raw: &Map<String, Value>) -> Option<usize> {
    let choices = raw.get("choices")?.as_array()?;
    choices.iter().enumerate().find_map(|(pos, c)| {
        let c = c.as_object()?;
        let is0 = match c.get("index") {
            None => pos == 0,
            Some(v) => v.as_u64() == Some(0) || v.as_f64() == Some(0.0),
        };
        is0.then_some(pos)
    })
}

fn choice0_ref(raw: &Map<String, Value>) -> Option<&Map<String, Value>> {
    let pos = choice0_pos(raw)?;
    raw.get("choices")?.as_array()?.get(pos)?.as_object()
}

fn choice0_mut(raw: &mut Map<String, Value>) -> Option<&mut Map<String, Value>> {
    let pos = choice0_pos(raw)?;
    raw.get_mut("choices")?
        .as_array_mut()?
        .get_mut(pos)?
        .as_object_mut()
}

/// A fragment of a tool call in a stream.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ToolCallDelta {
    /// The tool call's index.
    pub index: u32,
    /// Its id, when this fragment carries a non-empty one.
    pub id: Option<String>,
    /// Its function name, when this fragment carries a non-empty one.
    pub name: Option<String>,
    /// An arguments fragment.
    pub arguments: String,
}

/// Keeps the `logprobs.content` tokens of a choice that start at or after byte `cut`
/// of `text` (the tokens must spell `text`; else they are set to `null`).
fn trim_logprobs(choice: &mut Map<String, Value>, text: &str, cut: usize) {
    let Some(lp) = choice.get_mut("logprobs").and_then(Value::as_object_mut) else {
        return;
    };
    let Some(tokens) = lp.get("content").and_then(Value::as_array) else {
        return;
    };
    let spelled: Option<String> = tokens
        .iter()
        .map(|t| t.get("token").and_then(Value::as_str))
        .collect();
    if spelled.as_deref() != Some(text) {
        if cut > 0 {
            lp.insert("content".into(), Value::Null);
        }
        return;
    }
    let mut at = 0usize;
    let kept: Vec<Value> = tokens
        .iter()
        .filter(|t| {
            let start = at;
            at += t.get("token").and_then(Value::as_str).map_or(0, str::len);
            start >= cut
        })
        .cloned()
        .collect();
    lp.insert("content".into(), Value::Array(kept));
}

impl ToolCallDelta {
    /// The fragment in OpenAI's wire shape.
    pub fn to_json(&self) -> Value {
        let mut f = Map::new();
        if let Some(n) = &self.name {
            f.insert("name".into(), Value::String(n.clone()));
        }
        f.insert("arguments".into(), Value::String(self.arguments.clone()));
        let mut c = Map::new();
        c.insert("index".into(), Value::from(self.index));
        if let Some(id) = &self.id {
            c.insert("id".into(), Value::String(id.clone()));
            c.insert("type".into(), Value::String("function".into()));
        }
        c.insert("function".into(), Value::Object(f));
        Value::Object(c)
    }
}

/// Called by the transport; must not block (it runs on the read path).
#[cfg_attr(any(test, feature = "mock"), mockall::automock)]
pub trait ChunkObserver: Send + Sync {
    /// An incremental chunk arrived at `at` (monotonic). Called only when
    /// [`ChunkObserver::wants_deltas`] is false; otherwise [`ChunkObserver::on_delta`]
    /// replaces it.
    fn on_chunk(&self, at: Instant);

    /// Whether the transport should build and pass [`StreamDelta`]s.
    fn wants_deltas(&self) -> bool {
        false
    }

    /// Whether the deltas should carry the upstream's whole frame (`raw`), for a proxy
    /// that passes every field through.
    fn wants_raw(&self) -> bool {
        false
    }

    /// Every parsed chunk (incremental or not), in order, when `wants_deltas()`; `at`
    /// is the arrival time of the read that carried it.
    fn on_delta(&self, _at: Instant, _delta: StreamDelta) {}

    /// A 2xx answer's headers arrived: those a proxy passes on ([`passed_headers`]),
    /// before any chunk.
    fn on_headers(&self, _headers: &[(String, String)]) {}
}

/// Whether an upstream response header is one a proxy passes on to its client (SPEC
/// §17.4): the upstream's `x-request-id`, and the `x-ratelimit-*` family.
pub fn passed_header(name: &str) -> bool {
    name.eq_ignore_ascii_case("x-request-id")
        // Anthropic's request id, and its rate-limit headers (SPEC §23.2).
        || name.eq_ignore_ascii_case("request-id")
        || name
            .get(..12)
            .is_some_and(|p| p.eq_ignore_ascii_case("x-ratelimit-"))
        || name
            .get(..20)
            .is_some_and(|p| p.eq_ignore_ascii_case("anthropic-ratelimit-"))
}

/// The passed headers of a response, in order (at most 32, values at most 256 bytes:
/// an upstream cannot make the proxy carry more).
pub fn passed_headers<'a>(
    headers: impl Iterator<Item = (&'a str, &'a [u8])>,
) -> Vec<(String, String)> {
    headers
        .filter(|(n, _)| passed_header(n))
        .filter_map(|(n, v)| {
            let v = std::str::from_utf8(v).ok()?;
            (v.len() <= 256).then(|| (n.to_ascii_lowercase(), v.to_string()))
        })
        .take(32)
        .collect()
}

/// An observer that ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NullObserver;

impl ChunkObserver for NullObserver {
    fn on_chunk(&self, _at: Instant) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn delta(raw: Value) -> StreamDelta {
        let raw = raw.as_object().cloned();
        StreamDelta {
            role: Some("assistant".into()),
            content: Some("Hello".into()),
            raw,
            ..Default::default()
        }
    }

    #[test]
    fn set_text_rewrites_the_raw_frame() {
        let mut d = delta(
            json!({"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":"Hello","reasoning_content":"r"},"logprobs":{"content":[]}}]}),
        );
        d.set_text(
            Some("lo".into()),
            vec![ToolCallDelta {
                index: 0,
                id: Some("c1".into()),
                name: Some("f".into()),
                arguments: "{".into(),
            }],
        );
        d.strip_role();
        let raw = Value::Object(d.raw.clone().unwrap());
        assert_eq!(
            raw["choices"][0]["delta"],
            json!({"content":"lo","tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"f","arguments":"{"}}]})
        );
        // The replay's tokens the caller already has are not sent again.
        assert_eq!(raw["choices"][0]["logprobs"], json!({"content":null}));
        assert_eq!(raw["id"], "x");
        assert_eq!(d.content.as_deref(), Some("lo"));
        assert!(d.role.is_none());
    }

    /// Issue 22, item 3: a replay chunk cut to its new text keeps only the logprob
    /// tokens of that text (a token across the cut was delivered in part: dropped).
    #[test]
    fn a_cut_chunk_keeps_only_the_logprobs_of_its_new_text() {
        let tok = |t: &str| json!({"token": t, "logprob": -0.1, "bytes": t.as_bytes(), "top_logprobs": []});
        let frame = json!({"id":"x","choices":[{"index":0,"delta":{"content":"Hello world"},
            "logprobs":{"content":[tok("Hel"), tok("lo"), tok(" wor"), tok("ld")]}}]});
        let of = |f: &Value| StreamDelta {
            content: Some("Hello world".into()),
            ..delta(f.clone())
        };
        let mut d = of(&frame);
        d.set_text(Some("world".into()), vec![]);
        let raw = Value::Object(d.raw.clone().unwrap());
        assert_eq!(raw["choices"][0]["logprobs"]["content"], json!([tok("ld")]));
        assert_eq!(raw["choices"][0]["delta"]["content"], "world");
        let mut d = of(&frame);
        d.set_text(Some(" world".into()), vec![]);
        let raw = Value::Object(d.raw.clone().unwrap());
        assert_eq!(
            raw["choices"][0]["logprobs"]["content"],
            json!([tok(" wor"), tok("ld")])
        );
        // Nothing cut: every token stays.
        let mut d = of(&frame);
        d.set_text(Some("Hello world".into()), vec![]);
        let raw = Value::Object(d.raw.clone().unwrap());
        assert_eq!(
            raw["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .len(),
            4
        );
    }

    #[test]
    fn empty_chunks_are_recognized() {
        let mut d = delta(json!({"choices":[{"index":0,"delta":{"role":"assistant"}}]}));
        d.content = None;
        assert!(!d.is_empty_chunk());
        d.strip_role();
        assert!(d.is_empty_chunk());
        // A refusal or logprobs field is something a client wants.
        let mut d =
            delta(json!({"choices":[{"index":0,"delta":{"role":"assistant","refusal":"no"}}]}));
        d.content = None;
        d.strip_role();
        assert!(!d.is_empty_chunk());
        // A frame-level extra (Azure's content filter results) is kept; the envelope
        // alone (OpenAI's `obfuscation` padding included) is not.
        let mut d =
            delta(json!({"choices":[],"id":"","prompt_filter_results":[{"prompt_index":0}]}));
        d.content = None;
        d.role = None;
        assert!(!d.is_empty_chunk());
        let mut d = delta(
            json!({"choices":[{"index":0,"delta":{}}],"id":"x","object":"chat.completion.chunk",
            "created":1,"model":"m","system_fingerprint":"fp","service_tier":"default","obfuscation":"ab","usage":null}),
        );
        d.content = None;
        d.role = None;
        assert!(d.is_empty_chunk());
    }

    fn as_text(d: StreamDelta) -> StreamDelta {
        let json = serde_json::to_string(d.raw.as_ref().unwrap()).unwrap();
        StreamDelta {
            raw: None,
            raw_text: Some(Box::new(RawText {
                json,
                ..Default::default()
            })),
            ..d
        }
    }

    #[test]
    fn a_frame_kept_as_text_is_read_and_edited_like_an_object() {
        let frame = json!({"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":"Hello"},"logprobs":null}]});
        let d = as_text(delta(frame.clone()));
        assert_eq!(Value::Object(d.raw_object().unwrap().into_owned()), frame);
        // An edit turns the text into the object first; the two never disagree.
        let mut e = d.clone();
        e.strip_role();
        assert!(e.raw_text.is_none());
        assert_eq!(
            Value::Object(e.raw.clone().unwrap())["choices"][0]["delta"],
            json!({"content":"Hello"})
        );
        let mut e = d.clone();
        e.set_text(Some("lo".into()), vec![]);
        assert_eq!(e.raw.unwrap()["choices"][0]["delta"]["content"], "lo");
        // Emptiness reads the text's fields as it reads an object's.
        let mut e = as_text(delta(
            json!({"choices":[{"index":0,"delta":{"refusal":"no"}}]}),
        ));
        e.content = None;
        e.role = None;
        assert!(!e.is_empty_chunk());
        let mut e = as_text(delta(json!({"choices":[{"index":0,"delta":{}}]})));
        e.content = None;
        e.role = None;
        assert!(e.is_empty_chunk());
    }

    #[test]
    fn strip_usage_removes_both_places() {
        let mut d = StreamDelta {
            usage: Some(Usage::new(1, 2)),
            raw: json!({"choices":[{"index":0,"delta":{},"usage":{"prompt_tokens":1}}],"usage":{"prompt_tokens":1}})
                .as_object()
                .cloned(),
            ..Default::default()
        };
        d.strip_usage();
        let raw = Value::Object(d.raw.unwrap());
        assert!(raw.get("usage").is_none());
        assert!(raw["choices"][0].get("usage").is_none());
    }
}
