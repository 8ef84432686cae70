//! What Anthropic's Messages events mean to the engine (SPEC §23.4), pure: the first
//! content event, the answer's text (for telemetry's estimates and the aggregate),
//! tool calls, the stop reason, and usage — cumulative, per field the last value wins —
//! and an `error` event. The events themselves reach the client unchanged
//! ([`super::NativeEvent`]).

use serde_json::{Map, Value};

use crate::ports::{StreamDelta, ToolCallDelta};
use crate::response::Usage;

use super::{NativeError, PlainAnswer, ReadError};

/// Anthropic's usage fields as the stream has reported them so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MessagesUsage {
    /// `input_tokens`: the prompt tokens neither read from nor written to the cache.
    pub input: Option<u64>,
    /// `output_tokens` (thinking included).
    pub output: Option<u64>,
    /// `cache_read_input_tokens`.
    pub cache_read: Option<u64>,
    /// `cache_creation_input_tokens` (5-minute and 1-hour writes).
    pub cache_write: Option<u64>,
    /// `cache_creation.ephemeral_1h_input_tokens`: the part of the writes kept an hour.
    pub cache_write_1h: Option<u64>,
}

impl MessagesUsage {
    /// Folds a `usage` object: every field it carries replaces the one before
    /// (cumulative figures; a `null` changes nothing).
    pub fn fold(&mut self, u: &Map<String, Value>) {
        let get = |k: &str| u.get(k).and_then(Value::as_u64);
        if let Some(v) = get("input_tokens") {
            self.input = Some(v);
        }
        if let Some(v) = get("output_tokens") {
            self.output = Some(v);
        }
        if let Some(v) = get("cache_read_input_tokens") {
            self.cache_read = Some(v);
        }
        if let Some(v) = get("cache_creation_input_tokens") {
            self.cache_write = Some(v);
        }
        if let Some(v) = u
            .get("cache_creation")
            .and_then(|c| c.get("ephemeral_1h_input_tokens"))
            .and_then(Value::as_u64)
        {
            self.cache_write_1h = Some(v);
        }
    }

    /// Whether any figure was reported.
    pub fn is_known(&self) -> bool {
        self.input.is_some() || self.output.is_some()
    }

    /// As polygw counts usage: the prompt is every input token, cache reads and writes
    /// included (each part priced at its own rate, SPEC §20.1).
    pub fn to_usage(&self) -> Usage {
        let read = self.cache_read.unwrap_or(0);
        let write = self.cache_write.unwrap_or(0);
        Usage {
            prompt_tokens: self.input.unwrap_or(0) + read + write,
            completion_tokens: self.output.unwrap_or(0),
            reasoning_tokens: None,
            cached_prompt_tokens: self.cache_read,
            cache_write_tokens: self.cache_write,
            // A part of the writes, never more than they are.
            cache_write_1h_tokens: self.cache_write_1h.map(|h| h.min(write)),
        }
    }
}

/// Chat's finish reason for a Messages `stop_reason` (what the engine's rules read:
/// `length` is a cut answer, `tool_calls` a tool round).
pub fn finish_reason(stop_reason: &str) -> &str {
    match stop_reason {
        "end_turn" | "stop_sequence" => "stop",
        "max_tokens" | "model_context_window_exceeded" => "length",
        "tool_use" => "tool_calls",
        "refusal" => "content_filter",
        other => other,
    }
}

/// The error object of a Messages error body or event (`{"type":"error","error":{…}}`).
pub fn error_of(obj: &Map<String, Value>) -> Option<NativeError> {
    let e = obj.get("error")?.as_object()?;
    let s = |k: &str| e.get(k).and_then(Value::as_str).map(str::to_string);
    Some(NativeError {
        kind: s("type"),
        message: s("message"),
    })
}

