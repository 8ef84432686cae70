//! An incremental Server-Sent Events parser (HTML Living Standard, "event stream
//! interpretation") that gives the same events for any split of the byte stream.
//!
//! - Lines end with `\r\n`, `\n` or `\r`; a `\r\n` split across two reads is one line end.
//! - Bytes are kept until their line is complete, so a UTF-8 sequence split across reads
//!   is decoded whole (invalid UTF-8 becomes U+FFFD, as the standard says).
//! - `data:` lines accumulate (joined by `\n`); an empty line dispatches the event; lines
//!   starting with `:` are comments (keepalives) and are only counted; `event:`, `id:`
//!   and `retry:` are kept; other fields are ignored. One leading space after the colon
//!   is removed. A leading byte-order mark on the first line is dropped.
//! - Buffers are bounded: a line longer than `max_line_bytes` or an event whose data
//!   exceeds `max_event_bytes` is an error, never an unbounded allocation.
//!
//! [`SseParser::finish`] deviates from the standard on purpose: at the end of the
//! stream it returns the pending event (complete `data:` lines not yet followed by an
//! empty line, plus an unterminated last line) instead of discarding it, flagged as
//! unterminated, so the caller can decide (the transport accepts a frame that parses
//! and treats one that does not as a stream cut mid-frame).

use std::fmt;

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field, if the event had one.
    pub event: Option<String>,
    /// The data: every `data:` line of the event, joined by `\n`.
    pub data: String,
    /// The last event id seen so far (`id:` persists across events, per the standard).
    pub id: Option<String>,
}

/// The parser refused to buffer more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// A single line exceeded the bound.
    #[error("an SSE line exceeds {limit} bytes")]
    LineTooLong {
        /// The bound in bytes.
        limit: usize,
    },
    /// The data of one event exceeded the bound.
    #[error("an SSE event exceeds {limit} bytes of data")]
    EventTooLarge {
        /// The bound in bytes.
        limit: usize,
    },
}

/// The default bound of one line and of one event's data (16 MiB).
pub const DEFAULT_MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// The line buffer's capacity kept between lines (larger buffers are freed).
const KEEP_LINE_CAPACITY: usize = 64 * 1024;

/// The incremental parser. Feed it bytes as they arrive; it appends complete events.
pub struct SseParser {
    line: Vec<u8>,
    data: String,
    event: Option<String>,
    last_id: Option<String>,
    retry_ms: Option<u64>,
    pending_cr: bool,
    first_line: bool,
    max_line_bytes: usize,
    max_event_bytes: usize,
    comments: u64,
    events: u64,
}

impl fmt::Debug for SseParser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SseParser")
            .field("buffered_line_bytes", &self.line.len())
            .field("buffered_data_bytes", &self.data.len())
            .field("events", &self.events)
            .field("comments", &self.comments)
            .finish()
    }
}

impl Default for SseParser {
    fn default() -> Self {
        SseParser::new()
    }
}

impl SseParser {
    /// A parser with the default bounds.
    pub fn new() -> Self {
        SseParser::with_limits(DEFAULT_MAX_EVENT_BYTES, DEFAULT_MAX_EVENT_BYTES)
    }

    /// A parser with explicit bounds (each at least 1 byte).
    pub fn with_limits(max_line_bytes: usize, max_event_bytes: usize) -> Self {
        SseParser {
            line: Vec::new(),
            data: String::new(),
            event: None,
            last_id: None,
            retry_ms: None,
            pending_cr: false,
            first_line: true,
            max_line_bytes: max_line_bytes.max(1),
            max_event_bytes: max_event_bytes.max(1),
            comments: 0,
            events: 0,
        }
    }

    /// Comment lines seen so far (`: keepalive` and the like).
    pub fn comments(&self) -> u64 {
        self.comments
    }

    /// Events dispatched so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// The last `retry:` value, in milliseconds.
    pub fn retry_ms(&self) -> Option<u64> {
        self.retry_ms
    }

    /// Bytes held for an incomplete line or event (bounded by the limits).
    pub fn buffered_bytes(&self) -> usize {
        self.line.len() + self.data.len()
    }

