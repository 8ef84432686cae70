//! An answer as an Anthropic `message` (content blocks, `stop_reason`, usage counted
//! Anthropic's way), and errors in Anthropic's shape with the status its SDK expects.

use polygw_core::resume::estimate_bytes;
use polygw_core::{LlmResponse, Usage, UsageSource};
use serde_json::{json, Map, Value};

use super::translate::MessagesMeta;
use crate::chat::id_suffix;

/// The key a tool call's arguments are kept under when they are not a JSON object
/// (Anthropic's `input` must be one): the call is never dropped, and the client's
/// validation of the input tells the model what went wrong.
pub const RAW_ARGUMENTS_KEY: &str = "_polygw_raw_arguments";

/// `stop_reason` and `stop_sequence` from the chat answer: `length` → max_tokens;
/// `content_filter` → refusal; tool calls (with any other reason) → tool_use; a stop
/// string the source names (vLLM's `stop_reason`) that is one of the requested
/// `stop_sequences` → stop_sequence with it; anything else → end_turn.
pub(crate) fn stop_reason(
    finish_reason: Option<&str>,
    has_tool_calls: bool,
    matched_stop: Option<&str>,
) -> (&'static str, Option<String>) {
    match finish_reason {
        Some("length") => ("max_tokens", None),
        Some("content_filter") => ("refusal", None),
        _ if has_tool_calls => ("tool_use", None),
        _ => match matched_stop {
            Some(s) => ("stop_sequence", Some(s.to_string())),
            None => ("end_turn", None),
        },
    }
}

/// The requested stop sequence a chat choice says it stopped at (`choices[0].stop_reason`,
/// a string, as vLLM reports it), when it is one of `stop_sequences`.
pub(crate) fn matched_stop(
    choice: Option<&Map<String, Value>>,
    stop_sequences: &[String],
) -> Option<String> {
    let s = choice?.get("stop_reason")?.as_str()?;
    stop_sequences.iter().find(|x| x.as_str() == s).cloned()
}

/// Choice 0 of a chat object (a completion or a chunk).
pub(crate) fn choice0(o: &Map<String, Value>) -> Option<&Map<String, Value>> {
    o.get("choices")?
        .as_array()?
        .iter()
        .find(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)?
        .as_object()
}

/// Anthropic's usage from polygw's: `input_tokens` excludes the cached and
/// cache-written tokens (OpenAI's `prompt_tokens`, polygw's convention, includes them).
/// When polygw knows no usage, `input_tokens` is `prompt_estimate` and `output_tokens`
/// an estimate of the `received` text (Anthropic's usage has no "unknown").
pub(crate) fn usage_json(
    usage: &Usage,
    source: UsageSource,
    prompt_estimate: u64,
    received: u64,
) -> Value {
    if source == UsageSource::Unavailable {
        return json!({
            "input_tokens": prompt_estimate,
            "output_tokens": received,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
        });
    }
    let cached = usage.cached_prompt_tokens.unwrap_or(0);
    let written = usage.cache_write_tokens.unwrap_or(0);
    json!({
        "input_tokens": usage.prompt_tokens.saturating_sub(cached).saturating_sub(written),
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": written,
    })
}

/// The estimated tokens of what an answer holds (text, reasoning, tool arguments).
pub(crate) fn received_estimate(answer: &LlmResponse) -> u64 {
    let mut bytes = answer.content.len();
    bytes += answer.reasoning_content.as_deref().map_or(0, str::len);
    bytes += answer
        .tool_calls
        .iter()
        .map(|t| t.arguments.len())
        .sum::<usize>();
    estimate_bytes(bytes)
}

/// A tool call's chat arguments as Anthropic's `input` object: blank → `{}`; a JSON
/// object as is; anything else (invalid JSON, a non-object) kept whole as a string
/// under [`RAW_ARGUMENTS_KEY`].
pub fn tool_input(arguments: &str) -> Value {
    if arguments.trim().is_empty() {
        return json!({});
    }
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({RAW_ARGUMENTS_KEY: arguments}),
    }
}

