//! Client keys of a key store (SPEC §21.1) through the proxy: keys by hash, allowed
//! scopes and models, revocation, and the key's limits and budgets as 429s that name
//! the limit and its reset; a row's `client_key_id`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use polygw::core::client_key::{hash_key, shown_prefix, ClientKey, KeyLimits};
use polygw::core::ports::ClientKeyStore;
use polygw::core::TelemetryError;
use polygw::ScopeKind;
use polygw_mock_upstream::Behavior;
use polygw_serve::keys::KeyRing;
use polygw_serve::{ProxyConfig, ServerLimits};
use polygw_testkit::fakes::RecordingTelemetry;
use serde_json::{json, Value};

use crate::support::*;

/// A key store in memory.
#[derive(Debug, Default)]
struct Keys(Mutex<Vec<ClientKey>>);

#[async_trait]
impl ClientKeyStore for Keys {
    async fn create(&self, key: ClientKey) -> Result<(), TelemetryError> {
        self.0.lock().unwrap().push(key);
        Ok(())
    }
    async fn update(&self, key: ClientKey) -> Result<bool, TelemetryError> {
        let mut v = self.0.lock().unwrap();
        match v.iter_mut().find(|k| k.id == key.id) {
            Some(k) => {
                *k = key;
                Ok(true)
            }
            None => Ok(false),
        }
    }
    async fn list(&self) -> Result<Vec<ClientKey>, TelemetryError> {
        Ok(self.0.lock().unwrap().clone())
    }
    async fn find(&self, id_or_name: &str) -> Result<Option<ClientKey>, TelemetryError> {
        Ok(self
            .0
            .lock()
            .unwrap()
            .iter()
            .find(|k| k.id == id_or_name || k.name == id_or_name)
            .cloned())
    }
}

fn secret(n: u8) -> String {
    format!(
        "pgw-{}",
        std::iter::repeat_n(char::from(b'A' + n), 43).collect::<String>()
    )
}

/// Key `n` with a day budget and nothing else.
fn budget_key(n: u8, day_nanos: u64) -> ClientKey {
    key(
        n,
        KeyLimits {
            budget_day_nanos: Some(day_nanos),
            ..KeyLimits::default()
        },
    )
}

fn key(n: u8, limits: KeyLimits) -> ClientKey {
    let s = secret(n);
    ClientKey {
        id: format!("key_{n}"),
        name: format!("client-{n}"),
        hash: hash_key(&s),
        prefix: shown_prefix(&s),
        scopes: vec![],
        models: vec![],
        limits,
        created_at_ms: 1,
        updated_at_ms: 1,
        revoked_at_ms: None,
    }
}

async fn call(s: &Served, key: &str, model: &str) -> (u16, Value, reqwest::header::HeaderMap) {
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .bearer_auth(key)
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, r.json().await.unwrap_or(Value::Null), headers)
}

/// A proxy of one chat scope `LLM` over `src`, with the store's keys (rows to `rows`).
async fn keyed_proxy(
    store: Arc<Keys>,
    src: polygw::SourceConfig,
    rows: Option<Arc<RecordingTelemetry>>,
) -> Served {
    let ring = KeyRing::new(store, Duration::from_secs(3600));
    ring.refresh().await.unwrap();
    let chat = scope_with("LLM", ScopeKind::Chat, vec![src], rows, |_| {}).await;
    let cfg = ProxyConfig {
        key_ring: Some(ring),
        ..ProxyConfig::default()
    };
    serve_with(vec![chat], cfg, ServerLimits::default()).await
}

