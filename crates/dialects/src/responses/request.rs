//! `POST /v1/responses` bodies read once into a [`ResponsesRequest`]: every field the
//! Responses API defines is type-checked (errors name it), fields that cannot be
//! honoured are refused, and unknown fields are listed, not refused.

use serde_json::{Map, Value};

use super::input::{parse_item, Turn};
use super::tools::{check_choice, ToolSet};
use crate::error::DialectError;
use crate::json::{
    at, idx, one_of, opt_array, opt_bool, opt_int, opt_number, opt_object, opt_string, parse_body,
    req_string, take,
};

/// Fields read and accepted that have no effect on the answer (listed by
/// [`ResponsesRequest::ignored`] with the unknown ones).
const NO_EFFECT: [&str; 9] = [
    "stream_options",
    "client_metadata",
    "context_management",
    "prompt_cache_retention",
    "prompt_cache_options",
    "background_options",
    "moderation",
    "access_programs",
    "cyber",
];

/// `include` values accepted: the hosted tools' ones have nothing to include, and
/// nothing encrypted is ever returned.
const INCLUDABLE: [&str; 7] = [
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
];

/// A Responses request, read and checked.
#[derive(Debug, Clone)]
pub struct ResponsesRequest {
    pub(crate) model: String,
    pub(crate) stream: bool,
    pub(crate) store: bool,
    /// The input as items (a string input is one user message item).
    pub(crate) input: Vec<Value>,
    /// The items read, in order, with the input index each came from.
    pub(crate) turns: Vec<(usize, Turn)>,
    pub(crate) instructions: Option<String>,
    /// `tools` as sent (echoed).
    pub(crate) tools_raw: Vec<Value>,
    /// The tools translated (request `tools`, then the input's `additional_tools`).
    pub(crate) tools: ToolSet,
    pub(crate) tool_choice: Option<Value>,
    pub(crate) parallel_tool_calls: Option<bool>,
    pub(crate) max_output_tokens: Option<u32>,
    pub(crate) max_tool_calls: Option<u32>,
    pub(crate) temperature: Option<f64>,
    pub(crate) top_p: Option<f64>,
    pub(crate) top_logprobs: Option<u32>,
    /// `text` as sent (echoed; `verbosity` checked, echoed, not sent) and its `format`
    /// as chat's `response_format`.
    pub(crate) text: Option<Value>,
    pub(crate) response_format: Option<Value>,
    /// `reasoning` as sent (echoed) and its effort.
    pub(crate) reasoning: Option<Value>,
    pub(crate) reasoning_effort: Option<String>,
    pub(crate) metadata: Option<Value>,
    pub(crate) previous_response_id: Option<String>,
    pub(crate) prompt_cache_key: Option<String>,
    pub(crate) prompt_cache_retention: Option<String>,
    pub(crate) safety_identifier: Option<String>,
    pub(crate) service_tier: Option<String>,
    pub(crate) truncation: Option<String>,
    pub(crate) user: Option<String>,
    pub(crate) include: Vec<String>,
    pub(crate) ignored: Vec<String>,
}

impl ResponsesRequest {
    /// `model`: selects the scope.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// `stream`.
    pub fn stream(&self) -> bool {
        self.stream
    }

    /// `store` (default true, as OpenAI): keep the response and its input.
    pub fn store(&self) -> bool {
        self.store
    }

    /// `previous_response_id`: the stored conversation this one continues.
    pub fn previous_response_id(&self) -> Option<&str> {
        self.previous_response_id.as_deref()
    }

    /// The affinity key (SPEC §20.2): `prompt_cache_key`.
    pub fn affinity_key(&self) -> Option<&str> {
        self.prompt_cache_key.as_deref()
    }

    /// `user` (deprecated by OpenAI for `safety_identifier` / `prompt_cache_key`;
    /// SPEC §20.2 lists it among the affinity sources).
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// `metadata`, when sent.
    pub fn metadata(&self) -> Option<&Value> {
        self.metadata.as_ref()
    }

    /// The hosted tools in `tools` (and the input's `additional_tools`) that are not
    /// sent upstream: their types (`web_search`, `mcp:<server_label>`, …), once each.
    pub fn unsupported_tools(&self) -> &[String] {
        self.tools.unsupported()
    }

    /// Top-level fields that had no effect: unknown ones and accepted ones without
    /// effect (`stream_options`, `client_metadata`, `context_management`, …), sorted
    /// by name.
    pub fn ignored(&self) -> &[String] {
        &self.ignored
    }

    /// The input as items (a string input becomes one user message item).
    pub fn input(&self) -> &[Value] {
        &self.input
    }

