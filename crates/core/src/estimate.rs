//! The prompt estimate (SPEC §24.3): what a request will cost in input tokens, before any
//! provider counts it. One borrowed pass over the request — its chat form, or the body a
//! client of a native API sent — counting every part of what agents send: text, tool
//! definitions, tool calls' names and arguments, tool results, reasoning echoed back, and
//! images by the providers' published formulas (never their base64 text). The same
//! estimate drives client keys' TPM and budgets, context routing, `count_tokens` and
//! `message_start`.
//!
//! **Text** is counted by a calibrated rule over character classes
//! ([`text_tokens`]): per 1000 characters, ASCII letters and digits weigh 210, ASCII
//! punctuation 780, ASCII whitespace 140, CJK characters 880, other characters 1000.
//! The weights were fitted to OpenAI's o200k tokenizer over a corpus of English, Chinese,
//! code and tool-call JSON; the benchmark `cargo xtask bench estimate` measures the error
//! per class (docs/BENCHMARKS.md).
//!
//! **Images**: OpenAI's tile formula (`detail: low` = 85; otherwise fit in 2048 × 2048,
//! the short side to 768, 85 + 170 per 512-pixel tile) and Anthropic's (the long side at
//! most 1568, width × height / 750), the larger of the two — the request may go to either
//! provider. The dimensions come from the image's own header (PNG, GIF, JPEG, WebP) when
//! it is inline; an image by URL, or one whose header cannot be read, counts
//! [`UNKNOWN_IMAGE_TOKENS`], the most either formula gives.
//!
//! **Documents** (a PDF inline): [`PDF_TOKENS_PER_PAGE`] per 50 KB, at least one page.

use serde_json::{Map, Value};

use crate::request::ChatRequest;

/// An image whose size cannot be known: the most either provider's formula gives
/// (Anthropic's cap of about 1.15 megapixels / 750).
pub const UNKNOWN_IMAGE_TOKENS: u64 = 1600;

/// A PDF page as the providers bill it (its text and its image), roughly.
pub const PDF_TOKENS_PER_PAGE: u64 = 3000;

/// Bytes of a PDF counted as one page.
const PDF_BYTES_PER_PAGE: u64 = 50_000;

/// Weights per 1000 characters: ASCII alphanumeric, punctuation, whitespace, CJK, other.
const WEIGHTS: [u64; 5] = [210, 780, 140, 880, 1000];

/// Framing of a message (its role and separators).
const MESSAGE_FRAMING: u64 = 4;

/// Framing of a request: the reply's priming (OpenAI documents 3 tokens per request;
/// Anthropic's count of a one-word message is of the same size). A short prompt's
/// estimate is mostly framing: without it a client key's reservation for a one-word
/// call is below what it is billed (found by the day's-end test under load).
pub const REQUEST_FRAMING: u64 = 3;

/// The estimated tokens of `text` (see the module doc); at least 1 for non-empty text.
pub fn text_tokens(text: &str) -> u64 {
    let mut milli = 0u64;
    for ch in text.chars() {
        let class = if ch.is_ascii_alphanumeric() {
            0
        } else if ch.is_ascii_whitespace() {
            2
        } else if ch.is_ascii() {
            1
        } else if is_cjk(ch) {
            3
        } else {
            4
        };
        milli += WEIGHTS[class];
    }
    milli.div_ceil(1000)
}

fn is_cjk(ch: char) -> bool {
    matches!(ch,
        '\u{3000}'..='\u{303f}' // CJK punctuation
        | '\u{3040}'..='\u{30ff}' // kana
        | '\u{3400}'..='\u{4dbf}'
        | '\u{4e00}'..='\u{9fff}'
        | '\u{ac00}'..='\u{d7af}' // hangul
        | '\u{f900}'..='\u{faff}'
        | '\u{ff00}'..='\u{ffef}') // full-width forms
}

/// The estimated prompt tokens of a request: its native body when a client of a native
/// API sent one (what the source receives), else its chat form, with
/// [`REQUEST_FRAMING`]. At least [`REQUEST_FRAMING`].
pub fn request_tokens(req: &ChatRequest) -> u64 {
    if let Some(n) = &req.native {
        return REQUEST_FRAMING + body_tokens(&n.body);
    }
    let mut n = REQUEST_FRAMING;
    for m in &req.messages {
        n += MESSAGE_FRAMING;
        if let Some(c) = &m.content {
            n += value_tokens(c);
        }
        // Tool calls, a tool result's id, reasoning echoed back, a name.
        n += map_tokens(&m.extra);
    }
    if let Some(t) = &req.tools {
        n += t.iter().map(value_tokens).sum::<u64>();
    }
    n
}

