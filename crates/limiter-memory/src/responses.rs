//! [`MemoryResponseStore`]: stored OpenAI Responses (SPEC §18.1, §24.5) for a scope
//! without a telemetry database — bounded per owner (`RESPONSES__MAX_BYTES_PER_KEY`,
//! the owner's entries that expire soonest leave first) and in total (a put that only
//! another owner's entries could make room for is refused), expired entries purged
//! lazily.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex, Weak};

use async_trait::async_trait;
use polygw_core::ports::store::MAX_TURNS;
use polygw_core::ports::{entry_bytes, ResponseStore, StoredResponse};
use polygw_core::TelemetryError;
use serde_json::Value;

use crate::lock;

pub use polygw_core::ports::store::ENTRY_OVERHEAD;

/// The bounds of a [`MemoryResponseStore`] as a whole (each owner's own bound is the
/// `max_bytes` of its puts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseStoreLimits {
    /// Entries held at most (default 100 000); 0 stores nothing.
    pub max_entries: usize,
    /// Bytes held at most (default 256 MiB), as
    /// [`polygw_core::ports::entry_bytes`] counts them. A put that would exceed this
    /// evicts only entries of its own owner; when those are not enough, it is refused:
    /// no owner's entries leave for another's.
    pub max_bytes: u64,
}

impl Default for ResponseStoreLimits {
    fn default() -> Self {
        ResponseStoreLimits {
            max_entries: 100_000,
            max_bytes: 256 << 20,
        }
    }
}

/// One entry: the JSON text (shared, so a `get` copies nothing under the lock).
struct Entry {
    response: Arc<str>,
    input_items: Arc<str>,
    previous_id: Option<String>,
    created_at_ms: i64,
    expires_at_ms: i64,
    bytes: u64,
    /// Insertion number (unique), for the expiry indexes.
    seq: u64,
}

/// One owner's entries.
#[derive(Default)]
struct Owner {
    entries: HashMap<String, Entry>,
    /// (expires_at_ms, seq) → id, soonest first: the owner's eviction order.
    by_expiry: BTreeMap<(i64, u64), String>,
    bytes: u64,
}

#[derive(Default)]
struct State {
    owners: HashMap<String, Owner>,
    /// (expires_at_ms, seq) → (owner, id), soonest first: the purge order.
    by_expiry: BTreeMap<(i64, u64), (String, String)>,
    bytes: u64,
    len: usize,
    next_seq: u64,
}

impl State {
    /// Removes `owner`'s entry `id`; whether it was there.
    fn remove(&mut self, owner: &str, id: &str) -> bool {
        let Some(o) = self.owners.get_mut(owner) else {
            return false;
        };
        let Some(e) = o.entries.remove(id) else {
            return false;
        };
        o.by_expiry.remove(&(e.expires_at_ms, e.seq));
        o.bytes -= e.bytes;
        if o.entries.is_empty() {
            self.owners.remove(owner);
        }
        self.by_expiry.remove(&(e.expires_at_ms, e.seq));
        self.bytes -= e.bytes;
        self.len -= 1;
        true
    }

    /// Removes every entry expired at `now_ms` (each entry is purged once: amortised
    /// O(log n) per entry).
    fn purge_expired(&mut self, now_ms: i64) {
        while let Some((&(at, _), (owner, id))) = self.by_expiry.first_key_value() {
            if at > now_ms {
                break;
            }
            let (owner, id) = (owner.clone(), id.clone());
            self.remove(&owner, &id);
        }
    }

    /// Removes `owner`'s entry that expires soonest; whether there was one.
    fn evict_soonest(&mut self, owner: &str) -> bool {
        let id = self
            .owners
            .get(owner)
            .and_then(|o| o.by_expiry.first_key_value())
            .map(|(_, id)| id.clone());
        id.is_some_and(|id| self.remove(owner, &id))
    }

    /// Moves the expiry of the live turns `from` continues (within `owner`) to `until`
    /// where that is later.
    fn renew_chain(&mut self, owner: &str, from: Option<&str>, now_ms: i64, until: i64) {
        let Some(o) = self.owners.get_mut(owner) else {
            return;
        };
        let mut next = from.map(str::to_string);
        let mut steps = 0;
        while let Some(id) = next.take() {
            steps += 1;
            if steps > MAX_TURNS {
                break;
            }
            let Some(e) = o.entries.get_mut(&id) else {
                break;
            };
            if e.expires_at_ms <= now_ms {
                break;
            }
            next = e.previous_id.clone();
            if e.expires_at_ms >= until {
                continue;
            }
            o.by_expiry.remove(&(e.expires_at_ms, e.seq));
            let ids = self
                .by_expiry
                .remove(&(e.expires_at_ms, e.seq))
                .expect("every entry is indexed");
            e.expires_at_ms = until;
            o.by_expiry.insert((until, e.seq), id);
            self.by_expiry.insert((until, e.seq), ids);
        }
    }
}

