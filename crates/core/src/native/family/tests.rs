use proptest::prelude::*;
use serde_json::json;

use super::*;

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap()
}

fn placed(api: SourceApi, body: &Map<String, Value>, by_blob: &[(&str, &str)]) -> Placed {
    let refs = signed_in_request(api, body);
    let families = refs
        .iter()
        .map(|r| {
            by_blob
                .iter()
                .find(|(blob, _)| blob_key(blob) == r.key)
                .map(|(_, f)| f.to_string())
        })
        .collect();
    Placed::new(refs, families)
}

fn tool_loop(sig_old: &str, sig_latest: &str) -> Map<String, Value> {
    obj(json!({
        "model": "m", "max_tokens": 100,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "first", "signature": sig_old},
                {"type": "text", "text": "Let me think."}
            ]},
            {"role": "user", "content": "in Paris"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "look it up", "signature": sig_latest},
                {"type": "redacted_thinking", "data": "unknown-data"},
                {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {}}
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21"}]}
        ]
    }))
}

#[test]
fn keys_are_digests_not_blobs() {
    let k = blob_key("sig-secret");
    assert_eq!(k.len(), 34);
    assert!(k.starts_with("sg") && !k.contains("secret"));
    assert_ne!(k, blob_key("sig-secret2"));
}

#[test]
fn own_and_unknown_blobs_pass_unchanged() {
    let body = tool_loop("sig-a", "sig-a");
    let p = placed(SourceApi::Messages, &body, &[("sig-a", "a")]);
    assert_eq!(p.session_family().map(|f| &**f), Some("a"));
    let mut sent = body.clone();
    assert_eq!(
        p.keep_for(SourceApi::Messages, &mut sent, "a"),
        Stripped::default()
    );
    assert_eq!(sent, body);
    // Nothing placed: nothing removed, whatever the target.
    let p = placed(SourceApi::Messages, &body, &[]);
    assert_eq!(p.session_family(), None);
    let mut sent = body.clone();
    p.keep_for(SourceApi::Messages, &mut sent, "b");
    assert_eq!(sent, body);
}

#[test]
fn a_foreign_latest_message_loses_every_thinking_block_and_manual_thinking() {
    let body = tool_loop("sig-b", "sig-a");
    let p = placed(
        SourceApi::Messages,
        &body,
        &[("sig-a", "a"), ("sig-b", "b")],
    );
    let mut sent = body.clone();
    let s = p.keep_for(SourceApi::Messages, &mut sent, "b");
    // The latest message: all of its thinking (the unplaced redacted block too).
    assert_eq!(
        sent["messages"][3]["content"],
        json!([{"type": "tool_use", "id": "toolu_1", "name": "get", "input": {}}])
    );
    // The older turn is b's own: kept.
    assert_eq!(sent["messages"][1], body["messages"][1]);
    assert!(
        sent.get("thinking").is_none(),
        "an open tool loop: manual thinking off"
    );
    assert_eq!(
        s,
        Stripped {
            removed: 2,
            emptied: 0,
            thinking_off: true
        }
    );
    // Adaptive thinking needs no leading block: it stays.
    let mut adaptive = body.clone();
    adaptive.insert("thinking".into(), json!({"type": "adaptive"}));
    p.keep_for(SourceApi::Messages, &mut adaptive, "b");
    assert_eq!(adaptive["thinking"], json!({"type": "adaptive"}));
}

#[test]
fn an_older_foreign_turn_loses_only_its_foreign_blocks() {
    let body = tool_loop("sig-b", "sig-a");
    let p = placed(
        SourceApi::Messages,
        &body,
        &[("sig-a", "a"), ("sig-b", "b")],
    );
    let mut sent = body.clone();
    let s = p.keep_for(SourceApi::Messages, &mut sent, "a");
    assert_eq!(
        sent["messages"][1]["content"],
        json!([{"type": "text", "text": "Let me think."}])
    );
    assert_eq!(
        sent["messages"][3], body["messages"][3],
        "the latest is a's own"
    );
    assert_eq!(sent["thinking"], body["thinking"]);
    assert_eq!(s.removed, 1);
}

#[test]
fn a_message_left_empty_goes() {
    let body = obj(json!({"model": "m", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "sig-b"}]},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
        {"role": "user", "content": "q3"}
    ]}));
    let p = placed(SourceApi::Messages, &body, &[("sig-b", "b")]);
    let mut sent = body.clone();
    let s = p.keep_for(SourceApi::Messages, &mut sent, "a");
    assert_eq!(s.emptied, 1);
    assert_eq!(sent["messages"].as_array().unwrap().len(), 4);
}

