//! An answer as a Responses `response` object: output items (reasoning summary,
//! message, tool calls as the client's tool kinds), status from `finish_reason`,
//! usage in OpenAI's Responses shape, and the request's echoed fields. Item ids are
//! derived from the response id (`msg_<suffix>_<index>`), so a stream and a plain
//! answer name the same items alike.

use polygw_core::{LlmResponse, Usage, UsageSource};
use serde_json::{json, Map, Value};

use super::tools::{ToolKind, ToolTarget};
use super::translate::ResponsesMeta;
use crate::chat::id_suffix;

/// The `status` and `incomplete_details.reason` of an answer with this
/// `finish_reason`: `length` → incomplete (max_output_tokens), `content_filter` →
/// incomplete (content_filter), anything else → completed.
pub(crate) fn status_of(finish_reason: Option<&str>) -> (&'static str, Option<&'static str>) {
    match finish_reason {
        Some("length") => ("incomplete", Some("max_output_tokens")),
        Some("content_filter") => ("incomplete", Some("content_filter")),
        _ => ("completed", None),
    }
}

/// An output item's id: `<prefix>_<suffix of the response id>_<output index>`.
pub(crate) fn item_id(prefix: &str, response_id: &str, index: usize) -> String {
    format!("{prefix}_{}_{index}", id_suffix(response_id))
}

/// A tool call's id when the upstream gave none: `call_<suffix>_<index>`.
pub(crate) fn call_id(response_id: &str, index: u32) -> String {
    format!("call_{}_{index}", id_suffix(response_id))
}

/// The usage object of a response: `null` when polygw knows none (never zeros for
/// unknown); cached and cache-write tokens are part of `input_tokens`, as OpenAI
/// counts them.
pub(crate) fn usage_json(usage: &Usage, source: UsageSource) -> Value {
    if source == UsageSource::Unavailable {
        return Value::Null;
    }
    json!({
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_prompt_tokens.unwrap_or(0),
            "cache_write_tokens": usage.cache_write_tokens.unwrap_or(0),
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens.unwrap_or(0)},
        "total_tokens": usage.total(),
    })
}

/// A response whose usage is not as measured says so the way chat does (SPEC §25.5):
/// `"polygw": {"usage_source": "estimated"}` beside its `usage` (a resumed answer
/// counts a cut leg's delivered text as estimated tokens).
pub(crate) fn with_usage_source(mut response: Value, source: UsageSource) -> Value {
    if source == UsageSource::Estimated {
        if let Some(o) = response.as_object_mut() {
            o.insert("polygw".into(), json!({"usage_source": source.as_str()}));
        }
    }
    response
}

/// A reasoning item with one summary part.
pub(crate) fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [{"type": "summary_text", "text": text}]})
}

/// An `output_text` part.
pub(crate) fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// An assistant message item with one `output_text` part.
pub(crate) fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": [text_part(text)]})
}

/// The id prefix of an item for a call to this kind of tool.
pub(crate) fn call_prefix(kind: Option<ToolKind>) -> &'static str {
    match kind {
        None | Some(ToolKind::Function) => "fc",
        Some(ToolKind::Custom) => "ctc",
        Some(ToolKind::LocalShell) => "lsh",
        Some(ToolKind::Shell) => "sh",
        Some(ToolKind::ApplyPatch) => "apc",
        Some(ToolKind::ToolSearch) => "tsc",
    }
}

/// The output item of a tool call: a `function_call`, or the item of the client's tool
/// kind with the chat arguments converted (a custom tool's `input`, a built-in's
/// action). A built-in call whose arguments are not a JSON object comes back as a
/// `function_call` with the raw arguments (never dropped); a custom call whose
/// arguments are not `{"input": "<string>"}` has the raw arguments as its input.
pub(crate) fn call_item(
    target: Option<&ToolTarget>,
    chat_name: &str,
    id: &str,
    call_id: &str,
    arguments: &str,
    status: &str,
) -> Value {
    let function_call = |name: &str, namespace: Option<&str>| {
        let mut m = Map::new();
        m.insert("type".into(), json!("function_call"));
        m.insert("id".into(), json!(id));
        m.insert("call_id".into(), json!(call_id));
        m.insert("name".into(), json!(name));
        if let Some(ns) = namespace {
            m.insert("namespace".into(), json!(ns));
        }
        m.insert("arguments".into(), json!(arguments));
        m.insert("status".into(), json!(status));
        Value::Object(m)
    };
    let Some(t) = target else {
        return function_call(chat_name, None);
    };
    let args = serde_json::from_str::<Value>(arguments).ok();
    let args_obj = args.as_ref().and_then(Value::as_object);
    match (t.kind, args_obj) {
        (ToolKind::Function, _) => function_call(&t.name, t.namespace.as_deref()),
        (ToolKind::Custom, _) => {
            let input = args_obj
                .and_then(|o| o.get("input"))
                .and_then(Value::as_str)
                .map_or_else(|| arguments.to_string(), str::to_string);
            let mut m = Map::new();
            m.insert("type".into(), json!("custom_tool_call"));
            m.insert("id".into(), json!(id));
            m.insert("call_id".into(), json!(call_id));
            m.insert("name".into(), json!(t.name));
            if let Some(ns) = &t.namespace {
                m.insert("namespace".into(), json!(ns));
            }
            m.insert("input".into(), json!(input));
            m.insert("status".into(), json!(status));
            Value::Object(m)
        }
        (ToolKind::LocalShell, Some(a)) => {
            let mut action = a.clone();
            action.insert("type".into(), json!("exec"));
            action.entry("env").or_insert_with(|| json!({}));
            json!({"type": "local_shell_call", "id": id, "call_id": call_id, "action": action, "status": status})
        }
        (ToolKind::Shell, Some(a)) => {
            json!({"type": "shell_call", "id": id, "call_id": call_id, "action": a, "status": status})
        }
        (ToolKind::ApplyPatch, Some(a)) => {
            json!({"type": "apply_patch_call", "id": id, "call_id": call_id, "operation": a, "status": status})
        }
        (ToolKind::ToolSearch, Some(a)) => json!({
            "type": "tool_search_call", "id": id, "call_id": call_id, "arguments": a,
            "execution": "client", "status": status,
        }),
        (_, None) => function_call(&t.name, None),
    }
}

