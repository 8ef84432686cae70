//! A client's JSON body as received, and the chat body a source is sent made from it by
//! editing it in place (SPEC §27.1, the byte path).
//!
//! [`WireBody::scan`] finds the top-level members of an object body in one borrowed pass
//! (keys decoded only when they hold escapes; values as the byte ranges they were sent
//! as). [`chat_body_edited`] writes the `/chat/completions` body for a source from those
//! ranges: every member the client sent goes out byte for byte except the few a gateway
//! must set (`model`, `stream`, `stream_options`, the source's `EXTRA_BODY`); nothing is
//! parsed into a tree and serialized again. It is the same JSON request as
//! [`crate::body::chat_body`] builds from the parsed [`ChatRequest`] (property-tested
//! below), with two differences that are the client's own bytes winning over a re-encoding
//! (DECISIONS 187): numbers keep their spelling (`1` stays `1`, not `1.0`), and `null`s
//! nested in the objects of fields polygw does not read stay as sent.

use std::ops::Range;

use serde::de::{self, DeserializeSeed, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::body::merge_patch;
use crate::source::SourceConfig;

/// One top-level member: its key (decoded only when it held escapes) and the byte
/// range of its value in the body.
#[derive(Clone, PartialEq)]
struct Member {
    key: Key,
    value: Range<usize>,
}

#[derive(Clone, PartialEq)]
enum Key {
    /// The key as sent (no escapes): its range in the body.
    Plain(Range<usize>),
    /// A key with escapes, decoded.
    Decoded(Box<str>),
}

/// A client's object body as received, with its top-level members (the last of a
/// repeated key, as a JSON parser keeps it).
#[derive(Clone, PartialEq)]
pub struct WireBody {
    /// The body (checked UTF-8 once: every range below is a `str` of it).
    text: String,
    members: Vec<Member>,
}

impl std::fmt::Debug for WireBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WireBody")
            .field("bytes", &self.text.len())
            .field("members", &self.members.len())
            .finish()
    }
}

/// A key, borrowed when the body spells it without escapes.
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = std::borrow::Cow<'de, str>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = std::borrow::Cow<'de, str>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a key")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Borrowed(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Owned(v.to_owned()))
    }
}

/// Reads the top-level object of `body` (the text being deserialized) into members.
struct TopVisitor<'b> {
    body: &'b str,
}

impl<'de> Visitor<'de> for TopVisitor<'_> {
    type Value = Vec<Member>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let body = self.body;
        let mut members: Vec<Member> = Vec::with_capacity(map.size_hint().unwrap_or(8));
        while let Some(k) = map.next_key_seed(KeySeed)? {
            let key = match k {
                std::borrow::Cow::Borrowed(s) => {
                    let at = offset(body, s);
                    Key::Plain(at..at + s.len())
                }
                std::borrow::Cow::Owned(s) => Key::Decoded(s.into_boxed_str()),
            };
            let v: &'de RawValue = map.next_value()?;
            let at = offset(body, v.get());
            members.push(Member {
                key,
                value: at..at + v.get().len(),
            });
        }
        keep_last(&mut members, body);
        Ok(members)
    }
}

/// Keeps the last of each repeated key, in its place. A body holds a handful of
/// members: compared pairwise; a hostile one with thousands goes through a set (a
/// pairwise pass over 100 000 keys would be 5·10⁹ comparisons).
fn keep_last(members: &mut Vec<Member>, body: &str) {
    const PAIRWISE: usize = 16;
    let later = |i: usize, members: &[Member]| {
        let k = key_str(body, &members[i].key);
        members[i + 1..].iter().any(|m| key_str(body, &m.key) == k)
    };
    let drop: Vec<bool> = if members.len() <= PAIRWISE {
        (0..members.len()).map(|i| later(i, members)).collect()
    } else {
        let mut seen = std::collections::HashSet::with_capacity(members.len());
        let mut drop: Vec<bool> = members
            .iter()
            .rev()
            .map(|m| !seen.insert(key_str(body, &m.key)))
            .collect();
        drop.reverse();
        drop
    };
    if drop.iter().any(|d| *d) {
        let mut d = drop.into_iter();
        members.retain(|_| !d.next().unwrap_or(false));
    }
}

