//! Every client API on every source API (SPEC §23.3, issue 38): chat completions,
//! Messages and Responses clients, each against a scope of `chat`, `messages` and
//! `responses` sources — the 3 × 3 table of docs/SERVE.md — plain and streamed, with a
//! tool round (the source asks for `get_weather`, the client sends its result, the
//! source answers), a 429 on the primary answered by the fallback, and a cut before the
//! first token answered by the fallback. What reached the mock is in the source's API;
//! what the client got is in its own, its streams checked by the dialects' conformance
//! checks (one start, ordered blocks or items, one terminal event).

use polygw::core::source::SourceApi;
use polygw::SourceConfig;
use polygw_dialects::{messages as mwire, parse_sse, responses as rwire};
use polygw_mock_upstream::{Behavior, Fault, MockUpstream, RetryAfter, ToolCallSpec};
use serde_json::{json, Value};

use crate::native::{messages_scope, recording_mock};
use crate::support::*;

const APIS: [SourceApi; 3] = [SourceApi::Chat, SourceApi::Messages, SourceApi::Responses];

pub(crate) fn source_of(api: SourceApi, name: &str, m: &MockUpstream) -> SourceConfig {
    match api {
        SourceApi::Chat => source(name, m),
        SourceApi::Messages => crate::native::messages_source(name, m),
        SourceApi::Responses => crate::native::responses_source(name, m),
    }
}

pub(crate) fn path_of(api: SourceApi) -> &'static str {
    match api {
        SourceApi::Chat => "/v1/chat/completions",
        SourceApi::Messages => "/v1/messages",
        SourceApi::Responses => "/v1/responses",
    }
}

fn tool_call() -> Behavior {
    Behavior {
        chunk_count: Some(0),
        tool_call: Some(ToolCallSpec {
            id: "call_w1".into(),
            fragments: 2,
            ..ToolCallSpec::default()
        }),
        ..Behavior::default()
    }
}

fn answer() -> Behavior {
    Behavior::text(&["It is", " 21 °C", " in Paris."])
}