    /// `include`: accepted (`reasoning.encrypted_content` included; nothing encrypted
    /// is returned, and the hosted tools' values have nothing to include).
    pub fn include(&self) -> &[String] {
        &self.include
    }
}

/// Reads a `/v1/responses` body. Errors name the field (`param`); fields that cannot be
/// honoured by chat-completions sources (`background`, `conversation`, `prompt`,
/// `top_logprobs`, `n` > 1, logprobs in `include`) are refused.
pub fn parse_request(body: &[u8]) -> Result<ResponsesRequest, DialectError> {
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
    refuse(&mut o)?;
    let stream = opt_bool(take(&mut o, "stream"), "stream")?.unwrap_or(false);
    let store = opt_bool(take(&mut o, "store"), "store")?.unwrap_or(true);
    let input = match take(&mut o, "input") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![serde_json::json!({
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": s}],
        })],
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(DialectError::invalid(
                "input",
                format!(
                    "input must be a string or an array of items (got {})",
                    crate::json::type_name(&other)
                ),
            ))
        }
    };
    let mut turns = Vec::with_capacity(input.len());
    for (i, item) in input.iter().enumerate() {
        for t in parse_item(item, &idx("input", i))? {
            turns.push((i, t));
        }
    }
    let instructions = opt_string(take(&mut o, "instructions"), "instructions")?;
    let tools_raw = opt_array(take(&mut o, "tools"), "tools")?.unwrap_or_default();
    let mut tools = ToolSet::default();
    tools.add(&tools_raw, "tools", true)?;
    for (i, t) in &turns {
        if let Turn::Tools(list) = t {
            tools.add(list, &at(&idx("input", *i), "tools"), true)?;
        }
    }
    let tool_choice = take(&mut o, "tool_choice");
    if let Some(c) = &tool_choice {
        check_choice(c)?;
    }
    let parallel_tool_calls = opt_bool(take(&mut o, "parallel_tool_calls"), "parallel_tool_calls")?;
    let max_output_tokens = opt_int(take(&mut o, "max_output_tokens"), "max_output_tokens", 1)?;
    // Limits calls to hosted tools, which polygw never runs: trivially honoured.
    let max_tool_calls = opt_int(take(&mut o, "max_tool_calls"), "max_tool_calls", 0)?;
    let temperature = opt_number(take(&mut o, "temperature"), "temperature", 0.0, 2.0)?;
    let top_p = opt_number(take(&mut o, "top_p"), "top_p", 0.0, 1.0)?;
    let top_logprobs = opt_int(take(&mut o, "top_logprobs"), "top_logprobs", 0)?;
    if top_logprobs.is_some_and(|n| n > 0) {
        return Err(DialectError::invalid(
            "top_logprobs",
            "top_logprobs is not supported: polygw returns no logprobs",
        ));
    }
    let text = opt_object(take(&mut o, "text"), "text")?;
    let response_format = match &text {
        Some(t) => read_text(t)?,
        None => None,
    };
    let reasoning = opt_object(take(&mut o, "reasoning"), "reasoning")?;
    let reasoning_effort = match &reasoning {
        Some(r) => read_reasoning(r)?,
        None => None,
    };
    let metadata = opt_object(take(&mut o, "metadata"), "metadata")?;
    if let Some(m) = &metadata {
        if let Some((k, _)) = m.iter().find(|(_, v)| !v.is_string()) {
            return Err(DialectError::invalid(
                at("metadata", k),
                format!("metadata values must be strings (metadata.{k} is not)"),
            ));
        }
    }
    let previous_response_id =
        opt_string(take(&mut o, "previous_response_id"), "previous_response_id")?;
    let prompt_cache_key = opt_string(take(&mut o, "prompt_cache_key"), "prompt_cache_key")?;
    let prompt_cache_retention = match o.get("prompt_cache_retention") {
        None | Some(Value::Null) => None,
        Some(v) => Some(req_string(Some(v.clone()), "prompt_cache_retention")?),
    };
    let safety_identifier = opt_string(take(&mut o, "safety_identifier"), "safety_identifier")?;
    let service_tier = opt_string(take(&mut o, "service_tier"), "service_tier")?;
    let truncation = opt_string(take(&mut o, "truncation"), "truncation")?;
    if let Some(t) = &truncation {
        one_of(t, &["auto", "disabled"], "truncation")?;
    }
    let user = opt_string(take(&mut o, "user"), "user")?;
    let include = read_include(take(&mut o, "include"))?;
    if let Some(v) = o.get("stream_options") {
        if !v.is_null() && !v.is_object() {
            return Err(DialectError::invalid(
                "stream_options",
                "stream_options must be an object",
            ));
        }
    }
    let ignored: Vec<String> = o
        .iter()
        .filter(|(k, v)| !v.is_null() || !NO_EFFECT.contains(&k.as_str()))
        .map(|(k, _)| k.clone())
        .collect();
    Ok(ResponsesRequest {
        model,
        stream,
        store,
        input,
        turns,
        instructions,
        tools_raw,
        tools,
        tool_choice,
        parallel_tool_calls,
        max_output_tokens,
        max_tool_calls,
        temperature,
        top_p,
        top_logprobs,
        text: text.map(Value::Object),
        response_format,
        reasoning: reasoning.map(Value::Object),
        reasoning_effort,
        metadata: metadata.map(Value::Object),
        previous_response_id,
        prompt_cache_key,
        prompt_cache_retention,
        safety_identifier,
        service_tier,
        truncation,
        user,
        include,
        ignored,
    })
}

