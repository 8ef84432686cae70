//! [`MemoryResponseStore`]: stored OpenAI Responses (SPEC §18.1) for a scope without a
//! telemetry database — bounded in entries and bytes, oldest evicted first, expired
//! entries purged lazily.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex, Weak};

use async_trait::async_trait;
use hashlink::LinkedHashMap;
use polygw_core::ports::{ResponseStore, StoredResponse};
use polygw_core::TelemetryError;
use serde_json::Value;

use crate::lock;

/// Bytes counted for an entry besides its JSON text and key (map and index nodes, string
/// headers), so that many tiny entries are bounded too.
pub const ENTRY_OVERHEAD: usize = 160;

/// The bounds of a [`MemoryResponseStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseStoreLimits {
    /// Entries held at most (default 10 000); 0 stores nothing.
    pub max_entries: usize,
    /// Bytes held at most (default 64 MiB): the JSON text of each response and its input
    /// items, its scope and id, and [`ENTRY_OVERHEAD`]. A single entry larger than this
    /// is refused (`put` fails).
    pub max_bytes: usize,
}

impl Default for ResponseStoreLimits {
    fn default() -> Self {
        ResponseStoreLimits {
            max_entries: 10_000,
            max_bytes: 64 << 20,
        }
    }
}

/// One entry: the JSON text (shared, so a `get` copies nothing under the lock).
struct Entry {
    response: Arc<str>,
    input_items: Arc<str>,
    created_at_ms: i64,
    expires_at_ms: i64,
    bytes: usize,
    /// Insertion number (unique), for the expiry index.
    seq: u64,
}

#[derive(Default)]
struct State {
    /// Entries by key, in insertion order (oldest first: the eviction order).
    entries: LinkedHashMap<String, Entry>,
    /// (expires_at_ms, seq) → key, soonest first.
    by_expiry: BTreeMap<(i64, u64), String>,
    bytes: usize,
    next_seq: u64,
}

impl State {
    fn remove(&mut self, key: &str) -> bool {
        match self.entries.remove(key) {
            Some(e) => {
                self.forget(&e);
                true
            }
            None => false,
        }
    }

    fn forget(&mut self, e: &Entry) {
        self.by_expiry.remove(&(e.expires_at_ms, e.seq));
        self.bytes -= e.bytes;
    }

    /// Removes every entry expired at `now_ms` (each entry is purged once: amortised
    /// O(log n) per entry).
    fn purge_expired(&mut self, now_ms: i64) {
        while let Some(first) = self.by_expiry.first_entry() {
            if first.key().0 > now_ms {
                break;
            }
            let key = first.remove();
            if let Some(e) = self.entries.remove(&key) {
                self.bytes -= e.bytes;
            }
        }
    }

    fn evict_oldest(&mut self) -> bool {
        match self.entries.pop_front() {
            Some((_, e)) => {
                self.forget(&e);
                true
            }
            None => false,
        }
    }
}

/// A bounded in-process [`ResponseStore`] (SPEC §18.1, the store of a scope without a
/// telemetry database): at most [`ResponseStoreLimits::max_entries`] entries and
/// [`ResponseStoreLimits::max_bytes`] bytes; when a `put` would exceed either, the oldest
/// entries (by the time they were put) leave first, after any that expired. Entries past
/// their `expires_at_ms` are never returned and are purged lazily (by `put`, at the new
/// entry's `created_at_ms`, and by `get`, at its `now_ms`).
///
/// The response and its input items are kept as JSON text (what the byte bound counts,
/// and several times smaller than parsed values) and parsed on `get`: values come back
/// equal, as from the SQL store. One mutex guards the state, held for map operations
/// only (serialising and parsing happen outside it).
///
/// [`crate::shared_responses`] gives the process-wide store of a scope.
pub struct MemoryResponseStore {
    limits: ResponseStoreLimits,
    state: Mutex<State>,
}

impl fmt::Debug for MemoryResponseStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryResponseStore")
            .field("limits", &self.limits)
            .field("len", &self.len())
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl Default for MemoryResponseStore {
    fn default() -> Self {
        Self::new(ResponseStoreLimits::default())
    }
}

/// The map key of (scope, id): unambiguous (the scope's length first).
fn key(scope: &str, id: &str) -> String {
    format!("{}:{scope}{id}", scope.len())
}

impl MemoryResponseStore {
    /// An empty store with these bounds.
    pub fn new(limits: ResponseStoreLimits) -> Self {
        MemoryResponseStore {
            limits,
            state: Mutex::new(State::default()),
        }
    }

