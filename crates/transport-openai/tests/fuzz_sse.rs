//! Fuzzing the SSE parser and the stream aggregator (issue 10): arbitrary bytes cut at
//! arbitrary points, and well-formed provider-like streams with random line endings,
//! comments, multi-line `data:` and UTF-8 split anywhere. No input may panic, buffers
//! stay within their bounds, every split gives the same events as one whole read, and
//! well-formed streams aggregate to exactly what was sent.
//!
//! Case counts: moderate by default; `POLYGW_FUZZ_CASES=N` runs N cases per property
//! (e.g. `POLYGW_FUZZ_CASES=200000`), see docs/CHAOS.md.

use polygw_transport_openai::aggregate::{
    choice0, error_body, frame_usage, in_band_error, StreamAggregator,
};
use polygw_transport_openai::sse::{parse_all, SseError, SseEvent, SseParser};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// Cases per property: `POLYGW_FUZZ_CASES` when set, else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("POLYGW_FUZZ_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|n: &u32| *n > 0)
        .unwrap_or(default)
}

fn config(default: u32) -> ProptestConfig {
    ProptestConfig {
        cases: cases(default),
        max_shrink_iters: 2_000,
        // Failures print their minimal input; nothing is written into the source tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Cuts `bytes` at the given (sorted, deduplicated, in-range) offsets.
fn pieces<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut offs: Vec<usize> = cuts
        .iter()
        .map(|c| {
            if bytes.is_empty() {
                0
            } else {
                c % (bytes.len() + 1)
            }
        })
        .collect();
    offs.sort_unstable();
    offs.dedup();
    let mut out = Vec::new();
    let mut at = 0;
    for o in offs {
        out.push(&bytes[at..o]);
        at = o;
    }
    out.push(&bytes[at..]);
    out
}

/// What a parser produced: the events up to the first error, the error, and the
/// pending event at the end (when no error happened).
#[derive(Debug, PartialEq)]
struct Parsed {
    events: Vec<SseEvent>,
    error: Option<SseError>,
    tail: Option<SseEvent>,
}

/// The most bytes of data one event may hold under the bound `max_event`.
fn data_bound(max_event: usize) -> usize {
    max_event
}

/// Feeds the pieces one by one, checking the buffer bound after every feed.
fn feed_pieces(parts: &[&[u8]], max_line: usize, max_event: usize) -> Parsed {
    let mut p = SseParser::with_limits(max_line, max_event);
    let mut events = Vec::new();
    for part in parts {
        let r = p.feed(part, &mut events);
        assert!(
            p.buffered_bytes() <= max_line + data_bound(max_event),
            "buffered {} > {} + bound of {}",
            p.buffered_bytes(),
            max_line,
            max_event
        );
        if let Err(e) = r {
            return Parsed {
                events,
                error: Some(e),
                tail: None,
            };
        }
    }
    match p.finish() {
        Ok(tail) => Parsed {
            events,
            error: None,
            tail,
        },
        Err(e) => Parsed {
            events,
            error: Some(e),
            tail: None,
        },
    }
}

/// Bytes biased towards what matters to SSE: field names, colons, CR/LF, spaces and
/// multi-byte UTF-8 (including sequences that will be cut).
fn sse_ish_bytes() -> impl Strategy<Value = Vec<u8>> {
    let atom = prop_oneof![
        4 => Just(b"data:".to_vec()),
        2 => Just(b"data: ".to_vec()),
        1 => Just(b"event: error".to_vec()),
        1 => Just(b"id: 7".to_vec()),
        1 => Just(b"retry: 100".to_vec()),
        2 => Just(b": keepalive".to_vec()),
        4 => Just(b"\n".to_vec()),
        2 => Just(b"\r\n".to_vec()),
        2 => Just(b"\r".to_vec()),
        1 => Just(b"\n\n".to_vec()),
        1 => Just(b"[DONE]".to_vec()),
        1 => Just("é€😀".as_bytes().to_vec()),
        1 => Just(b"\xEF\xBB\xBF".to_vec()),
        1 => Just(b"{\"choices\":[{\"delta\":{\"content\":\"x\"}}]}".to_vec()),
        3 => prop::collection::vec(any::<u8>(), 0..12),
    ];
    prop::collection::vec(atom, 0..40).prop_map(|v| v.concat())
}

/// One frame of a generated, well-formed stream.
#[derive(Debug, Clone)]
enum Frame {
    /// An incremental content chunk.
    Content(String),
    /// A role-only delta (not incremental).
    Role,
    /// The finish chunk, optionally carrying usage inline.
    Finish(String, Option<(u64, u64)>),
    /// A usage-only frame with `choices: []`.
    Usage(u64, u64),
    /// A keepalive comment (not an event).
    Comment,
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        6 => any::<String>().prop_map(Frame::Content),
        6 => "[a-z ]{0,6}(é|€|😀|\u{0}|\u{2028}|\r|\n)?[a-z]{0,4}".prop_map(Frame::Content),
        1 => Just(Frame::Role),
        1 => ("(stop|length|tool_calls)", proptest::option::of((0u64..1_000_000, 0u64..1_000_000)))
            .prop_map(|(r, u)| Frame::Finish(r, u)),
        1 => (0u64..1_000_000, 0u64..1_000_000).prop_map(|(p, c)| Frame::Usage(p, c)),
        1 => Just(Frame::Comment),
    ]
}