/// The fields no chat-completions source can honour: refused, never a silent
/// different answer.
fn refuse(o: &mut Map<String, Value>) -> Result<(), DialectError> {
    if opt_bool(take(o, "background"), "background")? == Some(true) {
        return Err(DialectError::invalid(
            "background",
            "background responses are not supported: polygw answers while the request is open",
        ));
    }
    if take(o, "conversation").is_some() {
        return Err(DialectError::invalid(
            "conversation",
            "conversation is not supported: continue a conversation with previous_response_id",
        ));
    }
    if take(o, "prompt").is_some() {
        return Err(DialectError::invalid(
            "prompt",
            "prompt (a stored prompt template) is not supported: send instructions and input",
        ));
    }
    // Not a Responses field, but a client asking for several answers must not get one.
    match take(o, "n") {
        None => {}
        Some(n) if n.as_u64() == Some(1) => {}
        Some(_) => {
            return Err(DialectError::invalid(
                "n",
                "only one answer (n = 1) is supported",
            ))
        }
    }
    Ok(())
}

/// `text`: `format` → chat `response_format`. `verbosity` (low/medium/high) is checked
/// and echoed, not sent: a hint that strict chat sources refuse as an unknown field,
/// while Codex sends it on every request.
fn read_text(t: &Map<String, Value>) -> Result<Option<Value>, DialectError> {
    match t.get("verbosity") {
        None | Some(Value::Null) => {}
        Some(Value::String(v)) => one_of(v, &["low", "medium", "high"], "text.verbosity")?,
        Some(_) => {
            return Err(DialectError::invalid(
                "text.verbosity",
                "text.verbosity must be a string",
            ))
        }
    }
    let format = match t.get("format") {
        None | Some(Value::Null) => None,
        Some(Value::Object(f)) => match f.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(serde_json::json!({"type": "json_object"})),
            Some("json_schema") => {
                let name = match f.get("name") {
                    Some(Value::String(n)) if !n.is_empty() => n.clone(),
                    _ => {
                        return Err(DialectError::invalid(
                            "text.format.name",
                            "text.format.name is required for json_schema",
                        ))
                    }
                };
                let schema = match f.get("schema") {
                    Some(s @ Value::Object(_)) => s.clone(),
                    _ => {
                        return Err(DialectError::invalid(
                            "text.format.schema",
                            "text.format.schema must be a JSON schema object",
                        ))
                    }
                };
                let mut js = Map::new();
                js.insert("name".into(), Value::String(name));
                js.insert("schema".into(), schema);
                for k in ["strict", "description"] {
                    if let Some(v) = f.get(k).filter(|v| !v.is_null()) {
                        js.insert(k.into(), v.clone());
                    }
                }
                Some(serde_json::json!({"type": "json_schema", "json_schema": Value::Object(js)}))
            }
            _ => {
                return Err(DialectError::invalid(
                    "text.format.type",
                    "text.format.type must be text, json_object or json_schema",
                ))
            }
        },
        Some(_) => {
            return Err(DialectError::invalid(
                "text.format",
                "text.format must be an object",
            ))
        }
    };
    Ok(format)
}

