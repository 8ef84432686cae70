//! The chat-completions side shared by both dialects: a [`Conversation`] builder that
//! turns a dialect's turns into core [`Message`]s by chat's rules (one assistant
//! message per assistant turn, tool results right after the call, images a tool
//! returned carried in a user message after them), and [`NameTable`], which gives
//! every tool a name chat sources accept and remembers the way back.

use std::collections::BTreeSet;

use polygw_core::Message;
use serde_json::{json, Map, Value};

/// The longest function name chat-completions sources accept (OpenAI: 64).
pub(crate) const MAX_TOOL_NAME: usize = 64;

/// A `{"type":"text"}` part.
pub(crate) fn text_part(text: impl Into<String>) -> Value {
    json!({"type": "text", "text": text.into()})
}

/// A `{"type":"image_url"}` part.
pub(crate) fn image_part(url: impl Into<String>, detail: Option<String>) -> Value {
    let mut image = Map::new();
    image.insert("url".into(), Value::String(url.into()));
    if let Some(d) = detail {
        image.insert("detail".into(), Value::String(d));
    }
    json!({"type": "image_url", "image_url": Value::Object(image)})
}

/// A chat content value from parts: one text part → its string, no parts → `""`,
/// otherwise the array of parts.
pub(crate) fn content_value(mut parts: Vec<Value>) -> Value {
    if parts.is_empty() {
        return Value::String(String::new());
    }
    if parts.len() == 1 && parts[0]["type"] == "text" {
        if let Some(Value::String(s)) = parts[0].get_mut("text").map(Value::take) {
            return Value::String(s);
        }
    }
    Value::Array(parts)
}

/// An OpenAI `tool_calls[]` entry.
pub(crate) fn tool_call(id: &str, name: &str, arguments: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// A chat function tool definition.
pub(crate) fn function_def(
    name: &str,
    description: Option<&str>,
    parameters: Option<&Value>,
    strict: Option<bool>,
) -> Value {
    let mut f = Map::new();
    f.insert("name".into(), Value::String(name.to_string()));
    if let Some(d) = description {
        f.insert("description".into(), Value::String(d.to_string()));
    }
    if let Some(p) = parameters {
        f.insert("parameters".into(), p.clone());
    }
    if let Some(s) = strict {
        f.insert("strict".into(), Value::Bool(s));
    }
    json!({"type": "function", "function": Value::Object(f)})
}

/// Builds the chat conversation turn by turn.
#[derive(Debug, Default)]
pub(crate) struct Conversation {
    messages: Vec<Message>,
    /// The assistant turn being built: its content parts and tool calls.
    assistant: Option<(Vec<Value>, Vec<Value>)>,
    /// Images returned by tool calls of the current run of tool messages, sent in one
    /// user message once the run ends (chat tool messages carry text only).
    tool_images: Vec<Value>,
}

impl Conversation {
    /// A system message (its parts are all text: joined by a blank line, since many
    /// chat sources accept only a string there).
    pub(crate) fn system(&mut self, text: String) {
        self.flush();
        self.messages.push(Message::system(text));
    }

    /// A user message with these parts (text and image parts).
    pub(crate) fn user(&mut self, parts: Vec<Value>) {
        self.flush_assistant();
        let mut all = std::mem::take(&mut self.tool_images);
        all.extend(parts);
        self.messages.push(Message {
            role: "user".into(),
            content: Some(content_value(all)),
            extra: Map::new(),
        });
    }

    /// Text parts of the assistant's turn (consecutive assistant items are one turn).
    pub(crate) fn assistant_parts(&mut self, parts: Vec<Value>) {
        self.flush_tool_images();
        self.assistant
            .get_or_insert_with(Default::default)
            .0
            .extend(parts);
    }

    /// A tool call of the assistant's turn.
    pub(crate) fn assistant_call(&mut self, id: &str, name: &str, arguments: &str) {
        self.flush_tool_images();
        self.assistant
            .get_or_insert_with(Default::default)
            .1
            .push(tool_call(id, name, arguments));
    }

    /// A tool result: a `tool` message with the text; images are held for the user
    /// message that follows the run of tool messages, and the text says so.
    pub(crate) fn tool_result(&mut self, call_id: &str, text: String, images: Vec<Value>) {
        self.flush_assistant();
        let text = if images.is_empty() {
            text
        } else {
            let note = format!(
                "[{} image(s) returned by this tool call follow in the next user message]",
                images.len()
            );
            if text.is_empty() {
                note
            } else {
                format!("{text}\n{note}")
            }
        };
        if !images.is_empty() {
            self.tool_images.push(text_part(format!(
                "Images returned by tool call {call_id}:"
            )));
            self.tool_images.extend(images);
        }
        let mut extra = Map::new();
        extra.insert("tool_call_id".into(), Value::String(call_id.to_string()));
        self.messages.push(Message {
            role: "tool".into(),
            content: Some(Value::String(text)),
            extra,
        });
    }

    /// The messages, every pending turn flushed.
    pub(crate) fn finish(mut self) -> Vec<Message> {
        self.flush();
        self.messages
    }

    fn flush(&mut self) {
        self.flush_assistant();
        self.flush_tool_images();
    }

    fn flush_tool_images(&mut self) {
        if !self.tool_images.is_empty() {
            let parts = std::mem::take(&mut self.tool_images);
            self.messages.push(Message {
                role: "user".into(),
                content: Some(Value::Array(parts)),
                extra: Map::new(),
            });
        }
    }

    fn flush_assistant(&mut self) {
        let Some((parts, calls)) = self.assistant.take() else {
            return;
        };
        let content = if parts.is_empty() {
            // A tool-call-only turn: `content: null`, as OpenAI documents it.
            Value::Null
        } else {
            content_value(parts)
        };
        let mut extra = Map::new();
        if !calls.is_empty() {
            extra.insert("tool_calls".into(), Value::Array(calls));
        }
        self.messages.push(Message {
            role: "assistant".into(),
            content: Some(content),
            extra,
        });
    }
}

/// Gives each tool a function name chat sources accept (`^[A-Za-z0-9_-]{1,64}$`,
/// unique): other characters become `_`; a longer name keeps its first 55 characters
/// and gains `_` and 8 hex digits of a hash of the whole name; a name already given
/// gains `_2`, `_3`, ….
#[derive(Debug, Default, Clone)]
pub(crate) struct NameTable {
    used: BTreeSet<String>,
}

impl NameTable {
    /// The chat name for `wanted` (deterministic for a given order of calls).
    pub(crate) fn assign(&mut self, wanted: &str) -> String {
        let base = sanitize(wanted);
        let mut name = base.clone();
        let mut n = 2u32;
        while self.used.contains(&name) {
            let suffix = format!("_{n}");
            let keep = MAX_TOOL_NAME.saturating_sub(suffix.len()).min(base.len());
            name = format!("{}{suffix}", &base[..keep]);
            n += 1;
        }
        self.used.insert(name.clone());
        name
    }
}

/// `wanted` with characters outside `[A-Za-z0-9_-]` replaced and shortened to 64.
pub(crate) fn sanitize(wanted: &str) -> String {
    let mut s: String = wanted
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        s.push_str("tool");
    }
    if s.len() > MAX_TOOL_NAME {
        // Every character is ASCII now, so byte slicing is at a char boundary.
        s = format!("{}_{:08x}", &s[..55], fnv1a(wanted.as_bytes()) as u32);
    }
    s
}

