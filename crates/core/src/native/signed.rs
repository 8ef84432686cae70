//! Signed provider state in a native request (SPEC §23.5, the safety net): Anthropic's
//! `thinking` / `redacted_thinking` blocks carry signatures only the provider (and model)
//! that produced them can verify, and OpenAI's encrypted reasoning is bound to an
//! organization. A conversation that failed over from one source to another carries
//! blocks the new source refuses — with a 400 on every retry, which ends the session.
//!
//! [`signature_rejection`] recognises that refusal by the providers' own wording;
//! [`strip_signed`] removes the signed state from a body so that the request can be
//! sent once more, at once. Both are pure.

use serde_json::{Map, Value};

use crate::error::{AttemptError, ErrorClass};
use crate::source::SourceApi;

/// Whether `e` is a source refusing signed state it cannot verify: Anthropic's "Invalid
/// `signature` in `thinking` block" (and the "bound to a different conversation" form),
/// OpenAI's `invalid_encrypted_content` ("The encrypted content … could not be
/// verified", "… organization_id did not match …").
pub fn signature_rejection(api: SourceApi, e: &AttemptError) -> bool {
    if e.class != ErrorClass::Rejected {
        return false;
    }
    let message = e.provider_message.as_deref().unwrap_or("");
    let text = format!("{message} {}", e.detail).to_ascii_lowercase();
    match api {
        SourceApi::Messages => {
            text.contains("signature") && (text.contains("thinking") || text.contains("block"))
        }
        SourceApi::Responses | SourceApi::Chat => {
            e.provider_code.as_deref() == Some("invalid_encrypted_content")
                || text.contains("encrypted content")
        }
    }
}

/// What [`strip_signed`] removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stripped {
    /// Signed blocks or items removed.
    pub removed: usize,
    /// Messages left empty by it and removed (their neighbours' turns join).
    pub emptied: usize,
    /// Manual thinking (`thinking.type: enabled`) was turned off for this request: it
    /// requires the latest assistant turn to begin with a thinking block, which is gone.
    pub thinking_off: bool,
}

/// Removes the signed state of a native body of `api`:
/// - Messages: every `thinking` and `redacted_thinking` block of the `assistant`
///   messages (a message left empty is removed); with manual thinking on, `thinking` is
///   removed too (adaptive thinking needs no leading block and stays).
/// - Responses: every `reasoning` item of `input` that carries `encrypted_content`.
///
/// Nothing else changes: other blocks, items and fields keep their order and values.
pub fn strip_signed(api: SourceApi, body: &mut Map<String, Value>) -> Stripped {
    let mut out = Stripped::default();
    match api {
        SourceApi::Messages => {
            let Some(Value::Array(messages)) = body.get_mut("messages") else {
                return out;
            };
            let mut emptied = Vec::new();
            for (i, m) in messages.iter_mut().enumerate() {
                if m.get("role").and_then(Value::as_str) != Some("assistant") {
                    continue;
                }
                if let Some(Value::Array(blocks)) = m.get_mut("content") {
                    let before = blocks.len();
                    blocks.retain(|b| !is_thinking_block(b));
                    out.removed += before - blocks.len();
                    if blocks.is_empty() && before > 0 {
                        emptied.push(i);
                    }
                }
            }
            // A message left with no content is refused: it goes (consecutive turns of
            // one role are joined by the API).
            for i in emptied.iter().rev() {
                messages.remove(*i);
            }
            out.emptied = emptied.len();
            let manual = body
                .get("thinking")
                .and_then(|t| t.get("type"))
                .and_then(Value::as_str)
                == Some("enabled");
            if out.removed > 0 && manual {
                body.remove("thinking");
                out.thinking_off = true;
            }
        }
        SourceApi::Responses => {
            let Some(Value::Array(items)) = body.get_mut("input") else {
                return out;
            };
            let before = items.len();
            items.retain(|i| {
                !(i.get("type").and_then(Value::as_str) == Some("reasoning")
                    && i.get("encrypted_content").is_some_and(|c| !c.is_null()))
            });
            out.removed = before - items.len();
        }
        SourceApi::Chat => {}
    }
    out
}

/// Whether a Messages content block is thinking (`thinking` or `redacted_thinking`).
pub(crate) fn is_thinking_block(b: &Value) -> bool {
    matches!(
        b.get("type").and_then(Value::as_str),
        Some("thinking" | "redacted_thinking")
    )
}

#[cfg(test)]
mod tests;
