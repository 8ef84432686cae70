//! SPEC §23.6 through `polygw serve`, the resume modes of native streams beyond the
//! replay of `cross.rs`: a Messages stream cut mid-answer continues by assistant prefill
//! on a `messages` source that takes it (thinking off, the delivered text not ending in
//! whitespace) and by replay otherwise; a source that refuses prefill is learned and
//! replayed; a tool call cut mid-arguments is completed on another source under the id
//! the client already has; a 20 s stall mid-answer is rescued with `auto` defaults
//! (tokio's paused clock: the priors of docs/HEDGING.md, no tuning); and a recorded
//! stream of each API (thinking, text, a tool call) cut after every one of its events
//! reaches the client as one valid stream.

use std::time::Duration;

use polygw::core::resume::PrefillDialect;
use polygw::core::source::SourceApi;
use polygw_dialects::{messages as mwire, parse_sse, responses as rwire};
use polygw_mock_upstream::{
    Behavior, EndKind, Fault, MockUpstream, PrefillOutcome, PrefillPolicy, Stall, ToolCallSpec,
    TRAILING_WHITESPACE_MESSAGE,
};
use serde_json::{json, Value};

use crate::cross::{path_of, post, read, request, source_of};
use crate::native::{messages_scope, messages_source, recording_mock};

