use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::error::ErrorLabel;

fn rejected(code: Option<&str>, message: &str) -> AttemptError {
    let mut e = AttemptError::new(ErrorClass::Rejected, ErrorLabel::Invalid, "HTTP 400");
    e.provider_code = code.map(str::to_string);
    e.provider_message = Some(message.to_string());
    e
}

#[test]
fn the_providers_wording_is_recognised() {
    let anthropic = rejected(
        Some("invalid_request_error"),
        "messages.1.content.0: Invalid `signature` in `thinking` block",
    );
    assert!(signature_rejection(SourceApi::Messages, &anthropic));
    let bound = rejected(
        Some("invalid_request_error"),
        "messages.3.content.0: Invalid `signature` in `thinking` block. The block is bound to a different conversation",
    );
    assert!(signature_rejection(SourceApi::Messages, &bound));
    let openai = rejected(
        Some("invalid_encrypted_content"),
        "The encrypted content for item rs_1 could not be verified.",
    );
    assert!(signature_rejection(SourceApi::Responses, &openai));
    let org = rejected(
        None,
        "Encrypted content organization_id did not match the target organization.",
    );
    assert!(signature_rejection(SourceApi::Responses, &org));
    // Other 400s are not, nor a signature message of another class.
    let other = rejected(Some("invalid_request_error"), "max_tokens: field required");
    assert!(!signature_rejection(SourceApi::Messages, &other));
    assert!(!signature_rejection(SourceApi::Responses, &other));
    let mut transient = anthropic.clone();
    transient.class = ErrorClass::Transient;
    assert!(!signature_rejection(SourceApi::Messages, &transient));
}

#[test]
fn a_tool_loop_loses_its_thinking_and_manual_thinking() {
    let mut body = json!({
        "model": "m", "max_tokens": 100,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "let me look", "signature": "sig-a"},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {}}
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "only", "signature": "sig-a"}]},
            {"role": "user", "content": "and?"}
        ]
    });
    let Value::Object(b) = &mut body else {
        unreachable!()
    };
    let s = strip_signed(SourceApi::Messages, b);
    assert_eq!(
        s,
        Stripped {
            removed: 3,
            emptied: 1,
            thinking_off: true
        }
    );
    assert!(b.get("thinking").is_none());
    let msgs = b["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), 4);
    assert_eq!(
        msgs[1]["content"],
        json!([{"type": "tool_use", "id": "toolu_1", "name": "get", "input": {}}])
    );
    // Twice: nothing more.
    assert_eq!(strip_signed(SourceApi::Messages, b), Stripped::default());
}

#[test]
fn adaptive_thinking_stays_and_encrypted_reasoning_goes() {
    let mut m = json!({"thinking": {"type": "adaptive"}, "messages": [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "s"}, {"type": "text", "text": "hi"}]}
    ]});
    let Value::Object(mb) = &mut m else {
        unreachable!()
    };
    assert!(!strip_signed(SourceApi::Messages, mb).thinking_off);
    assert_eq!(mb["thinking"]["type"], "adaptive");
    let mut r = json!({"input": [
        {"type": "message", "role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "enc-a"},
        {"type": "reasoning", "id": "rs_2", "summary": []},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    ]});
    let Value::Object(rb) = &mut r else {
        unreachable!()
    };
    assert_eq!(strip_signed(SourceApi::Responses, rb).removed, 1);
    let kinds: Vec<_> = rb["input"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["message", "reasoning", "function_call"]);
    // A string input, a chat body: untouched.
    let mut s = json!({"input": "hello"});
    let Value::Object(sb) = &mut s else {
        unreachable!()
    };
    assert_eq!(strip_signed(SourceApi::Responses, sb), Stripped::default());
}

