//! Issue 22 (SPEC §17), the proxy as clients meet it: calls that cannot be served are
//! answered at once, keepalives only while an attempt runs and on every silence after
//! the headers, upstream answers mapped to the client's error classes, the inputs
//! OpenAI accepts, the upstream's headers passed on, and redaction that hides the key
//! and nothing else.

use std::collections::BTreeMap;
use std::time::Duration;

use polygw::ScopeKind;
use polygw_mock_upstream::{Behavior, RetryAfter, Stall};
use polygw_serve::{ProxyConfig, ServerLimits};
use serde_json::{json, Value};

use crate::support::*;

fn cfg(max_wait_s: u64, keepalive_s: u64) -> ProxyConfig {
    ProxyConfig {
        max_wait: Duration::from_secs(max_wait_s),
        keepalive: Duration::from_secs(keepalive_s),
        ..ProxyConfig::default()
    }
}

async fn post_json(s: &Served, path: &str, body: Value) -> reqwest::Response {
    http()
        .post(format!("{}{path}", s.v1()))
        .json(&body)
        .send()
        .await
        .unwrap()
}

fn chat(stream: bool) -> Value {
    json!({"model": "llm", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
}

/// Item 12: an upstream 429 with `Retry-After: 30` is known at once: the client gets a
/// 429 with `Retry-After` ≈ 30 without waiting out `--max-wait-s`, the message names
/// the bound, and the upstream saw one request.
#[tokio::test(start_paused = true)]
async fn a_known_rate_limit_is_answered_at_once() {
    let m = mock(Behavior {
        retry_after: Some(RetryAfter::Seconds(30.0)),
        ..Behavior::status(429)
    })
    .await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        cfg(10, 15),
        ServerLimits::default(),
    )
    .await;
    let t0 = tokio::time::Instant::now();
    let r = post_json(&s, "/chat/completions", chat(false)).await;
    let took = t0.elapsed();
    assert_eq!(r.status(), 429);
    assert!(took < Duration::from_millis(200), "held {took:?}");
    let ra: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((29..=31).contains(&ra), "{ra}");
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("--max-wait-s"), "the bound is named: {msg}");
    assert_eq!(m.requests().len(), 1);
}

/// Item 12: an open breaker is known at once too: 503 with `Retry-After`.
#[tokio::test(start_paused = true)]
async fn an_open_breaker_is_answered_at_once() {
    let m = mock(Behavior::status(500)).await;
    let scope = scope_with("LLM", ScopeKind::Chat, vec![source("a", &m)], None, |s| {
        s.breaker.failures = 1;
        s.breaker.open = Duration::from_secs(60);
        s.retry.max_attempts = 1;
    })
    .await;
    let s = serve_with(vec![scope], cfg(10, 15), ServerLimits::default()).await;
    assert_eq!(
        post_json(&s, "/chat/completions", chat(false))
            .await
            .status(),
        503
    );
    let t0 = tokio::time::Instant::now();
    let r = post_json(&s, "/chat/completions", chat(false)).await;
    assert!(
        t0.elapsed() < Duration::from_millis(200),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(r.status(), 503);
    let ra: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((55..=60).contains(&ra), "{ra}");
    assert_eq!(
        m.requests().len(),
        1,
        "the open breaker let nothing through"
    );
}

/// Item 13: with `--keepalive-s` below `--max-wait-s`, a streamed request whose
/// upstream answers 429 gets the HTTP status (a client's rate-limit error), never a 200
/// and an error event: nothing is sent while no attempt runs.
#[tokio::test(start_paused = true)]
async fn a_streamed_rate_limit_keeps_its_status_when_keepalives_are_short() {
    let m = mock(Behavior {
        retry_after: Some(RetryAfter::Seconds(5.0)),
        ..Behavior::status(429)
    })
    .await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        cfg(10, 1),
        ServerLimits::default(),
    )
    .await;
    let r = post_json(&s, "/chat/completions", chat(true)).await;
    assert_eq!(r.status(), 429, "{:?}", r.headers());
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
}

