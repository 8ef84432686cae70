//! `POST /v1/messages` bodies read once into a [`MessagesRequest`]: every field the
//! Messages API defines is type-checked (errors name it); the conversation is laid out
//! as chat messages here (tool results before the user's other content, images a tool
//! returned in a user message after the tool messages); Anthropic's own tools are set
//! aside; unknown fields are listed, not refused.

use std::collections::BTreeMap;

use polygw_core::Message;
use serde_json::{Map, Value};

use crate::chat::{image_part, text_part, Conversation, NameTable};
use crate::error::DialectError;
use crate::json::{
    at, idx, one_of, opt_array, opt_bool, opt_int, opt_number, opt_object, opt_string, parse_body,
    str_of, take, type_name,
};

/// Fields accepted without effect on the answer (listed by [`MessagesRequest::ignored`]
/// with the unknown ones).
const NO_EFFECT: [&str; 10] = [
    "service_tier",
    "context_management",
    "container",
    "inference_geo",
    "speed",
    "diagnostics",
    "cache_control",
    "user_profile_id",
    "workspace_id",
    "top_k",
];

/// A Messages request, read and checked.
#[derive(Debug, Clone)]
pub struct MessagesRequest {
    pub(crate) model: String,
    pub(crate) stream: bool,
    pub(crate) max_tokens: Option<u32>,
    pub(crate) messages: Vec<Message>,
    pub(crate) tools: Vec<Value>,
    /// Chat function name → the tool's name as the client defined it.
    pub(crate) names: BTreeMap<String, String>,
    pub(crate) unsupported: Vec<String>,
    pub(crate) tool_choice: Option<Value>,
    pub(crate) parallel_tool_calls: Option<bool>,
    pub(crate) stop_sequences: Vec<String>,
    pub(crate) temperature: Option<f64>,
    pub(crate) top_p: Option<f64>,
    pub(crate) reasoning_effort: Option<String>,
    pub(crate) thinking_visible: bool,
    pub(crate) response_format: Option<Value>,
    pub(crate) user_id: Option<String>,
    pub(crate) ignored: Vec<String>,
}

impl MessagesRequest {
    /// `model`: selects the scope.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// `stream`.
    pub fn stream(&self) -> bool {
        self.stream
    }

    /// `max_tokens` (`None` only for a count_tokens body).
    pub fn max_tokens(&self) -> Option<u32> {
        self.max_tokens
    }

    /// The affinity key (SPEC §20.2): `metadata.user_id`.
    pub fn affinity_key(&self) -> Option<&str> {
        self.user_id.as_deref()
    }

    /// Anthropic-defined and server tools not sent upstream (their `type`s:
    /// `web_search_20250305`, `bash_20250124`, …; `mcp_servers:<name>`), once each.
    pub fn unsupported_tools(&self) -> &[String] {
        &self.unsupported
    }

    /// Top-level fields that had no effect: unknown ones and accepted ones without
    /// effect (`service_tier`, `context_management`, `top_k`, …), sorted by name.
    pub fn ignored(&self) -> &[String] {
        &self.ignored
    }
}

/// Reads a `/v1/messages` body (`max_tokens` required).
pub fn parse_request(body: &[u8]) -> Result<MessagesRequest, DialectError> {
    parse(body, true)
}

