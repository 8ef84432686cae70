//! Integration tests of the mock upstream over real loopback HTTP (reqwest as the
//! client, raw TCP where the wire itself matters): routes, the SSE it writes, delays,
//! keepalives, every fault, the request log, profiles and shutdown; prefill in
//! `mock/prefill.rs`, the prefix cache in `mock/cache.rs`, the billing log in
//! `mock/billing.rs`.

use std::io::{Read, Write};
use std::time::Duration;

use polygw_mock_upstream::{
    Behavior, EndKind, Fault, MockConfig, MockUpstream, Profile, RetryAfter, Stall, ToolCallSpec,
    UsageMode,
};
use serde_json::{json, Value};

#[path = "mock/billing.rs"]
mod billing;
#[path = "mock/cache.rs"]
mod cache;
#[path = "mock/prefill.rs"]
mod prefill;

async fn mock() -> MockUpstream {
    MockUpstream::start(MockConfig::default()).await.unwrap()
}

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

async fn post(m: &MockUpstream, path: &str, body: Value) -> reqwest::Response {
    client()
        .post(format!("{}{path}", m.base_url()))
        .header("x-polygw-call-id", "cid-1")
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

async fn json_of(r: reqwest::Response) -> Value {
    serde_json::from_str(&r.text().await.unwrap()).unwrap()
}

fn chat_body(stream: bool) -> Value {
    json!({"model": "m-test", "stream": stream, "messages": [{"role": "user", "content": "12345678"}]})
}

/// The data payloads of an SSE body, and the number of comment lines.
fn sse_data(text: &str) -> (Vec<String>, usize) {
    let mut data = Vec::new();
    let mut comments = 0;
    for line in text.lines() {
        if let Some(d) = line.strip_prefix("data: ") {
            data.push(d.to_string());
        } else if line.starts_with(':') {
            comments += 1;
        }
    }
    (data, comments)
}

fn now() -> tokio::time::Instant {
    tokio::time::Instant::now()
}

#[tokio::test]
async fn routes_models_auth_and_bad_requests() {
    let m = MockUpstream::start(MockConfig {
        require_key: Some("k-123".into()),
        models: vec!["a".into(), "b".into()],
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let c = client();
    let r = c
        .get(format!("{}/models", m.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = json_of(r).await;
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let r = c
        .get(format!("{}/models", m.base_url()))
        .bearer_auth("k-123")
        .send()
        .await
        .unwrap();
    let v: Value = json_of(r).await;
    assert_eq!(v["data"][1]["id"], "b");
    let r = c
        .get(format!("{}/nope", m.base_url()))
        .bearer_auth("k-123")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = c
        .post(format!("{}/chat/completions", m.base_url()))
        .bearer_auth("k-123")
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let log = m.requests();
    assert_eq!(log.len(), 4);
    assert!(!log[0].authorization && log[1].authorization);
    assert_eq!(log[0].end, EndKind::Error { status: 401 });
    assert_eq!(log[1].end, EndKind::Completed);
    assert_eq!(log[3].end, EndKind::Error { status: 400 });
    m.shutdown().await;
}

#[tokio::test]
async fn default_stream_is_openai_shaped_and_recorded() {
    let m = mock().await;
    let text = post(&m, "/chat/completions", chat_body(true))
        .await
        .text()
        .await
        .unwrap();
    let (data, comments) = sse_data(&text);
    assert_eq!(comments, 0);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let frames: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(frames[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = frames
        .iter()
        .filter_map(|f| f["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "Hello from the polygw mock.");
    let finish = &frames[frames.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let usage = &frames[frames.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(usage["usage"]["prompt_tokens"], 2, "⌈8 chars / 4⌉");
    assert_eq!(frames[1]["model"], "m-test", "model echoed");
    let rec = &m.wait_for_ended(1, Duration::from_secs(5)).await[0];
    assert_eq!(rec.end, EndKind::Completed);
    assert_eq!(rec.chunks_sent, 5);
    assert_eq!(rec.frames_sent, 8, "role + 5 + finish + usage");
    assert_eq!(rec.content, rec.full_content);
    assert_eq!(rec.usage.unwrap().completion_tokens, 5);
    assert_eq!(rec.call_id.as_deref(), Some("cid-1"));
    assert_eq!(rec.model.as_deref(), Some("m-test"));
    assert!(rec.stream);
    assert!(rec.ended_at.unwrap() >= rec.arrived_at);
}

#[tokio::test]
async fn plain_answers_reasoning_tool_calls_and_usage_modes() {
    let m = mock().await;
    m.push_script(Behavior {
        reasoning: vec!["think".into()],
        chunks: vec!["a".into(), "b".into()],
        tool_call: Some(ToolCallSpec::default()),
        ..Behavior::default()
    });
    let v: Value = json_of(post(&m, "/chat/completions", chat_body(false)).await).await;
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["content"], "ab");
    assert_eq!(msg["reasoning_content"], "think");
    assert_eq!(msg["tool_calls"][0]["function"]["name"], "get_weather");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"],
        1
    );
    // Inline usage on the finish chunk; no [DONE].
    m.push_script(Behavior {
        usage: UsageMode::Choice,
        done: false,
        ..Behavior::default()
    });
    let text = post(&m, "/chat/completions", chat_body(true))
        .await
        .text()
        .await
        .unwrap();
    let (data, _) = sse_data(&text);
    assert_ne!(data.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(last["choices"][0]["usage"]["completion_tokens"], 5);
    // No usage at all.
    m.push_script(Behavior {
        usage: UsageMode::None,
        ..Behavior::default()
    });
    let text = post(&m, "/chat/completions", chat_body(true))
        .await
        .text()
        .await
        .unwrap();
    assert!(!text.contains("\"usage\""));
    let log = m.wait_for_ended(3, Duration::from_secs(5)).await;
    assert!(log[2].usage.is_none());
}

#[tokio::test]
async fn delays_gaps_stalls_and_keepalives() {
    let m = mock().await;
    m.push_script(Behavior {
        headers_delay_ms: 100.0,
        ttft_ms: 100.0,
        chunk_count: Some(4),
        gap_ms: 10.0,
        stalls: vec![Stall {
            before_chunk: 2,
            ms: 250.0,
        }],
        keepalive_ms: Some(30.0),
        ..Behavior::default()
    });
    let start = now();
    let resp = post(&m, "/chat/completions", chat_body(true)).await;
    let headers_after = start.elapsed();
    let text = resp.text().await.unwrap();
    let total = start.elapsed();
    assert!(
        headers_after >= Duration::from_millis(100),
        "{headers_after:?}"
    );
    assert!(total >= Duration::from_millis(100 + 100 + 250), "{total:?}");
    let (_, comments) = sse_data(&text);
    assert!(
        comments >= 5,
        "keepalives during the TTFT and the stall: {comments}"
    );
    let rec = &m.wait_for_ended(1, Duration::from_secs(5)).await[0];
    assert_eq!(rec.keepalives_sent as usize, comments);
    assert!(rec.headers_at.unwrap() - rec.arrived_at >= Duration::from_millis(100));
}

#[tokio::test]
async fn plain_answers_wait_for_the_whole_generation() {
    let m = mock().await;
    m.push_script(Behavior {
        ttft_ms: 50.0,
        chunk_count: Some(3),
        gap_ms: 50.0,
        retry_after: Some(RetryAfter::Seconds(3.0)),
        ..Behavior::default()
    });
    let start = now();
    let r = post(&m, "/chat/completions", chat_body(false)).await;
    assert!(start.elapsed() >= Duration::from_millis(150));
    assert_eq!(r.headers()["retry-after"], "3");
}

#[tokio::test]
async fn error_statuses_with_retry_after_and_bodies() {
    let m = mock().await;
    m.push_script(Behavior {
        status: 429,
        retry_after: Some(RetryAfter::Raw("Wed, 21 Oct 2015 07:28:00 GMT".into())),
        ..Behavior::default()
    });
    m.push_script(Behavior {
        status: 400,
        error_code: Some("context_length_exceeded".into()),
        ..Behavior::default()
    });
    m.push_script(Behavior {
        status: 503,
        error_body: Some(json!({"oops": 1})),
        ..Behavior::default()
    });
    let r = post(&m, "/chat/completions", chat_body(true)).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "Wed, 21 Oct 2015 07:28:00 GMT");
    let v: Value = json_of(r).await;
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    let v: Value = json_of(post(&m, "/chat/completions", chat_body(true)).await).await;
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let v: Value = json_of(post(&m, "/chat/completions", chat_body(false)).await).await;
    assert_eq!(v, json!({"oops": 1}));
    let ends: Vec<EndKind> = m.requests().iter().map(|r| r.end).collect();
    assert_eq!(
        ends,
        [
            EndKind::Error { status: 429 },
            EndKind::Error { status: 400 },
            EndKind::Error { status: 503 }
        ]
    );
}

/// Sends a raw HTTP request; returns what the server wrote and how the read ended.
async fn raw_exchange(m: &MockUpstream, body: &str) -> (Vec<u8>, std::io::Result<()>) {
    let addr = m.addr();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return (got, Ok(())),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => return (got, Err(e)),
            }
        }
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn reset_before_headers_sends_nothing_then_an_rst() {
    let m = mock().await;
    m.push_script(Behavior::fault(Fault::ResetBeforeHeaders));
    let (got, end) = raw_exchange(&m, &chat_body(true).to_string()).await;
    assert!(got.is_empty(), "no response bytes at all");
    let e = end.expect_err("the connection is reset, not closed");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
    assert_eq!(m.requests()[0].end, EndKind::ResetBeforeHeaders);
}

#[tokio::test]
async fn reset_mid_stream_after_n_chunks() {
    let m = mock().await;
    m.push_script(Behavior {
        chunk_count: Some(10),
        fault: Some(Fault::ResetAfter { chunks: 3 }),
        ..Behavior::default()
    });
    let (got, end) = raw_exchange(&m, &chat_body(true).to_string()).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(
        text.matches("\"content\":\"").count(),
        1 + 3,
        "role frame + 3 chunks"
    );
    assert!(!text.contains("finish_reason\":\"stop"));
    assert!(!text.ends_with("0\r\n\r\n"), "no terminating chunk");
    assert_eq!(end.unwrap_err().kind(), std::io::ErrorKind::ConnectionReset);
    let rec = &m.wait_for_ended(1, Duration::from_secs(5)).await[0];
    assert_eq!(rec.end, EndKind::ResetMidStream);
    assert_eq!(rec.chunks_sent, 3);
}

#[tokio::test]
async fn truncation_ends_the_body_cleanly_without_finish() {
    let m = mock().await;
    m.push_script(Behavior {
        chunk_count: Some(10),
        fault: Some(Fault::TruncateAfter { chunks: 4 }),
        ..Behavior::default()
    });
    let r = post(&m, "/chat/completions", chat_body(true)).await;
    let text = r.text().await.expect("a cleanly ended body");
    assert!(!text.contains("finish_reason\":\"stop"));
    assert!(!text.contains("[DONE]"));
    assert!(!text.contains("usage"));
    let rec = &m.wait_for_ended(1, Duration::from_secs(5)).await[0];
    assert_eq!((rec.end, rec.chunks_sent), (EndKind::Truncated, 4));
    assert_ne!(rec.content, rec.full_content);
}

#[tokio::test]
async fn malformed_and_error_frames() {
    let m = mock().await;
    m.push_script(Behavior {
        chunk_count: Some(4),
        fault: Some(Fault::MalformedAt { chunk: 1 }),
        ..Behavior::default()
    });
    m.push_script(Behavior {
        chunk_count: Some(4),
        fault: Some(Fault::ErrorFrameAt {
            chunk: 2,
            error: Some(json!({"error": {"message": "boom", "code": "server_error"}})),
        }),
        ..Behavior::default()
    });
    let text = post(&m, "/chat/completions", chat_body(true))
        .await
        .text()
        .await
        .unwrap();
    let (data, _) = sse_data(&text);
    let bad = data
        .iter()
        .filter(|d| *d != "[DONE]" && serde_json::from_str::<Value>(d).is_err())
        .count();
    assert_eq!(bad, 1, "exactly one malformed frame");
    let text = post(&m, "/chat/completions", chat_body(true))
        .await
        .text()
        .await
        .unwrap();
    let (data, _) = sse_data(&text);
    let last: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert_eq!(last["error"]["message"], "boom");
    assert!(!text.contains("[DONE]"));
    // Plain: a 200 whose body is the error object; an invalid JSON body.
    m.push_script(Behavior::fault(Fault::ErrorFrameAt {
        chunk: 0,
        error: None,
    }));
    let v: Value = json_of(post(&m, "/chat/completions", chat_body(false)).await).await;
    assert_eq!(v["error"]["code"], "server_error");
    m.push_script(Behavior::fault(Fault::MalformedAt { chunk: 0 }));
    let text = post(&m, "/chat/completions", chat_body(false))
        .await
        .text()
        .await
        .unwrap();
    assert!(serde_json::from_str::<Value>(&text).is_err());
}

#[tokio::test]
async fn client_disconnect_mid_stream_is_recorded() {
    let m = mock().await;
    // A long stall without keepalives: the mock notices the client leaving from the
    // socket itself, not from a failed write.
    m.push_script(Behavior {
        chunk_count: Some(5),
        stalls: vec![Stall {
            before_chunk: 2,
            ms: 30_000.0,
        }],
        ..Behavior::default()
    });
    let mut r = post(&m, "/chat/completions", chat_body(true)).await;
    let mut seen = String::new();
    // Role frame + the two chunks before the stall.
    while seen.matches("\"content\":\"").count() < 3 {
        let c = r.chunk().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&c));
    }
    drop(r);
    let start = now();
    let rec = &m.wait_for_ended(1, Duration::from_secs(10)).await[0];
    assert_eq!(rec.end, EndKind::ClientDisconnected);
    assert!(start.elapsed() < Duration::from_secs(10));
    assert_eq!(rec.chunks_sent, 2);
}

#[tokio::test]
async fn hang_after_finish_keeps_the_connection_open() {
    let m = mock().await;
    m.push_script(Behavior {
        chunk_count: Some(2),
        fault: Some(Fault::HangAfterFinish),
        ..Behavior::default()
    });
    let mut r = post(&m, "/chat/completions", chat_body(true)).await;
    let mut seen = String::new();
    while !seen.contains("\"usage\"") {
        let c = r.chunk().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&c));
    }
    let more = tokio::time::timeout(Duration::from_millis(200), r.chunk()).await;
    assert!(more.is_err(), "no end of body, no [DONE]");
    drop(r);
    let rec = &m.wait_for_ended(1, Duration::from_secs(10)).await[0];
    assert_eq!(rec.end, EndKind::ClientDisconnected);
    assert!(rec.usage.is_some());
}

#[tokio::test]
async fn raw_bodies_from_strings_and_files() {
    let dir = tempfile::tempdir().unwrap();
    let jsonl = dir.path().join("x.chunks.jsonl");
    std::fs::write(
        &jsonl,
        "{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n{\"choices\":[]}",
    )
    .unwrap();
    let sse_file = dir.path().join("x.sse");
    std::fs::write(&sse_file, "data: 1\n\n").unwrap();
    let m = mock().await;
    m.push_script(Behavior::jsonl(&jsonl));
    m.push_script(Behavior {
        raw_sse_file: Some(sse_file),
        ..Behavior::default()
    });
    m.push_script(Behavior {
        raw_sse: Some("data: x\n\n".repeat(10)),
        raw_chunk_bytes: Some(3),
        ..Behavior::default()
    });
    m.push_script(Behavior {
        raw_body: Some("plain text".into()),
        content_type: Some("text/plain".into()),
        ..Behavior::default()
    });
    m.push_script(Behavior::jsonl(dir.path().join("missing.jsonl")));
    let t = post(&m, "/chat/completions", chat_body(true))
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(
        t,
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[]}\n\ndata: [DONE]\n\n"
    );
    let t = post(&m, "/chat/completions", chat_body(true))
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(t, "data: 1\n\n");
    let t = post(&m, "/chat/completions", chat_body(true))
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(t, "data: x\n\n".repeat(10));
    let r = post(&m, "/chat/completions", chat_body(false)).await;
    assert_eq!(r.headers()["content-type"], "text/plain");
    assert_eq!(r.text().await.unwrap(), "plain text");
    let r = post(&m, "/chat/completions", chat_body(true)).await;
    assert_eq!(r.status(), 500);
    let log = m.wait_for_ended(5, Duration::from_secs(5)).await;
    assert_eq!(log[2].frames_sent, 30, "written 3 bytes at a time");
}

#[tokio::test]
async fn embeddings_and_vision() {
    let m = MockUpstream::start(MockConfig {
        embedding_dim: 8,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let v: Value = json_of(
        post(
            &m,
            "/embeddings",
            json!({"model": "e", "input": ["ab", "abcdefgh"]}),
        )
        .await,
    )
    .await;
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    let first: Vec<f32> = serde_json::from_value(v["data"][0]["embedding"].clone()).unwrap();
    assert_eq!(first, polygw_mock_upstream::embedding_of("ab", 8));
    assert_eq!(v["usage"]["prompt_tokens"], 1 + 2);
    let r = post(&m, "/embeddings", json!({"model": "e", "input": 3})).await;
    assert_eq!(r.status(), 400);
    let vision = json!({"model": "v", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "read"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAECAwQF"}}
    ]}]});
    let v: Value = json_of(post(&m, "/chat/completions", vision).await).await;
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "[mock-ocr] 1 image(s): image/jpeg 6 bytes"
    );
    assert_eq!(v["usage"]["prompt_tokens"], 1 + 85);
    let log = m.requests();
    assert_eq!(log[0].usage.unwrap().prompt_tokens, 3);
    assert_eq!(log[2].images[0].bytes, 6);
}

#[tokio::test]
async fn scripts_are_fifo_then_default_then_profile() {
    let m = mock().await;
    m.push_scripts([Behavior::status(500), Behavior::status(503)]);
    assert_eq!(m.queued_scripts(), 2);
    let s1 = post(&m, "/chat/completions", chat_body(false))
        .await
        .status();
    let s2 = post(&m, "/chat/completions", chat_body(false))
        .await
        .status();
    assert_eq!((s1.as_u16(), s2.as_u16()), (500, 503));
    m.set_default(Behavior::status(418));
    assert_eq!(
        post(&m, "/chat/completions", chat_body(false))
            .await
            .status(),
        418
    );
    m.set_profile(Profile::fixed("teapot", Behavior::status(402)));
    assert_eq!(
        post(&m, "/chat/completions", chat_body(false))
            .await
            .status(),
        402
    );
    assert_eq!(m.requests().len(), 4);
    m.reset_log();
    assert!(m.requests().is_empty());
}

#[tokio::test]
async fn the_log_is_bounded_and_config_debug_hides_the_key() {
    let cfg = MockConfig {
        log_capacity: 3,
        require_key: Some("k-secret-777".into()),
        ..MockConfig::default()
    };
    assert!(!format!("{cfg:?}").contains("k-secret-777"));
    let m = MockUpstream::start(cfg).await.unwrap();
    for _ in 0..5 {
        client()
            .get(format!("{}/models", m.base_url()))
            .bearer_auth("k-secret-777")
            .send()
            .await
            .unwrap();
    }
    let ids: Vec<u64> = m.requests().iter().map(|r| r.id).collect();
    assert_eq!(ids, [3, 4, 5], "the most recent requests are kept");
}

#[tokio::test]
async fn long_tail_profile_scaled_down_serves_concurrent_requests() {
    // 1 s of SPEC §12 → 1 ms: a long stall (20–120 s) lasts 20–120 ms here.
    let m = MockUpstream::start(MockConfig::with_profile(
        Profile::named("long-tail", 0.001, 11).unwrap(),
    ))
    .await
    .unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let url = format!("{}/chat/completions", m.base_url());
        tasks.spawn(async move {
            client()
                .post(url)
                .body(chat_body(true).to_string())
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        });
    }
    while let Some(t) = tasks.join_next().await {
        assert!(t.unwrap().ends_with("data: [DONE]\n\n"));
    }
    let log = m.wait_for_ended(8, Duration::from_secs(10)).await;
    assert_eq!(log.len(), 8);
    for r in &log {
        assert_eq!(r.end, EndKind::Completed);
        let content_chunks = r.behavior.as_ref().unwrap().chunk_count.unwrap();
        assert!((50..=400).contains(&content_chunks));
        assert!(r.usage.is_some(), "usage frame present");
        assert_eq!(r.content, r.full_content);
    }
    // Each request draws independently.
    let ttfts: std::collections::BTreeSet<u64> = log
        .iter()
        .map(|r| r.behavior.as_ref().unwrap().ttft_ms.to_bits())
        .collect();
    assert!(ttfts.len() > 1);
}

