//! Signed provider state, as the real providers sign and check it (SPEC §23.8), for a
//! behavior with a `signing_group`:
//! - a thinking block's signature is `sig-<group>-<h>`, `<h>` a digest of the thinking
//!   text the client receives ([`thinking_signature`]); a reasoning item's encrypted
//!   content is `enc-<group>-<n>` ([`encrypted_content`]); redacted thinking data starts
//!   `red-<group>`;
//! - a request is refused with the provider's own 400 ([`refusal`]) when it carries
//!   another group's signature or encrypted content ("Invalid `signature` in `thinking`
//!   block", `invalid_encrypted_content`), a thinking block of the latest assistant
//!   message whose text was changed ("… cannot be modified"), or — with manual thinking
//!   on, in a conversation that carries thinking blocks — an open tool loop whose
//!   assistant message does not begin with a thinking block ("Expected `thinking` or
//!   `redacted_thinking`, but found …").

use serde_json::Value;

use crate::play::WireApi;

/// The signature group `group` gives a thinking block whose text is `text`.
pub fn thinking_signature(group: &str, text: &str) -> String {
    // FNV-1a: stable, and enough to tell a changed text.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("sig-{group}-{h:016x}")
}

/// The encrypted content group `group` gives reasoning item `id`.
pub fn encrypted_content(group: &str, id: &str) -> String {
    format!("enc-{group}-{id}")
}

fn is_thinking(b: &Value) -> bool {
    matches!(
        b.get("type").and_then(Value::as_str),
        Some("thinking" | "redacted_thinking")
    )
}

fn has_block(m: &Value, kind: &str) -> bool {
    m.get("content").and_then(Value::as_array).is_some_and(|c| {
        c.iter()
            .any(|b| b.get("type").and_then(Value::as_str) == Some(kind))
    })
}

/// The provider's 400 for signed state group `group` does not accept: (error code,
/// message).
pub(crate) fn refusal(api: WireApi, body: &Value, group: &str) -> Option<(&'static str, String)> {
    match api {
        WireApi::Messages => messages_refusal(body, group),
        WireApi::Responses => {
            let items = body.get("input")?.as_array()?;
            items.iter().find_map(|item| {
                let enc = item.get("encrypted_content")?.as_str()?;
                (item.get("type").and_then(Value::as_str) == Some("reasoning")
                    && !enc.starts_with(&format!("enc-{group}-")))
                .then(|| {
                    let id = item.get("id").and_then(Value::as_str).unwrap_or("rs");
                    (
                        "invalid_encrypted_content",
                        format!(
                            "The encrypted content for item {id} could not be verified. \
                             Reason: Encrypted content organization_id did not match the \
                             target organization."
                        ),
                    )
                })
            })
        }
        _ => None,
    }
}

