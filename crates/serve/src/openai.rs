//! OpenAI's wire format: request bodies → [`ChatRequest`] (parsed once, every field
//! the proxy does not read passed through as sent), answers and stream chunks →
//! OpenAI JSON (the upstream's own object when there is one, SPEC §15), embeddings
//! (float or base64), and OpenAI's error object.

use axum::http::StatusCode;
use base64::Engine as _;

use crate::errors::ApiError;
use polygw::core::client_body::WireBody;
use polygw::{ChatRequest, Embeddings, LlmResponse, Message, StreamDelta, Usage, UsageSource};
use serde_json::{json, Map, Value};

/// A chat request read from an OpenAI body.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedChat {
    /// `model`: selects the scope.
    pub model: String,
    /// The request; every field not read here is in its overlay, as sent.
    pub request: ChatRequest,
    /// `stream_options.include_usage`: send a final usage chunk.
    pub include_usage: bool,
}

/// The fields read into [`ChatRequest`]'s own fields (everything else goes to the
/// upstream through the overlay, as the client sent it).
const READ_FIELDS: [&str; 8] = [
    "model",
    "messages",
    "stream",
    "temperature",
    "max_tokens",
    "reasoning_effort",
    "response_format",
    "tools",
];

/// The least number of JSON values any body may hold (see [`json_value_budget`]).
pub const MIN_JSON_VALUES: usize = 65_536;

/// Bytes of body per JSON value allowed beyond [`MIN_JSON_VALUES`].
pub const BYTES_PER_JSON_VALUE: usize = 5;

/// How many JSON values (every scalar, array, object and object key) a body of `len`
/// bytes may hold. A valid conversation's densest shape — short messages like
/// `{"role":"user","content":"hi"}`, 5 values in 30 bytes — stays under one value per 5
/// bytes, so no chat request of up to 100 000 messages under the byte cap is refused
/// for its value count (SPEC §17.5); a body of tiny values (`[1,1,1,…]`, a value per 2
/// bytes) is. Parsed, a value costs ≈ 32 bytes: a body's tree stays within ≈ 6× its
/// size. Deep nesting is refused by the parser (128 levels).
pub fn json_value_budget(len: usize) -> usize {
    MIN_JSON_VALUES.max(len / BYTES_PER_JSON_VALUE)
}

/// An upper bound of the JSON values in `bytes`, without parsing: the structural
/// characters outside strings (`,` `:` `[` `{`) plus one. Stops counting past `cap`.
pub fn count_json_values(bytes: &[u8], cap: usize) -> usize {
    let mut n = 1usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in bytes {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b',' | b':' | b'[' | b'{' => {
                n += 1;
                if n > cap {
                    return n;
                }
            }
            _ => {}
        }
    }
    n
}

/// The 413 of a body with more JSON values than [`json_value_budget`] allows, checked
/// before any parse (every route that parses a JSON body: the parsed tree of a body of
/// tiny values would be ~16× its size).
pub(crate) fn check_json_values(body: &[u8]) -> Result<(), ApiError> {
    let budget = json_value_budget(body.len());
    let values = count_json_values(body, budget);
    if values > budget {
        return Err(ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            ..ApiError::bad_request(
                "body",
                format!(
                    "the body holds more than {budget} JSON values ({} bytes): polygw accepts \
                     at most one value per {BYTES_PER_JSON_VALUE} bytes beyond {MIN_JSON_VALUES}",
                    body.len()
                ),
            )
        });
    }
    Ok(())
}

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    check_json_values(body)?;
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::bad_request(
            "body",
            "the body must be a JSON object",
        )),
        Err(e) => Err(ApiError::bad_request(
            "body",
            format!("the body is not valid JSON: {e}"),
        )),
    }
}

fn model_of(model: Option<Value>) -> Result<String, ApiError> {
    match model {
        Some(Value::String(m)) if !m.is_empty() => Ok(m),
        Some(_) => Err(ApiError::bad_request(
            "model",
            "model must be a non-empty string",
        )),
        None => Err(ApiError::bad_request("model", "model is required")),
    }
}

