//! Prompt-cache figures through `polygw serve` (SPEC §15, §18, §20.1; issue 25):
//!
//! - `/v1/chat/completions`, plain and streamed: a single-leg measured answer carries
//!   the upstream's usage object unchanged — `prompt_tokens_details`, DeepSeek's
//!   `prompt_cache_hit_tokens` / `prompt_cache_miss_tokens`, Anthropic-style
//!   `cache_read_input_tokens` / `cache_creation_input_tokens`, unknown fields;
//! - a resumed stream's usage (the sum over its legs, polygw's own object) carries the
//!   cached tokens the legs reported;
//! - `/v1/responses` and `/v1/messages` fill `input_tokens_details.cached_tokens` and
//!   `cache_read_input_tokens` / `cache_creation_input_tokens` from them, plain and
//!   streamed, against the mock's simulated prefix cache.
//!
//! (A suite of its own here, next to the program: the proxy's suites are being edited
//! elsewhere.)

use std::time::Duration;

use polygw::{GatewayClient, ScopeKind, ScopeSettings, SourceConfig};
use polygw_mock_upstream::{Behavior, CacheDialect, Fault, MockConfig, MockUpstream, PrefixCache};
use polygw_serve::{Proxy, ProxyConfig, Scope, ServerLimits};
use serde_json::{json, Value};

async fn mock(cache: Option<CacheDialect>) -> MockUpstream {
    MockUpstream::start(MockConfig {
        prefix_cache: cache.map(|d| PrefixCache::new(d).with_blocks(16, 32)),
        ..MockConfig::default()
    })
    .await
    .unwrap()
}

