//! Request bodies (SPEC §5): the chat body with the caller's overlay and the source's
//! `EXTRA_BODY` merged (JSON merge patch, RFC 7396: objects merge recursively, `null`
//! removes a key), plus the embedding and OCR bodies.

use serde_json::{json, Map, Value};

use crate::request::ChatRequest;
use crate::source::SourceConfig;

/// Merges `patch` into `target` (RFC 7396).
pub fn merge_patch(target: &mut Map<String, Value>, patch: &Map<String, Value>) {
    for (k, v) in patch {
        match v {
            Value::Null => {
                target.remove(k);
            }
            Value::Object(p) => match target.get_mut(k) {
                Some(Value::Object(t)) => merge_patch(t, p),
                _ => {
                    let mut t = Map::new();
                    merge_patch(&mut t, p);
                    target.insert(k.clone(), Value::Object(t));
                }
            },
            other => {
                target.insert(k.clone(), other.clone());
            }
        }
    }
}

/// The `/chat/completions` body. `model`, `messages` and `stream` always come from the
/// source and the request (an overlay cannot change them); streams always ask for
/// usage (`stream_options.include_usage = true`).
pub fn chat_body(source: &SourceConfig, req: &ChatRequest) -> Value {
    let mut body = chat_fields(source, req);
    body.insert(
        "messages".into(),
        serde_json::to_value(&req.messages).unwrap_or(Value::Array(vec![])),
    );
    Value::Object(body)
}

/// [`chat_body`] as the bytes sent, with the messages serialized straight from the
/// request instead of through a `Value` copy of them (issue 27). The same JSON value
/// as `chat_body`'s (property-tested); inside a message the keys come in the
/// struct's order. A message whose extra fields repeat `role` or `content` (which
/// only code can build) goes through `chat_body`, which keeps one of each.
pub fn chat_body_bytes(source: &SourceConfig, req: &ChatRequest) -> Vec<u8> {
    // The byte path (SPEC §27.1): the client's own body, edited in place.
    if let Some(wire) = &req.wire {
        if let Some(b) = crate::client_body::chat_body_edited(wire, source, req.stream) {
            // Debug builds check it against the parsed path (bodies up to 256 KiB: the
            // check holds two more copies of the body, and tests measure the memory a
            // large one costs).
            debug_assert!(
                b.len() > 256 * 1024
                    || serde_json::from_slice::<Value>(&b).is_ok_and(|v| {
                        crate::client_body::same_chat_body(&v, &chat_body(source, req))
                    }),
                "the body edited in place is not the request's: {} vs {}",
                String::from_utf8_lossy(&b),
                chat_body(source, req)
            );
            return b;
        }
    }
    let clash = req
        .messages
        .iter()
        .any(|m| m.extra.contains_key("role") || m.extra.contains_key("content"));
    if clash {
        return serde_json::to_vec(&chat_body(source, req)).unwrap_or_default();
    }
    let mut body = chat_fields(source, req);
    // Its place among the keys; the value is written from the request.
    body.insert("messages".into(), Value::Null);
    let mut out = Vec::with_capacity(256);
    out.push(b'{');
    for (i, (k, v)) in body.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        // Serializing a string, a `Value` or the messages into a `Vec` cannot fail.
        let _ = serde_json::to_writer(&mut out, k);
        out.push(b':');
        let _ = if k == "messages" {
            serde_json::to_writer(&mut out, &req.messages)
        } else {
            serde_json::to_writer(&mut out, v)
        };
    }
    out.push(b'}');
    out
}

/// Every field of the chat body but `messages`.
fn chat_fields(source: &SourceConfig, req: &ChatRequest) -> Map<String, Value> {
    let mut body = Map::new();
    if let Some(t) = req.temperature {
        body.insert("temperature".into(), json!(t));
    }
    if let Some(m) = req.max_tokens {
        body.insert("max_tokens".into(), json!(m));
    }
    if let Some(e) = &req.reasoning_effort {
        body.insert("reasoning_effort".into(), json!(e));
    }
    if let Some(rf) = &req.response_format {
        body.insert("response_format".into(), rf.clone());
    }
    if let Some(tools) = &req.tools {
        body.insert("tools".into(), Value::Array(tools.clone()));
    }
    if let Some(o) = &req.overlay {
        merge_patch(&mut body, o);
    }
    merge_patch(&mut body, &source.extra_body);
    body.insert("model".into(), json!(source.model));
    if source.max_completion_tokens {
        // The source takes the cap only as `max_completion_tokens` (SPEC §24.4): the
        // caller's `max_tokens` is renamed, unless it also sent the other.
        if let Some(m) = body.remove("max_tokens") {
            body.entry("max_completion_tokens").or_insert(m);
        }
    }
    // An overlay or `EXTRA_BODY` cannot set the messages either.
    body.remove("messages");
    body.insert("stream".into(), json!(req.stream));
    stream_options(&mut body, req.stream);
    body
}

