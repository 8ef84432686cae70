//! Signature families (SPEC §23.5): signed provider state stays with the family that
//! produced it.
//!
//! A source's family is its `SIGNATURE_GROUP` (default: the source itself). polygw
//! remembers which family produced each signed blob it passed to a client — a thinking
//! block's `signature`, a `redacted_thinking` block's `data`, a reasoning item's
//! `encrypted_content` — under the blob's digest ([`blob_key`]), and before a native
//! request goes to a source it looks them up ([`signed_in_request`], one store lookup
//! for all of them) and keeps in the body only what the target's family can verify
//! ([`Placed::keep_for`]):
//! - a blob known to come from another family is removed;
//! - a blob it cannot place (never seen, or forgotten) passes unchanged (the safety net
//!   of [`super::signed`] answers a refusal);
//! - Messages: the latest assistant message is all or nothing (Anthropic refuses a
//!   modified one): it keeps every block, or, when any of its blobs is foreign, loses
//!   every thinking block; manual thinking (`enabled`) is then turned off for the
//!   request when that message is an open tool loop (Anthropic requires it to begin
//!   with a thinking block; adaptive thinking does not, and stays).
//!
//! Everything here is pure: the store lookup and the write are the facade's.

use std::sync::Arc;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::signed::Stripped;
use crate::source::SourceApi;

/// The default time a blob's family is remembered (`{S}__SIGNATURE__TTL_S`): 7 days.
pub const DEFAULT_SIGNATURE_TTL: std::time::Duration =
    std::time::Duration::from_secs(7 * 24 * 3600);

/// The store key of a signed blob: `sg` and 32 hex characters of its SHA-256 (never the
/// blob itself; distinct from affinity keys, which are 32 characters).
pub fn blob_key(blob: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"polygw-signed-v1\0");
    h.update(blob.as_bytes());
    let mut out = String::with_capacity(34);
    out.push_str("sg");
    for b in &h.finalize()[..16] {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// Where a signed blob sits in a native request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Place {
    /// Messages: block `block` of message `message`.
    Block {
        /// The message's index in `messages`.
        message: usize,
        /// The block's index in its `content`.
        block: usize,
    },
    /// Responses: item `0` of `input`.
    Item(usize),
}

/// One signed blob of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedRef {
    /// Where it is.
    pub at: Place,
    /// Its store key ([`blob_key`]).
    pub key: String,
}

/// The signed blob of a Messages content block (`thinking`: its signature;
/// `redacted_thinking`: its data), when it is one.
fn block_blob(b: &Value) -> Option<&str> {
    match b.get("type").and_then(Value::as_str)? {
        "thinking" => b.get("signature").and_then(Value::as_str),
        "redacted_thinking" => b.get("data").and_then(Value::as_str),
        _ => None,
    }
    .filter(|s| !s.is_empty())
}

/// The encrypted reasoning of a Responses item, when it is one.
fn item_blob(i: &Value) -> Option<&str> {
    (i.get("type").and_then(Value::as_str) == Some("reasoning"))
        .then(|| i.get("encrypted_content").and_then(Value::as_str))
        .flatten()
        .filter(|s| !s.is_empty())
}

/// The signed blobs of a native request body of `api`, in request order: Messages'
/// assistant thinking blocks, Responses' reasoning items with encrypted content.
pub fn signed_in_request(api: SourceApi, body: &Map<String, Value>) -> Vec<SignedRef> {
    let mut out = Vec::new();
    match api {
        SourceApi::Messages => {
            let Some(Value::Array(messages)) = body.get("messages") else {
                return out;
            };
            for (m, msg) in messages.iter().enumerate() {
                if msg.get("role").and_then(Value::as_str) != Some("assistant") {
                    continue;
                }
                let Some(Value::Array(blocks)) = msg.get("content") else {
                    continue;
                };
                for (b, block) in blocks.iter().enumerate() {
                    if let Some(blob) = block_blob(block) {
                        out.push(SignedRef {
                            at: Place::Block {
                                message: m,
                                block: b,
                            },
                            key: blob_key(blob),
                        });
                    }
                }
            }
        }
        SourceApi::Responses => {
            let Some(Value::Array(items)) = body.get("input") else {
                return out;
            };
            for (i, item) in items.iter().enumerate() {
                if let Some(blob) = item_blob(item) {
                    out.push(SignedRef {
                        at: Place::Item(i),
                        key: blob_key(blob),
                    });
                }
            }
        }
        SourceApi::Chat => {}
    }
    out
}

/// The store keys of the signed blobs of a plain native answer of `api` (a Messages
/// `message`, a Responses `response`).
pub fn signed_in_answer(api: SourceApi, obj: &Map<String, Value>) -> Vec<String> {
    match api {
        SourceApi::Messages => obj
            .get("content")
            .and_then(Value::as_array)
            .map(|blocks| blocks.iter().filter_map(block_blob).map(blob_key).collect())
            .unwrap_or_default(),
        SourceApi::Responses => obj
            .get("output")
            .and_then(Value::as_array)
            .map(|items| items.iter().filter_map(item_blob).map(blob_key).collect())
            .unwrap_or_default(),
        SourceApi::Chat => Vec::new(),
    }
}

