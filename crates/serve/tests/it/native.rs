//! Issue 35 (SPEC §23.1–23.4): `messages` sources. A Messages client's request reaches
//! the source as it sent it (model aside), with its query string and `anthropic-*`
//! headers; the source's answer and events reach the client as the source sent them;
//! faults before the first content event fail over; content rejections pass unmodified;
//! usage with cache reads and writes is priced exactly.

use std::sync::Arc;

use polygw::core::source::SourceApi;
use polygw::{ScopeKind, SourceConfig};
use polygw_mock_upstream::{Behavior, Fault, MockConfig, MockUpstream, RetryAfter};
use polygw_testkit::fakes::RecordingTelemetry;
use serde_json::{json, Value};

use crate::support::*;

pub(crate) async fn recording_mock(default: Behavior) -> MockUpstream {
    let m = MockUpstream::start(MockConfig {
        record_bodies: true,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    m.set_default(default);
    m
}

/// A `messages` source `{name}-0` on the mock, at its base URL without `/v1` (as
/// vendors document their Anthropic endpoints).
pub(crate) fn messages_source(name: &str, m: &MockUpstream) -> SourceConfig {
    let base = m.base_url().trim_end_matches("/v1").to_string();
    SourceConfig::new(name, 0, base, UPSTREAM_KEY, format!("claude-{name}"))
        .with_api(SourceApi::Messages)
}

pub(crate) async fn messages_scope(
    sources: Vec<SourceConfig>,
    t: Option<Arc<RecordingTelemetry>>,
) -> Served {
    let scope = scope_with("LLM", ScopeKind::Chat, sources, t, |s| {
        s.retry.backoff_base = std::time::Duration::from_millis(1);
        s.retry.backoff_max = std::time::Duration::from_millis(5);
    })
    .await;
    serve(vec![scope]).await
}

/// A request shaped like Claude Code's: system blocks with `cache_control`, thinking,
/// 25 tools, `context_management`, `output_config`, metadata and a field polygw has
/// never heard of.
fn claude_code_body(stream: bool) -> Value {
    let tools: Vec<Value> = (0..25)
        .map(|i| {
            json!({"name": format!("Tool{i}"), "description": format!("tool {i}"),
            "input_schema": {"type": "object", "properties": {"p": {"type": "string"}}}})
        })
        .collect();
    json!({
        "model": "llm",
        "max_tokens": 32000,
        "stream": stream,
        "system": [
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Project notes.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hello there", "cache_control": {"type": "ephemeral"}}]}
        ],
        "thinking": {"type": "enabled", "budget_tokens": 16000},
        "tools": tools,
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc_account_x_session_y"},
        "a_field_from_the_future": {"x": [1, 2, 3]}
    })
}

pub(crate) async fn post_messages(s: &Served, body: &Value) -> reqwest::Response {
    http()
        .post(format!("{}/messages?beta=true", s.v1()))
        .header("anthropic-version", "2023-06-01")
        .header(
            "anthropic-beta",
            "interleaved-thinking-2025-05-14,context-management-2025-06-27",
        )
        .header("x-api-key", "client-key")
        .json(body)
        .send()
        .await
        .unwrap()
}

/// SSE events of a body: (event name, data as JSON).
pub(crate) fn events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut name = String::new();
            let mut data = String::new();
            for l in e.lines() {
                if let Some(v) = l.strip_prefix("event: ") {
                    name = v.to_string();
                } else if let Some(v) = l.strip_prefix("data: ") {
                    data.push_str(v);
                }
            }
            (name, serde_json::from_str(&data).unwrap_or(Value::Null))
        })
        .collect()
}

