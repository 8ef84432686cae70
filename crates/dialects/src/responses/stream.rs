//! [`ResponsesStream`]: core stream deltas as the Responses API's typed events, a pure
//! state machine. One output item is open at a time; an item is closed (every `.done`
//! event, then `response.output_item.done` with the whole item) when the content kind
//! changes, and the stream ends with exactly one terminal event carrying the whole
//! response.

use std::collections::{BTreeMap, BTreeSet};

use polygw_core::ports::StreamDelta;
use polygw_core::LlmResponse;
use serde_json::{json, Map, Value};

use super::output::{
    call_id, call_item, call_prefix, item_id, message_item, reasoning_item, response_value,
    status_of, text_part, usage_json, with_usage_source,
};
use super::tools::{ToolKind, ToolTarget};
use super::translate::ResponsesMeta;
use crate::sse::SseEvent;

/// The item being streamed.
#[derive(Debug, Clone)]
enum Open {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    Call {
        /// The chat tool call's index.
        index: u32,
        id: String,
        call_id: String,
        chat_name: String,
        target: Option<ToolTarget>,
        arguments: String,
        /// Whether `output_item.added` was sent (built-in calls announce at the end,
        /// once their item type is known from the whole arguments).
        announced: bool,
    },
}

/// A tool call seen before its name: held until the name (and so its kind) is known.
#[derive(Debug, Clone, Default)]
struct Pending {
    id: Option<String>,
    name: Option<String>,
    arguments: String,
}

/// The Responses event stream of one answer.
#[derive(Debug, Clone)]
pub struct ResponsesStream {
    id: String,
    created_at: u64,
    meta: ResponsesMeta,
    seq: u64,
    started: bool,
    /// Closed items, by output index.
    items: Vec<Value>,
    open: Option<Open>,
    pending: BTreeMap<u32, Pending>,
    /// Tool calls whose item is closed.
    closed_calls: BTreeSet<u32>,
    /// Every reasoning / answer text streamed so far.
    reasoning: String,
    text: String,
    /// Whether a message or a tool call was ever streamed.
    answered: bool,
    response: Option<Value>,
    /// Which `.done` events of the open item a source's stream already sent: the item
    /// takes no more content ([`Self::sealed`]), and closing it does not send those
    /// parts again.
    parts_done: BTreeSet<String>,
    /// The open message or reasoning item was observed added, its part not yet.
    part_pending: bool,
}

impl ResponsesStream {
    /// A stream for the response `id` (created at `created_at`, Unix seconds).
    pub fn new(id: &str, created_at: u64, meta: ResponsesMeta) -> Self {
        ResponsesStream {
            id: id.to_string(),
            created_at,
            meta,
            seq: 0,
            started: false,
            items: Vec::new(),
            open: None,
            pending: BTreeMap::new(),
            closed_calls: BTreeSet::new(),
            reasoning: String::new(),
            text: String::new(),
            answered: false,
            response: None,
            parts_done: BTreeSet::new(),
            part_pending: false,
        }
    }

    /// `response.created` and `response.in_progress` (once; the other methods start
    /// the stream themselves when this was not called).
    pub fn start(&mut self) -> Vec<SseEvent> {
        let mut out = Vec::new();
        self.ensure_started(&mut out);
        out
    }

