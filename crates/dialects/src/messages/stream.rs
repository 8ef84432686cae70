//! [`MessagesStream`]: core stream deltas as Anthropic's Messages stream events, a pure
//! state machine. One content block is open at a time (thinking, text, tool_use); a
//! block is stopped when the content kind changes, and every started block is stopped
//! before `message_delta` and `message_stop`.

use std::collections::{BTreeMap, BTreeSet};

use polygw_core::ports::StreamDelta;
use polygw_core::resume::estimate_bytes;
use polygw_core::{LlmResponse, UsageSource};
use serde_json::{json, Value};

use super::output::{choice0, matched_stop, stop_reason, tool_input, tool_use_id, usage_json};
use super::translate::MessagesMeta;
use crate::sse::SseEvent;

/// How a tool_use block's input is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Nothing but blanks so far.
    Undecided,
    /// The arguments start as a JSON object: `input_json_delta`s as they come.
    Live,
    /// They do not: held, and sent whole at the stop as a JSON object
    /// ([`tool_input`]), so the input the client parses is always an object.
    Buffered,
}

#[derive(Debug, Clone)]
enum Block {
    Thinking,
    Text,
    /// A block of a kind this encoder does not write (a server tool's, a citation's),
    /// observed in a source's stream.
    Other,
    Tool {
        call: u32,
        arguments: String,
        held: String,
        mode: Mode,
    },
}

#[derive(Debug, Clone, Default)]
struct Pending {
    id: Option<String>,
    name: Option<String>,
    arguments: String,
}

/// The Messages event stream of one answer.
#[derive(Debug, Clone)]
pub struct MessagesStream {
    id: String,
    meta: MessagesMeta,
    input_estimate: u64,
    started: bool,
    done: bool,
    /// Blocks started so far (the next block's index).
    blocks: u32,
    open: Option<Block>,
    pending: BTreeMap<u32, Pending>,
    closed_calls: BTreeSet<u32>,
    /// Everything received, per kind (for the remainder at `finish` and the output
    /// estimate when usage is unknown).
    text: String,
    thinking: String,
    arguments_bytes: usize,
    tool_calls: bool,
    matched_stop: Option<String>,
    /// A source's `message_delta` was observed: the stream only lacks its stop.
    stop_pending: bool,
}

impl MessagesStream {
    /// A stream for the message `id`; `input_tokens_estimate` is `message_start`'s
    /// `usage.input_tokens` (the final count follows in `message_delta`).
    pub fn new(id: &str, meta: MessagesMeta, input_tokens_estimate: u64) -> Self {
        MessagesStream {
            id: id.to_string(),
            meta,
            input_estimate: input_tokens_estimate,
            started: false,
            done: false,
            blocks: 0,
            open: None,
            pending: BTreeMap::new(),
            closed_calls: BTreeSet::new(),
            text: String::new(),
            thinking: String::new(),
            arguments_bytes: 0,
            tool_calls: false,
            matched_stop: None,
            stop_pending: false,
        }
    }

    /// `message_start` with an empty message (once; `delta` and `finish` start the
    /// stream themselves when this was not called).
    pub fn start(&mut self) -> Vec<SseEvent> {
        let mut out = Vec::new();
        self.ensure_started(&mut out);
        out
    }

    /// A `ping` (keepalive), valid anywhere before the terminal event.
    pub fn ping(&self) -> SseEvent {
        SseEvent::new("ping", json!({"type": "ping"}))
    }

