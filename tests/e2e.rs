//! GatewayClient end to end: the real transport over loopback HTTP against the mock
//! upstream, configured from environment-style keys. Real time, short durations, wide
//! tolerances.

use std::time::Duration;

use polygw::core::telemetry::RowKind;
use polygw::{ChatRequest, GatewayClient, GatewayError, UsageSource};
use polygw_mock_upstream::{Behavior, EndKind, MockConfig, MockUpstream, Stall};

async fn mock() -> MockUpstream {
    MockUpstream::start(MockConfig::default())
        .await
        .expect("mock")
}

fn source_vars(name: &str, m: &MockUpstream, prio: u32) -> Vec<(String, String)> {
    let p = name.to_uppercase();
    vec![
        (format!("LLM__{p}__0__BASE_URL"), m.base_url()),
        (format!("LLM__{p}__0__API_KEY"), format!("sk-{name}-secret")),
        (format!("LLM__{p}__0__MODEL"), format!("model-{name}")),
        (format!("LLM__{p}__0__PRIORITY"), prio.to_string()),
    ]
}

fn vars(parts: Vec<Vec<(String, String)>>, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = parts.into_iter().flatten().collect();
    v.extend(extra.iter().map(|(k, x)| (k.to_string(), x.to_string())));
    v
}

fn slow_first_token(ms: f64) -> Behavior {
    Behavior {
        ttft_ms: ms,
        ..Behavior::text(&["slow ", "answer"])
    }
}

