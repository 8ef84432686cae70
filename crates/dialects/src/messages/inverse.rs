//! [`request_from_chat`]: a core [`ChatRequest`] as a Messages request body, the inverse
//! of [`super::to_chat`] (for round-trip tests and benchmarks).

use polygw_core::ChatRequest;
use serde_json::{json, Map, Value};

/// The Messages body of a chat request. A first `system` message with string content
/// becomes `system`; other system messages become `role: "system"` entries; tool
/// messages become `tool_result` blocks (consecutive ones in one user message);
/// assistant tool calls `tool_use` blocks (`input` the parsed arguments, or
/// [`super::tool_input`]'s object when they are not a JSON object); images as base64
/// (data URLs) or url sources. `max_tokens`, `temperature`, `reasoning_effort`
/// (`output_config.effort`: low/medium/high/xhigh; other efforts are left out),
/// `response_format` json_schema (`output_config.format`), function tools
/// (`input_schema`), and from the overlay `stop` (`stop_sequences`), `top_p`,
/// `tool_choice`, `parallel_tool_calls` (`disable_parallel_tool_use`) and `model` map
/// back. `max_tokens` is set only when the request has one (a count_tokens body
/// otherwise).
pub fn request_from_chat(req: &ChatRequest) -> Value {
    let mut body = Map::new();
    let overlay = req.overlay.clone().unwrap_or_default();
    if let Some(m) = overlay.get("model").filter(|m| m.is_string()) {
        body.insert("model".into(), m.clone());
    }
    if let Some(n) = req.max_tokens {
        body.insert("max_tokens".into(), json!(n));
    }
    let mut rest = req.messages.as_slice();
    if let Some(first) = rest.first() {
        if first.role == "system" {
            if let Some(Value::String(s)) = &first.content {
                body.insert("system".into(), json!(s));
                rest = &rest[1..];
            }
        }
    }
    let mut messages: Vec<Value> = Vec::new();
    let mut results: Vec<Value> = Vec::new();
    let flush = |results: &mut Vec<Value>, messages: &mut Vec<Value>| {
        if !results.is_empty() {
            messages.push(json!({"role": "user", "content": std::mem::take(results)}));
        }
    };
    for m in rest {
        match m.role.as_str() {
            "tool" => {
                let content = match &m.content {
                    Some(Value::String(s)) => json!(s),
                    Some(v @ Value::Array(_)) => Value::Array(blocks(v)),
                    _ => json!(""),
                };
                results.push(json!({
                    "type": "tool_result",
                    "tool_use_id": m.extra.get("tool_call_id").cloned().unwrap_or(Value::Null),
                    "content": content,
                }));
            }
            "assistant" => {
                flush(&mut results, &mut messages);
                let mut content = match &m.content {
                    Some(Value::String(s)) if !s.is_empty() => {
                        vec![json!({"type": "text", "text": s})]
                    }
                    Some(v @ Value::Array(_)) => blocks(v),
                    _ => Vec::new(),
                };
                for tc in m
                    .extra
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let f = &tc["function"];
                    let args = f["arguments"].as_str().unwrap_or_default();
                    content.push(json!({
                        "type": "tool_use",
                        "id": tc.get("id").cloned().unwrap_or(Value::Null),
                        "name": f.get("name").cloned().unwrap_or(Value::Null),
                        "input": super::tool_input(args),
                    }));
                }
                messages.push(json!({"role": "assistant", "content": content}));
            }
            role => {
                flush(&mut results, &mut messages);
                let content = match &m.content {
                    Some(Value::String(s)) => json!(s),
                    Some(v @ Value::Array(_)) => Value::Array(blocks(v)),
                    _ => json!(""),
                };
                messages.push(json!({"role": role, "content": content}));
            }
        }
    }
    flush(&mut results, &mut messages);
    body.insert("messages".into(), Value::Array(messages));
    if req.stream {
        body.insert("stream".into(), json!(true));
    }
    if let Some(t) = req.temperature {
        body.insert("temperature".into(), json!(t));
    }
    let mut config = Map::new();
    if let Some(e) = req.reasoning_effort.as_deref() {
        if matches!(e, "low" | "medium" | "high" | "xhigh") {
            config.insert("effort".into(), json!(e));
        }
    }
    if let Some(rf) = &req.response_format {
        if rf["type"] == "json_schema" {
            if let Some(schema) = rf["json_schema"].get("schema") {
                config.insert(
                    "format".into(),
                    json!({"type": "json_schema", "schema": schema}),
                );
            }
        }
    }
    if !config.is_empty() {
        body.insert("output_config".into(), Value::Object(config));
    }
    if let Some(tools) = &req.tools {
        let list: Vec<Value> = tools
            .iter()
            .filter_map(|t| {
                let f = t.get("function")?;
                let mut o = Map::new();
                o.insert("name".into(), f.get("name")?.clone());
                if let Some(d) = f.get("description") {
                    o.insert("description".into(), d.clone());
                }
                o.insert(
                    "input_schema".into(),
                    f.get("parameters")
                        .cloned()
                        .unwrap_or_else(|| json!({"type": "object"})),
                );
                if let Some(s) = f.get("strict") {
                    o.insert("strict".into(), s.clone());
                }
                Some(Value::Object(o))
            })
            .collect();
        body.insert("tools".into(), Value::Array(list));
    }
    let mut choice = match overlay.get("tool_choice") {
        Some(Value::String(s)) => match s.as_str() {
            "required" => Some(json!({"type": "any"})),
            "none" => Some(json!({"type": "none"})),
            _ => Some(json!({"type": "auto"})),
        },
        Some(Value::Object(o)) => o
            .get("function")
            .and_then(|f| f.get("name"))
            .map(|n| json!({"type": "tool", "name": n})),
        _ => None,
    };
    if overlay.get("parallel_tool_calls") == Some(&Value::Bool(false)) {
        let c = choice.get_or_insert_with(|| json!({"type": "auto"}));
        c["disable_parallel_tool_use"] = json!(true);
    }
    if let Some(c) = choice {
        body.insert("tool_choice".into(), c);
    }
    match overlay.get("stop") {
        Some(Value::String(s)) => {
            body.insert("stop_sequences".into(), json!([s]));
        }
        Some(v @ Value::Array(_)) => {
            body.insert("stop_sequences".into(), v.clone());
        }
        _ => {}
    }
    if let Some(v) = overlay.get("top_p") {
        body.insert("top_p".into(), v.clone());
    }
    Value::Object(body)
}

