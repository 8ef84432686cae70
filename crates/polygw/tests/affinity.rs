//! Prompt-cache affinity through the engine (SPEC §20.2), under tokio's paused clock with
//! the fake transport: a session sticks to the source that last served it while that
//! source is admissible; a quota, an open breaker, a failure in the call or a better
//! priority tier move it; a hedge leg that wins takes the key along; the store is shared
//! by the process's clients of a scope and, with Redis governance, by every process; a
//! failing store never fails a call.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use polygw::core::affinity::{AffinityKey, AffinityMode, AffinityOutcome};
use polygw::core::hedge::ThresholdSetting;
use polygw::core::ports::{AffinityStore, Clock, MockAffinityStore, SplitMix64};
use polygw::core::GovernanceError;
use polygw::{CallOptions, ChatRequest, GatewayClient, Message, ScopeSettings, SourceConfig};
use polygw_limiter_memory::{MemoryAffinity, MemoryBreakerStore, MemoryLimiter};
use polygw_testkit::clock::TokioClock;
use polygw_testkit::fakes::{FakeEmbedder, FakeTransport, Script};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// `n` sources `s-0`…, equal weights, hedging off.
fn scope(n: usize) -> ScopeSettings {
    let sources = (0..n)
        .map(|i| SourceConfig::new("s", i as u32, "http://127.0.0.1:9/v1", "", "m"))
        .collect();
    let mut s = ScopeSettings::new("LLM", sources);
    s.hedge.after = ThresholdSetting::Off;
    s.hedge.stall_after = ThresholdSetting::Off;
    s.retry.backoff_base = ms(10);
    s.retry.backoff_max = ms(100);
    s
}

struct H {
    client: GatewayClient,
    fake: Arc<FakeTransport>,
    store: Arc<MemoryAffinity>,
}

async fn harness(s: ScopeSettings, seed: u64) -> H {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock);
    let fake = FakeTransport::new(clock.clone());
    let store = Arc::new(MemoryAffinity::new(clock.clone()));
    let client = GatewayClient::builder(s)
        .transport(fake.clone())
        .limiter(Arc::new(MemoryLimiter::new(clock.clone())))
        .breakers(Arc::new(MemoryBreakerStore::new(clock.clone())))
        .affinity_store(store.clone())
        .clock(clock)
        .rng(Arc::new(SplitMix64::new(seed)))
        .build()
        .await
        .expect("client");
    H {
        client,
        fake,
        store,
    }
}

/// A call keyed `key` (as `polygw serve` passes a session id).
async fn call(c: &GatewayClient, key: &str) -> String {
    let o = CallOptions::default().with_affinity_key(key);
    c.chat_with(ChatRequest::user("hi"), o)
        .await
        .expect("call")
        .source
}

fn outcomes(c: &GatewayClient) -> (u64, u64, u64) {
    let m = c.metrics();
    (
        m.affinity_with(AffinityOutcome::Hit),
        m.affinity_with(AffinityOutcome::Miss),
        m.affinity_with(AffinityOutcome::Moved),
    )
}

async fn stored(h: &H, key: &str) -> Option<String> {
    h.store
        .get("LLM", AffinityKey::given(key).as_str())
        .await
        .unwrap()
}

