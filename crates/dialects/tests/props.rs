//! Property tests of the dialects: chat requests survive the round trip through each
//! dialect (after a documented normalization), any delta sequence streams as a
//! conformant event sequence whose texts equal the answer's, and SSE writes parse back.

use polygw_core::ports::{StreamDelta, ToolCallDelta};
use polygw_core::{ChatRequest, LlmResponse, Message, ToolCall, Usage, UsageSource};
use polygw_dialects::{messages, responses, sse, SseEvent};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

// === Round trip: ChatRequest → dialect body → parse → to_chat ===

const TOOL_NAMES: [&str; 3] = ["read_file", "run", "search"];

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 .,!?\n\"{}\\\\é漢😀-]{1,40}"
}

fn json_args() -> impl Strategy<Value = String> {
    prop::collection::btree_map(
        "[a-z]{1,6}",
        prop_oneof![
            any::<i32>().prop_map(Value::from),
            text().prop_map(Value::from),
            any::<bool>().prop_map(Value::from),
        ],
        0..4,
    )
    .prop_map(|m| Value::Object(m.into_iter().collect()).to_string())
}

/// One turn of a conversation: what the user says, and how the assistant answers.
#[derive(Debug, Clone)]
enum Turn {
    User(String, Option<String>),
    Assistant(String),
    Calls(Option<String>, Vec<(usize, String, String)>),
    System(String),
}

fn turn() -> impl Strategy<Value = Turn> {
    prop_oneof![
        (text(), prop::option::of("[A-Za-z0-9+/]{4,12}")).prop_map(|(t, img)| Turn::User(t, img)),
        text().prop_map(Turn::Assistant),
        (
            prop::option::of(text()),
            prop::collection::vec((0..TOOL_NAMES.len(), json_args(), text()), 1..3)
        )
            .prop_map(|(t, calls)| Turn::Calls(t, calls)),
        text().prop_map(Turn::System),
    ]
}

/// A sampling parameter as clients write them: at most 2 decimals in 0..=1 (serde_json
/// reads a decimal into the nearest f64 only within a ULP, so 17-digit values may not
/// come back bit-identical; short ones do).
fn decimal() -> impl Strategy<Value = f64> {
    (0u32..=100).prop_map(|n| f64::from(n) / 100.0)
}

#[derive(Debug, Clone)]
struct Gen {
    system: Option<String>,
    turns: Vec<Turn>,
    tools: bool,
    temperature: Option<f64>,
    max_tokens: u32,
    top_p: Option<f64>,
    stop: Option<Vec<String>>,
    format: u8,
    effort: Option<&'static str>,
    choice: u8,
    parallel: Option<bool>,
    stream: bool,
}

fn gen() -> impl Strategy<Value = Gen> {
    (
        prop::option::of(text()),
        prop::collection::vec(turn(), 1..8),
        any::<bool>(),
        prop::option::of(decimal()),
        1u32..100_000,
        prop::option::of(decimal()),
        prop::option::of(prop::collection::vec("[A-Z]{1,5}", 1..3)),
        0u8..3,
        prop::option::of(prop_oneof![Just("low"), Just("medium"), Just("high")]),
        0u8..5,
        prop::option::of(any::<bool>()),
        any::<bool>(),
    )
        .prop_map(
            |(
                system,
                turns,
                tools,
                temperature,
                max_tokens,
                top_p,
                stop,
                format,
                effort,
                choice,
                parallel,
                stream,
            )| Gen {
                system,
                turns,
                tools,
                temperature,
                max_tokens,
                top_p,
                stop,
                format,
                effort,
                choice,
                parallel,
                stream,
            },
        )
}