async fn proxy_with(
    store: Arc<Keys>,
    rows: Arc<RecordingTelemetry>,
    m: &polygw_mock_upstream::MockUpstream,
) -> (Served, KeyRing) {
    let ring = KeyRing::new(store, Duration::from_secs(3600));
    ring.refresh().await.unwrap();
    let mut src = source("a", m);
    src.input_price = Some(1.0);
    src.output_price = Some(1.0);
    // What a budgeted key's call without a cap reserves for, and is sent (SPEC §24.1).
    src.max_output_tokens = Some(16);
    let chat = scope_with("LLM", ScopeKind::Chat, vec![src], Some(rows), |_| {}).await;
    let other = scope_with("EMB", ScopeKind::Chat, vec![source("a", m)], None, |_| {}).await;
    let cfg = ProxyConfig {
        key_ring: Some(ring.clone()),
        ..ProxyConfig::default()
    };
    (
        serve_with(vec![chat, other], cfg, ServerLimits::default()).await,
        ring,
    )
}

#[tokio::test]
async fn store_keys_authenticate_and_their_id_is_on_the_rows() {
    let m = mock(Behavior::text(&["hello"])).await;
    let store = Arc::new(Keys::default());
    store.create(key(0, KeyLimits::default())).await.unwrap();
    let rows = RecordingTelemetry::new();
    let (s, ring) = proxy_with(store.clone(), rows.clone(), &m).await;
    let (st, body, _) = call(&s, &secret(0), "llm").await;
    assert_eq!(st, 200, "{body}");
    // The row names the key by id.
    let mut r = rows.rows();
    for _ in 0..200 {
        if !r.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        r = rows.rows();
    }
    assert!(
        !r.is_empty()
            && r.iter()
                .all(|x| x.client_key_id.as_deref() == Some("key_0")),
        "{r:?}"
    );
    // Unknown keys and no key: 401; nothing reached the upstream.
    let before = m.requests().len();
    let (st, body, _) = call(&s, &secret(9), "llm").await;
    assert_eq!(
        (st, body["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    assert_eq!(m.requests().len(), before);
    // Revoked: after the ring's reload, refused with a message naming the key.
    let mut k = store.find("key_0").await.unwrap().unwrap();
    k.revoked_at_ms = Some(2);
    store.update(k).await.unwrap();
    assert_eq!(call(&s, &secret(0), "llm").await.0, 200, "not reloaded yet");
    ring.refresh().await.unwrap();
    let (st, body, _) = call(&s, &secret(0), "llm").await;
    assert_eq!(st, 401);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("key_0 was revoked"),
        "{body}"
    );
    let text = body.to_string();
    assert!(!text.contains(&secret(0)), "the key is never echoed");
}

#[tokio::test]
async fn a_key_may_call_only_its_scopes_and_models() {
    let m = mock(Behavior::text(&["hello"])).await;
    let store = Arc::new(Keys::default());
    let mut k = key(1, KeyLimits::default());
    k.scopes = vec!["LLM".into()];
    store.create(k).await.unwrap();
    let (s, _) = proxy_with(store, RecordingTelemetry::new(), &m).await;
    assert_eq!(call(&s, &secret(1), "llm").await.0, 200);
    let (st, body, _) = call(&s, &secret(1), "emb").await;
    assert_eq!(st, 403, "{body}");
    assert_eq!(body["error"]["code"], "model_not_allowed");
    // Issue 39: `/v1/models` shows a key only its own scopes' models.
    let get = |path: String| {
        let url = format!("{}{path}", s.v1());
        async move {
            let r = http().get(url).bearer_auth(secret(1)).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (st, list) = get("/models".into()).await;
    assert_eq!(st, 200);
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["LLM"], "{list}");
    assert_eq!(get("/models/llm".into()).await.0, 200);
    let (st, body) = get("/models/emb".into()).await;
    assert_eq!(st, 404, "{body}");
    assert!(
        !body.to_string().contains("EMB"),
        "no other scope named: {body}"
    );
}

#[tokio::test]
async fn a_keys_rpm_and_budget_refusals_name_the_limit() {
    let m = mock(Behavior::text(&["hello"])).await;
    let store = Arc::new(Keys::default());
    store
        .create(key(
            2,
            KeyLimits {
                rpm: 2,
                ..KeyLimits::default()
            },
        ))
        .await
        .unwrap();
    store
        .create(key(
            3,
            KeyLimits {
                // 1 nano-unit: the first call's reservation is already over it.
                budget_day_nanos: Some(1),
                ..KeyLimits::default()
            },
        ))
        .await
        .unwrap();
    let (s, _) = proxy_with(store, RecordingTelemetry::new(), &m).await;
    assert_eq!(call(&s, &secret(2), "llm").await.0, 200);
    assert_eq!(call(&s, &secret(2), "llm").await.0, 200);
    let before = m.requests().len();
    let (st, body, h) = call(&s, &secret(2), "llm").await;
    assert_eq!(st, 429, "{body}");
    assert_eq!(body["error"]["code"], "key_rpm");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("2 requests per minute"),
        "{body}"
    );
    let ra: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&ra), "{ra}");
    assert_eq!(
        m.requests().len(),
        before,
        "refused before any upstream request"
    );
    // A call whose reservation is above the budget itself can never pass: 403 (SPEC §24.2).
    let (st, body, h) = call(&s, &secret(3), "llm").await;
    assert_eq!(st, 403, "{body}");
    assert_eq!(body["error"]["code"], "key_budget_day");
    assert_eq!(h["x-should-retry"], "false");
    assert!(h.get("retry-after").is_none());
}