#[tokio::test]
async fn a_claude_code_request_reaches_the_source_unchanged_but_its_model() {
    for stream in [false, true] {
        let m = recording_mock(Behavior::text(&["Hi", " there"])).await;
        let s = messages_scope(vec![messages_source("a", &m)], None).await;
        let body = claude_code_body(stream);
        let r = post_messages(&s, &body).await;
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        let reqs = m.requests();
        assert_eq!(reqs.len(), 1);
        let got = &reqs[0];
        assert_eq!(got.path, "/v1/messages");
        assert_eq!(got.query.as_deref(), Some("beta=true"));
        let mut want = body.clone();
        want["model"] = json!("claude-a");
        assert_eq!(got.body, want, "stream={stream}");
        assert!(
            got.x_api_key && !got.authorization,
            "a messages source gets x-api-key"
        );
        let h: Vec<(&str, &str)> = got
            .anthropic_headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert!(h.contains(&("anthropic-version", "2023-06-01")), "{h:?}");
        assert!(
            h.contains(&(
                "anthropic-beta",
                "interleaved-thinking-2025-05-14,context-management-2025-06-27"
            )),
            "{h:?}"
        );
        if stream {
            // The source's events as it sent them: its message id, its ping, one
            // message_start, one message_stop.
            let ev = events(&text);
            let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
            assert_eq!(names.iter().filter(|n| **n == "message_start").count(), 1);
            assert_eq!(names.iter().filter(|n| **n == "message_stop").count(), 1);
            assert_eq!(names.last(), Some(&"message_stop"));
            assert!(names.contains(&"ping"));
            assert!(ev[0].1["message"]["id"]
                .as_str()
                .unwrap()
                .starts_with("msg_mock-"));
            let text: String = ev
                .iter()
                .filter_map(|(_, d)| d["delta"]["text"].as_str())
                .collect();
            assert_eq!(text, "Hi there");
        } else {
            let v: Value = serde_json::from_str(&text).unwrap();
            assert!(v["id"].as_str().unwrap().starts_with("msg_mock-"), "{v}");
            assert_eq!(v["content"][0]["text"], "Hi there");
            assert_eq!(v["stop_reason"], "end_turn");
        }
    }
}

/// A `messages` source's 529, its 429 with `Retry-After`, an `overloaded_error` event
/// before the first content event, and a cut before the first token: each fails over to
/// the second source, and the client gets that source's answer.
#[tokio::test]
async fn faults_before_the_first_content_event_fail_over() {
    let faults = [
        Behavior::status(529),
        Behavior {
            retry_after: Some(RetryAfter::Seconds(30.0)),
            ..Behavior::status(429)
        },
        Behavior::fault(Fault::ErrorFrameAt {
            chunk: 0,
            error: None,
        }),
        Behavior::fault(Fault::ResetAfter { chunks: 0 }),
    ];
    for (i, fault) in faults.into_iter().enumerate() {
        let bad = recording_mock(fault.clone()).await;
        let good = recording_mock(Behavior::text(&["fine"])).await;
        // Sources of their own: breakers and cooldowns are kept per process, scope and
        // source, and the 429 above put its source in a cooldown.
        let mut a = messages_source(&format!("a{i}"), &bad);
        a.priority = 0;
        let mut b = messages_source(&format!("b{i}"), &good);
        b.priority = 1;
        let s = messages_scope(vec![a, b], None).await;
        let mut body = claude_code_body(true);
        body["tools"] = json!([]);
        // Its own session: affinity would send a known session to its last source.
        body["metadata"]["user_id"] = json!(format!("session-{i}"));
        let r = post_messages(&s, &body).await;
        assert_eq!(r.status(), 200, "{fault:?}");
        let ev = events(&r.text().await.unwrap());
        let text: String = ev
            .iter()
            .filter_map(|(_, d)| d["delta"]["text"].as_str())
            .collect();
        assert_eq!(text, "fine", "{fault:?}");
        assert_eq!(
            ev.iter().filter(|(n, _)| n == "message_start").count(),
            1,
            "{fault:?} {ev:?}"
        );
        assert!(ev.iter().all(|(n, _)| n != "error"), "{fault:?}: {ev:?}");
        assert_eq!(bad.requests().len(), 1, "{fault:?}");
        assert_eq!(good.requests().len(), 1, "{fault:?}");
    }
}