/// The chat request of a generated conversation. Calls always use declared tools
/// (the tools are declared when a turn calls one), and every call gets its result.
fn build(g: &Gen) -> ChatRequest {
    let mut messages = Vec::new();
    if let Some(s) = &g.system {
        messages.push(Message::system(s.clone()));
    }
    let mut calls_made = false;
    let mut n = 0;
    let mut last_assistant = false;
    for t in &g.turns {
        match t {
            Turn::User(text, img) => {
                last_assistant = false;
                let content = match img {
                    None => json!(text),
                    Some(b64) => json!([{"type": "text", "text": text},
                        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}}]),
                };
                messages.push(Message {
                    role: "user".into(),
                    content: Some(content),
                    extra: Map::new(),
                });
            }
            Turn::System(text) => {
                last_assistant = false;
                messages.push(Message::system(text.clone()));
            }
            // Consecutive assistant turns are one turn in both dialects: skip.
            Turn::Assistant(_) | Turn::Calls(..) if last_assistant => {}
            Turn::Assistant(text) => {
                last_assistant = true;
                messages.push(Message::assistant(text.clone()));
            }
            Turn::Calls(text, calls) => {
                calls_made = true;
                let mut tool_calls = Vec::new();
                let mut results = Vec::new();
                for (tool, args, out) in calls {
                    n += 1;
                    let id = format!("call_{n}");
                    tool_calls.push(json!({"id": id, "type": "function", "function": {"name": TOOL_NAMES[*tool], "arguments": args}}));
                    let mut extra = Map::new();
                    extra.insert("tool_call_id".into(), json!(id));
                    results.push(Message {
                        role: "tool".into(),
                        content: Some(json!(out)),
                        extra,
                    });
                }
                let mut extra = Map::new();
                extra.insert("tool_calls".into(), Value::Array(tool_calls));
                let content = text.clone().map_or(Value::Null, Value::String);
                messages.push(Message {
                    role: "assistant".into(),
                    content: Some(content),
                    extra,
                });
                messages.extend(results);
                last_assistant = false;
            }
        }
    }
    let tools = (g.tools || calls_made).then(|| {
        TOOL_NAMES
            .iter()
            .map(|n| json!({"type": "function", "function": {"name": n, "description": format!("The {n} tool."),
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}))
            .collect::<Vec<_>>()
    });
    let mut req = ChatRequest {
        messages,
        stream: g.stream,
        temperature: g.temperature,
        max_tokens: Some(g.max_tokens),
        reasoning_effort: g.effort.map(str::to_string),
        response_format: match g.format {
            1 => Some(json!({"type": "json_object"})),
            2 => Some(
                json!({"type": "json_schema", "json_schema": {"name": "answer", "strict": true,
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}),
            ),
            _ => None,
        },
        tools,
        overlay: None,
        native: None,
        translated: Vec::new(),
        native_only: false,
        client_credential: None,
        wire: None,
    };
    if let Some(p) = g.top_p {
        req = req.with_overlay("top_p", json!(p));
    }
    if let Some(s) = &g.stop {
        req = req.with_overlay("stop", json!(s));
    }
    if req.tools.is_some() {
        let choice = match g.choice {
            1 => Some(json!("auto")),
            2 => Some(json!("required")),
            3 => Some(json!("none")),
            4 => Some(json!({"type": "function", "function": {"name": "run"}})),
            _ => None,
        };
        if let Some(c) = choice {
            req = req.with_overlay("tool_choice", c);
        }
        if let Some(p) = g.parallel {
            req = req.with_overlay("parallel_tool_calls", json!(p));
        }
    }
    req
}

/// What the Responses round trip keeps, documented: every message, tool, sampling and
/// reasoning field; of the overlay only what Responses can say (`top_p`,
/// `tool_choice`, `parallel_tool_calls`): `stop` has no Responses field.
fn normalize_responses(mut r: ChatRequest) -> ChatRequest {
    if let Some(o) = r.overlay.as_mut() {
        o.retain(|k, _| matches!(k.as_str(), "top_p" | "tool_choice" | "parallel_tool_calls"));
    }
    if r.overlay.as_ref().is_some_and(Map::is_empty) {
        r.overlay = None;
    }
    r
}

/// What the Messages round trip keeps, documented: `stop` as an array; JSON output only
/// as a schema (named `output`, strict: Anthropic has no json_object mode and no schema
/// name); `parallel_tool_calls` only as `false` (Anthropic can only disable parallel
/// calls, on a `tool_choice`: the default `auto` is then explicit); images without
/// `detail` (Anthropic has none).
fn normalize_messages(mut r: ChatRequest) -> ChatRequest {
    r.response_format = match r.response_format.take() {
        Some(rf) if rf["type"] == "json_schema" => Some(json!({"type": "json_schema",
            "json_schema": {"name": "output", "schema": rf["json_schema"]["schema"], "strict": true}})),
        _ => None,
    };
    if let Some(o) = r.overlay.as_mut() {
        o.remove("model");
        if o.get("parallel_tool_calls") == Some(&json!(true)) {
            o.remove("parallel_tool_calls");
        }
        if o.contains_key("parallel_tool_calls") && !o.contains_key("tool_choice") {
            o.insert("tool_choice".into(), json!("auto"));
        }
    }
    if r.overlay.as_ref().is_some_and(Map::is_empty) {
        r.overlay = None;
    }
    for m in &mut r.messages {
        if let Some(Value::Array(parts)) = m.content.as_mut() {
            for p in parts {
                if let Some(img) = p.get_mut("image_url").and_then(Value::as_object_mut) {
                    img.remove("detail");
                }
            }
        }
    }
    r
}

/// Every overlay field of `req` is either one the target keeps (`kept`) or named in
/// `unexpressed`: nothing is dropped silently.
fn named_or_kept(
    req: &ChatRequest,
    unexpressed: &[String],
    kept: &[&str],
) -> Result<(), TestCaseError> {
    for k in req.overlay.iter().flat_map(|o| o.keys()) {
        prop_assert!(
            kept.contains(&k.as_str()) || k == "model" || unexpressed.iter().any(|u| u == k),
            "{k} was dropped without being named: {unexpressed:?}"
        );
    }
    Ok(())
}

// === Streams: any split of an answer into deltas ===

#[derive(Debug, Clone)]
struct Answer {
    reasoning: String,
    content: String,
    calls: Vec<(usize, String)>,
    finish: Option<&'static str>,
    usage: Option<Usage>,
}

fn answer() -> impl Strategy<Value = Answer> {
    (
        prop_oneof![Just(String::new()), text()],
        prop_oneof![Just(String::new()), text()],
        prop::collection::vec(
            (
                0..TOOL_NAMES.len(),
                prop_oneof![json_args(), Just(String::new())],
            ),
            0..3,
        ),
        prop::option::of(prop_oneof![
            Just("stop"),
            Just("length"),
            Just("tool_calls"),
            Just("content_filter")
        ]),
        prop::option::of((0u64..5000, 0u64..500, prop::option::of(0u64..100))),
    )
        .prop_map(|(reasoning, content, calls, finish, usage)| Answer {
            reasoning,
            content,
            calls,
            finish,
            usage: usage.map(|(p, c, cached)| Usage {
                cached_prompt_tokens: cached.map(|x| x.min(p)),
                ..Usage::new(p, c)
            }),
        })
}

/// Splits `s` into pieces at the given char positions (a piece may be empty).
fn split(s: &str, cuts: &[usize]) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
    points.sort_unstable();
    let mut out = Vec::new();
    let mut prev = 0;
    for p in points.into_iter().chain([chars.len()]) {
        out.push(chars[prev..p].iter().collect());
        prev = p;
    }
    out
}

