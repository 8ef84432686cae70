//! Server-sent events as the two dialects stream them: [`SseEvent`] (an `event:` line
//! naming the type and one compact-JSON `data:` line) and [`parse_sse`], a parser for
//! tests and conformance checks.

use serde_json::Value;

/// One server-sent event. Both dialects name the event after its type (`event:
/// response.output_text.delta`, `event: content_block_delta`) and carry a JSON object
/// whose `type` is that same name; the Anthropic SDK skips events without an `event:`
/// line, so every event written here has one.
#[derive(Debug, Clone, PartialEq)]
pub struct SseEvent {
    /// The event's type (the `event:` line). One line: never contains `\n` or `\r`.
    pub event: String,
    /// The event's data (the `data:` line), an object with `type` for every event the
    /// dialects emit.
    pub data: Value,
}

impl SseEvent {
    /// An event of this type with this data.
    pub fn new(event: impl Into<String>, data: Value) -> Self {
        SseEvent {
            event: event.into(),
            data,
        }
    }

    /// Appends `event: <type>\ndata: <compact json>\n\n` to `out`.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(self.event.as_bytes());
        out.extend_from_slice(b"\ndata: ");
        // Writing JSON into a Vec<u8> cannot fail: a `Value`'s map keys are strings and
        // the writer never errors, so the result is ignored without loss.
        let _ = serde_json::to_writer(&mut *out, &self.data);
        out.extend_from_slice(b"\n\n");
    }

    /// The event as bytes ([`SseEvent::write_to`] into a new buffer).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        self.write_to(&mut out);
        out
    }
}

/// Writes every event, in order, into one buffer.
pub fn write_all(events: &[SseEvent]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in events {
        e.write_to(&mut out);
    }
    out
}

/// Parses an SSE byte stream (the WHATWG rules: `\n`, `\r\n` or `\r` line ends, `:`
/// comments, several `data:` lines joined by `\n`, one optional space after the colon,
/// an event dispatched at a blank line, an unterminated last event discarded).
///
/// `event` is the `event:` line's value, or `""` when the block had none (so a
/// conformance check can tell a missing `event:` line). `data` is the data parsed as
/// JSON, or a JSON string holding the raw text when it is not JSON (`[DONE]`). Blocks
/// without data are skipped, as browsers and the SDKs do.
pub fn parse_sse(bytes: &[u8]) -> Vec<SseEvent> {
    let text = String::from_utf8_lossy(bytes);
    let mut out = Vec::new();
    let mut event = String::new();
    let mut data: Option<String> = None;
    for line in lines(&text) {
        if line.is_empty() {
            if let Some(d) = data.take() {
                let value = serde_json::from_str(&d).unwrap_or(Value::String(d));
                out.push(SseEvent {
                    event: std::mem::take(&mut event),
                    data: value,
                });
            }
            event.clear();
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = match line.find(':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(' ').unwrap_or(v))
            }
            None => (line, ""),
        };
        match field {
            "event" => event = value.to_string(),
            "data" => match data.as_mut() {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            },
            _ => {}
        }
    }
    out
}

/// The lines of `text`, split at `\r\n`, `\n` or `\r`; the text after the last line
/// end (an unterminated line) is not returned, so an unterminated event is never
/// dispatched.
fn lines(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\n' => {
                out.push(&text[start..i]);
                i += 1;
                start = i;
            }
            b'\r' => {
                out.push(&text[start..i]);
                i += if bytes.get(i + 1) == Some(&b'\n') {
                    2
                } else {
                    1
                };
                start = i;
            }
            _ => i += 1,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn writes_an_event_line_and_one_compact_data_line() {
        let e = SseEvent::new("ping", json!({"type": "ping"}));
        assert_eq!(e.to_bytes(), b"event: ping\ndata: {\"type\":\"ping\"}\n\n");
    }

    #[test]
    fn parses_the_whatwg_forms() {
        let raw =
            b": comment\r\nevent: a\r\ndata: {\"x\":1}\r\n\r\nevent:b\ndata:one\ndata: two\n\n\
data: [DONE]\n\nevent: lost\ndata: {}";
        let got = parse_sse(raw);
        assert_eq!(
            got,
            vec![
                SseEvent::new("a", json!({"x": 1})),
                SseEvent::new("b", json!("one\ntwo")),
                SseEvent::new("", json!("[DONE]")),
            ]
        );
    }

    #[test]
    fn a_block_without_data_is_skipped() {
        assert!(parse_sse(b"event: x\n\n\n").is_empty());
    }
}
