//! [`check_stream`]: a conformance check of a whole Messages event sequence (event
//! lines, block order and indices, deltas matching their block, every started block
//! stopped, one terminal event), returning what a client ends with.

use serde_json::{Map, Value};

use crate::sse::SseEvent;

/// What a client ends with after a valid Messages stream.
#[derive(Debug, Clone, PartialEq)]
pub struct MessagesFinal {
    /// The message id.
    pub id: String,
    /// `message_start`'s model.
    pub model: String,
    /// Every text block, concatenated.
    pub text: String,
    /// Every thinking block, concatenated.
    pub thinking: String,
    /// The tool_use blocks, in order.
    pub tool_calls: Vec<FinalToolUse>,
    /// `message_delta`'s stop_reason (`None` for a failed stream).
    pub stop_reason: Option<String>,
    /// `message_delta`'s stop_sequence.
    pub stop_sequence: Option<String>,
    /// The usage as the Anthropic SDK accumulates it: `message_start`'s, overwritten by
    /// the fields `message_delta` sets.
    pub usage: Value,
    /// `(type, message)` of an `error` event that ended the stream.
    pub error: Option<(String, String)>,
}

/// One tool_use block of a finished Messages stream.
#[derive(Debug, Clone, PartialEq)]
pub struct FinalToolUse {
    /// `id`.
    pub id: String,
    /// `name`.
    pub name: String,
    /// The input: the concatenated `input_json_delta`s parsed (`{}` when none).
    pub input: Value,
}

#[derive(Debug)]
struct Block {
    ty: String,
    text: String,
    id: String,
    name: String,
    open: bool,
}

const STOP_REASONS: [&str; 7] = [
    "end_turn",
    "max_tokens",
    "stop_sequence",
    "tool_use",
    "pause_turn",
    "refusal",
    "model_context_window_exceeded",
];