/// A client of scope `LLM` with sources `a` (priority 0) and `b` (priority 1) and these
/// extra keys.
async fn client_ab(a: &MockUpstream, b: &MockUpstream, extra: &[(&str, &str)]) -> GatewayClient {
    GatewayClient::from_vars(
        vars(vec![source_vars("a", a, 0), source_vars("b", b, 1)], extra),
        "LLM",
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn a_late_first_token_is_beaten_by_a_hedge_leg() {
    let (a, b) = (mock().await, mock().await);
    a.set_default(slow_first_token(5_000.0));
    b.set_default(Behavior::text(&["fast ", "answer"]));
    let c = client_ab(
        &a,
        &b,
        &[
            ("LLM__HEDGE__AFTER_S", "0.2"),
            ("LLM__HEDGE__BUDGET_PCT", "0"),
        ],
    )
    .await;
    let r = c
        .chat(ChatRequest::user("hi").with_stream(true))
        .await
        .unwrap();
    assert_eq!(r.content, "fast answer");
    assert_eq!(r.source, "b-0");
    assert_eq!((r.call_stats.hedges, r.call_stats.hedge_won), (1, true));
    assert!(r.call_stats.total_latency_ms < 2_500, "{:?}", r.call_stats);
    assert!(r.call_stats.total_latency_ms >= 200, "{:?}", r.call_stats);
    assert_eq!(r.usage_source, UsageSource::Measured);
    // the loser's request was cut by the client
    let ended = a.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(ended[0].end, EndKind::ClientDisconnected);
    assert_eq!(ended[0].model.as_deref(), Some("model-a"));
    assert_eq!(c.in_flight("a-0").await.unwrap(), 0);
    assert_eq!(c.in_flight("b-0").await.unwrap(), 0);
}

#[tokio::test]
async fn a_stalled_stream_is_beaten_by_a_stall_hedge() {
    let (a, b) = (mock().await, mock().await);
    a.set_default(Behavior {
        stalls: vec![Stall {
            before_chunk: 2,
            ms: 8_000.0,
        }],
        ..Behavior::text(&["one ", "two ", "three"])
    });
    b.set_default(Behavior::text(&["other ", "answer"]));
    let c = client_ab(
        &a,
        &b,
        &[
            ("LLM__HEDGE__STALL_AFTER_S", "0.3"),
            ("LLM__HEDGE__BUDGET_PCT", "0"),
        ],
    )
    .await;
    let r = c
        .chat(ChatRequest::user("hi").with_stream(true))
        .await
        .unwrap();
    assert_eq!(r.content, "other answer");
    assert!(r.call_stats.hedge_won);
    assert!(r.call_stats.total_latency_ms < 3_000, "{:?}", r.call_stats);
}

#[tokio::test]
async fn with_hedging_off_the_slow_source_is_simply_waited_for() {
    let (a, b) = (mock().await, mock().await);
    a.set_default(slow_first_token(600.0));
    b.set_default(Behavior::text(&["never"]));
    let c = GatewayClient::from_vars(
        vars(
            vec![source_vars("a", &a, 0), source_vars("b", &b, 1)],
            &[
                ("LLM__HEDGE__AFTER_S", "off"),
                ("LLM__HEDGE__STALL_AFTER_S", "off"),
            ],
        ),
        "LLM",
    )
    .await
    .unwrap();
    let r = c
        .chat(ChatRequest::user("hi").with_stream(true))
        .await
        .unwrap();
    assert_eq!(r.content, "slow answer");
    assert_eq!((r.call_stats.attempts, r.call_stats.hedges), (1, 0));
    assert!(r.call_stats.total_latency_ms >= 600);
    assert!(r.ttft_ms.unwrap() >= 600);
    assert!(
        b.requests().is_empty(),
        "no request reached the other source"
    );
}

#[tokio::test]
async fn failures_are_retried_elsewhere_with_telemetry_in_sqlite() {
    let (a, b) = (mock().await, mock().await);
    a.set_default(Behavior::status(503));
    b.set_default(Behavior::text(&["from b"]));
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("t.db").display());
    let c = client_ab(
        &a,
        &b,
        &[
            ("LLM__TELEMETRY__URL", db.as_str()),
            ("LLM__RETRY__BACKOFF_BASE_S", "0.01"),
            ("LLM__RETRY__BACKOFF_MAX_S", "0.02"),
            ("LLM__B__0__INPUT_PRICE", "1"),
            ("LLM__B__0__OUTPUT_PRICE", "2"),
        ],
    )
    .await;
    let r = c.chat(ChatRequest::user("hi")).await.unwrap();
    assert_eq!(r.content, "from b");
    assert_eq!(r.call_stats.attempts, 2);
    let report = c.shutdown().await;
    assert_eq!((report.written, report.dropped), (2, 0));
    let rows = polygw_telemetry_sql::read_rows(&db, None).await.unwrap();
    assert_eq!(rows.len(), 2);
    let failed = rows.iter().find(|r| !r.ok).unwrap();
    assert_eq!(failed.error.as_deref(), Some("server_error"));
    assert_eq!(failed.http_status, Some(503));
    assert_eq!(failed.cost, None);
    let ok = rows.iter().find(|r| r.ok).unwrap();
    assert_eq!(ok.usage_source, UsageSource::Measured);
    assert!(ok.cost.unwrap() > 0.0);
    assert!(rows
        .iter()
        .all(|x| x.logical_call_id == r.logical_call_id && x.kind == RowKind::Attempt));
    // the key reached the upstream only as a Bearer header, never in telemetry
    let text = format!("{rows:?}");
    assert!(!text.contains("sk-a-secret") && !text.contains("sk-b-secret"));
}

#[tokio::test]
async fn dropping_a_call_over_http_cancels_the_request() {
    let a = mock().await;
    a.set_default(slow_first_token(10_000.0));
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("t.db").display());
    let c = GatewayClient::from_vars(
        vars(
            vec![source_vars("a", &a, 0)],
            &[("LLM__TELEMETRY__URL", db.as_str())],
        ),
        "LLM",
    )
    .await
    .unwrap();
    let call = c.chat(ChatRequest::user("hi").with_stream(true));
    let r = tokio::time::timeout(Duration::from_millis(300), call).await;
    assert!(r.is_err(), "still running when dropped");
    let ended = a.wait_for_ended(1, Duration::from_secs(5)).await;
    assert_eq!(ended[0].end, EndKind::ClientDisconnected);
    assert_eq!(c.in_flight("a-0").await.unwrap(), 0);
    c.shutdown().await;
    let rows = polygw_telemetry_sql::read_rows(&db, None).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].error.as_deref(), Some("cancelled"));
}