/// The prompt-bearing fields of a native body (Messages: `system`, `messages`,
/// `tools`; Responses: `instructions`, `input`, `tools`).
fn body_tokens(body: &Map<String, Value>) -> u64 {
    let mut n = 0;
    for key in ["system", "instructions", "tools"] {
        if let Some(v) = body.get(key) {
            n += value_tokens(v);
        }
    }
    for key in ["messages", "input"] {
        match body.get(key) {
            Some(Value::Array(items)) => {
                n += items
                    .iter()
                    .map(|m| MESSAGE_FRAMING + value_tokens(m))
                    .sum::<u64>();
            }
            Some(v) => n += MESSAGE_FRAMING + value_tokens(v),
            None => {}
        }
    }
    n
}

fn map_tokens(m: &Map<String, Value>) -> u64 {
    m.iter().map(|(k, v)| field_tokens(k, v)).sum()
}

/// A field: its name and its value, plus [`FIELD_FRAMING`] for the structure around them
/// (quotes, colon, comma) — except fields that are not text to a model (an opaque
/// signature).
fn field_tokens(key: &str, v: &Value) -> u64 {
    match key {
        // A thinking block's signature is verified, not read.
        "signature" => 1,
        _ => text_tokens(key) + FIELD_FRAMING + value_tokens(v),
    }
}

/// Tokens of a JSON field's structure (calibrated with the text weights).
const FIELD_FRAMING: u64 = 2;

/// The estimated tokens of a JSON value as a model reads it (see the module doc).
pub fn value_tokens(v: &Value) -> u64 {
    match v {
        Value::String(s) => string_tokens(s),
        Value::Array(items) => items.iter().map(value_tokens).sum::<u64>() + 1,
        Value::Object(m) => match media_tokens(m) {
            Some(n) => n,
            None => map_tokens(m) + 1,
        },
        Value::Null | Value::Bool(_) | Value::Number(_) => 1,
    }
}

/// A string: text, unless it is an inline image or document (a `data:` URL).
fn string_tokens(s: &str) -> u64 {
    match s.strip_prefix("data:") {
        Some(rest) => data_url_tokens(rest, None),
        None => text_tokens(s),
    }
}

/// The tokens of a data URL's `media;base64,DATA` part.
fn data_url_tokens(rest: &str, detail: Option<&str>) -> u64 {
    let (media, data) = rest.split_once(',').unwrap_or(("", rest));
    let media = media.split(';').next().unwrap_or("");
    media_data_tokens(media, data, detail)
}

fn media_data_tokens(media: &str, b64: &str, detail: Option<&str>) -> u64 {
    if media.starts_with("image/") {
        image_tokens(image_size(b64), detail)
    } else if media == "application/pdf" {
        let bytes = b64.len() as u64 / 4 * 3;
        bytes.div_ceil(PDF_BYTES_PER_PAGE).max(1) * PDF_TOKENS_PER_PAGE
    } else {
        // Plain text (or another document) inline: its decoded length as text.
        (b64.len() as u64 / 4 * 3).div_ceil(4)
    }
}

/// An image or document part of any API, by its shape:
/// - chat: `{"type": "image_url", "image_url": {"url", "detail"}}`;
/// - Responses: `{"type": "input_image", "image_url", "detail"}`,
///   `{"type": "input_file", "file_data"}`;
/// - Messages: `{"type": "image" | "document", "source": {"type": "base64",
///   "media_type", "data"} | {"type": "url", "url"}}`.
fn media_tokens(m: &Map<String, Value>) -> Option<u64> {
    let kind = m.get("type")?.as_str()?;
    fn detail(o: &Map<String, Value>) -> Option<&str> {
        o.get("detail").and_then(Value::as_str)
    }
    let by_url = |url: &str, detail: Option<&str>| match url.strip_prefix("data:") {
        Some(rest) => data_url_tokens(rest, detail),
        None => image_tokens(None, detail),
    };
    match kind {
        "image_url" => {
            let (url, d) = match m.get("image_url")? {
                Value::String(u) => (u.as_str(), detail(m)),
                Value::Object(o) => (o.get("url")?.as_str()?, detail(o).or(detail(m))),
                _ => return None,
            };
            Some(by_url(url, d))
        }
        "input_image" => Some(match m.get("image_url").and_then(Value::as_str) {
            Some(url) => by_url(url, detail(m)),
            None => image_tokens(None, detail(m)),
        }),
        "input_file" => {
            let data = m.get("file_data").and_then(Value::as_str)?;
            Some(match data.strip_prefix("data:") {
                Some(rest) => data_url_tokens(rest, None),
                None => media_data_tokens("application/pdf", data, None),
            })
        }
        "image" | "document" => {
            let src = m.get("source")?.as_object()?;
            Some(match src.get("type").and_then(Value::as_str) {
                Some("base64") => media_data_tokens(
                    src.get("media_type")
                        .and_then(Value::as_str)
                        .unwrap_or(if kind == "image" {
                            "image/png"
                        } else {
                            "application/pdf"
                        }),
                    src.get("data").and_then(Value::as_str).unwrap_or(""),
                    None,
                ),
                Some("text") => value_tokens(src.get("data").unwrap_or(&Value::Null)),
                _ if kind == "image" => image_tokens(None, None),
                _ => PDF_TOKENS_PER_PAGE,
            })
        }
        _ => None,
    }
}

