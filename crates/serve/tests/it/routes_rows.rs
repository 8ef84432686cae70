//! Every route's calls in telemetry (SPEC §18.4): the `api` column names the route a
//! call came by; and stored Responses expire after `RESPONSES__TTL_S` (SPEC §18.1).

use std::sync::Arc;
use std::time::Duration;

use polygw::ScopeKind;
use polygw_mock_upstream::{Behavior, MockUpstream};
use polygw_serve::{ProxyConfig, ServerLimits};
use polygw_testkit::fakes::RecordingTelemetry;
use serde_json::json;

use crate::support::*;

/// A proxy over one mock answering "hello", its rows recorded.
async fn recorded_proxy() -> (MockUpstream, Arc<RecordingTelemetry>, Served) {
    let m = mock(Behavior::text(&["hello"])).await;
    let rows = RecordingTelemetry::new();
    let scope = scope_with(
        "LLM",
        ScopeKind::Chat,
        vec![source("a", &m)],
        Some(rows.clone()),
        |_| {},
    )
    .await;
    let s = serve_with(vec![scope], ProxyConfig::default(), ServerLimits::default()).await;
    (m, rows, s)
}

/// SPEC §24.6: the agent session and agent ids coding agents send are on the rows of
/// every route — Claude Code's headers on Messages, Codex's `session_id` on Responses, a
/// chat request's `prompt_cache_key`.
#[tokio::test]
async fn agent_sessions_and_sub_agents_are_on_the_rows() {
    let (_m, rows, s) = recorded_proxy().await;
    let c = http();
    let r = c
        .post(format!("{}/messages", s.v1()))
        .header("anthropic-version", "2023-06-01")
        .header("x-claude-code-session-id", "cc-session")
        .header("x-claude-code-agent-id", "sub-1")
        .header("x-claude-code-parent-agent-id", "main")
        .json(&json!({"model": "llm", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .post(format!("{}/responses", s.v1()))
        .header("session_id", "codex-session")
        .json(&json!({"model": "llm", "input": "hi", "prompt_cache_key": "pck"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "llm", "prompt_cache_key": "chat-pck",
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut got = Vec::new();
    for _ in 0..200 {
        got = rows
            .rows()
            .iter()
            .map(|r| {
                (
                    r.api.clone().unwrap_or_default(),
                    r.agent_session_id.clone(),
                    r.agent_id.clone(),
                    r.parent_agent_id.clone(),
                )
            })
            .collect();
        if got.len() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    got.sort();
    let s = |v: &str| Some(v.to_string());
    assert_eq!(
        got,
        [
            ("chat".into(), s("chat-pck"), None, None),
            ("messages".into(), s("cc-session"), s("sub-1"), s("main")),
            ("responses".into(), s("codex-session"), None, None),
        ]
    );
}

#[tokio::test]
async fn each_route_names_itself_in_the_rows() {
    let (_m, rows, s) = recorded_proxy().await;
    let c = http();
    for (path, body) in [
        (
            "/chat/completions",
            json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}),
        ),
        ("/responses", json!({"model": "llm", "input": "hi"})),
        (
            "/messages",
            json!({"model": "llm", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}),
        ),
    ] {
        let r = c
            .post(format!("{}{path}", s.v1()))
            .header("anthropic-version", "2023-06-01")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}: {}", r.text().await.unwrap());
    }
    let mut apis: Vec<String> = Vec::new();
    for _ in 0..200 {
        apis = rows.rows().iter().filter_map(|r| r.api.clone()).collect();
        if apis.len() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    apis.sort();
    assert_eq!(apis, ["chat", "messages", "responses"]);
}

#[tokio::test]
async fn a_stored_response_expires_after_its_ttl() {
    let m = mock(Behavior::text(&["remember me"])).await;
    let scope = scope_with("LLM", ScopeKind::Chat, vec![source("a", &m)], None, |s| {
        s.responses_ttl = Duration::from_secs(1);
    })
    .await;
    let s = serve_with(vec![scope], ProxyConfig::default(), ServerLimits::default()).await;
    let c = http();
    let r: serde_json::Value = c
        .post(format!("{}/responses", s.v1()))
        .json(&json!({"model": "llm", "input": "hi", "store": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = r["id"].as_str().unwrap().to_string();
    let get = |id: String| {
        let c = c.clone();
        let url = format!("{}/responses/{id}", s.v1());
        async move { c.get(url).send().await.unwrap().status().as_u16() }
    };
    assert_eq!(get(id.clone()).await, 200, "stored");
    // Kept a whole second, gone after it (the store reads whole seconds).
    let t0 = tokio::time::Instant::now();
    loop {
        let st = get(id.clone()).await;
        if st == 404 {
            break;
        }
        assert_eq!(st, 200);
        assert!(t0.elapsed() < Duration::from_secs(5), "never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A continuation of the expired response is refused the same way.
    let r = c
        .post(format!("{}/responses", s.v1()))
        .json(&json!({"model": "llm", "input": "and then?", "previous_response_id": id}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}