/// The deltas of an answer: a role chunk, reasoning then text then each tool call in
/// pieces (only a call's first fragment has its id and name), with empty and
/// usage-only deltas sprinkled in, then a finish-only delta.
fn deltas(a: &Answer, cuts: &[usize], noise: &[u8]) -> Vec<StreamDelta> {
    let mut out = vec![StreamDelta {
        role: Some("assistant".into()),
        ..Default::default()
    }];
    let mut k = 0;
    let mut push = |d: StreamDelta, out: &mut Vec<StreamDelta>| {
        out.push(d);
        match noise.get(k % noise.len().max(1)).copied().unwrap_or(0) % 4 {
            0 => out.push(StreamDelta::default()),
            1 => out.push(StreamDelta {
                content: Some(String::new()),
                ..Default::default()
            }),
            2 => out.push(StreamDelta {
                usage: Some(Usage::new(1, 1)),
                ..Default::default()
            }),
            _ => {}
        }
        k += 1;
    };
    for piece in split(&a.reasoning, cuts) {
        push(
            StreamDelta {
                reasoning: Some(piece),
                ..Default::default()
            },
            &mut out,
        );
    }
    for piece in split(&a.content, &cuts[cuts.len() / 2..]) {
        push(
            StreamDelta {
                content: Some(piece),
                ..Default::default()
            },
            &mut out,
        );
    }
    for (i, (tool, args)) in a.calls.iter().enumerate() {
        for (j, piece) in split(args, cuts).into_iter().enumerate() {
            let first = j == 0;
            let td = ToolCallDelta {
                index: i as u32,
                id: first.then(|| format!("call_{i}")),
                name: first.then(|| TOOL_NAMES[*tool].to_string()),
                arguments: piece,
            };
            push(
                StreamDelta {
                    tool_calls: vec![td],
                    ..Default::default()
                },
                &mut out,
            );
        }
    }
    out.push(StreamDelta {
        finish_reason: a.finish.map(str::to_string),
        ..Default::default()
    });
    out
}