/// A tool_use id when the upstream gave none: `toolu_<suffix of the message id>_<index>`.
pub(crate) fn tool_use_id(message_id: &str, index: u32) -> String {
    format!("toolu_{}_{index}", id_suffix(message_id))
}

/// The `message` of a plain (non-stream) answer: thinking blocks (when thinking is on
/// in the request; `signature` ""), the text, tool_use blocks (names mapped back);
/// `stop_reason` / `stop_sequence` by [`stop_reason`] (the upstream choice's own
/// `stop_reason` consulted for stop_sequence); usage the Anthropic way.
pub fn message_object(id: &str, meta: &MessagesMeta, answer: &LlmResponse) -> Value {
    let mut content = Vec::new();
    if meta.thinking_visible {
        if let Some(r) = answer
            .reasoning_content
            .as_deref()
            .filter(|r| !r.is_empty())
        {
            content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
        }
    }
    if !answer.content.is_empty() {
        content.push(json!({"type": "text", "text": answer.content}));
    }
    for tc in &answer.tool_calls {
        let chat = tc.name.as_deref().unwrap_or_default();
        content.push(json!({
            "type": "tool_use",
            "id": tc.id.clone().unwrap_or_else(|| tool_use_id(id, tc.index)),
            "name": meta.tool_name(chat),
            "input": tool_input(&tc.arguments),
        }));
    }
    let matched = answer
        .upstream_object()
        .and_then(|u| matched_stop(choice0(&u), &meta.stop_sequences));
    let (reason, sequence) = stop_reason(
        answer.finish_reason.as_deref(),
        !answer.tool_calls.is_empty(),
        matched.as_deref(),
    );
    let model = if answer.model.is_empty() {
        meta.model()
    } else {
        &answer.model
    };
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_json(&answer.usage, answer.usage_source, meta.prompt_estimate, received_estimate(answer)),
    })
}