/// Reads a `/v1/messages` or `/v1/messages/count_tokens` body.
pub(crate) fn parse(body: &[u8], need_max_tokens: bool) -> Result<MessagesRequest, DialectError> {
    let mut o = parse_body(body)?;
    let model = match take(&mut o, "model") {
        Some(Value::String(m)) if !m.is_empty() => m,
        None => return Err(DialectError::invalid("model", "model is required")),
        Some(_) => {
            return Err(DialectError::invalid(
                "model",
                "model must be a non-empty string",
            ))
        }
    };
    let max_tokens = opt_int(take(&mut o, "max_tokens"), "max_tokens", 1)?;
    if need_max_tokens && max_tokens.is_none() {
        return Err(DialectError::invalid(
            "max_tokens",
            "max_tokens is required",
        ));
    }
    let stream = opt_bool(take(&mut o, "stream"), "stream")?.unwrap_or(false);
    let temperature = opt_number(take(&mut o, "temperature"), "temperature", 0.0, 1.0)?;
    let top_p = opt_number(take(&mut o, "top_p"), "top_p", 0.0, 1.0)?;
    if let Some(v) = o.get("top_k").filter(|v| !v.is_null()) {
        opt_int(Some(v.clone()), "top_k", 0)?;
    }
    let stop_sequences = match opt_array(take(&mut o, "stop_sequences"), "stop_sequences")? {
        None => Vec::new(),
        Some(list) => {
            let mut out = Vec::with_capacity(list.len());
            for (i, s) in list.into_iter().enumerate() {
                match s {
                    Value::String(s) => out.push(s),
                    other => {
                        let p = idx("stop_sequences", i);
                        return Err(DialectError::invalid(
                            &p,
                            format!("{p} must be a string (got {})", type_name(&other)),
                        ));
                    }
                }
            }
            out
        }
    };
    let metadata = opt_object(take(&mut o, "metadata"), "metadata")?;
    let user_id = match metadata {
        Some(mut m) => opt_string(take(&mut m, "user_id"), "metadata.user_id")?,
        None => None,
    };
    let (reasoning_effort, thinking_visible, response_format) = read_thinking(&mut o)?;

    // Tools first: the conversation's tool_use names map through them.
    let mut names = NameTable::default();
    let mut by_name: BTreeMap<String, String> = BTreeMap::new();
    let mut back: BTreeMap<String, String> = BTreeMap::new();
    let mut tools = Vec::new();
    let mut unsupported = Vec::new();
    for (i, t) in opt_array(take(&mut o, "tools"), "tools")?
        .unwrap_or_default()
        .into_iter()
        .enumerate()
    {
        let p = idx("tools", i);
        let mut t = crate::json::object(t, &p)?;
        match str_of(&t, "type") {
            None | Some("custom") => {}
            Some(other) => {
                if !unsupported.iter().any(|u| u == other) {
                    unsupported.push(other.to_string());
                }
                continue;
            }
        }
        let name = match t.remove("name") {
            Some(Value::String(n)) if !n.is_empty() => n,
            _ => {
                return Err(DialectError::invalid(
                    at(&p, "name"),
                    format!("{p}.name must be a non-empty string"),
                ))
            }
        };
        if by_name.contains_key(&name) {
            return Err(DialectError::invalid(
                at(&p, "name"),
                format!("{p}.name {name:?} is defined twice"),
            ));
        }
        // Moved, not copied: the schemas are most of a coding agent's request.
        let schema = match t.remove("input_schema") {
            Some(s @ Value::Object(_)) => s,
            _ => {
                return Err(DialectError::invalid(
                    at(&p, "input_schema"),
                    format!("{p}.input_schema must be a JSON schema object"),
                ))
            }
        };
        let description = opt_string(take(&mut t, "description"), &at(&p, "description"))?;
        let strict = t.get("strict").and_then(Value::as_bool);
        let chat = names.assign(&name);
        let mut f = Map::new();
        f.insert("name".into(), Value::String(chat.clone()));
        if let Some(d) = description {
            f.insert("description".into(), Value::String(d));
        }
        f.insert("parameters".into(), schema);
        if let Some(s) = strict {
            f.insert("strict".into(), Value::Bool(s));
        }
        tools.push(serde_json::json!({"type": "function", "function": Value::Object(f)}));
        by_name.insert(name.clone(), chat.clone());
        back.insert(chat, name);
    }
    if let Some(servers) = opt_array(take(&mut o, "mcp_servers"), "mcp_servers")? {
        for s in servers {
            let label = format!(
                "mcp_servers:{}",
                s.get("name").and_then(Value::as_str).unwrap_or("?")
            );
            if !unsupported.contains(&label) {
                unsupported.push(label);
            }
        }
    }
    let (tool_choice, parallel_tool_calls) =
        read_tool_choice(take(&mut o, "tool_choice"), &by_name, &unsupported)?;

    let mut conv = Conversation::default();
    match take(&mut o, "system") {
        None => {}
        Some(Value::String(s)) if !s.is_empty() => conv.system(s),
        Some(Value::String(_)) => {}
        Some(Value::Array(blocks)) => {
            let text = system_text(&blocks, "system")?;
            if !text.is_empty() {
                conv.system(text);
            }
        }
        Some(other) => {
            return Err(DialectError::invalid(
                "system",
                format!(
                    "system must be a string or an array of text blocks (got {})",
                    type_name(&other)
                ),
            ))
        }
    }
    let list = match take(&mut o, "messages") {
        Some(Value::Array(a)) => a,
        None => return Err(DialectError::invalid("messages", "messages is required")),
        Some(other) => {
            return Err(DialectError::invalid(
                "messages",
                format!("messages must be an array (got {})", type_name(&other)),
            ))
        }
    };
    for (i, m) in list.iter().enumerate() {
        message(&mut conv, m, &idx("messages", i), &by_name)?;
    }
    let messages = conv.finish();
    if messages.is_empty() {
        return Err(DialectError::invalid(
            "messages",
            "messages must hold at least one message",
        ));
    }
    let ignored: Vec<String> = o
        .iter()
        .filter(|(k, v)| !v.is_null() || !NO_EFFECT.contains(&k.as_str()))
        .map(|(k, _)| k.clone())
        .collect();
    Ok(MessagesRequest {
        model,
        stream,
        max_tokens,
        messages,
        tools,
        names: back,
        unsupported,
        tool_choice,
        parallel_tool_calls,
        stop_sequences,
        temperature,
        top_p,
        reasoning_effort,
        thinking_visible,
        response_format,
        user_id,
        ignored,
    })
}