/// The client's request in its API: the question (and, for the second turn, the tool
/// call and its result).
pub(crate) fn request(api: SourceApi, stream: bool, with_result: bool) -> Value {
    let q = "What is the weather in Paris?";
    match api {
        SourceApi::Chat => {
            let mut messages = vec![json!({"role": "user", "content": q})];
            if with_result {
                messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_w1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}));
                messages
                    .push(json!({"role": "tool", "tool_call_id": "call_w1", "content": "21 °C"}));
            }
            json!({"model": "llm", "stream": stream, "messages": messages, "max_tokens": 300,
                "stream_options": {"include_usage": true},
                "tools": [{"type": "function", "function": {"name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})
        }
        SourceApi::Messages => {
            let mut messages = vec![json!({"role": "user", "content": q})];
            if with_result {
                messages.push(json!({"role": "assistant", "content": [
                    {"type": "tool_use", "id": "call_w1", "name": "get_weather", "input": {"city": "Paris"}}]}));
                messages.push(json!({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_w1", "content": "21 °C"}]}));
            }
            json!({"model": "llm", "stream": stream, "max_tokens": 300, "messages": messages,
                "tools": [{"name": "get_weather", "input_schema": {"type": "object",
                    "properties": {"city": {"type": "string"}}}}]})
        }
        SourceApi::Responses => {
            let mut input = vec![json!({"type": "message", "role": "user", "content": q})];
            if with_result {
                input.push(
                    json!({"type": "function_call", "call_id": "call_w1", "name": "get_weather",
                    "arguments": "{\"city\":\"Paris\"}"}),
                );
                input.push(json!({"type": "function_call_output", "call_id": "call_w1", "output": "21 °C"}));
            }
            json!({"model": "llm", "stream": stream, "store": false, "input": input,
                "max_output_tokens": 300,
                "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object",
                    "properties": {"city": {"type": "string"}}}}]})
        }
    }
}

/// What the client got: its text, its tool calls (name, arguments as JSON), its
/// output tokens.
#[derive(Debug, Default)]
pub(crate) struct Got {
    pub(crate) text: String,
    pub(crate) calls: Vec<(String, Value)>,
    pub(crate) output_tokens: u64,
}

pub(crate) async fn post(s: &Served, api: SourceApi, body: &Value) -> reqwest::Response {
    let url = format!("{}{}", s.v1(), path_of(api).trim_start_matches("/v1"));
    let mut rb = http().post(url).json(body);
    rb = match api {
        SourceApi::Messages => rb
            .header("x-api-key", "k")
            .header("anthropic-version", "2023-06-01"),
        _ => rb.bearer_auth("k"),
    };
    rb.send().await.unwrap()
}

pub(crate) fn read(api: SourceApi, stream: bool, text: &str) -> Got {
    let mut got = Got::default();
    match (api, stream) {
        (SourceApi::Chat, false) => {
            let v: Value = serde_json::from_str(text).unwrap();
            let m = &v["choices"][0]["message"];
            got.text = m["content"].as_str().unwrap_or("").to_string();
            for c in m["tool_calls"].as_array().into_iter().flatten() {
                let args = c["function"]["arguments"].as_str().unwrap();
                got.calls.push((
                    c["function"]["name"].as_str().unwrap().to_string(),
                    serde_json::from_str(args).unwrap(),
                ));
            }
            got.output_tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        }
        (SourceApi::Chat, true) => {
            let mut args: Vec<(String, String)> = Vec::new();
            let done = text.contains("data: [DONE]");
            for (_, v) in crate::native::events(text) {
                if let Some(u) = v["usage"].as_object() {
                    got.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
                }
                let Some(d) = v["choices"].get(0).map(|c| &c["delta"]) else {
                    continue;
                };
                if let Some(t) = d["content"].as_str() {
                    got.text.push_str(t);
                }
                for c in d["tool_calls"].as_array().into_iter().flatten() {
                    let i = c["index"].as_u64().unwrap() as usize;
                    if args.len() <= i {
                        args.resize(i + 1, Default::default());
                    }
                    if let Some(n) = c["function"]["name"].as_str() {
                        args[i].0.push_str(n);
                    }
                    if let Some(a) = c["function"]["arguments"].as_str() {
                        args[i].1.push_str(a);
                    }
                }
            }
            assert!(done, "the chat stream ends with [DONE]: {text}");
            got.calls = args
                .into_iter()
                .map(|(n, a)| (n, serde_json::from_str(&a).unwrap()))
                .collect();
        }
        (SourceApi::Messages, false) => {
            let v: Value = serde_json::from_str(text).unwrap();
            for b in v["content"].as_array().unwrap() {
                match b["type"].as_str().unwrap() {
                    "text" => got.text.push_str(b["text"].as_str().unwrap()),
                    "tool_use" => got
                        .calls
                        .push((b["name"].as_str().unwrap().to_string(), b["input"].clone())),
                    _ => {}
                }
            }
            got.output_tokens = v["usage"]["output_tokens"].as_u64().unwrap_or(0);
        }
        (SourceApi::Messages, true) => {
            let f = mwire::check_stream(&parse_sse(text.as_bytes()))
                .unwrap_or_else(|e| panic!("{e}: {text}"));
            got.text = f.text.clone();
            got.calls = f
                .tool_calls
                .iter()
                .map(|t| (t.name.clone(), t.input.clone()))
                .collect();
            got.output_tokens = f.usage["output_tokens"].as_u64().unwrap_or(0);
        }
        (SourceApi::Responses, false) => {
            let v: Value = serde_json::from_str(text).unwrap();
            for i in v["output"].as_array().unwrap() {
                match i["type"].as_str().unwrap() {
                    "message" => {
                        for c in i["content"].as_array().unwrap() {
                            got.text.push_str(c["text"].as_str().unwrap_or(""));
                        }
                    }
                    "function_call" => got.calls.push((
                        i["name"].as_str().unwrap().to_string(),
                        serde_json::from_str(i["arguments"].as_str().unwrap()).unwrap(),
                    )),
                    _ => {}
                }
            }
            got.output_tokens = v["usage"]["output_tokens"].as_u64().unwrap_or(0);
        }
        (SourceApi::Responses, true) => {
            let f = rwire::check_stream(&parse_sse(text.as_bytes()))
                .unwrap_or_else(|e| panic!("{e}: {text}"));
            got.text = f.text.clone();
            got.calls = f
                .tool_calls
                .iter()
                .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap()))
                .collect();
            got.output_tokens = f.usage["output_tokens"].as_u64().unwrap_or(0);
        }
    }
    got
}