/// `reasoning.effort` (passed on as `reasoning_effort`); `summary` and the other
/// fields are accepted (the source's reasoning text comes back as the summary).
fn read_reasoning(r: &Map<String, Value>) -> Result<Option<String>, DialectError> {
    for k in ["summary", "generate_summary"] {
        match r.get(k) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => {
                one_of(s, &["auto", "concise", "detailed"], &at("reasoning", k))?
            }
            Some(_) => {
                return Err(DialectError::invalid(
                    at("reasoning", k),
                    format!("reasoning.{k} must be a string"),
                ))
            }
        }
    }
    match r.get("effort") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(e)) => {
            one_of(
                e,
                &["none", "minimal", "low", "medium", "high", "xhigh"],
                "reasoning.effort",
            )?;
            Ok(Some(e.clone()))
        }
        Some(_) => Err(DialectError::invalid(
            "reasoning.effort",
            "reasoning.effort must be a string",
        )),
    }
}

fn read_include(v: Option<Value>) -> Result<Vec<String>, DialectError> {
    let list = opt_array(v, "include")?.unwrap_or_default();
    let mut out = Vec::with_capacity(list.len());
    for (i, item) in list.into_iter().enumerate() {
        let p = idx("include", i);
        let s = req_string(Some(item), &p)?;
        if s == "message.output_text.logprobs" {
            return Err(DialectError::invalid(
                p,
                "message.output_text.logprobs is not supported: polygw returns no logprobs",
            ));
        }
        one_of(&s, &INCLUDABLE, &p)?;
        out.push(s);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ResponsesRequest, DialectError> {
        parse_request(v.to_string().as_bytes())
    }

    #[test]
    fn a_string_input_is_one_user_item_and_defaults_hold() {
        let r = parse(
            json!({"model": "m", "input": "hi", "x_unknown": 1, "client_metadata": {"a": "b"}}),
        )
        .unwrap();
        assert_eq!(r.model(), "m");
        assert!(!r.stream());
        assert!(r.store());
        assert_eq!(
            r.input(),
            [json!({"type":"message","role":"user","content":[{"type":"input_text","text":"hi"}]})]
        );
        assert_eq!(r.ignored(), ["client_metadata", "x_unknown"]);
        assert_eq!(r.affinity_key(), None);
    }

    #[test]
    fn refused_and_malformed_fields_are_named() {
        let table = [
            (json!({"input": "x"}), "model"),
            (json!({"model": "m", "background": true}), "background"),
            (json!({"model": "m", "conversation": "c"}), "conversation"),
            (json!({"model": "m", "prompt": {"id": "p"}}), "prompt"),
            (json!({"model": "m", "n": 2}), "n"),
            (json!({"model": "m", "top_logprobs": 3}), "top_logprobs"),
            (
                json!({"model": "m", "include": ["message.output_text.logprobs"]}),
                "include[0]",
            ),
            (json!({"model": "m", "include": ["nope"]}), "include[0]"),
            (json!({"model": "m", "temperature": 3}), "temperature"),
            (json!({"model": "m", "top_p": "x"}), "top_p"),
            (
                json!({"model": "m", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (json!({"model": "m", "stream": "yes"}), "stream"),
            (json!({"model": "m", "input": 5}), "input"),
            (
                json!({"model": "m", "text": {"format": {"type": "json_schema", "schema": {}}}}),
                "text.format.name",
            ),
            (
                json!({"model": "m", "text": {"verbosity": "loud"}}),
                "text.verbosity",
            ),
            (
                json!({"model": "m", "reasoning": {"effort": "max"}}),
                "reasoning.effort",
            ),
            (
                json!({"model": "m", "tools": [{"type": "function"}]}),
                "tools[0].name",
            ),
            (json!({"model": "m", "tool_choice": "maybe"}), "tool_choice"),
            (json!({"model": "m", "metadata": {"k": 1}}), "metadata.k"),
            (json!({"model": "m", "truncation": "middle"}), "truncation"),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}),
                "input[0].content[0].file_id",
            ),
        ];
        for (v, param) in table {
            let e = parse(v.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{v}: {}", e.message);
            assert_eq!(e.status, 400);
        }
        assert!(parse(json!({"model": "m", "background": false, "n": 1})).is_ok());
        assert_eq!(parse_request(b"nope").unwrap_err().param, None);
    }

    #[test]
    fn text_format_maps_to_response_format() {
        let r = parse(json!({"model": "m", "text": {"verbosity": "low", "format": {
            "type": "json_schema", "name": "Answer", "strict": true, "schema": {"type": "object"}}}}))
        .unwrap();
        assert_eq!(
            r.response_format,
            Some(
                json!({"type": "json_schema", "json_schema": {"name": "Answer", "strict": true, "schema": {"type": "object"}}})
            )
        );
        let r = parse(json!({"model": "m", "text": {"format": {"type": "json_object"}}})).unwrap();
        assert_eq!(r.response_format, Some(json!({"type": "json_object"})));
    }
}
