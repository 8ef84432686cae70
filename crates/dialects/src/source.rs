//! A client's request for a source of another API (SPEC §23.3): the core
//! [`ChatRequest`] — a chat client's request, or a Responses or Messages client's
//! translated by its dialect's `to_chat` — as the body a `messages` source
//! ([`for_messages`]) or a `responses` source ([`for_responses`]) is sent, with what
//! that API cannot express **named**, never silently dropped ([`Outbound::unexpressed`]).
//!
//! Both start from the dialect's inverse conversion (`request_from_chat`, which the
//! round-trip property tests hold to `to_chat`) and add what a source requires:
//! - Messages: every `system` / `developer` message becomes `system` (the API has no
//!   such role; they join in order); `max_tokens` is required — the client's cap
//!   (`max_tokens` or `max_completion_tokens`), else the source's `MAX_OUTPUT_TOKENS`;
//!   `temperature` is at most 1; `user` becomes `metadata.user_id`.
//! - Responses: `max_completion_tokens` becomes `max_output_tokens`; `user`,
//!   `metadata`, `prompt_cache_key`, `service_tier` pass; the source is called stateless
//!   (`store: false`, the encrypted reasoning included: SPEC §23.5).
//!
//! `model` and `stream` are the source's and the call's (set by core's
//! `NativeRequest::body_for`).

use polygw_core::native::NativeRequest;
use polygw_core::source::SourceApi;
use polygw_core::ChatRequest;
use serde_json::{json, Map, Value};

/// A request in a source's API, and what it could not carry.
#[derive(Debug, Clone, PartialEq)]
pub struct Outbound {
    /// The body (without `model` and `stream`).
    pub body: Map<String, Value>,
    /// What the target API cannot express, each named by its field in the chat form
    /// (`stop`, `logprobs`, `messages[3].reasoning_content`, `tools[1]`, …), in order.
    pub unexpressed: Vec<String>,
}

impl Outbound {
    /// As the native request a source of `api` is sent.
    pub fn into_native(self, api: SourceApi) -> NativeRequest {
        NativeRequest {
            api,
            body: self.body,
            headers: Vec::new(),
            query: None,
        }
    }
}

/// Overlay fields both targets take (or that are the call's: model, stream, usage).
const HANDLED_BY_BOTH: [&str; 9] = [
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "top_p",
    "tool_choice",
    "parallel_tool_calls",
    "user",
];

/// Names every overlay field that neither both targets nor this one (`handled`) take.
fn named_overlay(overlay: &Map<String, Value>, handled: &[&str], out: &mut Vec<String>) {
    for (k, v) in overlay {
        let key = k.as_str();
        if v.is_null() || HANDLED_BY_BOTH.contains(&key) || handled.contains(&key) {
            continue;
        }
        if k == "n" && v.as_u64() == Some(1) {
            continue;
        }
        if matches!(k.as_str(), "logprobs") && v == &Value::Bool(false) {
            continue;
        }
        out.push(k.clone());
    }
}

/// What the chat form's messages carry that neither target takes: reasoning text of
/// earlier turns (it has no signature a source could verify), and content parts other
/// than text and images.
fn named_content(req: &ChatRequest, out: &mut Vec<String>) {
    for (i, m) in req.messages.iter().enumerate() {
        for k in ["reasoning_content", "reasoning", "audio", "refusal"] {
            if m.extra.get(k).is_some_and(|v| !v.is_null() && v != "") {
                out.push(format!("messages[{i}].{k}"));
            }
        }
        if let Some(Value::Array(parts)) = &m.content {
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                if !matches!(kind, "text" | "image_url") {
                    out.push(format!("messages[{i}].content[{j}] ({kind})"));
                }
            }
        }
    }
    for (i, t) in req.tools.iter().flatten().enumerate() {
        if t.get("function").is_none() {
            let kind = t.get("type").and_then(Value::as_str).unwrap_or("");
            out.push(format!("tools[{i}] ({kind})"));
        }
    }
}

/// The client's output cap in the chat form: `max_tokens`, else the overlay's
/// `max_completion_tokens` / `max_tokens`.
fn client_cap(req: &ChatRequest) -> Option<u64> {
    req.max_tokens.map(u64::from).or_else(|| {
        let o = req.overlay.as_ref()?;
        ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|k| o.get(*k)?.as_u64())
    })
}

fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(o) => o,
        _ => Map::new(),
    }
}