/// The tool result as the source's API carries it, in the second request it received.
fn result_reached(api: SourceApi, body: &Value) -> bool {
    let s = body.to_string();
    match api {
        SourceApi::Chat => body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["role"] == "tool" && m["tool_call_id"] == "call_w1"),
        SourceApi::Messages => s.contains(r#""type":"tool_result""#) && s.contains("call_w1"),
        SourceApi::Responses => {
            s.contains(r#""type":"function_call_output""#) && s.contains("call_w1")
        }
    }
}

/// One cell: a tool round, plain and streamed.
async fn tool_round(client: SourceApi, src: SourceApi) {
    for stream in [false, true] {
        let cell = format!(
            "{} client on a {} source, stream={stream}",
            client.as_str(),
            src.as_str()
        );
        let m = recording_mock(answer()).await;
        m.push_script(tool_call());
        let name = format!("t{}{}{stream}", client.as_str(), src.as_str());
        let s = messages_scope(vec![source_of(src, &name, &m)], None).await;
        let r = post(&s, client, &request(client, stream, false)).await;
        assert_eq!(r.status(), 200, "{cell}");
        let text = r.text().await.unwrap();
        let got = read(client, stream, &text);
        assert_eq!(
            got.calls,
            [("get_weather".to_string(), json!({"city": "Paris"}))],
            "{cell}: {text}"
        );
        let r = post(&s, client, &request(client, stream, true)).await;
        assert_eq!(r.status(), 200, "{cell}");
        let text = r.text().await.unwrap();
        let got = read(client, stream, &text);
        assert_eq!(got.text, "It is 21 °C in Paris.", "{cell}: {text}");
        assert!(got.calls.is_empty(), "{cell}");
        assert!(
            got.output_tokens > 0,
            "{cell}: usage reaches the client: {text}"
        );
        let log = m.requests();
        assert_eq!(log.len(), 2, "{cell}");
        for r in &log {
            assert_eq!(r.path, path_of(src), "{cell}: the source's own API");
            assert_eq!(r.status, 200, "{cell}: {:#}", r.body);
        }
        assert!(
            result_reached(src, &log[1].body),
            "{cell}: {:#}",
            log[1].body
        );
    }
}

/// One cell's faults: a 429 on the primary and a cut before the first token, each
/// answered by the fallback.
async fn faults(client: SourceApi, src: SourceApi) {
    let limited = Behavior {
        retry_after: Some(RetryAfter::Seconds(30.0)),
        ..Behavior::status(429)
    };
    let cut = Behavior {
        fault: Some(Fault::ResetBeforeHeaders),
        ..answer()
    };
    for (what, bad, stream) in [("429", limited, false), ("cut", cut, true)] {
        let cell = format!(
            "{} client on {} sources, {what}",
            client.as_str(),
            src.as_str()
        );
        let primary = recording_mock(bad).await;
        let fallback = recording_mock(answer()).await;
        // Names of their own: a 429's cooldown is the process's, by scope and source.
        let tag = format!("{}{}{what}", client.as_str(), src.as_str());
        let a = source_of(src, &format!("fa{tag}"), &primary);
        let b = source_of(src, &format!("fb{tag}"), &fallback).with_priority(1);
        let s = messages_scope(vec![a, b], None).await;
        let r = post(&s, client, &request(client, stream, false)).await;
        assert_eq!(r.status(), 200, "{cell}");
        let text = r.text().await.unwrap();
        assert_eq!(
            read(client, stream, &text).text,
            "It is 21 °C in Paris.",
            "{cell}"
        );
        if what == "429" {
            assert_eq!(primary.requests().len(), 1, "{cell}");
        }
        assert_eq!(fallback.requests().len(), 1, "{cell}");
        assert_eq!(fallback.requests()[0].path, path_of(src), "{cell}");
    }
}

#[tokio::test]
async fn chat_clients_on_every_source_api() {
    for src in APIS {
        tool_round(SourceApi::Chat, src).await;
        faults(SourceApi::Chat, src).await;
    }
}

#[tokio::test]
async fn messages_clients_on_every_source_api() {
    for src in APIS {
        tool_round(SourceApi::Messages, src).await;
        faults(SourceApi::Messages, src).await;
    }
}

#[tokio::test]
async fn responses_clients_on_every_source_api() {
    for src in APIS {
        tool_round(SourceApi::Responses, src).await;
        faults(SourceApi::Responses, src).await;
    }
}

/// What a target cannot express is named (SPEC §23.3): a chat request with `logprobs`
/// and `seed` to a `messages` source says so in `x-polygw-untranslated`.
#[tokio::test]
async fn what_a_source_api_cannot_express_is_named() {
    let m = recording_mock(answer()).await;
    let s = messages_scope(vec![crate::native::messages_source("a", &m)], None).await;
    let r = post(
        &s,
        SourceApi::Chat,
        &json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}],
            "logprobs": true, "seed": 7}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-polygw-untranslated"],
        "messages: logprobs, messages: seed"
    );
    let sent = &m.requests()[0].body;
    assert!(sent.get("logprobs").is_none() && sent.get("seed").is_none());
    assert_eq!(
        sent["max_tokens"], 4096,
        "the source's cap, required by the API"
    );
}