/// The store key of the signed blob one streamed event of `api` completes, if any: a
/// Messages `signature_delta` or `redacted_thinking` block start, a Responses
/// `response.output_item.done` of a reasoning item with encrypted content. Events that
/// cannot carry one are skipped without parsing.
pub fn signed_in_event(api: SourceApi, data: &str) -> Option<String> {
    match api {
        SourceApi::Messages => {
            if !(data.contains("signature_delta") || data.contains("redacted_thinking")) {
                return None;
            }
            let v: Value = serde_json::from_str(data).ok()?;
            match v.get("type").and_then(Value::as_str)? {
                "content_block_delta" => {
                    let d = v.get("delta")?;
                    (d.get("type").and_then(Value::as_str) == Some("signature_delta"))
                        .then(|| d.get("signature").and_then(Value::as_str))
                        .flatten()
                        .filter(|s| !s.is_empty())
                        .map(blob_key)
                }
                "content_block_start" => block_blob(v.get("content_block")?).map(blob_key),
                _ => None,
            }
        }
        SourceApi::Responses => {
            if !(data.contains("encrypted_content") && data.contains("output_item.done")) {
                return None;
            }
            let v: Value = serde_json::from_str(data).ok()?;
            (v.get("type").and_then(Value::as_str) == Some("response.output_item.done"))
                .then(|| v.get("item").and_then(item_blob).map(blob_key))
                .flatten()
        }
        SourceApi::Chat => None,
    }
}

/// A request's signed blobs with the families the store placed them in.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Placed {
    /// The blobs, in request order.
    pub refs: Vec<SignedRef>,
    /// The family of each (`None`: not placed).
    pub families: Vec<Option<Arc<str>>>,
}

impl Placed {
    /// `refs` with the store's answer for their keys (missing answers: not placed).
    pub fn new(refs: Vec<SignedRef>, families: Vec<Option<String>>) -> Self {
        let mut families: Vec<Option<Arc<str>>> =
            families.into_iter().map(|f| f.map(Arc::from)).collect();
        families.resize(refs.len(), None);
        Placed { refs, families }
    }

    /// The family of the conversation: that of its latest placed blob (hedge and
    /// resume legs prefer it).
    pub fn session_family(&self) -> Option<&Arc<str>> {
        self.families.iter().rev().flatten().next()
    }

    /// Whether any placed blob belongs to a family other than `target`.
    pub fn any_foreign(&self, target: &str) -> bool {
        self.families.iter().flatten().any(|f| &**f != target)
    }

    /// Keeps in `body` (the request the blobs were read from, of `api`) only what
    /// family `target` can verify; see the module's rules. Returns what went
    /// (nothing: `body` is unchanged).
    pub fn keep_for(
        &self,
        api: SourceApi,
        body: &mut Map<String, Value>,
        target: &str,
    ) -> Stripped {
        let mut out = Stripped::default();
        if !self.any_foreign(target) {
            return out;
        }
        let foreign: Vec<Place> = self
            .refs
            .iter()
            .zip(&self.families)
            .filter(|(_, f)| f.as_deref().is_some_and(|f| f != target))
            .map(|(r, _)| r.at)
            .collect();
        match api {
            SourceApi::Messages => keep_messages(body, &foreign, &mut out),
            SourceApi::Responses => {
                if let Some(Value::Array(items)) = body.get_mut("input") {
                    let mut i = 0;
                    items.retain(|_| {
                        let gone = foreign.contains(&Place::Item(i));
                        i += 1;
                        !gone
                    });
                    out.removed = foreign.len();
                }
            }
            SourceApi::Chat => {}
        }
        out
    }
}

/// Whether the assistant message at `at` is an open tool loop: it calls a tool and the
/// request ends with the user's results.
fn open_tool_loop(messages: &[Value], at: usize) -> bool {
    let has = |m: &Value, kind: &str| {
        m.get("content").and_then(Value::as_array).is_some_and(|c| {
            c.iter()
                .any(|b| b.get("type").and_then(Value::as_str) == Some(kind))
        })
    };
    at + 2 == messages.len()
        && has(&messages[at], "tool_use")
        && has(&messages[at + 1], "tool_result")
}

fn keep_messages(body: &mut Map<String, Value>, foreign: &[Place], out: &mut Stripped) {
    let manual = body
        .get("thinking")
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        == Some("enabled");
    let Some(Value::Array(messages)) = body.get_mut("messages") else {
        return;
    };
    let latest = messages
        .iter()
        .rposition(|m| m.get("role").and_then(Value::as_str) == Some("assistant"));
    let mut emptied = Vec::new();
    let mut latest_cleared = false;
    for (m, msg) in messages.iter_mut().enumerate() {
        let here: Vec<usize> = foreign
            .iter()
            .filter_map(|p| match p {
                Place::Block { message, block } if *message == m => Some(*block),
                _ => None,
            })
            .collect();
        if here.is_empty() {
            continue;
        }
        let Some(Value::Array(blocks)) = msg.get_mut("content") else {
            continue;
        };
        let before = blocks.len();
        if Some(m) == latest {
            // All or nothing: every thinking block of the latest assistant message.
            blocks.retain(|b| !super::signed::is_thinking_block(b));
            latest_cleared = true;
        } else {
            let mut j = 0;
            blocks.retain(|_| {
                let gone = here.contains(&j);
                j += 1;
                !gone
            });
        }
        out.removed += before - blocks.len();
        if blocks.is_empty() {
            emptied.push(m);
        }
    }
    let tool_loop = latest.is_some_and(|l| open_tool_loop(messages, l));
    for i in emptied.iter().rev() {
        messages.remove(*i);
    }
    out.emptied = emptied.len();
    if latest_cleared && manual && tool_loop {
        body.remove("thinking");
        out.thinking_off = true;
    }
}

#[cfg(test)]
mod tests;