/// An image's tokens: the larger of OpenAI's and Anthropic's formulas for its size
/// (`None`: unknown, [`UNKNOWN_IMAGE_TOKENS`]); `detail: low` is OpenAI's 85.
pub fn image_tokens(size: Option<(u64, u64)>, detail: Option<&str>) -> u64 {
    if detail == Some("low") {
        return 85;
    }
    let Some((w, h)) = size.filter(|&(w, h)| w > 0 && h > 0) else {
        return UNKNOWN_IMAGE_TOKENS;
    };
    openai_image_tokens(w, h).max(anthropic_image_tokens(w, h))
}

fn scale_to(w: u64, h: u64, long: u64) -> (u64, u64) {
    let m = w.max(h);
    if m <= long {
        (w, h)
    } else {
        ((w * long / m).max(1), (h * long / m).max(1))
    }
}

fn openai_image_tokens(w: u64, h: u64) -> u64 {
    let (w, h) = scale_to(w, h, 2048);
    let short = w.min(h);
    let (w, h) = if short > 768 {
        ((w * 768 / short).max(1), (h * 768 / short).max(1))
    } else {
        (w, h)
    };
    85 + 170 * w.div_ceil(512) * h.div_ceil(512)
}

fn anthropic_image_tokens(w: u64, h: u64) -> u64 {
    let (w, h) = scale_to(w, h, 1568);
    (w * h).div_ceil(750).min(UNKNOWN_IMAGE_TOKENS)
}

/// Bytes of an image read to find its size (a JPEG's frame header can follow its
/// metadata).
const HEADER_BYTES: usize = 64 * 1024;

/// The (width, height) an inline image's header says (PNG, GIF, JPEG, WebP).
pub fn image_size(b64: &str) -> Option<(u64, u64)> {
    let bytes = decode_prefix(b64, HEADER_BYTES);
    let b = bytes.as_slice();
    let be16 = |i: usize| Some(u64::from(u16::from_be_bytes([*b.get(i)?, *b.get(i + 1)?])));
    let le16 = |i: usize| Some(u64::from(u16::from_le_bytes([*b.get(i)?, *b.get(i + 1)?])));
    let be32 = |i: usize| {
        Some(u64::from(u32::from_be_bytes(
            b.get(i..i + 4)?.try_into().ok()?,
        )))
    };
    if b.starts_with(b"\x89PNG\r\n\x1a\n") {
        return Some((be32(16)?, be32(20)?));
    }
    if b.starts_with(b"GIF8") {
        return Some((le16(6)?, le16(8)?));
    }
    if b.starts_with(b"RIFF") && b.get(8..12) == Some(b"WEBP") {
        let le24 = |i: usize| {
            Some(
                u64::from(*b.get(i)?)
                    | u64::from(*b.get(i + 1)?) << 8
                    | u64::from(*b.get(i + 2)?) << 16,
            )
        };
        return match b.get(12..16)? {
            b"VP8X" => Some((le24(24)? + 1, le24(27)? + 1)),
            b"VP8 " => Some((le16(26)? & 0x3fff, le16(28)? & 0x3fff)),
            b"VP8L" => {
                let v = u64::from(u32::from_le_bytes(b.get(21..25)?.try_into().ok()?));
                Some(((v & 0x3fff) + 1, ((v >> 14) & 0x3fff) + 1))
            }
            _ => None,
        };
    }
    if b.starts_with(&[0xff, 0xd8]) {
        // Markers until a start-of-frame (SOF0–SOF15 but DHT, JPG, DAC).
        let mut i = 2;
        while i + 9 < b.len() {
            if b[i] != 0xff {
                return None;
            }
            let marker = b[i + 1];
            let len = usize::from(u16::from_be_bytes([b[i + 2], b[i + 3]]));
            if (0xc0..=0xcf).contains(&marker) && !matches!(marker, 0xc4 | 0xc8 | 0xcc) {
                return Some((be16(i + 7)?, be16(i + 5)?));
            }
            i += 2 + len;
        }
    }
    None
}

/// The first `max` bytes of base64 text (standard or URL-safe alphabet; whitespace and
/// padding skipped; decoding stops at the first other character).
fn decode_prefix(b64: &str, max: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(max.min(b64.len() / 4 * 3));
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in b64.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' | b'\n' | b'\r' | b' ' => continue,
            _ => break,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
            if out.len() >= max {
                break;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