/// A content rejection reaches the client unmodified (status, type, message); a
/// source's 401 is the source's fault, not the client's: a 5xx in Anthropic's shape
/// that names no key.
#[tokio::test]
async fn content_rejections_pass_and_credential_failures_do_not() {
    // Anthropic's longest thinking rejection is ~450 bytes; this one is longer still.
    let wording = format!(
        "messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found \
         `tool_use`. When `thinking` is enabled, a final `assistant` message must start with a \
         thinking block. {}",
        "Please consult our documentation. ".repeat(30).trim_end()
    );
    let m = recording_mock(Behavior {
        error_message: Some(wording.clone()),
        ..Behavior::status(400)
    })
    .await;
    let s = messages_scope(vec![messages_source("a", &m)], None).await;
    let r = post_messages(&s, &claude_code_body(false)).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["message"], wording.as_str(), "every word of it");

    let m = recording_mock(Behavior::status(401)).await;
    let s = messages_scope(vec![messages_source("a", &m)], None).await;
    let r = post_messages(&s, &claude_code_body(false)).await;
    assert_eq!(r.status(), 502);
    assert_eq!(r.headers()["x-should-retry"], "false");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("a-0"), "names the source: {msg}");
    assert!(!msg.contains(UPSTREAM_KEY));
}

/// Anthropic's usage (input without the cache, cache reads, 5-minute and 1-hour cache
/// writes, output) is counted and priced exactly: each part at its own price.
#[tokio::test]
async fn cache_reads_and_writes_are_priced_exactly() {
    let sse = [
        r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude-a","content":[],"stop_reason":null,"usage":{"input_tokens":10,"cache_read_input_tokens":1000,"cache_creation_input_tokens":200,"cache_creation":{"ephemeral_5m_input_tokens":150,"ephemeral_1h_input_tokens":50},"output_tokens":1}}}"#,
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"ok"}}"#,
        r#"{"type":"content_block_stop","index":0}"#,
        r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":50}}"#,
        r#"{"type":"message_stop"}"#,
    ];
    let raw: String = sse
        .iter()
        .map(|d| {
            let name = serde_json::from_str::<Value>(d).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_string();
            format!("event: {name}\ndata: {d}\n\n")
        })
        .collect();
    let m = recording_mock(Behavior {
        raw_sse: Some(raw),
        ..Behavior::default()
    })
    .await;
    let t = RecordingTelemetry::new();
    let src = messages_source("a", &m)
        .with_prices(3.0, 15.0)
        .with_cached_input_price(0.3)
        .with_cache_write_price(3.75)
        .with_cache_write_1h_price(6.0);
    let s = messages_scope(vec![src], Some(t.clone())).await;
    let mut body = claude_code_body(true);
    body["tools"] = json!([]);
    let r = post_messages(&s, &body).await;
    assert_eq!(r.status(), 200);
    let ev = events(&r.text().await.unwrap());
    assert_eq!(ev.len(), 6, "every event, as sent");
    drop(s);
    let rows = t.rows();
    let row = rows
        .iter()
        .find(|r| r.ok && r.source.is_some())
        .expect("a success row");
    assert_eq!(row.prompt_tokens, Some(1210));
    assert_eq!(row.completion_tokens, Some(50));
    assert_eq!(row.cached_prompt_tokens, Some(1000));
    assert_eq!(row.cache_write_tokens, Some(200));
    // 10 × 3 + 1000 × 0.3 + 150 × 3.75 (5-minute writes) + 50 × 6 (1-hour writes)
    // + 50 × 15, per million.
    let want = (10.0 * 3.0 + 1000.0 * 0.3 + 150.0 * 3.75 + 50.0 * 6.0 + 50.0 * 15.0) / 1e6;
    let cost = row.cost.expect("priced");
    assert!((cost - want).abs() < 1e-12, "{cost} != {want}");
}