/// Anthropic's error body (`{"type":"error","error":{"type","message"}}`) and the
/// status a client should see, from polygw's status: 400 invalid_request_error, 401
/// authentication_error, 402 billing_error, 403 permission_error, 404 not_found_error,
/// 409 conflict_error, 413 request_too_large, 429 rate_limit_error, 500 api_error,
/// 503 → 529 overloaded_error, 504 timeout_error; other 4xx invalid_request_error
/// and other 5xx api_error with their status — a 502 (a source that cannot serve the
/// call: its key, billing or model) stays a 502 (SPEC §23.2) and carries
/// `x-should-retry: false`. The Anthropic SDK retries 408, 409, 429 and every status
/// ≥ 500 (529 and 504 included) unless `x-should-retry` says otherwise.
pub fn error_body(status: u16, message: &str) -> (u16, Value) {
    let (status, ty) = match status {
        400 => (400, "invalid_request_error"),
        401 => (401, "authentication_error"),
        402 => (402, "billing_error"),
        403 => (403, "permission_error"),
        404 => (404, "not_found_error"),
        409 => (409, "conflict_error"),
        413 => (413, "request_too_large"),
        429 => (429, "rate_limit_error"),
        503 | 529 => (529, "overloaded_error"),
        504 => (504, "timeout_error"),
        s if (400..500).contains(&s) => (s, "invalid_request_error"),
        s if s >= 500 => (s, "api_error"),
        _ => (500, "api_error"),
    };
    (
        status,
        json!({"type": "error", "error": {"type": ty, "message": message}}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{parse_request, to_chat};
    use polygw_core::ToolCall;

    #[test]
    fn stop_reason_table() {
        let table = [
            (Some("stop"), false, None, ("end_turn", None)),
            (None, false, None, ("end_turn", None)),
            (Some("length"), false, None, ("max_tokens", None)),
            (Some("length"), true, None, ("max_tokens", None)),
            (Some("tool_calls"), true, None, ("tool_use", None)),
            (Some("stop"), true, None, ("tool_use", None)),
            (Some("content_filter"), false, None, ("refusal", None)),
            (
                Some("stop"),
                false,
                Some("END"),
                ("stop_sequence", Some("END".to_string())),
            ),
            (Some("eos"), false, None, ("end_turn", None)),
        ];
        for (finish, tools, matched, want) in table {
            assert_eq!(
                stop_reason(finish, tools, matched),
                want,
                "{finish:?} {tools} {matched:?}"
            );
        }
        let choice = json!({"index": 0, "stop_reason": "END"});
        assert_eq!(
            matched_stop(choice.as_object(), &["END".into()]),
            Some("END".into())
        );
        assert_eq!(matched_stop(choice.as_object(), &["X".into()]), None);
    }

    #[test]
    fn error_status_table() {
        let table = [
            (400, 400, "invalid_request_error"),
            (401, 401, "authentication_error"),
            (403, 403, "permission_error"),
            (404, 404, "not_found_error"),
            (413, 413, "request_too_large"),
            (422, 422, "invalid_request_error"),
            (429, 429, "rate_limit_error"),
            (500, 500, "api_error"),
            (502, 502, "api_error"),
            (503, 529, "overloaded_error"),
            (504, 504, "timeout_error"),
            (507, 507, "api_error"),
        ];
        for (polygw, want_status, want_type) in table {
            let (s, body) = error_body(polygw, "m");
            assert_eq!(
                (s, body["error"]["type"].as_str()),
                (want_status, Some(want_type)),
                "{polygw}"
            );
            assert_eq!(body["type"], "error");
        }
    }

    #[test]
    fn tool_input_table() {
        assert_eq!(tool_input(""), json!({}));
        assert_eq!(tool_input("  "), json!({}));
        assert_eq!(tool_input(r#"{"a":1}"#), json!({"a": 1}));
        assert_eq!(tool_input("[1]"), json!({RAW_ARGUMENTS_KEY: "[1]"}));
        assert_eq!(
            tool_input(r#"{"a":"#),
            json!({RAW_ARGUMENTS_KEY: r#"{"a":"#})
        );
    }

    #[test]
    fn a_message_counts_input_without_the_cached_tokens() {
        let body = json!({"model": "claude-x", "max_tokens": 9, "stop_sequences": ["END"],
            "thinking": {"type": "enabled", "budget_tokens": 2000},
            "tools": [{"name": "a.b", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "hi"}]});
        let meta = to_chat(&parse_request(body.to_string().as_bytes()).unwrap())
            .unwrap()
            .meta;
        let answer = LlmResponse {
            content: "ok".into(),
            reasoning_content: Some("hm".into()),
            tool_calls: vec![ToolCall {
                index: 0,
                id: None,
                name: Some("a_b".into()),
                arguments: "{}".into(),
            }],
            finish_reason: Some("tool_calls".into()),
            usage: Usage {
                cached_prompt_tokens: Some(60),
                cache_write_tokens: Some(10),
                cache_write_1h_tokens: None,
                ..Usage::new(100, 7)
            },
            usage_source: UsageSource::Measured,
            ..Default::default()
        };
        let m = message_object("msg_q", &meta, &answer);
        assert_eq!(
            m["content"][0],
            json!({"type": "thinking", "thinking": "hm", "signature": ""})
        );
        assert_eq!(
            m["content"][2],
            json!({"type": "tool_use", "id": "toolu_q_0", "name": "a.b", "input": {}})
        );
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(
            m["usage"],
            json!({"input_tokens": 30, "output_tokens": 7, "cache_read_input_tokens": 60, "cache_creation_input_tokens": 10})
        );
        assert_eq!(m["model"], "claude-x");
        let mut upstream = Map::new();
        upstream.insert(
            "choices".into(),
            json!([{"index": 0, "stop_reason": "END", "finish_reason": "stop"}]),
        );
        let stopped = LlmResponse {
            content: "x".into(),
            finish_reason: Some("stop".into()),
            upstream: Some(upstream),
            ..Default::default()
        };
        let m = message_object("msg_q", &meta, &stopped);
        assert_eq!(
            (m["stop_reason"].as_str(), m["stop_sequence"].as_str()),
            (Some("stop_sequence"), Some("END"))
        );
        assert_eq!(m["usage"]["input_tokens"], meta.prompt_estimate());
        assert_eq!(m["usage"]["output_tokens"], 1);
    }
}