fn chunk_json(delta: Value, finish: Option<&str>) -> Value {
    json!({"id": "chatcmpl-fuzz", "object": "chat.completion.chunk", "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
}

/// The SSE text of the frames with the given line ending; `pretty` spreads a frame's
/// JSON over several `data:` lines (legal: they join with `\n`, JSON whitespace).
fn render(frames: &[Frame], eol: &str, pretty: bool, done: bool) -> String {
    let mut out = String::new();
    for f in frames {
        let v = match f {
            Frame::Content(s) => chunk_json(json!({"content": s}), None),
            Frame::Role => chunk_json(json!({"role": "assistant", "content": ""}), None),
            Frame::Finish(r, u) => {
                let mut v = chunk_json(json!({}), Some(r));
                if let Some((p, c)) = u {
                    v["usage"] = json!({"prompt_tokens": p, "completion_tokens": c});
                }
                v
            }
            Frame::Usage(p, c) => json!({"choices": [], "usage":
                {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}),
            Frame::Comment => {
                out.push_str(": keepalive");
                out.push_str(eol);
                out.push_str(eol);
                continue;
            }
        };
        let text = if pretty {
            serde_json::to_string_pretty(&v).unwrap()
        } else {
            v.to_string()
        };
        for line in text.split('\n') {
            out.push_str("data: ");
            out.push_str(line);
            out.push_str(eol);
        }
        out.push_str(eol);
    }
    if done {
        out.push_str("data: [DONE]");
        out.push_str(eol);
        out.push_str(eol);
    }
    out
}

/// What a correct client derives from the frames.
struct Expected {
    content: String,
    finish: Option<String>,
    usage: Option<(u64, u64)>,
    incremental: u32,
}

fn expected(frames: &[Frame]) -> Expected {
    let mut e = Expected {
        content: String::new(),
        finish: None,
        usage: None,
        incremental: 0,
    };
    for f in frames {
        match f {
            Frame::Content(s) => {
                e.content.push_str(s);
                if !s.is_empty() {
                    e.incremental += 1;
                }
            }
            Frame::Finish(r, u) => {
                e.finish = Some(r.clone());
                if u.is_some() {
                    e.usage = *u;
                }
            }
            Frame::Usage(p, c) => e.usage = Some((*p, *c)),
            Frame::Role | Frame::Comment => {}
        }
    }
    e
}

/// Arbitrary JSON, bounded in depth and size.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        any::<String>().prop_map(Value::String),
        "(choices|delta|content|usage|error|finish_reason|index|tool_calls|function|arguments|reasoning|reasoning_content|text|type|prompt_tokens|completion_tokens|message|code|status)"
            .prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        "(choices|delta|content|usage|error|finish_reason|index|tool_calls|id|function|name|arguments|reasoning|reasoning_content|text|type|thinking|prompt_tokens|completion_tokens|completion_tokens_details|reasoning_tokens|message|code|status|detail|model)",
                        any::<String>(),
                    ],
                    inner
                ),
                0..6
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<String, Value>>())),
        ]
    })
}