/// A scope of a chat and a messages source serves a Messages client from either: the
/// messages source's events pass as sent, the chat source's answer is translated.
#[tokio::test]
async fn a_mixed_scope_serves_a_messages_client_from_either_source() {
    let chat = recording_mock(Behavior::text(&["from", " chat"])).await;
    let native = recording_mock(Behavior::status(529)).await;
    let mut a = messages_source("a", &native);
    a.priority = 0;
    let mut b = source("b", &chat);
    b.priority = 1;
    let s = messages_scope(vec![a, b], None).await;
    let mut body = claude_code_body(true);
    body["tools"] = json!([]);
    body.as_object_mut().unwrap().remove("thinking");
    let r = post_messages(&s, &body).await;
    assert_eq!(r.status(), 200);
    let ev = events(&r.text().await.unwrap());
    let text: String = ev
        .iter()
        .filter_map(|(_, d)| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, "from chat");
    assert_eq!(ev.iter().filter(|(n, _)| n == "message_start").count(), 1);
    assert_eq!(chat.requests()[0].path, "/v1/chat/completions");
}

/// `GET /v1/models` with `anthropic-version` answers in Anthropic's shape, concrete
/// names only (SPEC §23.7); without it, OpenAI's list as before.
#[tokio::test]
async fn an_anthropic_client_lists_models_in_its_shape() {
    let m = recording_mock(Behavior::text(&["x"])).await;
    let mut scope = scope_with(
        "LLM",
        ScopeKind::Chat,
        vec![messages_source("a", &m)],
        None,
        |_| {},
    )
    .await;
    scope.aliases = vec!["claude-sonnet-4-5".into(), "claude-*".into()];
    let s = serve(vec![scope]).await;
    let get = |path: &'static str, anthropic: bool| {
        let mut rb = http().get(format!("{}{path}", s.v1()));
        if anthropic {
            rb = rb.header("anthropic-version", "2023-06-01");
        }
        rb.send()
    };
    let v: Value = get("/models", true).await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["LLM", "claude-sonnet-4-5"], "{v}");
    assert_eq!(v["data"][0]["type"], "model");
    assert_eq!(v["has_more"], false);
    assert_eq!(v["first_id"], "LLM");
    assert_eq!(v["last_id"], "claude-sonnet-4-5");
    let v: Value = get("/models/claude-opus-4", true)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (v["type"].as_str(), v["id"].as_str()),
        (Some("model"), Some("claude-opus-4"))
    );
    let r = get("/models/gpt-4o", true).await.unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "not_found_error");
    let v: Value = get("/models", false).await.unwrap().json().await.unwrap();
    assert_eq!(v["object"], "list");
}

/// Two scopes: `LLM` over a native source, `PLAIN` over a chat source on `chat`.
async fn native_beside_plain(native: SourceConfig, chat: &MockUpstream) -> Served {
    let native = scope_with("LLM", ScopeKind::Chat, vec![native], None, |_| {}).await;
    let plain = scope_with(
        "PLAIN",
        ScopeKind::Chat,
        vec![source("c", chat)],
        None,
        |_| {},
    )
    .await;
    serve(vec![native, plain]).await
}