    /// The events of one delta: items opened and closed as the content kind changes,
    /// text, reasoning summary and argument deltas. Role-only, empty, usage-only and
    /// finish-only deltas emit nothing. Nothing after the terminal event.
    pub fn delta(&mut self, d: &StreamDelta) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if self.is_done() {
            return out;
        }
        self.ensure_started(&mut out);
        if let Some(r) = d.reasoning.as_deref().filter(|s| !s.is_empty()) {
            self.push_reasoning(r, &mut out);
        }
        if let Some(c) = d.content.as_deref().filter(|s| !s.is_empty()) {
            self.push_text(c, &mut out);
        }
        for t in &d.tool_calls {
            // A repeated id or name on a closed call is harmless; more arguments are not.
            let closed = self.closed_calls.contains(&t.index);
            if closed && t.arguments.is_empty() {
                continue;
            }
            if closed {
                out.extend(self.fail(
                    "server_error",
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

    /// Ends the stream with the aggregated answer: whatever of the answer the deltas
    /// did not carry is sent first (a cache hit has no deltas at all), every open item
    /// is completed, then `response.completed` (or `response.incomplete` when
    /// `finish_reason` is `length` / `content_filter`) with the whole response.
    pub fn finish(&mut self, answer: &LlmResponse) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if self.is_done() {
            return out;
        }
        self.ensure_started(&mut out);
        if let Some(rest) = answer
            .reasoning_content
            .as_deref()
            .and_then(|r| r.strip_prefix(self.reasoning.as_str()))
            .filter(|r| !r.is_empty())
        {
            let rest = rest.to_string();
            self.push_reasoning(&rest, &mut out);
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
                    Some(Open::Call {
                        index, arguments, ..
                    }),
                    _,
                ) if *index == tc.index => arguments.as_str(),
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
        let (status, incomplete) = status_of(answer.finish_reason.as_deref());
        if !self.answered {
            self.open_message(&mut out);
        }
        self.close(status, &mut out);
        let model = if answer.model.is_empty() {
            self.meta.model().to_string()
        } else {
            answer.model.clone()
        };
        let response = with_usage_source(
            response_value(
                &self.id,
                self.created_at,
                &model,
                &self.meta,
                status,
                incomplete,
                self.items.clone(),
                usage_json(&answer.usage, answer.usage_source),
                Value::Null,
            ),
            answer.usage_source,
        );
        let ty = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        out.push(self.event(ty, obj(json!({"response": response.clone()}))));
        self.response = Some(response);
        out
    }

    /// Ends a stream that failed after it started: an `error` event (its fields flat,
    /// as the API reference documents them, and nested under `error`, as the live API
    /// sends them, so that openai-python raises an `APIError` with this message), then
    /// `response.failed` (the terminal event, `response.error` = `{code, message}`, as
    /// Codex reads it), whose output holds the items so far (the open one
    /// `incomplete`). Open items get no `.done` events: a partial call is never handed
    /// over as complete.
    pub fn fail(&mut self, code: &str, message: &str) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if self.is_done() {
            return out;
        }
        self.ensure_started(&mut out);
        let error = json!({"type": code, "code": code, "message": message, "param": null});
        out.push(self.event(
            "error",
            obj(json!({"code": code, "message": message, "param": null, "error": error})),
        ));
        let mut output = self.items.clone();
        if let Some(open) = self.open.take() {
            output.push(self.snapshot(&open, "incomplete"));
        }
        let response = response_value(
            &self.id,
            self.created_at,
            self.meta.model(),
            &self.meta,
            "failed",
            None,
            output,
            Value::Null,
            json!({"code": code, "message": message}),
        );
        out.push(self.event(
            "response.failed",
            obj(json!({"response": response.clone()})),
        ));
        self.response = Some(response);
        out
    }

    /// Whether the terminal event was sent.
    pub fn is_done(&self) -> bool {
        self.response.is_some()
    }

    /// The whole response as the terminal event carried it (what to store), once sent.
    pub fn response(&self) -> Option<&Value> {
        self.response.as_ref()
    }

    /// The output items completed so far (after `finish`: every item, what to store).
    pub fn output_items(&self) -> &[Value] {
        &self.items
    }

    /// Follows an event of a `responses` source's stream that went to the client as
    /// received (SPEC §23.6): the response's id and creation time, the sequence
    /// numbers, the items added, filled and done become this encoder's, so that when
    /// another leg continues the answer its deltas go on in the same stream —
    /// `sequence_number`s contiguous, the open message continued, the next item after
    /// the last — and [`Self::finish`] ends it with one `response.completed` carrying
    /// the whole output.
    pub fn observe(&mut self, data: &Value) {
        if let Some(n) = data.get("sequence_number").and_then(Value::as_u64) {
            self.seq = self.seq.max(n + 1);
        }
        let text = |k: &str| data[k].as_str().unwrap_or_default().to_string();
        match data["type"].as_str().unwrap_or_default() {
            "response.created" | "response.in_progress" => {
                self.started = true;
                let r = &data["response"];
                if let Some(id) = r["id"].as_str() {
                    self.id = id.to_string();
                }
                if let Some(t) = r["created_at"].as_u64() {
                    self.created_at = t;
                }
            }
            "response.output_item.added" => {
                let item = &data["item"];
                self.part_pending = matches!(item["type"].as_str(), Some("message" | "reasoning"));
                if matches!(item["type"].as_str(), Some("message" | "function_call")) {
                    self.answered = true;
                }
                let id = item["id"].as_str().unwrap_or_default().to_string();
                self.open = match item["type"].as_str().unwrap_or_default() {
                    "reasoning" => Some(Open::Reasoning {
                        id,
                        text: String::new(),
                    }),
                    "message" => Some(Open::Message {
                        id,
                        text: String::new(),
                    }),
                    "function_call" => {
                        let chat_name = item["name"].as_str().unwrap_or_default().to_string();
                        Some(Open::Call {
                            index: self.closed_calls.len() as u32,
                            id,
                            call_id: item["call_id"].as_str().unwrap_or_default().to_string(),
                            target: self.meta.tool_target(&chat_name).cloned(),
                            chat_name,
                            arguments: String::new(),
                            announced: true,
                        })
                    }
                    _ => None,
                };
            }
            "response.content_part.added" | "response.reasoning_summary_part.added" => {
                self.part_pending = false;
            }
            "response.output_text.delta" => {
                let d = text("delta");
                self.text.push_str(&d);
                if let Some(Open::Message { text, .. }) = self.open.as_mut() {
                    text.push_str(&d);
                }
            }
            "response.reasoning_summary_text.delta" => {
                let d = text("delta");
                self.reasoning.push_str(&d);
                if let Some(Open::Reasoning { text, .. }) = self.open.as_mut() {
                    text.push_str(&d);
                }
            }
            "response.function_call_arguments.delta" => {
                if let Some(Open::Call { arguments, .. }) = self.open.as_mut() {
                    arguments.push_str(&text("delta"));
                }
            }
            "response.output_text.done"
            | "response.content_part.done"
            | "response.function_call_arguments.done"
            | "response.reasoning_summary_text.done"
            | "response.reasoning_summary_part.done" => {
                if let (Some(t), Some(_)) = (data["type"].as_str(), &self.open) {
                    self.parts_done.insert(t.to_string());
                }
                if let Some(Open::Call { index, .. }) = &self.open {
                    self.closed_calls.insert(*index);
                }
            }
            "response.output_item.done" => {
                self.parts_done.clear();
                if let Some(Open::Call { index, .. }) = self.open.take() {
                    self.closed_calls.insert(index);
                }
                let item = data["item"].clone();
                if matches!(item["type"].as_str(), Some("message" | "function_call")) {
                    self.answered = true;
                }
                self.items.push(item);
            }
            "response.completed" | "response.incomplete" => {
                self.response = Some(data["response"].clone());
            }
            _ => {}
        }
    }

    /// Whether the open item's parts were done in a source's stream (it takes no more
    /// content).
    fn sealed(&self) -> bool {
        self.open.is_some() && !self.parts_done.is_empty()
    }

    // === impl ResponsesStream: items ===

    fn ensure_started(&mut self, out: &mut Vec<SseEvent>) {
        if self.started {
            return;
        }
        self.started = true;
        let response = response_value(
            &self.id,
            self.created_at,
            self.meta.model(),
            &self.meta,
            "in_progress",
            None,
            Vec::new(),
            Value::Null,
            Value::Null,
        );
        out.push(self.event(
            "response.created",
            obj(json!({"response": response.clone()})),
        ));
        out.push(self.event("response.in_progress", obj(json!({"response": response}))));
    }

    fn event(&mut self, ty: &str, mut data: Map<String, Value>) -> SseEvent {
        data.insert("type".into(), json!(ty));
        data.insert("sequence_number".into(), json!(self.seq));
        self.seq += 1;
        SseEvent::new(ty, Value::Object(data))
    }

    /// The part of an observed item whose part the source never added (its stream was
    /// cut between the two).
    fn add_pending_part(&mut self, out: &mut Vec<SseEvent>) {
        if !std::mem::take(&mut self.part_pending) {
            return;
        }
        let index = self.index();
        let ev = match &self.open {
            Some(Open::Message { id, .. }) => {
                let data = obj(
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": text_part("")}),
                );
                self.event("response.content_part.added", data)
            }
            Some(Open::Reasoning { id, .. }) => {
                let data = obj(
                    json!({"item_id": id, "output_index": index, "summary_index": 0,
                    "part": {"type": "summary_text", "text": ""}}),
                );
                self.event("response.reasoning_summary_part.added", data)
            }
            _ => return,
        };
        out.push(ev);
    }

    /// The output index of the open item (items are opened in order).
    fn index(&self) -> usize {
        self.items.len()
    }

    fn push_reasoning(&mut self, r: &str, out: &mut Vec<SseEvent>) {
        if self.sealed() || !matches!(self.open, Some(Open::Reasoning { .. })) {
            self.close("completed", out);
            let id = item_id("rs", &self.id, self.index());
            let added = json!({"type": "reasoning", "id": id, "summary": []});
            let ev = self.item_event("response.output_item.added", added);
            out.push(ev);
            let ev = self.event(
                "response.reasoning_summary_part.added",
                obj(
                    json!({"item_id": id, "output_index": self.index(), "summary_index": 0,
                    "part": {"type": "summary_text", "text": ""}}),
                ),
            );
            out.push(ev);
            self.open = Some(Open::Reasoning {
                id,
                text: String::new(),
            });
        }
        self.add_pending_part(out);
        let index = self.index();
        if let Some(Open::Reasoning { id, text }) = self.open.as_mut() {
            text.push_str(r);
            let data =
                obj(json!({"item_id": id, "output_index": index, "summary_index": 0, "delta": r}));
            self.reasoning.push_str(r);
            let ev = self.event("response.reasoning_summary_text.delta", data);
            out.push(ev);
        }
    }

    fn open_message(&mut self, out: &mut Vec<SseEvent>) {
        self.close("completed", out);
        self.answered = true;
        let id = item_id("msg", &self.id, self.index());
        let added = json!({"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []});
        let ev = self.item_event("response.output_item.added", added);
        out.push(ev);
        let ev = self.event(
            "response.content_part.added",
            obj(json!({"item_id": id, "output_index": self.index(), "content_index": 0, "part": text_part("")})),
        );
        out.push(ev);
        self.open = Some(Open::Message {
            id,
            text: String::new(),
        });
    }

    fn push_text(&mut self, c: &str, out: &mut Vec<SseEvent>) {
        if self.sealed() || !matches!(self.open, Some(Open::Message { .. })) {
            self.open_message(out);
        }
        self.add_pending_part(out);
        let index = self.index();
        if let Some(Open::Message { id, text }) = self.open.as_mut() {
            text.push_str(c);
            let data = obj(
                json!({"item_id": id, "output_index": index, "content_index": 0,
                "delta": c, "logprobs": []}),
            );
            self.text.push_str(c);
            let ev = self.event("response.output_text.delta", data);
            out.push(ev);
        }
    }

    /// One tool-call fragment: appended to the open call, or held until the call's
    /// name is known (or `force`, at the end), then the call's item is opened with what
    /// was held.
    fn push_call(
        &mut self,
        index: u32,
        id: Option<&str>,
        name: Option<&str>,
        arguments: &str,
        force: bool,
        out: &mut Vec<SseEvent>,
    ) {
        if let Some(Open::Call { index: open, .. }) = &self.open {
            if *open == index && !self.sealed() {
                self.append_arguments(arguments, out);
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
            // The end of the stream: a call whose name never came is opened nameless.
            p.name = Some(String::new());
        }
        p.arguments.push_str(arguments);
        let Some(chat_name) = p.name.clone() else {
            return;
        };
        let p = self.pending.remove(&index).unwrap_or_default();
        self.close("completed", out);
        self.answered = true;
        let target = self.meta.tool_target(&chat_name).cloned();
        let kind = target.as_ref().map(|t| t.kind);
        let item = item_id(call_prefix(kind), &self.id, self.index());
        let cid = p.id.unwrap_or_else(|| call_id(&self.id, index));
        let announced = !matches!(
            kind,
            Some(
                ToolKind::LocalShell
                    | ToolKind::Shell
                    | ToolKind::ApplyPatch
                    | ToolKind::ToolSearch
            )
        );
        if announced {
            let added = call_item(target.as_ref(), &chat_name, &item, &cid, "", "in_progress");
            let ev = self.item_event("response.output_item.added", added);
            out.push(ev);
        }
        self.open = Some(Open::Call {
            index,
            id: item,
            call_id: cid,
            chat_name,
            target,
            arguments: String::new(),
            announced,
        });
        self.append_arguments(&p.arguments, out);
    }

    fn append_arguments(&mut self, a: &str, out: &mut Vec<SseEvent>) {
        if a.is_empty() {
            return;
        }
        let output_index = self.index();
        let Some(Open::Call {
            id,
            target,
            arguments,
            ..
        }) = self.open.as_mut()
        else {
            return;
        };
        arguments.push_str(a);
        let streams = target.as_ref().is_none_or(|t| t.kind.streams_arguments());
        if streams {
            let data = obj(json!({"item_id": id, "output_index": output_index, "delta": a}));
            let ev = self.event("response.function_call_arguments.delta", data);
            out.push(ev);
        }
    }

    /// The item as it stands, with this status.
    fn snapshot(&self, open: &Open, status: &str) -> Value {
        match open {
            Open::Reasoning { id, text } => reasoning_item(id, text),
            Open::Message { id, text } => message_item(id, text, status),
            Open::Call {
                id,
                call_id,
                chat_name,
                target,
                arguments,
                ..
            } => call_item(target.as_ref(), chat_name, id, call_id, arguments, status),
        }
    }

    /// Completes the open item: its `.done` events, then `output_item.done` with the
    /// whole item (`status` for messages and calls).
    fn close(&mut self, status: &str, out: &mut Vec<SseEvent>) {
        let Some(open) = self.open.take() else {
            return;
        };
        // An observed item cut before its part was added gets it now (its `.done`
        // events below name it).
        let start = self.seq;
        let mut events = Vec::new();
        let open = if self.part_pending {
            self.open = Some(open);
            self.add_pending_part(&mut events);
            match self.open.take() {
                Some(o) => o,
                None => return,
            }
        } else {
            open
        };
        self.close_item(open, status, &mut events);
        let done = std::mem::take(&mut self.parts_done);
        if !done.is_empty() {
            // What the source already sent is not sent again; the numbers stay
            // contiguous.
            events.retain(|e| !done.contains(&e.event));
            for (i, e) in events.iter_mut().enumerate() {
                e.data["sequence_number"] = json!(start + i as u64);
            }
            self.seq = start + events.len() as u64;
        }
        out.extend(events);
    }

    fn close_item(&mut self, open: Open, status: &str, out: &mut Vec<SseEvent>) {
        let output_index = self.index();
        let item = self.snapshot(&open, status);
        match &open {
            Open::Reasoning { id, text } => {
                let ev = self.event(
                    "response.reasoning_summary_text.done",
                    obj(json!({"item_id": id, "output_index": output_index, "summary_index": 0, "text": text})),
                );
                out.push(ev);
                let ev = self.event(
                    "response.reasoning_summary_part.done",
                    obj(
                        json!({"item_id": id, "output_index": output_index, "summary_index": 0,
                        "part": {"type": "summary_text", "text": text}}),
                    ),
                );
                out.push(ev);
            }
            Open::Message { id, text } => {
                let ev = self.event(
                    "response.output_text.done",
                    obj(
                        json!({"item_id": id, "output_index": output_index, "content_index": 0,
                        "text": text, "logprobs": []}),
                    ),
                );
                out.push(ev);
                let ev = self.event(
                    "response.content_part.done",
                    obj(
                        json!({"item_id": id, "output_index": output_index, "content_index": 0,
                        "part": text_part(text)}),
                    ),
                );
                out.push(ev);
            }
            Open::Call {
                index,
                id,
                announced,
                arguments,
                ..
            } => {
                self.closed_calls.insert(*index);
                match item["type"].as_str() {
                    Some("function_call") if *announced => {
                        let ev = self.event(
                            "response.function_call_arguments.done",
                            obj(json!({"item_id": id, "output_index": output_index, "arguments": arguments})),
                        );
                        out.push(ev);
                    }
                    Some("custom_tool_call") => {
                        let input = item["input"].as_str().unwrap_or_default().to_string();
                        if !input.is_empty() {
                            let ev = self.event(
                                "response.custom_tool_call_input.delta",
                                obj(json!({"item_id": id, "output_index": output_index, "delta": input})),
                            );
                            out.push(ev);
                        }
                        let ev = self.event(
                            "response.custom_tool_call_input.done",
                            obj(json!({"item_id": id, "output_index": output_index, "input": input})),
                        );
                        out.push(ev);
                    }
                    _ => {}
                }
                if !*announced {
                    let mut added = item.clone();
                    if let Some(o) = added.as_object_mut() {
                        o.insert("status".into(), json!("in_progress"));
                    }
                    let ev = self.item_event("response.output_item.added", added);
                    out.push(ev);
                }
            }
        }
        let ev = self.item_event("response.output_item.done", item.clone());
        out.push(ev);
        self.items.push(item);
    }

    fn item_event(&mut self, ty: &str, item: Value) -> SseEvent {
        let output_index = self.index();
        self.event(ty, obj(json!({"output_index": output_index, "item": item})))
    }
}

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::responses::{check_stream, parse_request, to_chat};
    use polygw_core::ports::ToolCallDelta;
    use polygw_core::{ToolCall, Usage, UsageSource};

    fn meta(tools: Value) -> ResponsesMeta {
        let body = json!({"model": "m", "input": "x", "tools": tools, "stream": true});
        to_chat(&parse_request(body.to_string().as_bytes()).unwrap(), &[])
            .unwrap()
            .meta
    }

    fn text(s: &str) -> StreamDelta {
        StreamDelta {
            content: Some(s.into()),
            ..Default::default()
        }
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

    fn types(events: &[SseEvent]) -> Vec<&str> {
        events.iter().map(|e| e.event.as_str()).collect()
    }

    #[test]
    fn reasoning_text_and_a_call_in_order() {
        let mut s = ResponsesStream::new(
            "resp_1",
            5,
            meta(json!([{"type": "function", "name": "f"}])),
        );
        let mut ev = s.start();
        ev.extend(s.delta(&StreamDelta {
            role: Some("assistant".into()),
            ..Default::default()
        }));
        ev.extend(s.delta(&StreamDelta {
            reasoning: Some("hm".into()),
            ..Default::default()
        }));
        ev.extend(s.delta(&text("Hel")));
        ev.extend(s.delta(&text("lo")));
        ev.extend(s.delta(&frag(0, Some("c1"), Some("f"), "{\"a\"")));
        ev.extend(s.delta(&frag(0, None, None, ":1}")));
        let answer = LlmResponse {
            content: "Hello".into(),
            reasoning_content: Some("hm".into()),
            tool_calls: vec![ToolCall {
                index: 0,
                id: Some("c1".into()),
                name: Some("f".into()),
                arguments: "{\"a\":1}".into(),
            }],
            finish_reason: Some("tool_calls".into()),
            usage: Usage::new(3, 4),
            usage_source: UsageSource::Measured,
            ..Default::default()
        };
        ev.extend(s.finish(&answer));
        assert!(s.finish(&answer).is_empty());
        assert!(s.delta(&text("x")).is_empty());
        assert_eq!(
            types(&ev),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.reasoning_summary_part.added",
                "response.reasoning_summary_text.delta",
                "response.reasoning_summary_text.done",
                "response.reasoning_summary_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let fin = check_stream(&ev).unwrap();
        assert_eq!(fin.text, "Hello");
        assert_eq!(fin.reasoning, "hm");
        assert_eq!(fin.tool_calls[0].arguments, "{\"a\":1}");
        // The stream's items are the plain answer's items.
        let plain = super::super::output_items("resp_1", &s.meta, &answer);
        assert_eq!(s.output_items(), plain.as_slice());
        assert_eq!(s.response().unwrap()["usage"]["total_tokens"], 7);
    }

    #[test]
    fn a_cache_hit_without_deltas_streams_the_whole_answer() {
        let mut s = ResponsesStream::new(
            "resp_2",
            5,
            meta(json!([{"type": "custom", "name": "apply_patch"}])),
        );
        let answer = LlmResponse {
            content: "done".into(),
            tool_calls: vec![ToolCall {
                index: 0,
                id: None,
                name: Some("apply_patch".into()),
                arguments: r#"{"input":"*** Begin Patch"}"#.into(),
            }],
            finish_reason: Some("length".into()),
            ..Default::default()
        };
        let ev = s.finish(&answer);
        let fin = check_stream(&ev).unwrap();
        assert_eq!(fin.status, "incomplete");
        assert_eq!(fin.text, "done");
        assert_eq!(fin.tool_calls[0].kind, "custom_tool_call");
        assert_eq!(fin.tool_calls[0].arguments, "*** Begin Patch");
        assert_eq!(fin.tool_calls[0].call_id, "call_2_0");
        assert!(types(&ev).contains(&"response.custom_tool_call_input.done"));
        assert_eq!(fin.usage, Value::Null);
    }

    #[test]
    fn a_late_fragment_fails_the_stream_and_fail_is_terminal() {
        let mut s = ResponsesStream::new(
            "resp_3",
            5,
            meta(json!([{"type": "function", "name": "f"}])),
        );
        let mut ev = s.start();
        ev.extend(s.delta(&frag(0, Some("a"), Some("f"), "{}")));
        ev.extend(s.delta(&frag(1, Some("b"), Some("f"), "{")));
        ev.extend(s.delta(&frag(0, None, None, "x")));
        assert!(s.is_done());
        assert!(s.fail("server_error", "again").is_empty());
        let t = types(&ev);
        assert_eq!(&t[t.len() - 2..], ["error", "response.failed"]);
        let fin = check_stream(&ev).unwrap();
        assert_eq!(fin.status, "failed");
        assert!(fin.error.unwrap().1.contains("went back to tool call 0"));
        let failed = &ev.last().unwrap().data["response"];
        assert_eq!(failed["output"][1]["status"], "incomplete");
        assert_eq!(
            ev[ev.len() - 2].data["error"]["message"],
            ev[ev.len() - 2].data["message"]
        );
    }

    #[test]
    fn a_call_is_held_until_its_name_and_builtins_announce_at_the_end() {
        let mut s = ResponsesStream::new("resp_4", 5, meta(json!([{"type": "local_shell"}])));
        let mut ev = s.start();
        ev.extend(s.delta(&frag(0, Some("c"), None, "{\"command\":")));
        assert_eq!(ev.len(), 2);
        ev.extend(s.delta(&frag(0, None, Some("local_shell"), "[\"ls\"]}")));
        ev.extend(s.finish(&LlmResponse {
            tool_calls: vec![ToolCall {
                index: 0,
                id: Some("c".into()),
                name: Some("local_shell".into()),
                arguments: "{\"command\":[\"ls\"]}".into(),
            }],
            ..Default::default()
        }));
        let fin = check_stream(&ev).unwrap();
        assert_eq!(fin.tool_calls[0].kind, "local_shell_call");
        assert_eq!(s.output_items()[0]["action"]["command"], json!(["ls"]));
    }
}
