//! The proxy faithful to OpenAI's API (SPEC §15), driven by a third-party OpenAI client
//! (async-openai) and raw HTTP: one test per "Why" bullet of issue 15 that concerns
//! the API.

use std::time::Duration;

use async_openai::types::chat::{
    ChatCompletionStreamOptions, CreateChatCompletionRequestArgs, FinishReason,
};
use async_openai::types::embeddings::{CreateEmbeddingRequestArgs, EmbeddingInput, EncodingFormat};
use futures_util::StreamExt;
use polygw::ScopeKind;
use polygw_mock_upstream::{Behavior, MockUpstream, RetryAfter, UsageMode};
use polygw_serve::{ProxyConfig, ServerLimits};
use polygw_testkit::fakes::RecordingTelemetry;
use serde_json::{json, Value};

use crate::support::*;

/// A completion object with every field a client may rely on.
fn rich_completion() -> Value {
    json!({
        "id": "chatcmpl-upstream-42",
        "object": "chat.completion",
        "created": 1_700_000_042u64,
        "model": "gpt-4o-mini-2024-07-18",
        "system_fingerprint": "fp_44709d6fcb",
        "service_tier": "default",
        "choices": [{
            "index": 0,
            "finish_reason": "tool_calls",
            "logprobs": {"content": [{"token": "Hi", "logprob": -0.01, "bytes": [72, 105], "top_logprobs": []}], "refusal": null},
            "message": {
                "role": "assistant",
                "content": null,
                "refusal": null,
                "annotations": [],
                "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]
            }
        }],
        "usage": {
            "prompt_tokens": 19, "completion_tokens": 10, "total_tokens": 29,
            "prompt_tokens_details": {"cached_tokens": 12, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
        },
        "x_vendor_extension": {"kept": true}
    })
}

#[tokio::test]
async fn plain_answers_pass_every_field_through() {
    let upstream = rich_completion();
    // Pretty-printed, so that the bytes show whether the answer was re-serialized.
    let sent = serde_json::to_string_pretty(&upstream).unwrap();
    let m = mock(Behavior {
        raw_body: Some(sent.clone()),
        ..Behavior::default()
    })
    .await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;

    // As JSON: the upstream's object, unchanged (id, created, model included).
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}], "logprobs": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-polygw-usage-source"], "measured");
    assert_eq!(r.headers()["content-type"], "application/json");
    // Its own measured usage: the upstream's bytes, passed on as sent (issue 27).
    let text = r.text().await.unwrap();
    assert_eq!(text, sent);
    let got: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(got, upstream);

    // Through an OpenAI client: the fields it exposes are there.
    let c = openai(&s, "unused");
    let req = CreateChatCompletionRequestArgs::default()
        .model("llm")
        .messages(vec![user("hi")])
        .logprobs(true)
        .build()
        .unwrap();
    let r = c.chat().create(req).await.unwrap();
    assert_eq!(r.id, "chatcmpl-upstream-42");
    assert_eq!(r.created, 1_700_000_042);
    assert_eq!(r.model, "gpt-4o-mini-2024-07-18");
    #[allow(deprecated)] // deprecated by OpenAI, still sent by many providers
    let fp = r.system_fingerprint.as_deref();
    assert_eq!(fp, Some("fp_44709d6fcb"));
    assert!(r.service_tier.is_some());
    let ch = &r.choices[0];
    assert_eq!(ch.finish_reason, Some(FinishReason::ToolCalls));
    assert!(ch.logprobs.as_ref().unwrap().content.is_some());
    assert_eq!(ch.message.content, None, "content: null stays null");
    assert!(ch
        .message
        .annotations
        .as_ref()
        .is_some_and(|a| a.is_empty()));
    assert_eq!(ch.message.tool_calls.as_ref().unwrap().len(), 1);
    let u = r.usage.unwrap();
    assert_eq!(u.prompt_tokens_details.unwrap().cached_tokens, Some(12));
}