/// A stream asks for usage (`stream_options.include_usage = true`, the client's other
/// options kept); a plain call sends no `stream_options`.
pub(crate) fn stream_options(body: &mut Map<String, Value>, stream: bool) {
    if !stream {
        body.remove("stream_options");
        return;
    }
    let opts = body
        .entry("stream_options")
        .or_insert_with(|| Value::Object(Map::new()));
    if !opts.is_object() {
        *opts = Value::Object(Map::new());
    }
    if let Value::Object(o) = opts {
        o.insert("include_usage".into(), Value::Bool(true));
    }
}

#[cfg(test)]
mod max_tokens_field_tests {
    use super::*;
    use crate::request::ChatRequest;

    /// SPEC §24.4: a source that takes `max_completion_tokens` only gets the cap under
    /// that name, whether the caller set it as a field or in its overlay; a caller that
    /// sent both keeps its `max_completion_tokens`.
    #[test]
    fn the_cap_is_renamed_for_a_source_that_needs_it() {
        let mut src = SourceConfig::new("p", 0, "http://h/v1", "k", "o3");
        let req = ChatRequest::user("hi").with_max_tokens(100);
        assert_eq!(chat_body(&src, &req)["max_tokens"], 100);
        src.max_completion_tokens = true;
        let b = chat_body(&src, &req);
        assert_eq!(b["max_completion_tokens"], 100);
        assert!(b.get("max_tokens").is_none());
        let both = req.with_overlay("max_completion_tokens", json!(50));
        let b = chat_body(&src, &both);
        assert_eq!(
            (b["max_completion_tokens"].clone(), b.get("max_tokens")),
            (json!(50), None)
        );
        let bytes: Value = serde_json::from_slice(&chat_body_bytes(&src, &both)).unwrap();
        assert_eq!(bytes, chat_body(&src, &both));
    }
}

/// The `/embeddings` body.
pub fn embedding_body(source: &SourceConfig, texts: &[String]) -> Value {
    let mut body = Map::new();
    merge_patch(&mut body, &source.extra_body);
    body.insert("model".into(), json!(source.model));
    body.insert("input".into(), json!(texts));
    Value::Object(body)
}

/// The embeddings body of inputs that may be token arrays (passed as sent).
pub fn embedding_body_inputs(source: &SourceConfig, inputs: &[crate::EmbeddingInput]) -> Value {
    let mut body = Map::new();
    merge_patch(&mut body, &source.extra_body);
    body.insert("model".into(), json!(source.model));
    body.insert("input".into(), json!(inputs));
    Value::Object(body)
}