/// A Messages request without tools, streamed, thinking on or off.
fn messages_body(thinking: bool) -> Value {
    let mut body = json!({"model": "llm", "stream": true, "max_tokens": 2000,
        "messages": [{"role": "user", "content": "count for me"}]});
    if thinking {
        body["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
    }
    body
}

/// What the proxy answered: the stream, checked as one valid Messages stream.
async fn messages_stream(
    s: &crate::support::Served,
    body: &Value,
) -> (String, mwire::MessagesFinal) {
    let r = post(s, SourceApi::Messages, body).await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let fin =
        mwire::check_stream(&parse_sse(text.as_bytes())).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(fin.error, None, "{text}");
    (text, fin)
}

/// The last message of a request body the mock received.
fn last_message(body: &Value) -> &Value {
    body["messages"].as_array().unwrap().last().unwrap()
}

/// SPEC §23.6: a Messages stream cut mid-answer, thinking off, continues by assistant
/// prefill on a `messages` source with `PREFILL=assistant`: it receives the client's
/// own body plus the delivered text as the last assistant turn, and the client gets the
/// text once in one valid stream. When the delivered text ends in whitespace (which
/// Anthropic refuses as a prefill) or thinking is on, the same source is resumed by
/// replay instead, and never answers a 400.
#[tokio::test]
async fn a_messages_stream_continues_by_prefill_only_where_the_source_takes_it() {
    // (case, chunks, thinking, expect a prefill); `extra`: thinking is turned on by the
    // prefilling source's `EXTRA_BODY`, not by the client.
    let cases: [(&str, [&str; 4], bool, bool); 4] = [
        ("text", ["Alpha", " beta", " gamma", " delta."], false, true),
        (
            "whitespace",
            ["Alpha ", "beta ", "gamma ", "delta."],
            false,
            false,
        ),
        (
            "thinking",
            ["Alpha", " beta", " gamma", " delta."],
            true,
            false,
        ),
        (
            "extra",
            ["Alpha", " beta", " gamma", " delta."],
            false,
            false,
        ),
    ];
    for (case, words, thinking, prefill) in cases {
        let behavior = |fault: Option<Fault>| Behavior {
            fault,
            gap_ms: 40.0,
            reasoning: if thinking {
                vec!["Hm".into(), "m.".into()]
            } else {
                Vec::new()
            },
            ..Behavior::text(&words)
        };
        // Cut after two chunks of text (and the thinking's two before them).
        let chunks = if thinking { 4 } else { 2 };
        let cut = recording_mock(behavior(Some(Fault::ResetAfter { chunks }))).await;
        let next = recording_mock(behavior(None)).await;
        let a = messages_source(&format!("pfa{case}"), &cut);
        let mut b = messages_source(&format!("pfb{case}"), &next)
            .with_priority(1)
            .with_prefill(PrefillDialect::Assistant);
        if case == "extra" {
            let on = json!({"thinking": {"type": "enabled", "budget_tokens": 1024}});
            b = b.with_extra_body(on.as_object().cloned().unwrap_or_default());
        }
        let s = messages_scope(vec![a, b], None).await;
        let (text, fin) = messages_stream(&s, &messages_body(thinking)).await;
        assert_eq!(fin.text, words.concat(), "{case}: {text}");
        let log = next.requests();
        assert_eq!(log.len(), 1, "{case}: one continuation leg, no 400 first");
        assert_eq!(log[0].status, 200, "{case}");
        let last = last_message(&log[0].body);
        if prefill {
            let p = log[0].prefill.clone().expect("a prefill request");
            assert_eq!(p.outcome, PrefillOutcome::Continued, "{case}");
            assert_eq!(last["role"], "assistant", "{case}");
            let prefix = last["content"].as_str().unwrap();
            assert!(
                !prefix.is_empty() && words.concat().starts_with(prefix),
                "{case}: the delivered text is the prefill: {prefix:?}"
            );
            assert!(!prefix.ends_with(char::is_whitespace), "{case}");
            // The rest of the answer came from the prefill leg: it made only that.
            assert_eq!(
                format!("{prefix}{}", log[0].content),
                words.concat(),
                "{case}"
            );
        } else {
            assert_eq!(log[0].prefill, None, "{case}: resumed by replay");
            assert_eq!(last["role"], "user", "{case}: the client's body as sent");
        }
        assert!(
            fin.usage["output_tokens"].as_u64().unwrap_or(0) > 0,
            "{case}"
        );
    }
}

/// SPEC §23.6 and §17.1: a `messages` source that refuses prefill (Claude 4.6+:
/// "does not support assistant message prefill") answers the first resume with its
/// 400; the same call goes on by replay on it, the client gets the whole text once,
/// and the refusal is learned: the next cut call is replayed there at once.
#[tokio::test]
async fn a_source_that_refuses_prefill_is_replayed_and_remembered() {
    let words = ["One", " two", " three", " four."];
    let behavior = |fault: Option<Fault>| Behavior {
        fault,
        gap_ms: 40.0,
        ..Behavior::text(&words)
    };
    let cut = recording_mock(behavior(Some(Fault::ResetAfter { chunks: 2 }))).await;
    let next = recording_mock(behavior(None).with_prefill(PrefillPolicy::reject())).await;
    let a = messages_source("rfa", &cut);
    let b = messages_source("rfb", &next)
        .with_priority(1)
        .with_prefill(PrefillDialect::Assistant);
    let s = messages_scope(vec![a, b], None).await;
    for call in 0..2 {
        let (text, fin) = messages_stream(&s, &messages_body(false)).await;
        assert_eq!(fin.text, words.concat(), "call {call}: {text}");
    }
    let log = next.requests();
    let seen: Vec<(u16, Option<PrefillOutcome>)> = log
        .iter()
        .map(|r| (r.status, r.prefill.as_ref().map(|p| p.outcome)))
        .collect();
    assert_eq!(
        seen,
        vec![
            (400, Some(PrefillOutcome::Rejected)),
            (200, None),
            (200, None)
        ],
        "refused once, then replayed; learned for the second call"
    );
}

/// An Anthropic web-search answer as its stream: text, the server tool's call and
/// result, more text (SPEC §23.6: what a prefill of the text alone would lose).
fn web_search_events() -> Vec<String> {
    let e = |name: &str, data: Value| format!("event: {name}\ndata: {data}\n\n");
    let text = |i: u32, t: &str| {
        e(
            "content_block_delta",
            json!({"type":"content_block_delta","index":i,"delta":{"type":"text_delta","text":t}}),
        )
    };
    let start = |i: u32, block: Value| {
        e(
            "content_block_start",
            json!({"type":"content_block_start","index":i,"content_block":block}),
        )
    };
    let stop = |i: u32| {
        e(
            "content_block_stop",
            json!({"type":"content_block_stop","index":i}),
        )
    };
    vec![
        e(
            "message_start",
            json!({"type":"message_start","message":{"id":"msg_ws","type":"message","role":"assistant","model":"claude-x","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":1}}}),
        ),
        start(0, json!({"type":"text","text":""})),
        text(0, "Let me search."),
        stop(0),
        start(
            1,
            json!({"type":"server_tool_use","id":"srvtoolu_1","name":"web_search","input":{}}),
        ),
        e(
            "content_block_delta",
            json!({"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"query\":\"weather\"}"}}),
        ),
        stop(1),
        start(
            2,
            json!({"type":"web_search_tool_result","tool_use_id":"srvtoolu_1","content":[{"type":"web_search_result","url":"https://example.com","title":"Weather","encrypted_content":"abc"}]}),
        ),
        stop(2),
        start(3, json!({"type":"text","text":""})),
        text(3, "It is"),
        text(3, " sunny"),
        text(3, " today."),
        stop(3),
        e(
            "message_delta",
            json!({"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":30}}),
        ),
        e("message_stop", json!({"type":"message_stop"})),
    ]
}

