//! The `polygw` program from the outside: spawned binaries, real loopback HTTP, the
//! proxy driven by a third-party OpenAI client (async-openai).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use async_openai::types::chat::{ChatCompletionStreamOptions, CreateChatCompletionRequestArgs};
use async_openai::types::embeddings::{CreateEmbeddingRequestArgs, EmbeddingInput};
use futures_util::StreamExt;
use polygw_mock_upstream::{Behavior, EndKind, Fault};

mod support;

use support::*;

// ---------------------------------------------------------------- config check, chat

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_check_prints_redacted_settings_and_warnings() {
    let m = mock(Behavior::text(&["x"])).await;
    let mut env = source("LLM", "a", &m, &[("TTFT_TIMEOUT_S", "2")]);
    env.push(("LLM__HEDGE__AFTER_S".into(), "3".into()));
    env.push((
        "LLM__TELEMETRY__URL".into(),
        "postgres://u:hunter2@db/x".into(),
    ));
    let o = polygw(&["config", "check"], &env);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("\"name\": \"a-0\""), "{out}");
    assert!(out.contains("warning: LLM__HEDGE__AFTER_S"), "{out}");
    assert!(
        !out.contains("sk-a-upstream-secret") && !out.contains("hunter2"),
        "{out}"
    );
    // errors: non-zero exit, every key named
    let mut bad = env.clone();
    bad.push(("LLM__RETRY__MAX_ATTEMPTS".into(), "zero".into()));
    bad.push(("LLM__A__0__WEIGHTT".into(), "1".into()));
    let o = polygw(&["config", "check", "--scope", "llm"], &bad);
    let (out, _) = text(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        out.contains("LLM__RETRY__MAX_ATTEMPTS") && out.contains("WEIGHTT"),
        "{out}"
    );
    // nothing configured
    let o = polygw(&["config", "check"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("no scope is configured"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prints_the_answer_and_json_with_call_stats() {
    let m = mock(Behavior::text(&["Hello", " there"])).await;
    let env = source("LLM", "a", &m, &[]);
    let o = polygw(&["chat", "hi"], &env);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(out.trim(), "Hello there");
    assert!(err.contains("via a-0"), "{err}");
    let o = polygw(&["chat", "--json", "--stream", "hi"], &env);
    let (out, _) = text(&o);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["content"], "Hello there");
    assert_eq!(v["call_stats"]["attempts"], 1);
    assert_eq!(v["usage_source"], "measured");
    assert!(v["ttft_ms"].is_number());
    let o = polygw(&["chat", "--stream", "hi"], &env);
    assert_eq!(text(&o).0.trim(), "Hello there");
    // an upstream that rejects: non-zero exit, the provider's code shown
    m.set_default(Behavior {
        error_code: Some("context_length_exceeded".into()),
        ..Behavior::status(400)
    });
    let o = polygw(&["chat", "hi"], &env);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).1.contains("context_length_exceeded"));
}

#[tokio::test]
async fn mock_upstream_command_serves_a_profile() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let mut child = Command::new(BIN)
        .args([
            "mock-upstream",
            "--listen",
            &addr,
            "--profile",
            "fast",
            "--time-scale",
            "0.01",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains(&format!("http://{addr}/v1")), "{line}");
    let r: serde_json::Value = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        r["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .len()
            > 1
    );
    let _ = child.kill();
    let _ = child.wait();
    let o = polygw(&["mock-upstream", "--profile", "no-such-profile"], &[]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("--profile no-such-profile"));
}

// ---------------------------------------------------------------- serve

