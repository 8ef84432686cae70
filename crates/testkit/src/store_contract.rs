//! The `ResponseStore` contract (SPEC §18.1): cases every store of OpenAI Responses runs
//! through a [`StoreHarness`] — the in-process one (`polygw-limiter-memory`) and the SQL
//! one on SQLite and PostgreSQL (`polygw-telemetry-sql`).
//!
//! A store keeps `(scope, id)` → response and input items, JSON values exact; a lookup
//! from another scope never sees an entry; an entry is never returned at or after its
//! `expires_at_ms`; `put` replaces; `delete` says whether the entry was there. Time is
//! the `now_ms` the caller passes (and each entry's own times), so no case waits.
//! Give each case a store (or database) of its own: a store may purge any entry that
//! expired by the times a case passes, whatever its scope.

use std::sync::Arc;

use async_trait::async_trait;
use polygw_core::ports::{ResponseStore, StoredResponse};
use serde_json::{json, Value};

use crate::services::unique_name;

/// How the contract reaches one store.
#[async_trait]
pub trait StoreHarness: Send + Sync {
    /// The store.
    async fn store(&self) -> Arc<dyn ResponseStore>;
    /// Another handle on the same state (another client or connection where there are;
    /// the same store will do).
    async fn other(&self) -> Arc<dyn ResponseStore> {
        self.store().await
    }
}

/// 2026-12-02T11:32:08.123Z, the time entries are stored at.
pub const T0: i64 = 1_796_211_128_123;

/// A day, the default lifetime of the cases' entries.
pub const DAY_MS: i64 = 86_400_000;

fn scope() -> String {
    unique_name("SC")
}

/// A `response` object as `POST /v1/responses` answers it, with every kind of JSON value
/// (nested objects and arrays, unicode and escapes, integers at the ends of their ranges,
/// floats, booleans, null, empty containers).
pub fn response_json(id: &str, text: &str) -> Value {
    json!({
        "id": id,
        "object": "response",
        "created_at": 1_796_211_128u64,
        "status": "completed",
        "model": "gpt-5-mini",
        "output": [
            {
                "type": "reasoning",
                "id": format!("rs_{id}"),
                "summary": [{"type": "summary_text", "text": "thinking…"}]
            },
            {
                "type": "message",
                "id": format!("msg_{id}"),
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}]
            },
            {
                "type": "function_call",
                "id": format!("fc_{id}"),
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": "{\"city\":\"Zürich\",\"unit\":\"c\"}",
                "status": "completed"
            }
        ],
        "usage": {
            "input_tokens": 1200,
            "input_tokens_details": {"cached_tokens": 1024},
            "output_tokens": 350,
            "output_tokens_details": {"reasoning_tokens": 80},
            "total_tokens": 1550
        },
        "temperature": 0.7,
        "top_p": 1.0,
        "numbers": {
            "u64_max": u64::MAX,
            "i64_min": i64::MIN,
            "zero": 0,
            "negative": -42,
            "small": -1.5e-3,
            "large": 1e300,
            "pi": std::f64::consts::PI
        },
        "text": "quotes \" backslash \\ newline \n tab \t nul \u{0} emoji 🦀 CJK 漢字 rtl שלום",
        "metadata": {},
        "tools": [],
        "parallel_tool_calls": true,
        "previous_response_id": null,
        "store": true
    })
}

/// `n` input items (at least one) as a coding agent sends them.
pub fn input_items_json(n: usize) -> Vec<Value> {
    let mut items = vec![
        json!({"type": "message", "id": "dev_1", "role": "developer",
               "content": [{"type": "input_text", "text": "You are a coding agent."}]}),
        json!({"type": "message", "role": "user",
               "content": [{"type": "input_text", "text": "Fix the bug."},
                           {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}),
        json!({"type": "function_call", "call_id": "call_1", "name": "shell",
               "arguments": "{\"cmd\":[\"ls\",\"-la\"]}"}),
        json!({"type": "function_call_output", "call_id": "call_1", "output": "total 0\n"}),
    ];
    for i in items.len()..n {
        items.push(json!({"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": format!("item {i}")}]}));
    }
    items.truncate(n.max(1));
    items
}