#[test]
fn responses_lose_foreign_reasoning_items() {
    let body = obj(json!({"model": "m", "input": [
        {"type": "message", "role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "enc-a"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "1"},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "enc-b"}
    ]}));
    let p = placed(
        SourceApi::Responses,
        &body,
        &[("enc-a", "a"), ("enc-b", "b")],
    );
    assert_eq!(p.session_family().map(|f| &**f), Some("b"));
    let mut sent = body.clone();
    let s = p.keep_for(SourceApi::Responses, &mut sent, "b");
    assert_eq!(s.removed, 1);
    let ids: Vec<&str> = sent["input"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["id"].as_str())
        .collect();
    assert_eq!(ids, ["rs_2"]);
}

#[test]
fn answers_and_events_name_their_blobs() {
    let msg = obj(json!({"type": "message", "content": [
        {"type": "thinking", "thinking": "t", "signature": "S1"},
        {"type": "redacted_thinking", "data": "R1"},
        {"type": "text", "text": "x"}
    ]}));
    assert_eq!(
        signed_in_answer(SourceApi::Messages, &msg),
        vec![blob_key("S1"), blob_key("R1")]
    );
    let resp = obj(json!({"object": "response", "output": [
        {"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "E1"},
        {"type": "message", "content": []}
    ]}));
    assert_eq!(
        signed_in_answer(SourceApi::Responses, &resp),
        vec![blob_key("E1")]
    );
    let sig = r#"{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"S2"}}"#;
    assert_eq!(
        signed_in_event(SourceApi::Messages, sig),
        Some(blob_key("S2"))
    );
    let red = r#"{"type":"content_block_start","index":1,"content_block":{"type":"redacted_thinking","data":"R2"}}"#;
    assert_eq!(
        signed_in_event(SourceApi::Messages, red),
        Some(blob_key("R2"))
    );
    let text = r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"signature_delta"}}"#;
    assert_eq!(signed_in_event(SourceApi::Messages, text), None);
    let done = r#"{"type":"response.output_item.done","output_index":0,"item":{"type":"reasoning","id":"rs","summary":[],"encrypted_content":"E2"}}"#;
    assert_eq!(
        signed_in_event(SourceApi::Responses, done),
        Some(blob_key("E2"))
    );
    let delta =
        r#"{"type":"response.output_text.delta","delta":"encrypted_content output_item.done"}"#;
    assert_eq!(signed_in_event(SourceApi::Responses, delta), None);
}

/// A random Messages block: 0 thinking, 1 redacted thinking, 2 text, 3 tool use.
fn block(kind: u8, n: usize) -> Value {
    match kind {
        0 => {
            json!({"type": "thinking", "thinking": format!("t{n}"), "signature": format!("blob{n}")})
        }
        1 => json!({"type": "redacted_thinking", "data": format!("blob{n}")}),
        2 => json!({"type": "text", "text": format!("x{n}")}),
        _ => json!({"type": "tool_use", "id": format!("toolu_{n}"), "name": "f", "input": {}}),
    }
}

/// A conversation of `turns` (each assistant turn a list of block kinds), its last
/// message the user's (with a tool result when `loop_open`).
fn conversation(turns: &[Vec<u8>], loop_open: bool, manual: bool) -> Map<String, Value> {
    let mut messages = Vec::new();
    let mut n = 0;
    for t in turns {
        messages.push(json!({"role": "user", "content": "q"}));
        let blocks: Vec<Value> = t
            .iter()
            .map(|k| {
                n += 1;
                block(*k, n)
            })
            .collect();
        messages.push(json!({"role": "assistant", "content": blocks}));
    }
    messages.push(if loop_open {
        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}]})
    } else {
        json!({"role": "user", "content": "next"})
    });
    let mut body = obj(json!({"model": "m", "max_tokens": 10, "messages": messages}));
    if manual {
        body.insert(
            "thinking".into(),
            json!({"type": "enabled", "budget_tokens": 1024}),
        );
    }
    body
}

fn non_thinking(body: &Map<String, Value>) -> Vec<Value> {
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|m| match &m["content"] {
            Value::Array(b) => b
                .iter()
                .filter(|b| !crate::native::signed::is_thinking_block(b))
                .cloned()
                .collect(),
            other => vec![other.clone()],
        })
        .collect()
}

fn blobs(api: SourceApi, body: &Map<String, Value>) -> Vec<String> {
    signed_in_request(api, body)
        .into_iter()
        .map(|r| r.key)
        .collect()
}

fn latest_assistant(body: &Map<String, Value>) -> Option<Value> {
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|m| m["role"] == "assistant")
        .cloned()
}