/// The reasoning effort a Messages request asks for, and whether thinking is shown:
/// `output_config.effort` wins (low/medium/high/xhigh as is, max → xhigh); else
/// `thinking.type = enabled` by `budget_tokens` (< 8192 → low, < 24576 → medium, else
/// high: Claude Code's think / think hard / ultrathink budgets land on the three);
/// `adaptive`, `between_tools`, `disabled` or absent → none (the source's default).
/// Thinking blocks are returned when thinking is on (enabled, adaptive, between_tools)
/// and not `display: "omitted"`.
pub(crate) fn effort_of(
    thinking: Option<(&str, Option<u32>)>,
    effort: Option<&str>,
) -> Option<&'static str> {
    if let Some(e) = effort {
        return Some(match e {
            "low" => "low",
            "medium" => "medium",
            "high" => "high",
            _ => "xhigh",
        });
    }
    match thinking {
        Some(("enabled", Some(b))) if b < 8192 => Some("low"),
        Some(("enabled", Some(b))) if b < 24576 => Some("medium"),
        Some(("enabled", _)) => Some("high"),
        _ => None,
    }
}

#[allow(clippy::type_complexity)]
fn read_thinking(
    o: &mut Map<String, Value>,
) -> Result<(Option<String>, bool, Option<Value>), DialectError> {
    let thinking = opt_object(take(o, "thinking"), "thinking")?;
    let mut kind = None;
    let mut budget = None;
    let mut visible = false;
    if let Some(t) = &thinking {
        let ty = str_of(t, "type")
            .ok_or_else(|| DialectError::invalid("thinking.type", "thinking.type is required"))?;
        one_of(
            ty,
            &["enabled", "disabled", "adaptive", "between_tools"],
            "thinking.type",
        )?;
        if ty == "enabled" {
            budget = Some(
                opt_int(t.get("budget_tokens").cloned(), "thinking.budget_tokens", 1)?.ok_or_else(
                    || {
                        DialectError::invalid(
                            "thinking.budget_tokens",
                            "thinking.budget_tokens is required",
                        )
                    },
                )?,
            );
        }
        if let Some(d) = t.get("display").and_then(Value::as_str) {
            one_of(d, &["summarized", "omitted"], "thinking.display")?;
        }
        visible = ty != "disabled" && str_of(t, "display") != Some("omitted");
        kind = Some(ty.to_string());
    }
    let config = opt_object(take(o, "output_config"), "output_config")?;
    let mut effort = None;
    let mut format = None;
    if let Some(c) = &config {
        match c.get("effort") {
            None | Some(Value::Null) => {}
            Some(Value::String(e)) => {
                one_of(
                    e,
                    &["low", "medium", "high", "xhigh", "max"],
                    "output_config.effort",
                )?;
                effort = Some(e.as_str());
            }
            Some(_) => {
                return Err(DialectError::invalid(
                    "output_config.effort",
                    "output_config.effort must be a string",
                ))
            }
        }
        match c.get("format") {
            None | Some(Value::Null) => {}
            Some(Value::Object(f)) => {
                if str_of(f, "type") != Some("json_schema") {
                    return Err(DialectError::invalid(
                        "output_config.format.type",
                        "output_config.format.type must be json_schema",
                    ));
                }
                let schema = f
                    .get("schema")
                    .filter(|s| s.is_object())
                    .cloned()
                    .ok_or_else(|| {
                        DialectError::invalid(
                            "output_config.format.schema",
                            "output_config.format.schema must be a JSON schema object",
                        )
                    })?;
                format = Some(serde_json::json!({"type": "json_schema",
                    "json_schema": {"name": "output", "schema": schema, "strict": true}}));
            }
            Some(_) => {
                return Err(DialectError::invalid(
                    "output_config.format",
                    "output_config.format must be an object",
                ))
            }
        }
    }
    let e = effort_of(kind.as_deref().map(|k| (k, budget)), effort).map(str::to_string);
    Ok((e, visible, format))
}