#[tokio::test]
async fn profile_files_drive_the_mock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mine.json");
    std::fs::write(
        &path,
        r#"{"time_scale": 0.5, "seed": 1, "mix": [
            {"weight": 1, "behavior": {"status": 503, "retry_after": 4}},
            {"weight": 1, "behavior": {"chunks": ["x"]}}
        ]}"#,
    )
    .unwrap();
    let p = Profile::from_file(&path).unwrap();
    assert_eq!(p.name, "mine");
    let m = MockUpstream::start(MockConfig::with_profile(p))
        .await
        .unwrap();
    let mut statuses = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let r = post(&m, "/chat/completions", chat_body(false)).await;
        if r.status() == 503 {
            assert_eq!(r.headers()["retry-after"], "2", "Retry-After scaled by 0.5");
        }
        statuses.insert(r.status().as_u16());
    }
    assert_eq!(statuses.into_iter().collect::<Vec<_>>(), [200, 503]);
    assert!(Profile::from_file(dir.path().join("absent.json")).is_err());
}

#[tokio::test]
async fn shutdown_aborts_in_flight_responses_and_frees_the_port() {
    let m = mock().await;
    m.push_script(Behavior {
        ttft_ms: 60_000.0,
        ..Behavior::default()
    });
    let addr = m.addr();
    let log = m.log();
    let r = post(&m, "/chat/completions", chat_body(true)).await;
    assert_eq!(log.requests()[0].end, EndKind::InFlight);
    let body = tokio::spawn(async move { r.text().await });
    let start = now();
    m.shutdown().await;
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "shutdown is prompt"
    );
    assert_eq!(log.requests()[0].end, EndKind::ServerShutdown);
    assert!(
        body.await.unwrap().is_err(),
        "the client sees the body break"
    );
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "nothing listens after shutdown"
    );
}

#[tokio::test]
async fn dropping_the_handle_stops_the_server() {
    let m = mock().await;
    let addr = m.addr();
    let log = m.log();
    m.push_script(Behavior {
        ttft_ms: 60_000.0,
        ..Behavior::default()
    });
    let r = post(&m, "/chat/completions", chat_body(true)).await;
    drop(m);
    assert!(r.text().await.is_err());
    let rec = &log.wait_for_ended(1, Duration::from_secs(5)).await[0];
    assert_ne!(rec.end, EndKind::InFlight);
    assert!(std::net::TcpStream::connect(addr).is_err());
}