/// Where `inner` (a slice of `outer`) starts in it.
fn offset(outer: &str, inner: &str) -> usize {
    inner.as_ptr() as usize - outer.as_ptr() as usize
}

impl WireBody {
    /// The body's top-level members in one borrowed pass; `Err` (serde's) when the body
    /// is not one JSON object. A repeated key keeps its last value, in the place of its
    /// last occurrence.
    pub fn scan(bytes: Vec<u8>) -> Result<WireBody, serde_json::Error> {
        let text = match String::from_utf8(bytes) {
            Ok(t) => t,
            // Not UTF-8: serde's error says where (a JSON text is UTF-8 throughout).
            Err(e) => {
                return Err(match serde_json::from_slice::<Value>(e.as_bytes()) {
                    Err(e) => e,
                    Ok(_) => serde_json::Error::io(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "the body is not UTF-8",
                    )),
                })
            }
        };
        let members = {
            let mut de = serde_json::Deserializer::from_str(&text);
            let members = de::Deserializer::deserialize_map(&mut de, TopVisitor { body: &text })?;
            de.end()?;
            members
        };
        Ok(WireBody { text, members })
    }

    /// The top-level members: each key with its value's text as sent.
    pub fn members(&self) -> impl Iterator<Item = (&str, &str)> {
        self.members
            .iter()
            .map(|m| (key_str(&self.text, &m.key), &self.text[m.value.clone()]))
    }

    /// The value text of top-level member `key`, as sent.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.members().find(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

fn key_str<'a>(text: &'a str, k: &'a Key) -> &'a str {
    match k {
        Key::Plain(r) => &text[r.clone()],
        Key::Decoded(s) => s,
    }
}

/// The members a gateway sets itself; the client's are not forwarded.
const SET_HERE: [&str; 3] = ["model", "stream", "stream_options"];

/// The `/chat/completions` body for `source` made from the client's body by editing it
/// in place: the same request as [`crate::body::chat_body`] of the parsed request
/// (module docs). `None` where the edit is not one this path makes (a source that takes
/// the output cap only as `max_completion_tokens`); the caller then builds the body
/// from the parsed request.
pub fn chat_body_edited(wire: &WireBody, source: &SourceConfig, stream: bool) -> Option<Vec<u8>> {
    if source.max_completion_tokens {
        return None;
    }
    let extra = &source.extra_body;
    // Members that `EXTRA_BODY` or the stream's usage option change: the only ones read
    // into values, and written from them.
    let touched = |k: &str| {
        k != "messages"
            && k != "model"
            && k != "stream"
            && (extra.contains_key(k) || k == "stream_options")
    };
    let mut edited = Map::new();
    let mut out = Vec::with_capacity(wire.text.len() + 64);
    out.push(b'{');
    let mut first = true;
    let mut sep = |out: &mut Vec<u8>| {
        if !std::mem::take(&mut first) {
            out.push(b',');
        }
    };
    for (k, v) in wire.members() {
        // A top-level `null` is no value: the parsed path drops it (a field not given,
        // or a merge patch's removal).
        if v == "null" {
            continue;
        }
        if touched(k) {
            if k != "stream_options" || stream {
                edited.insert(k.to_owned(), serde_json::from_str(v).ok()?);
            }
            continue;
        }
        if SET_HERE.contains(&k) {
            continue;
        }
        sep(&mut out);
        // Writing a string into a `Vec` cannot fail.
        let _ = serde_json::to_writer(&mut out, k);
        out.push(b':');
        out.extend_from_slice(v.as_bytes());
    }
    merge_patch(&mut edited, extra);
    for k in ["model", "messages", "stream"] {
        edited.remove(k);
    }
    crate::body::stream_options(&mut edited, stream);
    for (k, v) in &edited {
        sep(&mut out);
        let _ = serde_json::to_writer(&mut out, k);
        out.push(b':');
        let _ = serde_json::to_writer(&mut out, v);
    }
    sep(&mut out);
    out.extend_from_slice(b"\"model\":");
    let _ = serde_json::to_writer(&mut out, &source.model);
    out.extend_from_slice(if stream {
        b",\"stream\":true}"
    } else {
        b",\"stream\":false}"
    });
    Some(out)
}

