//! OpenAI wire format for the proxy: request bodies → `ChatRequest`, responses and
//! stream chunks → OpenAI JSON, errors → OpenAI's error object and HTTP status.

use axum::http::StatusCode;
use polygw::{ChatRequest, GatewayError, LlmResponse, Message, StreamDelta, TerminalReason, Usage};
use serde_json::{json, Map, Value};

/// An error as the proxy answers it.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<String>,
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn bad_request(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
            retry_after: None,
        }
    }

    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: Some(code.to_string()),
            retry_after: None,
        }
    }

    /// OpenAI's error object.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    /// The error of a failed logical call (SPEC §11): a rejection keeps the upstream's
    /// status and code; retry_exhausted, stalled, no_runnable_source and
    /// governance_backend are 503 (with Retry-After when known); deadline_exceeded 504.
    pub fn from_gateway(e: &GatewayError) -> Self {
        let retry_after = e
            .context()
            .and_then(|c| c.retry_after)
            .map(|d| d.as_secs_f64().ceil().max(1.0) as u64);
        match e {
            GatewayError::InvalidRequest { field, message } => {
                ApiError::bad_request(field, format!("{field}: {message}"))
            }
            GatewayError::Config(c) => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "configuration",
                format!("the gateway is misconfigured: {c}"),
            ),
            _ => {
                let reason = e
                    .terminal_reason()
                    .unwrap_or(TerminalReason::RetryExhausted);
                let last = e.last_error();
                match reason {
                    TerminalReason::Rejected => {
                        let status = last
                            .and_then(|l| l.http_status)
                            .and_then(|s| StatusCode::from_u16(s).ok())
                            .filter(|s| s.is_client_error())
                            .unwrap_or(StatusCode::BAD_REQUEST);
                        ApiError {
                            status,
                            message: last
                                .and_then(|l| l.provider_message.clone())
                                .unwrap_or_else(|| e.to_string()),
                            kind: "invalid_request_error",
                            param: None,
                            code: last.and_then(|l| l.provider_code.clone()),
                            retry_after: None,
                        }
                    }
                    TerminalReason::DeadlineExceeded => ApiError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "timeout",
                        reason.as_str(),
                        e.to_string(),
                    ),
                    TerminalReason::StructuredInvalid => ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        "server_error",
                        reason.as_str(),
                        e.to_string(),
                    ),
                    _ => ApiError {
                        retry_after,
                        ..ApiError::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "server_error",
                            reason.as_str(),
                            e.to_string(),
                        )
                    },
                }
            }
        }
    }
}

/// A chat request read from an OpenAI body.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedChat {
    pub model: String,
    pub request: ChatRequest,
    /// `stream_options.include_usage`: send a final usage chunk.
    pub include_usage: bool,
}

/// Keys that are not passed through in the overlay (they are read, or set per source).
const NOT_OVERLAID: [&str; 10] = [
    "model",
    "messages",
    "stream",
    "stream_options",
    "temperature",
    "max_tokens",
    "max_completion_tokens",
    "reasoning_effort",
    "response_format",
    "tools",
];

/// Reads `/v1/chat/completions` JSON. Errors name the field.
pub fn parse_chat(body: &[u8]) -> Result<ParsedChat, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request("body", format!("the body is not valid JSON: {e}")))?;
    let Value::Object(mut o) = v else {
        return Err(ApiError::bad_request(
            "body",
            "the body must be a JSON object",
        ));
    };
    let model = match o.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        Some(_) => {
            return Err(ApiError::bad_request(
                "model",
                "model must be a non-empty string",
            ))
        }
        None => return Err(ApiError::bad_request("model", "model is required")),
    };
    let messages: Vec<Message> = match o.remove("messages") {
        Some(Value::Array(a)) if !a.is_empty() => {
            let mut out = Vec::with_capacity(a.len());
            for (i, m) in a.into_iter().enumerate() {
                out.push(serde_json::from_value(m).map_err(|e| {
                    ApiError::bad_request(
                        &format!("messages[{i}]"),
                        format!("messages[{i}] is not a message: {e}"),
                    )
                })?);
            }
            out
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_request(
                "messages",
                "messages must not be empty",
            ))
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "messages",
                "messages must be an array",
            ))
        }
        None => return Err(ApiError::bad_request("messages", "messages is required")),
    };
    let stream = match o.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad_request("stream", "stream must be a boolean")),
    };
    if let Some(n) = o.get("n") {
        if n.as_u64() != Some(1) && !n.is_null() {
            return Err(ApiError::bad_request("n", "only n = 1 is supported"));
        }
    }
    let include_usage = o
        .get("stream_options")
        .and_then(|s| s.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let num = |k: &str| -> Result<Option<f64>, ApiError> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| ApiError::bad_request(k, format!("{k} must be a number"))),
        }
    };
    let temperature = num("temperature")?;
    let max_tokens = match num("max_completion_tokens")?.or(num("max_tokens")?) {
        None => None,
        Some(x) if x >= 1.0 && x.fract() == 0.0 && x <= u32::MAX as f64 => Some(x as u32),
        Some(_) => {
            return Err(ApiError::bad_request(
                "max_tokens",
                "max_tokens must be a positive integer",
            ))
        }
    };
    let reasoning_effort = match o.get("reasoning_effort") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "reasoning_effort",
                "reasoning_effort must be a string",
            ))
        }
    };
    let response_format = match o.get("response_format") {
        None | Some(Value::Null) => None,
        Some(x @ Value::Object(_)) => Some(x.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "response_format",
                "response_format must be an object",
            ))
        }
    };
    let tools = match o.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(a.clone()),
        Some(_) => return Err(ApiError::bad_request("tools", "tools must be an array")),
    };
    let overlay: Map<String, Value> = o
        .into_iter()
        .filter(|(k, _)| !NOT_OVERLAID.contains(&k.as_str()) && k != "n")
        .collect();
    let request = ChatRequest {
        messages,
        stream,
        temperature,
        max_tokens,
        reasoning_effort,
        response_format,
        tools,
        overlay: (!overlay.is_empty()).then_some(overlay),
    };
    request
        .validate()
        .map_err(|(field, message)| ApiError::bad_request(&field, format!("{field}: {message}")))?;
    Ok(ParsedChat {
        model,
        request,
        include_usage,
    })
}