#[tokio::test]
async fn rejections_keep_the_provider_code() {
    let a = mock().await;
    a.set_default(Behavior {
        error_code: Some("context_length_exceeded".into()),
        error_message: Some("This model's maximum context length is 8192 tokens".into()),
        ..Behavior::status(400)
    });
    let c = GatewayClient::from_vars(vars(vec![source_vars("a", &a, 0)], &[]), "LLM")
        .await
        .unwrap();
    let e = c.chat(ChatRequest::user("hi")).await.unwrap_err();
    assert!(matches!(e, GatewayError::Rejected(_)));
    let last = e.last_error().unwrap();
    assert_eq!(
        last.provider_code.as_deref(),
        Some("context_length_exceeded")
    );
    assert_eq!(last.http_status, Some(400));
    assert!(!e.to_string().contains("sk-a-secret"));
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_governance_is_wired_and_fails_closed() {
    let Some(url) = polygw_testkit::services::redis_url() else {
        return;
    };
    let a = mock().await;
    a.set_default(Behavior::text(&["via redis"]));
    let scope = polygw_testkit::services::unique_name("E2E").to_uppercase();
    let mut v: Vec<(String, String)> = source_vars("a", &a, 0)
        .into_iter()
        .map(|(k, x)| (k.replacen("LLM", &scope, 1), x))
        .collect();
    v.push((format!("{scope}__REDIS__URL"), url));
    v.push((format!("{scope}__A__0__RPM"), "100".into()));
    let c = GatewayClient::from_vars(v.clone(), &scope).await.unwrap();
    assert_eq!(
        c.chat(ChatRequest::user("hi")).await.unwrap().content,
        "via redis"
    );
    c.shutdown().await;
    // nothing listens on port 1: every call fails closed, nothing reaches the upstream
    let before = a.requests().len();
    v.retain(|(k, _)| !k.ends_with("REDIS__URL"));
    v.push((format!("{scope}__REDIS__URL"), "redis://127.0.0.1:1".into()));
    let c = GatewayClient::from_vars(v, &scope).await.unwrap();
    let e = c.chat(ChatRequest::user("hi")).await.unwrap_err();
    assert_eq!(
        e.terminal_reason(),
        Some(polygw::TerminalReason::GovernanceBackend),
        "{e}"
    );
    assert_eq!(a.requests().len(), before);
}

// ---------------------------------------------------------------- SPEC §10 over HTTP

mod features_over_http {
    use super::*;
    use polygw::{EmbeddingClient, OcrClient};
    use polygw_mock_upstream::{embedding_of, UsageMode};

    fn embed_vars(m: &MockUpstream, extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut v = vec![
            ("EMBED__E__0__BASE_URL".to_string(), m.base_url()),
            ("EMBED__E__0__API_KEY".to_string(), String::new()),
            ("EMBED__E__0__MODEL".to_string(), "embed-model".to_string()),
            ("EMBED__E__0__BATCH_SIZE".to_string(), "2".to_string()),
            (
                "EMBED__RETRY__BACKOFF_BASE_S".to_string(),
                "0.01".to_string(),
            ),
            (
                "EMBED__RETRY__BACKOFF_MAX_S".to_string(),
                "0.02".to_string(),
            ),
        ];
        v.extend(extra.iter().map(|(k, x)| (k.to_string(), x.to_string())));
        v
    }

    #[tokio::test]
    async fn embedding_order_survives_a_failing_then_retried_batch() {
        let m = mock().await;
        m.push_scripts([Behavior::default(), Behavior::status(500)]);
        let c = EmbeddingClient::from_vars(embed_vars(&m, &[]), "EMBED")
            .await
            .unwrap();
        let texts: Vec<String> = (0..5).map(|i| format!("document {i}")).collect();
        let e = c.embed(&texts).await.unwrap();
        assert_eq!(e.vectors.len(), 5);
        for (t, v) in texts.iter().zip(&e.vectors) {
            assert_eq!(v, &embedding_of(t, 16), "vector of {t:?} out of order");
        }
        assert_eq!(e.call_stats.attempts, 4, "3 batches, one retried");
        assert_eq!(e.usage_source, UsageSource::Measured);
        let reqs = m.requests();
        assert_eq!(reqs.len(), 4);
        assert_eq!(
            reqs[1].body["input"], reqs[2].body["input"],
            "the same batch again"
        );
    }

    #[tokio::test]
    async fn a_batch_without_usage_makes_the_call_unavailable_and_its_cost_null() {
        let m = mock().await;
        m.push_scripts([
            Behavior::default(),
            Behavior {
                usage: UsageMode::None,
                ..Behavior::default()
            },
        ]);
        let c = EmbeddingClient::from_vars(
            embed_vars(
                &m,
                &[
                    ("EMBED__E__0__INPUT_PRICE", "0.1"),
                    ("EMBED__E__0__OUTPUT_PRICE", "0"),
                ],
            ),
            "EMBED",
        )
        .await
        .unwrap();
        let texts: Vec<String> = (0..4).map(|i| format!("t{i}")).collect();
        let e = c.embed(&texts).await.unwrap();
        assert_eq!(e.usage_source, UsageSource::Unavailable);
        assert_eq!(e.cost, None);
        let e = c.embed(&texts[..2]).await.unwrap();
        assert_eq!(e.usage_source, UsageSource::Measured);
        assert!(e.cost.unwrap() > 0.0);
    }

    #[tokio::test]
    async fn a_cache_hit_is_a_free_row_and_reaches_no_upstream() {
        let m = mock().await;
        m.set_default(Behavior::text(&["cached"]));
        let dir = tempfile::tempdir().unwrap();
        let db = format!("sqlite://{}", dir.path().join("t.db").display());
        let c = GatewayClient::from_vars(
            vars(
                vec![source_vars("a", &m, 0)],
                &[
                    ("LLM__CACHE__TTL_S", "60"),
                    ("LLM__TELEMETRY__URL", db.as_str()),
                    ("LLM__A__0__INPUT_PRICE", "1"),
                    ("LLM__A__0__OUTPUT_PRICE", "1"),
                ],
            ),
            "LLM",
        )
        .await
        .unwrap();
        let first = c.chat(ChatRequest::user("same question")).await.unwrap();
        let hit = c.chat(ChatRequest::user("same question")).await.unwrap();
        assert_eq!(hit.content, first.content);
        assert!(hit.call_stats.cache_hit);
        assert_eq!(
            (hit.call_stats.attempts, hit.call_stats.generation_ms),
            (0, 0)
        );
        assert_eq!(m.requests().len(), 1);
        c.shutdown().await;
        let rows = polygw_telemetry_sql::read_rows(&db, None).await.unwrap();
        let hit_row = rows.iter().find(|r| r.kind == RowKind::CacheHit).unwrap();
        assert_eq!(hit_row.cost, Some(0.0));
        assert!(hit_row.cache_hit && hit_row.ok);
        assert_eq!(hit_row.logical_call_id, hit.logical_call_id);
        assert_eq!(rows.len(), 2);
    }

    #[derive(Debug, serde::Deserialize, PartialEq)]
    struct Pick {
        city: String,
    }

    #[tokio::test]
    async fn a_reask_succeeds_on_the_second_round() {
        let m = mock().await;
        m.push_scripts([
            Behavior::text(&["Paris, ", "obviously."]),
            Behavior::text(&["{\"city\":", " \"Paris\"}"]),
        ]);
        let c = GatewayClient::from_vars(vars(vec![source_vars("a", &m, 0)], &[]), "LLM")
            .await
            .unwrap();
        let s = c
            .chat_json::<Pick>(ChatRequest::user("Which city? JSON please"))
            .await
            .unwrap();
        assert_eq!(
            s.value,
            Pick {
                city: "Paris".into()
            }
        );
        assert_eq!(s.rounds, 2);
        assert_eq!(s.response.call_stats.attempts, 2);
        let reqs = m.requests();
        assert_eq!(reqs[0].body["response_format"]["type"], "json_object");
        let msgs = reqs[1].body["messages"].as_array().unwrap();
        let last = msgs.last().unwrap()["content"].as_str().unwrap();
        assert!(
            last.contains("not valid JSON"),
            "the parse error is sent back: {last}"
        );
        assert_eq!(msgs[msgs.len() - 2]["role"], "assistant");
    }

    #[tokio::test]
    async fn an_ocr_call_sends_a_vision_request_and_records_its_row() {
        let m = mock().await;
        let dir = tempfile::tempdir().unwrap();
        let db = format!("sqlite://{}", dir.path().join("t.db").display());
        let v: Vec<(String, String)> = vec![
            ("OCR__V__0__BASE_URL".into(), m.base_url()),
            ("OCR__V__0__API_KEY".into(), "k".into()),
            ("OCR__V__0__MODEL".into(), "vision-model".into()),
            ("OCR__V__0__PRICE_PER_CALL".into(), "0.003".into()),
            ("OCR__V__0__RPM".into(), "60".into()),
            ("OCR__TELEMETRY__URL".into(), db.clone()),
            ("OCR__OCR__PROMPT".into(), "Read every word.".into()),
        ];
        let c = OcrClient::from_vars(v, "OCR").await.unwrap();
        let png = b"\x89PNG\r\n\x1a\nfake image bytes";
        let t = c.recognize(png, "image/png").await.unwrap();
        assert!(!t.text.is_empty());
        assert_eq!(t.cost, Some(0.003));
        let reqs = m.requests();
        assert_eq!(reqs[0].images.len(), 1);
        assert_eq!(reqs[0].images[0].mime, "image/png");
        assert_eq!(reqs[0].images[0].bytes, png.len());
        assert!(reqs[0].body.to_string().contains("Read every word."));
        let flushed = c.shutdown().await;
        assert_eq!((flushed.written, flushed.dropped), (1, 0));
        let rows = polygw_telemetry_sql::read_rows(&db, None).await.unwrap();
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!(&*r.operation, "ocr");
        assert_eq!(r.usage_source, UsageSource::Measured);
        assert_eq!((r.prompt_tokens, r.completion_tokens), (Some(0), Some(0)));
        assert_eq!(r.cost, Some(0.003));
    }
}

/// SPEC §19.2: processes sharing Redis governance merge their latency distributions and
/// so hedge on one threshold. Three clients (each its own connection and engine, as
/// three processes have) see 20 answers each of a source whose latency differs per
/// client; alone, none has the 50 samples `auto` needs; after an exchange each, all three
/// hold the same 60-sample distribution and the same threshold from it.
#[tokio::test]
async fn processes_sharing_redis_converge_on_one_threshold() {
    let Some(url) = polygw_testkit::services::redis_url() else {
        return;
    };
    let (a, b) = (mock().await, mock().await);
    b.set_default(Behavior::text(&["b"]));
    let scope = polygw_testkit::services::unique_name("LAT").to_uppercase();
    let mut v: Vec<(String, String)> = [source_vars("a", &a, 0), source_vars("b", &b, 1)]
        .concat()
        .into_iter()
        .map(|(k, x)| (k.replacen("LLM", &scope, 1), x))
        .collect();
    v.push((format!("{scope}__REDIS__URL"), url));
    v.push((format!("{scope}__HEDGE__MIN_S"), "0.001".into()));
    // Three replicas: each client keeps its evidence to itself, as a process would
    // (in one process they would share one book: SPEC §25.1).
    let mut clients = Vec::new();
    for _ in 0..3 {
        let loaded =
            polygw::core::config::load_scope(v.clone(), &scope, polygw::core::ScopeKind::Chat)
                .unwrap();
        let window = loaded.settings.hedge.window;
        clients.push(
            GatewayClient::builder(loaded.settings)
                .upstream_evidence(polygw::UpstreamEvidence::isolated(window))
                .build()
                .await
                .unwrap(),
        );
    }
    for (i, c) in clients.iter().enumerate() {
        for k in 0..20u32 {
            a.push_script(Behavior {
                ttft_ms: f64::from(10 + 20 * i as u32 + k),
                ..Behavior::text(&["a"])
            });
            c.chat(ChatRequest::user("time me")).await.unwrap();
        }
    }
    let origin = |c: &GatewayClient| {
        let t = c.hedge_thresholds(false);
        serde_json::to_value(t[0].1.after).unwrap()
    };
    for c in &clients {
        assert_eq!(
            origin(c)["origin"],
            "not_yet",
            "20 samples alone: {}",
            origin(c)
        );
    }
    for _ in 0..2 {
        for c in &clients {
            c.exchange_latency().await.unwrap();
        }
    }
    let seen: Vec<serde_json::Value> = clients.iter().map(origin).collect();
    assert_eq!(seen[0]["origin"], "source", "{seen:?}");
    assert!(
        seen.iter().all(|t| *t == seen[0]),
        "one threshold: {seen:?}"
    );
    // The merge's 90th percentile: above every client's own range but the last's.
    let ms = seen[0]["ms"].as_u64().unwrap();
    assert!((50..=110).contains(&ms), "{ms} ms");
    for c in clients {
        c.shutdown().await;
    }
}

/// SPEC §26.2 for library users: a `ReloadingClient` follows its env file. `reload()`
/// applies a rotated key at once; a bad file is refused whole (the running client
/// stays); a change to the file is picked up by itself; a source that stays the same
/// upstream keeps its state (a drain set on the first client holds after the reload),
/// and calls on the old client finish with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloading_client_follows_its_env_file() {
    let m = mock().await;
    m.set_default(Behavior::text(&["fine"]));
    let b = mock().await;
    b.set_default(Behavior::text(&["from b"]));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("polygw.env");
    let write = |key: &str, extra: &[&str]| {
        let mut lines = vec![
            format!("RELOADLIB__A__0__BASE_URL={}", m.base_url()),
            format!("RELOADLIB__A__0__API_KEY={key}"),
            "RELOADLIB__A__0__MODEL=model-a".to_string(),
        ];
        lines.extend(extra.iter().map(|l| l.to_string()));
        let tmp = file.with_extension("tmp");
        std::fs::write(&tmp, lines.join("\n")).unwrap();
        std::fs::rename(&tmp, &file).unwrap();
    };
    let last_key = |m: &MockUpstream| m.requests().last().and_then(|r| r.bearer.clone());
    write("sk-one", &[]);
    let r = polygw::ReloadingClient::watch("RELOADLIB", &file)
        .await
        .unwrap();
    let first = r.client();
    first.chat(ChatRequest::user("hi")).await.unwrap();
    assert_eq!(last_key(&m).as_deref(), Some("sk-one"));

    // A bad file: refused whole, naming the key; the running client stays.
    write("sk-two", &["RELOADLIB__A__0__RPM=abc"]);
    let e = r.reload().await.unwrap_err().to_string();
    assert!(e.contains("RELOADLIB__A__0__RPM"), "{e}");
    assert!(!e.contains("sk-two"), "no key in the error: {e}");
    r.client().chat(ChatRequest::user("hi")).await.unwrap();
    assert_eq!(last_key(&m).as_deref(), Some("sk-one"));

    // The same upstream keeps its state: drained on the first client, drained after.
    first.set_drained("a-0", true).await.unwrap();
    write("sk-two", &[]);
    let changes = r.reload().await.unwrap();
    assert_eq!(changes.summary(), "kept a-0");
    let second = r.client();
    let drained = second.status().await.unwrap();
    assert_eq!(drained.sources[0].state, "drained", "{drained:?}");
    second.set_drained("a-0", false).await.unwrap();
    second.chat(ChatRequest::user("hi")).await.unwrap();
    assert_eq!(last_key(&m).as_deref(), Some("sk-two"));

    // A change of the file is picked up by itself (polled every second): a new source,
    // preferred.
    write(
        "sk-two",
        &[
            "RELOADLIB__A__0__PRIORITY=1",
            &format!("RELOADLIB__B__0__BASE_URL={}", b.base_url()),
            "RELOADLIB__B__0__API_KEY=sk-b",
            "RELOADLIB__B__0__MODEL=model-b",
            "RELOADLIB__B__0__PRIORITY=0",
        ],
    );
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let got = r.client().chat(ChatRequest::user("hi")).await.unwrap();
        if got.content == "from b" {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the file change was not picked up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The first client still serves, with its own configuration.
    let old = first.chat(ChatRequest::user("hi")).await.unwrap();
    assert_eq!(old.content, "fine");
    assert_eq!(last_key(&m).as_deref(), Some("sk-one"));
    drop(r);
}
