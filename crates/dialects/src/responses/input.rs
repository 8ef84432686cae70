//! Responses input items as conversation turns: each item is checked and read into a
//! [`Turn`] (a message's parts, a tool call, a tool output, more tools, a reference),
//! and the turns are laid out as chat messages by [`crate::chat::Conversation`].

use serde_json::{Map, Value};

use super::tools::{builtin_type, ToolKind};
use crate::chat::{image_part, text_part};
use crate::error::DialectError;
use crate::json::{at, idx, str_of, type_name};

/// One input item, read.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Turn {
    /// A `system` or `developer` message: its text.
    System(String),
    /// A `user` message: chat parts (text, image_url).
    User(Vec<Value>),
    /// An `assistant` message: text parts.
    Assistant(Vec<Value>),
    /// A tool call the model made.
    Call {
        /// The tool's kind.
        kind: ToolKind,
        /// `call_id`.
        call_id: String,
        /// The tool's name as the client knows it.
        name: String,
        /// Its namespace.
        namespace: Option<String>,
        /// The chat arguments (JSON text).
        arguments: String,
    },
    /// A tool call's output.
    Output {
        /// `call_id`.
        call_id: String,
        /// Its text.
        text: String,
        /// Images it returned (chat image parts).
        images: Vec<Value>,
    },
    /// Tools made available (`additional_tools`, tools a client-run search loaded).
    Tools(Vec<Value>),
    /// An `item_reference` to resolve.
    Reference(String),
}

fn invalid(p: &str, what: &str) -> DialectError {
    DialectError::invalid(p, format!("{p} {what}"))
}

fn req_str<'a>(o: &'a Map<String, Value>, key: &str, p: &str) -> Result<&'a str, DialectError> {
    match o.get(key) {
        Some(Value::String(s)) => Ok(s),
        None | Some(Value::Null) => Err(invalid(&at(p, key), "is required")),
        Some(v) => Err(invalid(
            &at(p, key),
            &format!("must be a string (got {})", type_name(v)),
        )),
    }
}

fn opt_str<'a>(
    o: &'a Map<String, Value>,
    key: &str,
    p: &str,
) -> Result<Option<&'a str>, DialectError> {
    match o.get(key) {
        Some(Value::String(s)) => Ok(Some(s)),
        None | Some(Value::Null) => Ok(None),
        Some(v) => Err(invalid(
            &at(p, key),
            &format!("must be a string (got {})", type_name(v)),
        )),
    }
}

/// The call id of a call item: `call_id`, else (items of older clients) `id`.
fn call_id_of<'a>(o: &'a Map<String, Value>, p: &str) -> Result<&'a str, DialectError> {
    match opt_str(o, "call_id", p)? {
        Some(c) => Ok(c),
        None => match opt_str(o, "id", p)? {
            Some(id) => Ok(id),
            // Neither: the error names the field a client should send.
            None => req_str(o, "call_id", p),
        },
    }
}