/// FNV-1a, 64 bits: a stable hash for shortened names (no randomness, no crate).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The suffix of a response/message id after its `resp_` / `msg_` prefix, for item ids
/// derived from it.
pub(crate) fn id_suffix(id: &str) -> &str {
    match id.split_once('_') {
        Some((_, rest)) if !rest.is_empty() => rest,
        _ => id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_sanitized_shortened_and_unique() {
        let mut t = NameTable::default();
        assert_eq!(t.assign("get_weather"), "get_weather");
        assert_eq!(t.assign("get_weather"), "get_weather_2");
        assert_eq!(t.assign("ns.tool name"), "ns_tool_name");
        let long = "x".repeat(80);
        let a = t.assign(&long);
        assert_eq!(a.len(), 64);
        assert!(a.starts_with(&"x".repeat(55)));
        let b = t.assign(&long);
        assert_ne!(a, b);
        assert!(b.len() <= 64);
        assert_eq!(t.assign(""), "tool");
    }

    #[test]
    fn tool_images_follow_the_run_of_tool_messages() {
        let mut c = Conversation::default();
        c.assistant_call("c1", "f", "{}");
        c.assistant_call("c2", "f", "{}");
        c.tool_result("c1", "one".into(), vec![image_part("data:x", None)]);
        c.tool_result("c2", "two".into(), vec![]);
        c.user(vec![text_part("next")]);
        let m = c.finish();
        let roles: Vec<_> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["assistant", "tool", "tool", "user"]);
        assert_eq!(m[0].content, Some(Value::Null));
        assert!(m[1].text().unwrap().starts_with("one\n[1 image(s)"));
        let parts = m[3].content.as_ref().unwrap().as_array().unwrap();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[1]["type"], "image_url");
        assert_eq!(parts[2]["text"], "next");
    }

    #[test]
    fn content_value_collapses_one_text_part() {
        assert_eq!(content_value(vec![text_part("a")]), json!("a"));
        assert_eq!(content_value(vec![]), json!(""));
        assert_eq!(
            content_value(vec![text_part("a"), text_part("b")]),
            json!([{"type":"text","text":"a"},{"type":"text","text":"b"}])
        );
        assert_eq!(id_suffix("resp_abc"), "abc");
        assert_eq!(id_suffix("plain"), "plain");
    }
}