/// An entry of `scope` stored at [`T0`], alive for a day.
pub fn entry(scope: &str, id: &str, text: &str) -> StoredResponse {
    StoredResponse {
        id: id.to_string(),
        scope: scope.to_string(),
        response: response_json(id, text),
        input_items: input_items_json(4),
        previous_id: None,
        created_at_ms: T0,
        expires_at_ms: T0 + DAY_MS,
    }
}

/// A per-owner bound no case reaches.
pub const UNBOUNDED: u64 = u64::MAX;

async fn put(s: &dyn ResponseStore, r: &StoredResponse) {
    s.put(r.clone(), UNBOUNDED).await.expect("put");
}

async fn get(s: &dyn ResponseStore, scope: &str, id: &str, now: i64) -> Option<StoredResponse> {
    s.get(scope, id, now).await.expect("get")
}

async fn delete(s: &dyn ResponseStore, scope: &str, id: &str) -> bool {
    s.delete(scope, id).await.expect("delete")
}

/// What was put comes back equal (every field, JSON values exact), through the store and
/// through another handle on it; an unknown id is `None`.
pub async fn put_get_round_trip(h: &dyn StoreHarness) {
    let (s, other) = (h.store().await, h.other().await);
    let sc = scope();
    let r = entry(&sc, "resp_round_trip", "Hello, world.");
    put(s.as_ref(), &r).await;
    assert_eq!(get(s.as_ref(), &sc, &r.id, T0).await.as_ref(), Some(&r));
    assert_eq!(
        get(other.as_ref(), &sc, &r.id, T0 + 1).await.as_ref(),
        Some(&r)
    );
    assert_eq!(get(s.as_ref(), &sc, "resp_unknown", T0).await, None);
    // Empty input items, a scalar response: values as given.
    let mut bare = entry(&sc, "resp_bare", "");
    bare.input_items = Vec::new();
    bare.response = json!({"id": "resp_bare", "output": []});
    put(s.as_ref(), &bare).await;
    assert_eq!(get(s.as_ref(), &sc, "resp_bare", T0).await, Some(bare));
}

/// An id of one scope is invisible from another: `get` is `None`, `delete` is false and
/// leaves it; the same id in two scopes is two entries.
pub async fn another_scopes_id_is_invisible(h: &dyn StoreHarness) {
    let s = h.store().await;
    let (a, b) = (scope(), scope());
    let ra = entry(&a, "resp_shared_id", "scope a");
    put(s.as_ref(), &ra).await;
    assert_eq!(get(s.as_ref(), &b, &ra.id, T0).await, None);
    assert!(!delete(s.as_ref(), &b, &ra.id).await);
    assert_eq!(get(s.as_ref(), &a, &ra.id, T0).await.as_ref(), Some(&ra));
    let rb = entry(&b, "resp_shared_id", "scope b");
    put(s.as_ref(), &rb).await;
    assert_eq!(get(s.as_ref(), &a, &ra.id, T0).await.as_ref(), Some(&ra));
    assert_eq!(get(s.as_ref(), &b, &rb.id, T0).await.as_ref(), Some(&rb));
    assert!(delete(s.as_ref(), &a, &ra.id).await);
    assert_eq!(get(s.as_ref(), &a, &ra.id, T0).await, None);
    assert_eq!(get(s.as_ref(), &b, &rb.id, T0).await, Some(rb));
    // A scope that is a prefix of another, and ids that complete it, stay apart.
    let r1 = entry(&format!("{a}X"), "Y", "1");
    let r2 = entry(&a, "XY", "2");
    put(s.as_ref(), &r1).await;
    put(s.as_ref(), &r2).await;
    assert_eq!(
        get(s.as_ref(), &r1.scope, "Y", T0).await.as_ref(),
        Some(&r1)
    );
    assert_eq!(get(s.as_ref(), &a, "XY", T0).await.as_ref(), Some(&r2));
}