/// Reads one input item at `p` (`input[3]`).
pub(crate) fn parse_item(item: &Value, p: &str) -> Result<Vec<Turn>, DialectError> {
    let o = item
        .as_object()
        .ok_or_else(|| invalid(p, &format!("must be an object (got {})", type_name(item))))?;
    let ty = match o.get("type") {
        None | Some(Value::Null) if o.contains_key("role") => "message",
        Some(Value::String(s)) => s.as_str(),
        _ => {
            return Err(invalid(
                &at(p, "type"),
                "is required (or role, for a message)",
            ))
        }
    };
    let one = |t: Turn| Ok(vec![t]);
    match ty {
        "message" => one(message(o, p)?),
        "function_call" => one(Turn::Call {
            kind: ToolKind::Function,
            call_id: call_id_of(o, p)?.to_string(),
            name: req_str(o, "name", p)?.to_string(),
            namespace: opt_str(o, "namespace", p)?.map(str::to_string),
            arguments: req_str(o, "arguments", p)?.to_string(),
        }),
        "custom_tool_call" => one(Turn::Call {
            kind: ToolKind::Custom,
            call_id: call_id_of(o, p)?.to_string(),
            name: req_str(o, "name", p)?.to_string(),
            namespace: opt_str(o, "namespace", p)?.map(str::to_string),
            arguments: custom_arguments(req_str(o, "input", p)?),
        }),
        "function_call_output" | "custom_tool_call_output" => {
            let call_id = req_str(o, "call_id", p)?.to_string();
            let (text, images) = output(o.get("output"), &at(p, "output"))?;
            one(Turn::Output {
                call_id,
                text,
                images,
            })
        }
        "local_shell_call" | "shell_call" | "apply_patch_call" | "tool_search_call" => {
            let (kind, field) = match ty {
                "local_shell_call" => (ToolKind::LocalShell, "action"),
                "shell_call" => (ToolKind::Shell, "action"),
                "apply_patch_call" => (ToolKind::ApplyPatch, "operation"),
                _ => (ToolKind::ToolSearch, "arguments"),
            };
            let call_id = match opt_str(o, "call_id", p)? {
                Some(c) => c,
                None => req_str(o, "id", p)?,
            };
            let mut payload = o
                .get(field)
                .filter(|v| !v.is_null())
                .cloned()
                .ok_or_else(|| invalid(&at(p, field), "is required"))?;
            if kind == ToolKind::LocalShell {
                // `action.type` is always `exec`: not an argument the model chooses.
                if let Some(a) = payload.as_object_mut() {
                    a.remove("type");
                }
            }
            one(Turn::Call {
                kind,
                call_id: call_id.to_string(),
                name: builtin_type(kind).to_string(),
                namespace: None,
                arguments: payload.to_string(),
            })
        }
        "local_shell_call_output" => {
            // Its `id` is the call's id (the API's own description of the field).
            let call_id = match opt_str(o, "call_id", p)? {
                Some(c) => c,
                None => req_str(o, "id", p)?,
            };
            let text = req_str(o, "output", p)?.to_string();
            one(Turn::Output {
                call_id: call_id.to_string(),
                text,
                images: Vec::new(),
            })
        }
        "shell_call_output" | "apply_patch_call_output" => {
            // The structured result as compact JSON text: lossless, and readable.
            let mut result = Map::new();
            for k in ["status", "output", "max_output_length"] {
                if let Some(v) = o.get(k).filter(|v| !v.is_null()) {
                    result.insert(k.into(), v.clone());
                }
            }
            one(Turn::Output {
                call_id: req_str(o, "call_id", p)?.to_string(),
                text: Value::Object(result).to_string(),
                images: Vec::new(),
            })
        }
        "tool_search_output" => {
            let call_id = match opt_str(o, "call_id", p)? {
                Some(c) => c,
                None => req_str(o, "id", p)?,
            };
            let tools = o
                .get("tools")
                .and_then(Value::as_array)
                .cloned()
                .ok_or_else(|| invalid(&at(p, "tools"), "must be an array"))?;
            let names: Vec<Value> = tools
                .iter()
                .filter_map(|t| t.get("name").cloned())
                .collect();
            let text = serde_json::json!({"loaded_tools": names}).to_string();
            Ok(vec![
                Turn::Tools(tools),
                Turn::Output {
                    call_id: call_id.to_string(),
                    text,
                    images: Vec::new(),
                },
            ])
        }
        "additional_tools" => {
            let tools = o
                .get("tools")
                .and_then(Value::as_array)
                .cloned()
                .ok_or_else(|| invalid(&at(p, "tools"), "must be an array"))?;
            one(Turn::Tools(tools))
        }
        // Reasoning is the model's own; nothing of it is sent upstream (its encrypted
        // content is OpenAI's, and polygw returns none). A web search call carries no
        // result (the message after it does).
        "reasoning" | "web_search_call" => Ok(Vec::new()),
        "item_reference" => one(Turn::Reference(req_str(o, "id", p)?.to_string())),
        other => Err(DialectError::invalid(
            at(p, "type"),
            format!(
                "{p} is a {other:?} item, which polygw's chat-completions sources cannot replay \
                 (a hosted tool's item or an unknown type)"
            ),
        )),
    }
}