async fn put(h: &H, key: &str, source: &str) {
    h.store
        .put(
            "LLM",
            AffinityKey::given(key).as_str(),
            source,
            Duration::from_secs(300),
        )
        .await
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_session_sticks_to_the_source_that_served_it() {
    let h = harness(scope(3), 1).await;
    let mut by_session: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for turn in 0..5 {
        for s in 0..20 {
            let key = format!("session-{s}");
            let src = call(&h.client, &key).await;
            by_session.entry(key).or_default().insert(src);
            let _ = turn;
        }
    }
    for (k, srcs) in &by_session {
        assert_eq!(srcs.len(), 1, "{k} moved: {srcs:?}");
    }
    let used: BTreeSet<&String> = by_session.values().flatten().collect();
    assert!(
        used.len() > 1,
        "new sessions still spread by weight: {used:?}"
    );
    assert_eq!(outcomes(&h.client), (80, 20, 0));
}

#[tokio::test(start_paused = true)]
async fn without_a_key_a_conversation_keys_on_its_system_prompt_and_first_question() {
    let h = harness(scope(3), 2).await;
    for s in 0..10 {
        let mut messages = vec![
            Message::system("You are terse."),
            Message::user(format!("question {s}")),
        ];
        let mut seen = BTreeSet::new();
        for t in 0..4 {
            let r = h
                .client
                .chat(ChatRequest::new(messages.clone()))
                .await
                .unwrap();
            seen.insert(r.source);
            messages.push(Message::assistant(r.content));
            messages.push(Message::user(format!("follow-up {t}")));
        }
        assert_eq!(seen.len(), 1, "conversation {s}: {seen:?}");
    }
    assert_eq!(outcomes(&h.client), (30, 10, 0));
}

#[tokio::test(start_paused = true)]
async fn affinity_off_takes_the_normal_order() {
    let mut s = scope(3);
    s.affinity.mode = AffinityMode::Off;
    let h = harness(s, 3).await;
    let mut used = BTreeSet::new();
    for _ in 0..30 {
        used.insert(call(&h.client, "one-session").await);
    }
    assert!(used.len() > 1, "{used:?}");
    assert!(h.store.is_empty(), "nothing remembered");
    assert_eq!(outcomes(&h.client), (0, 0, 0));
}

/// Invariant 3 of `core::affinity`: a sticky source over its quota is passed over.
#[tokio::test(start_paused = true)]
async fn a_source_over_its_quota_is_passed_over_and_the_key_moves() {
    let mut s = scope(3);
    for src in &mut s.sources {
        src.rpm = 1;
    }
    let h = harness(s, 4).await;
    let first = call(&h.client, "k").await;
    let second = call(&h.client, "k").await;
    assert_ne!(
        first, second,
        "the first source's one request a minute is spent"
    );
    assert_eq!(h.fake.calls_to(&first), 1, "never over-admitted");
    assert_eq!(stored(&h, "k").await.as_deref(), Some(second.as_str()));
    assert_eq!(outcomes(&h.client), (0, 1, 1));
}

/// A sticky source that fails is left for the call's other sources (failed in the
/// call), and once its breaker is open it is not even tried.
#[tokio::test(start_paused = true)]
async fn a_failing_source_and_an_open_breaker_move_the_key() {
    let mut s = scope(2);
    s.breaker.failures = 1;
    let h = harness(s, 5).await;
    h.fake.set_default("s-0", Script::http(ms(5), 500));
    put(&h, "k", "s-0").await;
    assert_eq!(call(&h.client, "k").await, "s-1", "retried elsewhere");
    assert_eq!(h.fake.calls_to("s-0"), 1);
    assert_eq!(stored(&h, "k").await.as_deref(), Some("s-1"));
    // Another process wrote s-0 meanwhile: its breaker is open, so it is passed over.
    put(&h, "k", "s-0").await;
    assert_eq!(call(&h.client, "k").await, "s-1");
    assert_eq!(
        h.fake.calls_to("s-0"),
        1,
        "an open breaker is never overridden"
    );
    assert_eq!(outcomes(&h.client), (0, 0, 2));
}

/// Invariant 4: a better priority tier wins over the key's source.
#[tokio::test(start_paused = true)]
async fn a_better_priority_tier_wins_over_the_keys_source() {
    let mut s = scope(2);
    s.sources[1].priority = 1;
    let h = harness(s, 6).await;
    // The session went to the backup while the primary was out.
    put(&h, "k", "s-1").await;
    assert_eq!(call(&h.client, "k").await, "s-0");
    assert_eq!(stored(&h, "k").await.as_deref(), Some("s-0"));
    // Within a tier the key's source leads.
    let mut s = scope(3);
    s.sources[0].priority = 1;
    let h = harness(s, 6).await;
    for src in ["s-2", "s-1", "s-2"] {
        put(&h, "k", src).await;
        assert_eq!(call(&h.client, "k").await, src);
    }
}

#[tokio::test(start_paused = true)]
async fn a_hedge_leg_that_wins_takes_the_key_along() {
    let mut s = scope(2);
    s.hedge.after = ThresholdSetting::Static(ms(100));
    let h = harness(s, 7).await;
    put(&h, "k", "s-0").await;
    h.fake
        .push("s-0", Script::ok(Duration::from_secs(5), "slow"));
    let o = CallOptions::default().with_affinity_key("k");
    let r = h
        .client
        .chat_with(ChatRequest::user("hi"), o)
        .await
        .unwrap();
    assert!(r.call_stats.hedge_won, "{:?}", r.call_stats);
    assert_eq!(r.source, "s-1");
    assert_eq!(stored(&h, "k").await.as_deref(), Some("s-1"));
    // The next turn goes to the hedge's source first, and needs no hedge.
    let r = h
        .client
        .chat_with(
            ChatRequest::user("hi"),
            CallOptions::default().with_affinity_key("k"),
        )
        .await
        .unwrap();
    assert_eq!((r.source.as_str(), r.call_stats.hedges), ("s-1", 0));
    assert_eq!(outcomes(&h.client), (1, 0, 1));
}

#[tokio::test(start_paused = true)]
async fn a_key_is_forgotten_after_its_ttl() {
    let mut s = scope(3);
    s.affinity.ttl = Duration::from_secs(10);
    let h = harness(s, 8).await;
    let first = call(&h.client, "k").await;
    tokio::time::advance(Duration::from_secs(9)).await;
    assert_eq!(call(&h.client, "k").await, first, "within the TTL");
    // The second call renewed it: 9 s later it is still there, 11 s later gone.
    tokio::time::advance(Duration::from_secs(9)).await;
    assert_eq!(stored(&h, "k").await.as_deref(), Some(first.as_str()));
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(stored(&h, "k").await, None);
    call(&h.client, "k").await;
    assert_eq!(outcomes(&h.client), (1, 2, 0));
}

#[tokio::test(start_paused = true)]
async fn a_failing_store_never_fails_a_call() {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock);
    let mut store = MockAffinityStore::new();
    store
        .expect_get()
        .returning(|_, _| Err(GovernanceError::new("redis", "down")));
    store
        .expect_put()
        .returning(|_, _, _, _| Err(GovernanceError::new("redis", "down")));
    let client = GatewayClient::builder(scope(2))
        .transport(FakeTransport::new(clock.clone()))
        .limiter(Arc::new(MemoryLimiter::new(clock.clone())))
        .breakers(Arc::new(MemoryBreakerStore::new(clock.clone())))
        .affinity_store(Arc::new(store))
        .clock(clock)
        .build()
        .await
        .unwrap();
    for _ in 0..3 {
        call(&client, "k").await;
    }
    // Nothing was remembered: each counts as a miss.
    assert_eq!(outcomes(&client), (0, 3, 0));
}