fn llm(a: &Answer) -> LlmResponse {
    LlmResponse {
        content: a.content.clone(),
        reasoning_content: (!a.reasoning.is_empty()).then(|| a.reasoning.clone()),
        tool_calls: a
            .calls
            .iter()
            .enumerate()
            .map(|(i, (tool, args))| ToolCall {
                index: i as u32,
                id: Some(format!("call_{i}")),
                name: Some(TOOL_NAMES[*tool].to_string()),
                arguments: args.clone(),
            })
            .collect(),
        finish_reason: a.finish.map(str::to_string),
        usage: a.usage.unwrap_or_default(),
        usage_source: if a.usage.is_some() {
            UsageSource::Measured
        } else {
            UsageSource::Unavailable
        },
        ..Default::default()
    }
}

fn tools_body() -> Value {
    Value::Array(
        TOOL_NAMES
            .iter()
            .map(|n| json!({"type": "function", "name": n, "parameters": {"type": "object"}}))
            .collect(),
    )
}

fn responses_meta() -> responses::ResponsesMeta {
    let body = json!({"model": "m", "input": "x", "stream": true, "tools": tools_body()});
    responses::to_chat(
        &responses::parse_request(body.to_string().as_bytes()).unwrap(),
        &[],
    )
    .unwrap()
    .meta
}

fn messages_meta(thinking: bool) -> messages::MessagesMeta {
    let tools: Vec<Value> = TOOL_NAMES
        .iter()
        .map(|n| json!({"name": n, "input_schema": {"type": "object"}}))
        .collect();
    let mut body = json!({"model": "m", "max_tokens": 10, "stream": true, "tools": tools,
        "messages": [{"role": "user", "content": "x"}]});
    if thinking {
        body["thinking"] = json!({"type": "enabled", "budget_tokens": 2048});
    }
    messages::to_chat(&messages::parse_request(body.to_string().as_bytes()).unwrap())
        .unwrap()
        .meta
}