proptest! {
    #![proptest_config(config(2_000))]

    /// Arbitrary bytes, arbitrary cuts, tight bounds: no panic, the buffer stays within
    /// its bounds after every read, and every cut gives the events (and the error) of
    /// one whole read.
    #[test]
    fn any_bytes_any_split_same_events_bounded(
        bytes in sse_ish_bytes(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
        max_line in 1usize..96,
        max_event in 1usize..192,
    ) {
        let whole = feed_pieces(&[&bytes[..]], max_line, max_event);
        let split = feed_pieces(&pieces(&bytes, &cuts), max_line, max_event);
        prop_assert_eq!(&whole, &split);
        for ev in &whole.events {
            prop_assert!(
                ev.data.len() <= data_bound(max_event),
                "event of {} bytes, bound {}",
                ev.data.len(),
                max_event
            );
        }
        // Byte by byte, the worst split of all.
        let singles: Vec<&[u8]> = bytes.chunks(1).collect();
        prop_assert_eq!(&whole, &feed_pieces(&singles, max_line, max_event));
    }

    /// Raw arbitrary bytes (not biased) through the default parser and the aggregator:
    /// no panic; the frames that are JSON objects fold without panicking.
    #[test]
    fn raw_bytes_through_parser_and_aggregator(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(events) = parse_all(&bytes) {
            let mut agg = StreamAggregator::new();
            for ev in events {
                if let Ok(Value::Object(o)) = serde_json::from_str::<Value>(ev.data.trim()) {
                    let _ = in_band_error(&o);
                    let _ = agg.feed(&o, true);
                }
            }
            let a = agg.finish();
            prop_assert!(a.frames as usize <= bytes.len());
        }
        let _ = error_body(&bytes);
    }

    /// Well-formed streams with random line endings, comments, multi-line data and
    /// UTF-8 cut anywhere aggregate to exactly what was sent.
    #[test]
    fn well_formed_streams_aggregate_exactly(
        frames in prop::collection::vec(frame(), 0..24),
        eol in prop_oneof![Just("\n"), Just("\r\n"), Just("\r")],
        pretty in any::<bool>(),
        done in any::<bool>(),
        cuts in prop::collection::vec(any::<usize>(), 0..16),
    ) {
        let text = render(&frames, eol, pretty, done);
        let bytes = text.as_bytes();
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        for part in pieces(bytes, &cuts) {
            parser.feed(part, &mut events).unwrap();
        }
        events.extend(parser.finish().unwrap());
        let mut agg = StreamAggregator::new();
        let mut incremental = 0;
        for ev in &events {
            if ev.data == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(&ev.data)
                .unwrap_or_else(|e| panic!("frame did not survive parsing: {e}: {:?}", ev.data));
            let o = v.as_object().unwrap();
            prop_assert!(in_band_error(o).is_none());
            if agg.feed(o, false).incremental {
                incremental += 1;
            }
        }
        let want = expected(&frames);
        let comments = frames.iter().filter(|f| matches!(f, Frame::Comment)).count() as u64;
        prop_assert_eq!(parser.comments(), comments);
        let got = agg.finish();
        prop_assert_eq!(&got.content, &want.content);
        prop_assert_eq!(&got.finish_reason, &want.finish);
        prop_assert_eq!(got.usage.map(|u| (u.prompt_tokens, u.completion_tokens)), want.usage);
        prop_assert_eq!(got.incremental_chunks, want.incremental);
        prop_assert_eq!(incremental, want.incremental);
    }

}

proptest! {
    // Generating nested JSON costs more per case than parsing it: fewer cases by default.
    #![proptest_config(config(300))]

    /// Arbitrary JSON objects as frames, in-band errors and error bodies: no panic; the
    /// usage a frame reports is what `frame_usage` reads.
    #[test]
    fn arbitrary_json_frames_never_panic(frames in prop::collection::vec(json_value(), 0..12)) {
        let mut agg = StreamAggregator::new();
        let mut last_usage = None;
        for v in &frames {
            let _ = error_body(v.to_string().as_bytes());
            if let Value::Object(o) = v {
                let _ = in_band_error(o);
                if let Some((u, _)) = frame_usage(o) {
                    last_usage = Some(u);
                }
                let _ = agg.feed(o, true);
            }
        }
        let before = agg.usage();
        prop_assert_eq!(before, last_usage);
        let _ = agg.finish();
    }
}

#[test]
fn bounds_are_errors_not_allocations() {
    // A line that never ends is refused once it passes the bound, whatever the reads.
    let mut p = SseParser::with_limits(64, 64);
    let mut out = Vec::new();
    let mut refused = false;
    for _ in 0..1_000 {
        if p.feed(&[b'x'; 7], &mut out).is_err() {
            refused = true;
            break;
        }
        assert!(p.buffered_bytes() <= 128);
    }
    assert!(refused, "an endless line must be refused");
    // An event whose data lines keep coming is refused too.
    let mut p = SseParser::with_limits(64, 100);
    let mut refused = false;
    for _ in 0..1_000 {
        if let Err(e) = p.feed(b"data: 0123456789\n", &mut out) {
            assert_eq!(e, SseError::EventTooLarge { limit: 100 });
            refused = true;
            break;
        }
        assert!(p.buffered_bytes() <= 164);
    }
    assert!(refused, "an endless event must be refused");
    assert!(out.is_empty());
}

/// FINDING SSE-1 (fixed): invalid UTF-8 used to pass the event bound on raw bytes and
/// be stored as U+FFFD (3 bytes each); the parser now bounds the decoded data.
#[test]
fn finding_sse_1_decoded_data_stays_within_the_event_bound() {
    let mut p = SseParser::with_limits(8, 4);
    let mut out = Vec::new();
    let r = p.feed(b"data:\x80\x00\x80\n\n", &mut out);
    assert!(r.is_err(), "7 decoded bytes exceed a 4-byte bound: {out:?}");
    assert!(out.iter().all(|e| e.data.len() <= 4));
}

/// A JSON value of any type for a field the typed path reads as a string or a number.
fn field_value() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => "[a-z]{0,3}(é|\\\\|\"|\n|😀)?".prop_map(Value::String),
        1 => Just(Value::String(String::new())),
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::Bool),
        1 => prop_oneof![Just(json!(0)), Just(json!(1)), Just(json!(0.0)), Just(json!(-0.0)),
                         Just(json!(2.5)), Just(json!(-1)), Just(json!(u64::MAX)), Just(json!(5_000_000_000u64))],
        1 => Just(json!(["x", {"type": "text", "text": "y"}])),
        1 => Just(json!({"text": "z"})),
    ]
    .boxed()
}