/// An entry is returned before its `expires_at_ms` and never at or after it; one stored
/// already expired is never returned.
pub async fn expired_entries_are_never_returned(h: &dyn StoreHarness) {
    let s = h.store().await;
    let sc = scope();
    let mut r = entry(&sc, "resp_expiring", "short-lived");
    r.expires_at_ms = T0 + 1_000;
    put(s.as_ref(), &r).await;
    assert_eq!(get(s.as_ref(), &sc, &r.id, T0).await.as_ref(), Some(&r));
    assert_eq!(
        get(s.as_ref(), &sc, &r.id, T0 + 999).await.as_ref(),
        Some(&r)
    );
    assert_eq!(get(s.as_ref(), &sc, &r.id, T0 + 1_000).await, None);
    assert_eq!(get(s.as_ref(), &sc, &r.id, T0 + 5_000).await, None);
    assert_eq!(get(s.as_ref(), &sc, &r.id, T0 + 30 * DAY_MS).await, None);
    let mut dead = entry(&sc, "resp_born_dead", "");
    dead.expires_at_ms = T0;
    put(s.as_ref(), &dead).await;
    assert_eq!(get(s.as_ref(), &sc, &dead.id, T0).await, None);
    // Another entry lives on by its own time.
    let live = entry(&sc, "resp_live", "long-lived");
    put(s.as_ref(), &live).await;
    assert_eq!(get(s.as_ref(), &sc, &live.id, T0 + 5_000).await, Some(live));
}

/// `delete` is true for an entry that is there, then false; the entry is gone; deleting
/// an unknown id is false.
pub async fn delete_returns_true_then_false(h: &dyn StoreHarness) {
    let s = h.store().await;
    let sc = scope();
    let r = entry(&sc, "resp_delete", "to delete");
    let keep = entry(&sc, "resp_keep", "to keep");
    put(s.as_ref(), &r).await;
    put(s.as_ref(), &keep).await;
    assert!(delete(s.as_ref(), &sc, &r.id).await);
    assert_eq!(get(s.as_ref(), &sc, &r.id, T0).await, None);
    assert!(!delete(s.as_ref(), &sc, &r.id).await);
    assert!(!delete(s.as_ref(), &sc, "resp_never_stored").await);
    assert_eq!(get(s.as_ref(), &sc, &keep.id, T0).await, Some(keep));
    // Stored again after a delete: there again.
    put(s.as_ref(), &r).await;
    assert_eq!(get(s.as_ref(), &sc, &r.id, T0).await, Some(r));
}

/// A second `put` of the same (scope, id) replaces the entry: its values and its times
/// (an expiry moved later keeps it alive; moved earlier ends it sooner).
pub async fn put_replaces(h: &dyn StoreHarness) {
    let s = h.store().await;
    let sc = scope();
    let mut v1 = entry(&sc, "resp_replace", "first");
    v1.expires_at_ms = T0 + 10;
    put(s.as_ref(), &v1).await;
    let mut v2 = entry(&sc, "resp_replace", "second");
    v2.input_items = input_items_json(7);
    v2.created_at_ms = T0 + 5;
    v2.expires_at_ms = T0 + 1_000;
    put(s.as_ref(), &v2).await;
    assert_eq!(
        get(s.as_ref(), &sc, &v2.id, T0 + 500).await.as_ref(),
        Some(&v2)
    );
    let mut v3 = v2.clone();
    v3.response = json!({"id": "resp_replace", "status": "incomplete"});
    v3.expires_at_ms = T0 + 100;
    put(s.as_ref(), &v3).await;
    assert_eq!(
        get(s.as_ref(), &sc, &v3.id, T0 + 50).await.as_ref(),
        Some(&v3)
    );
    assert_eq!(get(s.as_ref(), &sc, &v3.id, T0 + 500).await, None);
    // Still one entry per (scope, id) (whether an expired one counts for `delete` before
    // it is purged is not part of the contract).
    let v4 = entry(&sc, "resp_replace", "fourth");
    put(s.as_ref(), &v4).await;
    assert_eq!(get(s.as_ref(), &sc, &v4.id, T0).await, Some(v4.clone()));
    assert!(delete(s.as_ref(), &sc, &v4.id).await);
    assert!(
        !delete(s.as_ref(), &sc, &v4.id).await,
        "one entry, not four"
    );
    assert_eq!(get(s.as_ref(), &sc, &v4.id, T0).await, None);
}