fn messages_refusal(body: &Value, group: &str) -> Option<(&'static str, String)> {
    let messages = body.get("messages")?.as_array()?;
    let latest = messages
        .iter()
        .rposition(|m| m.get("role").and_then(Value::as_str) == Some("assistant"));
    let own = format!("sig-{group}-");
    for (i, m) in messages.iter().enumerate() {
        let Some(blocks) = m.get("content").and_then(Value::as_array) else {
            continue;
        };
        for (j, b) in blocks.iter().enumerate() {
            let (foreign, modified) = match b.get("type").and_then(Value::as_str) {
                Some("thinking") => {
                    let sig = b.get("signature").and_then(Value::as_str).unwrap_or("");
                    let text = b.get("thinking").and_then(Value::as_str).unwrap_or("");
                    if !sig.starts_with(&own) {
                        (true, false)
                    } else {
                        (false, sig != thinking_signature(group, text))
                    }
                }
                Some("redacted_thinking") => (
                    !b.get("data")
                        .and_then(Value::as_str)
                        .is_some_and(|d| d.starts_with(&format!("red-{group}"))),
                    false,
                ),
                _ => (false, false),
            };
            if modified && Some(i) == latest {
                return Some((
                    "invalid_request_error",
                    format!(
                        "messages.{i}.content.{j}: `thinking` or `redacted_thinking` blocks in \
                         the latest assistant message cannot be modified. These blocks must \
                         remain as they were in the original response."
                    ),
                ));
            }
            if foreign || modified {
                return Some((
                    "invalid_request_error",
                    format!("messages.{i}.content.{j}: Invalid `signature` in `thinking` block"),
                ));
            }
        }
    }
    // Manual thinking: an open tool loop's assistant message begins with thinking — in
    // a conversation that has thinking at all (the mock's own answers carry none when
    // its behavior has no reasoning, where a real model would have thought).
    let thought = messages.iter().any(|m| {
        m.get("content")
            .and_then(Value::as_array)
            .is_some_and(|c| c.iter().any(is_thinking))
    });
    let manual = thought
        && body
            .get("thinking")
            .and_then(|t| t.get("type"))
            .and_then(Value::as_str)
            == Some("enabled");
    let l = latest?;
    if manual
        && l + 2 == messages.len()
        && has_block(&messages[l], "tool_use")
        && has_block(&messages[l + 1], "tool_result")
    {
        let first = messages[l]
            .get("content")
            .and_then(Value::as_array)
            .and_then(|c| c.first())?;
        if !is_thinking(first) {
            let found = first.get("type").and_then(Value::as_str).unwrap_or("text");
            return Some((
                "invalid_request_error",
                format!(
                    "messages.{l}.content.0.type: Expected `thinking` or `redacted_thinking`, \
                     but found `{found}`. When `thinking` is enabled, a final `assistant` \
                     message must start with a thinking block (preceeding the lastmost set of \
                     `tool_use` and `tool_result` blocks). We recommend you include thinking \
                     blocks from previous turns. To avoid this requirement, disable \
                     `thinking`. Please consult our documentation at \
                     https://docs.claude.com/en/docs/build-with-claude/extended-thinking"
                ),
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn loop_body(first: Value) -> Value {
        json!({"thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [first, {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}
        ]})
    }

    #[test]
    fn the_providers_rules() {
        let own = json!({"type": "thinking", "thinking": "hm", "signature": thinking_signature("a", "hm")});
        assert_eq!(refusal(WireApi::Messages, &loop_body(own), "a"), None);
        let foreign = json!({"type": "thinking", "thinking": "hm", "signature": thinking_signature("b", "hm")});
        let r = refusal(WireApi::Messages, &loop_body(foreign), "a").unwrap();
        assert!(r.1.contains("Invalid `signature`"), "{r:?}");
        let changed = json!({"type": "thinking", "thinking": "hm!", "signature": thinking_signature("a", "hm")});
        let r = refusal(WireApi::Messages, &loop_body(changed), "a").unwrap();
        assert!(r.1.contains("cannot be modified"), "{r:?}");
        let dropped = json!({"type": "text", "text": "x"});
        let mut earlier = loop_body(dropped.clone());
        earlier["messages"].as_array_mut().unwrap().splice(
            0..0,
            [
                json!({"role": "user", "content": "q0"}),
                json!({"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "t", "signature": thinking_signature("a", "t")},
                    {"type": "text", "text": "a0"}]}),
            ],
        );
        let r = refusal(WireApi::Messages, &earlier, "a").unwrap();
        assert!(r.1.contains("Expected `thinking`"), "{r:?}");
        assert_eq!(
            refusal(WireApi::Messages, &loop_body(dropped.clone()), "a"),
            None,
            "a conversation without thinking"
        );
        let mut adaptive = loop_body(dropped);
        adaptive["thinking"] = json!({"type": "adaptive"});
        assert_eq!(refusal(WireApi::Messages, &adaptive, "a"), None);
        let items = |enc: &str| json!({"input": [{"type": "reasoning", "id": "rs_1", "encrypted_content": enc}]});
        assert_eq!(
            refusal(
                WireApi::Responses,
                &items(&encrypted_content("a", "rs_1")),
                "a"
            ),
            None
        );
        let r = refusal(
            WireApi::Responses,
            &items(&encrypted_content("b", "rs_1")),
            "a",
        )
        .unwrap();
        assert_eq!(r.0, "invalid_encrypted_content");
    }
}