/// An optional member: absent, or present with `v`.
fn member(
    key: &'static str,
    v: impl Strategy<Value = Value>,
) -> impl Strategy<Value = Option<(String, Value)>> {
    proptest::option::of(v.prop_map(move |v| (key.to_string(), v)))
}

fn object(members: Vec<Option<(String, Value)>>) -> Value {
    Value::Object(members.into_iter().flatten().collect())
}

/// Chunk-like frames: mostly the common shape, with every field sometimes of another
/// type, indexes of every kind, non-object elements, usage and errors.
fn chunkish() -> BoxedStrategy<Value> {
    let function = (
        member("name", field_value()),
        member("arguments", field_value()),
    )
        .prop_map(|(a, b)| object(vec![a, b]))
        .boxed();
    let tool = (
        member("index", field_value()),
        member("id", field_value()),
        member("function", prop_oneof![4 => function, 1 => field_value()]),
    )
        .prop_map(|(a, b, c)| object(vec![a, b, c]))
        .boxed();
    let tools = prop_oneof![
        4 => prop::collection::vec(prop_oneof![6 => tool, 1 => field_value()], 0..3).prop_map(Value::Array),
        1 => field_value(),
    ]
    .boxed();
    let delta = (
        member("role", field_value()),
        member("content", field_value()),
        member("reasoning_content", field_value()),
        member("reasoning", field_value()),
        member("tool_calls", tools),
    )
        .prop_map(|(a, b, c, d, e)| object(vec![a, b, c, d, e]))
        .boxed();
    let usage = prop_oneof![
        Just(Value::Null),
        Just(json!({"prompt_tokens": 3, "completion_tokens": 4})),
        Just(json!(7)),
    ];
    let choice = (
        member("index", field_value()),
        member("delta", prop_oneof![6 => delta, 1 => field_value()]),
        member("finish_reason", field_value()),
        member("usage", usage.clone()),
    )
        .prop_map(|(a, b, c, d)| object(vec![a, b, c, d]))
        .boxed();
    let choices = prop_oneof![
        6 => prop::collection::vec(prop_oneof![8 => choice, 1 => field_value()], 0..3).prop_map(Value::Array),
        1 => field_value(),
    ]
    .boxed();
    (
        member("model", field_value()),
        member("choices", choices),
        member("usage", usage),
        member(
            "error",
            prop_oneof![
                Just(Value::Null),
                Just(json!(false)),
                Just(json!({"message": "m"}))
            ],
        ),
        member("id", field_value()),
    )
        .prop_map(|(a, b, c, d, e)| object(vec![a, b, c, d, e]))
        .boxed()
}