/// SPEC §23.6: a Messages answer that used a server tool (web search) and is cut in its
/// later text is resumed by replay, never by a prefill of its text alone — which would
/// drop the search call and its results — even on a source that takes prefill.
#[tokio::test]
async fn an_answer_with_a_server_tool_block_is_replayed_not_prefilled() {
    let events = web_search_events();
    // Cut after " sunny": the text so far ends in no whitespace, thinking is off.
    let cut_at = events.iter().position(|e| e.contains(" sunny")).unwrap() + 1;
    let cut = recording_mock(Behavior {
        raw_sse: Some(events[..cut_at].concat()),
        ..Behavior::default()
    })
    .await;
    let next = recording_mock(Behavior {
        raw_sse: Some(events.concat()),
        ..Behavior::default()
    })
    .await;
    let a = messages_source("wsa", &cut);
    let b = messages_source("wsb", &next)
        .with_priority(1)
        .with_prefill(PrefillDialect::Assistant);
    let s = messages_scope(vec![a, b], None).await;
    let (text, fin) = messages_stream(&s, &messages_body(false)).await;
    assert_eq!(fin.text, "Let me search.It is sunny today.", "{text}");
    assert_eq!(
        text.matches("\"web_search_tool_result\"").count(),
        1,
        "the search result once: {text}"
    );
    let log = next.requests();
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].prefill, None, "resumed by replay");
    assert_eq!(last_message(&log[0].body)["role"], "user");
}