/// A scope that mixes a chat source and a `messages` source fails over between them
/// mid-stream for a chat client (SPEC §23.3): the chat source's stream is cut after two
/// chunks, the `messages` source continues it (verified replay of its translation),
/// and the client receives the answer once, neither duplicated nor missing.
#[tokio::test]
async fn a_chat_stream_cut_on_a_chat_source_continues_on_a_messages_source() {
    let words = ["one ", "two ", "three ", "four ", "five"];
    let chat = recording_mock(Behavior {
        fault: Some(Fault::ResetAfter { chunks: 2 }),
        ..Behavior::text(&words)
    })
    .await;
    let native = recording_mock(Behavior::text(&words)).await;
    let a = source("mixa", &chat);
    let b = crate::native::messages_source("mixb", &native).with_priority(1);
    let s = messages_scope(vec![a, b], None).await;
    let r = post(
        &s,
        SourceApi::Chat,
        &json!({"model": "llm", "stream": true, "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "count"}]}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let got = read(SourceApi::Chat, true, &text);
    assert_eq!(got.text, words.concat(), "{text}");
    assert_eq!(chat.requests().len(), 1);
    let log = native.requests();
    assert_eq!(log.len(), 1, "one continuation leg");
    assert_eq!(log[0].path, "/v1/messages");
    assert!(got.output_tokens > 0, "{text}");
}

/// SPEC §23.6: a native stream cut mid-answer — a reset after each chunk, an
/// `overloaded_error` event (Messages) or `response.failed` (Responses) — continues on
/// the next source of the client's API, and the client receives one valid stream in its
/// API: Messages with one `message_start`, blocks numbered in order and one
/// `message_stop`; Responses with contiguous sequence numbers and one
/// `response.completed` carrying the whole output; the text once, neither duplicated nor
/// missing. The continuation is a verified replay (the client's body is sent as is).
#[tokio::test]
async fn a_native_stream_cut_mid_answer_continues_on_the_next_source() {
    let words = ["Alpha ", "beta ", "gamma ", "delta ", "epsilon."];
    for api in [SourceApi::Messages, SourceApi::Responses] {
        let mut faults: Vec<(String, Fault)> = (1..words.len() as u32)
            .map(|c| (format!("reset after {c}"), Fault::ResetAfter { chunks: c }))
            .collect();
        faults.push((
            "error event".into(),
            Fault::ErrorFrameAt {
                chunk: 2,
                error: None,
            },
        ));
        for (what, fault) in faults {
            let case = format!("{} {what}", api.as_str());
            // Chunks 40 ms apart: the first ones reach the client before the cut.
            let cut = recording_mock(Behavior {
                fault: Some(fault),
                gap_ms: 40.0,
                ..Behavior::text(&words)
            })
            .await;
            let next = recording_mock(Behavior::text(&words)).await;
            let tag = format!("{}{}", api.as_str(), what.replace(' ', ""));
            let a = source_of(api, &format!("ra{tag}"), &cut);
            let b = source_of(api, &format!("rb{tag}"), &next).with_priority(1);
            let s = messages_scope(vec![a, b], None).await;
            let mut body = request(api, true, false);
            body.as_object_mut().unwrap().remove("tools");
            let r = post(&s, api, &body).await;
            assert_eq!(r.status(), 200, "{case}");
            let text = r.text().await.unwrap();
            let got = read(api, true, &text);
            assert_eq!(got.text, words.concat(), "{case}: {text}");
            assert!(got.output_tokens > 0, "{case}");
            let names: Vec<String> = parse_sse(text.as_bytes())
                .into_iter()
                .map(|e| e.event)
                .collect();
            let count = |n: &str| names.iter().filter(|x| *x == n).count();
            match api {
                SourceApi::Messages => {
                    assert_eq!(
                        (count("message_start"), count("message_stop")),
                        (1, 1),
                        "{case}: {names:?}"
                    );
                    assert_eq!(count("error"), 0, "{case}");
                }
                _ => {
                    let added = count("response.output_item.added");
                    assert_eq!(added, 1, "{case}: one message item, continued: {names:?}");
                    assert_eq!(count("response.created"), 1, "{case}: {names:?}");
                    assert_eq!(count("response.completed"), 1, "{case}");
                    assert_eq!(count("response.failed"), 0, "{case}");
                }
            }
            assert_eq!(next.requests().len(), 1, "{case}: one continuation");
            assert_eq!(next.requests()[0].path, path_of(api), "{case}");
            // The usage shown describes the answer: the last leg's context and the
            // output delivered (the replay made all of it), not the legs' sum.
            let billed = next.requests()[0].usage.expect("the mock reports usage");
            let shown = parse_sse(text.as_bytes())
                .into_iter()
                .rev()
                .find_map(|e| match api {
                    SourceApi::Messages => {
                        (e.event == "message_delta").then(|| e.data["usage"].clone())
                    }
                    _ => (e.event == "response.completed")
                        .then(|| e.data["response"]["usage"].clone()),
                })
                .unwrap();
            assert_eq!(
                shown["input_tokens"], billed.prompt_tokens,
                "{case}: {shown}"
            );
            assert_eq!(
                shown["output_tokens"], billed.completion_tokens,
                "{case}: {shown}"
            );
        }
    }
}

/// SPEC §23.6: a replay that does not reproduce what the client received ends the
/// stream with the original failure — in the client's API, after exactly the text it
/// had (nothing duplicated, nothing missing) — and a cut inside a thinking block is
/// closed for the client without a signature, the answer continuing after it.
#[tokio::test]
async fn a_diverging_replay_ends_honestly_and_a_cut_thinking_block_closes_unsigned() {
    let words = ["Alpha ", "beta ", "gamma."];
    for api in [SourceApi::Messages, SourceApi::Responses] {
        let case = api.as_str();
        let cut = recording_mock(Behavior {
            fault: Some(Fault::ResetAfter { chunks: 2 }),
            gap_ms: 40.0,
            ..Behavior::text(&words)
        })
        .await;
        // Another answer altogether: the replay diverges.
        let other = recording_mock(Behavior::text(&["Something", " else."])).await;
        let a = source_of(api, &format!("dva{case}"), &cut);
        let b = source_of(api, &format!("dvb{case}"), &other).with_priority(1);
        let s = messages_scope(vec![a, b], None).await;
        let mut body = request(api, true, false);
        body.as_object_mut().unwrap().remove("tools");
        let r = post(&s, api, &body).await;
        assert_eq!(r.status(), 200, "{case}");
        let text = r.text().await.unwrap();
        let events = parse_sse(text.as_bytes());
        let names: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
        let delivered: String = events
            .iter()
            .filter_map(|e| match api {
                SourceApi::Messages => e.data["delta"]["text"].as_str(),
                _ => (e.event == "response.output_text.delta")
                    .then(|| e.data["delta"].as_str())
                    .flatten(),
            })
            .collect();
        assert_eq!(delivered, "Alpha beta ", "{case}: {text}");
        assert!(
            !text.contains("Something"),
            "{case}: the diverging leg is not shown"
        );
        let last = *names.last().unwrap();
        assert!(
            last == "error" || last == "response.failed",
            "{case}: ends with the failure: {names:?}"
        );
    }
    // A cut inside a thinking block (Messages, thinking on).
    let behavior = |fault: Option<Fault>| Behavior {
        reasoning: vec!["Let me".into(), " think".into()],
        fault,
        gap_ms: 40.0,
        ..Behavior::text(&["Fine", " then."])
    };
    let cut = recording_mock(behavior(Some(Fault::ResetAfter { chunks: 1 }))).await;
    let next = recording_mock(behavior(None)).await;
    let a = crate::native::messages_source("thka", &cut);
    let b = crate::native::messages_source("thkb", &next).with_priority(1);
    let s = messages_scope(vec![a, b], None).await;
    let body = json!({"model": "llm", "stream": true, "max_tokens": 2000,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "go"}]});
    let r = post(&s, SourceApi::Messages, &body).await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let events = parse_sse(text.as_bytes());
    let fin = mwire::check_stream(&events).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(fin.text, "Fine then.", "{text}");
    // The thinking the client received before the cut, closed there: the replay's
    // thinking is verified, not shown again.
    assert_eq!(fin.thinking, "Let me", "{text}");
    assert!(
        !events
            .iter()
            .any(|e| e.data["delta"]["type"] == "signature_delta"),
        "the cut thinking block is closed without a signature: {text}"
    );
    assert_eq!(
        events.iter().filter(|e| e.event == "message_stop").count(),
        1
    );
}