    /// Its bounds.
    pub fn limits(&self) -> ResponseStoreLimits {
        self.limits
    }

    /// Entries held now (expired ones included until purged).
    pub fn len(&self) -> usize {
        lock(&self.state).entries.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held now, as [`ResponseStoreLimits::max_bytes`] counts them.
    pub fn bytes(&self) -> usize {
        lock(&self.state).bytes
    }
}

#[async_trait]
impl ResponseStore for MemoryResponseStore {
    async fn put(&self, r: StoredResponse) -> Result<(), TelemetryError> {
        let bad = |e: serde_json::Error| {
            TelemetryError(format!("response {:?} cannot be stored: {e}", r.id))
        };
        let response: Arc<str> = serde_json::to_string(&r.response).map_err(bad)?.into();
        let input_items: Arc<str> = serde_json::to_string(&r.input_items).map_err(bad)?.into();
        let k = key(&r.scope, &r.id);
        let bytes = k.len() + response.len() + input_items.len() + ENTRY_OVERHEAD;
        let limits = self.limits;
        if limits.max_entries == 0 || bytes > limits.max_bytes {
            return Err(TelemetryError(format!(
                "response {:?} ({bytes} bytes) does not fit the in-process response store \
                 ({} entries, {} bytes at most)",
                r.id, limits.max_entries, limits.max_bytes
            )));
        }
        let mut st = lock(&self.state);
        st.remove(&k);
        st.purge_expired(r.created_at_ms);
        while st.entries.len() >= limits.max_entries || st.bytes + bytes > limits.max_bytes {
            if !st.evict_oldest() {
                break;
            }
        }
        st.next_seq += 1;
        let seq = st.next_seq;
        st.by_expiry.insert((r.expires_at_ms, seq), k.clone());
        st.bytes += bytes;
        st.entries.insert(
            k,
            Entry {
                response,
                input_items,
                created_at_ms: r.created_at_ms,
                expires_at_ms: r.expires_at_ms,
                bytes,
                seq,
            },
        );
        Ok(())
    }

    async fn get(
        &self,
        scope: &str,
        id: &str,
        now_ms: i64,
    ) -> Result<Option<StoredResponse>, TelemetryError> {
        let found = {
            let mut st = lock(&self.state);
            st.purge_expired(now_ms);
            st.entries.get(&key(scope, id)).and_then(|e| {
                (e.expires_at_ms > now_ms).then(|| {
                    (
                        e.response.clone(),
                        e.input_items.clone(),
                        e.created_at_ms,
                        e.expires_at_ms,
                    )
                })
            })
        };
        let Some((response, items, created_at_ms, expires_at_ms)) = found else {
            return Ok(None);
        };
        let bad = |what: &str, e: serde_json::Error| {
            TelemetryError(format!(
                "stored response {id:?}: {what} does not parse: {e}"
            ))
        };
        Ok(Some(StoredResponse {
            id: id.to_string(),
            scope: scope.to_string(),
            response: serde_json::from_str::<Value>(&response).map_err(|e| bad("response", e))?,
            input_items: serde_json::from_str::<Vec<Value>>(&items)
                .map_err(|e| bad("input_items", e))?,
            created_at_ms,
            expires_at_ms,
        }))
    }

    async fn delete(&self, scope: &str, id: &str) -> Result<bool, TelemetryError> {
        Ok(lock(&self.state).remove(&key(scope, id)))
    }
}

type Registry = Mutex<HashMap<String, Weak<MemoryResponseStore>>>;

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// The process-wide response store of scope `scope`, with the default bounds (10 000
/// entries, 64 MiB): every client of that scope in this process shares it, so a response
/// stored through one is found through another. It lives while some handle of it does.
pub fn shared_responses(scope: &str) -> Arc<MemoryResponseStore> {
    shared_responses_with(scope, ResponseStoreLimits::default())
}

/// [`shared_responses`] with other bounds: they apply when this call creates the scope's
/// store; an existing store keeps the bounds it was created with.
pub fn shared_responses_with(scope: &str, limits: ResponseStoreLimits) -> Arc<MemoryResponseStore> {
    let mut reg = lock(&REGISTRY);
    reg.retain(|_, w| w.strong_count() > 0);
    if let Some(s) = reg.get(scope).and_then(Weak::upgrade) {
        return s;
    }
    let s = Arc::new(MemoryResponseStore::new(limits));
    reg.insert(scope.to_string(), Arc::downgrade(&s));
    s
}
