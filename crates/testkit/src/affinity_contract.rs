//! The `AffinityStore` contract (SPEC §20.2): cases every store of prompt-cache affinity
//! keys runs through an [`AffinityHarness`] — the in-process one (`polygw-limiter-memory`,
//! on a manual clock) and the Redis one on the single server and on the local Redis
//! Cluster (`polygw-limiter-redis`, on the server's clock).
//!
//! A store keeps `(scope, key)` → the source that last served the key: `put` replaces; a
//! key is readable until `ttl` after its last `put` and never after; scopes and keys are
//! independent; every client of the store (another connection, another process) reads
//! what one wrote; concurrent writers leave one of their values. Cases take the harness's
//! margin around each expiry, so a store on real time passes on a loaded machine.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::affinity::AffinityKey;
use polygw_core::ports::AffinityStore;

use crate::services::unique_name;

/// How the contract reaches one store.
#[async_trait]
pub trait AffinityHarness: Send + Sync {
    /// The store.
    async fn store(&self) -> Arc<dyn AffinityStore>;
    /// `n` clients of the same state (other connections where there are).
    async fn clients(&self, n: usize) -> Vec<Arc<dyn AffinityStore>>;
    /// Moves the store's time on by `by` (a manual clock), or waits that long (real time).
    async fn advance(&self, by: Duration);
    /// The TTL the expiry cases write with: short on real time, anything on a manual clock.
    fn ttl(&self) -> Duration;
    /// How far from an expiry a case looks (0 on a manual clock).
    fn margin(&self) -> Duration;
}

/// Every case, for the "each implementation runs them all" check.
pub const CASES: [&str; 10] = [
    "unknown_key_reads_none",
    "put_then_get",
    "put_replaces_the_source",
    "scopes_and_keys_are_independent",
    "expires_after_its_ttl",
    "a_put_renews_the_ttl",
    "zero_ttl_forgets",
    "every_client_reads_what_one_wrote",
    "concurrent_writers_leave_one_of_their_values",
    "many_keys_are_read_and_written_at_once",
];

fn scope() -> String {
    unique_name("AFF")
}

fn key(s: &str) -> String {
    AffinityKey::given(s).as_str().to_string()
}

const LONG: Duration = Duration::from_secs(600);

/// A key never written reads `None`.
pub async fn unknown_key_reads_none(h: &dyn AffinityHarness) {
    let s = h.store().await;
    assert_eq!(s.get(&scope(), &key("nobody")).await.unwrap(), None);
}

/// What was written reads back.
pub async fn put_then_get(h: &dyn AffinityHarness) {
    let s = h.store().await;
    let sc = scope();
    s.put(&sc, &key("a"), "openai-0", LONG).await.unwrap();
    assert_eq!(
        s.get(&sc, &key("a")).await.unwrap().as_deref(),
        Some("openai-0")
    );
}

/// A later put is the key's source (the key moved).
pub async fn put_replaces_the_source(h: &dyn AffinityHarness) {
    let s = h.store().await;
    let sc = scope();
    s.put(&sc, &key("a"), "openai-0", LONG).await.unwrap();
    s.put(&sc, &key("a"), "deepseek-1", LONG).await.unwrap();
    assert_eq!(
        s.get(&sc, &key("a")).await.unwrap().as_deref(),
        Some("deepseek-1")
    );
}

/// Another scope's key and another key of the scope are untouched.
pub async fn scopes_and_keys_are_independent(h: &dyn AffinityHarness) {
    let s = h.store().await;
    let (a, b) = (scope(), scope());
    s.put(&a, &key("k"), "x-0", LONG).await.unwrap();
    s.put(&b, &key("k"), "y-0", LONG).await.unwrap();
    s.put(&a, &key("other"), "z-0", LONG).await.unwrap();
    assert_eq!(s.get(&a, &key("k")).await.unwrap().as_deref(), Some("x-0"));
    assert_eq!(s.get(&b, &key("k")).await.unwrap().as_deref(), Some("y-0"));
    assert_eq!(
        s.get(&a, &key("other")).await.unwrap().as_deref(),
        Some("z-0")
    );
    assert_eq!(s.get(&b, &key("other")).await.unwrap(), None);
}

/// Readable before its TTL has passed, gone after.
pub async fn expires_after_its_ttl(h: &dyn AffinityHarness) {
    let s = h.store().await;
    let sc = scope();
    let ttl = h.ttl();
    s.put(&sc, &key("a"), "x-0", ttl).await.unwrap();
    h.advance(ttl.saturating_sub(h.margin()).saturating_sub(h.margin()))
        .await;
    assert_eq!(
        s.get(&sc, &key("a")).await.unwrap().as_deref(),
        Some("x-0"),
        "before its TTL"
    );
    h.advance(h.margin() * 3 + Duration::from_millis(1)).await;
    assert_eq!(s.get(&sc, &key("a")).await.unwrap(), None, "after its TTL");
}