/// A large response (a 2 MiB answer) with 2 000 input items round-trips exactly.
pub async fn large_values_round_trip(h: &dyn StoreHarness) {
    let s = h.store().await;
    let sc = scope();
    let text: String = "Lorem ipsum dolor sit amet, ünïcödé ✓ "
        .chars()
        .cycle()
        .take(2 << 20)
        .collect();
    let mut r = entry(&sc, "resp_large", &text);
    r.input_items = input_items_json(2_000);
    put(s.as_ref(), &r).await;
    let got = get(s.as_ref(), &sc, &r.id, T0)
        .await
        .expect("the large entry");
    assert_eq!(got.input_items.len(), 2_000);
    assert!(got == r, "the large entry differs after a round trip");
}

/// Many entries over several scopes: each comes back as stored; deleting half leaves the
/// other half.
pub async fn many_entries(h: &dyn StoreHarness) {
    let s = h.store().await;
    let scopes = [scope(), scope(), scope()];
    let n = 150;
    let mut all = Vec::new();
    for (i, sc) in scopes.iter().cycle().take(n * scopes.len()).enumerate() {
        let mut r = entry(sc, &format!("resp_{i:05}"), &format!("answer {i}"));
        r.input_items = input_items_json(1 + i % 5);
        r.expires_at_ms = T0 + DAY_MS + i as i64;
        all.push(r);
    }
    for r in &all {
        put(s.as_ref(), r).await;
    }
    for r in &all {
        assert_eq!(get(s.as_ref(), &r.scope, &r.id, T0).await.as_ref(), Some(r));
    }
    for r in all.iter().step_by(2) {
        assert!(delete(s.as_ref(), &r.scope, &r.id).await, "{}", r.id);
    }
    for (i, r) in all.iter().enumerate() {
        let got = get(s.as_ref(), &r.scope, &r.id, T0).await;
        if i % 2 == 0 {
            assert_eq!(got, None, "{}", r.id);
        } else {
            assert_eq!(got.as_ref(), Some(r), "{}", r.id);
        }
    }
}

/// Clients putting, reading and deleting at once each see their own entries.
pub async fn concurrent_clients(h: &dyn StoreHarness) {
    let sc = scope();
    let mut tasks = Vec::new();
    for t in 0..8 {
        let s = if t % 2 == 0 {
            h.store().await
        } else {
            h.other().await
        };
        let sc = sc.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..20 {
                let r = entry(&sc, &format!("resp_t{t}_{i}"), &format!("{t}/{i}"));
                put(s.as_ref(), &r).await;
                assert_eq!(get(s.as_ref(), &sc, &r.id, T0).await.as_ref(), Some(&r));
                if i % 4 == 0 {
                    assert!(delete(s.as_ref(), &sc, &r.id).await);
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("a client task panicked");
    }
    let s = h.store().await;
    for t in 0..8 {
        for i in 0..20 {
            let got = get(s.as_ref(), &sc, &format!("resp_t{t}_{i}"), T0).await;
            assert_eq!(got.is_some(), i % 4 != 0, "resp_t{t}_{i}");
        }
    }
}

/// A turn that continues another, in a conversation of three (SPEC §24.5).
pub fn turn(scope: &str, id: &str, previous: Option<&str>, at: i64) -> StoredResponse {
    let mut r = entry(scope, id, &format!("answer {id}"));
    r.input_items = vec![json!({"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": format!("question {id}")}]})];
    r.previous_id = previous.map(str::to_string);
    r.created_at_ms = at;
    r.expires_at_ms = at + DAY_MS;
    r
}