/// A budget holds under a run of calls: each call settles at what its rows cost, the
/// spend never passes the budget, and the key is refused once the next reservation no
/// longer fits.
#[tokio::test]
async fn a_budget_is_spent_exactly_and_never_exceeded() {
    let m = mock(Behavior::text(&["hello", " there"])).await;
    let store = Arc::new(Keys::default());
    // Prices of 1.0 per 1M tokens: a call costs a few thousand nanos, its reservation
    // (its prompt and output estimates) somewhat more: some 30 calls fit.
    let budget = 100_000u64;
    store.create(budget_key(4, budget)).await.unwrap();
    let rows = RecordingTelemetry::new();
    let (s, _) = proxy_with(store, rows.clone(), &m).await;
    let mut ok = 0;
    loop {
        let (st, body, h) = call(&s, &secret(4), "llm").await;
        if st == 200 {
            // The call had no cap: it was sent the one it reserved for.
            let sent = m.requests().last().unwrap().body["max_tokens"].clone();
            assert_eq!(sent, json!(16));
        }
        if st != 200 {
            assert_eq!(
                (st, body["error"]["code"].as_str()),
                (429, Some("key_budget_day")),
                "{body}"
            );
            // Spent for the day (nothing in flight): Retry-After is the reset, and no
            // client library should retry before it (SPEC §24.2).
            assert_eq!(h["x-should-retry"], "false");
            let ra: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
            assert!(ra > 1, "{ra}");
            break;
        }
        ok += 1;
        assert!(ok < 1_000, "the budget never ran out");
    }
    let scope = s.proxy.scopes().next().unwrap();
    let polygw_serve::ScopeClient::Chat(c) = &scope.client else {
        panic!("chat")
    };
    let mut usage = c.key_usage("key_4").await.unwrap();
    for _ in 0..200 {
        if usage.reserved_nanos == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        usage = c.key_usage("key_4").await.unwrap();
    }
    let spent: u64 = rows
        .rows()
        .iter()
        .filter_map(|r| r.cost)
        .map(polygw::core::key_quota::cost_nanos)
        .sum();
    assert!(ok >= 5, "{ok} calls");
    assert_eq!(usage.day_nanos, spent, "the spend is what the rows cost");
    assert!(usage.day_nanos <= budget, "{} > {budget}", usage.day_nanos);
}