fn block() -> impl Strategy<Value = Value> {
    prop_oneof![
        "[a-z ]{0,8}".prop_map(|t| json!({"type": "text", "text": t})),
        "[a-z]{1,4}".prop_map(|s| json!({"type": "thinking", "thinking": "t", "signature": s})),
        "[a-z]{1,4}".prop_map(|d| json!({"type": "redacted_thinking", "data": d})),
        "[a-z]{1,4}".prop_map(|id| json!({"type": "tool_use", "id": id, "name": "f", "input": {}})),
        "[a-z]{1,4}"
            .prop_map(|id| json!({"type": "tool_result", "tool_use_id": id, "content": "r"})),
    ]
}

fn message() -> impl Strategy<Value = Value> {
    (
        prop_oneof![Just("user"), Just("assistant")],
        prop::collection::vec(block(), 0..5),
        any::<bool>(),
    )
        .prop_map(|(role, blocks, as_text)| {
            if as_text && blocks.is_empty() {
                json!({"role": role, "content": "plain"})
            } else {
                json!({"role": role, "content": blocks})
            }
        })
}

/// The test's own oracle of a signed block (not the module's).
fn signed(b: &Value) -> bool {
    let t = b["type"].as_str();
    t == Some("thinking") || t == Some("redacted_thinking")
}

/// (role, block) of every block that is not signed state of an assistant message, in
/// order; string contents as one entry.
fn kept(messages: &[Value]) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for m in messages {
        let role = m["role"].as_str().unwrap().to_string();
        match &m["content"] {
            Value::Array(blocks) => {
                for b in blocks {
                    if !(role == "assistant" && signed(b)) {
                        out.push((role.clone(), b.clone()));
                    }
                }
            }
            other => out.push((role.clone(), other.clone())),
        }
    }
    out
}

proptest! {
    /// Over any conversation: no signed block is left in an assistant message; every
    /// other block and message stays, in order, unchanged; the count removed is the
    /// count there was; manual thinking goes exactly when a block went; a second strip
    /// changes nothing.
    #[test]
    fn stripping_removes_all_signed_state_and_nothing_else(
        messages in prop::collection::vec(message(), 0..8),
        thinking in prop_oneof![Just(None), Just(Some("enabled")), Just(Some("adaptive"))],
    ) {
        let mut body = Map::new();
        body.insert("model".into(), json!("m"));
        body.insert("messages".into(), Value::Array(messages.clone()));
        if let Some(t) = thinking {
            body.insert("thinking".into(), json!({"type": t}));
        }
        let n_signed: usize = messages
            .iter()
            .filter(|m| m["role"] == "assistant")
            .filter_map(|m| m["content"].as_array())
            .map(|b| b.iter().filter(|b| signed(b)).count())
            .sum();
        let s = strip_signed(SourceApi::Messages, &mut body);
        let after = body["messages"].as_array().unwrap().clone();
        prop_assert_eq!(s.removed, n_signed);
        let clean = after
            .iter()
            .filter(|m| m["role"] == "assistant")
            .all(|m| m["content"].as_array().is_none_or(|b| !b.iter().any(signed)));
        prop_assert!(clean, "a signed block is left");
        // Only a message that lost every block goes; one empty before stays.
        let empty_before = messages.iter().filter(|m| m["content"].as_array().is_some_and(Vec::is_empty)).count();
        let empty_after = after.iter().filter(|m| m["content"].as_array().is_some_and(Vec::is_empty)).count();
        prop_assert_eq!(empty_before, empty_after);
        prop_assert_eq!(kept(&after), kept(&messages));
        prop_assert_eq!(after.len() + s.emptied, messages.len());
        prop_assert_eq!(s.thinking_off, n_signed > 0 && thinking == Some("enabled"));
        prop_assert_eq!(body.contains_key("thinking"), thinking.is_some() && !s.thinking_off);
        prop_assert_eq!(body["model"].clone(), json!("m"));
        let again = strip_signed(SourceApi::Messages, &mut body);
        prop_assert_eq!(again, Stripped::default());
    }
}