/// The output items of an answer, in order: a reasoning item when the answer has
/// reasoning text, a message when it has text (or has no tool calls: an empty answer is
/// an empty message), then one item per tool call. When the answer was cut
/// (`incomplete`), the last item's status is `incomplete`. These are the items to store.
pub fn output_items(id: &str, meta: &ResponsesMeta, answer: &LlmResponse) -> Vec<Value> {
    let (status, _) = status_of(answer.finish_reason.as_deref());
    let mut out = Vec::new();
    if let Some(r) = answer
        .reasoning_content
        .as_deref()
        .filter(|r| !r.is_empty())
    {
        out.push(reasoning_item(&item_id("rs", id, out.len()), r));
    }
    if !answer.content.is_empty() || answer.tool_calls.is_empty() {
        out.push(message_item(
            &item_id("msg", id, out.len()),
            &answer.content,
            "completed",
        ));
    }
    for tc in &answer.tool_calls {
        let chat_name = tc.name.as_deref().unwrap_or_default();
        let target = meta.tool_target(chat_name);
        let item = item_id(call_prefix(target.map(|t| t.kind)), id, out.len());
        let cid = tc.id.clone().unwrap_or_else(|| call_id(id, tc.index));
        out.push(call_item(
            target,
            chat_name,
            &item,
            &cid,
            &tc.arguments,
            "completed",
        ));
    }
    if status == "incomplete" {
        if let Some(last) = out.last_mut().and_then(Value::as_object_mut) {
            if last.contains_key("status") {
                last.insert("status".into(), json!("incomplete"));
            }
        }
    }
    out
}

/// A `response` object with these parts and the request's echoed fields.
#[allow(clippy::too_many_arguments)]
pub(crate) fn response_value(
    id: &str,
    created_at: u64,
    model: &str,
    meta: &ResponsesMeta,
    status: &str,
    incomplete: Option<&str>,
    output: Vec<Value>,
    usage: Value,
    error: Value,
) -> Value {
    let mut o = meta.echo.clone();
    o.insert("id".into(), json!(id));
    o.insert("object".into(), json!("response"));
    o.insert("created_at".into(), json!(created_at));
    o.insert("status".into(), json!(status));
    o.insert("error".into(), error);
    o.insert(
        "incomplete_details".into(),
        incomplete.map_or(Value::Null, |r| json!({"reason": r})),
    );
    o.insert("model".into(), json!(model));
    o.insert("output".into(), Value::Array(output));
    o.insert("usage".into(), usage);
    Value::Object(o)
}