/// Item 14: a committed stream that goes silent (a stall being waited out or
/// rescued) gets a keepalive comment every `--keepalive-s`, then the rest.
#[tokio::test(start_paused = true)]
async fn a_silent_committed_stream_gets_keepalives() {
    let m = mock(Behavior {
        stalls: vec![Stall {
            before_chunk: 2,
            ms: 5_500.0,
        }],
        ..Behavior::text(&["one", " two", " three"])
    })
    .await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        cfg(10, 1),
        ServerLimits::default(),
    )
    .await;
    let r = post_json(&s, "/chat/completions", chat(true)).await;
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    let first = body.find("\"one\"").unwrap();
    let last = body.find("\" three\"").unwrap();
    let between = body[first..last].matches(": keepalive\n\n").count();
    assert!(
        (4..=6).contains(&between),
        "{between} keepalives in 5.5 s: {body}"
    );
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
}

/// Item 15: one transient 401 does not take a one-source scope out (the next attempt
/// answers); two in a row do, and the client gets a 502 naming the source and the
/// status (not a retryable 503).
#[tokio::test(start_paused = true)]
async fn auth_failures_are_a_misconfiguration_only_when_they_persist() {
    let m = mock(Behavior::text(&["ok"])).await;
    m.push_script(Behavior::status(401));
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        cfg(10, 15),
        ServerLimits::default(),
    )
    .await;
    let r = post_json(&s, "/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 200, "one 401 is not a dead source");
    m.push_script(Behavior::status(401));
    m.push_script(Behavior::status(401));
    let r = post_json(&s, "/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 502);
    assert_eq!(r.headers()["x-should-retry"], "false");
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("`a-0`") && msg.contains("HTTP 401"), "{msg}");
    assert_eq!(v["error"]["code"], "upstream_misconfigured");
}

/// Item 15: 409 and 422 are rejections passed through with their status, sent once.
#[tokio::test(start_paused = true)]
async fn conflicts_are_passed_through_not_retried() {
    for status in [409u16, 422] {
        let m = mock(Behavior::status(status)).await;
        let s = serve(vec![chat_scope("LLM", &m).await]).await;
        let r = post_json(&s, "/chat/completions", chat(false)).await;
        assert_eq!(r.status().as_u16(), status);
        assert_eq!(m.requests().len(), 1, "{status} sent once");
    }
}