proptest! {
    #![proptest_config(config(1_000))]

    /// The typed path folds a frame exactly as the general path does whenever it
    /// accepts it (outcome, delta, and the aggregate after a whole sequence), and
    /// leaves the aggregator untouched when it declines.
    #[test]
    fn typed_and_general_paths_agree(
        frames in prop::collection::vec(prop_oneof![4 => chunkish(), 1 => json_value()], 0..10),
        want in any::<bool>(),
    ) {
        let mut general = StreamAggregator::new();
        let mut typed = StreamAggregator::new();
        for v in &frames {
            let text = v.to_string();
            match v {
                Value::Object(o) => {
                    let expected = general.feed(o, want);
                    let got = match typed.feed_typed(&text, want) {
                        Some(out) => out,
                        None => typed.feed(o, want),
                    };
                    prop_assert_eq!(got, expected, "{}", text);
                }
                _ => prop_assert!(typed.feed_typed(&text, want).is_none(), "{}", text),
            }
        }
        prop_assert_eq!(typed.finish(), general.finish());
    }
}

/// Completion-like bodies: chunk-like objects whose choices mostly carry `message`
/// (sometimes still `delta`, or both).
fn completionish() -> BoxedStrategy<Value> {
    (chunkish(), 0..3u8)
        .prop_map(|(mut v, how)| {
            if let Some(cs) = v.get_mut("choices").and_then(Value::as_array_mut) {
                for c in cs.iter_mut().filter_map(Value::as_object_mut) {
                    match how {
                        0 => {}
                        1 => {
                            if let Some(d) = c.get("delta").cloned() {
                                c.insert("message".into(), d);
                            }
                        }
                        _ => {
                            if let Some(d) = c.remove("delta") {
                                c.insert("message".into(), d);
                            }
                        }
                    }
                }
            }
            v
        })
        .boxed()
}

