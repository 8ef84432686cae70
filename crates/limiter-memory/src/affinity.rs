//! [`MemoryAffinity`]: the affinity keys of one process (SPEC §20.2) behind core's
//! [`AffinityStore`] port — which source last served each key, until its TTL runs out.
//!
//! Entries are kept in the order they were last written (a `LinkedHashMap`): a write
//! moves its key to the back, so with the scope's one TTL the front is always the next to
//! expire and expired entries are purged from the front, each once (amortised O(1) per
//! write). The store is bounded ([`MemoryAffinity::with_capacity`], default 100 000 keys):
//! beyond it the least recently written key is forgotten — its session starts on the
//! normal order, which only costs a cache read. Time is the injected clock's.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use hashlink::LinkedHashMap;
use polygw_core::error::GovernanceError;
use polygw_core::ports::{AffinityStore, Clock};

use crate::{elapsed_ms, lock};

/// The default number of keys a [`MemoryAffinity`] holds.
pub const DEFAULT_AFFINITY_CAPACITY: usize = 100_000;

struct Entry {
    source: Arc<str>,
    expires_ms: u64,
}

/// The keys of one process (every scope's; a key is `(scope, key)`).
pub struct MemoryAffinity {
    clock: Arc<dyn Clock>,
    base: Instant,
    capacity: usize,
    entries: Mutex<LinkedHashMap<(String, String), Entry>>,
}

impl std::fmt::Debug for MemoryAffinity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryAffinity")
            .field("capacity", &self.capacity)
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl MemoryAffinity {
    /// An empty store on `clock`, of [`DEFAULT_AFFINITY_CAPACITY`] keys.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self::with_capacity(clock, DEFAULT_AFFINITY_CAPACITY)
    }

    /// An empty store holding at most `capacity` keys (0: remembers nothing).
    pub fn with_capacity(clock: Arc<dyn Clock>, capacity: usize) -> Self {
        let base = clock.now();
        MemoryAffinity {
            clock,
            base,
            capacity,
            entries: Mutex::new(LinkedHashMap::new()),
        }
    }

    /// Keys held now, expired ones not yet purged included.
    pub fn len(&self) -> usize {
        lock(&self.entries).len()
    }

    /// Whether it holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn now_ms(&self) -> u64 {
        elapsed_ms(self.clock.as_ref(), self.base)
    }
}

/// Purges expired entries from the front (the least recently written).
fn purge(map: &mut LinkedHashMap<(String, String), Entry>, now_ms: u64) {
    while map.front().is_some_and(|(_, e)| e.expires_ms <= now_ms) {
        map.pop_front();
    }
}

#[async_trait]
impl AffinityStore for MemoryAffinity {
    async fn get(&self, scope: &str, key: &str) -> Result<Option<String>, GovernanceError> {
        let mut map = lock(&self.entries);
        let now = self.now_ms();
        purge(&mut map, now);
        // Entries written with a longer TTL than the front's may sit behind it expired.
        let k = (scope.to_string(), key.to_string());
        Ok(match map.get(&k) {
            Some(e) if e.expires_ms > now => Some(e.source.to_string()),
            Some(_) => {
                map.remove(&k);
                None
            }
            None => None,
        })
    }

    async fn put(
        &self,
        scope: &str,
        key: &str,
        source: &str,
        ttl: Duration,
    ) -> Result<(), GovernanceError> {
        let mut map = lock(&self.entries);
        let now = self.now_ms();
        purge(&mut map, now);
        let k = (scope.to_string(), key.to_string());
        map.remove(&k);
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        if ttl_ms == 0 || self.capacity == 0 {
            return Ok(());
        }
        while map.len() >= self.capacity {
            map.pop_front();
        }
        map.insert(
            k,
            Entry {
                source: source.into(),
                expires_ms: now.saturating_add(ttl_ms),
            },
        );
        Ok(())
    }
}

type Registry = Mutex<HashMap<(String, usize), Weak<MemoryAffinity>>>;

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// The affinity store of scope `scope` in this process on `clock` (SPEC §14.11, as the
/// limiter's [`crate::shared`]): every client of the scope built with the same clock
/// shares it, so a session sticks across them. It lives while some client holds it.
pub fn shared_affinity(scope: &str, clock: Arc<dyn Clock>) -> Arc<MemoryAffinity> {
    let key = (scope.to_string(), Arc::as_ptr(&clock) as *const () as usize);
    let mut reg = lock(&REGISTRY);
    reg.retain(|_, w| w.strong_count() > 0);
    if let Some(s) = reg.get(&key).and_then(Weak::upgrade) {
        return s;
    }
    let s = Arc::new(MemoryAffinity::new(clock));
    reg.insert(key, Arc::downgrade(&s));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use polygw_core::ports::ManualClock;

    fn clock() -> Arc<ManualClock> {
        Arc::new(ManualClock::new(tokio::time::Instant::now().into_std(), 0))
    }

    #[tokio::test]
    async fn bounded_least_recently_written_first() {
        let c = clock();
        let s = MemoryAffinity::with_capacity(c.clone(), 2);
        let ttl = Duration::from_secs(60);
        s.put("S", "a", "x", ttl).await.unwrap();
        s.put("S", "b", "x", ttl).await.unwrap();
        s.put("S", "a", "y", ttl).await.unwrap();
        s.put("S", "c", "x", ttl).await.unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(
            s.get("S", "b").await.unwrap(),
            None,
            "b was the oldest write"
        );
        assert_eq!(s.get("S", "a").await.unwrap().as_deref(), Some("y"));
        let none = MemoryAffinity::with_capacity(c, 0);
        none.put("S", "a", "x", ttl).await.unwrap();
        assert_eq!(none.get("S", "a").await.unwrap(), None);
    }

    #[tokio::test]
    async fn expired_keys_are_purged_not_kept() {
        let c = clock();
        let s = MemoryAffinity::new(c.clone());
        for i in 0..1000 {
            s.put("S", &format!("k{i}"), "x", Duration::from_secs(1))
                .await
                .unwrap();
        }
        c.advance(Duration::from_secs(1));
        s.put("S", "fresh", "x", Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(s.len(), 1, "a write purges what expired before it");
    }

    #[test]
    fn one_store_per_scope_and_clock() {
        let c: Arc<dyn Clock> = clock();
        let a = shared_affinity("AFF_A", c.clone());
        let b = shared_affinity("AFF_A", c.clone());
        let other = shared_affinity("AFF_B", c.clone());
        assert!(Arc::ptr_eq(&a, &b) && !Arc::ptr_eq(&a, &other));
        let c2: Arc<dyn Clock> = clock();
        assert!(!Arc::ptr_eq(&a, &shared_affinity("AFF_A", c2)));
    }
}