/// Item 15: a redirect and an answer over the size cap are terminal for their source:
/// sent once, then a 502 naming it.
#[tokio::test(start_paused = true)]
async fn redirects_and_oversize_answers_are_not_retried_on_the_same_source() {
    let mut headers = BTreeMap::new();
    headers.insert(
        "location".to_string(),
        "http://elsewhere.invalid/v1".to_string(),
    );
    let m = mock(Behavior {
        headers,
        ..Behavior::status(307)
    })
    .await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let r = post_json(&s, "/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("BASE_URL"),
        "{v}"
    );
    assert_eq!(m.requests().len(), 1, "a redirect is not retried");

    let m = mock(Behavior {
        raw_body: Some(format!(
            r#"{{"choices":[{{"index":0,"message":{{"role":"assistant","content":"{}"}},"finish_reason":"stop"}}]}}"#,
            "x".repeat(17 << 20)
        )),
        ..Behavior::default()
    })
    .await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let r = post_json(&s, "/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 502);
    assert_eq!(
        m.requests().len(),
        1,
        "an oversize answer is downloaded once"
    );
}

/// Item 17: `n > 1` is served as the upstream answers it (every choice).
#[tokio::test(start_paused = true)]
async fn several_choices_are_passed_through() {
    let m = mock(Behavior {
        raw_body: Some(
            json!({"id":"c","object":"chat.completion","created":1,"model":"m","choices":[
                {"index":0,"message":{"role":"assistant","content":"one"},"finish_reason":"stop"},
                {"index":1,"message":{"role":"assistant","content":"two"},"finish_reason":"stop"}],
                "usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}})
            .to_string(),
        ),
        ..Behavior::default()
    })
    .await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let mut body = chat(false);
    body["n"] = json!(2);
    let r = post_json(&s, "/chat/completions", body).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(m.requests()[0].body["n"], 2);

    // Streamed: frames of both choices reach the client.
    let m = mock(Behavior {
        raw_sse: Some(
            [
                r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"one"}}]}"#,
                r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":1,"delta":{"role":"assistant","content":"two"}}]}"#,
                r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":1,"delta":{},"finish_reason":"stop"}]}"#,
                r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            ]
            .iter()
            .map(|f| format!("data: {f}\n\n"))
            .collect::<String>()
                + "data: [DONE]\n\n",
        ),
        ..Behavior::default()
    })
    .await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let mut body = chat(true);
    body["n"] = json!(2);
    let text = post_json(&s, "/chat/completions", body)
        .await
        .text()
        .await
        .unwrap();
    assert!(
        text.contains(r#""two""#) && text.contains(r#""one""#),
        "{text}"
    );
    assert!(text.contains(r#""index":1"#), "{text}");
}

/// Item 17: token-array embedding inputs (LangChain's default) are passed through.
#[tokio::test(start_paused = true)]
async fn embeddings_of_token_arrays_are_served() {
    let m = mock(Behavior::default()).await;
    let scope = scope_with(
        "EMBED",
        ScopeKind::Embedding,
        vec![source("e", &m)],
        None,
        |_| {},
    )
    .await;
    let s = serve(vec![scope]).await;
    let r = post_json(
        &s,
        "/embeddings",
        json!({"model": "embed", "input": [[15339, 1917], [1, 2, 3]], "encoding_format": "float"}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(
        m.requests()[0].body["input"],
        json!([[15339, 1917], [1, 2, 3]])
    );
}

/// Item 17: a body of 20 000 short messages (700 KB) is a valid request, not too many
/// JSON values; an assistant message's `content: null` reaches the upstream as sent.
#[tokio::test(start_paused = true)]
async fn long_histories_and_null_contents_are_served_as_sent() {
    let m = mock(Behavior::text(&["ok"])).await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let mut messages: Vec<Value> = (0..20_000)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "hi"}))
        .collect();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}));
    messages.push(json!({"role": "tool", "tool_call_id": "c1", "content": "done"}));
    let body = json!({"model": "llm", "messages": messages});
    assert!(body.to_string().len() > 600_000);
    let r = post_json(&s, "/chat/completions", body).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let sent = &m.requests()[0].body["messages"];
    assert_eq!(sent.as_array().unwrap().len(), 20_002);
    let null_msg = &sent[20_000];
    assert!(null_msg.as_object().unwrap().contains_key("content"));
    assert!(null_msg["content"].is_null());
}

/// Item 17: an agent's history of 7 000 tool-call pairs (1.5 MB: each assistant
/// turn a `content: null` message with a tool call, each answer a `tool` message) is a
/// valid request, not too many JSON values, and reaches the upstream as sent.
#[tokio::test(start_paused = true)]
async fn an_agent_history_of_seven_thousand_tool_calls_is_served() {
    let m = mock(Behavior::text(&["ok"])).await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let mut messages: Vec<Value> = vec![json!({"role": "user", "content": "fix the build"})];
    for i in 0..7_000 {
        let id = format!("call_{i:05}");
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{
                "id": id, "type": "function",
                "function": {"name": "sh", "arguments": format!(r#"{{"cmd":"ls {i}"}}"#)}
            }]}),
        );
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": format!("ok {i}")}));
    }
    let body = json!({"model": "llm", "messages": messages, "tools": [{"type": "function",
        "function": {"name": "sh", "parameters": {"type": "object",
        "properties": {"cmd": {"type": "string"}}}}}]});
    let size = body.to_string().len();
    assert!((1_400_000..1_600_000).contains(&size), "{size} bytes");
    let r = post_json(&s, "/chat/completions", body).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let sent = m.requests()[0].body["messages"].clone();
    let sent = sent.as_array().unwrap();
    assert_eq!(sent.len(), 14_001);
    assert_eq!(sent[1]["tool_calls"][0]["id"], "call_00000");
    assert!(sent[13_999]["content"].is_null());
    assert_eq!(sent[14_000]["tool_call_id"], "call_06999");
}

