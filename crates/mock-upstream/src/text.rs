//! Deterministic content of the mock: generated words, the prompt-token estimate,
//! embedding vectors derived from the text, and the images of a vision request.

use base64::Engine as _;
use serde_json::Value;

use crate::record::ImageSeen;

const WORDS: &[&str] = &[
    "the", "gateway", "routes", "each", "request", "to", "a", "source", "that", "answers",
    "quickly", "while", "quota", "stays", "within", "limits", "and", "every", "token", "is",
    "counted", "once", "streams", "may", "stall", "but", "hedged", "legs", "cut", "tail",
    "latency", "down",
];

/// SplitMix64: a tiny deterministic mixer.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// FNV-1a's offset basis.
pub(crate) const FNV_OFFSET: u64 = 0xCBF2_9CE4_8422_2325;

/// FNV-1a of some bytes.
fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_from(FNV_OFFSET, bytes)
}

/// FNV-1a continued from state `h`.
pub(crate) fn fnv1a_from(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// The seed of a request's generated words: a hash of the text of its last `user`
/// message (string content, or its text parts). It depends on nothing else — not the
/// model, the mock instance, the request's sequence number, a trailing assistant
/// message or any sampling — so the same request gets the same words from any mock,
/// and a replay reproduces a delivered prefix exactly.
pub(crate) fn request_seed(body: &Value) -> u64 {
    // A Responses request's `input`: a string is one user message.
    if let Some(Value::String(s)) = body.get("input") {
        return mix(fnv1a(s.as_bytes()));
    }
    let last_user = body
        .get("messages")
        .or_else(|| body.get("input"))
        .and_then(Value::as_array)
        .and_then(|ms| {
            ms.iter()
                .rev()
                .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        });
    let text: String = match last_user.and_then(|m| m.get("content")) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    };
    mix(fnv1a(text.as_bytes()))
}

/// Content chunk `i` of generated answer `seed`: one word, with a leading space after
/// the first.
pub(crate) fn word(seed: u64, i: u32) -> String {
    let w = WORDS[(mix(seed.wrapping_mul(1_000_003).wrapping_add(u64::from(i)))
        % WORDS.len() as u64) as usize];
    if i == 0 {
        let mut c = w.chars();
        match c.next() {
            Some(f) => f.to_uppercase().chain(c).collect(),
            None => String::new(),
        }
    } else {
        format!(" {w}")
    }
}

/// Characters of text in a message content (a string, or the text parts of an array).
fn content_chars(content: &Value) -> usize {
    match content {
        Value::String(s) => s.chars().count(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(|s| s.chars().count())
            .sum(),
        _ => 0,
    }
}

/// The prompt-token estimate: ⌈characters / 4⌉ of every message's text (at least 1),
/// plus 85 per image (OpenAI's low-detail image cost).
pub(crate) fn prompt_tokens(body: &Value, images: usize) -> u64 {
    if let Some(Value::String(s)) = body.get("input") {
        return (s.chars().count() as u64).div_ceil(4).max(1) + 85 * images as u64;
    }
    let chars: usize = body
        .get("messages")
        .or_else(|| body.get("input"))
        .and_then(Value::as_array)
        .map(|ms| {
            ms.iter()
                .filter_map(|m| m.get("content"))
                .map(content_chars)
                .sum()
        })
        .unwrap_or(0);
    (chars as u64).div_ceil(4).max(1) + 85 * images as u64
}

/// Tokens of an embedding input: ⌈characters / 4⌉, at least 1.
pub(crate) fn text_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(4).max(1)
}

