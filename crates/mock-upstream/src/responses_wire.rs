//! The Responses API's wire format for the mock (SPEC §23.8): a planned answer as the
//! typed events of a Responses stream — `response.created`, `response.in_progress`, an
//! output item per kind (reasoning with a summary, a message with `output_text`, a
//! function call) with its `added` / delta / `done` events, then `response.completed`
//! (or `response.incomplete`) carrying the whole response — and as the plain `response`
//! object, which is the same response. Pure: the player writes what this returns.

use polygw_core::Usage;
use serde_json::{json, Value};

use crate::behavior::ToolCallSpec;
use crate::play::Item;

/// Responses' usage object: cached tokens are part of `input_tokens`.
pub(crate) fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens.unwrap_or(0)},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens.unwrap_or(0)},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// An event as SSE: its `type` as the `event:` line.
pub(crate) fn sse(v: &Value) -> String {
    let name = v.get("type").and_then(Value::as_str).unwrap_or("message");
    format!("event: {name}\ndata: {v}\n\n")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Message,
    Call,
}

/// The output item being streamed.
#[derive(Debug)]
struct Open {
    kind: Kind,
    id: String,
    text: String,
}

/// Writes one response's events, numbering them.
#[derive(Debug)]
pub(crate) struct ResponsesWriter {
    id: String,
    model: String,
    created: u64,
    seq: u64,
    items: Vec<Value>,
    open: Option<Open>,
    tool: ToolCallSpec,
    /// The signature group whose encrypted content reasoning items carry.
    signing: Option<String>,
}

impl ResponsesWriter {
    /// The writer of response `resp_mock-{n}`.
    pub(crate) fn new(n: u64, model: &str, created: u64, tool: Option<ToolCallSpec>) -> Self {
        ResponsesWriter {
            id: format!("resp_mock-{n}"),
            model: model.to_string(),
            created,
            seq: 0,
            items: Vec::new(),
            open: None,
            tool: tool.unwrap_or_default(),
            signing: None,
        }
    }

    /// Reasoning items carry encrypted content of `group` (`Behavior::signing_group`).
    pub(crate) fn signed_by(mut self, group: Option<&str>) -> Self {
        self.signing = group.map(str::to_string);
        self
    }

    fn event(&mut self, mut v: Value) -> Value {
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        v
    }

    fn response(&self, status: &str, usage: Option<&Usage>) -> Value {
        json!({
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": self.items,
            "usage": usage.map(usage_json),
            "incomplete_details": null, "error": null,
        })
    }

    /// `response.created`, `response.in_progress`.
    pub(crate) fn start(&mut self) -> Vec<Value> {
        let r = self.response("in_progress", None);
        vec![
            self.event(json!({"type": "response.created", "response": r})),
            self.event(json!({"type": "response.in_progress", "response": r})),
        ]
    }

    fn index(&self) -> usize {
        self.items.len()
    }

    /// Closes the open item: its `done` events and `response.output_item.done`.
    fn close(&mut self) -> Vec<Value> {
        let Some(o) = self.open.take() else {
            return Vec::new();
        };
        let i = self.index();
        let mut out = Vec::new();
        let item = match o.kind {
            Kind::Reasoning => {
                let part = json!({"type": "summary_text", "text": o.text});
                out.push(
                    self.event(json!({"type": "response.reasoning_summary_text.done",
                    "item_id": o.id, "output_index": i, "summary_index": 0, "text": o.text})),
                );
                out.push(
                    self.event(json!({"type": "response.reasoning_summary_part.done",
                    "item_id": o.id, "output_index": i, "summary_index": 0, "part": part})),
                );
                let mut item = json!({"id": o.id, "type": "reasoning", "summary": [part]});
                if let Some(g) = &self.signing {
                    item["encrypted_content"] = json!(crate::signing::encrypted_content(g, &o.id));
                }
                item
            }
            Kind::Message => {
                let part = json!({"type": "output_text", "text": o.text, "annotations": []});
                out.push(self.event(json!({"type": "response.output_text.done",
                    "item_id": o.id, "output_index": i, "content_index": 0, "text": o.text, "logprobs": []})));
                out.push(self.event(json!({"type": "response.content_part.done",
                    "item_id": o.id, "output_index": i, "content_index": 0, "part": part})));
                json!({"id": o.id, "type": "message", "status": "completed", "role": "assistant",
                    "content": [part]})
            }
            Kind::Call => {
                out.push(
                    self.event(json!({"type": "response.function_call_arguments.done",
                    "item_id": o.id, "output_index": i, "arguments": o.text})),
                );
                json!({"id": o.id, "type": "function_call", "status": "completed",
                    "call_id": self.tool.id, "name": self.tool.name, "arguments": o.text})
            }
        };
        out.push(
            self.event(
                json!({"type": "response.output_item.done", "output_index": i, "item": item}),
            ),
        );
        self.items.push(item);
        out
    }