/// Whether two chat bodies are the same request as the byte path promises: equal JSON,
/// numbers compared by value (`1` and `1.0` are one number), and `null`s nested in the
/// objects of members other than `messages`, `tools` and `response_format` left out of
/// the comparison (the parsed path's merge drops them; the byte path keeps them as
/// sent). Used by the debug check of [`crate::body::chat_body_bytes`] and the tests.
pub fn same_chat_body(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let norm = |o: &Map<String, Value>| -> Map<String, Value> {
                o.iter()
                    .map(|(k, v)| {
                        let v = if matches!(k.as_str(), "messages" | "tools" | "response_format") {
                            v.clone()
                        } else {
                            without_nested_nulls(v)
                        };
                        (k.clone(), v)
                    })
                    .collect()
            };
            same_json(&Value::Object(norm(x)), &Value::Object(norm(y)))
        }
        _ => same_json(a, b),
    }
}

/// A value with the `null` members of its objects removed, recursively through objects
/// (what a JSON merge patch into an empty object leaves of it).
fn without_nested_nulls(v: &Value) -> Value {
    match v {
        Value::Object(o) => Value::Object(
            o.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nested_nulls(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// JSON equality with numbers compared by value.
fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            x == y || (x.as_f64().is_some() && x.as_f64() == y.as_f64())
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_json(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src() -> SourceConfig {
        SourceConfig::new("p", 0, "http://h/v1", "k", "up-model")
    }

    #[test]
    fn members_are_found_with_their_bytes() {
        let w = WireBody::scan(
            br#" { "model" : "m", "mod\u0065l":"n", "messages":[{"role":"user","content":"h\u00e9"}], "x": 1.50 } "#
                .to_vec(),
        )
        .unwrap();
        let m: Vec<_> = w.members().collect();
        assert_eq!(
            m,
            vec![
                ("model", "\"n\""),
                ("messages", r#"[{"role":"user","content":"h\u00e9"}]"#),
                ("x", "1.50"),
            ]
        );
        assert_eq!(w.get("x"), Some("1.50"));
        // Many members (the set's path): the last of each key, in its place.
        let many: Vec<String> = (0..40).map(|i| format!("\"k{}\":{i}", i % 20)).collect();
        let w = WireBody::scan(format!("{{{}}}", many.join(",")).into_bytes()).unwrap();
        let kept: Vec<_> = w.members().collect();
        assert_eq!(kept.len(), 20);
        assert_eq!(kept[0], ("k0", "20"));
        assert_eq!(kept[19], ("k19", "39"));
        assert!(WireBody::scan(b"[1]".to_vec()).is_err());
        assert!(WireBody::scan(b"{\"a\":1} x".to_vec()).is_err());
    }

    #[test]
    fn the_edit_keeps_the_client_bytes_and_sets_what_a_gateway_sets() {
        let body = br#"{"model":"scope","messages":[{"role":"user","content":"h\u00e9"}],"temperature":1,"user":null,"stream_options":{"include_usage":false},"big":18446744073709551616}"#;
        let w = WireBody::scan(body.to_vec()).unwrap();
        let plain = String::from_utf8(chat_body_edited(&w, &src(), false).unwrap()).unwrap();
        assert_eq!(
            plain,
            r#"{"messages":[{"role":"user","content":"h\u00e9"}],"temperature":1,"big":18446744073709551616,"model":"up-model","stream":false}"#
        );
        let streamed = String::from_utf8(chat_body_edited(&w, &src(), true).unwrap()).unwrap();
        assert_eq!(
            streamed,
            r#"{"messages":[{"role":"user","content":"h\u00e9"}],"temperature":1,"big":18446744073709551616,"stream_options":{"include_usage":true},"model":"up-model","stream":true}"#
        );
        let mut s = src();
        s.extra_body =
            serde_json::from_str(r#"{"temperature":null,"seed":7,"metadata":{"a":1,"b":null}}"#)
                .unwrap();
        let v: Value = serde_json::from_slice(&chat_body_edited(&w, &s, false).unwrap()).unwrap();
        assert!(v.get("temperature").is_none());
        assert_eq!(
            (&v["seed"], &v["metadata"]),
            (&Value::from(7), &serde_json::json!({"a": 1}))
        );
        s.max_completion_tokens = true;
        assert_eq!(chat_body_edited(&w, &s, false), None);
    }
}