/// Item 18: the upstream's `x-request-id` and `x-ratelimit-*` headers reach the
/// client (plain and streamed), and a stream's synthesized final usage chunk carries
/// the stream's `system_fingerprint` and `service_tier`.
#[tokio::test(start_paused = true)]
async fn upstream_headers_and_stream_fields_are_passed_on() {
    let mut headers = BTreeMap::new();
    headers.insert("x-request-id".to_string(), "req_upstream_1".to_string());
    headers.insert(
        "x-ratelimit-remaining-requests".to_string(),
        "99".to_string(),
    );
    let m = mock(Behavior {
        headers,
        ..Behavior::text(&["hi"])
    })
    .await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    for stream in [false, true] {
        let r = post_json(&s, "/chat/completions", chat(stream)).await;
        assert_eq!(
            r.headers()["x-polygw-upstream-request-id"],
            "req_upstream_1"
        );
        assert_eq!(r.headers()["x-ratelimit-remaining-requests"], "99");
        assert_ne!(
            r.headers()["x-request-id"],
            "req_upstream_1",
            "ours stays ours"
        );
    }
    let m = mock(Behavior {
        raw_sse: Some(
            [
                r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_9","service_tier":"default","choices":[{"index":0,"delta":{"role":"assistant","content":"hi"}}]}"#,
                r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp_9","service_tier":"default","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            ]
            .iter()
            .map(|f| format!("data: {f}\n\n"))
            .collect::<String>()
                + "data: [DONE]\n\n",
        ),
        ..Behavior::default()
    })
    .await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let mut body = chat(true);
    body["stream_options"] = json!({"include_usage": true});
    let text = post_json(&s, "/chat/completions", body)
        .await
        .text()
        .await
        .unwrap();
    let usage: Value = sse_data(&text)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .find(|v| v["choices"].as_array().is_some_and(|c| c.is_empty()))
        .expect("a usage chunk");
    assert_eq!(usage["system_fingerprint"], "fp_9", "{usage}");
    assert_eq!(usage["service_tier"], "default");
}

/// Item 18: redaction hides the key and its case and encodings, and nothing that
/// merely shares a word with it.
#[tokio::test(start_paused = true)]
async fn redaction_hides_the_key_and_nothing_else() {
    let m = mock(Behavior {
        error_message: Some(format!(
            "upstream says 400: the key {} is not allowed here",
            UPSTREAM_KEY.to_ascii_uppercase()
        )),
        ..Behavior::status(400)
    })
    .await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let r = post_json(&s, "/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 400);
    let text = r.text().await.unwrap();
    assert!(text.contains("upstream says 400"), "{text}");
    assert!(
        !text
            .to_ascii_lowercase()
            .contains(&UPSTREAM_KEY[3..20].to_ascii_lowercase()),
        "{text}"
    );
    assert!(text.contains("<redacted>"), "{text}");
}

/// The JSON value budget guards every route that parses a body (SPEC §17.7): a body of
/// tiny values is a 413 naming the body on Responses and Messages too, in each API's
/// shape, and nothing reaches the upstream.
#[tokio::test(start_paused = true)]
async fn bodies_of_tiny_values_are_refused_on_every_api() {
    let m = mock(Behavior::text(&["ok"])).await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    // 400 000 one-digit values: about 800 KB, far above one value per 5 bytes.
    let tiny = vec![1u8; 400_000];
    let cases = [
        (
            "/responses",
            json!({"model": "llm", "input": "hi", "metadata": {"x": tiny}}),
        ),
        (
            "/messages",
            json!({"model": "llm", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "x": tiny}),
        ),
        (
            "/messages/count_tokens",
            json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}], "x": tiny}),
        ),
    ];
    for (path, body) in cases {
        let r = post_json(&s, path, body).await;
        assert_eq!(r.status(), 413, "{path}");
        let v: Value = r.json().await.unwrap();
        let text = v.to_string();
        assert!(text.contains("JSON values"), "{path}: {text}");
        if path.starts_with("/messages") {
            assert_eq!(v["type"], "error", "{path}: {text}");
            assert_eq!(v["error"]["type"], "request_too_large", "{path}: {text}");
        } else {
            assert_eq!(v["error"]["param"], "body", "{path}: {text}");
        }
    }
    assert!(m.requests().is_empty(), "nothing reached the upstream");
}