/// A bounded in-process [`ResponseStore`] (SPEC §18.1, §24.5: the store of a scope
/// without a telemetry database).
///
/// - Each owner (`StoredResponse::scope`: the scope, and the client key that stored the
///   entry) holds at most the `max_bytes` of its puts; when a put would exceed it, that
///   owner's entries that expire soonest leave first (a conversation in use is renewed
///   by each turn, so these are the least recently used).
/// - The whole store holds at most [`ResponseStoreLimits`]; a put that would exceed it
///   evicts only its own owner's entries, and is refused when those are not enough.
/// - Entries past their `expires_at_ms` are never returned and are purged lazily (by
///   `put`, at the new entry's `created_at_ms`, and by `get`, at its `now_ms`).
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
        lock(&self.state).len
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held now, as [`ResponseStoreLimits::max_bytes`] counts them.
    pub fn bytes(&self) -> u64 {
        lock(&self.state).bytes
    }

    /// Bytes `owner` holds now.
    pub fn owner_bytes(&self, owner: &str) -> u64 {
        lock(&self.state).owners.get(owner).map_or(0, |o| o.bytes)
    }
}

#[async_trait]
impl ResponseStore for MemoryResponseStore {
    async fn put(&self, r: StoredResponse, max_bytes: u64) -> Result<(), TelemetryError> {
        let bad = |e: serde_json::Error| {
            TelemetryError(format!("response {:?} cannot be stored: {e}", r.id))
        };
        let response: Arc<str> = serde_json::to_string(&r.response).map_err(bad)?.into();
        let input_items: Arc<str> = serde_json::to_string(&r.input_items).map_err(bad)?.into();
        let bytes = entry_bytes(&r, response.len(), input_items.len());
        let limits = self.limits;
        if bytes > max_bytes {
            return Err(TelemetryError(format!(
                "response {:?} ({bytes} bytes) is larger than RESPONSES__MAX_BYTES_PER_KEY \
                 ({max_bytes} bytes); not stored",
                r.id
            )));
        }
        if limits.max_entries == 0 || bytes > limits.max_bytes {
            return Err(TelemetryError(format!(
                "response {:?} ({bytes} bytes) does not fit the in-process response store \
                 ({} entries, {} bytes at most)",
                r.id, limits.max_entries, limits.max_bytes
            )));
        }
        let mut st = lock(&self.state);
        st.purge_expired(r.created_at_ms);
        let mine = st.owners.get(&r.scope);
        let (held, held_len) = mine.map_or((0, 0), |o| (o.bytes, o.entries.len()));
        // What the whole store would need freed, from this owner's entries only (the
        // entry it replaces counts as freed).
        let others = st.bytes - held;
        let others_len = st.len - held_len;
        if others + bytes > limits.max_bytes || others_len + 1 > limits.max_entries {
            return Err(TelemetryError(format!(
                "response {:?} ({bytes} bytes) does not fit the in-process response store: \
                 other keys hold {others} of its {} bytes ({others_len} of its {} \
                 entries), and no key's responses are evicted for another's",
                r.id, limits.max_bytes, limits.max_entries
            )));
        }
        st.remove(&r.scope, &r.id);
        st.renew_chain(
            &r.scope,
            r.previous_id.as_deref(),
            r.created_at_ms,
            r.expires_at_ms,
        );
        let cap = max_bytes.min(limits.max_bytes - others);
        let cap_len = limits.max_entries - others_len;
        loop {
            let (b, n) = st
                .owners
                .get(&r.scope)
                .map_or((0, 0), |o| (o.bytes, o.entries.len()));
            if b + bytes <= cap && n < cap_len {
                break;
            }
            if !st.evict_soonest(&r.scope) {
                break;
            }
        }
        st.next_seq += 1;
        let seq = st.next_seq;
        st.by_expiry
            .insert((r.expires_at_ms, seq), (r.scope.clone(), r.id.clone()));
        st.bytes += bytes;
        st.len += 1;
        let o = st.owners.entry(r.scope).or_default();
        o.by_expiry.insert((r.expires_at_ms, seq), r.id.clone());
        o.bytes += bytes;
        o.entries.insert(
            r.id,
            Entry {
                response,
                input_items,
                previous_id: r.previous_id,
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
            st.owners
                .get(scope)
                .and_then(|o| o.entries.get(id))
                .and_then(|e| {
                    (e.expires_at_ms > now_ms).then(|| {
                        (
                            e.response.clone(),
                            e.input_items.clone(),
                            e.previous_id.clone(),
                            e.created_at_ms,
                            e.expires_at_ms,
                        )
                    })
                })
        };
        let Some((response, items, previous_id, created_at_ms, expires_at_ms)) = found else {
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
            previous_id,
            created_at_ms,
            expires_at_ms,
        }))
    }

    async fn delete(&self, scope: &str, id: &str) -> Result<bool, TelemetryError> {
        Ok(lock(&self.state).remove(scope, id))
    }
}

type Registry = Mutex<HashMap<String, Weak<MemoryResponseStore>>>;

static REGISTRY: LazyLock<Registry> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// The process-wide response store of scope `scope`, with the default bounds (100 000
/// entries, 256 MiB): every client of that scope in this process shares it, so a response
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
