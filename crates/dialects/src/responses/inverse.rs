//! [`request_from_chat`]: a core [`ChatRequest`] as a Responses request body, the
//! inverse of [`super::to_chat`] (for round-trip tests and benchmarks).

use polygw_core::{ChatRequest, Message};
use serde_json::{json, Map, Value};

/// The Responses body of a chat request. A first `system` message with string content
/// becomes `instructions`; other messages become items (`system` messages stay
/// `system`, assistant text an `output_text` message, tool calls `function_call`
/// items, tool messages `function_call_output` items); function tools, `temperature`,
/// `max_tokens` (`max_output_tokens`), `reasoning_effort`, `response_format`
/// (`text.format`), and from the overlay `top_p`, `tool_choice`,
/// `parallel_tool_calls` and `model` map back. What Responses cannot
/// express (other overlay fields such as `stop`) is left out. `model` is set only when
/// the overlay has one (a `ChatRequest` carries none).
pub fn request_from_chat(req: &ChatRequest) -> Value {
    let mut body = Map::new();
    let overlay = req.overlay.clone().unwrap_or_default();
    if let Some(m) = overlay.get("model").filter(|m| m.is_string()) {
        body.insert("model".into(), m.clone());
    }
    let mut messages = req.messages.iter().peekable();
    if let Some(first) = messages.peek() {
        if first.role == "system" {
            if let Some(Value::String(s)) = &first.content {
                body.insert("instructions".into(), json!(s));
                messages.next();
            }
        }
    }
    let mut input = Vec::new();
    for m in messages {
        items_of(m, &mut input);
    }
    body.insert("input".into(), Value::Array(input));
    if req.stream {
        body.insert("stream".into(), json!(true));
    }
    if let Some(t) = req.temperature {
        body.insert("temperature".into(), json!(t));
    }
    if let Some(n) = req.max_tokens {
        body.insert("max_output_tokens".into(), json!(n));
    }
    if let Some(e) = &req.reasoning_effort {
        body.insert("reasoning".into(), json!({"effort": e}));
    }
    let mut text = Map::new();
    if let Some(rf) = &req.response_format {
        match rf.get("type").and_then(Value::as_str) {
            Some("json_schema") => {
                let mut f = rf
                    .get("json_schema")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                f.insert("type".into(), json!("json_schema"));
                text.insert("format".into(), Value::Object(f));
            }
            Some("json_object") => {
                text.insert("format".into(), json!({"type": "json_object"}));
            }
            _ => {}
        }
    }
    if !text.is_empty() {
        body.insert("text".into(), Value::Object(text));
    }
    if let Some(tools) = &req.tools {
        let list: Vec<Value> = tools
            .iter()
            .filter_map(|t| {
                let f = t.get("function")?.as_object()?;
                let mut o = f.clone();
                o.insert("type".into(), json!("function"));
                Some(Value::Object(o))
            })
            .collect();
        body.insert("tools".into(), Value::Array(list));
    }
    if let Some(tc) = overlay.get("tool_choice") {
        let choice = match tc {
            Value::Object(o) => match o.get("function").and_then(|f| f.get("name")) {
                Some(n) => json!({"type": "function", "name": n}),
                None => tc.clone(),
            },
            other => other.clone(),
        };
        body.insert("tool_choice".into(), choice);
    }
    for k in ["top_p", "parallel_tool_calls"] {
        if let Some(v) = overlay.get(k) {
            body.insert(k.into(), v.clone());
        }
    }
    Value::Object(body)
}

fn parts_of(content: &Value, assistant: bool) -> Vec<Value> {
    let text_type = if assistant {
        "output_text"
    } else {
        "input_text"
    };
    let text = |t: &str| {
        if assistant {
            json!({"type": text_type, "text": t, "annotations": []})
        } else {
            json!({"type": text_type, "text": t})
        }
    };
    match content {
        Value::String(s) => vec![text(s)],
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| match p.get("type").and_then(Value::as_str)? {
                "text" => Some(text(p.get("text")?.as_str()?)),
                "image_url" => {
                    let img = p.get("image_url")?;
                    let mut o = Map::new();
                    o.insert("type".into(), json!("input_image"));
                    o.insert("image_url".into(), img.get("url")?.clone());
                    if let Some(d) = img.get("detail") {
                        o.insert("detail".into(), d.clone());
                    }
                    Some(Value::Object(o))
                }
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn items_of(m: &Message, out: &mut Vec<Value>) {
    match m.role.as_str() {
        "assistant" => {
            if let Some(c) = m
                .content
                .as_ref()
                .filter(|c| !c.is_null() && c.as_str() != Some(""))
            {
                out.push(
                    json!({"type": "message", "role": "assistant", "content": parts_of(c, true)}),
                );
            }
            for tc in m
                .extra
                .get("tool_calls")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let f = &tc["function"];
                out.push(json!({
                    "type": "function_call",
                    "call_id": tc.get("id").cloned().unwrap_or(Value::Null),
                    "name": f.get("name").cloned().unwrap_or(Value::Null),
                    "arguments": f.get("arguments").cloned().unwrap_or_else(|| json!("")),
                }));
            }
        }
        "tool" => {
            let output = match &m.content {
                Some(Value::String(s)) => json!(s),
                Some(v @ Value::Array(_)) => Value::Array(parts_of(v, false)),
                _ => json!(""),
            };
            out.push(json!({
                "type": "function_call_output",
                "call_id": m.extra.get("tool_call_id").cloned().unwrap_or(Value::Null),
                "output": output,
            }));
        }
        role => {
            let content = m
                .content
                .as_ref()
                .map_or_else(Vec::new, |c| parts_of(c, false));
            out.push(json!({"type": "message", "role": role, "content": content}));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::responses::{parse_request, to_chat};
    use polygw_core::Message;

    #[test]
    fn a_chat_request_survives_the_round_trip() {
        let mut assistant = Message::assistant("calling");
        assistant.extra.insert(
            "tool_calls".into(),
            json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]),
        );
        let mut tool = Message::new("tool", "42");
        tool.extra.insert("tool_call_id".into(), json!("c1"));
        let req = ChatRequest {
            messages: vec![Message::system("sys"), Message::user("q"), assistant, tool],
            temperature: Some(0.5),
            max_tokens: Some(50),
            reasoning_effort: Some("low".into()),
            tools: Some(vec![json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})]),
            ..Default::default()
        }
        .with_overlay("top_p", json!(0.9))
        .with_overlay("model", json!("m"));
        let body = request_from_chat(&req);
        let back = to_chat(&parse_request(body.to_string().as_bytes()).unwrap(), &[])
            .unwrap()
            .request;
        assert_eq!(back.messages, req.messages);
        assert_eq!(back.tools, req.tools);
        assert_eq!(back.overlay.unwrap()["top_p"], json!(0.9));
        assert_eq!((back.temperature, back.max_tokens), (Some(0.5), Some(50)));
    }
}