/// The TTL counts from the last put (a session served again stays).
pub async fn a_put_renews_the_ttl(h: &dyn AffinityHarness) {
    let s = h.store().await;
    let sc = scope();
    let ttl = h.ttl();
    s.put(&sc, &key("a"), "x-0", ttl).await.unwrap();
    h.advance(ttl / 2).await;
    s.put(&sc, &key("a"), "x-0", ttl).await.unwrap();
    // Past the first TTL, within the second.
    h.advance(ttl / 2 + h.margin() + Duration::from_millis(1))
        .await;
    assert_eq!(
        s.get(&sc, &key("a")).await.unwrap().as_deref(),
        Some("x-0"),
        "renewed by the second put"
    );
    h.advance(ttl / 2 + h.margin() * 2).await;
    assert_eq!(s.get(&sc, &key("a")).await.unwrap(), None);
}

/// A zero TTL forgets the key.
pub async fn zero_ttl_forgets(h: &dyn AffinityHarness) {
    let s = h.store().await;
    let sc = scope();
    s.put(&sc, &key("a"), "x-0", LONG).await.unwrap();
    s.put(&sc, &key("a"), "y-0", Duration::ZERO).await.unwrap();
    assert_eq!(s.get(&sc, &key("a")).await.unwrap(), None);
}

/// Shared state: what one client writes, every other reads (across processes for a
/// shared backend), and the last write wins.
pub async fn every_client_reads_what_one_wrote(h: &dyn AffinityHarness) {
    let cs = h.clients(3).await;
    let sc = scope();
    cs[0].put(&sc, &key("s"), "a-0", LONG).await.unwrap();
    for c in &cs {
        assert_eq!(c.get(&sc, &key("s")).await.unwrap().as_deref(), Some("a-0"));
    }
    cs[2].put(&sc, &key("s"), "c-0", LONG).await.unwrap();
    for c in &cs {
        assert_eq!(c.get(&sc, &key("s")).await.unwrap().as_deref(), Some("c-0"));
    }
}

/// Many clients writing one key at once leave one of the values written (never a mix,
/// never nothing); many keys at once are all kept.
pub async fn concurrent_writers_leave_one_of_their_values(h: &dyn AffinityHarness) {
    let cs = h.clients(4).await;
    let sc = Arc::new(scope());
    let mut tasks = Vec::new();
    for (i, c) in cs.iter().enumerate() {
        for j in 0..25 {
            let (c, sc) = (c.clone(), sc.clone());
            tasks.push(tokio::spawn(async move {
                let src = format!("src-{i}");
                c.put(&sc, &key("one"), &src, LONG).await.unwrap();
                c.put(&sc, &key(&format!("k{i}-{j}")), &src, LONG)
                    .await
                    .unwrap();
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let got = cs[0].get(&sc, &key("one")).await.unwrap().unwrap();
    assert!(
        (0..cs.len()).any(|i| got == format!("src-{i}")),
        "a written value: {got}"
    );
    for i in 0..cs.len() {
        for j in 0..25 {
            assert_eq!(
                cs[(i + 1) % cs.len()]
                    .get(&sc, &key(&format!("k{i}-{j}")))
                    .await
                    .unwrap(),
                Some(format!("src-{i}"))
            );
        }
    }
}

/// Signature families (SPEC §23.5): `put_many` writes every key, `get_many` reads them
/// back in order with `None` where a key is unknown or expired, and an empty list is no
/// round trip's worth of trouble.
pub async fn many_keys_are_read_and_written_at_once(h: &dyn AffinityHarness) {
    use polygw_core::native::family::blob_key;
    let s = h.store().await;
    let sc = scope();
    assert!(s.get_many(&sc, &[]).await.unwrap().is_empty());
    s.put_many(&sc, &[], "a", LONG).await.unwrap();
    let (k1, k2, k3) = (blob_key("sig-1"), blob_key("sig-2"), blob_key("sig-3"));
    s.put_many(&sc, &[k1.clone(), k2.clone()], "group-a", LONG)
        .await
        .unwrap();
    s.put_many(&sc, std::slice::from_ref(&k3), "group-b", h.ttl())
        .await
        .unwrap();
    let keys = [k1.clone(), blob_key("never"), k3.clone(), k2.clone()];
    assert_eq!(
        s.get_many(&sc, &keys).await.unwrap(),
        vec![
            Some("group-a".to_string()),
            None,
            Some("group-b".to_string()),
            Some("group-a".to_string())
        ]
    );
    // Another client reads the same.
    let other = h.clients(1).await.remove(0);
    assert_eq!(
        other
            .get_many(&sc, std::slice::from_ref(&k2))
            .await
            .unwrap(),
        vec![Some("group-a".to_string())]
    );
    h.advance(h.ttl() + h.margin()).await;
    assert_eq!(
        s.get_many(&sc, &[k3, k1]).await.unwrap(),
        vec![None, Some("group-a".to_string())]
    );
}
