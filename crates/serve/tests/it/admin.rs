//! The admin routes (SPEC §26.3): 404 without `POLYGW_ADMIN_KEY`, 401 with a wrong or
//! missing key; the live state of every source as JSON and as a page; a breaker reset
//! takes effect on the next call; a drained source takes no call until it is brought
//! back.

use std::time::Duration;

use polygw::core::ScopeKind;
use polygw::core::Secret;
use polygw_mock_upstream::{Behavior, MockUpstream};
use polygw_serve::{ProxyConfig, ServerLimits};
use serde_json::{json, Value};

use crate::support::*;

const ADMIN: &str = "admin-key-of-the-test";

fn admin_cfg() -> ProxyConfig {
    ProxyConfig {
        admin_key: Some(Secret::new(ADMIN)),
        ..ProxyConfig::default()
    }
}

async fn two_source_scope(a: &MockUpstream, b: &MockUpstream) -> polygw_serve::Scope {
    scope_with(
        "LLM",
        ScopeKind::Chat,
        vec![
            {
                let mut s = source("a", a);
                s.priority = 0;
                s
            },
            {
                let mut s = source("b", b);
                s.priority = 1;
                s
            },
        ],
        None,
        |s| {
            s.breaker.failures = 2;
            s.breaker.open = Duration::from_secs(300);
            s.breaker.open_max = Duration::from_secs(300);
        },
    )
    .await
}

/// The proxy with the admin key over `two_source_scope`: a primary answering 500 and a
/// healthy second source.
async fn failing_primary() -> (Served, MockUpstream, MockUpstream) {
    let (a, b) = (
        mock(Behavior::status(500)).await,
        mock(Behavior::text(&["from b"])).await,
    );
    let s = serve_with(
        vec![two_source_scope(&a, &b).await],
        admin_cfg(),
        ServerLimits::default(),
    )
    .await;
    (s, a, b)
}

async fn status(s: &Served) -> Value {
    let r = http()
        .get(format!("{}/admin/status", s.base))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn state_of(v: &Value, source: &str) -> String {
    v["scopes"][0]["sources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == source)
        .unwrap_or_else(|| panic!("{source} in {v:#}"))["state"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn ask(s: &Served) -> reqwest::Response {
    http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap()
}

async fn act(s: &Served, source: &str, action: &str) -> reqwest::Response {
    http()
        .post(format!(
            "{}/admin/scopes/llm/sources/{source}/{action}",
            s.base
        ))
        .bearer_auth(ADMIN)
        .json(&json!({}))
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn without_an_admin_key_the_routes_do_not_exist_and_a_wrong_key_is_refused() {
    let m = mock(Behavior::text(&["ok"])).await;
    let off = serve(vec![chat_scope("LLM", &m).await]).await;
    for path in ["/admin", "/admin/status"] {
        let r = http()
            .get(format!("{}{path}", off.base))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{path}");
    }
    let r = http()
        .post(format!("{}/admin/scopes/llm/sources/a-0/reset", off.base))
        .bearer_auth(ADMIN)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let on = serve_with(
        vec![chat_scope("LLM", &m).await],
        admin_cfg(),
        ServerLimits::default(),
    )
    .await;
    for key in [None, Some("wrong"), Some("")] {
        let mut req = http().get(format!("{}/admin/status", on.base));
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401, "{key:?}");
        assert!(r.headers()["www-authenticate"]
            .to_str()
            .unwrap()
            .starts_with("Basic"));
        let body = r.text().await.unwrap();
        assert!(!body.contains(ADMIN), "{body}");
    }
    // Basic, with the key as the password (what a browser sends).
    let r = http()
        .get(format!("{}/admin", on.base))
        .basic_auth("anyone", Some(ADMIN))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let page = r.text().await.unwrap();
    assert!(
        page.contains("\"name\":\"a-0\""),
        "the state is in the page"
    );
    assert!(!page.contains(ADMIN));
}

#[tokio::test]
async fn a_breaker_reset_takes_effect_on_the_next_call_and_a_drained_source_takes_none() {
    let (s, a, _b) = failing_primary().await;
    // Two calls, each failing on a first: its breaker opens (FAILURES 2, open 300 s).
    for _ in 0..2 {
        assert_eq!(ask(&s).await.status(), 200);
    }
    let v = status(&s).await;
    assert_eq!(state_of(&v, "a-0"), "open", "{v:#}");
    let sources = v["scopes"][0]["sources"].as_array().unwrap();
    assert!(sources[0]["for_s"].as_f64().unwrap() > 250.0, "{v:#}");
    assert_eq!(sources[0]["consecutive_failures"], 2);
    let seen_by_a = a.requests().len();
    ask(&s).await;
    assert_eq!(
        a.requests().len(),
        seen_by_a,
        "an open breaker takes no call"
    );
    // The primary recovers; the operator resets its breaker: the next call goes there.
    a.set_default(Behavior::text(&["from a"]));
    let r = act(&s, "a-0", "reset").await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(state_of(&status(&s).await, "a-0"), "closed");
    let r = ask(&s).await;
    assert_eq!(r.headers()["x-polygw-source"], "a-0");
    // Drained: every call goes to b until it is brought back.
    assert_eq!(act(&s, "a-0", "drain").await.status(), 200);
    assert_eq!(state_of(&status(&s).await, "a-0"), "drained");
    let before = a.requests().len();
    for _ in 0..3 {
        assert_eq!(ask(&s).await.headers()["x-polygw-source"], "b-0");
    }
    assert_eq!(a.requests().len(), before);
    assert_eq!(act(&s, "a-0", "undrain").await.status(), 200);
    assert_eq!(ask(&s).await.headers()["x-polygw-source"], "a-0");
    // Unknown names are named.
    let r = act(&s, "zz-9", "reset").await;
    assert_eq!(r.status(), 404);
    assert!(r.text().await.unwrap().contains("a-0, b-0"));
    let r = act(&s, "a-0", "explode").await;
    assert_eq!(r.status(), 404);
}

/// SPEC §26.3: the status page renders in a browser (headless Chromium) with no asset
/// from elsewhere, shows every source's state, and takes the key as Basic credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_renders_each_sources_state_in_a_browser() {
    let Some(bin) = polygw_testkit::browser::chromium() else {
        return;
    };
    let (s, _a, _b) = failing_primary().await;
    for _ in 0..2 {
        assert_eq!(ask(&s).await.status(), 200);
    }
    assert_eq!(act(&s, "b-0", "drain").await.status(), 200);
    let dir = tempfile::tempdir().unwrap();
    let url = format!("http://admin:{ADMIN}@{}/admin", s.addr);
    let profiles = dir.path().to_path_buf();
    let loaded = tokio::task::spawn_blocking(move || {
        polygw_testkit::browser::load_url(&bin, &profiles, &url)
    })
    .await
    .unwrap();
    let dom = &loaded.dom;
    for want in [
        r#"<span class="state open" data-source="a-0">open</span>"#,
        r#"<span class="state drained" data-source="b-0">drained</span>"#,
        "<h2>LLM</h2>",
        "model-a",
        "reset breaker",
        "bring back",
    ] {
        assert!(dom.contains(want), "{want:?} in the rendered page:\n{dom}");
    }
    let console = loaded.console.join("\n");
    assert!(
        console.contains("polygw-admin rendered LLM/a-0=open LLM/b-0=drained"),
        "the page's script ran: {console}"
    );
    for bad in ["Uncaught", "Refused to"] {
        assert!(!console.contains(bad), "{console}");
    }
}