fn read_tool_choice(
    v: Option<Value>,
    by_name: &BTreeMap<String, String>,
    unsupported: &[String],
) -> Result<(Option<Value>, Option<bool>), DialectError> {
    let Some(v) = v else {
        return Ok((None, None));
    };
    let o = crate::json::object(v, "tool_choice")?;
    let ty = str_of(&o, "type")
        .ok_or_else(|| DialectError::invalid("tool_choice.type", "tool_choice.type is required"))?;
    let parallel = match o.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => (*b).then_some(false),
        Some(_) => {
            return Err(DialectError::invalid(
                "tool_choice.disable_parallel_tool_use",
                "tool_choice.disable_parallel_tool_use must be a boolean",
            ))
        }
    };
    let choice = match ty {
        "auto" => Value::String("auto".into()),
        "none" => Value::String("none".into()),
        "any" => {
            if by_name.is_empty() {
                return Err(required_but_none(unsupported));
            }
            Value::String("required".into())
        }
        "tool" => {
            let name = str_of(&o, "name").ok_or_else(|| {
                DialectError::invalid("tool_choice.name", "tool_choice.name is required")
            })?;
            let chat = by_name.get(name).ok_or_else(|| {
                DialectError::invalid(
                    "tool_choice.name",
                    format!("tool_choice names tool {name:?}, which is not a custom tool of the request"),
                )
            })?;
            serde_json::json!({"type": "function", "function": {"name": chat}})
        }
        other => {
            return Err(DialectError::invalid(
                "tool_choice.type",
                format!("tool_choice.type must be auto, any, tool or none (got {other:?})"),
            ))
        }
    };
    Ok((Some(choice), parallel))
}

fn required_but_none(unsupported: &[String]) -> DialectError {
    let why = if unsupported.is_empty() {
        "no tools are defined".to_string()
    } else {
        format!(
            "only Anthropic-run tools are defined ({}), which polygw's sources cannot run",
            unsupported.join(", ")
        )
    };
    DialectError::invalid(
        "tool_choice",
        format!("tool_choice requires a tool call, but {why}"),
    )
}

/// The text of `system` blocks (text blocks; `cache_control` dropped), joined by a
/// blank line.
fn system_text(blocks: &[Value], p: &str) -> Result<String, DialectError> {
    let mut texts = Vec::with_capacity(blocks.len());
    for (i, b) in blocks.iter().enumerate() {
        let bp = idx(p, i);
        let o = b
            .as_object()
            .ok_or_else(|| DialectError::invalid(&bp, format!("{bp} must be a text block")))?;
        if str_of(o, "type") != Some("text") {
            return Err(DialectError::invalid(
                at(&bp, "type"),
                format!("{bp} must be a text block"),
            ));
        }
        texts.push(block_text(o, &bp)?.to_string());
    }
    Ok(texts.join("\n\n"))
}

fn block_text<'a>(o: &'a Map<String, Value>, p: &str) -> Result<&'a str, DialectError> {
    str_of(o, "text")
        .ok_or_else(|| DialectError::invalid(at(p, "text"), format!("{p}.text must be a string")))
}

