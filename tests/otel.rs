//! OpenTelemetry through `polygw serve` (SPEC §26.1): the spawned program, configured
//! only by the standard `OTEL_*` variables, exports to an OTLP/HTTP receiver that
//! decodes with the official protobuf definitions. A streamed call that is cut and
//! resumed is one trace under the client's `traceparent`, with a span per upstream
//! request (each upstream saw its own span as parent), usage on the answering one and
//! the resume event; a hedged call shows both legs; the GenAI metrics arrive; and a
//! receiver that is down or slow fails no call, its drops counted on `/metrics`.

#[path = "support/otlp.rs"]
mod otlp;
mod support;

use std::time::Duration;

use polygw_mock_upstream::{Behavior, Fault, MockUpstream};
use support::{mock, serve_args, source};

use otlp::{int_attr, parent_id, span_id, str_attr, trace_id, Sink};

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn words(n: u32) -> Behavior {
    Behavior {
        chunk_count: Some(n),
        ..Behavior::default()
    }
}

/// Primary `a`, fallback `b`, fast retries, OpenTelemetry to `endpoint`.
fn env(
    a: &MockUpstream,
    b: &MockUpstream,
    endpoint: &str,
    extra: &[(&str, &str)],
) -> Vec<(String, String)> {
    let mut v = source("LLM", "a", a, &[("PRIORITY", "0")]);
    v.extend(source("LLM", "b", b, &[("PRIORITY", "1")]));
    for (k, x) in [
        ("LLM__RETRY__BACKOFF_BASE_S", "0.01"),
        ("LLM__RETRY__BACKOFF_MAX_S", "0.02"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        ("OTEL_SERVICE_NAME", "polygw-under-test"),
        ("OTEL_BSP_SCHEDULE_DELAY", "50"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "200"),
    ] {
        v.push((k.into(), x.into()));
    }
    v.extend(extra.iter().map(|(k, x)| (k.to_string(), x.to_string())));
    v
}

/// One streamed chat call through the proxy; the whole body.
async fn stream(base: &str, traceparent: Option<&str>) -> (u16, String) {
    let mut rb = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(&serde_json::json!({
            "model": "llm",
            "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "tell me a story"}],
        }));
    if let Some(t) = traceparent {
        rb = rb.header("traceparent", t);
    }
    let r = rb.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_stream_is_one_trace_under_the_callers_span() {
    let sink = Sink::start(Duration::ZERO).await;
    let a = mock(Behavior {
        fault: Some(Fault::ResetAfter { chunks: 30 }),
        ..words(60)
    })
    .await;
    let b = mock(words(60)).await;
    let s = serve_args(&[], &env(&a, &b, &sink.endpoint, &[]));
    let caller = format!("00-{TRACE}-{CALLER_SPAN}-01");
    let (status, body) = stream(&s.base, Some(&caller)).await;
    assert_eq!(status, 200);
    assert!(body.contains("[DONE]"), "{body}");

    sink.wait("the call's spans", |g| {
        g.spans.iter().filter(|s| trace_id(s) == TRACE).count() >= 3
    })
    .await;
    let sent_by = {
        let got = sink.got.lock().unwrap();
        assert_eq!(got.service.as_deref(), Some("polygw-under-test"));
        let spans: Vec<_> = got.spans.iter().filter(|s| trace_id(s) == TRACE).collect();
        let root = spans
            .iter()
            .find(|s| parent_id(s) == CALLER_SPAN)
            .expect("the call's span continues the caller's");
        assert_eq!(root.name, "chat llm");
        assert_eq!(root.kind, 3, "SPAN_KIND_CLIENT");
        assert_eq!(
            str_attr(&root.attributes, "gen_ai.operation.name"),
            Some("chat")
        );
        assert_eq!(int_attr(&root.attributes, "polygw.resumes"), Some(1));
        let events: Vec<&str> = root.events.iter().map(|e| e.name.as_str()).collect();
        assert!(events.contains(&"polygw.resume"), "{events:?}");
        assert!(events.contains(&"polygw.commit"), "{events:?}");
        let children: Vec<_> = spans
            .iter()
            .filter(|s| parent_id(s) == span_id(root))
            .collect();
        assert_eq!(children.len(), 2, "one span per upstream request");
        let role = |r: &str| {
            children
                .iter()
                .find(|s| str_attr(&s.attributes, "polygw.leg_role") == Some(r))
                .unwrap_or_else(|| panic!("no {r} span"))
        };
        let primary = role("primary");
        let resume = role("resume");
        assert!(str_attr(&primary.attributes, "error.type").is_some());
        assert_eq!(
            primary.status.as_ref().map(|s| s.code),
            Some(2),
            "STATUS_CODE_ERROR"
        );
        assert_eq!(str_attr(&resume.attributes, "polygw.source"), Some("b-0"));
        assert!(int_attr(&resume.attributes, "gen_ai.usage.output_tokens").is_some_and(|n| n > 0));
        assert_eq!(
            str_attr(&resume.attributes, "gen_ai.request.model"),
            Some("model-b")
        );
        assert_eq!(
            str_attr(&resume.attributes, "server.address"),
            Some("127.0.0.1")
        );
        assert!(str_attr(&resume.attributes, "polygw.resume_mode").is_some());
        // Each upstream saw the caller's trace, its own request's span as parent.
        [(&a, span_id(primary)), (&b, span_id(resume))]
    };
    for (m, span) in sent_by {
        let log = m.wait_for_ended(1, Duration::from_secs(5)).await;
        let sent = log[0].traceparent.clone().expect("a traceparent upstream");
        assert_eq!(sent, format!("00-{TRACE}-{span}-01"));
    }

    sink.wait("the GenAI metrics", |g| {
        [
            "gen_ai.client.token.usage",
            "gen_ai.client.operation.duration",
            "gen_ai.client.operation.time_to_first_chunk",
            "polygw.calls",
            "polygw.attempts",
        ]
        .iter()
        .all(|n| g.metrics.iter().any(|(m, _)| m == n))
    })
    .await;
    let got = sink.got.lock().unwrap();
    let (_, usage) = got
        .metrics
        .iter()
        .find(|(m, _)| m == "gen_ai.client.token.usage")
        .unwrap();
    assert!(str_attr(usage, "gen_ai.token.type").is_some());
    assert!(str_attr(usage, "gen_ai.provider.name").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedged_call_shows_both_legs() {
    let sink = Sink::start(Duration::ZERO).await;
    let a = mock(Behavior {
        ttft_ms: 3_000.0,
        ..words(20)
    })
    .await;
    let b = mock(words(20)).await;
    let s = serve_args(
        &[],
        &env(&a, &b, &sink.endpoint, &[("LLM__HEDGE__AFTER_S", "0.2")]),
    );
    let (status, body) = stream(&s.base, None).await;
    assert_eq!(status, 200);
    assert!(body.contains("[DONE]"));
    sink.wait("a hedged call's three spans", |g| g.spans.len() >= 3)
        .await;
    let got = sink.got.lock().unwrap();
    let root = got
        .spans
        .iter()
        .find(|s| s.parent_span_id.is_empty())
        .expect("a root span of its own trace");
    let events: Vec<&str> = root.events.iter().map(|e| e.name.as_str()).collect();
    assert!(events.contains(&"polygw.hedge_launched"), "{events:?}");
    let legs: Vec<_> = got
        .spans
        .iter()
        .filter(|s| parent_id(s) == span_id(root))
        .collect();
    assert_eq!(legs.len(), 2, "both legs");
    let hedge = legs
        .iter()
        .find(|s| str_attr(&s.attributes, "polygw.leg_role") == Some("hedge"))
        .expect("the hedge leg");
    assert_eq!(
        str_attr(&hedge.attributes, "polygw.hedge_reason"),
        Some("first_token")
    );
    assert_eq!(str_attr(&hedge.attributes, "polygw.source"), Some("b-0"));
    assert!(legs
        .iter()
        .any(|s| str_attr(&s.attributes, "polygw.leg_role") == Some("primary")));
}

fn dropped(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("polygw_otel_dropped_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no polygw_otel_dropped_total in\n{metrics}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_or_slow_fails_no_call_and_drops_are_counted() {
    let slow = Sink::start(Duration::from_secs(5)).await;
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let e = format!("http://{}", l.local_addr().unwrap());
        drop(l);
        e
    };
    for endpoint in [down, slow.endpoint.clone()] {
        let a = mock(words(5)).await;
        let b = mock(words(5)).await;
        let s = serve_args(
            &[],
            &env(
                &a,
                &b,
                &endpoint,
                &[
                    ("OTEL_EXPORTER_OTLP_TIMEOUT", "100"),
                    ("OTEL_BSP_SCHEDULE_DELAY", "10"),
                    ("OTEL_BSP_MAX_QUEUE_SIZE", "4"),
                ],
            ),
        );
        for _ in 0..12 {
            let (status, body) = stream(&s.base, None).await;
            assert_eq!(status, 200, "{endpoint}: {body}");
            assert!(body.contains("[DONE]"));
        }
        let until = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let m = reqwest::get(format!("{}/metrics", s.base))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            if dropped(&m) > 0 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "{endpoint}: no drop counted\n{m}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// An attribute of a span Phoenix returns: a flat key, or the same key nested by dots.
fn phoenix_attr<'a>(span: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    let attrs = &span["attributes"];
    attrs
        .get(key)
        .or_else(|| key.split('.').try_fold(attrs, |v, part| v.get(part)))
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Arize Phoenix (pinned, from PyPI), a receiver teams use, started by the test: the
/// spans of a resumed streamed call are read back through its REST API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phoenix_shows_a_resumed_call_under_the_callers_trace() {
    let Some(phoenix) =
        support::sdk::phoenix("phoenix_shows_a_resumed_call_under_the_callers_trace")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = std::process::Command::new(&phoenix)
        .arg("serve")
        .env("PHOENIX_HOST", "127.0.0.1")
        .env("PHOENIX_PORT", port.to_string())
        .env("PHOENIX_GRPC_PORT", free_port().to_string())
        .env("PHOENIX_WORKING_DIR", dir.path())
        .env("PHOENIX_TELEMETRY_ENABLED", "false")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("phoenix serve");
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _kill = Kill(&mut child);
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        if let Ok(r) = http.get(format!("{base}/healthz")).send().await {
            if r.status().is_success() {
                break;
            }
        }
        assert!(tokio::time::Instant::now() < until, "Phoenix did not start");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let a = mock(Behavior {
        fault: Some(Fault::ResetAfter { chunks: 30 }),
        ..words(60)
    })
    .await;
    let b = mock(words(60)).await;
    let s = serve_args(
        &[],
        &env(
            &a,
            &b,
            &base,
            // Phoenix takes traces; metrics go nowhere.
            &[("OTEL_METRICS_EXPORTER", "none")],
        ),
    );
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let caller = "b7ad6b7169203331";
    let (status, body) = stream(&s.base, Some(&format!("00-{trace}-{caller}-01"))).await;
    assert_eq!(status, 200);
    assert!(body.contains("[DONE]"));

    let url = format!("{base}/v1/projects/default/spans?trace_id={trace}&limit=100");
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    let spans: Vec<serde_json::Value> = loop {
        let got: serde_json::Value = match http.get(&url).send().await {
            Ok(r) if r.status().is_success() => r.json().await.unwrap_or_default(),
            _ => serde_json::Value::Null,
        };
        let spans = got["data"].as_array().cloned().unwrap_or_default();
        if spans.len() >= 3 {
            break spans;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "Phoenix never showed the call's three spans: {got}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let root = spans
        .iter()
        .find(|s| s["parent_id"] == caller)
        .unwrap_or_else(|| panic!("no span under the caller's: {spans:#?}"));
    assert_eq!(root["context"]["trace_id"], trace);
    assert_eq!(root["name"], "chat llm");
    let events: Vec<&str> = root["events"]
        .as_array()
        .map(|e| e.iter().filter_map(|e| e["name"].as_str()).collect())
        .unwrap_or_default();
    assert!(events.contains(&"polygw.resume"), "{events:?}");
    let root_id = root["context"]["span_id"].clone();
    let children: Vec<_> = spans.iter().filter(|s| s["parent_id"] == root_id).collect();
    assert_eq!(
        children.len(),
        2,
        "one span per upstream request: {spans:#?}"
    );
    let resume = children
        .iter()
        .find(|s| phoenix_attr(s, "polygw.leg_role").and_then(|v| v.as_str()) == Some("resume"))
        .expect("the resume leg's span");
    let out = phoenix_attr(resume, "gen_ai.usage.output_tokens").and_then(|v| {
        v.as_i64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
    });
    assert!(
        out.is_some_and(|n| n > 0),
        "usage on the answering request: {resume:#}"
    );
}

/// Embeddings are calls too: a span named for the operation, with its usage, under the
/// caller's trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embeddings_call_is_a_span_with_its_usage() {
    let sink = Sink::start(Duration::ZERO).await;
    let a = mock(words(5)).await;
    let b = mock(words(5)).await;
    let mut vars = env(&a, &b, &sink.endpoint, &[]);
    vars.extend(source("EMBED", "e", &a, &[]));
    vars.push(("EMBED__KIND".into(), "embedding".into()));
    let s = serve_args(&[], &vars);
    let r = reqwest::Client::new()
        .post(format!("{}/v1/embeddings", s.base))
        .header("traceparent", format!("00-{TRACE}-{CALLER_SPAN}-01"))
        .json(&serde_json::json!({"model": "embed", "input": ["one", "two"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap());
    sink.wait("the embeddings call's spans", |g| {
        g.spans.iter().filter(|s| trace_id(s) == TRACE).count() >= 2
    })
    .await;
    let got = sink.got.lock().unwrap();
    let root = got
        .spans
        .iter()
        .find(|s| parent_id(s) == CALLER_SPAN)
        .expect("the call's span");
    assert_eq!(root.name, "embeddings embed");
    assert!(int_attr(&root.attributes, "gen_ai.usage.input_tokens").is_some_and(|n| n > 0));
    let child = got
        .spans
        .iter()
        .find(|s| parent_id(s) == span_id(root))
        .expect("the upstream request's span");
    assert_eq!(
        str_attr(&child.attributes, "gen_ai.operation.name"),
        Some("embeddings")
    );
}