/// OpenAI's usage object.
pub fn usage_json(u: &Usage) -> Value {
    let mut v = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total(),
    });
    if let Some(r) = u.reasoning_tokens {
        v["completion_tokens_details"] = json!({"reasoning_tokens": r});
    }
    v
}

fn tool_calls_json(r: &LlmResponse) -> Value {
    Value::Array(
        r.tool_calls
            .iter()
            .map(|t| {
                json!({
                    "id": t.id.clone().unwrap_or_else(|| format!("call_{}", t.index)),
                    "type": "function",
                    "function": {"name": t.name.clone().unwrap_or_default(), "arguments": t.arguments},
                })
            })
            .collect(),
    )
}

/// A `chat.completion` object.
pub fn completion_json(r: &LlmResponse, created: u64) -> Value {
    let mut message = json!({"role": "assistant", "content": r.content});
    if let Some(rc) = &r.reasoning_content {
        message["reasoning_content"] = json!(rc);
    }
    if !r.tool_calls.is_empty() {
        message["tool_calls"] = tool_calls_json(r);
    }
    json!({
        "id": format!("chatcmpl-{}", r.logical_call_id),
        "object": "chat.completion",
        "created": created,
        "model": r.model,
        "choices": [{
            "index": 0,
            "message": message,
            "finish_reason": r.finish_reason,
        }],
        "usage": usage_json(&r.usage),
        "system_fingerprint": null,
    })
}

/// A `chat.completion.chunk` object for one upstream delta (usage is sent separately).
pub fn chunk_json(id: &str, model: &str, created: u64, d: &StreamDelta) -> Option<Value> {
    let mut delta = Map::new();
    if let Some(r) = &d.role {
        delta.insert("role".into(), json!(r));
    }
    if let Some(c) = &d.content {
        delta.insert("content".into(), json!(c));
    }
    if let Some(r) = &d.reasoning {
        delta.insert("reasoning_content".into(), json!(r));
    }
    if !d.tool_calls.is_empty() {
        let calls: Vec<Value> = d
            .tool_calls
            .iter()
            .map(|t| {
                let mut f = Map::new();
                if let Some(n) = &t.name {
                    f.insert("name".into(), json!(n));
                }
                f.insert("arguments".into(), json!(t.arguments));
                let mut c = Map::new();
                c.insert("index".into(), json!(t.index));
                if let Some(id) = &t.id {
                    c.insert("id".into(), json!(id));
                    c.insert("type".into(), json!("function"));
                }
                c.insert("function".into(), Value::Object(f));
                Value::Object(c)
            })
            .collect();
        delta.insert("tool_calls".into(), Value::Array(calls));
    }
    if delta.is_empty() && d.finish_reason.is_none() {
        return None;
    }
    Some(json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": d.model.as_deref().unwrap_or(model),
        "choices": [{"index": 0, "delta": Value::Object(delta), "finish_reason": d.finish_reason}],
    }))
}

/// Reads `/v1/embeddings` JSON: `model` and `input` (a string or an array of strings).
pub fn parse_embeddings(body: &[u8]) -> Result<(String, Vec<String>), ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request("body", format!("the body is not valid JSON: {e}")))?;
    let model = match v.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        _ => {
            return Err(ApiError::bad_request(
                "model",
                "model is required (a string)",
            ))
        }
    };
    let input = match v.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let mut out = Vec::with_capacity(a.len());
            for (i, x) in a.iter().enumerate() {
                match x {
                    Value::String(s) => out.push(s.clone()),
                    _ => {
                        return Err(ApiError::bad_request(
                            &format!("input[{i}]"),
                            "only string inputs are supported",
                        ))
                    }
                }
            }
            out
        }
        _ => {
            return Err(ApiError::bad_request(
                "input",
                "input is required (a string or an array of strings)",
            ))
        }
    };
    if let Some(f) = v.get("encoding_format").and_then(Value::as_str) {
        if f != "float" {
            return Err(ApiError::bad_request(
                "encoding_format",
                "only \"float\" is supported",
            ));
        }
    }
    Ok((model, input))
}