/// Reads one Messages stream, event by event.
#[derive(Debug, Clone, Default)]
pub struct MessagesReader {
    /// The indices of open server-tool blocks (`server_tool_use`): the tool runs after
    /// its block stops.
    server_tools: Vec<u32>,
    /// The block indices of the `tool_use` blocks, in order: a tool call's index is
    /// its position here (0, 1, … whatever blocks come between), as a chat or Responses
    /// client numbers its calls (SPEC §23.3).
    tool_blocks: Vec<u32>,
    usage: MessagesUsage,
    stop_reason: Option<String>,
    done: bool,
    events: u64,
}

impl MessagesReader {
    /// A reader at the start of a stream.
    pub fn new() -> Self {
        MessagesReader::default()
    }

    /// Usage so far.
    pub fn usage(&self) -> MessagesUsage {
        self.usage
    }

    /// The `stop_reason`, once `message_delta` said it.
    pub fn stop_reason(&self) -> Option<&str> {
        self.stop_reason.as_deref()
    }

    /// Whether `message_stop` came.
    pub fn done(&self) -> bool {
        self.done
    }

    /// Reads one event: what it means as a [`StreamDelta`] whose `native` is the event
    /// itself (every event is for the client, pings included).
    pub fn on_event(&mut self, event: Option<&str>, data: &str) -> Result<StreamDelta, ReadError> {
        self.events += 1;
        let (obj, kind) = super::typed_event(event, data, self.events)?;
        if kind == "error" || event == Some("error") {
            return Err(ReadError::Provider(error_of(&obj).unwrap_or_default()));
        }
        let mut d = StreamDelta::default();
        let mut progress = false;
        let mut patient = false;
        let mut opaque = false;
        match kind.as_str() {
            "message_start" => {
                let m = obj.get("message").and_then(Value::as_object);
                d.role = Some("assistant".into());
                d.model = m
                    .and_then(|m| m.get("model"))
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string);
                if let Some(u) = m.and_then(|m| m.get("usage")).and_then(Value::as_object) {
                    self.usage.fold(u);
                    d.usage = Some(self.usage.to_usage());
                }
            }
            "content_block_start" => {
                progress = true;
                let index = index_of(&obj);
                if let Some(b) = obj.get("content_block").and_then(Value::as_object) {
                    let s = |k: &str| b.get(k).and_then(Value::as_str);
                    match s("type").unwrap_or_default() {
                        "text" => d.content = s("text").filter(|t| !t.is_empty()).map(Into::into),
                        "thinking" => {
                            d.reasoning = s("thinking").filter(|t| !t.is_empty()).map(Into::into)
                        }
                        "tool_use" => d.tool_calls.push(ToolCallDelta {
                            index: {
                                self.tool_blocks.push(index);
                                self.tool_blocks.len() as u32 - 1
                            },
                            id: s("id").map(Into::into),
                            name: s("name").map(Into::into),
                            arguments: String::new(),
                        }),
                        // Thinking may stream no deltas (`display: "omitted"`).
                        "redacted_thinking" => patient = true,
                        "server_tool_use" => {
                            self.server_tools.push(index);
                            opaque = true;
                        }
                        // Server tools' results and any block added after polygw was
                        // written.
                        _ => opaque = true,
                    }
                    patient |= s("type") == Some("thinking");
                }
            }
            "content_block_stop" => {
                // A server tool runs once its call is complete, silently.
                let index = index_of(&obj);
                if let Some(i) = self.server_tools.iter().position(|&t| t == index) {
                    self.server_tools.swap_remove(i);
                    patient = true;
                }
            }
            "content_block_delta" => {
                progress = true;
                let index = index_of(&obj);
                if let Some(x) = obj.get("delta").and_then(Value::as_object) {
                    let s = |k: &str| x.get(k).and_then(Value::as_str);
                    match s("type").unwrap_or_default() {
                        "text_delta" => d.content = s("text").map(Into::into),
                        "thinking_delta" => d.reasoning = s("thinking").map(Into::into),
                        "input_json_delta" => {
                            // A server tool's input is not a call of the client's.
                            let call = self.tool_blocks.iter().position(|&b| b == index);
                            if let (Some(p), Some(call)) = (s("partial_json"), call) {
                                d.tool_calls.push(ToolCallDelta {
                                    index: call as u32,
                                    id: None,
                                    name: None,
                                    arguments: p.to_string(),
                                });
                            }
                        }
                        _ => {}
                    }
                }
            }
            "message_delta" => {
                if let Some(r) = obj
                    .get("delta")
                    .and_then(|x| x.get("stop_reason"))
                    .and_then(Value::as_str)
                {
                    self.stop_reason = Some(r.to_string());
                    d.finish_reason = Some(finish_reason(r).to_string());
                }
                if let Some(u) = obj.get("usage").and_then(Value::as_object) {
                    self.usage.fold(u);
                    d.usage = Some(self.usage.to_usage());
                }
            }
            "message_stop" => self.done = true,
            // `ping`, `content_block_stop`, and event types added after polygw was
            // written: for the client, not progress.
            _ => {}
        }
        d.native = Some(super::as_received(
            crate::source::SourceApi::Messages,
            event,
            data,
            progress,
            patient,
            opaque,
        ));
        Ok(d)
    }
}