/// Validates a whole Messages event sequence: every event has an `event:` line equal to
/// its `type`; `message_start` first (only `ping`s and an `error` may come before it;
/// an `error` alone is a stream that failed at once); blocks started at the next index,
/// one open at a time, deltas of the block's kind into the open block
/// (`text_delta` → text, `thinking_delta` / `signature_delta` → thinking,
/// `input_json_delta` → tool_use or a server tool's call (`server_tool_use`,
/// `mcp_tool_use`), whose concatenation is a JSON object or empty; a server tool's
/// result (`…_tool_result`) and `redacted_thinking` come whole in their start and take
/// no delta); every
/// block stopped before the one `message_delta` (a known stop_reason, integer
/// `usage.output_tokens`); then `message_stop` last — or an `error` event last. Pings
/// anywhere before the end; nothing after it.
pub fn check_stream(events: &[SseEvent]) -> Result<MessagesFinal, String> {
    let mut id = None;
    let mut model = String::new();
    let mut usage = Map::new();
    let mut blocks: Vec<Block> = Vec::new();
    let mut delta: Option<Value> = None;
    let mut error = None;
    let mut ended = false;
    for (n, e) in events.iter().enumerate() {
        let at = |m: String| format!("event {n} ({}): {m}", e.event);
        if ended {
            return Err(at("after the terminal event".into()));
        }
        let d = &e.data;
        let ty = d
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| at("data has no type".into()))?;
        if e.event != ty {
            return Err(at(format!(
                "the event line says {:?} but the type is {ty:?}",
                e.event
            )));
        }
        if id.is_none() && !matches!(ty, "message_start" | "ping" | "error") {
            return Err(at("before message_start".into()));
        }
        let index = d.get("index").and_then(Value::as_u64).map(|i| i as usize);
        match ty {
            "ping" => {}
            "message_start" => {
                if id.is_some() {
                    return Err(at("message_start again".into()));
                }
                let m = &d["message"];
                let mid = m
                    .get("id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| at("no message.id".into()))?;
                if m["type"] != "message" || m["role"] != "assistant" {
                    return Err(at("message must be an assistant message".into()));
                }
                if m["content"].as_array().is_none_or(|c| !c.is_empty()) {
                    return Err(at("message.content must be []".into()));
                }
                if m["usage"]["input_tokens"].as_u64().is_none() {
                    return Err(at("message.usage.input_tokens must be an integer".into()));
                }
                id = Some(mid.to_string());
                model = m["model"].as_str().unwrap_or_default().to_string();
                usage = m["usage"].as_object().cloned().unwrap_or_default();
            }
            "content_block_start" => {
                if delta.is_some() {
                    return Err(at("a block after message_delta".into()));
                }
                if index != Some(blocks.len()) {
                    return Err(at(format!("index {index:?}, expected {}", blocks.len())));
                }
                if blocks.iter().any(|b| b.open) {
                    return Err(at("the previous block was never stopped".into()));
                }
                let cb = &d["content_block"];
                let bty = cb["type"].as_str().unwrap_or_default();
                let well_formed = match bty {
                    "text" => cb["text"] == "",
                    "thinking" => cb["thinking"] == "",
                    "tool_use" | "server_tool_use" | "mcp_tool_use" => {
                        cb["input"] == Value::Object(Map::new())
                            && cb["id"].is_string()
                            && cb["name"].is_string()
                    }
                    // Whole in their start.
                    "redacted_thinking" => cb["data"].is_string(),
                    t if t.ends_with("_tool_result") => cb["tool_use_id"].is_string(),
                    other => return Err(at(format!("unexpected block type {other:?}"))),
                };
                if !well_formed {
                    return Err(at(format!(
                        "a started {bty} block must be empty (text, thinking, calls) or whole (results, redacted thinking)"
                    )));
                }
                blocks.push(Block {
                    ty: bty.to_string(),
                    text: String::new(),
                    id: cb["id"].as_str().unwrap_or_default().to_string(),
                    name: cb["name"].as_str().unwrap_or_default().to_string(),
                    open: true,
                });
            }
            "content_block_delta" => {
                let b = index
                    .and_then(|i| blocks.get_mut(i))
                    .filter(|b| b.open)
                    .ok_or_else(|| at(format!("block {index:?} is not open")))?;
                let dd = &d["delta"];
                let (want, field) = match dd["type"].as_str().unwrap_or_default() {
                    "text_delta" => ("text", "text"),
                    "thinking_delta" => ("thinking", "thinking"),
                    "signature_delta" => ("thinking", ""),
                    "input_json_delta" => ("tool_use", "partial_json"),
                    other => return Err(at(format!("unexpected delta type {other:?}"))),
                };
                let calls = want == "tool_use" && b.ty.ends_with("tool_use");
                if b.ty != want && !calls {
                    return Err(at(format!("a {} delta into a {} block", dd["type"], b.ty)));
                }
                if !field.is_empty() {
                    b.text.push_str(
                        dd[field]
                            .as_str()
                            .ok_or_else(|| at(format!("no delta.{field}")))?,
                    );
                }
            }
            "content_block_stop" => {
                let b = index
                    .and_then(|i| blocks.get_mut(i))
                    .filter(|b| b.open)
                    .ok_or_else(|| at(format!("block {index:?} is not open")))?;
                if b.ty.ends_with("tool_use") && !b.text.trim().is_empty() {
                    match serde_json::from_str::<Value>(&b.text) {
                        Ok(Value::Object(_)) => {}
                        _ => {
                            return Err(at(format!("tool input {:?} is not a JSON object", b.text)))
                        }
                    }
                }
                b.open = false;
            }
            "message_delta" => {
                if delta.is_some() {
                    return Err(at("message_delta again".into()));
                }
                if let Some(i) = blocks.iter().position(|b| b.open) {
                    return Err(at(format!("block {i} was never stopped")));
                }
                let reason = d["delta"]["stop_reason"].as_str().unwrap_or_default();
                if !STOP_REASONS.contains(&reason) {
                    return Err(at(format!("unknown stop_reason {reason:?}")));
                }
                let u = d["usage"]
                    .as_object()
                    .ok_or_else(|| at("no usage".into()))?;
                if u.get("output_tokens").and_then(Value::as_u64).is_none() {
                    return Err(at("usage.output_tokens must be an integer".into()));
                }
                for (k, v) in u {
                    if !v.is_null() {
                        usage.insert(k.clone(), v.clone());
                    }
                }
                delta = Some(d["delta"].clone());
            }
            "message_stop" => {
                if delta.is_none() {
                    return Err(at("message_stop before message_delta".into()));
                }
                ended = true;
            }
            "error" => {
                let err = &d["error"];
                let (Some(t), Some(m)) = (err["type"].as_str(), err["message"].as_str()) else {
                    return Err(at("error needs error.type and error.message".into()));
                };
                error = Some((t.to_string(), m.to_string()));
                ended = true;
            }
            other => return Err(at(format!("unexpected event type {other:?}"))),
        }
    }
    if !ended {
        return Err("the stream has no terminal event (message_stop or error)".into());
    }
    let mut text = String::new();
    let mut thinking = String::new();
    let mut tool_calls = Vec::new();
    for b in &blocks {
        match b.ty.as_str() {
            "text" => text.push_str(&b.text),
            "thinking" => thinking.push_str(&b.text),
            // The client's calls only (a server tool ran at the provider).
            "tool_use" => tool_calls.push(FinalToolUse {
                id: b.id.clone(),
                name: b.name.clone(),
                input: if b.text.trim().is_empty() {
                    Value::Object(Map::new())
                } else {
                    serde_json::from_str(&b.text).unwrap_or(Value::Null)
                },
            }),
            _ => {}
        }
    }
    let str_of = |v: Option<&Value>, k: &str| v.and_then(|d| d[k].as_str()).map(str::to_string);
    Ok(MessagesFinal {
        id: id.unwrap_or_default(),
        model,
        text,
        thinking,
        tool_calls,
        stop_reason: str_of(delta.as_ref(), "stop_reason"),
        stop_sequence: str_of(delta.as_ref(), "stop_sequence"),
        usage: Value::Object(usage),
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(data: Value) -> SseEvent {
        SseEvent::new(data["type"].as_str().unwrap().to_string(), data)
    }

    #[test]
    fn a_minimal_stream_passes_and_broken_ones_say_why() {
        let good = vec![
            ev(
                json!({"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant",
                "model": "x", "content": [], "usage": {"input_tokens": 3, "output_tokens": 0}}}),
            ),
            ev(
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            ev(
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
            ),
            ev(json!({"type": "content_block_stop", "index": 0})),
            ev(
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": 1}}),
            ),
            ev(json!({"type": "message_stop"})),
        ];
        let fin = check_stream(&good).unwrap();
        assert_eq!(
            (fin.text.as_str(), fin.usage["output_tokens"].as_u64()),
            ("hi", Some(1))
        );
        let mut no_stop = good.clone();
        no_stop.remove(3);
        assert!(check_stream(&no_stop)
            .unwrap_err()
            .contains("never stopped"));
        let mut no_line = good.clone();
        no_line[2].event = String::new();
        assert!(check_stream(&no_line).unwrap_err().contains("event line"));
        let mut wrong_kind = good.clone();
        wrong_kind[2].data["delta"] = json!({"type": "input_json_delta", "partial_json": "{}"});
        assert!(check_stream(&wrong_kind)
            .unwrap_err()
            .contains("delta into a text block"));
        let mut after = good.clone();
        after.push(ev(json!({"type": "ping"})));
        assert!(check_stream(&after)
            .unwrap_err()
            .contains("after the terminal"));
        assert!(check_stream(&good[..5])
            .unwrap_err()
            .contains("no terminal"));
        let only_error = [ev(
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
        )];
        assert_eq!(
            check_stream(&only_error).unwrap().error.unwrap().0,
            "overloaded_error"
        );
    }
}