/// The chat arguments of a custom tool call: `{"input": …}`.
pub(crate) fn custom_arguments(input: &str) -> String {
    let mut m = Map::new();
    m.insert("input".into(), Value::String(input.to_string()));
    Value::Object(m).to_string()
}

fn message(o: &Map<String, Value>, p: &str) -> Result<Turn, DialectError> {
    let role = req_str(o, "role", p)?;
    let cp = at(p, "content");
    let parts: Vec<(Value, bool)> = match o.get("content") {
        Some(Value::String(s)) => vec![(text_part(s.clone()), false)],
        Some(Value::Array(a)) => {
            let mut out = Vec::with_capacity(a.len());
            for (i, part) in a.iter().enumerate() {
                out.push(content_part(part, &idx(&cp, i))?);
            }
            out
        }
        None | Some(Value::Null) => return Err(invalid(&cp, "is required")),
        Some(v) => {
            return Err(invalid(
                &cp,
                &format!(
                    "must be a string or an array of parts (got {})",
                    type_name(v)
                ),
            ))
        }
    };
    match role {
        "user" => Ok(Turn::User(parts.into_iter().map(|(v, _)| v).collect())),
        "assistant" => {
            if let Some(i) = parts.iter().position(|(_, image)| *image) {
                return Err(invalid(
                    &idx(&cp, i),
                    "is an image, which an assistant message cannot hold",
                ));
            }
            Ok(Turn::Assistant(parts.into_iter().map(|(v, _)| v).collect()))
        }
        "system" | "developer" => {
            let mut texts = Vec::with_capacity(parts.len());
            for (i, (v, image)) in parts.into_iter().enumerate() {
                if image {
                    return Err(invalid(
                        &idx(&cp, i),
                        "is an image, which chat sources do not take in a system message",
                    ));
                }
                texts.push(v["text"].as_str().unwrap_or_default().to_string());
            }
            Ok(Turn::System(texts.join("\n\n")))
        }
        other => Err(DialectError::invalid(
            at(p, "role"),
            format!("{p}.role must be user, assistant, system or developer (got {other:?})"),
        )),
    }
}

/// One content part as a chat part, and whether it is an image.
fn content_part(part: &Value, p: &str) -> Result<(Value, bool), DialectError> {
    let o = part
        .as_object()
        .ok_or_else(|| invalid(p, &format!("must be an object (got {})", type_name(part))))?;
    match str_of(o, "type").unwrap_or_default() {
        "input_text" | "output_text" | "text" | "summary_text" | "reasoning_text" => {
            Ok((text_part(req_str(o, "text", p)?), false))
        }
        "refusal" => Ok((text_part(req_str(o, "refusal", p)?), false)),
        "input_image" => Ok((image(o, p)?, true)),
        "input_file" => Err(DialectError::invalid(
            p,
            format!("{p} is an input_file, which polygw's chat-completions sources do not take"),
        )),
        "" => Err(invalid(&at(p, "type"), "is required")),
        other => Err(DialectError::invalid(
            at(p, "type"),
            format!("{p}.type {other:?} is not a supported content part"),
        )),
    }
}

fn image(o: &Map<String, Value>, p: &str) -> Result<Value, DialectError> {
    if o.get("file_id").is_some_and(|v| !v.is_null()) {
        return Err(DialectError::invalid(
            at(p, "file_id"),
            format!("{p}.file_id is not supported: polygw holds no files; send image_url (a URL or a data URL)"),
        ));
    }
    let url = req_str(o, "image_url", p)?;
    let detail = opt_str(o, "detail", p)?.map(str::to_string);
    Ok(image_part(url, detail))
}