/// Reads `/v1/chat/completions` JSON, once: one borrowed pass finds the top-level
/// members ([`WireBody::scan`]), `messages` is read typed from its bytes, the other
/// members into values (the known fields moved out, the rest the overlay), and the body
/// is kept as received for the byte path (SPEC §27.1: a `chat` source is sent it,
/// edited in place). Errors name the field.
pub fn parse_chat(body: impl Into<Vec<u8>>) -> Result<ParsedChat, ApiError> {
    let body = body.into();
    check_json_values(&body)?;
    let wire = WireBody::scan(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            ApiError::bad_request("body", "the body must be a JSON object")
        }
        _ => ApiError::bad_request("body", format!("the body is not valid JSON: {e}")),
    })?;
    let mut o = Map::new();
    let (mut messages, mut model) = (None, None);
    for (k, v) in wire.members() {
        if k == "messages" {
            messages = Some(v);
            continue;
        }
        // Each member's text is one JSON value (the scan read it as one).
        let value = serde_json::from_str(v)
            .map_err(|e| ApiError::bad_request(k, format!("{k} is not valid JSON: {e}")))?;
        if k == "model" {
            model = Some(value);
        } else {
            o.insert(k.to_owned(), value);
        }
    }
    let model = model_of(model)?;
    let messages = match messages {
        Some(text) => parse_messages(text)?,
        None => return Err(ApiError::bad_request("messages", "messages is required")),
    };
    let stream = match o.remove("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(_) => return Err(ApiError::bad_request("stream", "stream must be a boolean")),
    };
    // n > 1 is served as the upstream answers it (SPEC §17.5); only checked here.
    match o.get("n") {
        None | Some(Value::Null) => {}
        Some(n) if n.as_u64().is_some_and(|n| (1..=128).contains(&n)) => {}
        Some(_) => {
            return Err(ApiError::bad_request(
                "n",
                "n must be an integer from 1 to 128",
            ))
        }
    }
    let include_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) => match so.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::bad_request(
                    "stream_options.include_usage",
                    "stream_options.include_usage must be a boolean",
                ))
            }
        },
        Some(_) => {
            return Err(ApiError::bad_request(
                "stream_options",
                "stream_options must be an object",
            ))
        }
    };
    let num = |o: &mut Map<String, Value>, k: &str| -> Result<Option<f64>, ApiError> {
        match o.remove(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| ApiError::bad_request(k, format!("{k} must be a number"))),
        }
    };
    let positive_int = |x: f64| x >= 1.0 && x.fract() == 0.0 && x <= f64::from(u32::MAX);
    let temperature = num(&mut o, "temperature")?;
    let max_tokens = match num(&mut o, "max_tokens")? {
        None => None,
        Some(x) if positive_int(x) => Some(x as u32),
        Some(_) => {
            return Err(ApiError::bad_request(
                "max_tokens",
                "max_tokens must be a positive integer",
            ))
        }
    };
    // `max_completion_tokens` reaches the upstream as `max_completion_tokens` (the
    // overlay); it is only checked here.
    match o.get("max_completion_tokens") {
        None | Some(Value::Null) => {}
        Some(x) if x.as_f64().is_some_and(positive_int) => {}
        Some(_) => {
            return Err(ApiError::bad_request(
                "max_completion_tokens",
                "max_completion_tokens must be a positive integer",
            ))
        }
    }
    let reasoning_effort = match o.remove("reasoning_effort") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => {
            return Err(ApiError::bad_request(
                "reasoning_effort",
                "reasoning_effort must be a string",
            ))
        }
    };
    let response_format = match o.remove("response_format") {
        None | Some(Value::Null) => None,
        Some(x @ Value::Object(_)) => Some(x),
        Some(_) => {
            return Err(ApiError::bad_request(
                "response_format",
                "response_format must be an object",
            ))
        }
    };
    let tools = match o.remove("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(a),
        Some(_) => return Err(ApiError::bad_request("tools", "tools must be an array")),
    };
    debug_assert!(READ_FIELDS.iter().all(|k| !o.contains_key(*k)));
    let request = ChatRequest {
        messages,
        stream,
        temperature,
        max_tokens,
        reasoning_effort,
        response_format,
        tools,
        overlay: (!o.is_empty()).then_some(o),
        native: None,
        translated: Vec::new(),
        native_only: false,
        client_credential: None,
        wire: Some(std::sync::Arc::new(wire)),
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

/// `messages` read typed from its bytes as sent: a non-empty array of messages; the
/// error names the first element that is not one.
fn parse_messages(text: &str) -> Result<Vec<Message>, ApiError> {
    use serde::de::{DeserializeSeed, SeqAccess, Visitor};
    struct Seq<'a>(&'a std::cell::Cell<usize>);
    impl<'de> Visitor<'de> for Seq<'_> {
        type Value = Vec<Message>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an array of messages")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(4));
            while let Some(m) = seq.next_element::<Message>()? {
                out.push(m);
                self.0.set(out.len());
            }
            Ok(out)
        }
    }
    impl<'de> DeserializeSeed<'de> for Seq<'_> {
        type Value = Vec<Message>;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_seq(self)
        }
    }
    if !text.starts_with('[') {
        return Err(ApiError::bad_request(
            "messages",
            "messages must be an array",
        ));
    }
    let read = std::cell::Cell::new(0);
    let mut de = serde_json::Deserializer::from_str(text);
    let messages = Seq(&read).deserialize(&mut de).map_err(|e| {
        let i = read.get();
        ApiError::bad_request(
            &format!("messages[{i}]"),
            format!("messages[{i}] is not a message: {e}"),
        )
    })?;
    if messages.is_empty() {
        return Err(ApiError::bad_request(
            "messages",
            "messages must not be empty",
        ));
    }
    Ok(messages)
}