proptest! {
    /// Invariants of [`Placed::keep_for`] on Messages, over random conversations and
    /// random placements (not placed, the target's family, another family):
    /// 1. no blob of another family is sent;
    /// 2. every blob that is not foreign, outside a cleared latest message, is sent;
    /// 3. the latest assistant message is sent unchanged, or with exactly its thinking
    ///    blocks gone (never partly);
    /// 4. every block that is not thinking is sent, in order;
    /// 5. with nothing foreign, the body is unchanged.
    #[test]
    fn keeping_a_family_sends_nothing_foreign_and_never_a_modified_latest_message(
        turns in prop::collection::vec(prop::collection::vec(0u8..4, 1..5), 1..5),
        loop_open in any::<bool>(),
        manual in any::<bool>(),
        placements in prop::collection::vec(0u8..3, 0..24),
    ) {
        let body = conversation(&turns, loop_open, manual);
        let refs = signed_in_request(SourceApi::Messages, &body);
        let families: Vec<Option<String>> = refs
            .iter()
            .enumerate()
            .map(|(i, _)| match placements.get(i).copied().unwrap_or(0) {
                0 => None,
                1 => Some("target".to_string()),
                _ => Some("other".to_string()),
            })
            .collect();
        let foreign: Vec<String> = refs
            .iter()
            .zip(&families)
            .filter(|(_, f)| f.as_deref() == Some("other"))
            .map(|(r, _)| r.key.clone())
            .collect();
        let p = Placed::new(refs.clone(), families);
        let mut sent = body.clone();
        let s = p.keep_for(SourceApi::Messages, &mut sent, "target");
        let kept = blobs(SourceApi::Messages, &sent);
        // 1.
        for k in &foreign {
            prop_assert!(!kept.contains(k), "a foreign blob was sent");
        }
        // 3.
        let before = latest_assistant(&body);
        let after = latest_assistant(&sent);
        let before_keys = before
            .as_ref()
            .map(|m| {
                m["content"].as_array().unwrap().iter().filter_map(block_blob).map(blob_key).collect::<Vec<_>>()
            })
            .unwrap_or_default();
        let cleared = before_keys.iter().any(|k| foreign.contains(k));
        if let (Some(b), Some(a)) = (&before, &after) {
            if !cleared {
                prop_assert_eq!(a, b, "a latest message with nothing foreign changed");
            } else if b["content"].as_array().unwrap().iter().any(|x| !crate::native::signed::is_thinking_block(x)) {
                let mut want = b.clone();
                want["content"].as_array_mut().unwrap().retain(|x| !crate::native::signed::is_thinking_block(x));
                prop_assert_eq!(a, &want, "the latest message was modified, not cleared");
            }
        }
        // 2.
        for k in blobs(SourceApi::Messages, &body) {
            let may_go = foreign.contains(&k) || (cleared && before_keys.contains(&k));
            if !may_go {
                prop_assert!(kept.contains(&k), "a blob that is not foreign was dropped");
            }
        }
        // 4.
        prop_assert_eq!(non_thinking(&sent), non_thinking(&body));
        // 5.
        if foreign.is_empty() {
            prop_assert_eq!(&sent, &body);
            prop_assert_eq!(s, Stripped::default());
        }
        if s.thinking_off {
            prop_assert!(manual && loop_open && cleared);
        }
    }

    /// Responses: exactly the foreign reasoning items go; every other item is sent in
    /// order.
    #[test]
    fn responses_keep_every_item_but_the_foreign_reasoning(
        kinds in prop::collection::vec(0u8..3, 0..12),
        placements in prop::collection::vec(0u8..3, 0..12),
    ) {
        let input: Vec<Value> = kinds
            .iter()
            .enumerate()
            .map(|(n, k)| match k {
                0 => json!({"type": "reasoning", "id": format!("rs_{n}"), "summary": [], "encrypted_content": format!("enc{n}")}),
                1 => json!({"type": "message", "role": "user", "content": format!("m{n}")}),
                _ => json!({"type": "reasoning", "id": format!("rs_{n}"), "summary": []}),
            })
            .collect();
        let body = obj(json!({"model": "m", "input": input}));
        let refs = signed_in_request(SourceApi::Responses, &body);
        let families: Vec<Option<String>> = (0..refs.len())
            .map(|i| match placements.get(i).copied().unwrap_or(0) {
                0 => None,
                1 => Some("target".into()),
                _ => Some("other".into()),
            })
            .collect();
        let foreign: Vec<usize> = refs
            .iter()
            .zip(&families)
            .filter(|(_, f)| f.as_deref() == Some("other"))
            .map(|(r, _)| match r.at { Place::Item(i) => i, Place::Block { .. } => usize::MAX })
            .collect();
        let p = Placed::new(refs, families);
        let mut sent = body.clone();
        p.keep_for(SourceApi::Responses, &mut sent, "target");
        let want: Vec<Value> = body["input"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .filter(|(i, _)| !foreign.contains(i))
            .map(|(_, v)| v.clone())
            .collect();
        prop_assert_eq!(&sent["input"], &Value::Array(want));
    }
}