/// Turns link up: `chain` returns the turn and those it continues, newest first, each
/// with its own input only; a turn whose predecessor is gone ends the chain there; each
/// turn renews the live turns it continues to its own expiry, so the first turn of a
/// conversation in use outlives its own TTL.
pub async fn chains_link_turns_and_renew_them(h: &dyn StoreHarness) {
    let (s, other) = (h.store().await, h.other().await);
    let sc = scope();
    let t1 = turn(&sc, "resp_t1", None, T0);
    let t2 = turn(&sc, "resp_t2", Some("resp_t1"), T0 + DAY_MS / 2);
    let t3 = turn(&sc, "resp_t3", Some("resp_t2"), T0 + DAY_MS - 1);
    for t in [&t1, &t2, &t3] {
        put(s.as_ref(), t).await;
    }
    // Past t1's own expiry: renewed with t3's.
    let later = T0 + DAY_MS + 1_000;
    let chain = other.chain(&sc, "resp_t3", later).await.expect("chain");
    let ids: Vec<&str> = chain.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["resp_t3", "resp_t2", "resp_t1"]);
    assert_eq!(chain[0], t3);
    assert_eq!(
        chain[2].input_items, t1.input_items,
        "each turn its own input"
    );
    assert_eq!(chain[2].expires_at_ms, t3.expires_at_ms, "renewed");
    let whole = polygw_core::ports::conversation(&chain).expect("a whole conversation");
    assert_eq!(
        whole.len(),
        3 * (1 + 3),
        "three inputs and three outputs of three items"
    );
    // From the middle: two turns. Unknown: empty.
    assert_eq!(s.chain(&sc, "resp_t2", later).await.unwrap().len(), 2);
    assert!(s.chain(&sc, "resp_none", T0).await.unwrap().is_empty());
    // Another owner sees none of it.
    assert!(s.chain(&scope(), "resp_t3", T0).await.unwrap().is_empty());
    // A deleted turn breaks the chain where it was: no shorter conversation passes for
    // the whole.
    assert!(delete(s.as_ref(), &sc, "resp_t2").await);
    let chain = s.chain(&sc, "resp_t3", later).await.unwrap();
    assert_eq!(chain.len(), 1);
    let broken = polygw_core::ports::conversation(&chain).unwrap_err();
    assert_eq!(broken.missing, "resp_t2");
    // Past everything: nothing.
    assert!(s
        .chain(&sc, "resp_t3", t3.expires_at_ms)
        .await
        .unwrap()
        .is_empty());
    // A renewal never shortens a turn that lives longer already.
    let mut long = turn(&sc, "resp_long", None, T0);
    long.expires_at_ms = T0 + 10 * DAY_MS;
    put(s.as_ref(), &long).await;
    put(s.as_ref(), &turn(&sc, "resp_after", Some("resp_long"), T0)).await;
    assert_eq!(
        get(s.as_ref(), &sc, "resp_long", T0)
            .await
            .unwrap()
            .expires_at_ms,
        T0 + 10 * DAY_MS
    );
}

/// Bytes one entry of [`turn`] counts (all turns of a case are the same size when their
/// ids are).
pub fn turn_bytes(r: &StoredResponse) -> u64 {
    let response = serde_json::to_string(&r.response).expect("json").len();
    let items = serde_json::to_string(&r.input_items).expect("json").len();
    polygw_core::ports::entry_bytes(r, response, items)
}