/// OpenAI's usage object from polygw's figures.
pub fn usage_json(u: &Usage) -> Value {
    let mut v = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total(),
    });
    // Prompt-cache figures when known (SPEC §20.1), in OpenAI's field; cache writes in
    // the Anthropic-style field OpenAI-compatible sources use (both part of
    // `prompt_tokens`, as polygw counts them).
    if let Some(c) = u.cached_prompt_tokens {
        v["prompt_tokens_details"] = json!({"cached_tokens": c});
    }
    if let Some(w) = u.cache_write_tokens {
        v["cache_creation_input_tokens"] = json!(w);
    }
    if let Some(r) = u.reasoning_tokens {
        v["completion_tokens_details"] = json!({"reasoning_tokens": r});
    }
    v
}

/// The usage a plain answer reports from polygw's figures (SPEC §15): measured or
/// estimated as counted, unavailable as `null` — never zeros for unknown. (A measured
/// usage object in the upstream's own answer is passed as received instead:
/// [`completion_json`].)
fn usage_value(r: &LlmResponse) -> Value {
    match r.usage_source {
        UsageSource::Unavailable => Value::Null,
        UsageSource::Measured | UsageSource::Estimated => usage_json(&r.usage),
    }
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

/// A plain answer as a `chat.completion` object. The upstream's own object when there
/// is one, every field as received (`logprobs`, `system_fingerprint`, `refusal`,
/// `annotations`, usage details, unknown fields, `content: null`, its id, created and
/// model) with only `usage` set by the rule of [`usage_value`]; otherwise (a cache hit,
/// an answer aggregated from a stream) a synthesized object with the same rules:
/// `content: null` for a tool-only answer, `usage: null` when unknown.
///
/// The upstream's object is moved out of `r` (`r.upstream` is `None` afterwards), not
/// copied: a copy of the whole tree is a visible share of a proxied call's CPU.
pub fn completion_json(r: &mut LlmResponse, created: u64) -> Value {
    let upstream = match r.upstream.take() {
        Some(o) => Some(o),
        None => r.upstream_object().map(std::borrow::Cow::into_owned),
    };
    if let Some(mut o) = upstream {
        let usage = match o.remove("usage") {
            Some(u) if r.usage_source == UsageSource::Measured && u.is_object() => u,
            _ => usage_value(r),
        };
        o.insert("usage".into(), usage);
        return Value::Object(o);
    }
    let content = if r.content.is_empty() && !r.tool_calls.is_empty() {
        Value::Null
    } else {
        Value::String(r.content.clone())
    };
    let mut message = json!({"role": "assistant", "content": content});
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
        "usage": usage_value(r),
    })
}