/// A stored response is read, continued and deleted only with the client key that stored
/// it: another valid key gets 404, as for an id that does not exist.
#[tokio::test]
async fn stored_responses_belong_to_the_key_that_stored_them() {
    let m = mock(Behavior::text(&["stored ", "answer"])).await;
    let store = Arc::new(Keys::default());
    for n in [0, 1] {
        store.create(key(n, KeyLimits::default())).await.unwrap();
    }
    let (s, ring) = proxy_with(store.clone(), RecordingTelemetry::new(), &m).await;
    let r = http()
        .post(format!("{}/responses", s.v1()))
        .bearer_auth(secret(0))
        .json(&json!({"model": "llm", "input": "hi", "store": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let get = |k: String| {
        let url = format!("{}/responses/{id}", s.v1());
        async move {
            let mut last = 0;
            // The answer is stored as it goes out: poll briefly for the write.
            for _ in 0..50 {
                last = http()
                    .get(&url)
                    .bearer_auth(&k)
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16();
                if last == 200 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            last
        }
    };
    assert_eq!(get(secret(0)).await, 200, "the key that stored it reads it");
    assert_eq!(get(secret(1)).await, 404, "another key does not see it");
    // Nor can it continue or delete it.
    let r = http()
        .post(format!("{}/responses", s.v1()))
        .bearer_auth(secret(1))
        .json(&json!({"model": "llm", "input": "more", "previous_response_id": id}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = http()
        .delete(format!("{}/responses/{id}", s.v1()))
        .bearer_auth(secret(1))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(get(secret(0)).await, 200, "still there for its owner");
    // Issue 39: the owner's scopes no longer include LLM: it reads and deletes nothing
    // there any more.
    let mut k0 = key(0, KeyLimits::default());
    k0.scopes = vec!["EMB".into()];
    store.update(k0).await.unwrap();
    ring.refresh().await.unwrap();
    assert_eq!(get(secret(0)).await, 404, "a scope the key lost");
    let r = http()
        .delete(format!("{}/responses/{id}", s.v1()))
        .bearer_auth(secret(0))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

/// `/v1/messages` answers the guards' refusals in Anthropic's shape too (an unknown key:
/// 401 `authentication_error`), so the Anthropic SDKs read their message.
#[tokio::test]
async fn messages_refusals_of_the_guard_are_in_anthropics_shape() {
    let m = mock(Behavior::text(&["x"])).await;
    let store = Arc::new(Keys::default());
    store.create(key(0, KeyLimits::default())).await.unwrap();
    let (s, _ring) = proxy_with(store, RecordingTelemetry::new(), &m).await;
    let r = http()
        .post(format!("{}/messages", s.v1()))
        .header("x-api-key", secret(7))
        .json(&json!({"model": "llm", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], "authentication_error", "{body}");
    assert!(
        !body.to_string().contains(&secret(7)),
        "the key is never echoed"
    );
    // The chat route keeps OpenAI's.
    let (st, body, _) = call(&s, &secret(7), "llm").await;
    assert_eq!(
        (st, body["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
}

/// SPEC §24.2: what no provider billed costs the key nothing — calls the upstream
/// answered 400, 503 or 429 (an error status before any body) leave the key's spend at
/// 0, where each used to settle at its whole reservation.
#[tokio::test]
async fn error_answers_leave_the_budget_untouched() {
    for status in [400u16, 503, 429] {
        let m = mock(Behavior::status(status)).await;
        let store = Arc::new(Keys::default());
        store.create(budget_key(7, 1_000_000_000)).await.unwrap();
        let rows = RecordingTelemetry::new();
        let (s, _) = proxy_with(store, rows.clone(), &m).await;
        let (st, body, _) = call(&s, &secret(7), "llm").await;
        assert!(st >= 400, "{status}: {st} {body}");
        let scope = s.proxy.scopes().next().unwrap();
        let polygw_serve::ScopeClient::Chat(c) = &scope.client else {
            panic!("chat")
        };
        let mut usage = c.key_usage("key_7").await.unwrap();
        for _ in 0..200 {
            if usage.reserved_nanos == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            usage = c.key_usage("key_7").await.unwrap();
        }
        assert_eq!(usage.reserved_nanos, 0, "{status}");
        assert_eq!(
            usage.day_nanos, 0,
            "{status}: nothing billed, nothing charged"
        );
        assert!(
            !m.requests().is_empty(),
            "{status}: the upstream was called"
        );
    }
}

/// SPEC §24.1: a call reserves its output cap from whichever field carries it —
/// `max_completion_tokens`, `max_output_tokens`, `max_tokens` — times `n`: a budget
/// that pays a small cap refuses a call whose cap it could not pay, however the cap is
/// spelled.
#[tokio::test]
async fn every_cap_field_is_reserved() {
    let m = mock(Behavior::text(&["ok"])).await;
    let store = Arc::new(Keys::default());
    // 1.0 per 1M tokens: a token costs 1 000 nanos; the budget pays 1 000 tokens.
    store.create(budget_key(8, 1_000_000)).await.unwrap();
    let (s, _) = proxy_with(store, RecordingTelemetry::new(), &m).await;
    let send = |extra: Value| {
        let mut body = json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        http()
            .post(format!("{}/chat/completions", s.v1()))
            .bearer_auth(secret(8))
            .json(&body)
            .send()
    };
    assert_eq!(
        send(json!({"max_tokens": 100})).await.unwrap().status(),
        200
    );
    for too_much in [
        json!({"max_completion_tokens": 1_000_000}),
        json!({"max_tokens": 100, "n": 20}),
    ] {
        // Above the budget itself: it can never pass (SPEC §24.2: 403, no retry).
        let r = send(too_much.clone()).await.unwrap();
        assert_eq!(r.status(), 403, "{too_much}");
        assert_eq!(r.headers()["x-should-retry"], "false");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "key_budget_day", "{too_much}: {v}");
    }
}

/// SPEC §24.1: a budgeted call whose remaining budget cannot pay for its whole cap is
/// admitted with the smaller cap it pays for — sent upstream in place of the default —
/// down to `KEYS__MIN_OUTPUT_TOKENS`; below that it is refused.
#[tokio::test]
async fn a_cap_the_budget_cannot_pay_shrinks_down_to_the_minimum() {
    let m = mock(Behavior::text(&["short"])).await;
    let store = Arc::new(Keys::default());
    // 1.0 per 1M tokens: 1000 nanos a token. 2.1M nanos pay ~2090 output tokens, not the
    // 4096 an uncapped call reserves by default; 1M nanos pay fewer than 1024.
    for (n, budget) in [(11, 2_100_000u64), (12, 1_000_000)] {
        store.create(budget_key(n, budget)).await.unwrap();
    }
    let mut src = source("a", &m);
    src.input_price = Some(1.0);
    src.output_price = Some(1.0);
    let s = keyed_proxy(store, src, None).await;
    let (st, body, _) = call(&s, &secret(11), "llm").await;
    assert_eq!(st, 200, "{body}");
    let sent = m.requests().last().unwrap().body["max_tokens"]
        .as_u64()
        .expect("a cap was sent");
    assert!((1024..2100).contains(&sent), "sent cap {sent}");
    let (st, body, h) = call(&s, &secret(12), "llm").await;
    assert_eq!(st, 403, "{body}");
    assert_eq!(body["error"]["code"], "key_budget_day");
    assert_eq!(h["x-should-retry"], "false");
    assert_eq!(
        m.requests().len(),
        1,
        "the refused call reached no upstream"
    );
}

/// SPEC §24.1 measured at one process: 32 concurrent clients — with and without caps,
/// streamed and plain — on a key whose budget buys a handful of calls, then one client
/// call by call until the budget is spent. The mock bills by its own count: hidden
/// reasoning (3000 completion tokens behind 4 chunks, up to the cap it is sent) and
/// cache-write premiums. Its bill for the key never exceeds the budget, at least half of
/// the budget is used, and the key's settled spend is what the upstream billed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_clients_never_overspend_a_budget_that_buys_a_handful_of_calls() {
    use polygw_mock_upstream::{CacheDialect, PrefixCache, Prices};
    let m = mock(Behavior {
        completion_tokens: Some(3000),
        ..Behavior::text(&["a ", "b ", "c ", "d"])
    })
    .await;
    m.set_prefix_cache(PrefixCache {
        min_tokens: 16,
        block_tokens: 16,
        ..PrefixCache::new(CacheDialect::Anthropic)
    });
    m.set_prices(Prices::new(1.0, 4.0).with_cache_write(1.25));
    let store = Arc::new(Keys::default());
    // An uncapped call reserves ~16.5M nanos (4096 out at 4.0/1M) and costs ~12M; a
    // capped one (500) reserves and costs ~2M.
    let budget = 60_000_000u64;
    store.create(budget_key(20, budget)).await.unwrap();
    let mut src = source("a", &m);
    src.input_price = Some(1.0);
    src.output_price = Some(4.0);
    src.cache_write_price = Some(1.25);
    let s = Arc::new(keyed_proxy(store, src, Some(RecordingTelemetry::new())).await);
    // One call: (status, x-should-retry).
    async fn one(s: &Served, c: usize, n: usize) -> (u16, Option<String>) {
        let mut body = json!({
            "model": "llm",
            "messages": [{"role": "user", "content": format!(
                "client {c:02} call {n:03}: tell me about budgets and how they are kept, and why a gateway that overspends them is worse than none at all")}],
            "stream": c % 2 == 0,
        });
        if c % 3 == 0 {
            body["max_tokens"] = json!(500);
        }
        let r = http()
            .post(format!("{}/chat/completions", s.v1()))
            .bearer_auth(secret(20))
            .json(&body)
            .send()
            .await
            .unwrap();
        let st = r.status().as_u16();
        let retry = r
            .headers()
            .get("x-should-retry")
            .map(|v| v.to_str().unwrap().to_string());
        let text = r.text().await.unwrap();
        if st == 200 && c % 2 == 0 {
            assert!(text.contains("data: [DONE]"), "{text}");
        }
        (st, retry)
    }
    let clients: Vec<_> = (0..32)
        .map(|c| {
            let s = s.clone();
            tokio::spawn(async move {
                let mut ok = 0;
                loop {
                    match one(&s, c, ok).await {
                        (200, _) => ok += 1,
                        (429 | 403, _) => return ok,
                        other => panic!("client {c}: {other:?}"),
                    }
                }
            })
        })
        .collect();
    let mut concurrent = 0;
    for c in clients {
        concurrent += c.await.unwrap();
    }
    // Then call by call, nothing else in flight, until the budget itself refuses.
    let mut alone = 0;
    loop {
        match one(&s, 99, alone).await {
            (200, _) => alone += 1,
            (429, Some(r)) if r == "true" => panic!("refused for calls in flight with none"),
            (429 | 403, _) => break,
            other => panic!("{other:?}"),
        }
        assert!(alone < 100);
    }
    let scope = s.proxy.scopes().next().unwrap();
    let polygw_serve::ScopeClient::Chat(c) = &scope.client else {
        panic!("chat")
    };
    let usage = c.key_usage("key_20").await.unwrap();
    assert_eq!(usage.reserved_nanos, 0, "{usage:?}");
    let invoice = m.invoice();
    let billed = polygw::core::key_quota::cost_nanos(invoice.total.unwrap());
    let calls = invoice.entries.len() as u64;
    assert_eq!(
        calls as usize,
        concurrent + alone,
        "one upstream request per call"
    );
    assert!(
        invoice.entries.iter().any(|e| e.cache_write_tokens > 0),
        "cache writes were billed: {:?}",
        invoice.entries.first()
    );
    assert!(billed <= budget, "billed {billed} nanos, budget {budget}");
    assert!(billed * 2 >= budget, "only {billed} of {budget} used");
    assert!(
        usage.day_nanos.abs_diff(billed) <= calls,
        "settled {} vs billed {billed}",
        usage.day_nanos
    );
    println!(
        "one process, 32 clients: {calls} calls ({concurrent} concurrent + {alone} one by one), billed {billed} of {budget} nanos: overshoot {}",
        billed as i64 - budget as i64
    );
}