/// An owner's entries stay within the `max_bytes` of its puts: the ones that expire
/// soonest leave first, the one put never; another owner's entries never leave for it;
/// an entry larger than the bound is refused and changes nothing.
pub async fn an_owner_is_bounded_and_never_evicts_another(h: &dyn StoreHarness) {
    let s = h.store().await;
    let (a, b) = (scope(), scope());
    let one = turn_bytes(&turn(&a, "resp_00", None, T0));
    let bound = one * 3 + one / 2;
    // b's entries, put without a bound, before and after a's.
    put(s.as_ref(), &turn(&b, "resp_b0", None, T0)).await;
    for i in 0..8 {
        let r = turn(&a, &format!("resp_{i:02}"), None, T0 + i);
        s.put(r, bound).await.expect("put within the bound");
    }
    put(s.as_ref(), &turn(&b, "resp_b1", None, T0)).await;
    let now = T0 + 10;
    let mut live = Vec::new();
    for i in 0..8 {
        if get(s.as_ref(), &a, &format!("resp_{i:02}"), now)
            .await
            .is_some()
        {
            live.push(i);
        }
    }
    assert_eq!(live, [5, 6, 7], "the three that expire last");
    for id in ["resp_b0", "resp_b1"] {
        assert!(get(s.as_ref(), &b, id, now).await.is_some(), "{id}");
    }
    // A renewed conversation outlives an older one.
    let mut keep = turn(&a, "resp_08", Some("resp_05"), T0 + 20);
    keep.expires_at_ms = T0 + 2 * DAY_MS;
    s.put(keep, bound).await.unwrap();
    assert!(
        get(s.as_ref(), &a, "resp_05", now).await.is_some(),
        "renewed"
    );
    assert!(
        get(s.as_ref(), &a, "resp_06", now).await.is_none(),
        "evicted"
    );
    // Too large on its own: refused, nothing evicted.
    let mut big = turn(&a, "resp_big", None, T0 + 30);
    big.response = json!({"id": "resp_big", "text": "y".repeat(bound as usize)});
    let e = s
        .put(big, bound)
        .await
        .expect_err("larger than the bound")
        .0;
    assert!(e.contains("RESPONSES__MAX_BYTES_PER_KEY"), "{e}");
    assert!(get(s.as_ref(), &a, "resp_big", now).await.is_none());
    for id in ["resp_05", "resp_07", "resp_08"] {
        assert!(get(s.as_ref(), &a, id, now).await.is_some(), "{id}");
    }
}

/// Every case, by name (for a harness that runs them in one test).
pub const CASES: [&str; 10] = [
    "put_get_round_trip",
    "another_scopes_id_is_invisible",
    "expired_entries_are_never_returned",
    "delete_returns_true_then_false",
    "put_replaces",
    "large_values_round_trip",
    "many_entries",
    "concurrent_clients",
    "chains_link_turns_and_renew_them",
    "an_owner_is_bounded_and_never_evicts_another",
];

/// Runs the case `name` of [`CASES`].
pub async fn run(name: &str, h: &dyn StoreHarness) {
    match name {
        "put_get_round_trip" => put_get_round_trip(h).await,
        "another_scopes_id_is_invisible" => another_scopes_id_is_invisible(h).await,
        "expired_entries_are_never_returned" => expired_entries_are_never_returned(h).await,
        "delete_returns_true_then_false" => delete_returns_true_then_false(h).await,
        "put_replaces" => put_replaces(h).await,
        "large_values_round_trip" => large_values_round_trip(h).await,
        "many_entries" => many_entries(h).await,
        "concurrent_clients" => concurrent_clients(h).await,
        "chains_link_turns_and_renew_them" => chains_link_turns_and_renew_them(h).await,
        "an_owner_is_bounded_and_never_evicts_another" => {
            an_owner_is_bounded_and_never_evicts_another(h).await
        }
        other => panic!("no store contract case {other:?}"),
    }
}