#[tokio::test(start_paused = true)]
async fn a_single_source_scope_or_an_embedding_client_asks_no_store() {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock);
    // No expectations: any call of the store panics.
    let client = GatewayClient::builder(scope(1))
        .transport(FakeTransport::new(clock.clone()))
        .limiter(Arc::new(MemoryLimiter::new(clock.clone())))
        .breakers(Arc::new(MemoryBreakerStore::new(clock.clone())))
        .affinity_store(Arc::new(MockAffinityStore::new()))
        .clock(clock)
        .build()
        .await
        .unwrap();
    assert_eq!(call(&client, "k").await, "s-0");
    // Affinity is about chat prompts: an embedding client of two sources asks nothing.
    let clock: Arc<dyn Clock> = Arc::new(TokioClock);
    let embedder = GatewayClient::builder(scope(2))
        .transport(FakeTransport::new(clock.clone()))
        .embedding_transport(Arc::new(FakeEmbedder::default()))
        .limiter(Arc::new(MemoryLimiter::new(clock.clone())))
        .breakers(Arc::new(MemoryBreakerStore::new(clock.clone())))
        .affinity_store(Arc::new(MockAffinityStore::new()))
        .clock(clock)
        .build_embedding()
        .await
        .unwrap();
    embedder.embed(&["a".to_string()]).await.unwrap();
}

/// SPEC §14.11 for affinity: the clients of a scope in one process share one store.
#[tokio::test(start_paused = true)]
async fn the_clients_of_a_scope_share_the_process_store() {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock);
    let fake = FakeTransport::new(clock.clone());
    let limiter = Arc::new(MemoryLimiter::new(clock.clone()));
    let breakers = Arc::new(MemoryBreakerStore::new(clock.clone()));
    let mut clients = Vec::new();
    for seed in [11, 12] {
        clients.push(
            GatewayClient::builder(scope(3))
                .transport(fake.clone())
                .limiter(limiter.clone())
                .breakers(breakers.clone())
                .clock(clock.clone())
                .rng(Arc::new(SplitMix64::new(seed)))
                .build()
                .await
                .unwrap(),
        );
    }
    for s in 0..12 {
        let key = format!("session-{s}");
        let a = call(&clients[0], &key).await;
        let b = call(&clients[1], &key).await;
        assert_eq!(a, b, "{key}");
    }
}

/// With Redis governance every process shares the keys: two clients on their own
/// connections (two replicas) send a session's turns to one source.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_affinity_through_redis() {
    let Some(url) = polygw_testkit::services::redis_url() else {
        return;
    };
    let clock: Arc<dyn Clock> = Arc::new(TokioClock);
    let fake = FakeTransport::new(clock.clone());
    let name = polygw_testkit::services::unique_name("AFFR").to_uppercase();
    let mut s = scope(3);
    s.name = name.clone();
    s.redis_url = Some(polygw::core::Secret::new(url.as_str()));
    let mut replicas = Vec::new();
    for seed in [21, 22, 23] {
        replicas.push(
            GatewayClient::builder(s.clone())
                .transport(fake.clone())
                .rng(Arc::new(SplitMix64::new(seed)))
                .build()
                .await
                .unwrap(),
        );
    }
    for sess in 0..9 {
        let key = format!("session-{sess}");
        let mut seen = BTreeSet::new();
        for turn in 0..6 {
            seen.insert(call(&replicas[(sess + turn) % 3], &key).await);
        }
        assert_eq!(seen.len(), 1, "{key}: {seen:?}");
    }
    let hits: u64 = replicas
        .iter()
        .map(|c| c.metrics().affinity_with(AffinityOutcome::Hit))
        .sum();
    assert_eq!(hits, 9 * 5);
}