fn index_of(obj: &Map<String, Value>) -> u32 {
    obj.get("index")
        .and_then(Value::as_u64)
        .and_then(|i| u32::try_from(i).ok())
        .unwrap_or(0)
}

/// Reads a plain Messages answer (a `message` object).
pub fn read_message(obj: &Map<String, Value>) -> PlainAnswer {
    let mut a = PlainAnswer {
        model: obj.get("model").and_then(Value::as_str).map(str::to_string),
        finish_reason: obj
            .get("stop_reason")
            .and_then(Value::as_str)
            .map(|r| finish_reason(r).to_string()),
        ..PlainAnswer::default()
    };
    if let Some(u) = obj.get("usage").and_then(Value::as_object) {
        let mut usage = MessagesUsage::default();
        usage.fold(u);
        a.usage = usage.is_known().then(|| usage.to_usage());
    }
    for b in obj
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(b) = b.as_object() else { continue };
        a.has_blocks = true;
        let s = |k: &str| b.get(k).and_then(Value::as_str);
        match s("type").unwrap_or_default() {
            "text" => a.content.push_str(s("text").unwrap_or_default()),
            "thinking" => a.reasoning.push_str(s("thinking").unwrap_or_default()),
            "tool_use" => a.tool_calls.push((
                a.tool_calls.len() as u32,
                s("id").map(Into::into),
                s("name").map(Into::into),
                b.get("input").map_or_else(|| "{}".into(), Value::to_string),
            )),
            _ => {}
        }
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn ev(r: &mut MessagesReader, name: &str, v: Value) -> StreamDelta {
        r.on_event(Some(name), &v.to_string()).unwrap()
    }

    #[test]
    fn a_stream_reads_as_its_text_tools_stop_and_usage() {
        let mut r = MessagesReader::new();
        let d = ev(
            &mut r,
            "message_start",
            json!({"type":"message_start","message":{"id":"msg_1","model":"claude-x","usage":{"input_tokens":10,"cache_read_input_tokens":100,"cache_creation_input_tokens":20,"output_tokens":1}}}),
        );
        assert!(!d.is_incremental());
        assert_eq!(d.model.as_deref(), Some("claude-x"));
        assert_eq!(d.usage.unwrap().prompt_tokens, 130);
        let d = ev(&mut r, "ping", json!({"type":"ping"}));
        assert!(!d.is_incremental() && !d.is_empty_chunk());
        // An empty text block's start is already the first content event.
        let d = ev(
            &mut r,
            "content_block_start",
            json!({"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}),
        );
        assert!(d.is_incremental());
        let d = ev(
            &mut r,
            "content_block_delta",
            json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}),
        );
        assert_eq!(d.content.as_deref(), Some("Hi"));
        ev(
            &mut r,
            "content_block_stop",
            json!({"type":"content_block_stop","index":0}),
        );
        let d = ev(
            &mut r,
            "content_block_start",
            json!({"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"get","input":{}}}),
        );
        assert_eq!(d.tool_calls[0].name.as_deref(), Some("get"));
        let d = ev(
            &mut r,
            "content_block_delta",
            json!({"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"a\":1}"}}),
        );
        assert_eq!(d.tool_calls[0].arguments, "{\"a\":1}");
        assert_eq!(
            d.tool_calls[0].index, 0,
            "the first call, whatever its block"
        );
        let d = ev(
            &mut r,
            "message_delta",
            json!({"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":42}}),
        );
        assert_eq!(d.finish_reason.as_deref(), Some("tool_calls"));
        let u = d.usage.unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (130, 42));
        assert_eq!(
            (u.cached_prompt_tokens, u.cache_write_tokens),
            (Some(100), Some(20))
        );
        ev(&mut r, "message_stop", json!({"type":"message_stop"}));
        assert!(r.done());
    }

    #[test]
    fn signature_and_redacted_blocks_are_progress_and_errors_are_read() {
        let mut r = MessagesReader::new();
        let d = ev(
            &mut r,
            "content_block_delta",
            json!({"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"abc"}}),
        );
        assert!(d.is_incremental());
        let d = ev(
            &mut r,
            "content_block_start",
            json!({"type":"content_block_start","index":1,"content_block":{"type":"redacted_thinking","data":"x"}}),
        );
        assert!(d.is_incremental());
        let e = r
            .on_event(
                Some("error"),
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
            )
            .unwrap_err();
        assert_eq!(
            e,
            ReadError::Provider(NativeError {
                kind: Some("overloaded_error".into()),
                message: Some("Overloaded".into())
            })
        );
        assert!(matches!(
            r.on_event(None, "[1,2]"),
            Err(ReadError::Malformed(_))
        ));
        assert!(matches!(
            r.on_event(Some("ping"), "{"),
            Err(ReadError::Malformed(_))
        ));
        // An unknown event type passes, not as progress.
        let d = r
            .on_event(Some("future_event"), r#"{"type":"future_event","x":1}"#)
            .unwrap();
        assert!(!d.is_incremental());
        assert_eq!(d.native.unwrap().event.as_deref(), Some("future_event"));
    }

    /// SPEC §23.4: a thinking block's start and a server tool's completed call are
    /// followed by a silence that is no stall; a text delta is not.
    #[test]
    fn silences_that_are_not_stalls_are_marked() {
        let mut r = MessagesReader::new();
        let patient = |d: StreamDelta| d.native.unwrap().patient;
        let d = ev(
            &mut r,
            "content_block_start",
            json!({"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}),
        );
        assert!(patient(d));
        let d = ev(
            &mut r,
            "content_block_start",
            json!({"type":"content_block_start","index":1,"content_block":{"type":"server_tool_use","id":"srvtoolu_1","name":"web_search","input":{}}}),
        );
        assert!(!patient(d));
        let d = ev(
            &mut r,
            "content_block_stop",
            json!({"type":"content_block_stop","index":1}),
        );
        assert!(patient(d));
        let d = ev(
            &mut r,
            "content_block_delta",
            json!({"type":"content_block_delta","index":2,"delta":{"type":"text_delta","text":"x"}}),
        );
        assert!(!patient(d));
        let d = ev(
            &mut r,
            "content_block_stop",
            json!({"type":"content_block_stop","index":2}),
        );
        assert!(!patient(d));
    }

    /// SPEC §23.6: a block a prefill cannot carry (a server tool's call or result, a
    /// type polygw does not read) is marked opaque; text, thinking and the client's
    /// tool calls are not — and a transcript that absorbed one is not prefillable.
    #[test]
    fn blocks_a_prefill_cannot_carry_are_opaque() {
        let mut r = MessagesReader::new();
        let mut t = crate::resume::Transcript::default();
        let mut start = |r: &mut MessagesReader, i: u32, block: Value| {
            let d = ev(
                r,
                "content_block_start",
                json!({"type":"content_block_start","index":i,"content_block":block}),
            );
            t.absorb(&d);
            (d.native.unwrap().opaque, t.prefillable())
        };
        assert_eq!(
            start(&mut r, 0, json!({"type":"thinking","thinking":""})),
            (false, true)
        );
        assert_eq!(
            start(&mut r, 1, json!({"type":"text","text":""})),
            (false, true)
        );
        assert_eq!(
            start(
                &mut r,
                2,
                json!({"type":"server_tool_use","id":"srvtoolu_1","name":"web_search","input":{}})
            ),
            (true, false)
        );
        let mut r = MessagesReader::new();
        let mut t = crate::resume::Transcript::default();
        let d = ev(
            &mut r,
            "content_block_start",
            json!({"type":"content_block_start","index":0,"content_block":{"type":"web_search_tool_result","tool_use_id":"srvtoolu_1","content":[]}}),
        );
        t.absorb(&d);
        assert!(d.native.unwrap().opaque && !t.prefillable());
        let d = ev(
            &mut r,
            "content_block_start",
            json!({"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"get","input":{}}}),
        );
        assert!(!d.native.unwrap().opaque, "a client's call is not opaque");
    }

    #[test]
    fn a_plain_answer_reads_as_its_blocks() {
        let m = json!({"id":"msg_1","type":"message","model":"m","stop_reason":"end_turn",
            "content":[{"type":"thinking","thinking":"hm","signature":"s"},{"type":"text","text":"ok"},
                       {"type":"tool_use","id":"t","name":"f","input":{"a":1}}],
            "usage":{"input_tokens":5,"output_tokens":7,"cache_read_input_tokens":3}});
        let a = read_message(m.as_object().unwrap());
        assert_eq!((a.content.as_str(), a.reasoning.as_str()), ("ok", "hm"));
        assert_eq!(a.finish_reason.as_deref(), Some("stop"));
        assert_eq!(
            a.tool_calls,
            vec![(0, Some("t".into()), Some("f".into()), "{\"a\":1}".into())]
        );
        assert_eq!(a.usage.unwrap().prompt_tokens, 8);
    }

    proptest! {
        /// Usage is cumulative: whatever events carry usage, and in whatever split,
        /// each field is the last value reported for it, and the prompt is the sum of
        /// its three parts.
        #[test]
        fn usage_is_per_field_last_value_wins(
            reports in prop::collection::vec(
                (prop::option::of(0u64..1_000_000), prop::option::of(0u64..1_000_000),
                 prop::option::of(0u64..1_000_000), prop::option::of(0u64..1_000_000)),
                1..8),
        ) {
            let mut r = MessagesReader::new();
            let mut want = MessagesUsage::default();
            for (i, (inp, out, read, write)) in reports.iter().enumerate() {
                let mut u = Map::new();
                let mut put = |k: &str, v: &Option<u64>| {
                    u.insert(k.into(), v.map_or(Value::Null, Value::from));
                };
                put("input_tokens", inp);
                put("output_tokens", out);
                put("cache_read_input_tokens", read);
                put("cache_creation_input_tokens", write);
                let v = if i == 0 {
                    json!({"type":"message_start","message":{"usage":u}})
                } else {
                    json!({"type":"message_delta","delta":{},"usage":u})
                };
                let name = v["type"].as_str().unwrap().to_string();
                r.on_event(Some(&name), &v.to_string()).unwrap();
                want.input = inp.or(want.input);
                want.output = out.or(want.output);
                want.cache_read = read.or(want.cache_read);
                want.cache_write = write.or(want.cache_write);
            }
            prop_assert_eq!(r.usage(), want);
            let u = r.usage().to_usage();
            prop_assert_eq!(
                u.prompt_tokens,
                want.input.unwrap_or(0) + want.cache_read.unwrap_or(0) + want.cache_write.unwrap_or(0)
            );
        }
    }
}