    /// Parses `chunk` and appends every event it completes to `out`.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        let mut i = 0;
        while i < chunk.len() {
            if self.pending_cr {
                self.pending_cr = false;
                if chunk[i] == b'\n' {
                    i += 1;
                    continue;
                }
            }
            let rest = &chunk[i..];
            match rest.iter().position(|&b| b == b'\n' || b == b'\r') {
                None => {
                    if self.line.len() + rest.len() > self.max_line_bytes {
                        return Err(SseError::LineTooLong {
                            limit: self.max_line_bytes,
                        });
                    }
                    self.line.extend_from_slice(rest);
                    break;
                }
                Some(p) => {
                    let piece = &rest[..p];
                    if self.line.len() + piece.len() > self.max_line_bytes {
                        return Err(SseError::LineTooLong {
                            limit: self.max_line_bytes,
                        });
                    }
                    if self.line.is_empty() {
                        self.process_line(piece, out)?;
                    } else {
                        let mut buf = std::mem::take(&mut self.line);
                        buf.extend_from_slice(piece);
                        let r = self.process_line(&buf, out);
                        buf.clear();
                        // A long line's buffer is not kept for the rest of the stream.
                        if buf.capacity() > KEEP_LINE_CAPACITY {
                            buf = Vec::new();
                        }
                        self.line = buf;
                        r?;
                    }
                    if rest[p] == b'\r' {
                        self.pending_cr = true;
                    }
                    i += p + 1;
                }
            }
        }
        Ok(())
    }

    /// Ends the stream: returns the pending, unterminated event if there is one (see the
    /// module documentation), and resets the parser.
    pub fn finish(&mut self) -> Result<Option<SseEvent>, SseError> {
        let mut scratch = Vec::new();
        if !self.line.is_empty() {
            let buf = std::mem::take(&mut self.line);
            self.process_line(&buf, &mut scratch)?;
        }
        self.pending_cr = false;
        if let Some(ev) = scratch.pop() {
            return Ok(Some(ev));
        }
        if self.data.is_empty() {
            self.event = None;
            return Ok(None);
        }
        Ok(Some(self.take_event()))
    }

    fn take_event(&mut self) -> SseEvent {
        let mut data = std::mem::take(&mut self.data);
        if data.ends_with('\n') {
            data.pop();
        }
        self.events += 1;
        SseEvent {
            event: self.event.take(),
            data,
            id: self.last_id.clone(),
        }
    }

    fn process_line(&mut self, mut line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if self.first_line {
            self.first_line = false;
            if let Some(rest) = line.strip_prefix(BOM) {
                line = rest;
            }
        }
        if line.is_empty() {
            if self.data.is_empty() {
                self.event = None;
            } else {
                let ev = self.take_event();
                out.push(ev);
            }
            return Ok(());
        }
        if line[0] == b':' {
            self.comments += 1;
            return Ok(());
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(c) => {
                let v = &line[c + 1..];
                (&line[..c], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                // The bound holds for what is stored: invalid UTF-8 decodes to U+FFFD
                // (3 bytes per byte), so check after decoding.
                let decoded = String::from_utf8_lossy(value);
                if self.data.len() + decoded.len() + 1 > self.max_event_bytes {
                    return Err(SseError::EventTooLarge {
                        limit: self.max_event_bytes,
                    });
                }
                self.data.push_str(&decoded);
                self.data.push('\n');
            }
            b"event" => self.event = Some(String::from_utf8_lossy(value).into_owned()),
            b"id" if !value.contains(&0) => {
                self.last_id = Some(String::from_utf8_lossy(value).into_owned());
            }
            b"retry" if !value.is_empty() && value.iter().all(u8::is_ascii_digit) => {
                self.retry_ms = std::str::from_utf8(value).ok().and_then(|s| s.parse().ok());
            }
            _ => {}
        }
        Ok(())
    }
}