/// A synthesized `chat.completion.chunk` for one delta (used when no upstream frame
/// exists: an answer from the cache streamed in one chunk).
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
        let calls: Vec<Value> = d.tool_calls.iter().map(|t| t.to_json()).collect();
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

/// `encoding_format` of an embeddings request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// JSON numbers.
    Float,
    /// Base64 of the vector's little-endian `f32` bytes (the OpenAI SDKs' default).
    Base64,
}

/// An embeddings request.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedEmbeddings {
    /// `model`: selects the scope.
    pub model: String,
    /// The inputs: texts, or token arrays (passed through as sent).
    pub input: Vec<polygw::EmbeddingInput>,
    /// How vectors are written back.
    pub encoding: Encoding,
}

/// Reads `/v1/embeddings` JSON: `model`, `input` (a string or an array of strings),
/// `encoding_format` (`float` or `base64`). `user` is accepted and not forwarded;
/// `dimensions` is refused (the vector size is the source's, set it in `EXTRA_BODY`).
pub fn parse_embeddings(body: &[u8]) -> Result<ParsedEmbeddings, ApiError> {
    let mut o = parse_object(body)?;
    let model = model_of(o.remove("model"))?;
    use polygw::EmbeddingInput as In;
    let token = |x: &Value| x.as_u64().filter(|t| *t <= u64::from(u32::MAX));
    let tokens = |param: &str, a: &[Value]| -> Result<Vec<u64>, ApiError> {
        if a.is_empty() {
            return Err(ApiError::bad_request(
                param,
                format!("{param}: an empty token array"),
            ));
        }
        a.iter()
            .map(|x| {
                token(x).ok_or_else(|| {
                    ApiError::bad_request(param, format!("{param}: token ids are integers ≥ 0"))
                })
            })
            .collect()
    };
    let input = match o.remove("input") {
        Some(Value::String(s)) => vec![In::Text(s)],
        // One input as token ids (OpenAI: an array of integers).
        Some(Value::Array(a)) if !a.is_empty() && a[0].is_number() => {
            vec![In::Tokens(tokens("input", &a)?)]
        }
        Some(Value::Array(a)) if !a.is_empty() => {
            let mut out = Vec::with_capacity(a.len());
            for (i, x) in a.into_iter().enumerate() {
                let param = format!("input[{i}]");
                match x {
                    Value::String(s) => out.push(In::Text(s)),
                    Value::Array(t) => out.push(In::Tokens(tokens(&param, &t)?)),
                    _ => {
                        return Err(ApiError::bad_request(
                            &param,
                            format!("{param}: a string or an array of token ids"),
                        ))
                    }
                }
            }
            out
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_request("input", "input must not be empty"))
        }
        _ => {
            return Err(ApiError::bad_request(
                "input",
                "input is required (a string or an array of strings)",
            ))
        }
    };
    let encoding = match o.remove("encoding_format") {
        None | Some(Value::Null) => Encoding::Float,
        Some(Value::String(f)) if f == "float" => Encoding::Float,
        Some(Value::String(f)) if f == "base64" => Encoding::Base64,
        Some(_) => {
            return Err(ApiError::bad_request(
                "encoding_format",
                "encoding_format must be \"float\" or \"base64\"",
            ))
        }
    };
    if o.get("dimensions").is_some_and(|d| !d.is_null()) {
        return Err(ApiError::bad_request(
            "dimensions",
            "dimensions is not forwarded by polygw serve: the vector size is the source's \
             (set it in the source's EXTRA_BODY)",
        ));
    }
    Ok(ParsedEmbeddings {
        model,
        input,
        encoding,
    })
}