/// A tool output (`output`: a string or parts) as text and images.
fn output(v: Option<&Value>, p: &str) -> Result<(String, Vec<Value>), DialectError> {
    match v {
        Some(Value::String(s)) => Ok((s.clone(), Vec::new())),
        Some(Value::Array(a)) => {
            let mut texts = Vec::new();
            let mut images = Vec::new();
            for (i, part) in a.iter().enumerate() {
                let (v, is_image) = content_part(part, &idx(p, i))?;
                if is_image {
                    images.push(v);
                } else {
                    texts.push(v["text"].as_str().unwrap_or_default().to_string());
                }
            }
            Ok((texts.join("\n"), images))
        }
        None | Some(Value::Null) => Err(invalid(p, "is required")),
        Some(v) => Err(invalid(
            p,
            &format!(
                "must be a string or an array of parts (got {})",
                type_name(v)
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn turn(v: Value) -> Turn {
        let mut t = parse_item(&v, "input[0]").unwrap();
        assert_eq!(t.len(), 1, "{v}");
        t.remove(0)
    }

    fn err(v: Value) -> String {
        parse_item(&v, "input[0]").unwrap_err().param.unwrap()
    }

    /// A call item of an older client carries its call id as `id` only.
    #[test]
    fn a_call_id_falls_back_to_the_items_id() {
        let call = |v: Value| match turn(v) {
            Turn::Call { call_id, .. } => call_id,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            call(json!({"type": "function_call", "id": "old", "name": "f", "arguments": "{}"})),
            "old"
        );
        assert_eq!(
            call(
                json!({"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "{}"})
            ),
            "c",
            "call_id wins"
        );
        assert_eq!(
            err(json!({"type": "function_call", "name": "f", "arguments": "{}"})),
            "input[0].call_id"
        );
    }

    #[test]
    fn items_read_as_turns() {
        assert_eq!(
            turn(json!({"role": "user", "content": "hi"})),
            Turn::User(vec![text_part("hi")])
        );
        assert_eq!(
            turn(
                json!({"type": "message", "role": "developer", "id": "m1", "content": [
                {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]})
            ),
            Turn::System("a\n\nb".into())
        );
        assert_eq!(
            turn(json!({"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "x", "annotations": []}, {"type": "refusal", "refusal": "no"}]})),
            Turn::Assistant(vec![text_part("x"), text_part("no")])
        );
        assert_eq!(
            turn(
                json!({"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": "*** Begin"})
            ),
            Turn::Call {
                kind: ToolKind::Custom,
                call_id: "c".into(),
                name: "apply_patch".into(),
                namespace: None,
                arguments: r#"{"input":"*** Begin"}"#.into()
            }
        );
        assert_eq!(
            turn(
                json!({"type": "local_shell_call", "id": "lsh", "call_id": "c", "status": "completed",
                "action": {"type": "exec", "command": ["ls"], "env": {}}})
            ),
            Turn::Call {
                kind: ToolKind::LocalShell,
                call_id: "c".into(),
                name: "local_shell".into(),
                namespace: None,
                arguments: r#"{"command":["ls"],"env":{}}"#.into()
            }
        );
        assert_eq!(
            turn(
                json!({"type": "function_call_output", "call_id": "c", "output": [
                {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "data:image/png;base64,AA"}]})
            ),
            Turn::Output {
                call_id: "c".into(),
                text: "see".into(),
                images: vec![image_part("data:image/png;base64,AA", None)]
            }
        );
        assert!(
            parse_item(&json!({"type": "reasoning", "summary": []}), "i")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn refusals_name_the_field() {
        let table = [
            (
                json!({"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}),
                "input[0].content[0].file_id",
            ),
            (
                json!({"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}),
                "input[0].content[0]",
            ),
            (
                json!({"role": "system", "content": [{"type": "input_image", "image_url": "u"}]}),
                "input[0].content[0]",
            ),
            (json!({"role": "tool", "content": "x"}), "input[0].role"),
            (
                json!({"type": "function_call", "call_id": "c", "name": "f"}),
                "input[0].arguments",
            ),
            (json!({"type": "computer_call", "id": "x"}), "input[0].type"),
            (
                json!({"type": "message", "role": "user", "content": 3}),
                "input[0].content",
            ),
            (json!("text"), "input[0]"),
        ];
        for (v, param) in table {
            assert_eq!(err(v.clone()), param, "{v}");
        }
    }
}