/// Chat content parts as Messages blocks.
fn blocks(content: &Value) -> Vec<Value> {
    content
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| match p["type"].as_str()? {
            "text" => Some(json!({"type": "text", "text": p["text"]})),
            "image_url" => {
                let url = p["image_url"]["url"].as_str()?;
                let source = match url
                    .strip_prefix("data:")
                    .and_then(|r| r.split_once(";base64,"))
                {
                    Some((media, data)) => {
                        json!({"type": "base64", "media_type": media, "data": data})
                    }
                    None => json!({"type": "url", "url": url}),
                };
                Some(json!({"type": "image", "source": source}))
            }
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{parse_request, to_chat};
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
            messages: vec![
                Message::system("sys"),
                Message {
                    role: "user".into(),
                    content: Some(json!([{"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}])),
                    extra: Map::new(),
                },
                assistant,
                tool,
                Message::system("later"),
            ],
            max_tokens: Some(50),
            temperature: Some(0.5),
            reasoning_effort: Some("high".into()),
            tools: Some(vec![json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})]),
            ..Default::default()
        }
        .with_overlay("stop", json!(["X"]))
        .with_overlay("tool_choice", json!("required"))
        .with_overlay("parallel_tool_calls", json!(false))
        .with_overlay("model", json!("m"));
        let body = request_from_chat(&req);
        let back = to_chat(&parse_request(body.to_string().as_bytes()).unwrap())
            .unwrap()
            .request;
        assert_eq!(back.messages, req.messages);
        assert_eq!(back.tools, req.tools);
        let mut want = req.overlay.clone().unwrap();
        want.remove("model");
        assert_eq!(back.overlay, Some(want));
        assert_eq!(back.reasoning_effort.as_deref(), Some("high"));
    }
}