/// The mock refuses a whitespace-ended prefill on `/v1/messages` as Anthropic does:
/// what polygw must never send (the test above shows it does not).
#[tokio::test]
async fn the_mock_refuses_a_prefill_ending_in_whitespace() {
    let m = recording_mock(Behavior::text(&["Alpha ", "beta."])).await;
    let r = crate::support::http()
        .post(format!("{}/messages", m.base_url()))
        .header("x-api-key", "k")
        .header("anthropic-version", "2023-06-01")
        .json(&json!({"model": "m", "max_tokens": 10, "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "Alpha "}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["message"], TRAILING_WHITESPACE_MESSAGE);
}

/// SPEC §23.6: a tool call cut mid-arguments, on `messages` and on `responses`
/// sources, is completed on another source: the client keeps the call id it received
/// (the other source names its call otherwise), and gets the arguments whole, once.
#[tokio::test]
async fn a_tool_call_cut_mid_arguments_is_completed_under_its_id() {
    let call = |id: &str| Behavior {
        chunk_count: Some(0),
        gap_ms: 40.0,
        tool_call: Some(ToolCallSpec {
            id: id.into(),
            arguments: r#"{"city":"Paris","unit":"celsius","days":3}"#.into(),
            fragments: 4,
            ..ToolCallSpec::default()
        }),
        ..Behavior::default()
    };
    for api in [SourceApi::Messages, SourceApi::Responses] {
        let case = api.as_str();
        let cut = recording_mock(Behavior {
            fault: Some(Fault::ResetAfter { chunks: 2 }),
            ..call("call_first")
        })
        .await;
        let next = recording_mock(call("call_other")).await;
        let a = source_of(api, &format!("tca{case}"), &cut);
        let b = source_of(api, &format!("tcb{case}"), &next).with_priority(1);
        let s = messages_scope(vec![a, b], None).await;
        let r = post(&s, api, &request(api, true, false)).await;
        assert_eq!(r.status(), 200, "{case}");
        let text = r.text().await.unwrap();
        let got = read(api, true, &text);
        assert_eq!(
            got.calls,
            vec![(
                "get_weather".to_string(),
                json!({"city": "Paris", "unit": "celsius", "days": 3})
            )],
            "{case}: the arguments whole, once: {text}"
        );
        let events = parse_sse(text.as_bytes());
        let id = match api {
            SourceApi::Messages => {
                let fin = mwire::check_stream(&events).unwrap();
                fin.tool_calls[0].id.clone()
            }
            _ => {
                let fin = rwire::check_stream(&events).unwrap();
                let done = fin.response["output"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|i| i["type"] == "function_call")
                    .expect("the call in response.completed")
                    .clone();
                assert_eq!(
                    done["call_id"],
                    fin.tool_calls[0].call_id.as_str(),
                    "{case}"
                );
                fin.tool_calls[0].call_id.clone()
            }
        };
        assert!(
            cut.requests()[0].chunks_sent == 2 && !text.contains("call_other"),
            "{case}: the other source's id is not shown: {text}"
        );
        assert!(
            id.contains("call_first"),
            "{case}: the id the client had: {id}"
        );
        assert_eq!(next.requests().len(), 1, "{case}");
        assert_eq!(next.requests()[0].path, path_of(api), "{case}");
    }
}

/// SPEC §23.6 with SPEC §25.1's defaults: a native stream that falls silent for 20 s
/// mid-answer is continued on the next source by the stall trigger's prior (10 s),
/// with nothing configured; the client gets the whole text once, before the stall
/// would have ended, and the silent leg is cancelled.
#[tokio::test(start_paused = true)]
async fn a_twenty_second_stall_mid_answer_is_rescued_with_auto_defaults() {
    let words = ["Alpha ", "beta ", "gamma ", "delta ", "epsilon."];
    for api in [SourceApi::Messages, SourceApi::Responses] {
        let case = api.as_str();
        let stalled = recording_mock(Behavior {
            stalls: vec![Stall {
                before_chunk: 2,
                ms: 20_000.0,
            }],
            ..Behavior::text(&words)
        })
        .await;
        let next = recording_mock(Behavior::text(&words)).await;
        let a = source_of(api, &format!("sta{case}"), &stalled);
        let b = source_of(api, &format!("stb{case}"), &next).with_priority(1);
        let s = messages_scope(vec![a, b], None).await;
        let mut body = request(api, true, false);
        body.as_object_mut().unwrap().remove("tools");
        let t0 = tokio::time::Instant::now();
        let r = post(&s, api, &body).await;
        assert_eq!(r.status(), 200, "{case}");
        let text = r.text().await.unwrap();
        let took = t0.elapsed();
        let got = read(api, true, &text);
        assert_eq!(got.text, words.concat(), "{case}: {text}");
        assert!(
            took < Duration::from_secs(20),
            "{case}: rescued before the stall ended: {took:?}"
        );
        assert_eq!(next.requests().len(), 1, "{case}: one continuation");
        let log = stalled.wait_for_ended(1, Duration::from_secs(60)).await;
        assert_eq!(log[0].end, EndKind::ClientDisconnected, "{case}: cancelled");
        assert_eq!(log[0].chunks_sent, 2, "{case}");
    }
}

/// A healthy native stream as the mock sends it to `path` for `body` (thinking, text
/// and a tool call), split into its SSE events (each with its blank line).
async fn recorded_events(m: &MockUpstream, api: SourceApi, body: &Value) -> Vec<String> {
    let url = format!("{}{}", m.base_url(), path_of(api).trim_start_matches("/v1"));
    let text = crate::support::http()
        .post(url)
        .header("x-api-key", "k")
        .header("anthropic-version", "2023-06-01")
        .bearer_auth("k")
        .json(body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.split_inclusive("\n\n").map(str::to_string).collect()
}

/// SPEC §23.6 "a cut at every event position of a recorded stream": a native stream of
/// both APIs — thinking or reasoning, text, a tool call — recorded from the mock, is
/// served cut after each of its events (the body ends there) and whole by the
/// fallback. Every cut gives the client one valid stream of its API with the whole
/// text and the tool call once; thinking delivered before a cut is never repeated.
#[tokio::test]
async fn a_native_stream_cut_at_every_event_is_one_valid_stream() {
    let behavior = Behavior {
        reasoning: vec!["Think".into(), "ing.".into()],
        tool_call: Some(ToolCallSpec {
            id: "call_rec".into(),
            fragments: 3,
            ..ToolCallSpec::default()
        }),
        ..Behavior::text(&["Checking", " the", " weather."])
    };
    for api in [SourceApi::Messages, SourceApi::Responses] {
        let case = api.as_str();
        let recorder = recording_mock(behavior.clone()).await;
        let mut body = request(api, true, false);
        if api == SourceApi::Messages {
            body["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
        }
        let events = recorded_events(&recorder, api, &body).await;
        let all = events.concat();
        let kinds = match api {
            SourceApi::Messages => ["thinking_delta", "text_delta", "input_json_delta"],
            _ => [
                "response.reasoning",
                "response.output_text.delta",
                "response.function_call_arguments.delta",
            ],
        };
        for kind in kinds {
            assert!(
                all.contains(kind),
                "{case}: the recording has {kind}: {all}"
            );
        }
        assert!(events.len() > 12, "{case}: {} events", events.len());
        let whole = || Behavior {
            raw_sse: Some(all.clone()),
            ..Behavior::default()
        };
        let a = recording_mock(Behavior::default()).await;
        let b = recording_mock(whole()).await;
        let scope = crate::support::scope_cut_on_purpose(vec![
            source_of(api, &format!("eva{case}"), &a),
            source_of(api, &format!("evb{case}"), &b).with_priority(1),
        ])
        .await;
        let s = crate::support::serve(vec![scope]).await;
        for k in 0..events.len() {
            let what = format!("{case} cut after {k} of {} events", events.len());
            a.reset_log();
            a.push_script(Behavior {
                raw_sse: Some(events[..k].concat()),
                ..Behavior::default()
            });
            let r = post(&s, api, &body).await;
            assert_eq!(r.status(), 200, "{what}");
            let text = r.text().await.unwrap();
            let got = read(api, true, &text);
            assert_eq!(got.text, "Checking the weather.", "{what}: {text}");
            assert_eq!(
                got.calls,
                vec![("get_weather".to_string(), json!({"city": "Paris"}))],
                "{what}: {text}"
            );
            let sse = parse_sse(text.as_bytes());
            let thinking = match api {
                SourceApi::Messages => mwire::check_stream(&sse).unwrap().thinking,
                _ => rwire::check_stream(&sse).unwrap().reasoning,
            };
            assert!(
                "Thinking.".starts_with(&thinking),
                "{what}: thinking never repeated: {thinking:?}"
            );
            assert_eq!(a.requests().len(), 1, "{what}");
        }
    }
}

/// SPEC §23.6 under `STREAM__RESUME=prefill`: the continuation goes to a source that
/// can prefill *this* answer. A Messages client with thinking on is cut; the first
/// fallback (`messages`, `PREFILL=assistant`) cannot take a prefill with thinking on,
/// the second (`chat`, `PREFILL=prefix`) can: it continues the answer, and the first is
/// not asked.
#[tokio::test]
async fn resume_by_prefill_only_picks_a_source_that_can_prefill_this_answer() {
    let words = ["Alpha", " beta", " gamma", " delta."];
    let cut = recording_mock(Behavior {
        fault: Some(Fault::ResetAfter { chunks: 4 }),
        gap_ms: 40.0,
        reasoning: vec!["Hm".into(), "m.".into()],
        ..Behavior::text(&words)
    })
    .await;
    let native = recording_mock(Behavior::text(&words)).await;
    let chat = recording_mock(Behavior::text(&words)).await;
    let sources = vec![
        messages_source("pka", &cut),
        messages_source("pkb", &native)
            .with_priority(1)
            .with_prefill(PrefillDialect::Assistant),
        crate::support::source("pkc", &chat)
            .with_priority(2)
            .with_prefill(PrefillDialect::Prefix),
    ];
    let scope = crate::support::scope_with("LLM", polygw::ScopeKind::Chat, sources, None, |s| {
        s.stream.resume = polygw::core::resume::ResumeSetting::Prefill;
        s.retry.backoff_base = Duration::from_millis(1);
        s.retry.backoff_max = Duration::from_millis(5);
    })
    .await;
    let s = crate::support::serve(vec![scope]).await;
    let (text, fin) = messages_stream(&s, &messages_body(true)).await;
    assert_eq!(fin.text, words.concat(), "{text}");
    assert!(
        native.requests().is_empty(),
        "the messages fallback is not asked"
    );
    let log = chat.requests();
    assert_eq!(log.len(), 1);
    assert_eq!(
        log[0].prefill.as_ref().map(|p| p.outcome),
        Some(PrefillOutcome::Continued),
        "continued by prefill on the chat source"
    );
}