/// Parses a whole byte string at once (tests, tools): every event, then the pending one.
pub fn parse_all(bytes: &[u8]) -> Result<Vec<SseEvent>, SseError> {
    let mut p = SseParser::new();
    let mut out = Vec::new();
    p.feed(bytes, &mut out)?;
    out.extend(p.finish()?);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data(events: &[SseEvent]) -> Vec<&str> {
        events.iter().map(|e| e.data.as_str()).collect()
    }

    #[test]
    fn basic_events_and_done() {
        let ev = parse_all(b"data: {\"a\":1}\n\ndata: [DONE]\n\n").unwrap();
        assert_eq!(data(&ev), ["{\"a\":1}", "[DONE]"]);
    }

    #[test]
    fn crlf_cr_and_lf_line_ends() {
        let ev = parse_all(b"data: a\r\n\r\ndata: b\r\rdata: c\n\n").unwrap();
        assert_eq!(data(&ev), ["a", "b", "c"]);
    }

    #[test]
    fn multi_line_data_joins_with_newline() {
        let ev = parse_all(b"data: line1\ndata: line2\ndata:\n\n").unwrap();
        assert_eq!(data(&ev), ["line1\nline2\n"]);
    }

    #[test]
    fn comments_fields_and_ids() {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        p.feed(
            b": keepalive\n\n:\nevent: error\nid: 7\nretry: 1500\nfoo: bar\ndata:x\n\n",
            &mut out,
        )
        .unwrap();
        assert_eq!(p.comments(), 2);
        assert_eq!(p.retry_ms(), Some(1500));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].event.as_deref(), Some("error"));
        assert_eq!(out[0].id.as_deref(), Some("7"));
        assert_eq!(out[0].data, "x", "no space after the colon is fine");
    }

    #[test]
    fn empty_data_line_dispatches_empty_event_but_blank_lines_alone_do_not() {
        let ev = parse_all(b"\n\n\ndata:\n\nevent: x\n\n").unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].data, "");
        assert_eq!(ev[0].event, None);
    }

    #[test]
    fn only_one_leading_space_is_removed() {
        let ev = parse_all(b"data:  two\n\n").unwrap();
        assert_eq!(ev[0].data, " two");
    }

    #[test]
    fn bom_is_stripped_even_when_split() {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        p.feed(b"\xEF", &mut out).unwrap();
        p.feed(b"\xBB\xBFdata: a\n\n", &mut out).unwrap();
        assert_eq!(data(&out), ["a"]);
    }

    #[test]
    fn utf8_split_across_reads_is_decoded_whole() {
        let text = "data: ⚠️ “quoted” — ✅\n\n".as_bytes();
        for cut in 0..text.len() {
            let mut p = SseParser::new();
            let mut out = Vec::new();
            p.feed(&text[..cut], &mut out).unwrap();
            p.feed(&text[cut..], &mut out).unwrap();
            assert_eq!(data(&out), ["⚠️ “quoted” — ✅"], "cut at {cut}");
        }
    }

    #[test]
    fn crlf_split_across_reads_is_one_line_end() {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        p.feed(b"data: a\r", &mut out).unwrap();
        p.feed(b"\n", &mut out).unwrap();
        p.feed(b"\r", &mut out).unwrap();
        p.feed(b"\ndata: b\r\n\r\n", &mut out).unwrap();
        assert_eq!(data(&out), ["a", "b"]);
    }

    #[test]
    fn finish_returns_unterminated_event() {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        p.feed(b"data: {\"x\":1}", &mut out).unwrap();
        assert!(out.is_empty());
        let last = p.finish().unwrap().unwrap();
        assert_eq!(last.data, "{\"x\":1}");
        let mut p = SseParser::new();
        p.feed(b"data: a\ndata: b\n", &mut out).unwrap();
        assert_eq!(p.finish().unwrap().unwrap().data, "a\nb");
        assert_eq!(p.finish().unwrap(), None);
    }

    #[test]
    fn bounds_are_enforced() {
        let mut p = SseParser::with_limits(16, 1024);
        let mut out = Vec::new();
        assert_eq!(
            p.feed(&[b'a'; 17], &mut out),
            Err(SseError::LineTooLong { limit: 16 })
        );
        let mut p = SseParser::with_limits(16, 1024);
        p.feed(b"data: 0123", &mut out).unwrap();
        assert!(p.feed(b"456789abcdef\n", &mut out).is_err());
        let mut p = SseParser::with_limits(1024, 10);
        assert_eq!(
            p.feed(b"data: 12345\ndata: 6789\n", &mut out),
            Err(SseError::EventTooLarge { limit: 10 })
        );
        // Keepalives never grow a buffer.
        let mut p = SseParser::with_limits(32, 32);
        for _ in 0..10_000 {
            p.feed(b": keepalive\n\n", &mut out).unwrap();
        }
        assert_eq!(p.buffered_bytes(), 0);
    }

    fn chunked(bytes: &[u8], cuts: &[usize]) -> Vec<SseEvent> {
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        cuts.sort_unstable();
        let mut p = SseParser::new();
        let mut out = Vec::new();
        let mut prev = 0;
        for c in cuts {
            p.feed(&bytes[prev..c], &mut out).unwrap();
            prev = c;
        }
        p.feed(&bytes[prev..], &mut out).unwrap();
        out.extend(p.finish().unwrap());
        out
    }

    proptest! {
        #[test]
        fn any_chunking_gives_the_same_events(
            lines in proptest::collection::vec("[a-z{}:\" é✅]{0,12}", 1..12),
            crlf in any::<bool>(),
            comments in any::<bool>(),
            cuts in proptest::collection::vec(0usize..4096, 0..24),
        ) {
            let nl = if crlf { "\r\n" } else { "\n" };
            let mut s = String::new();
            for l in &lines {
                if comments { s.push_str(": ping"); s.push_str(nl); }
                s.push_str("data: "); s.push_str(l); s.push_str(nl); s.push_str(nl);
            }
            let whole = parse_all(s.as_bytes()).unwrap();
            prop_assert_eq!(whole.len(), lines.len());
            prop_assert_eq!(chunked(s.as_bytes(), &cuts), whole);
        }
    }
}
