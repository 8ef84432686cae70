//! [`MemoryCache`]: the in-process response cache (SPEC §10) — bounded, with a TTL per
//! entry and least-recently-used eviction.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use polygw_core::error::CacheError;
use polygw_core::ports::{Clock, ResponseCache};
use polygw_core::response::LlmResponse;

use crate::lock;

/// A bounded in-process [`ResponseCache`]: at most `capacity` entries, each fresh for the
/// TTL it was stored with; when full, the least recently used entry goes first (expired
/// entries go before any live one). Cheap to clone (shared state).
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
    /// Position in the recency order.
    seq: u64,
    /// Insertion number (unique), for the expiry index.
    ins: u64,
}

#[derive(Default)]
struct State {
    entries: HashMap<String, Entry>,
    /// seq → key, least recently used first.
    order: BTreeMap<u64, String>,
    /// (expiry, insertion number) → key, soonest first.
    by_expiry: BTreeMap<(Instant, u64), String>,
    next_seq: u64,
}

impl State {
    fn touch(&mut self, key: &str) {
        self.next_seq += 1;
        let seq = self.next_seq;
        if let Some(e) = self.entries.get_mut(key) {
            self.order.remove(&e.seq);
            e.seq = seq;
            self.order.insert(seq, key.to_string());
        }
    }

    fn remove(&mut self, key: &str) {
        if let Some(e) = self.entries.remove(key) {
            self.order.remove(&e.seq);
            self.by_expiry.remove(&(e.expires, e.ins));
        }
    }

    fn purge_expired(&mut self, now: Instant) {
        while let Some(entry) = self.by_expiry.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let key = entry.remove();
            if let Some(e) = self.entries.remove(&key) {
                self.order.remove(&e.seq);
            }
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
                state: Mutex::new(State::default()),
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
        match st.entries.get(key) {
            None => Ok(None),
            Some(e) if e.expires <= now => {
                st.remove(key);
                Ok(None)
            }
            Some(e) => {
                let response = e.response.clone();
                st.touch(key);
                Ok(Some(response))
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
            let Some((_, oldest)) = st.order.pop_first() else {
                break;
            };
            if let Some(e) = st.entries.remove(&oldest) {
                st.by_expiry.remove(&(e.expires, e.ins));
            }
        }
        st.next_seq += 1;
        let seq = st.next_seq;
        st.order.insert(seq, key.to_string());
        st.by_expiry.insert((expires, seq), key.to_string());
        st.entries.insert(
            key.to_string(),
            Entry {
                response: response.clone(),
                expires,
                seq,
                ins: seq,
            },
        );
        Ok(())
    }
}