/// SPEC §25.5: a 529 (polygw's 503 in Anthropic's shape) has a reason phrase on its
/// status line, and says when to come back and, after polygw's own attempts, that a
/// client's retry would not help.
#[tokio::test]
async fn a_529_has_a_reason_phrase_and_the_retry_headers() {
    let m = mock(Behavior::status(500)).await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        cfg(10, 15),
        ServerLimits::default(),
    )
    .await;
    let body = json!({"model": "llm", "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let raw = raw_exchange(
        s.addr,
        &post("/v1/messages", &body, "Connection: close\r\n"),
    )
    .await;
    let r = parse_raw(&raw);
    assert!(
        r.head.starts_with("HTTP/1.1 529 Overloaded\r\n"),
        "{}",
        r.head
    );
    assert_eq!(r.json()["error"]["type"], "overloaded_error");
    assert!(r.header("retry-after").is_some(), "{}", r.head);
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
}

/// SPEC §24.4: a source that refuses `max_tokens` (OpenAI's reasoning models) is
/// learned from its first 400: the request goes again at once with
/// `max_completion_tokens`, the client sees only the answer, and later calls send the
/// cap under that name from the start; `MAX_TOKENS_FIELD` says so up front.
#[tokio::test]
async fn a_source_that_refuses_max_tokens_is_learned_and_served() {
    let m = polygw_mock_upstream::MockUpstream::start(polygw_mock_upstream::MockConfig {
        record_bodies: true,
        ..polygw_mock_upstream::MockConfig::default()
    })
    .await
    .unwrap();
    m.set_default(Behavior::text(&["fine"]));
    m.push_script(Behavior {
        error_code: Some("unsupported_parameter".into()),
        error_message: Some(
            "Unsupported parameter: 'max_tokens' is not supported with this model. Use \
             'max_completion_tokens' instead."
                .into(),
        ),
        ..Behavior::status(400)
    });
    // A source name of its own: what is learned is kept per process.
    let src = polygw::SourceConfig::new("reasoner", 0, m.base_url(), UPSTREAM_KEY, "o-model");
    let scope = scope_with("LLM", ScopeKind::Chat, vec![src], None, |_| {}).await;
    let s = serve(vec![scope]).await;
    let body =
        json!({"model": "llm", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]});
    for _ in 0..2 {
        let r = post_json(&s, "/chat/completions", body.clone()).await;
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "fine");
    }
    let log = m.requests();
    assert_eq!(log.len(), 3, "one refusal, then the two calls: {log:#?}");
    assert_eq!(log[0].body["max_tokens"], 64);
    for r in &log[1..] {
        assert_eq!(r.body["max_completion_tokens"], 64, "{:#}", r.body);
        assert!(r.body.get("max_tokens").is_none());
    }

    // Said up front: the first request has it already.
    let m2 = polygw_mock_upstream::MockUpstream::start(polygw_mock_upstream::MockConfig {
        record_bodies: true,
        ..polygw_mock_upstream::MockConfig::default()
    })
    .await
    .unwrap();
    m2.set_default(Behavior::text(&["fine"]));
    let vars = [
        ("LLM__R__0__BASE_URL", m2.base_url()),
        ("LLM__R__0__API_KEY", UPSTREAM_KEY.to_string()),
        ("LLM__R__0__MODEL", "o-model".to_string()),
        (
            "LLM__R__0__MAX_TOKENS_FIELD",
            "max_completion_tokens".to_string(),
        ),
    ];
    let loaded = polygw::core::config::load_scope(vars, "LLM", ScopeKind::Chat).unwrap();
    assert!(loaded.settings.sources[0].max_completion_tokens);
    let scope = polygw_serve::Scope::of_kind(
        ScopeKind::Chat,
        polygw::GatewayClient::builder(loaded.settings)
            .build_all()
            .await
            .unwrap(),
    )
    .unwrap();
    let s2 = serve(vec![scope]).await;
    let r = post_json(&s2, "/chat/completions", body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(m2.requests()[0].body["max_completion_tokens"], 64);
}