#[cfg(test)]
mod tests {
    use super::*;
    use polygw::core::{ErrorClass, FailureContext, SourceReasons};
    use std::time::Duration;

    #[test]
    fn parses_known_fields_and_overlays_the_rest() {
        let p = parse_chat(
            br#"{"model":"llm","messages":[{"role":"user","content":"hi"}],"stream":true,
                "stream_options":{"include_usage":true},"temperature":0.3,"max_completion_tokens":9,
                "top_p":0.5,"stop":["x"],"user":"u1"}"#,
        )
        .unwrap();
        assert_eq!(p.model, "llm");
        assert!(p.request.stream && p.include_usage);
        assert_eq!(p.request.temperature, Some(0.3));
        assert_eq!(p.request.max_tokens, Some(9));
        let o = p.request.overlay.unwrap();
        assert_eq!(o["top_p"], 0.5);
        assert!(o.contains_key("stop") && o.contains_key("user"));
        assert!(!o.contains_key("model") && !o.contains_key("stream_options"));
    }

    #[test]
    fn bad_bodies_name_the_field() {
        let cases: &[(&[u8], &str)] = &[
            (b"{not json", "body"),
            (b"[1]", "body"),
            (br#"{"messages":[{"role":"user","content":"x"}]}"#, "model"),
            (br#"{"model":"m"}"#, "messages"),
            (br#"{"model":"m","messages":[]}"#, "messages"),
            (br#"{"model":"m","messages":[5]}"#, "messages[0]"),
            (
                br#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":"yes"}"#,
                "stream",
            ),
            (
                br#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":2}"#,
                "n",
            ),
            (
                br#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#,
                "temperature",
            ),
            (
                br#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":9}"#,
                "temperature",
            ),
            (
                br#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}"#,
                "max_tokens",
            ),
        ];
        for (body, field) in cases {
            let e = parse_chat(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(
                e.param.as_deref(),
                Some(*field),
                "{}",
                String::from_utf8_lossy(body)
            );
            assert!(e.body()["error"]["message"]
                .as_str()
                .unwrap()
                .contains(field));
        }
    }

    #[test]
    fn gateway_errors_map_to_statuses() {
        let ctx = |last: Option<polygw::AttemptError>| FailureContext {
            logical_call_id: "x".into(),
            last_error: last.map(Box::new),
            reasons: SourceReasons::new(),
            attempts: 1,
            retry_after: Some(Duration::from_millis(1500)),
            detail: None,
        };
        let rej =
            polygw::AttemptError::new(ErrorClass::Rejected, polygw::ErrorLabel::Rejected, "x")
                .with_status(413)
                .with_provider(
                    Some("context_length_exceeded".into()),
                    Some("too long".into()),
                );
        let e = ApiError::from_gateway(&GatewayError::terminal(
            TerminalReason::Rejected,
            ctx(Some(rej)),
        ));
        assert_eq!(
            (e.status, e.code.as_deref()),
            (
                StatusCode::PAYLOAD_TOO_LARGE,
                Some("context_length_exceeded")
            )
        );
        assert_eq!(e.message, "too long");
        for (reason, status) in [
            (TerminalReason::RetryExhausted, 503),
            (TerminalReason::Stalled, 503),
            (TerminalReason::NoRunnableSource, 503),
            (TerminalReason::GovernanceBackend, 503),
            (TerminalReason::DeadlineExceeded, 504),
        ] {
            let e = ApiError::from_gateway(&GatewayError::terminal(reason, ctx(None)));
            assert_eq!(e.status.as_u16(), status, "{reason}");
            assert_eq!(e.code.as_deref(), Some(reason.as_str()));
            if status == 503 {
                assert_eq!(e.retry_after, Some(2));
            }
        }
    }

    #[test]
    fn embeddings_input_shapes() {
        assert_eq!(
            parse_embeddings(br#"{"model":"e","input":"a"}"#).unwrap().1,
            ["a"]
        );
        assert_eq!(
            parse_embeddings(br#"{"model":"e","input":["a","b"]}"#)
                .unwrap()
                .1,
            ["a", "b"]
        );
        assert_eq!(
            parse_embeddings(br#"{"model":"e","input":[1]}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("input[0]")
        );
        assert_eq!(
            parse_embeddings(br#"{"input":"a"}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("model")
        );
    }

    #[test]
    fn chunks_skip_empty_deltas() {
        let d = StreamDelta::default();
        assert!(chunk_json("i", "m", 0, &d).is_none());
        let d = StreamDelta {
            content: Some("x".into()),
            ..Default::default()
        };
        let c = chunk_json("i", "m", 0, &d).unwrap();
        assert_eq!(c["choices"][0]["delta"]["content"], "x");
        assert_eq!(c["model"], "m");
    }
}