    /// The events of one planned item: a new output item when the kind changes, then
    /// its delta.
    pub(crate) fn item(&mut self, item: &Item) -> Vec<Value> {
        let (kind, text, first_call) = match item {
            Item::Reasoning(s) => (Kind::Reasoning, s.as_str(), false),
            Item::Content(s) => (Kind::Message, s.as_str(), false),
            Item::Tool { first, args } => (Kind::Call, args.as_str(), *first),
        };
        let mut out = Vec::new();
        if self.open.as_ref().map(|o| o.kind) != Some(kind) || first_call {
            out.extend(self.close());
            let i = self.index();
            let (id, added, part) = match kind {
                Kind::Reasoning => {
                    let id = format!("rs_mock_{i}");
                    let added = json!({"id": id, "type": "reasoning", "summary": []});
                    let part = json!({"type": "response.reasoning_summary_part.added", "item_id": id,
                        "output_index": i, "summary_index": 0, "part": {"type": "summary_text", "text": ""}});
                    (id, added, Some(part))
                }
                Kind::Message => {
                    let id = format!("msg_mock_{i}");
                    let added = json!({"id": id, "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []});
                    let part = json!({"type": "response.content_part.added", "item_id": id,
                        "output_index": i, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}});
                    (id, added, Some(part))
                }
                Kind::Call => {
                    let id = format!("fc_mock_{i}");
                    let added = json!({"id": id, "type": "function_call", "status": "in_progress",
                        "call_id": self.tool.id, "name": self.tool.name, "arguments": ""});
                    (id, added, None)
                }
            };
            out.push(self.event(
                json!({"type": "response.output_item.added", "output_index": i, "item": added}),
            ));
            if let Some(p) = part {
                out.push(self.event(p));
            }
            self.open = Some(Open {
                kind,
                id,
                text: String::new(),
            });
        }
        let i = self.index();
        let Some(o) = self.open.as_mut() else {
            return out;
        };
        o.text.push_str(text);
        let id = o.id.clone();
        let v = match kind {
            Kind::Reasoning => {
                json!({"type": "response.reasoning_summary_text.delta", "item_id": id,
                "output_index": i, "summary_index": 0, "delta": text})
            }
            Kind::Message => json!({"type": "response.output_text.delta", "item_id": id,
                "output_index": i, "content_index": 0, "delta": text, "logprobs": []}),
            Kind::Call => json!({"type": "response.function_call_arguments.delta", "item_id": id,
                "output_index": i, "delta": text}),
        };
        out.push(self.event(v));
        out
    }

    /// The end: the open item closed, then `response.completed` — or
    /// `response.incomplete` for a `length` finish — with the whole response.
    pub(crate) fn finish(&mut self, finish_reason: &str, usage: Option<&Usage>) -> Vec<Value> {
        let mut out = self.close();
        let v = self.final_response(finish_reason, usage);
        let kind = if finish_reason == "length" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        out.push(self.event(json!({"type": kind, "response": v})));
        out
    }

    /// The whole response (after [`Self::finish`]'s close, or for a plain answer).
    pub(crate) fn final_response(&mut self, finish_reason: &str, usage: Option<&Usage>) -> Value {
        self.close();
        let incomplete = finish_reason == "length";
        let mut v = self.response(
            if incomplete {
                "incomplete"
            } else {
                "completed"
            },
            usage,
        );
        if incomplete {
            v["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        v
    }

    /// `response.failed` with `error` (default: a `server_error`).
    pub(crate) fn failed(&mut self, error: Option<Value>) -> Value {
        let mut r = self.response("failed", None);
        r["error"] = error.unwrap_or_else(|| {
            json!({"code": "server_error", "message": "The server had an error while processing your request."})
        });
        self.event(json!({"type": "response.failed", "response": r}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The events are numbered without a gap and every item is added before its
    /// deltas and done before the end, which carries every item.
    #[test]
    fn a_planned_answer_is_a_well_formed_stream() {
        let mut w = ResponsesWriter::new(
            1,
            "m",
            0,
            Some(ToolCallSpec {
                id: "call_1".into(),
                name: "get".into(),
                arguments: "{}".into(),
                fragments: 1,
            }),
        );
        let mut evs = w.start();
        for it in [
            Item::Reasoning("hm".into()),
            Item::Content("Hi".into()),
            Item::Content(" there".into()),
            Item::Tool {
                first: true,
                args: "{}".into(),
            },
        ] {
            evs.extend(w.item(&it));
        }
        evs.extend(w.finish("tool_calls", Some(&Usage::new(5, 3))));
        for (i, e) in evs.iter().enumerate() {
            assert_eq!(e["sequence_number"], i as u64, "{e}");
        }
        let last = evs.last().unwrap();
        assert_eq!(last["type"], "response.completed");
        let out = last["response"]["output"].as_array().unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(out[1]["content"][0]["text"], "Hi there");
        assert_eq!(out[2]["call_id"], "call_1");
        assert_eq!(last["response"]["usage"]["input_tokens"], 5);
    }
}