/// The proxy over scope `LLM` with these sources, on an ephemeral loopback port: its
/// base URL.
async fn serve(sources: Vec<SourceConfig>) -> String {
    let mut s = ScopeSettings::new("LLM", sources);
    s.retry.backoff_base = Duration::from_millis(1);
    s.retry.backoff_max = Duration::from_millis(2);
    let clients = GatewayClient::builder(s).build_all().await.unwrap();
    let scope = Scope::of_kind(ScopeKind::Chat, clients).unwrap();
    let proxy = Proxy::new(ProxyConfig::default(), vec![scope]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(polygw_serve::serve(
        listener,
        proxy,
        ServerLimits::default(),
        std::future::pending(),
    ));
    format!("http://{addr}")
}

fn source(name: &str, m: &MockUpstream) -> SourceConfig {
    SourceConfig::new(
        name,
        0,
        m.base_url(),
        "sk-upstream-secret",
        format!("model-{name}"),
    )
}

async fn post(base: &str, path: &str, body: Value) -> reqwest::Response {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{path}");
    r
}

/// The `data:` payloads of an SSE body, `[DONE]` left out.
fn sse_data(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// A usage object in every cache dialect at once, with an unknown field.
fn rich_usage() -> Value {
    json!({
        "prompt_tokens": 374, "completion_tokens": 61, "total_tokens": 435,
        "prompt_tokens_details": {"cached_tokens": 256, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 17},
        "prompt_cache_hit_tokens": 256, "prompt_cache_miss_tokens": 118,
        "cache_read_input_tokens": 256, "cache_creation_input_tokens": 64,
        "x_vendor_cost": {"usd": 0.0001}
    })
}

fn chat(stream: bool) -> Value {
    json!({"model": "llm", "stream": stream, "stream_options": {"include_usage": true},
           "messages": [{"role": "user", "content": "hi"}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_pass_the_upstreams_usage_details_through_unchanged() {
    let m = mock(None).await;
    let base = serve(vec![source("a", &m)]).await;

    // Plain.
    m.push_script(Behavior {
        raw_body: Some(
            json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                   "choices": [{"index": 0, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "ok"}}],
                   "usage": rich_usage()})
            .to_string(),
        ),
        ..Behavior::default()
    });
    let plain: Value = post(&base, "/v1/chat/completions", chat(false))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(plain["usage"], rich_usage());

    // Streamed: the usage arrives mid-stream (DeepSeek sends it on the finish chunk);
    // the client gets it once, at the end, as sent.
    let frame = |delta: Value, finish: Value, usage: Value| {
        json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
               "usage": usage})
    };
    let sse = [
        frame(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
            Value::Null,
        ),
        frame(json!({"content": "ok"}), Value::Null, Value::Null),
        frame(json!({}), json!("stop"), rich_usage()),
    ]
    .iter()
    .map(|f| format!("data: {f}\n\n"))
    .collect::<String>()
        + "data: [DONE]\n\n";
    m.push_script(Behavior {
        raw_sse: Some(sse),
        ..Behavior::default()
    });
    let body = post(&base, "/v1/chat/completions", chat(true))
        .await
        .text()
        .await
        .unwrap();
    let frames = sse_data(&body);
    let last = frames.last().unwrap();
    assert_eq!(last["choices"], json!([]), "{body}");
    assert_eq!(last["usage"], rich_usage(), "{body}");
    assert!(last.get("polygw").is_none(), "measured: not marked");
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_streams_usage_carries_the_cached_tokens_of_its_legs() {
    // a is cut after 3 chunks; b replays the answer with a prefix-cache hit.
    let (a, b) = (mock(None).await, mock(Some(CacheDialect::Deepseek)).await);
    let words: Vec<String> = (0..12).map(|i| format!("w{i:02} ")).collect();
    a.set_default(Behavior {
        chunks: words.clone(),
        fault: Some(Fault::ResetAfter { chunks: 3 }),
        ..Behavior::default()
    });
    b.set_default(Behavior {
        chunks: words.clone(),
        ..Behavior::default()
    });
    let mut sa = source("a", &a);
    sa.priority = 0;
    let mut sb = source("b", &b);
    sb.priority = 1;
    let base = serve(vec![sa, sb]).await;
    let system = "The shared system prompt of a long conversation. ".repeat(12);
    let body = |q: &str| {
        json!({"model": "llm", "stream": true, "stream_options": {"include_usage": true},
               "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
    };
    // Warm b's cache with the same prefix (a first call resumed on b as well).
    let _ = post(&base, "/v1/chat/completions", body("first"))
        .await
        .text()
        .await
        .unwrap();
    let text = post(&base, "/v1/chat/completions", body("second"))
        .await
        .text()
        .await
        .unwrap();
    let frames = sse_data(&text);
    let content: String = frames
        .iter()
        .filter_map(|f| f["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, words.concat(), "{text}");
    let last = frames.last().unwrap();
    let cached = b
        .requests()
        .last()
        .and_then(|r| r.usage)
        .and_then(|u| u.cached_prompt_tokens)
        .unwrap();
    assert!(cached > 0);
    assert_eq!(
        last["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(cached),
        "{last}"
    );
    // The sum of an estimated leg and a measured one: marked.
    assert_eq!(last["polygw"]["usage_source"], "estimated", "{last}");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_and_messages_report_the_prefix_caches_figures() {
    let m = mock(Some(CacheDialect::Anthropic)).await;
    m.set_default(Behavior::text(&["cached ", "answer"]));
    let base = serve(vec![source("a", &m)]).await;
    let system = "The shared instructions of every call, long enough to be cached. ".repeat(10);
    let mut seen = Vec::new();
    for (i, stream) in [false, false, true, false, true].into_iter().enumerate() {
        let q = format!("question {i}");
        let responses =
            json!({"model": "llm", "stream": stream, "instructions": system, "input": q});
        let messages = json!({"model": "llm", "stream": stream, "max_tokens": 64, "system": system,
                              "messages": [{"role": "user", "content": q}]});
        for (path, req) in [("/v1/responses", responses), ("/v1/messages", messages)] {
            let text = post(&base, path, req).await.text().await.unwrap();
            let usage = if stream {
                // The last event that carries the whole usage.
                sse_data(&text)
                    .iter()
                    .rev()
                    .find_map(|e| {
                        e.get("response")
                            .and_then(|r| r.get("usage"))
                            .or_else(|| e.get("usage"))
                            .filter(|u| u.is_object())
                            .cloned()
                    })
                    .unwrap_or_else(|| panic!("{path}: no usage in {text}"))
            } else {
                serde_json::from_str::<Value>(&text).unwrap()["usage"].clone()
            };
            let u = m.requests().last().and_then(|r| r.usage).unwrap();
            let (prompt, cached, write) = (
                u.prompt_tokens,
                u.cached_prompt_tokens.unwrap(),
                u.cache_write_tokens.unwrap(),
            );
            if path == "/v1/responses" {
                assert_eq!(usage["input_tokens"], json!(prompt), "{path}: {usage}");
                assert_eq!(
                    usage["input_tokens_details"]["cached_tokens"],
                    json!(cached),
                    "{path}: {usage}"
                );
            } else {
                assert_eq!(
                    usage["cache_read_input_tokens"],
                    json!(cached),
                    "{path}: {usage}"
                );
                if stream {
                    // The final message_delta's usage may leave the input side out;
                    // what it says must agree.
                    if let Some(w) = usage.get("cache_creation_input_tokens") {
                        assert_eq!(w, &json!(write), "{path}: {usage}");
                    }
                } else {
                    assert_eq!(
                        usage["cache_creation_input_tokens"],
                        json!(write),
                        "{path}: {usage}"
                    );
                    assert_eq!(
                        usage["input_tokens"],
                        json!(prompt - cached - write),
                        "{path}: {usage}"
                    );
                }
            }
            seen.push((path, stream, cached, write));
        }
    }
    assert!(
        seen.iter().filter(|(_, _, c, _)| *c > 0).count() >= 8,
        "the shared instructions were read back: {seen:?}"
    );
    assert!(seen.iter().any(|(_, _, _, w)| *w > 0), "{seen:?}");
    m.shutdown().await;
}