/// A deterministic unit vector of `dim` components derived from the text (FNV-1a then
/// SplitMix64): equal texts give equal vectors.
pub fn embedding_of(text: &str, dim: usize) -> Vec<f32> {
    let h = fnv1a(text.as_bytes());
    let mut v: Vec<f32> = (0..dim)
        .map(|i| {
            let r = mix(h ^ (i as u64).wrapping_mul(0xA24B_AED4_963E_E407));
            ((r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        for x in &mut v {
            *x /= norm;
        }
    }
    v
}

/// The embedding inputs of a body: a string or an array of strings.
pub(crate) fn embedding_inputs(body: &Value) -> Option<Vec<String>> {
    // Token ids stand for the text `tokens:1,2,3` (a deterministic vector per array).
    let tokens = |a: &[Value]| -> Option<String> {
        let ids: Option<Vec<String>> = a
            .iter()
            .map(|t| t.as_u64().map(|n| n.to_string()))
            .collect();
        ids.filter(|i| !i.is_empty())
            .map(|i| format!("tokens:{}", i.join(",")))
    };
    match body.get("input")? {
        Value::String(s) => Some(vec![s.clone()]),
        // One input as token ids, as OpenAI accepts it.
        Value::Array(a) if a.first().is_some_and(Value::is_number) => Some(vec![tokens(a)?]),
        Value::Array(a) => a
            .iter()
            .map(|v| match v {
                Value::String(s) => Some(s.clone()),
                Value::Array(t) => tokens(t),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

/// Every `image_url` part of the request's messages.
pub(crate) fn images_of(body: &Value) -> Vec<ImageSeen> {
    let mut out = Vec::new();
    let Some(msgs) = body.get("messages").and_then(Value::as_array) else {
        return out;
    };
    for m in msgs {
        let Some(parts) = m.get("content").and_then(Value::as_array) else {
            continue;
        };
        for p in parts {
            if p.get("type").and_then(Value::as_str) != Some("image_url") {
                continue;
            }
            let url = p
                .get("image_url")
                .and_then(|u| u.get("url").or(Some(u)))
                .and_then(Value::as_str)
                .unwrap_or("");
            out.push(
                match url.strip_prefix("data:").and_then(|r| r.split_once(',')) {
                    Some((meta, data)) => {
                        let mime = meta.split(';').next().unwrap_or("").to_string();
                        let bytes = if meta.ends_with(";base64") {
                            base64::engine::general_purpose::STANDARD
                                .decode(data.trim())
                                .map(|b| b.len())
                                .unwrap_or(0)
                        } else {
                            data.len()
                        };
                        ImageSeen { mime, bytes }
                    }
                    None => ImageSeen {
                        mime: "url".into(),
                        bytes: 0,
                    },
                },
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn words_are_deterministic() {
        assert_eq!(word(7, 0), word(7, 0));
        assert!(word(7, 1).starts_with(' '));
        assert!(word(7, 0).chars().next().unwrap().is_uppercase());
    }

    #[test]
    fn the_seed_is_the_last_user_message() {
        let a = json!({"model": "x", "messages": [{"role": "user", "content": "q"}]});
        let b = json!({"model": "y", "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": "partial answer", "prefix": true}]});
        assert_eq!(request_seed(&a), request_seed(&b));
        let c = json!({"messages": [{"role": "user", "content": "q2"}]});
        assert_ne!(request_seed(&a), request_seed(&c));
        assert_eq!(
            request_seed(&json!({})),
            request_seed(&json!({"messages": []}))
        );
    }

    #[test]
    fn prompt_token_estimate() {
        let b = json!({"messages":[{"role":"user","content":"12345678"},{"role":"user","content":[{"type":"text","text":"abcd"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]});
        assert_eq!(prompt_tokens(&b, 1), 3 + 85);
        assert_eq!(prompt_tokens(&json!({}), 0), 1);
        let imgs = images_of(&b);
        assert_eq!(
            imgs,
            vec![ImageSeen {
                mime: "image/png".into(),
                bytes: 3
            }]
        );
    }

    #[test]
    fn embeddings_are_unit_and_deterministic() {
        let a = embedding_of("hello", 16);
        assert_eq!(a, embedding_of("hello", 16));
        assert_ne!(a, embedding_of("hellp", 16));
        let n: f32 = a.iter().map(|x| x * x).sum();
        assert!((n - 1.0).abs() < 1e-4);
        assert_eq!(
            embedding_inputs(&json!({"input":"x"})),
            Some(vec!["x".to_string()])
        );
        // Token arrays (one, or several) stand for a text of their ids.
        assert_eq!(
            embedding_inputs(&json!({"input":[1, 2]})),
            Some(vec!["tokens:1,2".to_string()])
        );
        assert_eq!(
            embedding_inputs(&json!({"input":[[1], "x"]})),
            Some(vec!["tokens:1".to_string(), "x".to_string()])
        );
        assert_eq!(embedding_inputs(&json!({"input":[true]})), None);
    }
}
