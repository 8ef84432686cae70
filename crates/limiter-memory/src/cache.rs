//! [`MemoryCache`]: the in-process response cache (SPEC §10) — bounded, with a TTL per
//! entry and least-recently-used eviction.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use hashlink::LruCache;
use polygw_core::error::CacheError;
use polygw_core::ports::{Clock, ResponseCache};
use polygw_core::response::LlmResponse;

use crate::lock;

/// A bounded in-process [`ResponseCache`]: at most `capacity` entries, each fresh for the
/// TTL it was stored with; when full, the least recently used entry goes first (expired
/// entries go before any live one). Cheap to clone (shared state).
///
/// A hit is one hash lookup that also moves the entry to the most recent end of the
/// recency list (O(1), no allocation besides the clone of the answer); a store also
/// keeps the entry in an expiry index, so expired entries leave before live ones.
#[derive(Clone)]
pub struct MemoryCache {
    inner: Arc<Inner>,
}

struct Inner {
    capacity: usize,
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
}

struct Entry {
    response: LlmResponse,
    expires: Instant,
    /// Insertion number (unique), for the expiry index.
    ins: u64,
}

struct State {
    /// Entries in recency order, least recently used first (the capacity is enforced
    /// here, not by the map, so that an evicted entry also leaves the expiry index).
    entries: LruCache<String, Entry>,
    /// (expiry, insertion number) → key, soonest first.
    by_expiry: BTreeMap<(Instant, u64), String>,
    next_ins: u64,
}

impl State {
    fn new() -> Self {
        State {
            entries: LruCache::new_unbounded(),
            by_expiry: BTreeMap::new(),
            next_ins: 0,
        }
    }

    fn remove(&mut self, key: &str) {
        if let Some(e) = self.entries.remove(key) {
            self.by_expiry.remove(&(e.expires, e.ins));
        }
    }

    fn purge_expired(&mut self, now: Instant) {
        while let Some(entry) = self.by_expiry.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let key = entry.remove();
            self.entries.remove(&key);
        }
    }

    fn evict_lru(&mut self) -> bool {
        match self.entries.remove_lru() {
            Some((_, e)) => {
                self.by_expiry.remove(&(e.expires, e.ins));
                true
            }
            None => false,
        }
    }
}

impl fmt::Debug for MemoryCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryCache")
            .field("capacity", &self.inner.capacity)
            .field("len", &self.len())
            .finish()
    }
}

impl MemoryCache {
    /// A cache of at most `capacity` entries (0 stores nothing) on `clock`.
    pub fn new(capacity: usize, clock: Arc<dyn Clock>) -> Self {
        MemoryCache {
            inner: Arc::new(Inner {
                capacity,
                clock,
                state: Mutex::new(State::new()),
            }),
        }
    }

    /// Entries held now (expired ones included until they are evicted or looked up).
    pub fn len(&self) -> usize {
        lock(&self.inner.state).entries.len()
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[async_trait]
impl ResponseCache for MemoryCache {
    async fn get(&self, key: &str) -> Result<Option<LlmResponse>, CacheError> {
        let now = self.inner.clock.now();
        let mut st = lock(&self.inner.state);
        // `get` moves a found entry to the most recent end.
        match st.entries.get(key) {
            None => Ok(None),
            Some(e) if e.expires > now => Ok(Some(e.response.clone())),
            Some(_) => {
                st.remove(key);
                Ok(None)
            }
        }
    }

    async fn put(
        &self,
        key: &str,
        response: &LlmResponse,
        ttl: Duration,
    ) -> Result<(), CacheError> {
        if self.inner.capacity == 0 || ttl.is_zero() {
            return Ok(());
        }
        let now = self.inner.clock.now();
        let Some(expires) = now.checked_add(ttl) else {
            return Err(CacheError(format!("ttl {ttl:?} is out of range")));
        };
        let mut st = lock(&self.inner.state);
        st.remove(key);
        st.purge_expired(now);
        while st.entries.len() >= self.inner.capacity {
            if !st.evict_lru() {
                break;
            }
        }
        st.next_ins += 1;
        let ins = st.next_ins;
        st.by_expiry.insert((expires, ins), key.to_string());
        st.entries.insert(
            key.to_string(),
            Entry {
                response: response.clone(),
                expires,
                ins,
            },
        );
        Ok(())
    }
}