#[tokio::test]
async fn request_fields_reach_the_upstream_as_sent() {
    let m = mock(Behavior::text(&["ok"])).await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({
            "model": "llm", "messages": [{"role": "user", "content": "hi", "name": "ann"}],
            "max_completion_tokens": 77, "logprobs": true, "top_logprobs": 3, "seed": 7,
            "user": "u-1", "n": 1, "temperature": 0.25, "parallel_tool_calls": false,
            "stream": true, "stream_options": {"include_usage": false, "include_obfuscation": false},
            "metadata": {"k": "v"}
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.text().await.unwrap();
    let body = &m.requests()[0].body;
    assert_eq!(body["max_completion_tokens"], 77, "{body}");
    assert!(body.get("max_tokens").is_none(), "never renamed: {body}");
    for (k, v) in [
        ("logprobs", json!(true)),
        ("top_logprobs", json!(3)),
        ("seed", json!(7)),
        ("user", json!("u-1")),
        ("n", json!(1)),
        ("temperature", json!(0.25)),
        ("parallel_tool_calls", json!(false)),
        ("metadata", json!({"k": "v"})),
    ] {
        assert_eq!(body[k], v, "{k}: {body}");
    }
    assert_eq!(body["messages"][0]["name"], "ann");
    assert_eq!(body["model"], "model-a", "the source's own model");
    // The client's stream options are kept; polygw asks for usage (it accounts).
    assert_eq!(body["stream_options"]["include_obfuscation"], false);
    assert_eq!(body["stream_options"]["include_usage"], true);
}

#[tokio::test]
async fn unknown_usage_is_null_never_zeros() {
    let m = mock(Behavior {
        usage: UsageMode::None,
        ..Behavior::text(&["no", " usage"])
    })
    .await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-polygw-usage-source"], "unavailable");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["usage"], Value::Null, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "no usage");

    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(
            &json!({"model": "llm", "stream": true, "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .unwrap();
    let data = sse_data(&r.text().await.unwrap());
    let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], Value::Null, "{last}");
    assert_eq!(last["polygw"]["usage_source"], "unavailable");
    assert_eq!(data.last().unwrap(), "[DONE]");
}

#[tokio::test]
async fn embeddings_in_base64_the_sdk_default_and_in_float() {
    let m = mock(Behavior::default()).await;
    let emb = scope_with(
        "EMBED",
        ScopeKind::Embedding,
        vec![source("e", &m)],
        None,
        |_| {},
    )
    .await;
    let s = serve(vec![emb]).await;
    let c = openai(&s, "unused");
    let texts = vec!["one".to_string(), "two".to_string()];
    let float = c
        .embeddings()
        .create(
            CreateEmbeddingRequestArgs::default()
                .model("embed")
                .input(EmbeddingInput::StringArray(texts.clone()))
                .build()
                .unwrap(),
        )
        .await
        .unwrap();
    let b64 = c
        .embeddings()
        .create_base64(
            CreateEmbeddingRequestArgs::default()
                .model("embed")
                .input(EmbeddingInput::StringArray(texts))
                .encoding_format(EncodingFormat::Base64)
                .build()
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(b64.data.len(), 2);
    for (f, b) in float.data.iter().zip(b64.data) {
        let decoded: Vec<f32> = b.embedding.into();
        assert_eq!(decoded, f.embedding, "little-endian f32, base64");
        assert!(!decoded.is_empty());
    }
    // The Python SDK sends `encoding_format: "base64"` unasked: a string comes back.
    let r: Value = http()
        .post(format!("{}/embeddings", s.v1()))
        .json(&json!({"model": "EMBED", "input": "x", "encoding_format": "base64"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(r["data"][0]["embedding"].is_string(), "{r}");
    assert!(r["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn models_retrieve_finds_a_listed_model() {
    let m = mock(Behavior::default()).await;
    let llm = scope_with("LLM", ScopeKind::Chat, vec![source("a", &m)], None, |s| {
        s.model_aliases = vec!["gpt-4o-mini".into()];
    })
    .await;
    let s = serve(vec![llm]).await;
    let c = openai(&s, "unused");
    let listed = c.models().list().await.unwrap();
    assert!(listed.data.iter().any(|m| m.id == "gpt-4o-mini"));
    let one = c.models().retrieve("gpt-4o-mini").await.unwrap();
    assert_eq!(one.id, "gpt-4o-mini");
    assert_eq!(c.models().retrieve("llm").await.unwrap().id, "LLM");
    let r = http()
        .get(format!("{}/models/nope", s.v1()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
}

#[tokio::test]
async fn every_answer_has_a_request_id_and_errors_their_polygw_headers() {
    let m = mock(Behavior::text(&["hello"])).await;
    let rows = RecordingTelemetry::new();
    let llm = scope_with(
        "LLM",
        ScopeKind::Chat,
        vec![source("a", &m)],
        Some(rows.clone()),
        |s| {
            s.retry.max_attempts = 1;
        },
    )
    .await;
    let s = serve_with(
        vec![llm],
        ProxyConfig {
            client_keys: vec!["client-key".into()],
            ..ProxyConfig::default()
        },
        ServerLimits::default(),
    )
    .await;
    let h = http();
    let chat = |body: Value, key: &'static str| {
        h.post(format!("{}/chat/completions", s.v1()))
            .bearer_auth(key)
            .json(&body)
            .send()
    };
    // A success: x-request-id is the logical call id, the one of the telemetry rows.
    let r = chat(
        json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}),
        "client-key",
    )
    .await
    .unwrap();
    let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(r.headers()["x-polygw-logical-call-id"], id.as_str());
    assert_eq!(r.headers()["x-polygw-source"], "a-0");
    assert_eq!(rows.rows_of(&id).len(), 1);
    // Refused before any call: an id still (no call, so no logical call id).
    for (body, key, status) in [
        (
            json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            "client-key",
            404,
        ),
        (json!({"model": "llm", "messages": "x"}), "client-key", 400),
        (
            json!({"model": "llm", "messages": [{"role": "user", "content": "x"}]}),
            "wrong",
            401,
        ),
    ] {
        let r = chat(body, key).await.unwrap();
        assert_eq!(r.status(), status);
        assert!(r.headers().contains_key("x-request-id"), "{status}");
        let v: Value = r.json().await.unwrap();
        assert!(v["error"]["message"].is_string());
    }
    // Every `/v1/` path asks for a key before it is routed (one guard layer, DECISIONS
    // 153): an unknown path is 401 without a key, 404 with one; `/healthz` asks none.
    for (key, status) in [(None, 401), (Some("client-key"), 404)] {
        let mut rb = h.get(format!("{}/no-such-route", s.v1()));
        if let Some(k) = key {
            rb = rb.bearer_auth(k);
        }
        let r = rb.send().await.unwrap();
        assert_eq!(r.status(), status, "key {key:?}");
        assert!(r.headers().contains_key("x-request-id"));
        let v: Value = r.json().await.unwrap();
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    let r = h.get(format!("{}/healthz", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // A failed call: the id of its terminal row, and what is known of it.
    m.set_default(Behavior::status(500));
    let r = chat(
        json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}),
        "client-key",
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 503);
    let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(r.headers()["x-polygw-logical-call-id"], id.as_str());
    assert_eq!(r.headers()["x-polygw-attempts"], "1");
    assert_eq!(r.headers()["x-polygw-terminal-reason"], "retry_exhausted");
    assert!(rows.rows_of(&id).len() >= 2, "attempt + terminal rows");
}

/// A proxy with `--max-wait-s` `max_wait` in front of an upstream that always answers
/// 429 with `Retry-After: hint_s`, and one plain call through it: the proxy, the
/// upstream, the answer's status, `Retry-After` (seconds), JSON body, and how long the
/// call took.
async fn through_rate_limited(
    hint_s: f64,
    max_wait: Duration,
) -> (Served, MockUpstream, u16, Option<u64>, Value, Duration) {
    let m = mock(Behavior {
        retry_after: Some(RetryAfter::Seconds(hint_s)),
        ..Behavior::status(429)
    })
    .await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig {
            max_wait,
            ..ProxyConfig::default()
        },
        ServerLimits::default(),
    )
    .await;
    let started = tokio::time::Instant::now();
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let took = started.elapsed();
    let status = r.status().as_u16();
    assert!(r.headers().contains_key("x-request-id"));
    let ra = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let v: Value = r.json().await.unwrap();
    (s, m, status, ra, v, took)
}

#[tokio::test(start_paused = true)]
async fn short_upstream_hints_are_honoured_then_reach_the_client_as_a_429() {
    // The case: an upstream that always answers 429 with `Retry-After: 1`. The
    // proxy honours each hint (about one request a second, never a tight loop) and,
    // once nothing admitted the call for --max-wait-s, answers 429 with Retry-After
    // instead of holding the client for the 60 s stall window.
    let (_s, m, status, ra, v, took) = through_rate_limited(1.0, Duration::from_secs(2)).await;
    assert_eq!(status, 429);
    assert!(
        ra.is_some_and(|ra| (1..=2).contains(&ra)),
        "the upstream's own hint: {ra:?}"
    );
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert!(took < Duration::from_secs(6), "held {took:?}");
    let n = m.requests().len();
    assert!(
        (2..=4).contains(&n),
        "each 1 s hint honoured: {n} upstream requests in {took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn rate_limits_reach_the_client_as_429_with_retry_after() {
    // The upstream asks for 30 s; the proxy waits at most 1 s, then says so.
    let (s, m, status, ra, v, took) = through_rate_limited(30.0, Duration::from_secs(1)).await;
    assert_eq!(status, 429);
    assert!(
        ra.is_some_and(|ra| (25..=31).contains(&ra)),
        "the earliest admission: {ra:?}"
    );
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert!(took < Duration::from_secs(3), "held {took:?}");
    assert_eq!(
        m.requests().len(),
        1,
        "one upstream request, not one per poll"
    );

    // Streams too, before any chunk.
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "llm", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
}

#[tokio::test(start_paused = true)]
async fn a_long_first_token_gets_headers_and_keepalives_then_errors_in_stream() {
    let m = mock(Behavior {
        ttft_ms: 3_500.0,
        ..Behavior::text(&["late", " answer"])
    })
    .await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig {
            keepalive: Duration::from_secs(1),
            ..ProxyConfig::default()
        },
        ServerLimits::default(),
    )
    .await;
    let started = tokio::time::Instant::now();
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "llm", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    // The headers came after the first keepalive interval, long before the answer.
    let headers_after = started.elapsed();
    assert!(
        headers_after < Duration::from_millis(1_500),
        "{headers_after:?}"
    );
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    assert!(r.headers().contains_key("x-request-id"));
    let body = r.text().await.unwrap();
    let keepalives = body.matches(": keepalive\n\n").count();
    assert!((3..=4).contains(&keepalives), "{body}");
    assert!(body.starts_with(": keepalive\n\n"), "{body}");
    let first_data = body.find("data: ").unwrap();
    assert!(
        body[first_data..].find(": keepalive").is_none(),
        "keepalives stop at the first chunk"
    );
    assert!(
        body.contains("\"late\"") && body.trim_end().ends_with("data: [DONE]"),
        "{body}"
    );

    // A failure after the headers went out is an in-stream error event.
    m.set_default(Behavior {
        headers_delay_ms: 2_500.0,
        ..Behavior::status(500)
    });
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "llm", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    assert!(body.starts_with(": keepalive\n\n"), "{body}");
    let data = sse_data(&body);
    let err: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert_eq!(err["error"]["code"], "retry_exhausted", "{body}");
    assert!(!body.contains("[DONE]"));
}

#[tokio::test(start_paused = true)]
async fn a_504_says_what_happened() {
    let m = mock(Behavior {
        ttft_ms: 10_000.0,
        ..Behavior::text(&["late"])
    })
    .await;
    let llm = scope_with("LLM", ScopeKind::Chat, vec![source("a", &m)], None, |s| {
        s.call_deadline = Some(Duration::from_secs(1));
    })
    .await;
    let s = serve(vec![llm]).await;
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 504);
    assert_eq!(r.headers()["x-polygw-attempts"], "1");
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("after 1 attempt(s)"), "{msg}");
    assert!(!msg.contains("no attempt made"), "{msg}");
    assert_eq!(m.requests().len(), 1, "the upstream did receive it");
}

#[tokio::test]
async fn the_declared_kind_decides_the_endpoint_not_the_name() {
    let m = mock(Behavior::text(&["chat", " answer"])).await;
    // A chat scope named EMBED is a chat scope.
    let embed_named_chat = chat_scope("EMBED", &m).await;
    let vectors = scope_with(
        "VECTORS",
        ScopeKind::Embedding,
        vec![source("e", &m)],
        None,
        |_| {},
    )
    .await;
    let s = serve(vec![embed_named_chat, vectors]).await;
    let c = openai(&s, "unused");
    let r = c
        .chat()
        .create(
            CreateChatCompletionRequestArgs::default()
                .model("EMBED")
                .messages(vec![user("hi")])
                .build()
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.choices[0].message.content.as_deref(), Some("chat answer"));
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "vectors", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/embeddings"),
        "{v}"
    );
    let r = http()
        .post(format!("{}/embeddings", s.v1()))
        .json(&json!({"model": "embed", "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let health: Value = http()
        .get(format!("{}/healthz", s.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["scopes"][0]["kind"], "chat");
    assert_eq!(health["scopes"][1]["kind"], "embedding");
}

#[tokio::test]
async fn streams_through_an_openai_client_with_usage() {
    let m = mock(Behavior::text(&["Hello", " from", " a"])).await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let c = openai(&s, "unused");
    let req = CreateChatCompletionRequestArgs::default()
        .model("llm")
        .messages(vec![user("hi")])
        .stream(true)
        .stream_options(ChatCompletionStreamOptions {
            include_usage: Some(true),
            include_obfuscation: None,
        })
        .build()
        .unwrap();
    let mut st = c.chat().create_stream(req).await.unwrap();
    let (mut text, mut usage, mut ids) = (String::new(), None, std::collections::BTreeSet::new());
    while let Some(chunk) = st.next().await {
        let chunk = chunk.unwrap();
        ids.insert(chunk.id.clone());
        if let Some(u) = chunk.usage {
            usage = Some(u);
        }
        for ch in chunk.choices {
            if let Some(t) = ch.delta.content {
                text.push_str(&t);
            }
        }
    }
    assert_eq!(text, "Hello from a");
    assert_eq!(ids.len(), 1, "one id for the whole stream: {ids:?}");
    assert!(usage.unwrap().completion_tokens > 0);
}