/// `count_tokens` goes to the scope's `messages` source (its model, the client's
/// headers) and answers as it does; a scope without one answers polygw's estimate.
#[tokio::test]
async fn count_tokens_is_forwarded_to_a_messages_source() {
    let m = recording_mock(Behavior::text(&["x"])).await;
    let chat = recording_mock(Behavior::text(&["x"])).await;
    let s = native_beside_plain(messages_source("a", &m), &chat).await;
    let body = |model: &str| {
        json!({"model": model, "system": "be brief",
            "messages": [{"role": "user", "content": "How many tokens is this question, exactly?"}]})
    };
    let r = http()
        .post(format!("{}/messages/count_tokens", s.v1()))
        .header("anthropic-version", "2023-06-01")
        .header("anthropic-beta", "token-counting-2024-11-01")
        .json(&body("llm"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers().get("x-polygw-usage-source").is_none(),
        "the source's count"
    );
    let v: Value = r.json().await.unwrap();
    let log = m.requests();
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].path, "/v1/messages/count_tokens");
    assert_eq!(log[0].body["model"], "claude-a");
    assert_eq!(log[0].body["system"], "be brief");
    assert!(log[0]
        .anthropic_headers
        .contains(&("anthropic-beta".into(), "token-counting-2024-11-01".into())));
    assert_eq!(v["input_tokens"], 11, "the mock's count: ⌈42 / 4⌉");

    let r = http()
        .post(format!("{}/messages/count_tokens", s.v1()))
        .json(&body("plain"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-polygw-usage-source"], "estimated");
    assert!(chat.requests().is_empty());
}

/// A `responses` source at the mock's `/v1` base URL.
pub(crate) fn responses_source(name: &str, m: &MockUpstream) -> SourceConfig {
    SourceConfig::new(name, 0, m.base_url(), UPSTREAM_KEY, format!("gpt-{name}"))
        .with_api(SourceApi::Responses)
}

/// A request shaped like the Codex CLI's: stateless, `instructions`, `developer` and
/// user message items, a function and a custom tool, `include`, `reasoning`,
/// `prompt_cache_key`, and a field polygw has never heard of.
fn codex_body(stream: bool) -> Value {
    json!({
        "model": "llm",
        "instructions": "You are Codex.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: read-only"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}
        ],
        "tools": [
            {"type": "function", "name": "shell", "description": "run", "strict": false,
             "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}},
            {"type": "custom", "name": "apply_patch", "description": "patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}}
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": false,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": false,
        "stream": stream,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-abc",
        "a_field_from_the_future": true
    })
}

/// Issue 35 (SPEC §23.2): a Codex-shaped Responses request reaches a `responses` source
/// unchanged but its model; its events and answer reach the client as sent (the
/// source's response id, its sequence numbers); a 500 before the first content event
/// fails over to the second source.
#[tokio::test]
async fn a_codex_request_reaches_a_responses_source_unchanged_but_its_model() {
    for stream in [false, true] {
        let bad = recording_mock(Behavior::status(500)).await;
        let m = recording_mock(Behavior {
            reasoning: vec!["Listing".into()],
            ..Behavior::text(&["Here", " they", " are"])
        })
        .await;
        let mut a = responses_source(&format!("a{stream}"), &bad);
        a.priority = 0;
        let b = responses_source(&format!("b{stream}"), &m).with_priority(1);
        let s = messages_scope(vec![a, b], None).await;
        let body = codex_body(stream);
        let r = http()
            .post(format!("{}/responses", s.v1()))
            .bearer_auth("client-key")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "stream={stream}");
        let text = r.text().await.unwrap();
        let got = m.requests();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].path, "/v1/responses");
        let mut want = body.clone();
        want["model"] = json!(format!("gpt-b{stream}"));
        assert_eq!(got[0].body, want, "stream={stream}");
        assert!(
            got[0].authorization && !got[0].x_api_key,
            "a responses source gets a bearer"
        );
        assert_eq!(bad.requests().len(), 1, "the primary was tried first");
        if stream {
            let ev = events(&text);
            let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names.first(), Some(&"response.created"), "{names:?}");
            assert_eq!(names.last(), Some(&"response.completed"), "{names:?}");
            for (i, (_, d)) in ev.iter().enumerate() {
                assert_eq!(d["sequence_number"], i as u64, "the source's numbering");
            }
            assert!(ev[0].1["response"]["id"]
                .as_str()
                .unwrap()
                .starts_with("resp_mock-"));
            let deltas: String = ev
                .iter()
                .filter(|(n, _)| n == "response.output_text.delta")
                .filter_map(|(_, d)| d["delta"].as_str())
                .collect();
            assert_eq!(deltas, "Here they are");
        } else {
            let v: Value = serde_json::from_str(&text).unwrap();
            assert!(v["id"].as_str().unwrap().starts_with("resp_mock-"), "{v}");
            assert_eq!(v["output"][1]["content"][0]["text"], "Here they are");
            assert_eq!(v["output"][0]["type"], "reasoning");
        }
    }
}