/// The `response` object of a plain (non-stream) answer: `status` completed, or
/// incomplete with `incomplete_details.reason` (max_output_tokens, content_filter)
/// from `finish_reason`; `output` as [`output_items`]; `usage` `null` when unknown;
/// `model` the model that answered (the requested one when unknown).
pub fn response_object(
    id: &str,
    created_at: u64,
    meta: &ResponsesMeta,
    answer: &LlmResponse,
) -> Value {
    let (status, incomplete) = status_of(answer.finish_reason.as_deref());
    let model = if answer.model.is_empty() {
        meta.model()
    } else {
        &answer.model
    };
    with_usage_source(
        response_value(
            id,
            created_at,
            model,
            meta,
            status,
            incomplete,
            output_items(id, meta, answer),
            usage_json(&answer.usage, answer.usage_source),
            Value::Null,
        ),
        answer.usage_source,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::responses::{parse_request, to_chat};
    use polygw_core::ToolCall;

    fn meta(tools: Value) -> ResponsesMeta {
        let body = json!({"model": "m", "input": "x", "tools": tools, "metadata": {"k": "v"}});
        to_chat(&parse_request(body.to_string().as_bytes()).unwrap(), &[])
            .unwrap()
            .meta
    }

    fn call(index: u32, name: &str, args: &str) -> ToolCall {
        ToolCall {
            index,
            id: Some(format!("call_{index}")),
            name: Some(name.into()),
            arguments: args.into(),
        }
    }

    #[test]
    fn status_table() {
        let table = [
            (Some("stop"), ("completed", None)),
            (Some("tool_calls"), ("completed", None)),
            (None, ("completed", None)),
            (Some("length"), ("incomplete", Some("max_output_tokens"))),
            (
                Some("content_filter"),
                ("incomplete", Some("content_filter")),
            ),
        ];
        for (finish, want) in table {
            assert_eq!(status_of(finish), want, "{finish:?}");
        }
    }

    #[test]
    fn calls_come_back_as_the_clients_tool_kinds() {
        let m = meta(json!([
            {"type": "custom", "name": "apply_patch"},
            {"type": "namespace", "name": "crm", "description": "", "tools": [{"type": "function", "name": "orders"}]},
            {"type": "local_shell"}
        ]));
        let answer = LlmResponse {
            content: String::new(),
            reasoning_content: Some("think".into()),
            tool_calls: vec![
                call(0, "apply_patch", r#"{"input":"*** Begin Patch"}"#),
                call(1, "crm__orders", r#"{"id":1}"#),
                call(2, "local_shell", r#"{"command":["ls"]}"#),
                call(3, "local_shell", "not json"),
                call(4, "invented", "{}"),
            ],
            finish_reason: Some("tool_calls".into()),
            usage: Usage::new(10, 5),
            usage_source: UsageSource::Measured,
            ..Default::default()
        };
        let items = output_items("resp_abc", &m, &answer);
        let brief: Vec<(String, String)> = items
            .iter()
            .map(|i| {
                (
                    i["type"].as_str().unwrap().to_string(),
                    i["id"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let want = [
            ("reasoning", "rs_abc_0"),
            ("custom_tool_call", "ctc_abc_1"),
            ("function_call", "fc_abc_2"),
            ("local_shell_call", "lsh_abc_3"),
            ("function_call", "lsh_abc_4"),
            ("function_call", "fc_abc_5"),
        ];
        assert_eq!(brief, want.map(|(a, b)| (a.to_string(), b.to_string())));
        assert_eq!(items[1]["input"], "*** Begin Patch");
        assert_eq!(
            (items[2]["name"].as_str(), items[2]["namespace"].as_str()),
            (Some("orders"), Some("crm"))
        );
        assert_eq!(
            items[3]["action"],
            json!({"type": "exec", "command": ["ls"], "env": {}})
        );
        assert_eq!(
            (items[4]["name"].as_str(), items[4]["arguments"].as_str()),
            (Some("local_shell"), Some("not json"))
        );
        assert_eq!(items[5]["name"], "invented");
        let r = response_object("resp_abc", 7, &m, &answer);
        assert_eq!(r["status"], "completed");
        assert_eq!(r["usage"]["total_tokens"], 15);
        assert_eq!(r["metadata"], json!({"k": "v"}));
        assert_eq!(r["model"], "m");
    }

    #[test]
    fn an_estimated_usage_is_marked_as_chat_marks_it() {
        let r = with_usage_source(
            json!({"usage": {"total_tokens": 3}}),
            UsageSource::Estimated,
        );
        assert_eq!(r["polygw"]["usage_source"], "estimated");
        for s in [UsageSource::Measured, UsageSource::Unavailable] {
            assert!(with_usage_source(json!({}), s).get("polygw").is_none());
        }
    }

    #[test]
    fn a_cut_answer_is_incomplete_and_unknown_usage_is_null() {
        let m = meta(json!([]));
        let answer = LlmResponse {
            content: "partial".into(),
            finish_reason: Some("length".into()),
            model: "upstream-m".into(),
            ..Default::default()
        };
        let r = response_object("resp_x", 1, &m, &answer);
        assert_eq!(r["status"], "incomplete");
        assert_eq!(
            r["incomplete_details"],
            json!({"reason": "max_output_tokens"})
        );
        assert_eq!(r["output"][0]["status"], "incomplete");
        assert_eq!(r["usage"], Value::Null);
        assert!(r.get("polygw").is_none(), "only an estimate is marked");
        assert_eq!(r["model"], "upstream-m");
        let cached = Usage {
            cached_prompt_tokens: Some(4),
            reasoning_tokens: Some(2),
            ..Usage::new(10, 3)
        };
        let u = usage_json(&cached, UsageSource::Estimated);
        assert_eq!(u["input_tokens"], 10);
        assert_eq!(u["input_tokens_details"]["cached_tokens"], 4);
        assert_eq!(u["output_tokens_details"]["reasoning_tokens"], 2);
    }
}