#[tokio::test]
async fn serve_answers_an_openai_client_plain_streamed_and_embeddings() {
    // The upstream accepts only its own key: the client's key never reaches it.
    let a = keyed_mock("a", Behavior::text(&["Hello", " from", " a"])).await;
    let mut env = source("LLM", "a", &a, &[]);
    env.push(("LLM__MODEL_ALIASES".into(), "gpt-4o-mini".into()));
    env.extend(source("EMBED", "a", &a, &[]));
    // The kind is declared, never inferred from the name.
    env.push(("EMBED__KIND".into(), "embedding".into()));
    env.push((
        "POLYGW_PROXY_KEYS".into(),
        "client-key-1,client-key-2".into(),
    ));
    let s = serve(&env);
    let c = openai(&s.base, "client-key-2");

    let req = CreateChatCompletionRequestArgs::default()
        .model("gpt-4o-mini")
        .messages(vec![user("hi")])
        .build()
        .unwrap();
    let r = c.chat().create(req).await.unwrap();
    assert_eq!(
        r.choices[0].message.content.as_deref(),
        Some("Hello from a")
    );
    assert_eq!(r.model, "model-a", "the model that actually answered");
    let u = r.usage.unwrap();
    assert!(u.prompt_tokens > 0 && u.completion_tokens > 0);

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
    let mut content = String::new();
    let mut usage = None;
    let mut finish = None;
    while let Some(chunk) = st.next().await {
        let chunk = chunk.unwrap();
        if let Some(u) = chunk.usage {
            usage = Some(u);
        }
        for ch in chunk.choices {
            if let Some(t) = ch.delta.content {
                content.push_str(&t);
            }
            if ch.finish_reason.is_some() {
                finish = ch.finish_reason;
            }
        }
    }
    assert_eq!(content, "Hello from a");
    assert!(finish.is_some());
    assert!(usage.unwrap().completion_tokens > 0);

    let req = CreateEmbeddingRequestArgs::default()
        .model("EMBED")
        .input(EmbeddingInput::StringArray(vec![
            "one".into(),
            "two".into(),
            "three".into(),
        ]))
        .build()
        .unwrap();
    let e = c.embeddings().create(req).await.unwrap();
    assert_eq!(e.data.len(), 3);
    assert_eq!(e.data[2].index, 2);
    assert!(!e.data[0].embedding.is_empty());

    // unknown model: 404 listing the known ones; bad key: 401; bad body: 400 naming it
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{}/v1/chat/completions", s.base))
        .bearer_auth("client-key-1")
        .json(&serde_json::json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "model_not_found");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("gpt-4o-mini"));
    let r = http
        .post(format!("{}/v1/chat/completions", s.base))
        .bearer_auth("wrong")
        .json(&serde_json::json!({"model": "llm", "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .get(format!("{}/v1/models", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "no key at all");
    let r = http
        .post(format!("{}/v1/chat/completions", s.base))
        .bearer_auth("client-key-1")
        .json(&serde_json::json!({"model": "llm", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["param"], "temperature");
    let r = http
        .get(format!("{}/v1/models", s.base))
        .bearer_auth("client-key-1")
        .send()
        .await
        .unwrap();
    let models: serde_json::Value = r.json().await.unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert!(ids.contains(&"LLM") && ids.contains(&"gpt-4o-mini") && ids.contains(&"EMBED"));

    // metrics
    let m = http
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("polygw_calls_total{scope=\"LLM\",outcome=\"ok\"} 2"),
        "{m}"
    );
    assert!(
        m.contains("polygw_attempts_total{scope=\"LLM\",source=\"a-0\",outcome=\"ok\"} 2"),
        "{m}"
    );
    assert!(
        m.contains("polygw_ttft_seconds_count{scope=\"LLM\",source=\"a-0\"} 1"),
        "{m}"
    );
    assert!(m.contains("polygw_call_latency_seconds_bucket"), "{m}");
    assert!(m.contains("polygw_telemetry_rows_dropped_total 0"), "{m}");
    let h = http
        .get(format!("{}/healthz", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(h.status(), 200);
}

#[tokio::test]
async fn serve_hedges_before_the_commit_and_never_passes_off_a_broken_stream() {
    let slow = mock(Behavior {
        ttft_ms: 5_000.0,
        ..Behavior::text(&["slow"])
    })
    .await;
    let fast = mock(Behavior::text(&["fast", " answer"])).await;
    let mut env = source("LLM", "slow", &slow, &[("PRIORITY", "0")]);
    env.extend(source("LLM", "fast", &fast, &[("PRIORITY", "1")]));
    env.push(("LLM__HEDGE__AFTER_S".into(), "0.2".into()));
    env.push(("LLM__HEDGE__BUDGET_PCT".into(), "0".into()));
    env.push(("LLM__RETRY__ON_NO_RUNNABLE".into(), "fail".into()));
    // Resume off: a failure after the commit is final (resumes have their own tests).
    env.push(("LLM__STREAM__RESUME".into(), "off".into()));
    let s = serve(&env);
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&serde_json::json!({"model": "llm", "stream": true, "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-polygw-source"], "fast-0");
    assert_eq!(r.headers()["x-polygw-hedged"], "true");
    let body = r.text().await.unwrap();
    assert!(
        body.contains("\"fast\"") && body.trim_end().ends_with("data: [DONE]"),
        "{body}"
    );
    assert!(!body.contains("slow"));
    let ended = slow.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(
        ended[0].end,
        EndKind::ClientDisconnected,
        "the loser was cancelled"
    );

    // With resume off, a failure after the commit ends the stream with an error event:
    // no [DONE], and nothing is retried elsewhere (the content is already on the wire).
    slow.set_default(Behavior {
        fault: Some(Fault::ResetAfter { chunks: 2 }),
        ..Behavior::text(&["part", " one", " two", " three"])
    });
    let fast_before = fast.requests().len();
    let r = http
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&serde_json::json!({"model": "llm", "stream": true, "messages": [{"role": "user", "content": "z"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-polygw-source"], "slow-0");
    let body = r.text().await.unwrap();
    assert!(body.contains("\"part\""), "{body}");
    assert!(
        body.contains("\"error\""),
        "the failure reaches the client: {body}"
    );
    assert!(
        !body.contains("[DONE]"),
        "never a silently truncated success: {body}"
    );
    assert_eq!(
        fast.requests().len(),
        fast_before,
        "no retry after the commit"
    );

    // A call that fails before any chunk gets a real HTTP status: every source cooling
    // down on an upstream's 429 hint is a rate limit (429 + Retry-After), SPEC §15.
    slow.set_default(Behavior {
        retry_after: Some(polygw_mock_upstream::RetryAfter::Seconds(30.0)),
        ..Behavior::status(429)
    });
    fast.set_default(Behavior {
        retry_after: Some(polygw_mock_upstream::RetryAfter::Seconds(30.0)),
        ..Behavior::status(429)
    });
    let r = http
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&serde_json::json!({"model": "llm", "stream": true, "messages": [{"role": "user", "content": "w"}]}))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_its_call() {
    let a = mock(Behavior {
        ttft_ms: 10_000.0,
        ..Behavior::text(&["late"])
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("t.db").display());
    let mut env = source("LLM", "a", &a, &[]);
    env.push(("LLM__TELEMETRY__URL".into(), db.clone()));
    let s = serve(&env);
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{}/v1/chat/completions", s.base))
        .timeout(Duration::from_millis(300))
        .json(&serde_json::json!({"model": "llm", "stream": true, "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await;
    assert!(r.is_err(), "the client gave up");
    let ended = a.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(ended[0].end, EndKind::ClientDisconnected);
    // SIGTERM: graceful shutdown flushes telemetry; the cancelled attempt has its row.
    let lines = s.terminate();
    let all = lines.join("\n");
    assert!(all.contains("(scope(s) LLM): written 1"), "{all}");
    let rows = polygw::telemetry::read_rows(&db, None).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].error.as_deref(), Some("cancelled"));
}

/// Issue 22, item 16: two scopes that share one telemetry database print its figures
/// once at shutdown, naming both scopes — not the shared total under each scope.
#[tokio::test]
async fn scopes_sharing_a_database_print_its_figures_once() {
    let a = mock(Behavior::text(&["hi"])).await;
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("t.db").display());
    let mut env = source("LLM", "a", &a, &[]);
    env.extend(source("OTHER", "a", &a, &[]));
    env.push(("LLM__TELEMETRY__URL".into(), db.clone()));
    env.push(("OTHER__TELEMETRY__URL".into(), db.clone()));
    let s = serve(&env);
    let http = reqwest::Client::new();
    for model in ["llm", "other"] {
        let r = http
            .post(format!("{}/v1/chat/completions", s.base))
            .json(&serde_json::json!({"model": model, "messages": [{"role": "user", "content": "x"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{model}");
    }
    let lines = s.terminate();
    let figures: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("telemetry ") && l.contains("written"))
        .collect();
    assert_eq!(
        figures.len(),
        1,
        "one line for the one database: {lines:#?}"
    );
    assert!(
        figures[0].contains("LLM") && figures[0].contains("OTHER"),
        "{}",
        figures[0]
    );
    assert!(figures[0].contains("written 2,"), "{}", figures[0]);
    let rows = polygw::telemetry::read_rows(&db, None).await.unwrap();
    assert_eq!(rows.len(), 2);
}

// ---------------------------------------------------------------- demo

#[test]
fn demo_finishes_and_prints_its_table() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("demo.db");
    let o = Command::new(BIN)
        .args([
            "demo",
            "--calls",
            "60",
            "--warmup",
            "30",
            "--concurrency",
            "12",
            "--db",
        ])
        .arg(&db)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    for needle in [
        "60 streamed calls per run after 30 warm-up calls",
        "hedging off",
        "hedging on",
        "latency p99",
        "extra upstream requests",
        "hedge legs / wins",
        "of which resumes (prefill)",
        "hedging on: the defaults",
        "auto thresholds at the end",
        "stall share",
        "tokens",
        "cost",
        "accounting gap",
        "polygw report --db",
    ] {
        assert!(out.contains(needle), "missing {needle}: {out}");
    }
    // The table counts the measured calls only, not the warm-up's.
    let ok = out.lines().find(|l| l.starts_with("calls ok")).unwrap();
    assert_eq!(ok.matches("60/60").count(), 2, "{ok}");
    assert!(db.exists());
}

#[tokio::test]
async fn serve_streams_an_answer_that_arrives_in_one_write() {
    // The whole SSE body in a single write: the call can end in the poll that commits.
    let body = [
        r#"{"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"all "},"finish_reason":null}]}"#,
        r#"{"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"at once"},"finish_reason":"stop"}]}"#,
        r#"{"id":"x","object":"chat.completion.chunk","model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#,
    ]
    .iter()
    .map(|l| format!("data: {l}\n\n"))
    .collect::<String>()
        + "data: [DONE]\n\n";
    let a = mock(Behavior {
        raw_sse: Some(body),
        ..Behavior::default()
    })
    .await;
    let s = serve(&source("LLM", "a", &a, &[]));
    let http = reqwest::Client::new();
    for _ in 0..5 {
        let r = http
            .post(format!("{}/v1/chat/completions", s.base))
            .json(&serde_json::json!({"model": "llm", "stream": true, "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "x"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-polygw-source"], "a-0");
        assert!(r.headers().contains_key("x-polygw-logical-call-id"));
        let text = r.text().await.unwrap();
        assert!(
            text.contains("\"all \"") && text.contains("\"at once\""),
            "{text}"
        );
        assert!(text.contains("\"total_tokens\":5"), "usage chunk: {text}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    }
}

/// `polygw keys` (SPEC §21.1) end to end: a key is created and printed once, listed
/// without its secret, honoured by `polygw serve` (through an OpenAI client), refused
/// past its RPM, and refused within 5 s of `polygw keys revoke`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_made_listed_honoured_and_revoked() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("keys.db").display());
    let env = vec![("POLYGW_KEYS_DB".to_string(), db.clone())];
    let o = polygw(
        &[
            "keys", "create", "--name", "batch", "--scope", "LLM", "--rpm", "2", "--budget",
            "5/day",
        ],
        &env,
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let key = out.trim().to_string();
    assert!(key.starts_with("pgw-") && key.len() == 47, "{out}");
    assert!(err.contains("shown once"), "{err}");
    let o = polygw(&["keys", "list"], &env);
    let (out, _) = text(&o);
    assert!(
        out.contains("batch") && out.contains("rpm 2") && out.contains("5/day"),
        "{out}"
    );
    assert!(
        !out.contains(&key[4..]),
        "the secret is never listed: {out}"
    );
    // Unknown key id: a clear error.
    let o = polygw(&["keys", "revoke", "nope"], &env);
    assert!(!o.status.success());
    assert!(text(&o)
        .1
        .contains("no client key with id or name \"nope\""));

    let m = mock(Behavior::text(&["hi there"])).await;
    let mut senv = source(
        "LLM",
        "a",
        &m,
        &[("INPUT_PRICE", "1"), ("OUTPUT_PRICE", "1")],
    );
    senv.extend(env.clone());
    let s = serve(&senv);
    let ask = |k: String| {
        let base = s.base.clone();
        async move {
            reqwest::Client::new()
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth(k)
                .json(&serde_json::json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}))
                .send()
                .await
                .unwrap()
        }
    };
    let c = openai(&s.base, &key);
    let req = CreateChatCompletionRequestArgs::default()
        .model("llm")
        .messages(vec![user("hello")])
        .build()
        .unwrap();
    let r = c.chat().create(req).await.unwrap();
    assert_eq!(r.choices[0].message.content.as_deref(), Some("hi there"));
    assert_eq!(ask(key.clone()).await.status(), 200);
    let r = ask(key.clone()).await;
    assert_eq!(r.status(), 429, "past its RPM of 2");
    assert_eq!(ask("pgw-wrong".into()).await.status(), 401);
    // Revocation reaches the proxy within 5 s.
    let o = polygw(&["keys", "revoke", "batch"], &env);
    assert!(o.status.success(), "{:?}", text(&o));
    let t0 = tokio::time::Instant::now();
    loop {
        let st = ask(key.clone()).await.status();
        if st == 401 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "still {st} after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("revocation took effect after {:?}", t0.elapsed());
}

/// SPEC §24.2: on the memory backend a client key's spend survives a restart of `polygw
/// serve` — restored from the telemetry rows of the day before serving. A budget of 0.030
/// per day; each call reserves 0.012 (a 6-token prompt estimate + 25 %, the 4-token cap
/// `MAX_OUTPUT_TOKENS` it is sent, at 0.001 a token) and costs 0.004. Three calls before the
/// restart leave 0.018: two more pass after it, then the budget refuses (a fresh budget
/// would have let five through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_spend_survives_a_restart_on_the_memory_backend() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("polygw.db").display());
    let env = vec![("POLYGW_KEYS_DB".to_string(), db.clone())];
    let o = polygw(
        // A call bills 0.004 and reserves 0.016 (16 tokens: "hello" framed, + 25 %, and
        // the cap of 4): 4 × 0.004 + 0.016 ≤ 0.034 < 5 × 0.004 + 0.016, so exactly five
        // calls pass in all.
        &["keys", "create", "--name", "app", "--budget", "0.034/day"],
        &env,
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let key = out.trim().to_string();
    let m = mock(Behavior::text(&["hi", " there"])).await;
    m.set_prices(polygw_mock_upstream::Prices::new(1000.0, 1000.0));
    let mut senv = source(
        "LLM",
        "a",
        &m,
        &[
            ("INPUT_PRICE", "1000"),
            ("OUTPUT_PRICE", "1000"),
            ("MAX_OUTPUT_TOKENS", "4"),
        ],
    );
    senv.push(("LLM__TELEMETRY__URL".into(), db.clone()));
    senv.extend(env.clone());
    let ask = |base: String, key: String| async move {
        reqwest::Client::new()
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(key)
            .json(&serde_json::json!({"model": "llm", "messages": [{"role": "user", "content": "hello"}]}))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    let s = serve(&senv);
    for _ in 0..3 {
        assert_eq!(ask(s.base.clone(), key.clone()).await, 200);
    }
    s.terminate();
    drop(s);
    let s = serve(&senv);
    let mut after = 0;
    loop {
        match ask(s.base.clone(), key.clone()).await {
            200 => after += 1,
            st => {
                assert_eq!(st, 429, "refused by the budget");
                break;
            }
        }
        assert!(after < 10, "the budget never ran out");
    }
    assert_eq!(after, 2, "the spend before the restart still counts");
    let invoice = m.invoice();
    assert_eq!(invoice.entries.len(), 5);
    assert!(invoice.total.unwrap() <= 0.034 + 1e-12, "{invoice:?}");
}