/// The OCR body: a plain vision chat request with the image as a data URI.
pub fn ocr_body(source: &SourceConfig, data_uri: &str, prompt: &str) -> Value {
    let mut body = Map::new();
    merge_patch(&mut body, &source.extra_body);
    body.insert("model".into(), json!(source.model));
    body.insert("stream".into(), json!(false));
    body.remove("stream_options");
    body.insert(
        "messages".into(),
        json!([{
            "role": "user",
            "content": [
                {"type": "text", "text": prompt},
                {"type": "image_url", "image_url": {"url": data_uri}}
            ]
        }]),
    );
    Value::Object(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::Message;
    use proptest::prelude::*;

    fn small_value() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i32>().prop_map(|n| json!(n)),
            (-1e6f64..1e6).prop_map(|f| json!(f)),
            "[a-zé\\\"\n ]{0,8}".prop_map(Value::String),
            Just(
                json!([{"type": "text", "text": "t"}, {"type": "image_url", "image_url": {"url": "u"}}])
            ),
            Just(json!({"nested": {"k": [1, null]}})),
        ]
    }

    fn message() -> impl Strategy<Value = Message> {
        (
            prop::sample::select(vec!["system", "user", "assistant", "tool", "développeur"]),
            prop::option::of(small_value()),
            prop::collection::btree_map(
                prop::sample::select(vec![
                    "name",
                    "tool_call_id",
                    "tool_calls",
                    "role",
                    "content",
                    "x",
                ]),
                small_value(),
                0..3,
            ),
        )
            .prop_map(|(role, content, extra)| Message {
                role: role.to_string(),
                content,
                extra: extra.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            })
    }

    #[test]
    fn a_message_repeating_role_in_its_extra_fields_is_sent_with_one_role() {
        let mut m = Message::user("hi");
        m.extra.insert("role".into(), json!("assistant"));
        let req = ChatRequest::new(vec![m]);
        let text = String::from_utf8(chat_body_bytes(&src(), &req)).unwrap();
        assert_eq!(text.matches("\"role\"").count(), 1, "{text}");
    }

    proptest! {
        /// The bytes sent are the JSON value of `chat_body`, whatever the messages,
        /// the overlay and `EXTRA_BODY` hold.
        #[test]
        fn the_bytes_are_the_chat_body(
            messages in prop::collection::vec(message(), 1..4),
            stream in any::<bool>(),
            overlay in prop::collection::btree_map(
                prop::sample::select(vec!["temperature", "messages", "top_p", "stream_options", "model", "n"]),
                small_value(),
                0..3,
            ),
            extra in prop::collection::btree_map(
                prop::sample::select(vec!["enable_thinking", "messages", "stream_options", "seed"]),
                small_value(),
                0..3,
            ),
        ) {
            let mut req = ChatRequest::new(messages).with_stream(stream);
            for (k, v) in overlay {
                req = req.with_overlay(k, v);
            }
            let source = SourceConfig::new("p", 0, "http://x", "", "m")
                .with_extra_body(extra.into_iter().map(|(k, v)| (k.to_string(), v)).collect());
            let bytes = chat_body_bytes(&source, &req);
            let parsed: Value = serde_json::from_slice(&bytes).expect("valid JSON");
            // Both as the upstream reads them (a float read back may differ from the
            // `Value` by its last bit: the same for both texts).
            let before = serde_json::to_vec(&chat_body(&source, &req)).unwrap();
            let expected: Value = serde_json::from_slice(&before).unwrap();
            prop_assert_eq!(parsed, expected, "{}", String::from_utf8_lossy(&bytes));
        }
    }

    fn src() -> SourceConfig {
        let mut extra = Map::new();
        extra.insert("enable_thinking".into(), json!(false));
        extra.insert("stream_options".into(), json!({"chunk": 1}));
        SourceConfig::new("p", 0, "http://x", "", "qwen").with_extra_body(extra)
    }

    #[test]
    fn stream_body_asks_for_usage_and_merges_overlay_then_extra() {
        let mut req = ChatRequest::new(vec![Message::user("hi")])
            .with_stream(true)
            .with_temperature(0.5)
            .with_reasoning_effort("low")
            .with_overlay("top_p", json!(0.9))
            .with_overlay("enable_thinking", json!(true))
            .with_overlay("model", json!("hijack"));
        req.max_tokens = Some(10);
        let b = chat_body(&src(), &req);
        assert_eq!(b["model"], "qwen");
        assert_eq!(b["stream"], true);
        assert_eq!(
            b["stream_options"],
            json!({"chunk": 1, "include_usage": true})
        );
        assert_eq!(b["reasoning_effort"], "low");
        assert_eq!(b["temperature"], 0.5);
        assert_eq!(b["max_tokens"], 10);
        assert_eq!(b["top_p"], 0.9);
        assert_eq!(b["enable_thinking"], false, "EXTRA_BODY is merged last");
        assert_eq!(b["messages"][0]["content"], "hi");
    }

    #[test]
    fn plain_body_has_no_stream_options_or_unset_fields() {
        let b = chat_body(&src(), &ChatRequest::user("x"));
        assert_eq!(b["stream"], false);
        assert!(b.get("stream_options").is_none());
        assert!(b.get("reasoning_effort").is_none());
        assert!(b.get("temperature").is_none());
    }

    #[test]
    fn null_in_overlay_removes() {
        let req = ChatRequest::user("x")
            .with_temperature(1.0)
            .with_overlay("temperature", Value::Null);
        let b = chat_body(&src(), &req);
        assert!(b.get("temperature").is_none());
    }

    #[test]
    fn ocr_and_embedding_bodies() {
        let b = ocr_body(&src(), "data:image/png;base64,AAAA", "read");
        assert_eq!(
            b["messages"][0]["content"][1]["image_url"]["url"],
            "data:image/png;base64,AAAA"
        );
        assert!(b.get("stream_options").is_none());
        let e = embedding_body(&src(), &["a".into(), "b".into()]);
        assert_eq!(e["input"], json!(["a", "b"]));
        assert_eq!(e["model"], "qwen");
        let e = embedding_body_inputs(
            &src(),
            &[
                crate::EmbeddingInput::Tokens(vec![1, 2]),
                crate::EmbeddingInput::Text("c".into()),
            ],
        );
        assert_eq!(e["input"], json!([[1, 2], "c"]), "token arrays as sent");
        assert_eq!(e["model"], "qwen");
        assert_eq!(e["enable_thinking"], false, "EXTRA_BODY too");
    }

    /// RFC 7396: objects merge key by key at every depth; `null` removes.
    #[test]
    fn objects_merge_recursively() {
        let mut target = json!({"a": {"x": 1, "y": {"p": 1, "q": 2}}, "b": 1});
        let patch = json!({"a": {"y": {"q": 3, "p": null}, "z": 4}, "b": {"new": true}});
        merge_patch(target.as_object_mut().unwrap(), patch.as_object().unwrap());
        assert_eq!(
            target,
            json!({"a": {"x": 1, "y": {"q": 3}, "z": 4}, "b": {"new": true}})
        );
    }
}