/// The base64 of a vector's little-endian `f32` bytes.
pub fn base64_vector(v: &[f32]) -> String {
    let mut bytes = Vec::with_capacity(v.len() * 4);
    for x in v {
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The `list` object of an embeddings answer.
pub fn embeddings_json(e: &Embeddings, encoding: Encoding) -> Value {
    let data: Vec<Value> = e
        .vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = match encoding {
                Encoding::Float => json!(v),
                Encoding::Base64 => Value::String(base64_vector(v)),
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let usage = match e.usage_source {
        UsageSource::Unavailable => Value::Null,
        _ => json!({"prompt_tokens": e.usage.prompt_tokens, "total_tokens": e.usage.total()}),
    };
    json!({"object": "list", "data": data, "model": e.model, "usage": usage})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_reach_the_upstream_as_sent() {
        let p = parse_chat(
            br#"{"model":"llm","messages":[{"role":"user","content":"hi"}],"stream":true,
                "stream_options":{"include_usage":true,"include_obfuscation":false},"temperature":0.3,
                "max_completion_tokens":9,"n":1,"logprobs":true,"top_logprobs":2,
                "top_p":0.5,"stop":["x"],"user":"u1","seed":7}"#,
        )
        .unwrap();
        assert_eq!(p.model, "llm");
        assert!(p.request.stream && p.include_usage);
        assert_eq!(p.request.temperature, Some(0.3));
        assert_eq!(p.request.max_tokens, None, "never renamed to max_tokens");
        let o = p.request.overlay.unwrap();
        assert_eq!(o["max_completion_tokens"], 9);
        assert_eq!(o["top_p"], 0.5);
        assert_eq!(o["logprobs"], true);
        assert_eq!(o["n"], 1);
        assert_eq!(o["stream_options"]["include_obfuscation"], false);
        for k in ["stop", "user", "seed", "top_logprobs"] {
            assert!(o.contains_key(k), "{k}");
        }
        for k in READ_FIELDS {
            assert!(!o.contains_key(k), "{k}");
        }
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
                br#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":0}"#,
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
            (
                br#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":1.5}"#,
                "max_completion_tokens",
            ),
            (
                br#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":"y"}}"#,
                "stream_options.include_usage",
            ),
        ];
        for (body, field) in cases {
            let e = parse_chat(*body).unwrap_err();
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
    fn a_body_of_tiny_values_is_refused_before_parsing() {
        assert_eq!(count_json_values(br#"{"a":[1,2,{"b":"x,y:[{"}]}"#, 100), 8);
        assert_eq!(count_json_values(br#""a\"b,c""#, 100), 1);
        // 1 MiB of `1,` is 500k values: over the budget of a 1 MiB body.
        let mut body = br#"{"model":"m","messages":[{"role":"user","content":"x"}],"x":["#.to_vec();
        while body.len() < 1024 * 1024 {
            body.extend_from_slice(b"1,");
        }
        body.extend_from_slice(b"1]}");
        let e = parse_chat(body.as_slice()).unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(e.message.contains("JSON values"), "{}", e.message);
        // The same size in one string is fine.
        let mut body = br#"{"model":"m","messages":[{"role":"user","content":""#.to_vec();
        body.resize(1024 * 1024, b'a');
        body.extend_from_slice(br#""}]}"#);
        assert!(parse_chat(body).is_ok());
    }

    #[test]
    fn synthesized_usage_carries_the_cache_figures() {
        let u = Usage {
            reasoning_tokens: Some(3),
            cached_prompt_tokens: Some(640),
            cache_write_tokens: Some(128),
            cache_write_1h_tokens: None,
            ..Usage::new(1000, 10)
        };
        assert_eq!(
            usage_json(&u),
            json!({"prompt_tokens": 1000, "completion_tokens": 10, "total_tokens": 1010,
                   "prompt_tokens_details": {"cached_tokens": 640},
                   "cache_creation_input_tokens": 128,
                   "completion_tokens_details": {"reasoning_tokens": 3}})
        );
        // Not reported: not invented.
        assert_eq!(
            usage_json(&Usage::new(5, 2)),
            json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7})
        );
    }

    #[test]
    fn plain_answers_pass_the_upstream_object_through() {
        let upstream = json!({
            "id": "chatcmpl-up", "object": "chat.completion", "created": 1700000000,
            "model": "gpt-x-2025", "system_fingerprint": "fp_1", "service_tier": "default",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": {"content": []},
                "message": {"role": "assistant", "content": null, "refusal": null, "annotations": [],
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                "prompt_tokens_details": {"cached_tokens": 3}},
            "x_unknown": {"kept": true},
        });
        let mut r = LlmResponse {
            content: String::new(),
            reasoning_content: None,
            tool_calls: vec![],
            finish_reason: Some("tool_calls".into()),
            model: "gpt-x-2025".into(),
            source: "a-0".into(),
            usage: Usage::new(5, 2),
            usage_source: UsageSource::Measured,
            answer_usage: None,
            ttft_ms: None,
            max_inter_token_ms: None,
            logical_call_id: "lc".into(),
            call_stats: Default::default(),
            upstream: upstream.as_object().cloned(),
            upstream_body: None,
            upstream_usage_object: false,
            upstream_headers: Vec::new(),
        };
        assert_eq!(completion_json(&mut r.clone(), 1), upstream);
        // Unknown usage is null, never zeros.
        r.usage_source = UsageSource::Unavailable;
        let v = completion_json(&mut r.clone(), 1);
        assert_eq!(v["usage"], Value::Null);
        assert_eq!(v["x_unknown"]["kept"], true);
        // Synthesized (no upstream object): a tool-only answer keeps content null.
        r.upstream = None;
        r.tool_calls = vec![polygw::ToolCall {
            index: 0,
            id: Some("c1".into()),
            name: Some("f".into()),
            arguments: "{}".into(),
        }];
        let v = completion_json(&mut r.clone(), 9);
        assert_eq!(v["choices"][0]["message"]["content"], Value::Null);
        assert_eq!(v["usage"], Value::Null);
        assert_eq!(v["created"], 9);
        r.usage_source = UsageSource::Estimated;
        assert_eq!(
            completion_json(&mut r.clone(), 9)["usage"]["total_tokens"],
            7
        );
    }

    #[test]
    fn embeddings_shapes_and_base64() {
        let p = parse_embeddings(br#"{"model":"e","input":"a"}"#).unwrap();
        assert_eq!(
            (p.input.as_slice(), p.encoding),
            (
                &[polygw::EmbeddingInput::Text("a".into())][..],
                Encoding::Float
            )
        );
        // Token arrays (issue 22, item 17): one, or several.
        let p = parse_embeddings(br#"{"model":"e","input":[1,2,3]}"#).unwrap();
        assert_eq!(p.input, vec![polygw::EmbeddingInput::Tokens(vec![1, 2, 3])]);
        let p = parse_embeddings(br#"{"model":"e","input":[[1,2],[3]]}"#).unwrap();
        assert_eq!(p.input.len(), 2);
        let p = parse_embeddings(
            br#"{"model":"e","input":["a","b"],"encoding_format":"base64","user":"u"}"#,
        )
        .unwrap();
        assert_eq!(p.encoding, Encoding::Base64);
        for (body, param) in [
            (&br#"{"model":"e","input":[true]}"#[..], "input[0]"),
            (br#"{"model":"e","input":[[1,-2]]}"#, "input[0]"),
            (br#"{"input":"a"}"#, "model"),
            (br#"{"model":"e","input":[]}"#, "input"),
            (
                br#"{"model":"e","input":"a","encoding_format":"int8"}"#,
                "encoding_format",
            ),
            (br#"{"model":"e","input":"a","dimensions":8}"#, "dimensions"),
        ] {
            assert_eq!(
                parse_embeddings(body).unwrap_err().param.as_deref(),
                Some(param)
            );
        }
        // Little-endian f32: 1.0 = 00 00 80 3f.
        assert_eq!(base64_vector(&[1.0]), "AACAPw==");
        assert_eq!(base64_vector(&[]), "");
    }

    #[test]
    fn synthesized_chunks_skip_empty_deltas() {
        assert!(chunk_json("i", "m", 0, &StreamDelta::default()).is_none());
        let d = StreamDelta {
            content: Some("x".into()),
            ..Default::default()
        };
        let c = chunk_json("i", "m", 0, &d).unwrap();
        assert_eq!(c["choices"][0]["delta"]["content"], "x");
        assert_eq!(c["model"], "m");
    }
}

/// SPEC §27.1: the chat body a `chat` source is sent, made from the client's bytes by
/// editing them in place, is the same request as the one built from the parsed fields,
/// for arbitrary valid bodies — unknown fields, unicode escapes, repeated keys, numbers
/// at their limits, any order and spacing.
#[cfg(test)]
mod byte_path {
    use super::*;
    use polygw::core::body::chat_body_bytes;
    use polygw::core::client_body::same_chat_body;
    use polygw::SourceConfig;
    use proptest::prelude::*;

    const NUMBERS: [&str; 16] = [
        "0",
        "1",
        "-1",
        "-0",
        "1.0",
        "0.7",
        "1e2",
        "2E-1",
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775808",
        "-9223372036854775809",
        "1.7976931348623157e308",
        "5e-324",
        "123456789012345678901234567890",
        "0.1e1",
    ];

    /// A JSON string for `s`, its non-ASCII characters written as `\u` escapes when
    /// `escaped`.
    fn string_text(s: &str, escaped: bool) -> String {
        let plain = serde_json::to_string(s).unwrap();
        if !escaped {
            return plain;
        }
        let mut out = String::new();
        for c in plain.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
        out
    }

    fn text() -> impl Strategy<Value = String> {
        (
            proptest::collection::vec(
                prop_oneof![
                    Just('a'),
                    Just(' '),
                    Just('é'),
                    Just('😀'),
                    Just('"'),
                    Just('\\'),
                    Just('\n'),
                    Just('\u{1}'),
                    Just('/'),
                ],
                0..6,
            ),
            any::<bool>(),
        )
            .prop_map(|(cs, esc)| string_text(&cs.into_iter().collect::<String>(), esc))
    }

    fn number() -> impl Strategy<Value = String> {
        proptest::sample::select(&NUMBERS[..]).prop_map(str::to_string)
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("\"user\"".to_string()),
            Just("\"\\u0075ser\"".to_string()),
            Just("\"metadata\"".to_string()),
            Just("\"seed\"".to_string()),
            Just("\"top_p\"".to_string()),
            Just("\"x-é\"".to_string()),
            Just("\"x-\\u00e9\"".to_string()),
            Just("\"stop\"".to_string()),
        ]
    }

    /// Any JSON value, objects possibly repeating a key.
    fn value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_string()),
            Just("true".to_string()),
            Just("false".to_string()),
            number(),
            text(),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                proptest::collection::vec((key(), inner), 0..4).prop_map(|kv| {
                    let m: Vec<String> = kv.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
                    format!("{{{}}}", m.join(" , "))
                }),
            ]
        })
    }

    fn message() -> impl Strategy<Value = String> {
        (
            proptest::sample::select(vec!["user", "assistant", "system", "tool"]),
            prop_oneof![
                text(),
                Just("null".to_string()),
                text().prop_map(|t| format!(r#"[{{"type":"text","text":{t}}}]"#)),
            ],
            proptest::collection::vec((key(), value()), 0..3),
        )
            .prop_map(|(role, content, extra)| {
                let mut m = vec![
                    format!("\"role\":\"{role}\""),
                    format!("\"content\":{content}"),
                ];
                m.extend(extra.into_iter().map(|(k, v)| format!("{k}:{v}")));
                format!("{{{}}}", m.join(","))
            })
    }

    /// One of these spellings.
    fn spelled(xs: &'static [&'static str]) -> BoxedStrategy<String> {
        proptest::sample::select(xs)
            .prop_map(str::to_string)
            .boxed()
    }

    /// Known fields (sometimes `null`, sometimes spelled oddly) and unknown ones, in
    /// any order, with repeated keys.
    fn body() -> impl Strategy<Value = String> {
        let opt = |s: BoxedStrategy<String>| prop_oneof![1 => Just(None), 1 => Just(Some("null".to_string())), 3 => s.prop_map(Some)];
        (
            prop_oneof![Just("\"model\""), Just("\"mod\\u0065l\"")],
            text().prop_filter("a model", |t| t.len() > 2),
            proptest::collection::vec(message(), 1..4),
            opt(spelled(&["1", "0.7", "1e0", "-0"])),
            opt(spelled(&["100", "100.0", "1e2", "4294967295"])),
            opt(spelled(&[r#"{"type":"json_object","x":null}"#])),
            opt(spelled(&[
                r#"[{"type":"function","function":{"name":"f","parameters":{"a":null}}}]"#,
            ])),
            opt(spelled(&["true", "false"])),
            opt(spelled(&[
                r#"{"include_usage":true}"#,
                r#"{"include_usage":false,"x":null}"#,
            ])),
            proptest::collection::vec((key(), value()), 0..4),
            any::<prop::sample::Index>(),
            any::<bool>(),
        )
            .prop_map(
                |(mk, model, msgs, temp, max, rf, tools, stream, so, unknown, order, spaced)| {
                    let mut m = vec![
                        format!("{mk}:{model}"),
                        format!("\"messages\":[{}]", msgs.join(",")),
                    ];
                    let known = [
                        ("temperature", temp),
                        ("max_tokens", max),
                        ("response_format", rf),
                        ("tools", tools),
                        ("stream", stream),
                        ("stream_options", so),
                    ];
                    for (k, v) in known {
                        if let Some(v) = v {
                            m.push(format!("\"{k}\":{v}"));
                        }
                    }
                    m.extend(unknown.into_iter().map(|(k, v)| format!("{k}:{v}")));
                    // A repeated key: the first member again with another value, or
                    // an unknown one twice.
                    let i = order.index(m.len());
                    m.rotate_left(i);
                    if i % 3 == 0 {
                        m.push("\"temperature\":0.5".to_string());
                    }
                    let sep = if spaced { " ,\n " } else { "," };
                    format!("{{{}}}", m.join(sep))
                },
            )
    }

    fn source(extra: &str, max_completion_tokens: bool) -> SourceConfig {
        let mut s = SourceConfig::new("p", 0, "http://h/v1", "k", "up-model");
        s.extra_body = serde_json::from_str(extra).unwrap();
        s.max_completion_tokens = max_completion_tokens;
        s
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn the_edited_body_is_the_parsed_request(
            body in body(),
            extra in proptest::sample::select(vec![
                "{}",
                r#"{"temperature":null}"#,
                r#"{"seed":7,"metadata":{"a":null,"b":1}}"#,
                r#"{"stream_options":{"x":1},"user":"forced"}"#,
                r#"{"model":"x","messages":[],"stream":true}"#,
            ]),
            mct in any::<bool>(),
        ) {
            let Ok(p) = parse_chat(body.as_bytes()) else {
                return Ok(());
            };
            let src = source(extra, mct);
            let wire = p.request.wire.clone().expect("the proxy keeps the body");
            let mut parsed = p.request.clone();
            parsed.wire = None;
            let edited = chat_body_bytes(&src, &p.request);
            let built = chat_body_bytes(&src, &parsed);
            let e: Value = serde_json::from_slice(&edited).unwrap();
            let b: Value = serde_json::from_slice(&built).unwrap();
            prop_assert!(same_chat_body(&e, &b), "{body}\nedited {e}\nbuilt  {b}");
            if !mct {
                // The byte path was taken: the messages went as the client sent them.
                let messages = wire.get("messages").unwrap();
                let edited = String::from_utf8(edited).unwrap();
                prop_assert!(edited.contains(messages), "{edited}");
            }
        }
    }

    /// A message that names its role or content twice is refused, naming the message
    /// (which one the client meant is not polygw's guess; DECISIONS 187).
    #[test]
    fn a_message_repeating_its_role_is_refused() {
        let e = parse_chat(
            &br#"{"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","role":"system","content":"x"}]}"#[..],
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1]"));
        assert!(
            e.message.contains("duplicate field `role`"),
            "{}",
            e.message
        );
        // Repeated top-level keys: the last one counts, as a JSON parser keeps it.
        let p = parse_chat(
            &br#"{"model":"a","messages":[{"role":"user","content":"x"}],"model":"b","temperature":1,"temperature":0.5}"#[..],
        )
        .unwrap();
        assert_eq!((p.model.as_str(), p.request.temperature), ("b", Some(0.5)));
        // Not UTF-8: refused as invalid JSON.
        let e = parse_chat(&b"{\"model\":\"\xff\",\"messages\":[]}"[..]).unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
    }
}