// === SSE ===

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        ".*".prop_map(Value::from),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(".{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn responses_round_trip(g in gen()) {
        let req = build(&g);
        let mut body = responses::request_from_chat(&req);
        body["model"] = json!("m");
        let parsed = responses::parse_request(body.to_string().as_bytes()).unwrap();
        let back = responses::to_chat(&parsed, &[]).unwrap().request;
        prop_assert_eq!(normalize_responses(back), normalize_responses(req));
    }

    #[test]
    fn messages_round_trip(g in gen()) {
        let req = build(&g);
        let mut body = messages::request_from_chat(&req);
        body["model"] = json!("m");
        let parsed = messages::parse_request(body.to_string().as_bytes()).unwrap();
        let back = messages::to_chat(&parsed).unwrap().request;
        prop_assert_eq!(normalize_messages(back), normalize_messages(req));
    }

    /// SPEC §23.3, chat → `messages` source: what Messages can say survives the way
    /// there and back (the client's cap, else the source's; temperature at most 1),
    /// and every overlay field that does not is named.
    #[test]
    fn a_messages_source_gets_what_messages_can_say_and_the_rest_is_named(g in gen()) {
        let req = build(&g);
        let out = polygw_dialects::source::for_messages(&req, 4096);
        let mut body = Value::Object(out.body.clone());
        body["model"] = json!("m");
        body["stream"] = json!(req.stream);
        let parsed = messages::parse_request(body.to_string().as_bytes()).unwrap();
        let back = messages::to_chat(&parsed).unwrap().request;
        prop_assert_eq!(back.max_tokens, Some(req.max_tokens.unwrap_or(4096)));
        let mut want = normalize_messages(req.clone());
        want.temperature = want.temperature.map(|t| t.min(1.0));
        // The API has no system role: every system message joins `system`, in order.
        let system: Vec<String> = want
            .messages
            .iter()
            .filter(|m| m.role == "system")
            .filter_map(|m| m.content.as_ref()?.as_str().map(str::to_string))
            .filter(|t| !t.is_empty())
            .collect();
        want.messages.retain(|m| m.role != "system");
        // A system message between two turns of one role: the API joins those turns
        // (as Anthropic does), which this comparison does not model.
        prop_assume!(want
            .messages
            .windows(2)
            .all(|w| w[0].role != w[1].role || w[0].role == "tool"));
        if !system.is_empty() {
            want.messages.insert(0, Message::system(system.join("\n\n")));
        }
        want.max_tokens = back.max_tokens;
        prop_assert_eq!(normalize_messages(back), want);
        named_or_kept(&req, &out.unexpressed, &["stop", "top_p", "tool_choice", "parallel_tool_calls"])?;
    }

    /// SPEC §23.3, chat → `responses` source: likewise, called stateless.
    #[test]
    fn a_responses_source_gets_what_responses_can_say_and_the_rest_is_named(g in gen()) {
        let req = build(&g);
        let out = polygw_dialects::source::for_responses(&req);
        prop_assert_eq!(&out.body["store"], &json!(false));
        let mut body = Value::Object(out.body.clone());
        body["model"] = json!("m");
        body["stream"] = json!(req.stream);
        let parsed = responses::parse_request(body.to_string().as_bytes()).unwrap();
        let back = responses::to_chat(&parsed, &[]).unwrap().request;
        prop_assert_eq!(normalize_responses(back), normalize_responses(req.clone()));
        named_or_kept(&req, &out.unexpressed, &["top_p", "tool_choice", "parallel_tool_calls"])?;
    }

    #[test]
    fn responses_streams_conform(
        a in answer(),
        cuts in prop::collection::vec(any::<usize>(), 0..6),
        noise in prop::collection::vec(any::<u8>(), 0..8),
        keep in any::<prop::sample::Index>(),
        fail in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let all = deltas(&a, &cuts, &noise);
        // A prefix of the deltas only: finish sends the rest (a cache hit sends none).
        let n = keep.index(all.len() + 1);
        let answer = llm(&a);
        let meta = responses_meta();
        let mut s = responses::ResponsesStream::new("resp_p", 1, meta.clone());
        let mut ev = s.start();
        let stop_at = fail.map(|f| f.index(n + 1));
        for (i, d) in all[..n].iter().enumerate() {
            if stop_at == Some(i) { break; }
            ev.extend(s.delta(d));
        }
        if stop_at.is_some() {
            ev.extend(s.fail("server_error", "the source failed"));
        } else {
            ev.extend(s.finish(&answer));
        }
        prop_assert!(s.finish(&answer).is_empty() && s.fail("x", "y").is_empty());
        let seqs: Vec<u64> = ev.iter().map(|e| e.data["sequence_number"].as_u64().unwrap()).collect();
        prop_assert!(seqs.windows(2).all(|w| w[0] < w[1]));
        let terminals = ev.iter().filter(|e| matches!(e.event.as_str(),
            "response.completed" | "response.incomplete" | "response.failed")).count();
        prop_assert_eq!(terminals, 1);
        let fin = responses::check_stream(&ev).map_err(TestCaseError::fail)?;
        if stop_at.is_some() {
            prop_assert_eq!(fin.status.as_str(), "failed");
            prop_assert!(fin.error.is_some());
        } else {
            prop_assert_eq!(&fin.text, &a.content);
            prop_assert_eq!(&fin.reasoning, &a.reasoning);
            let args: Vec<&str> = fin.tool_calls.iter().map(|c| c.arguments.as_str()).collect();
            let want: Vec<&str> = a.calls.iter().map(|(_, args)| args.as_str()).collect();
            prop_assert_eq!(args, want);
            let plain = responses::output_items("resp_p", &meta, &answer);
            prop_assert_eq!(s.output_items(), plain.as_slice());
            let plain_usage = responses::response_object("resp_p", 1, &meta, &answer)["usage"].clone();
            prop_assert_eq!(&fin.usage, &plain_usage);
        }
    }

    #[test]
    fn messages_streams_conform(
        a in answer(),
        thinking in any::<bool>(),
        cuts in prop::collection::vec(any::<usize>(), 0..6),
        noise in prop::collection::vec(any::<u8>(), 0..8),
        keep in any::<prop::sample::Index>(),
        fail in prop::option::of(any::<prop::sample::Index>()),
        pings in prop::collection::vec(any::<bool>(), 0..4),
    ) {
        let all = deltas(&a, &cuts, &noise);
        let n = keep.index(all.len() + 1);
        let answer = llm(&a);
        let meta = messages_meta(thinking);
        let mut s = messages::MessagesStream::new("msg_p", meta.clone(), 7);
        let mut ev = s.start();
        let stop_at = fail.map(|f| f.index(n + 1));
        for (i, d) in all[..n].iter().enumerate() {
            if stop_at == Some(i) { break; }
            if pings.get(i).copied().unwrap_or(false) {
                ev.push(s.ping());
            }
            ev.extend(s.delta(d));
        }
        if stop_at.is_some() {
            ev.extend(s.fail("overloaded_error", "the source failed"));
        } else {
            ev.extend(s.finish(&answer));
        }
        prop_assert!(s.finish(&answer).is_empty() && s.fail("x", "y").is_empty());
        let terminals = ev.iter().filter(|e| matches!(e.event.as_str(), "message_stop" | "error")).count();
        prop_assert_eq!(terminals, 1);
        let starts = ev.iter().filter(|e| e.event == "content_block_start").count();
        let stops = ev.iter().filter(|e| e.event == "content_block_stop").count();
        let fin = messages::check_stream(&ev).map_err(TestCaseError::fail)?;
        if stop_at.is_some() {
            prop_assert!(fin.error.is_some());
        } else {
            prop_assert_eq!(starts, stops);
            prop_assert_eq!(&fin.text, &a.content);
            let want_thinking = if thinking { a.reasoning.as_str() } else { "" };
            prop_assert_eq!(fin.thinking.as_str(), want_thinking);
            let inputs: Vec<Value> = fin.tool_calls.iter().map(|c| c.input.clone()).collect();
            let want: Vec<Value> = a.calls.iter().map(|(_, args)| messages::tool_input(args)).collect();
            prop_assert_eq!(inputs, want);
            let plain = messages::message_object("msg_p", &meta, &answer);
            prop_assert_eq!(fin.stop_reason.as_deref(), plain["stop_reason"].as_str());
            if a.usage.is_some() {
                for k in ["output_tokens", "cache_read_input_tokens", "input_tokens"] {
                    prop_assert_eq!(&fin.usage[k], &plain["usage"][k]);
                }
            }
        }
    }

    /// SPEC §23.3, a source's stream to a client of another API: an answer as a
    /// `messages` (or `responses`) source streams it, read event by event by core's
    /// reader (what the engine does), then written for a Responses (or Messages)
    /// client. The client's stream conforms (one start, ordered items or blocks, one
    /// terminal event) and carries the same text, the same tool arguments, and the
    /// same usage — nothing lost or counted twice between the two APIs.
    #[test]
    fn a_source_stream_reaches_a_client_of_another_api_whole(
        a in answer(),
        to_messages in any::<bool>(),
        cuts in prop::collection::vec(any::<usize>(), 0..6),
        noise in prop::collection::vec(any::<u8>(), 0..8),
    ) {
        use polygw_core::native::{messages::MessagesReader, responses::ResponsesReader};
        // An answer a source finishes (the source states its stop and usage).
        let mut a = a;
        a.finish = Some(if a.calls.is_empty() { "stop" } else { "tool_calls" });
        a.usage = Some(a.usage.unwrap_or(Usage::new(3, 2)));
        let answer = llm(&a);
        let all = deltas(&a, &cuts, &noise);
        // The source's events.
        let source_events: Vec<SseEvent> = if to_messages {
            let mut s = responses::ResponsesStream::new("resp_src", 1, responses_meta());
            let mut ev = s.start();
            for d in &all { ev.extend(s.delta(d)); }
            ev.extend(s.finish(&answer));
            ev
        } else {
            let mut s = messages::MessagesStream::new("msg_src", messages_meta(true), 7);
            let mut ev = s.start();
            for d in &all { ev.extend(s.delta(d)); }
            ev.extend(s.finish(&answer));
            ev
        };
        // Read as the engine reads them; the events themselves do not reach the client.
        let mut read = Vec::new();
        let mut usage = None;
        let mut finish = None;
        let (mut mr, mut rr) = (MessagesReader::new(), ResponsesReader::new());
        for e in &source_events {
            let data = e.data.to_string();
            let d = if to_messages { rr.on_event(Some(&e.event), &data) } else { mr.on_event(Some(&e.event), &data) };
            let mut d = d.map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
            d.native = None;
            if d.usage.is_some() { usage = d.usage; }
            if d.finish_reason.is_some() { finish = d.finish_reason.clone(); }
            read.push(d);
        }
        let done = if to_messages { rr.done() } else { mr.done() };
        prop_assert!(done, "the source's stream ended");
        // The answer as the engine aggregates what it read: calls by their index.
        let mut calls: Vec<ToolCall> = Vec::new();
        for t in read.iter().flat_map(|d| &d.tool_calls) {
            match calls.iter_mut().find(|c| c.index == t.index) {
                Some(c) => c.arguments.push_str(&t.arguments),
                None => calls.push(ToolCall {
                    index: t.index,
                    id: t.id.clone(),
                    name: t.name.clone(),
                    arguments: t.arguments.clone(),
                }),
            }
        }
        let indices: Vec<u32> = calls.iter().map(|c| c.index).collect();
        prop_assert_eq!(indices, (0..a.calls.len() as u32).collect::<Vec<_>>(), "calls numbered 0, 1, …");
        let engine_answer = LlmResponse {
            usage: usage.unwrap_or_default(),
            finish_reason: finish,
            tool_calls: calls,
            ..answer.clone()
        };
        let u = a.usage.unwrap();
        prop_assert_eq!(engine_answer.usage.prompt_tokens, u.prompt_tokens);
        prop_assert_eq!(engine_answer.usage.completion_tokens, u.completion_tokens);
        // The client's stream.
        if to_messages {
            let mut c = messages::MessagesStream::new("msg_c", messages_meta(true), 7);
            let mut ev = c.start();
            for d in &read { ev.extend(c.delta(d)); }
            ev.extend(c.finish(&engine_answer));
            let fin = messages::check_stream(&ev).map_err(TestCaseError::fail)?;
            prop_assert_eq!(&fin.text, &a.content);
            let inputs: Vec<Value> = fin.tool_calls.iter().map(|c| c.input.clone()).collect();
            let want: Vec<Value> = a.calls.iter().map(|(_, args)| messages::tool_input(args)).collect();
            prop_assert_eq!(inputs, want);
            prop_assert_eq!(fin.usage["output_tokens"].as_u64(), Some(u.completion_tokens));
        } else {
            let mut c = responses::ResponsesStream::new("resp_c", 1, responses_meta());
            let mut ev = c.start();
            for d in &read { ev.extend(c.delta(d)); }
            ev.extend(c.finish(&engine_answer));
            let fin = responses::check_stream(&ev).map_err(TestCaseError::fail)?;
            prop_assert_eq!(&fin.text, &a.content);
            prop_assert_eq!(&fin.reasoning, &a.reasoning);
            let args: Vec<&str> = fin.tool_calls.iter().map(|c| c.arguments.as_str()).collect();
            let want: Vec<&str> = a.calls.iter().map(|(_, args)| args.as_str()).collect();
            prop_assert_eq!(args, want);
            prop_assert_eq!(fin.usage["output_tokens"].as_u64(), Some(u.completion_tokens));
            prop_assert_eq!(fin.usage["input_tokens"].as_u64(), Some(u.prompt_tokens));
        }
    }

    /// SPEC §23.6: a native stream cut after any event and continued by another leg
    /// is one valid stream for its client. The events before the cut went to the
    /// client as the source sent them, and the client's encoder followed them
    /// (`observe`); the continuation leg's deltas — what the engine forwards after the
    /// delivered prefix — and the end are then written by that encoder. Messages: one
    /// `message_start`, blocks numbered 0…n−1 each started and stopped once, one
    /// `message_delta`, one `message_stop`; Responses: one `response.created`,
    /// contiguous sequence numbers, one `response.completed` with the whole output.
    /// Either way the client's text and tool arguments are the answer's, once.
    #[test]
    fn a_native_stream_cut_anywhere_is_continued_as_one_valid_stream(
        a in answer(),
        messages_api in any::<bool>(),
        cuts in prop::collection::vec(any::<usize>(), 0..6),
        at in any::<prop::sample::Index>(),
    ) {
        use polygw_core::native::{messages::MessagesReader, responses::ResponsesReader};
        let mut a = a;
        a.finish = Some(if a.calls.is_empty() { "stop" } else { "tool_calls" });
        a.usage = Some(a.usage.unwrap_or(Usage::new(3, 2)));
        let answer = llm(&a);
        let all = deltas(&a, &cuts, &[]);
        let source: Vec<SseEvent> = if messages_api {
            let mut s = messages::MessagesStream::new("msg_src", messages_meta(true), 7);
            let mut ev = s.start();
            for d in &all { ev.extend(s.delta(d)); }
            ev.extend(s.finish(&answer));
            ev
        } else {
            let mut s = responses::ResponsesStream::new("resp_src", 1, responses_meta());
            let mut ev = s.start();
            for d in &all { ev.extend(s.delta(d)); }
            ev.extend(s.finish(&answer));
            ev
        };
        // Cut after k events (at least the first, before the terminal one).
        let k = 1 + at.index(source.len() - 1);
        let passed = &source[..k];
        // What the client received, as the engine read it.
        let (mut mr, mut rr) = (MessagesReader::new(), ResponsesReader::new());
        let mut text = String::new();
        let mut thought = String::new();
        let mut args: Vec<String> = vec![String::new(); a.calls.len()];
        let mut named: Vec<bool> = vec![false; a.calls.len()];
        for e in passed {
            let data = e.data.to_string();
            let d = if messages_api { mr.on_event(Some(&e.event), &data) } else { rr.on_event(Some(&e.event), &data) };
            let d = d.map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
            text.push_str(d.content.as_deref().unwrap_or_default());
            thought.push_str(d.reasoning.as_deref().unwrap_or_default());
            for t in &d.tool_calls {
                let i = t.index as usize;
                args[i].push_str(&t.arguments);
                named[i] |= t.name.is_some();
            }
        }
        prop_assert!(a.content.starts_with(&text));
        // The continuation: what was not delivered.
        prop_assert!(a.reasoning.starts_with(&thought));
        let mut rest = vec![
            StreamDelta { reasoning: Some(a.reasoning[thought.len()..].to_string()), ..Default::default() },
            StreamDelta { content: Some(a.content[text.len()..].to_string()), ..Default::default() },
        ];
        for (i, (tool, full)) in a.calls.iter().enumerate() {
            prop_assert!(full.starts_with(&args[i]));
            rest.push(StreamDelta {
                tool_calls: vec![ToolCallDelta {
                    index: i as u32,
                    id: (!named[i]).then(|| format!("call_{i}")),
                    name: (!named[i]).then(|| TOOL_NAMES[*tool].to_string()),
                    arguments: full[args[i].len()..].to_string(),
                }],
                ..Default::default()
            });
        }
        let mut out: Vec<SseEvent> = passed.to_vec();
        if messages_api {
            let mut c = messages::MessagesStream::new("msg_client", messages_meta(true), 7);
            for e in passed { c.observe(&e.event, &e.data); }
            for d in &rest { out.extend(c.delta(d)); }
            out.extend(c.finish(&answer));
            let fin = messages::check_stream(&out).map_err(TestCaseError::fail)?;
            prop_assert_eq!(&fin.text, &a.content);
            let inputs: Vec<Value> = fin.tool_calls.iter().map(|c| c.input.clone()).collect();
            let want: Vec<Value> = a.calls.iter().map(|(_, args)| messages::tool_input(args)).collect();
            prop_assert_eq!(inputs, want);
            prop_assert_eq!(out.iter().filter(|e| e.event == "message_start").count(), 1);
            prop_assert_eq!(out.iter().filter(|e| e.event == "message_delta").count(), 1);
            prop_assert_eq!(out.iter().filter(|e| e.event == "message_stop").count(), 1);
        } else {
            let mut c = responses::ResponsesStream::new("resp_client", 1, responses_meta());
            for e in passed { c.observe(&e.data); }
            for d in &rest { out.extend(c.delta(d)); }
            out.extend(c.finish(&answer));
            let seqs: Vec<u64> = out.iter().map(|e| e.data["sequence_number"].as_u64().unwrap()).collect();
            prop_assert_eq!(seqs, (0..out.len() as u64).collect::<Vec<_>>(), "contiguous sequence numbers");
            let fin = responses::check_stream(&out).map_err(TestCaseError::fail)?;
            prop_assert_eq!(&fin.text, &a.content);
            let got: Vec<&str> = fin.tool_calls.iter().map(|c| c.arguments.as_str()).collect();
            let want: Vec<&str> = a.calls.iter().map(|(_, args)| args.as_str()).collect();
            prop_assert_eq!(got, want);
            prop_assert_eq!(&fin.id, "resp_src", "the id the client saw first");
            // The same items as the answer the source would have completed.
            let kinds = |events: &[SseEvent]| -> Vec<String> {
                events.iter().rev().find(|e| e.event == "response.completed")
                    .and_then(|e| e.data["response"]["output"].as_array().cloned())
                    .unwrap_or_default()
                    .iter()
                    .map(|i| i["type"].as_str().unwrap_or_default().to_string())
                    .collect()
            };
            prop_assert_eq!(kinds(&out), kinds(&source), "no item added or lost");
        }
    }

    #[test]
    fn sse_round_trips(events in prop::collection::vec(("[a-z_.]{1,24}", value()), 0..6)) {
        let events: Vec<SseEvent> = events.into_iter().map(|(e, d)| SseEvent::new(e, d)).collect();
        prop_assert_eq!(sse::parse_sse(&sse::write_all(&events)), events);
    }
}