proptest! {
    #![proptest_config(config(1_000))]

    /// A plain completion read typed folds exactly as the general path folds it
    /// whenever the typed path accepts the body, and folds nothing when it declines.
    #[test]
    fn typed_and_general_completion_paths_agree(
        v in prop_oneof![6 => completionish(), 1 => json_value()],
    ) {
        let text = v.to_string();
        let mut typed = StreamAggregator::new();
        let accepted = typed.absorb_completion_typed(text.as_bytes()).is_some();
        if !accepted {
            prop_assert_eq!(typed.finish(), StreamAggregator::new().finish(), "declined but folded: {}", text);
            return Ok(());
        }
        let o = v.as_object();
        prop_assert!(o.is_some(), "accepted a non-object: {}", text);
        let o = o.unwrap();
        let c = choice0(o);
        prop_assert!(c.is_some(), "accepted without a choice 0: {}", text);
        let mut general = StreamAggregator::new();
        general.absorb_completion(o, c.unwrap());
        let typed = typed.finish();
        // What the proxy relies on to pass the body as received without looking for
        // its usage again (issue 42): read at the top level ⇔ an object there.
        prop_assert_eq!(
            typed.usage_location == Some(polygw_transport_openai::aggregate::UsageLocation::TopLevel),
            o.get("usage").is_some_and(Value::is_object),
            "{}", text
        );
        prop_assert_eq!(typed, general.finish(), "{}", text);
    }
}

#[test]
fn the_typed_completion_path_reads_the_common_shape() {
    let mut agg = StreamAggregator::new();
    let body =
        br#"{"id":"c","model":"m","choices":[{"index":0,"logprobs":{"content":[{"token":"a"}]},
        "message":{"role":"assistant","content":"hi","tool_calls":[{"id":"t","type":"function",
        "function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}],
        "usage":{"prompt_tokens":3,"completion_tokens":2}}"#;
    assert!(agg.absorb_completion_typed(body).is_some());
    let a = agg.finish();
    assert_eq!(a.content, "hi");
    assert_eq!(a.tool_calls.len(), 1);
    assert_eq!(a.finish_reason.as_deref(), Some("tool_calls"));
    assert_eq!(
        a.usage.map(|u| (u.prompt_tokens, u.completion_tokens)),
        Some((3, 2))
    );
    for declined in [
        &br#"{"error":{"message":"m"},"choices":[{"message":{"content":"x"}}]}"#[..],
        br#"{"choices":[]}"#,
        br#"{"choices":[{"message":{"content":"x"},"usage":{"prompt_tokens":1}}]}"#,
        br#"{"choices":[{"delta":{"content":"x"}}]}"#,
        br#"{"usage":7,"choices":[{"message":{"content":"x"}}]}"#,
        br#"{"choices":[{"message":{"content":[{"type":"text","text":"p"}]}}]}"#,
        br#"{"model":1,"choices":[{"message":{"content":"x"}}]}"#,
    ] {
        let mut agg = StreamAggregator::new();
        assert!(
            agg.absorb_completion_typed(declined).is_none(),
            "{}",
            String::from_utf8_lossy(declined)
        );
    }
}

#[test]
fn the_typed_path_reads_objects_only_and_declines_errors_and_usage() {
    let mut agg = StreamAggregator::new();
    for declined in [
        "[]",
        "[null, [{\"delta\": {\"content\": \"x\"}}]]",
        "{\"choices\": [[0, {\"content\": \"x\"}, null]]}",
        "{\"choices\": [{\"delta\": [null, \"x\"]}]}",
        "{\"error\": {\"message\": \"m\"}, \"choices\": []}",
        "{\"usage\": {\"prompt_tokens\": 1}, \"choices\": []}",
        "{\"choices\": [{\"delta\": {\"content\": \"a\"}, \"usage\": {}}]}",
        "{\"model\": \"a\", \"model\": \"b\"}",
        "{\"choices\": [{\"delta\": {\"content\": [{\"type\": \"text\", \"text\": \"p\"}]}}]}",
    ] {
        assert!(agg.feed_typed(declined, true).is_none(), "{declined}");
    }
    let out = agg
        .feed_typed(
            "{\"model\":\"m\",\"usage\":null,\"error\":null,\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\\nb\"}}]}",
            false,
        )
        .expect("the common shape");
    assert!(out.incremental);
    let a = agg.finish();
    assert_eq!((a.content.as_str(), a.frames), ("a\nb", 1));
}