/// The text of a chat message's content (its text parts joined).
fn text_of(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The body a `messages` source is sent for `req`; `max_output_tokens` is the cap when
/// the client set none (the source's `MAX_OUTPUT_TOKENS`).
pub fn for_messages(req: &ChatRequest, max_output_tokens: u64) -> Outbound {
    let mut unexpressed = Vec::new();
    // System and developer messages: the API's `system`, in order.
    let system: Vec<String> = req
        .messages
        .iter()
        .filter(|m| matches!(m.role.as_str(), "system" | "developer"))
        .map(|m| text_of(m.content.as_ref()))
        .filter(|t| !t.is_empty())
        .collect();
    let mut rest = req.clone();
    rest.messages
        .retain(|m| !matches!(m.role.as_str(), "system" | "developer"));
    rest.max_tokens = None;
    if let Some(e) = req.reasoning_effort.as_deref() {
        if !matches!(e, "low" | "medium" | "high" | "xhigh") {
            unexpressed.push(format!("reasoning_effort ({e})"));
        }
    }
    if let Some(rf) = &req.response_format {
        if rf.get("type").and_then(Value::as_str) != Some("json_schema") {
            let kind = rf.get("type").and_then(Value::as_str).unwrap_or("");
            unexpressed.push(format!("response_format ({kind})"));
        }
    }
    if let Some(t) = rest.temperature.filter(|t| *t > 1.0) {
        unexpressed.push(format!("temperature ({t} > 1: sent as 1)"));
        rest.temperature = Some(1.0);
    }
    let mut body = object(crate::messages::request_from_chat(&rest));
    body.remove("model");
    body.remove("stream");
    if !system.is_empty() {
        body.insert("system".into(), json!(system.join("\n\n")));
    }
    body.insert(
        "max_tokens".into(),
        json!(client_cap(req).unwrap_or(max_output_tokens).max(1)),
    );
    let overlay = req.overlay.clone().unwrap_or_default();
    if let Some(u) = overlay.get("user").and_then(Value::as_str) {
        body.insert("metadata".into(), json!({"user_id": u}));
    }
    named_content(req, &mut unexpressed);
    named_overlay(&overlay, &["stop"], &mut unexpressed);
    Outbound { body, unexpressed }
}

/// The body a `responses` source is sent for `req`.
pub fn for_responses(req: &ChatRequest) -> Outbound {
    let mut unexpressed = Vec::new();
    let mut rest = req.clone();
    rest.max_tokens = None;
    let mut body = object(crate::responses::request_from_chat(&rest));
    body.remove("model");
    body.remove("stream");
    if let Some(cap) = client_cap(req) {
        body.insert("max_output_tokens".into(), json!(cap));
    }
    let overlay = req.overlay.clone().unwrap_or_default();
    for k in [
        "user",
        "metadata",
        "prompt_cache_key",
        "service_tier",
        "safety_identifier",
    ] {
        if let Some(v) = overlay.get(k).filter(|v| !v.is_null()) {
            body.insert(k.into(), v.clone());
        }
    }
    // Stateless (SPEC §23.5): polygw keeps the conversation.
    body.insert("store".into(), json!(false));
    body.insert("include".into(), json!(["reasoning.encrypted_content"]));
    named_content(req, &mut unexpressed);
    named_overlay(
        &overlay,
        &[
            "metadata",
            "prompt_cache_key",
            "service_tier",
            "safety_identifier",
            "store",
        ],
        &mut unexpressed,
    );
    Outbound { body, unexpressed }
}

#[cfg(test)]
mod tests {
    use super::*;
    use polygw_core::Message;

    fn loop_request() -> ChatRequest {
        let mut assistant = Message::assistant("");
        assistant.extra.insert(
            "tool_calls".into(),
            json!([{"id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{\"city\":\"Paris\"}"}}]),
        );
        assistant
            .extra
            .insert("reasoning_content".into(), json!("I will look"));
        let mut tool = Message::new("tool", "21");
        tool.extra.insert("tool_call_id".into(), json!("call_1"));
        ChatRequest {
            messages: vec![
                Message::system("Be terse."),
                Message::new("developer", "Use tools."),
                Message::user("weather?"),
                assistant,
                tool,
            ],
            temperature: Some(1.5),
            tools: Some(vec![
                json!({"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}),
            ]),
            ..Default::default()
        }
        .with_overlay("stop", json!("END"))
        .with_overlay("logprobs", json!(true))
        .with_overlay("user", json!("u1"))
    }

    #[test]
    fn a_chat_tool_loop_for_a_messages_source() {
        let o = for_messages(&loop_request(), 8192);
        let b = &o.body;
        assert_eq!(b["system"], "Be terse.\n\nUse tools.");
        assert_eq!(b["max_tokens"], 8192, "required: the source's cap");
        assert_eq!(b["temperature"], 1.0);
        assert_eq!(b["metadata"], json!({"user_id": "u1"}));
        assert_eq!(b["stop_sequences"], json!(["END"]));
        assert!(b.get("model").is_none() && b.get("stream").is_none());
        let msgs = b["messages"].as_array().unwrap();
        assert_eq!(msgs.len(), 3);
        assert_eq!(msgs[1]["content"][0]["type"], "tool_use");
        assert_eq!(msgs[1]["content"][0]["input"], json!({"city": "Paris"}));
        assert_eq!(msgs[2]["content"][0]["type"], "tool_result");
        assert_eq!(
            o.unexpressed,
            [
                "temperature (1.5 > 1: sent as 1)",
                "messages[3].reasoning_content",
                "logprobs"
            ]
        );
        // The client's own cap wins.
        let capped = for_messages(&loop_request().with_max_tokens(64), 8192);
        assert_eq!(capped.body["max_tokens"], 64);
    }

    #[test]
    fn a_chat_tool_loop_for_a_responses_source() {
        let o = for_responses(&loop_request().with_overlay("max_completion_tokens", json!(99)));
        let b = &o.body;
        assert_eq!(b["store"], false);
        assert_eq!(b["include"], json!(["reasoning.encrypted_content"]));
        assert_eq!(b["max_output_tokens"], 99);
        assert_eq!(b["user"], "u1");
        let kinds: Vec<&str> = b["input"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            [
                "message",
                "message",
                "function_call",
                "function_call_output"
            ]
        );
        assert_eq!(b["instructions"], "Be terse.");
        assert_eq!(
            o.unexpressed,
            ["messages[3].reasoning_content", "logprobs", "stop"]
        );
    }
}
