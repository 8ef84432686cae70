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
    body.insert(
        "messages".into(),
        serde_json::to_value(&req.messages).unwrap_or(Value::Array(vec![])),
    );
    body.insert("stream".into(), json!(req.stream));
    if req.stream {
        let opts = body
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Map::new()));
        if !opts.is_object() {
            *opts = Value::Object(Map::new());
        }
        if let Value::Object(o) = opts {
            o.insert("include_usage".into(), Value::Bool(true));
        }
    } else {
        body.remove("stream_options");
    }
    Value::Object(body)
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
    }
}