/// One message of `messages` into the conversation.
fn message(
    conv: &mut Conversation,
    m: &Value,
    p: &str,
    names: &BTreeMap<String, String>,
) -> Result<(), DialectError> {
    let o = m
        .as_object()
        .ok_or_else(|| DialectError::invalid(p, format!("{p} must be an object")))?;
    let role = str_of(o, "role")
        .ok_or_else(|| DialectError::invalid(at(p, "role"), format!("{p}.role is required")))?;
    let cp = at(p, "content");
    let blocks: Vec<Value> = match o.get("content") {
        Some(Value::String(s)) => vec![serde_json::json!({"type": "text", "text": s})],
        Some(Value::Array(a)) => a.clone(),
        _ => {
            return Err(DialectError::invalid(
                &cp,
                format!("{cp} must be a string or an array of content blocks"),
            ))
        }
    };
    match role {
        "system" => conv.system(system_text(&blocks, &cp)?),
        "user" => {
            let mut parts = Vec::new();
            for (i, b) in blocks.iter().enumerate() {
                let bp = idx(&cp, i);
                let bo = b
                    .as_object()
                    .ok_or_else(|| DialectError::invalid(&bp, format!("{bp} must be an object")))?;
                match str_of(bo, "type").unwrap_or_default() {
                    "tool_result" => {
                        let id = str_of(bo, "tool_use_id").ok_or_else(|| {
                            DialectError::invalid(
                                at(&bp, "tool_use_id"),
                                format!("{bp}.tool_use_id is required"),
                            )
                        })?;
                        let (mut text, images) = match bo.get("content") {
                            None | Some(Value::Null) => (String::new(), Vec::new()),
                            Some(Value::String(s)) => (s.clone(), Vec::new()),
                            Some(Value::Array(inner)) => {
                                let mut texts = Vec::new();
                                let mut images = Vec::new();
                                for (j, ib) in inner.iter().enumerate() {
                                    let ip = idx(&at(&bp, "content"), j);
                                    let io = ib.as_object().ok_or_else(|| {
                                        DialectError::invalid(
                                            &ip,
                                            format!("{ip} must be an object"),
                                        )
                                    })?;
                                    let part = user_part(io, &ip)?;
                                    if part["type"] == "image_url" {
                                        images.push(part);
                                    } else {
                                        texts.push(
                                            part["text"].as_str().unwrap_or_default().to_string(),
                                        );
                                    }
                                }
                                (texts.join("\n"), images)
                            }
                            Some(_) => {
                                return Err(DialectError::invalid(
                                    at(&bp, "content"),
                                    format!("{bp}.content must be a string or an array of blocks"),
                                ))
                            }
                        };
                        if bo.get("is_error").and_then(Value::as_bool) == Some(true) {
                            text = if text.is_empty() {
                                "Error".into()
                            } else {
                                format!("Error: {text}")
                            };
                        }
                        conv.tool_result(id, text, images);
                    }
                    _ => parts.push(user_part(bo, &bp)?),
                }
            }
            let only_results = !blocks.is_empty() && parts.is_empty();
            if !only_results {
                conv.user(parts);
            }
        }
        "assistant" => {
            for (i, b) in blocks.iter().enumerate() {
                let bp = idx(&cp, i);
                let bo = b
                    .as_object()
                    .ok_or_else(|| DialectError::invalid(&bp, format!("{bp} must be an object")))?;
                match str_of(bo, "type").unwrap_or_default() {
                    "text" => {
                        let t = block_text(bo, &bp)?;
                        if !t.is_empty() {
                            conv.assistant_parts(vec![text_part(t)]);
                        }
                    }
                    // The model's own reasoning, signed for Anthropic: not for other sources.
                    "thinking" | "redacted_thinking" => {}
                    "tool_use" => {
                        let id = str_of(bo, "id").ok_or_else(|| {
                            DialectError::invalid(at(&bp, "id"), format!("{bp}.id is required"))
                        })?;
                        let name = str_of(bo, "name").ok_or_else(|| {
                            DialectError::invalid(at(&bp, "name"), format!("{bp}.name is required"))
                        })?;
                        let input = bo
                            .get("input")
                            .cloned()
                            .unwrap_or_else(|| Value::Object(Map::new()));
                        let chat = names
                            .get(name)
                            .cloned()
                            .unwrap_or_else(|| crate::chat::sanitize(name));
                        conv.assistant_call(id, &chat, &input.to_string());
                    }
                    other => return Err(unsupported_block(other, &bp, "an assistant message")),
                }
            }
        }
        other => {
            return Err(DialectError::invalid(
                at(p, "role"),
                format!("{p}.role must be user, assistant or system (got {other:?})"),
            ))
        }
    }
    Ok(())
}