/// A `previous_response_id` of an answer a `responses` source gave (stored by polygw)
/// is expanded into the next request's input — any source can continue it — and the
/// answer names it back, plain and streamed.
#[tokio::test]
async fn a_stored_native_answer_is_continued_by_expansion() {
    let m = recording_mock(Behavior::text(&["Hello"])).await;
    let s = messages_scope(vec![responses_source("a", &m)], None).await;
    let post = |body: Value| {
        http()
            .post(format!("{}/responses", s.v1()))
            .bearer_auth("k")
            .json(&body)
            .send()
    };
    let first: Value = post(json!({"model": "llm", "input": "My name is Ann."}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = first["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("resp_mock-"), "{first}");
    let second: Value =
        post(json!({"model": "llm", "input": "Who am I?", "previous_response_id": id}))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    assert_eq!(second["previous_response_id"], id.as_str(), "{second}");
    let log = m.requests();
    let body = &log[1].body;
    assert!(body.get("previous_response_id").is_none(), "{body:#}");
    let input = body["input"].as_array().unwrap();
    assert_eq!(input.len(), 3, "{body:#}");
    assert_eq!(input[1]["content"][0]["text"], "Hello", "{body:#}");
    let r = post(json!({"model": "llm", "input": "Again?", "stream": true,
        "previous_response_id": second["id"]}))
    .await
    .unwrap();
    let ev = events(&r.text().await.unwrap());
    let done = ev.iter().find(|(n, _)| n == "response.completed").unwrap();
    assert_eq!(done.1["response"]["previous_response_id"], second["id"]);
    assert_eq!(m.requests()[2].body["input"].as_array().unwrap().len(), 5);
}

/// `POST /v1/responses/input_tokens` goes to the scope's `responses` source; a scope
/// without one answers polygw's estimate.
#[tokio::test]
async fn input_tokens_is_forwarded_to_a_responses_source() {
    let m = recording_mock(Behavior::text(&["x"])).await;
    let chat = recording_mock(Behavior::text(&["x"])).await;
    let s = native_beside_plain(responses_source("a", &m), &chat).await;
    let post = |model: &str| {
        http()
            .post(format!("{}/responses/input_tokens", s.v1()))
            .json(&json!({"model": model, "input": "How many tokens is this question, exactly?"}))
            .send()
    };
    let r = post("llm").await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-polygw-usage-source").is_none());
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v,
        json!({"object": "response.input_tokens", "input_tokens": 11})
    );
    let log = m.requests();
    assert_eq!(
        (log[0].path.as_str(), &log[0].body["model"]),
        ("/v1/responses/input_tokens", &json!("gpt-a"))
    );
    let r = post("plain").await.unwrap();
    assert_eq!(r.headers()["x-polygw-usage-source"], "estimated");
    let v: Value = r.json().await.unwrap();
    assert!(v["input_tokens"].as_u64().unwrap() > 0);
    assert!(chat.requests().is_empty());
}

/// SPEC §23.1 `AUTH=client`: the client's own credential reaches the source — on a
/// keyless proxy the one it sent, on a keyed proxy the one that is not the proxy's key
/// (which never goes upstream). A client whose own key the source refuses gets the
/// source's 401, and the source stays in for the others. A client that sends no
/// credential of its own is not sent to such a source.
#[tokio::test]
async fn a_client_credential_is_forwarded_and_only_the_clients() {
    let user_key = "sk-ant-user-own-key-42";
    let m = MockUpstream::start(MockConfig {
        record_bodies: true,
        require_key: Some(user_key.into()),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    m.set_default(Behavior::text(&["Hi"]));
    let src = || {
        let base = m.base_url().trim_end_matches("/v1").to_string();
        SourceConfig::new("byok", 0, base, "", "claude-x")
            .with_api(SourceApi::Messages)
            .with_auth(polygw::core::source::SourceAuth::Client)
    };
    let body =
        json!({"model": "llm", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
    // A keyless proxy: the client's x-api-key is its own.
    let s = messages_scope(vec![src()], None).await;
    let post = |key: &'static str| {
        http()
            .post(format!("{}/messages", s.v1()))
            .header("x-api-key", key)
            .json(&body)
            .send()
    };
    assert_eq!(post(user_key).await.unwrap().status(), 200);
    let r = post("sk-ant-someone-else-wrong").await.unwrap();
    assert_eq!(r.status(), 401, "the source's 401, the client's problem");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "authentication_error");
    assert_eq!(
        post(user_key).await.unwrap().status(),
        200,
        "the source stays in"
    );
    drop(s);

    // A keyed proxy: the proxy's key in Authorization, the client's own in x-api-key.
    let scope = scope_with("LLM", ScopeKind::Chat, vec![src()], None, |_| {}).await;
    let cfg = polygw_serve::ProxyConfig {
        client_keys: vec!["proxy-key-1".into()],
        ..polygw_serve::ProxyConfig::default()
    };
    let s = serve_with(vec![scope], cfg, polygw_serve::ServerLimits::default()).await;
    let r = http()
        .post(format!("{}/messages", s.v1()))
        .bearer_auth("proxy-key-1")
        .header("x-api-key", user_key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    // The proxy's key alone: no credential of the client's own, no call upstream.
    let before = m.requests().len();
    let r = http()
        .post(format!("{}/messages", s.v1()))
        .bearer_auth("proxy-key-1")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("AUTH=client"),
        "{v}"
    );
    assert_eq!(
        m.requests().len(),
        before,
        "the proxy's key never goes upstream"
    );
}

/// SPEC §23.2: what the chat translation cannot express (a PDF document block, an
/// `input_file`, `background`) still reaches a native source as sent — only native
/// sources are sent it; a scope without one refuses it as before, naming the field.
#[tokio::test]
async fn what_chat_cannot_express_still_passes_to_a_native_source() {
    let pdf = json!({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"}});
    let messages_body = json!({"model": "llm", "max_tokens": 20,
        "messages": [{"role": "user", "content": [pdf, {"type": "text", "text": "Summarize."}]}]});
    let responses_body = json!({"model": "llm", "background": false,
        "input": [{"role": "user", "content": [
            {"type": "input_file", "filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0xLjQK"},
            {"type": "input_text", "text": "Summarize."}]}]});
    for (path, body, native) in [
        ("/messages", &messages_body, true),
        ("/responses", &responses_body, false),
    ] {
        let m = recording_mock(Behavior::text(&["A summary."])).await;
        let chat = recording_mock(Behavior::text(&["never"])).await;
        let src = if native {
            messages_source("n", &m)
        } else {
            responses_source("n", &m)
        };
        // The chat source is preferred, yet it cannot be sent this request.
        let s = messages_scope(vec![source("c", &chat), src.with_priority(1)], None).await;
        let r = http()
            .post(format!("{}{path}", s.v1()))
            .bearer_auth("k")
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}: {}", r.text().await.unwrap());
        let mut want = body.clone();
        want["model"] = json!("claude-n".replace("claude", if native { "claude" } else { "gpt" }));
        if !native {
            // A `responses` source is called stateless (SPEC §23.5).
            want["store"] = json!(false);
            want["include"] = json!(["reasoning.encrypted_content"]);
        }
        assert_eq!(m.requests()[0].body, want, "{path}: as sent");
        assert!(chat.requests().is_empty(), "{path}");
        // Without a native source: the translation's refusal, as before.
        let chat_only = messages_scope(vec![source("d", &chat)], None).await;
        let r = http()
            .post(format!("{}{path}", chat_only.v1()))
            .bearer_auth("k")
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{path}");
    }
}

/// SPEC §23.2: a `messages` source's `request-id` reaches the client as
/// `x-polygw-upstream-request-id` (the client's `request-id` stays polygw's), its
/// `anthropic-ratelimit-*` headers pass, its organization id does not.
#[tokio::test]
async fn a_messages_sources_headers_pass_as_the_spec_says() {
    let headers: std::collections::BTreeMap<String, String> = [
        ("request-id", "req_upstream_1"),
        ("anthropic-ratelimit-requests-remaining", "42"),
        ("anthropic-organization-id", "org-secret"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    for stream in [false, true] {
        let m = recording_mock(Behavior {
            headers: headers.clone(),
            ..Behavior::text(&["Hi"])
        })
        .await;
        let s = messages_scope(vec![messages_source(&format!("h{stream}"), &m)], None).await;
        let mut body = claude_code_body(stream);
        body["tools"] = json!([]);
        let r = post_messages(&s, &body).await;
        assert_eq!(r.status(), 200);
        let h = r.headers();
        assert_eq!(
            h["x-polygw-upstream-request-id"], "req_upstream_1",
            "stream={stream}"
        );
        assert_eq!(h["anthropic-ratelimit-requests-remaining"], "42");
        assert!(h.get("anthropic-organization-id").is_none());
        assert_ne!(
            h["request-id"], "req_upstream_1",
            "the client's request-id is polygw's"
        );
    }
}

/// SPEC §23.5's safety net: a conversation whose history another provider signed (its
/// thinking blocks, its encrypted reasoning) reaches a source that cannot verify them.
/// The source's 400 ("Invalid `signature` in `thinking` block", `invalid_encrypted_content`)
/// is answered by sending the request once more, at once, without the signed state —
/// Messages: its thinking blocks gone, and manual thinking off (the latest assistant turn
/// no longer begins with one); Responses: its encrypted reasoning items gone. The client
/// gets the answer, not the 400; a history the source signed itself passes untouched.
#[tokio::test]
async fn signed_state_another_source_produced_is_dropped_once_refused() {
    let signer = |g: &str| Behavior {
        signing_group: Some(g.to_string()),
        ..Behavior::text(&["fine"])
    };
    // Messages, streamed and not.
    for stream in [false, true] {
        let m = recording_mock(signer("b")).await;
        let s = messages_scope(vec![messages_source("b", &m)], None).await;
        let history = |sig: &str| {
            json!({
                "model": "llm", "max_tokens": 1000, "stream": stream,
                "thinking": {"type": "enabled", "budget_tokens": 512},
                "messages": [
                    {"role": "user", "content": "weather in Paris?"},
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "I should call the tool", "signature": sig},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
                    ]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 °C"}]}
                ]
            })
        };
        let r = post_messages(&s, &history("sig-a")).await;
        assert_eq!(r.status(), 200, "stream={stream}");
        let text = r.text().await.unwrap();
        assert!(text.contains("fine"), "{text}");
        let reqs = m.requests();
        assert_eq!(reqs.len(), 2, "one refusal, one resend: {reqs:#?}");
        assert_eq!(reqs[0].status, 400);
        let resent = &reqs[1].body;
        assert!(resent.get("thinking").is_none(), "{resent:#}");
        assert_eq!(
            resent["messages"][1]["content"],
            json!([{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}])
        );
        assert_eq!(resent["messages"][2], history("sig-a")["messages"][2]);
        // Its own signature: passed as sent, once.
        let own = polygw_mock_upstream::thinking_signature("b", "I should call the tool");
        let r = post_messages(&s, &history(own.as_str())).await;
        assert_eq!(r.status(), 200);
        let reqs = m.requests();
        assert_eq!(reqs.len(), 3);
        let mut want = history(own.as_str());
        want["model"] = json!("claude-b");
        assert_eq!(reqs[2].body, want);
    }
    // Responses: encrypted reasoning of another organization.
    let m = recording_mock(signer("b")).await;
    let scope = scope_with(
        "LLM",
        ScopeKind::Chat,
        vec![responses_source("b", &m)],
        None,
        |_| {},
    )
    .await;
    let s = serve(vec![scope]).await;
    let body = json!({
        "model": "llm", "store": false,
        "input": [
            {"type": "message", "role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "enc-a-123"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "21"}
        ]
    });
    let r = http()
        .post(format!("{}/responses", s.v1()))
        .header("authorization", "Bearer client-key")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let reqs = m.requests();
    assert_eq!(reqs.len(), 2, "{reqs:#?}");
    assert_eq!(reqs[0].status, 400);
    let kinds: Vec<&str> = reqs[1].body["input"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["message", "function_call", "function_call_output"]);
}