    /// The events of one delta: blocks started and stopped as the content kind
    /// changes, `text_delta`, `thinking_delta` (when thinking is on in the request),
    /// `input_json_delta`. Role-only, empty, usage-only and finish-only deltas emit
    /// nothing. Nothing after the terminal event.
    pub fn delta(&mut self, d: &StreamDelta) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        self.ensure_started(&mut out);
        if d.finish_reason.is_some() && self.matched_stop.is_none() {
            if let Some(raw) = d.raw_object() {
                self.matched_stop = matched_stop(choice0(&raw), &self.meta.stop_sequences);
            }
        }
        if let Some(r) = d.reasoning.as_deref().filter(|s| !s.is_empty()) {
            self.push_thinking(r, &mut out);
        }
        if let Some(c) = d.content.as_deref().filter(|s| !s.is_empty()) {
            self.push_text(c, &mut out);
        }
        for t in &d.tool_calls {
            let closed = self.closed_calls.contains(&t.index);
            if closed && t.arguments.is_empty() {
                // A repeated id or name on a closed call is harmless.
                continue;
            }
            if closed {
                out.extend(self.fail(
                    "api_error",
                    &format!(
                        "the upstream went back to tool call {} after starting another one; \
                         polygw cannot stream that call faithfully",
                        t.index
                    ),
                ));
                return out;
            }
            self.push_call(
                t.index,
                t.id.as_deref(),
                t.name.as_deref(),
                &t.arguments,
                false,
                &mut out,
            );
        }
        out
    }

    /// Ends the stream with the aggregated answer: what the deltas did not carry is
    /// sent first (a cache hit has no deltas), the open block is stopped, then
    /// `message_delta` (stop_reason, stop_sequence, usage) and `message_stop`.
    pub fn finish(&mut self, answer: &LlmResponse) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        self.ensure_started(&mut out);
        if self.stop_pending {
            // The source said how it ended; only its stop was lost.
            self.done = true;
            out.push(SseEvent::new(
                "message_stop",
                json!({"type": "message_stop"}),
            ));
            return out;
        }
        if let Some(rest) = answer
            .reasoning_content
            .as_deref()
            .and_then(|r| r.strip_prefix(self.thinking.as_str()))
            .filter(|r| !r.is_empty())
        {
            let rest = rest.to_string();
            self.push_thinking(&rest, &mut out);
        }
        if let Some(rest) = answer
            .content
            .strip_prefix(self.text.as_str())
            .filter(|r| !r.is_empty())
        {
            let rest = rest.to_string();
            self.push_text(&rest, &mut out);
        }
        for tc in &answer.tool_calls {
            if self.closed_calls.contains(&tc.index) {
                continue;
            }
            let seen = match (&self.open, self.pending.get(&tc.index)) {
                (
                    Some(Block::Tool {
                        call, arguments, ..
                    }),
                    _,
                ) if *call == tc.index => arguments.as_str(),
                (_, Some(p)) => p.arguments.as_str(),
                _ => "",
            };
            let rest = tc.arguments.strip_prefix(seen).unwrap_or("").to_string();
            self.push_call(
                tc.index,
                tc.id.as_deref(),
                tc.name.as_deref(),
                &rest,
                true,
                &mut out,
            );
        }
        let held: Vec<u32> = self.pending.keys().copied().collect();
        for index in held {
            self.push_call(index, None, None, "", true, &mut out);
        }
        self.close(&mut out);
        let matched = self.matched_stop.clone().or_else(|| {
            answer
                .upstream_object()
                .and_then(|u| matched_stop(choice0(&u), &self.meta.stop_sequences))
        });
        let (reason, sequence) = stop_reason(
            answer.finish_reason.as_deref(),
            self.tool_calls || !answer.tool_calls.is_empty(),
            matched.as_deref(),
        );
        let usage = if answer.usage_source == UsageSource::Unavailable {
            // Keep message_start's input estimate; count what was received.
            let bytes = self.text.len() + self.thinking.len() + self.arguments_bytes;
            json!({"output_tokens": estimate_bytes(bytes)})
        } else {
            usage_json(&answer.usage, answer.usage_source, self.input_estimate, 0)
        };
        out.push(SseEvent::new(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}),
        ));
        out.push(SseEvent::new(
            "message_stop",
            json!({"type": "message_stop"}),
        ));
        self.done = true;
        out
    }

    /// Ends a stream that failed after it started: `event: error` with
    /// `{"type":"error","error":{"type": error_type,"message": message}}` (the Anthropic
    /// SDK raises an `APIStatusError` carrying this body). Open blocks are not stopped:
    /// a partial tool_use is never handed over as complete.
    pub fn fail(&mut self, error_type: &str, message: &str) -> Vec<SseEvent> {
        if self.done {
            return Vec::new();
        }
        self.done = true;
        vec![SseEvent::new(
            "error",
            json!({"type": "error", "error": {"type": error_type, "message": message}}),
        )]
    }

    /// Follows an event of a `messages` source's stream that went to the client as
    /// received (SPEC §23.6): the blocks it started, filled and stopped become this
    /// encoder's, so that when another leg continues the answer, its deltas go on in
    /// the same stream — the open text block continued, the next block numbered after
    /// the last, a thinking block cut before its signature closed without one — and
    /// [`Self::finish`] ends it with one `message_delta` and one `message_stop`.
    pub fn observe(&mut self, event: &str, data: &Value) {
        let index = data.get("index").and_then(Value::as_u64).unwrap_or(0) as u32;
        match event {
            "message_start" => self.started = true,
            "content_block_start" => {
                self.started = true;
                let b = &data["content_block"];
                self.open = Some(match b["type"].as_str().unwrap_or_default() {
                    "text" => {
                        self.text.push_str(b["text"].as_str().unwrap_or_default());
                        Block::Text
                    }
                    "thinking" | "redacted_thinking" => Block::Thinking,
                    "tool_use" => {
                        self.tool_calls = true;
                        Block::Tool {
                            call: self.observed_calls(),
                            arguments: String::new(),
                            held: String::new(),
                            mode: Mode::Live,
                        }
                    }
                    _ => Block::Other,
                });
                self.blocks = self.blocks.max(index + 1);
            }
            "content_block_delta" => {
                let d = &data["delta"];
                let text = |k: &str| d[k].as_str().unwrap_or_default();
                match (d["type"].as_str().unwrap_or_default(), self.open.as_mut()) {
                    ("text_delta", _) => self.text.push_str(text("text")),
                    ("thinking_delta", _) => self.thinking.push_str(text("thinking")),
                    ("input_json_delta", Some(Block::Tool { arguments, .. })) => {
                        arguments.push_str(text("partial_json"))
                    }
                    _ => {}
                }
            }
            "content_block_stop" => {
                if let Some(Block::Tool { call, .. }) = self.open.take() {
                    self.closed_calls.insert(call);
                }
            }
            "message_delta" => self.stop_pending = true,
            "message_stop" => self.done = true,
            _ => {}
        }
    }

    /// The call index of the next `tool_use` block observed: calls are numbered in
    /// order (as core's reader numbers them).
    fn observed_calls(&self) -> u32 {
        let open = matches!(self.open, Some(Block::Tool { .. }));
        self.closed_calls.len() as u32 + u32::from(open)
    }

    /// Whether the terminal event was sent.
    pub fn is_done(&self) -> bool {
        self.done
    }

    // === impl MessagesStream: blocks ===

    fn ensure_started(&mut self, out: &mut Vec<SseEvent>) {
        if self.started {
            return;
        }
        self.started = true;
        out.push(SseEvent::new(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.meta.model(),
                "content": [], "stop_reason": null, "stop_sequence": null,
                // Numbers, never nulls (SPEC §25.5): agents size their context from it,
                // and the cache fields are not known yet (the final count comes in
                // `message_delta`).
                "usage": {"input_tokens": self.input_estimate, "output_tokens": 0,
                    "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
            }}),
        ));
    }

    fn start_block(&mut self, block: Block, content_block: Value, out: &mut Vec<SseEvent>) {
        self.close(out);
        out.push(SseEvent::new(
            "content_block_start",
            json!({"type": "content_block_start", "index": self.blocks, "content_block": content_block}),
        ));
        self.open = Some(block);
    }

    fn block_delta(&self, delta: Value) -> SseEvent {
        // The open block is the last one started.
        let index = self.blocks.saturating_sub(1);
        SseEvent::new(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        )
    }

    fn push_thinking(&mut self, r: &str, out: &mut Vec<SseEvent>) {
        self.thinking.push_str(r);
        if !self.meta.thinking_visible() {
            return;
        }
        if !matches!(self.open, Some(Block::Thinking)) {
            self.start_block(
                Block::Thinking,
                json!({"type": "thinking", "thinking": "", "signature": ""}),
                out,
            );
            self.blocks += 1;
        }
        out.push(self.block_delta(json!({"type": "thinking_delta", "thinking": r})));
    }

    fn push_text(&mut self, c: &str, out: &mut Vec<SseEvent>) {
        self.text.push_str(c);
        if !matches!(self.open, Some(Block::Text)) {
            self.start_block(Block::Text, json!({"type": "text", "text": ""}), out);
            self.blocks += 1;
        }
        out.push(self.block_delta(json!({"type": "text_delta", "text": c})));
    }

    fn push_call(
        &mut self,
        index: u32,
        id: Option<&str>,
        name: Option<&str>,
        arguments: &str,
        force: bool,
        out: &mut Vec<SseEvent>,
    ) {
        self.arguments_bytes += arguments.len();
        if let Some(Block::Tool { call, .. }) = &self.open {
            if *call == index {
                self.append_input(arguments, out);
                return;
            }
        }
        let p = self.pending.entry(index).or_default();
        if p.id.is_none() {
            p.id = id.filter(|s| !s.is_empty()).map(str::to_string);
        }
        if p.name.is_none() {
            p.name = name.filter(|s| !s.is_empty()).map(str::to_string);
        }
        if p.name.is_none() && force {
            p.name = Some(String::new());
        }
        p.arguments.push_str(arguments);
        let Some(chat) = p.name.clone() else {
            return;
        };
        let p = self.pending.remove(&index).unwrap_or_default();
        self.tool_calls = true;
        let tool_id = p.id.unwrap_or_else(|| tool_use_id(&self.id, index));
        let name = self.meta.tool_name(&chat).to_string();
        self.start_block(
            Block::Tool {
                call: index,
                arguments: String::new(),
                held: String::new(),
                mode: Mode::Undecided,
            },
            json!({"type": "tool_use", "id": tool_id, "name": name, "input": {}}),
            out,
        );
        self.blocks += 1;
        self.append_input(&p.arguments, out);
    }

    fn append_input(&mut self, a: &str, out: &mut Vec<SseEvent>) {
        if a.is_empty() {
            return;
        }
        let Some(Block::Tool {
            arguments,
            held,
            mode,
            ..
        }) = self.open.as_mut()
        else {
            return;
        };
        arguments.push_str(a);
        let send = match *mode {
            Mode::Live => Some(a.to_string()),
            Mode::Buffered => None,
            Mode::Undecided => {
                held.push_str(a);
                match held.trim_start().chars().next() {
                    None => None,
                    Some('{') => {
                        *mode = Mode::Live;
                        Some(std::mem::take(held))
                    }
                    Some(_) => {
                        *mode = Mode::Buffered;
                        None
                    }
                }
            }
        };
        if let Some(partial) = send {
            let ev = self.block_delta(json!({"type": "input_json_delta", "partial_json": partial}));
            out.push(ev);
        }
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        let Some(block) = self.open.take() else {
            return;
        };
        if let Block::Tool {
            call,
            arguments,
            mode,
            ..
        } = &block
        {
            self.closed_calls.insert(*call);
            if *mode == Mode::Buffered {
                let whole = tool_input(arguments).to_string();
                out.push(
                    self.block_delta(json!({"type": "input_json_delta", "partial_json": whole})),
                );
            }
        }
        out.push(SseEvent::new(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": self.blocks.saturating_sub(1)}),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{check_stream, parse_request, to_chat};
    use polygw_core::ports::ToolCallDelta;
    use polygw_core::{ToolCall, Usage};
    use serde_json::Map;

    fn meta(thinking: bool) -> MessagesMeta {
        let mut body = json!({"model": "claude", "max_tokens": 100, "stop_sequences": ["END"],
            "tools": [{"name": "Read", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "hi"}], "stream": true});
        if thinking {
            body["thinking"] = json!({"type": "adaptive"});
        }
        to_chat(&parse_request(body.to_string().as_bytes()).unwrap())
            .unwrap()
            .meta
    }

    fn types(ev: &[SseEvent]) -> Vec<String> {
        ev.iter()
            .map(|e| match e.data["delta"]["type"].as_str() {
                Some(t) if e.event == "content_block_delta" => t.to_string(),
                _ => e.event.clone(),
            })
            .collect()
    }

    fn frag(index: u32, id: Option<&str>, name: Option<&str>, args: &str) -> StreamDelta {
        StreamDelta {
            tool_calls: vec![ToolCallDelta {
                index,
                id: id.map(str::to_string),
                name: name.map(str::to_string),
                arguments: args.into(),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn thinking_text_and_tool_use_blocks_in_order() {
        let mut s = MessagesStream::new("msg_1", meta(true), 12);
        let mut ev = s.start();
        ev.push(s.ping());
        ev.extend(s.delta(&StreamDelta {
            reasoning: Some("hm".into()),
            ..Default::default()
        }));
        ev.extend(s.delta(&StreamDelta {
            content: Some("Hi".into()),
            ..Default::default()
        }));
        ev.extend(s.delta(&frag(0, Some("call_a"), Some("Read"), "{\"pa")));
        ev.extend(s.delta(&frag(0, None, None, "th\":\"x\"}")));
        ev.extend(s.delta(&frag(1, Some("call_b"), Some("Read"), "")));
        let answer = LlmResponse {
            content: "Hi".into(),
            reasoning_content: Some("hm".into()),
            tool_calls: vec![
                ToolCall {
                    index: 0,
                    id: Some("call_a".into()),
                    name: Some("Read".into()),
                    arguments: "{\"path\":\"x\"}".into(),
                },
                ToolCall {
                    index: 1,
                    id: Some("call_b".into()),
                    name: Some("Read".into()),
                    arguments: String::new(),
                },
            ],
            finish_reason: Some("tool_calls".into()),
            usage: Usage {
                cached_prompt_tokens: Some(8),
                ..Usage::new(20, 5)
            },
            usage_source: UsageSource::Measured,
            ..Default::default()
        };
        ev.extend(s.finish(&answer));
        assert!(s.finish(&answer).is_empty());
        assert_eq!(
            types(&ev),
            [
                "message_start",
                "ping",
                "content_block_start",
                "thinking_delta",
                "content_block_stop",
                "content_block_start",
                "text_delta",
                "content_block_stop",
                "content_block_start",
                "input_json_delta",
                "input_json_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        // SPEC §25.5: message_start's usage holds numbers only.
        let start = &ev[0].data["message"]["usage"];
        for (k, v) in start.as_object().unwrap() {
            assert!(v.is_u64(), "message_start usage {k}: {v}");
        }
        let fin = check_stream(&ev).unwrap();
        assert_eq!((fin.text.as_str(), fin.thinking.as_str()), ("Hi", "hm"));
        assert_eq!(fin.tool_calls[0].input, json!({"path": "x"}));
        assert_eq!(fin.tool_calls[1].input, json!({}));
        assert_eq!(fin.stop_reason.as_deref(), Some("tool_use"));
        assert_eq!(fin.usage["input_tokens"], 12);
        assert_eq!(fin.usage["cache_read_input_tokens"], 8);
    }

    #[test]
    fn non_object_arguments_are_sent_whole_as_an_object() {
        let mut s = MessagesStream::new("msg_2", meta(false), 1);
        let mut ev = s.start();
        ev.extend(s.delta(&frag(0, None, Some("Read"), " [1,")));
        ev.extend(s.delta(&frag(0, None, None, "2]")));
        ev.extend(s.finish(&LlmResponse {
            tool_calls: vec![ToolCall {
                index: 0,
                id: None,
                name: Some("Read".into()),
                arguments: " [1,2]".into(),
            }],
            ..Default::default()
        }));
        let fin = check_stream(&ev).unwrap();
        assert_eq!(
            fin.tool_calls[0].input,
            json!({"_polygw_raw_arguments": " [1,2]"})
        );
        assert_eq!(fin.tool_calls[0].id, "toolu_2_0");
        // Usage unknown: the start's estimate stays, the output is estimated.
        assert_eq!(fin.usage["input_tokens"], 1);
        assert_eq!(fin.usage["output_tokens"], 2);
    }

    #[test]
    fn hidden_thinking_a_stop_sequence_and_a_failure() {
        let mut s = MessagesStream::new("msg_3", meta(false), 1);
        let mut ev = s.start();
        ev.extend(s.delta(&StreamDelta {
            reasoning: Some("secret".into()),
            ..Default::default()
        }));
        ev.extend(s.delta(&StreamDelta {
            content: Some("a".into()),
            ..Default::default()
        }));
        let mut raw = Map::new();
        raw.insert(
            "choices".into(),
            json!([{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]),
        );
        ev.extend(s.delta(&StreamDelta {
            finish_reason: Some("stop".into()),
            raw: Some(raw),
            ..Default::default()
        }));
        ev.extend(s.finish(&LlmResponse {
            content: "a".into(),
            finish_reason: Some("stop".into()),
            ..Default::default()
        }));
        let fin = check_stream(&ev).unwrap();
        assert_eq!(fin.thinking, "");
        assert_eq!(
            (fin.stop_reason.as_deref(), fin.stop_sequence.as_deref()),
            (Some("stop_sequence"), Some("END"))
        );

        let mut s = MessagesStream::new("msg_4", meta(false), 1);
        let mut ev = s.start();
        ev.extend(s.delta(&frag(0, None, Some("Read"), "{")));
        ev.extend(s.fail("overloaded_error", "all sources are busy"));
        assert!(s
            .delta(&StreamDelta {
                content: Some("x".into()),
                ..Default::default()
            })
            .is_empty());
        let fin = check_stream(&ev).unwrap();
        assert_eq!(
            fin.error,
            Some(("overloaded_error".into(), "all sources are busy".into()))
        );
    }
}