fn unsupported_block(ty: &str, p: &str, place: &str) -> DialectError {
    DialectError::invalid(
        at(p, "type"),
        format!(
            "{p} is a {ty:?} block, which polygw's chat-completions sources cannot take in {place}"
        ),
    )
}

/// A user-side block (text, image, text document, search result) as a chat part.
fn user_part(o: &Map<String, Value>, p: &str) -> Result<Value, DialectError> {
    match str_of(o, "type").unwrap_or_default() {
        "text" => Ok(text_part(block_text(o, p)?)),
        "image" => {
            let sp = at(p, "source");
            let src = o
                .get("source")
                .and_then(Value::as_object)
                .ok_or_else(|| DialectError::invalid(&sp, format!("{sp} is required")))?;
            match str_of(src, "type").unwrap_or_default() {
                "base64" => {
                    let media = str_of(src, "media_type").ok_or_else(|| {
                        DialectError::invalid(
                            at(&sp, "media_type"),
                            format!("{sp}.media_type is required"),
                        )
                    })?;
                    let data = str_of(src, "data").ok_or_else(|| {
                        DialectError::invalid(at(&sp, "data"), format!("{sp}.data is required"))
                    })?;
                    Ok(image_part(format!("data:{media};base64,{data}"), None))
                }
                "url" => {
                    let url = str_of(src, "url").ok_or_else(|| {
                        DialectError::invalid(at(&sp, "url"), format!("{sp}.url is required"))
                    })?;
                    Ok(image_part(url, None))
                }
                other => Err(DialectError::invalid(
                    at(&sp, "type"),
                    format!("{sp}.type {other:?} is not supported: send base64 or url images"),
                )),
            }
        }
        "document" => {
            let sp = at(p, "source");
            let src = o
                .get("source")
                .and_then(Value::as_object)
                .ok_or_else(|| DialectError::invalid(&sp, format!("{sp} is required")))?;
            let body = match str_of(src, "type").unwrap_or_default() {
                "text" => str_of(src, "data").unwrap_or_default().to_string(),
                "content" => match src.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(blocks)) => {
                        let mut texts = Vec::new();
                        for (i, b) in blocks.iter().enumerate() {
                            let bp = idx(&at(&sp, "content"), i);
                            let bo = b.as_object().filter(|b| str_of(b, "type") == Some("text")).ok_or_else(|| {
                                DialectError::invalid(&bp, format!("{bp} must be a text block"))
                            })?;
                            texts.push(block_text(bo, &bp)?.to_string());
                        }
                        texts.join("\n\n")
                    }
                    _ => String::new(),
                },
                other => {
                    return Err(DialectError::invalid(
                        at(&sp, "type"),
                        format!("{sp}.type {other:?} (a PDF or file document) is not supported: polygw's sources take text only"),
                    ))
                }
            };
            let mut head = Vec::new();
            for k in ["title", "context"] {
                if let Some(t) = str_of(o, k).filter(|t| !t.is_empty()) {
                    head.push(t.to_string());
                }
            }
            head.push(body);
            Ok(text_part(head.join("\n\n")))
        }
        "search_result" => {
            let mut text = String::new();
            if let Some(t) = str_of(o, "title") {
                text.push_str(t);
            }
            if let Some(s) = str_of(o, "source") {
                text.push_str(&format!(" ({s})"));
            }
            for b in o
                .get("content")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(t) = b.get("text").and_then(Value::as_str) {
                    text.push_str("\n\n");
                    text.push_str(t);
                }
            }
            Ok(text_part(text))
        }
        "" => Err(DialectError::invalid(
            at(p, "type"),
            format!("{p}.type is required"),
        )),
        other => Err(unsupported_block(other, p, "a user message")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_v(v: Value) -> Result<MessagesRequest, DialectError> {
        parse_request(v.to_string().as_bytes())
    }

    #[test]
    fn thinking_to_effort_table() {
        let table = [
            (None, None, None),
            (Some(("enabled", Some(1024))), None, Some("low")),
            (Some(("enabled", Some(4000))), None, Some("low")),
            (Some(("enabled", Some(10000))), None, Some("medium")),
            (Some(("enabled", Some(31999))), None, Some("high")),
            (Some(("adaptive", None)), None, None),
            (Some(("disabled", None)), None, None),
            (Some(("adaptive", None)), Some("low"), Some("low")),
            (
                Some(("enabled", Some(31999))),
                Some("medium"),
                Some("medium"),
            ),
            (None, Some("high"), Some("high")),
            (None, Some("xhigh"), Some("xhigh")),
            (None, Some("max"), Some("xhigh")),
        ];
        for (thinking, effort, want) in table {
            assert_eq!(effort_of(thinking, effort), want, "{thinking:?} {effort:?}");
        }
    }

    #[test]
    fn tool_results_come_before_the_users_other_content() {
        let r = parse_v(json!({"model": "m", "max_tokens": 10, "system": [
                {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "b"}],
            "tools": [{"name": "Read", "input_schema": {"type": "object"}}, {"type": "web_search_20250305", "name": "web_search"}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "sig"},
                    {"type": "text", "text": "reading"},
                    {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a"}}]},
                {"role": "user", "content": [
                    {"type": "text", "text": "and?"},
                    {"type": "tool_result", "tool_use_id": "t1", "is_error": true, "content": [
                        {"type": "text", "text": "no file"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}]},
                {"role": "system", "content": "late rule"}
            ]}))
        .unwrap();
        let m = serde_json::to_value(&r.messages).unwrap();
        assert_eq!(
            m,
            json!([
                {"role": "system", "content": "a\n\nb"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "reading", "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "Read", "arguments": "{\"path\":\"a\"}"}}]},
                {"role": "tool", "tool_call_id": "t1", "content":
                    "Error: no file\n[1 image(s) returned by this tool call follow in the next user message]"},
                {"role": "user", "content": [
                    {"type": "text", "text": "Images returned by tool call t1:"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                    {"type": "text", "text": "and?"}]},
                {"role": "system", "content": "late rule"}
            ])
        );
        assert_eq!(r.unsupported_tools(), ["web_search_20250305"]);
        assert_eq!(r.tools.len(), 1);
    }

    #[test]
    fn refusals_name_the_field() {
        let base = |extra: Value| {
            let mut b = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            b
        };
        let table = [
            (json!({"model": "m", "messages": []}), "max_tokens"),
            (base(json!({"temperature": 1.5})), "temperature"),
            (
                base(json!({"stop_sequences": ["a", 1]})),
                "stop_sequences[1]",
            ),
            (
                base(json!({"thinking": {"type": "enabled"}})),
                "thinking.budget_tokens",
            ),
            (
                base(json!({"thinking": {"type": "sometimes"}})),
                "thinking.type",
            ),
            (
                base(json!({"output_config": {"effort": "huge"}})),
                "output_config.effort",
            ),
            (
                base(json!({"tool_choice": {"type": "tool", "name": "nope"}})),
                "tool_choice.name",
            ),
            (base(json!({"tool_choice": {"type": "any"}})), "tool_choice"),
            (
                base(json!({"tools": [{"name": "x"}]})),
                "tools[0].input_schema",
            ),
            (
                base(
                    json!({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "x"}}]}]}),
                ),
                "messages[0].content[0].source.type",
            ),
            (
                base(
                    json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}),
                ),
                "messages[0].content[0].source.type",
            ),
            (
                base(
                    json!({"messages": [{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s"}]}]}),
                ),
                "messages[0].content[0].type",
            ),
            (
                base(json!({"messages": [{"role": "bot", "content": "x"}]})),
                "messages[0].role",
            ),
            (base(json!({"messages": []})), "messages"),
        ];
        for (v, param) in table {
            let e = parse_v(v.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{v}: {}", e.message);
        }
    }

    #[test]
    fn options_map_and_unknown_fields_are_listed() {
        let r = parse_v(json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "a.b", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "a.b", "disable_parallel_tool_use": true},
            "metadata": {"user_id": "u1"}, "top_k": 5, "service_tier": "auto", "context_management": {"edits": []},
            "fancy": 1, "thinking": {"type": "adaptive"}}))
        .unwrap();
        assert_eq!(
            r.tool_choice,
            Some(json!({"type": "function", "function": {"name": "a_b"}}))
        );
        assert_eq!(r.parallel_tool_calls, Some(false));
        assert_eq!(r.affinity_key(), Some("u1"));
        assert_eq!(
            r.ignored(),
            ["context_management", "fancy", "service_tier", "top_k"]
        );
        assert!(r.thinking_visible);
        assert_eq!(r.names["a_b"], "a.b");
    }
}
