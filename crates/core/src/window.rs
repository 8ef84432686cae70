//! The limiter's semantics as a pure model on millisecond timestamps (SPEC §4.2, §14.3,
//! §14.4): rolling 60 s windows of requests and tokens per source and per scope, and
//! leased in-flight slots. The memory backend runs it as is; the Redis Lua scripts mirror
//! it; the contract suite and the proptests use it as the reference.
//!
//! - **Requests** (RPM): a request admitted at `t` counts in every window with
//!   `now < t + 60 s`.
//! - **Tokens** (TPM): an admission reserves its estimate. The reservation counts from
//!   admission until it is settled, however long the call takes; settled, it becomes the
//!   settled amount, counted from the settlement time for the next 60 s. A reservation is a
//!   lease: renewed while its holder is alive ([`WindowLimiter::renew`], the heartbeat),
//!   and if it is never settled it is taken as settled at its estimate when the lease ends
//!   (a crashed holder's tokens were probably billed), so it counts until lease end + 60 s.
//! - **Slots** (concurrency): an admission takes an in-flight slot until it is released
//!   or its lease ends; the heartbeat renews live leases. A lease that ended is never
//!   revived by a late renewal (its slot may have been given to someone else).
//!
//! Time never goes backwards inside the model: every operation first raises its clock to
//! the latest `now` it has seen, so callers reading a clock outside a lock cannot create
//! out-of-order entries.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Duration;

use crate::error::RefusalReason;
use crate::ports::limiter::{AcquireRequest, Refusal};

/// Length of the rolling window.
pub const WINDOW_MS: u64 = 60_000;

/// A hasher for the model's own permit ids (sequential `u64`s it hands out itself, so
/// never chosen by an adversary): one multiplication instead of SipHash on the hot path.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        // FxHash's mixing, a word at a time.
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: the high bits (hashbrown's control bytes) and the low bits
        // (its bucket index) both vary with sequential ids.
        self.0 = (self.0 ^ n)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(26);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by permit ids.
pub type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// The requests of one window (RPM), in admission order.
#[derive(Debug, Default, Clone)]
pub(crate) struct Requests {
    /// (admission ms, requests admitted in that ms), strictly increasing times.
    at: VecDeque<(u64, u64)>,
    n: u64,
}

impl Requests {
    pub(crate) fn prune(&mut self, now: u64) {
        while let Some(&(t, c)) = self.at.front() {
            if t + WINDOW_MS > now {
                break;
            }
            self.at.pop_front();
            self.n -= c;
        }
    }

    pub(crate) fn push(&mut self, now: u64) {
        match self.at.back_mut() {
            Some((t, c)) if *t == now => *c += 1,
            _ => self.at.push_back((now, 1)),
        }
        self.n += 1;
    }

    pub(crate) fn count(&self) -> u64 {
        self.n
    }

    /// Whether no request is in the window's buffer.
    pub(crate) fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// ms until `count - limit + 1` requests have left the window.
    pub(crate) fn hint(&self, now: u64, limit: u64) -> Option<u64> {
        let idx = (self.count() + 1).checked_sub(limit)?.checked_sub(1)?;
        let mut cum = 0;
        for &(t, c) in &self.at {
            cum += c;
            if cum > idx {
                return Some((t + WINDOW_MS).saturating_sub(now).max(1));
            }
        }
        None
    }
}

/// The tokens of one window (TPM): reservations (until settled or their lease ends, then
/// one more window) and settlements (one window from settlement).
#[derive(Debug, Default, Clone)]
pub(crate) struct Tokens {
    /// Unsettled reservations: id → (lease end, tokens).
    reserved: IdMap<(u64, u64)>,
    /// (lease end, id) of the reservations: they count until lease end + window.
    reserved_by_end: BTreeSet<(u64, u64)>,
    /// (settled at, id, tokens), in settlement order — which is time order, since the
    /// model's clock never goes back: they count until settled at + window.
    settled: VecDeque<(u64, u64)>,
    pub(crate) total: u64,
}

impl Tokens {
    pub(crate) fn prune(&mut self, now: u64) {
        while let Some(&(end, id)) = self.reserved_by_end.first() {
            if end + WINDOW_MS > now {
                break;
            }
            self.reserved_by_end.pop_first();
            if let Some((_, t)) = self.reserved.remove(&id) {
                self.total -= t;
            }
        }
        while let Some(&(at, t)) = self.settled.front() {
            if at + WINDOW_MS > now {
                break;
            }
            self.settled.pop_front();
            self.total -= t;
        }
    }

    pub(crate) fn reserve(&mut self, id: u64, end: u64, tokens: u64) {
        self.reserved.insert(id, (end, tokens));
        self.reserved_by_end.insert((end, id));
        self.total += tokens;
    }

    /// Settles a reservation still in the window: it counts `tokens` from `now`.
    pub(crate) fn settle(&mut self, now: u64, id: u64, tokens: u64) {
        if let Some((end, old)) = self.reserved.remove(&id) {
            self.reserved_by_end.remove(&(end, id));
            self.total = self.total - old + tokens;
            match self.settled.back_mut() {
                Some((at, t)) if *at == now => *t += tokens,
                _ => self.settled.push_back((now, tokens)),
            }
        }
    }

    /// Extends a reservation whose lease has not ended.
    pub(crate) fn renew(&mut self, now: u64, id: u64, until: u64) {
        if let Some((end, _)) = self.reserved.get_mut(&id) {
            if *end > now && until > *end {
                self.reserved_by_end.remove(&(*end, id));
                *end = until;
                self.reserved_by_end.insert((until, id));
            }
        }
    }

    /// ms until `total + est ≤ limit`, assuming nothing is settled meanwhile and no lease
    /// is renewed (so an upper bound while reservations are alive), if that can happen.
    pub(crate) fn hint(&self, now: u64, limit: u64, est: u64) -> Option<u64> {
        if est > limit {
            return None;
        }
        let mut res = self
            .reserved_by_end
            .iter()
            .map(|&(end, id)| (end + WINDOW_MS, self.reserved[&id].1))
            .peekable();
        let mut set = self
            .settled
            .iter()
            .map(|&(at, t)| (at + WINDOW_MS, t))
            .peekable();
        let mut remaining = self.total;
        loop {
            let next = match (res.peek(), set.peek()) {
                (Some(a), Some(b)) if a.0 <= b.0 => res.next(),
                (Some(_), Some(_)) => set.next(),
                (Some(_), None) => res.next(),
                (None, Some(_)) => set.next(),
                (None, None) => return None,
            };
            let (expiry, tokens) = next?;
            remaining -= tokens;
            if remaining + est <= limit {
                return Some(expiry.saturating_sub(now).max(1));
            }
        }
    }

    /// Whether nothing is counted (no reservation, no settlement in the window).
    pub(crate) fn is_empty(&self) -> bool {
        self.reserved.is_empty() && self.settled.is_empty()
    }

    fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.reserved.keys().copied()
    }

    pub(crate) fn holds(&self, id: u64) -> bool {
        self.reserved.contains_key(&id)
    }
}

#[derive(Debug, Default, Clone)]
struct Window {
    requests: Requests,
    tokens: Tokens,
}

impl Window {
    fn prune(&mut self, now: u64) {
        self.requests.prune(now);
        self.tokens.prune(now);
    }

    fn is_empty(&self) -> bool {
        self.requests.at.is_empty()
            && self.tokens.reserved.is_empty()
            && self.tokens.settled.is_empty()
    }
}

#[derive(Debug, Default, Clone)]
struct SourceState {
    window: Window,
    /// permit id → lease end.
    in_flight: IdMap<u64>,
}

impl SourceState {
    fn prune_leases(&mut self, now: u64) {
        self.in_flight.retain(|_, until| *until > now);
    }

    fn is_empty(&self) -> bool {
        self.window.is_empty() && self.in_flight.is_empty()
    }
}

/// Slots addressed by a small index, with a free list: names are looked up once per
/// acquire (by `&str`, no allocation) and permits remember indices, not names.
#[derive(Debug, Clone)]
struct Slab<T> {
    slots: Vec<Option<T>>,
    free: Vec<u32>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            slots: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> Slab<T> {
    fn insert(&mut self, v: T) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(v);
                i
            }
            None => {
                self.slots.push(Some(v));
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 names")
            }
        }
    }

    fn get(&self, i: u32) -> Option<&T> {
        self.slots.get(i as usize)?.as_ref()
    }

    fn get_mut(&mut self, i: u32) -> Option<&mut T> {
        self.slots.get_mut(i as usize)?.as_mut()
    }

    fn remove(&mut self, i: u32) {
        if let Some(slot) = self.slots.get_mut(i as usize) {
            if slot.take().is_some() {
                self.free.push(i);
            }
        }
    }

    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|v| (i as u32, v)))
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = (u32, &mut T)> {
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| Some((i as u32, s.as_mut()?)))
    }
}

/// One scope: its window and its sources (interned by name).
#[derive(Debug, Default, Clone)]
struct ScopeState {
    name: String,
    window: Window,
    source_ids: HashMap<String, u32>,
    sources: Slab<(String, SourceState)>,
}

impl ScopeState {
    fn source_mut(&mut self, source: &str) -> Option<&mut SourceState> {
        let i = *self.source_ids.get(source)?;
        self.sources.get_mut(i).map(|s| &mut s.1)
    }
}

/// Where a permit's state is: (scope slot, source slot).
type Place = (u32, u32);

/// Permit id → place. Ids are handed out in sequence, so the recent ones live in a deque
/// indexed by `id - base` (an insert is a push, a lookup an index: no hashing, no probing
/// of a large table); compaction moves the few old permits still alive behind the front
/// into a small map, so one long call never pins the deque's memory.
#[derive(Debug, Default, Clone)]
struct Permits {
    base: u64,
    recent: VecDeque<Option<Place>>,
    old: IdMap<Place>,
}

impl Permits {
    fn insert(&mut self, id: u64, place: Place) {
        if self.recent.is_empty() {
            self.base = id;
        }
        // Ids only grow: fill any gap (never happens: one id per acquire) and push.
        while self.base + (self.recent.len() as u64) < id {
            self.recent.push_back(None);
        }
        self.recent.push_back(Some(place));
    }

    /// Forgets a permit that holds nothing any more.
    fn remove(&mut self, id: u64) {
        match id.checked_sub(self.base) {
            Some(i) => {
                if let Some(slot) = self.recent.get_mut(i as usize) {
                    *slot = None;
                }
                while let Some(None) = self.recent.front() {
                    self.recent.pop_front();
                    self.base += 1;
                }
            }
            None => {
                self.old.remove(&id);
            }
        }
    }

    fn get(&self, id: u64) -> Option<Place> {
        match id.checked_sub(self.base) {
            Some(i) => self.recent.get(usize::try_from(i).ok()?).copied().flatten(),
            None => self.old.get(&id).copied(),
        }
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.old.is_empty() && self.recent.iter().all(Option::is_none)
    }

    /// Keeps the permits `live` says are alive; bounds the deque to the span from the
    /// oldest recent permit alive, moving older live ones to the map when they are few.
    fn retain(&mut self, live: impl Fn(u64) -> bool) {
        self.old.retain(|id, _| live(*id));
        let base = self.base;
        for (i, slot) in self.recent.iter_mut().enumerate() {
            if slot.is_some() && !live(base + i as u64) {
                *slot = None;
            }
        }
        // Move live entries out of the front half to the map while they are sparse.
        let half = self.recent.len() / 2;
        let alive_front = self
            .recent
            .iter()
            .take(half)
            .filter(|s| s.is_some())
            .count();
        if alive_front <= half / 8 {
            for _ in 0..half {
                let id = self.base;
                if let Some(Some(place)) = self.recent.pop_front() {
                    self.old.insert(id, place);
                }
                self.base += 1;
            }
        }
        while let Some(None) = self.recent.front() {
            self.recent.pop_front();
            self.base += 1;
        }
    }
}

/// The reference limiter. Not thread-safe by itself: wrap it in a mutex.
///
/// Scope and source names are interned: an acquire looks them up by `&str` and a permit
/// remembers slot indices, so the hot path allocates nothing once a name is known (and
/// the windows' buffers have grown).
#[derive(Debug, Default, Clone)]
pub struct WindowLimiter {
    scope_ids: HashMap<String, u32>,
    scopes: Slab<ScopeState>,
    /// permit id → where its source is, for settlements, releases and renewals.
    permits: Permits,
    /// The place of the latest acquire (checked by name before use).
    last: Option<Place>,
    next_id: u64,
    /// The latest time seen: the model's clock never goes back.
    clock: u64,
}

pub(crate) fn lease_ms(lease: Duration) -> u64 {
    u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl WindowLimiter {
    /// An empty limiter.
    pub fn new() -> Self {
        Self::default()
    }

    /// `now`, never earlier than a time already seen.
    fn tick(&mut self, now: u64) -> u64 {
        self.clock = self.clock.max(now);
        self.clock
    }

    /// The model's current time (the latest `now` it has seen).
    pub fn now(&self) -> u64 {
        self.clock
    }

    /// The slots of a scope and source, interned on first sight.
    fn place(&mut self, scope: &str, source: &str) -> Place {
        // Most acquires name the pair the previous one did: two string comparisons
        // instead of two hash lookups.
        if let Some((si, ri)) = self.last {
            if let Some(sc) = self.scopes.get(si) {
                if sc.name == scope && sc.sources.get(ri).is_some_and(|s| s.0 == source) {
                    return (si, ri);
                }
            }
        }
        let place = self.intern(scope, source);
        self.last = Some(place);
        place
    }

    fn intern(&mut self, scope: &str, source: &str) -> Place {
        let si = match self.scope_ids.get(scope) {
            Some(&i) => i,
            None => {
                let i = self.scopes.insert(ScopeState {
                    name: scope.to_string(),
                    ..ScopeState::default()
                });
                self.scope_ids.insert(scope.to_string(), i);
                i
            }
        };
        let sc = self.scopes.get_mut(si).expect("interned above");
        let ri = match sc.source_ids.get(source) {
            Some(&i) => i,
            None => {
                let i = sc
                    .sources
                    .insert((source.to_string(), SourceState::default()));
                sc.source_ids.insert(source.to_string(), i);
                i
            }
        };
        (si, ri)
    }

    fn scope_mut(&mut self, scope: &str) -> Option<&mut ScopeState> {
        let i = *self.scope_ids.get(scope)?;
        self.scopes.get_mut(i)
    }

    /// The scope and source states of a permit.
    fn states(&mut self, id: u64) -> Option<(&mut Window, &mut SourceState)> {
        let (si, ri) = self.permits.get(id)?;
        let sc = self.scopes.get_mut(si)?;
        let src = sc.sources.get_mut(ri)?;
        Some((&mut sc.window, &mut src.1))
    }

    /// Admits or refuses one request at `now`. On admission returns the permit id.
    pub fn acquire(&mut self, now: u64, req: &AcquireRequest<'_>) -> Result<u64, Refusal> {
        let now = self.tick(now);
        let (si, ri) = self.place(req.scope, req.source);
        let sc = self.scopes.get_mut(si).expect("interned");
        let src = &mut sc.sources.get_mut(ri).expect("interned").1;
        src.window.prune(now);
        let refuse = |reason, hint: Option<u64>| Refusal {
            reason,
            retry_after: hint.map(Duration::from_millis),
        };
        if req.max_concurrency > 0 && src.in_flight.len() as u64 >= req.max_concurrency as u64 {
            src.prune_leases(now);
            if src.in_flight.len() as u64 >= req.max_concurrency as u64 {
                // The earliest lease end: a release (or a renewal) may come sooner or later.
                let hint = src.in_flight.values().min().map(|u| u.saturating_sub(now));
                return Err(refuse(RefusalReason::Concurrency, hint));
            }
        }
        let w = &src.window;
        if req.rpm > 0 && w.requests.count() >= req.rpm as u64 {
            return Err(refuse(
                RefusalReason::Rpm,
                w.requests.hint(now, req.rpm as u64),
            ));
        }
        if req.tpm > 0 && w.tokens.total + req.est_tokens > req.tpm {
            return Err(refuse(
                RefusalReason::Tpm,
                w.tokens.hint(now, req.tpm, req.est_tokens),
            ));
        }
        let scope = &mut sc.window;
        scope.prune(now);
        if req.scope_rpm > 0 && scope.requests.count() >= req.scope_rpm as u64 {
            return Err(refuse(
                RefusalReason::ScopeRpm,
                scope.requests.hint(now, req.scope_rpm as u64),
            ));
        }
        if req.scope_tpm > 0 && scope.tokens.total + req.est_tokens > req.scope_tpm {
            return Err(refuse(
                RefusalReason::ScopeTpm,
                scope.tokens.hint(now, req.scope_tpm, req.est_tokens),
            ));
        }
        self.next_id += 1;
        let id = self.next_id;
        let end = now.saturating_add(lease_ms(req.lease));
        scope.requests.push(now);
        scope.tokens.reserve(id, end, req.est_tokens);
        let src = &mut sc.sources.get_mut(ri).expect("interned").1;
        src.window.requests.push(now);
        src.window.tokens.reserve(id, end, req.est_tokens);
        src.in_flight.insert(id, end);
        self.permits.insert(id, (si, ri));
        Ok(id)
    }

    /// Settles permit `id` at `now`: its reservation becomes `tokens`, counted from now for
    /// one window. Only the first settlement counts; a reservation that already left the
    /// window (its lease ended a window ago) is not revived.
    pub fn settle(&mut self, now: u64, id: u64, tokens: u64) {
        let now = self.tick(now);
        if let Some((scope, src)) = self.states(id) {
            src.window.tokens.prune(now);
            src.window.tokens.settle(now, id, tokens);
            scope.tokens.prune(now);
            scope.tokens.settle(now, id, tokens);
            if !src.in_flight.contains_key(&id) && !src.window.tokens.reserved.contains_key(&id) {
                self.permits.remove(id);
            }
        }
    }

    /// Frees permit `id`'s in-flight slot. Idempotent.
    pub fn release(&mut self, id: u64) {
        if let Some((_, src)) = self.states(id) {
            src.in_flight.remove(&id);
            if !src.window.tokens.reserved.contains_key(&id) {
                self.permits.remove(id);
            }
        }
    }

    /// The heartbeat: extends permit `id`'s slot and unsettled reservation to
    /// `now + lease`, each only if its lease has not ended (never shortens one).
    pub fn renew(&mut self, now: u64, id: u64, lease: Duration) {
        let now = self.tick(now);
        let until = now.saturating_add(lease_ms(lease));
        if let Some((scope, src)) = self.states(id) {
            if let Some(end) = src.in_flight.get_mut(&id) {
                if *end > now && until > *end {
                    *end = until;
                }
            }
            src.window.tokens.renew(now, id, until);
            scope.tokens.renew(now, id, until);
        }
    }

    /// In-flight count of a source at `now` (ended leases excluded).
    pub fn in_flight(&mut self, now: u64, scope: &str, source: &str) -> u32 {
        let now = self.tick(now);
        match self.scope_mut(scope).and_then(|sc| sc.source_mut(source)) {
            Some(s) => {
                s.prune_leases(now);
                s.in_flight.len() as u32
            }
            None => 0,
        }
    }

    /// (requests, tokens) in a source's window at `now`.
    pub fn source_window(&mut self, now: u64, scope: &str, source: &str) -> (u64, u64) {
        let now = self.tick(now);
        match self.scope_mut(scope).and_then(|sc| sc.source_mut(source)) {
            Some(s) => {
                s.window.prune(now);
                (s.window.requests.count(), s.window.tokens.total)
            }
            None => (0, 0),
        }
    }

    /// (requests, tokens) in a scope's window at `now`.
    pub fn scope_window(&mut self, now: u64, scope: &str) -> (u64, u64) {
        let now = self.tick(now);
        match self.scope_mut(scope) {
            Some(l) => {
                l.window.prune(now);
                (l.window.requests.count(), l.window.tokens.total)
            }
            None => (0, 0),
        }
    }

    /// Whether permit `id` still holds anything (a slot or tokens in a window) at `now`.
    pub fn holds(&mut self, now: u64, id: u64) -> bool {
        let now = self.tick(now);
        let Some((_, s)) = self.states(id) else {
            return false;
        };
        s.window.tokens.prune(now);
        s.prune_leases(now);
        s.in_flight.contains_key(&id) || s.window.tokens.holds(id)
    }

    /// Forgets settled, released permits whose entries left every window, and the names
    /// of sources and scopes that hold nothing (bounded memory).
    pub fn compact(&mut self, now: u64) {
        let now = self.tick(now);
        let mut live: HashSet<u64, BuildHasherDefault<IdHasher>> = HashSet::default();
        let mut empty_scopes = vec![];
        for (si, sc) in self.scopes.iter_mut() {
            sc.window.prune(now);
            let mut empty_sources = vec![];
            for (ri, (_, s)) in sc.sources.iter_mut() {
                s.window.prune(now);
                s.prune_leases(now);
                if s.is_empty() {
                    empty_sources.push(ri);
                } else {
                    live.extend(s.window.tokens.ids().chain(s.in_flight.keys().copied()));
                }
            }
            for ri in empty_sources {
                if let Some((name, _)) = sc.sources.get(ri) {
                    let name = name.clone();
                    sc.source_ids.remove(&name);
                }
                sc.sources.remove(ri);
            }
            if sc.window.is_empty() && sc.source_ids.is_empty() {
                empty_scopes.push(si);
            }
        }
        for si in empty_scopes {
            if let Some(sc) = self.scopes.get(si) {
                let name = sc.name.clone();
                self.scope_ids.remove(&name);
            }
            self.scopes.remove(si);
        }
        self.permits.retain(|id| live.contains(&id));
        // Give back what a burst grew: a deque keeps its capacity otherwise (the
        // memory of a past peak rate, never returned: issue 22, item 10).
        fn shrink<T>(d: &mut VecDeque<T>) {
            if d.capacity() > 4 * d.len().max(64) {
                d.shrink_to(d.len().max(64) * 2);
            }
        }
        shrink(&mut self.permits.recent);
        for (_, sc) in self.scopes.iter_mut() {
            shrink(&mut sc.window.requests.at);
            shrink(&mut sc.window.tokens.settled);
            for (_, (_, s)) in sc.sources.iter_mut() {
                shrink(&mut s.window.requests.at);
                shrink(&mut s.window.tokens.settled);
            }
        }
        self.last = None;
    }
}

impl WindowLimiter {
    /// Entries held in the windows and the permit table (tests: no growth with the
    /// number of calls).
    #[cfg(test)]
    fn footprint(&self) -> usize {
        let mut n = self.permits.recent.len() + self.permits.old.len();
        for (_, sc) in self.scopes.iter() {
            n += sc.window.requests.at.len() + sc.window.tokens.settled.len();
            for (_, (_, s)) in sc.sources.iter() {
                n += s.window.requests.at.len() + s.window.tokens.settled.len() + s.in_flight.len();
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The RPM hint waits for as many requests to leave as put the window over its limit
    /// — more than one when the limit was lowered below what the window holds (a reload).
    #[test]
    fn the_rpm_hint_waits_for_the_requests_over_a_lowered_limit() {
        let mut r = Requests::default();
        for t in [0, 10, 20] {
            r.push(t);
        }
        assert_eq!(r.count(), 3);
        assert_eq!(r.hint(30, 4), None, "room for one more");
        assert_eq!(r.hint(30, 3), Some(WINDOW_MS - 30), "the oldest leaves");
        assert_eq!(r.hint(30, 2), Some(WINDOW_MS + 10 - 30), "two must leave");
        assert_eq!(r.hint(30, 1), Some(WINDOW_MS + 20 - 30), "all three");
        r.push(20);
        assert_eq!(
            r.hint(30, 2),
            Some(WINDOW_MS + 20 - 30),
            "one ms, two requests"
        );
    }

    /// The TPM hint takes what leaves the window in expiry order, reservations and
    /// settlements merged; an estimate of exactly the limit waits for the window to empty;
    /// a lease renewed at the very ms it ends has ended (as for a source's slot).
    #[test]
    fn the_tpm_hint_merges_expiries_and_a_lease_ends_at_its_end() {
        let mut t = Tokens::default();
        t.reserve(1, 100, 5);
        t.reserve(2, 1_000, 5);
        t.settle(500, 2, 5);
        assert_eq!(t.total, 10);
        // the reservation (out at 100 + window) leaves before the settlement (500 + window)
        assert_eq!(t.hint(600, 10, 5), Some(WINDOW_MS + 100 - 600));
        assert_eq!(
            t.hint(600, 10, 10),
            Some(WINDOW_MS + 500 - 600),
            "all of it"
        );
        assert_eq!(t.hint(600, 10, 11), None, "never");
        t.renew(100, 1, 5_000);
        t.prune(WINDOW_MS + 100);
        assert!(!t.holds(1), "renewed at its end: not renewed");
        assert_eq!(t.total, 5);
        t.reserve(3, 200, 7);
        t.renew(199, 3, 5_000);
        t.prune(WINDOW_MS + 4_999);
        assert!(t.holds(3), "renewed before its end");
    }

    /// The id hasher's promise: sequential ids vary both the low bits (hashbrown's bucket
    /// index) and the high seven (its control bytes), and no two keys of a small dense
    /// set collide — as words, as two words, and as bytes (whole words and a remainder).
    #[test]
    fn the_id_hasher_spreads_dense_keys() {
        fn hash(f: impl FnOnce(&mut IdHasher)) -> u64 {
            let mut h = IdHasher::default();
            f(&mut h);
            h.finish()
        }
        let distinct = |v: Vec<u64>| v.iter().collect::<HashSet<_>>().len();
        let ids: Vec<u64> = (1..=4096u64).map(|n| hash(|h| h.write_u64(n))).collect();
        assert_eq!(distinct(ids.clone()), 4096);
        assert!(distinct(ids.iter().map(|x| x & 0xfff).collect()) > 2000);
        assert!(distinct(ids.iter().map(|x| x >> 57).collect()) > 100);
        let pairs: Vec<u64> = (0..64u64)
            .flat_map(|a| (0..64u64).map(move |b| (a, b)))
            .map(|(a, b)| {
                hash(|h| {
                    h.write_u64(a);
                    h.write_u64(b)
                })
            })
            .collect();
        assert_eq!(distinct(pairs), 4096);
        let words: Vec<u64> = (0..64u64)
            .flat_map(|a| (0..64u64).map(move |b| (a, b)))
            .map(|(a, b)| {
                let mut bytes = a.to_le_bytes().to_vec();
                bytes.extend(b.to_le_bytes());
                hash(|h| h.write(&bytes))
            })
            .collect();
        assert_eq!(distinct(words), 4096);
        let short: Vec<u64> = (0..=u16::MAX)
            .map(|n| hash(|h| h.write(&n.to_le_bytes())))
            .collect();
        assert_eq!(distinct(short), 65_536);
    }

    /// Issue 22, item 10 (SPEC §17.7, §22.2): what the limiter keeps does not grow with
    /// the number of calls — calls finished in one millisecond take one entry per
    /// window, whatever their number, and a finished permit is forgotten.
    #[test]
    fn memory_does_not_grow_with_the_calls() {
        let mut w = WindowLimiter::new();
        let r = req(0, 0, 0, 10);
        let run = |w: &mut WindowLimiter, n: u64, at: u64| {
            for _ in 0..n {
                let id = w.acquire(at, &r).unwrap();
                w.settle(at, id, 7);
                w.release(id);
            }
        };
        run(&mut w, 100_000, 1_000);
        let after_n = w.footprint();
        run(&mut w, 100_000, 1_000);
        let after_2n = w.footprint();
        assert!(after_n <= 8, "{after_n} entries after 100k calls in one ms");
        assert_eq!(after_n, after_2n, "no growth with the number of calls");
        // Spread over a window's milliseconds: bounded by the window's length.
        let mut w = WindowLimiter::new();
        for ms in 0..2_000u64 {
            run(&mut w, 10, 10_000 + ms);
        }
        let spread = w.footprint();
        assert!(spread <= 4 * 2_000 + 8, "{spread}");
    }

    fn req<'a>(rpm: u32, tpm: u64, conc: u32, est: u64) -> AcquireRequest<'a> {
        AcquireRequest {
            scope: "S",
            source: "a",
            rpm,
            tpm,
            max_concurrency: conc,
            scope_rpm: 0,
            scope_tpm: 0,
            est_tokens: est,
            lease: Duration::from_secs(90),
        }
    }

    /// A permit acts on its own scope's and source's state, whichever was interned first.
    #[test]
    fn a_permit_acts_on_its_own_source() {
        let mut l = WindowLimiter::new();
        let on = |scope, source| AcquireRequest {
            scope,
            source,
            ..req(0, 0, 1, 5)
        };
        let a = l.acquire(0, &on("S", "a")).unwrap();
        let b = l.acquire(0, &on("S", "b")).unwrap();
        let c = l.acquire(0, &on("T", "c")).unwrap();
        l.release(b);
        assert_eq!(l.in_flight(1, "S", "b"), 0, "b's slot is freed");
        assert_eq!(l.in_flight(1, "S", "a"), 1, "a's is not");
        l.acquire(1, &on("S", "b")).unwrap();
        l.release(c);
        assert_eq!(l.in_flight(1, "T", "c"), 0);
        assert!(l.holds(1, a));
        l.release(a);
        assert_eq!(l.in_flight(2, "S", "a"), 0);
    }

    #[test]
    fn rpm_window_and_hint() {
        let mut l = WindowLimiter::new();
        let r = req(2, 0, 0, 0);
        l.acquire(0, &r).unwrap();
        l.acquire(10_000, &r).unwrap();
        let e = l.acquire(20_000, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::Rpm);
        assert_eq!(e.retry_after, Some(Duration::from_millis(40_000)));
        assert!(l.acquire(59_999, &r).is_err());
        l.acquire(60_000, &r).unwrap();
    }

    #[test]
    fn tpm_reserve_then_settle_from_settlement_time() {
        let mut l = WindowLimiter::new();
        let r = req(0, 1000, 0, 400);
        let a = l.acquire(0, &r).unwrap();
        l.acquire(1, &r).unwrap();
        assert_eq!(l.acquire(2, &r).unwrap_err().reason, RefusalReason::Tpm);
        l.settle(2, a, 100); // 100 + 400 = 500 used
        l.acquire(3, &r).unwrap(); // 900
        let e = l.acquire(4, &r).unwrap_err();
        // The reservations' leases (90 s) end before nothing else: the settled 100 leaves
        // first (at 2 + 60 s), but 800 + 400 > 1000 still; then a reservation's lease end
        // plus a window.
        assert_eq!(
            e.retry_after,
            Some(Duration::from_millis(1 + 90_000 + 60_000 - 4))
        );
        // a second settlement changes nothing
        l.settle(5, a, 5000);
        assert_eq!(l.source_window(5, "S", "a"), (3, 900));
    }

    #[test]
    fn settlement_above_estimate_counts_a_window_from_settlement() {
        let mut l = WindowLimiter::new();
        let r = req(0, 1000, 0, 400);
        let a = l.acquire(0, &r).unwrap();
        l.settle(10_000, a, 5000);
        assert_eq!(l.source_window(10_000, "S", "a"), (1, 5000));
        let e = l.acquire(10_001, &r).unwrap_err();
        assert_eq!(e.retry_after, Some(Duration::from_millis(59_999)));
        assert!(l.acquire(69_999, &r).is_err());
        l.acquire(70_000, &r).unwrap();
    }

    /// SPEC §14.3: a call longer than the window keeps its reservation until it is
    /// settled (the old model let it leave the window after 60 s).
    #[test]
    fn long_calls_keep_their_reservation_until_settled() {
        let mut l = WindowLimiter::new();
        let r = AcquireRequest {
            lease: Duration::from_secs(30),
            ..req(0, 60_000, 0, 20_000)
        };
        let ids: Vec<u64> = (0..3).map(|i| l.acquire(i, &r).unwrap()).collect();
        let mut now = 0;
        // The calls last 65 s; the heartbeat renews their leases every 10 s.
        while now < 65_000 {
            now += 10_000;
            for &id in &ids {
                l.renew(now, id, r.lease);
            }
            assert_eq!(l.acquire(now, &r).unwrap_err().reason, RefusalReason::Tpm);
        }
        for &id in &ids {
            l.settle(now, id, 20_000);
        }
        assert!(l.acquire(now + WINDOW_MS - 1, &r).is_err());
        l.acquire(now + WINDOW_MS, &r).unwrap();
    }

    #[test]
    fn unsettled_reservation_of_a_dead_holder_counts_until_lease_end_plus_window() {
        let mut l = WindowLimiter::new();
        let r = AcquireRequest {
            lease: Duration::from_secs(30),
            ..req(0, 1000, 1, 600)
        };
        let _crashed = l.acquire(0, &r).unwrap();
        let e = l.acquire(1, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::Concurrency);
        assert_eq!(e.retry_after, Some(Duration::from_millis(29_999)));
        // The slot frees at the lease end; the tokens stay one more window.
        let e = l.acquire(30_000, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::Tpm);
        assert_eq!(e.retry_after, Some(Duration::from_millis(60_000)));
        l.acquire(90_000, &r).unwrap();
    }

    #[test]
    fn concurrency_and_leases() {
        let mut l = WindowLimiter::new();
        let r = AcquireRequest {
            lease: Duration::from_millis(500),
            ..req(0, 0, 1, 0)
        };
        let a = l.acquire(0, &r).unwrap();
        assert_eq!(
            l.acquire(1, &r).unwrap_err().reason,
            RefusalReason::Concurrency
        );
        l.release(a);
        l.release(a);
        let b = l.acquire(2, &r).unwrap();
        // renewed by its heartbeat, the lease outlives its first term
        l.renew(400, b, r.lease);
        assert_eq!(l.in_flight(800, "S", "a"), 1);
        assert!(l.acquire(850, &r).is_err());
        // a crashed holder's lease ends; a late renewal does not revive it
        assert_eq!(l.in_flight(900, "S", "a"), 0);
        l.renew(901, b, r.lease);
        assert_eq!(l.in_flight(902, "S", "a"), 0);
        l.acquire(903, &r).unwrap();
    }

    #[test]
    fn scope_limits_are_atomic_with_source() {
        let mut l = WindowLimiter::new();
        let mut a = req(0, 0, 0, 10);
        a.scope_rpm = 1;
        let mut b = a;
        b.source = "b";
        l.acquire(0, &a).unwrap();
        let e = l.acquire(0, &b).unwrap_err();
        assert_eq!(e.reason, RefusalReason::ScopeRpm);
        // the refused source recorded nothing
        assert_eq!(l.source_window(0, "S", "b"), (0, 0));
        let mut c = req(0, 0, 0, 600);
        c.scope_tpm = 1000;
        c.source = "c";
        l.acquire(1, &c).unwrap();
        let e = l.acquire(1, &c).unwrap_err();
        assert_eq!(e.reason, RefusalReason::ScopeTpm);
    }

    #[test]
    fn estimate_above_limit_has_no_hint() {
        let mut l = WindowLimiter::new();
        let e = l.acquire(0, &req(0, 100, 0, 200)).unwrap_err();
        assert_eq!((e.reason, e.retry_after), (RefusalReason::Tpm, None));
    }

    /// Compaction forgets only what left every window: settled tokens of a source whose
    /// requests left the window still count.
    #[test]
    fn compaction_keeps_tokens_still_counted() {
        let mut l = WindowLimiter::new();
        let r = req(0, 1000, 0, 400);
        let a = l.acquire(0, &r).unwrap();
        l.release(a);
        l.settle(59_000, a, 900);
        l.compact(61_000);
        assert_eq!(l.source_window(61_000, "S", "a"), (0, 900));
        assert!(l.acquire(61_001, &r).is_err());
        l.compact(119_000);
        l.acquire(119_000, &r).unwrap();
    }

    /// One long call does not pin the permit table: compaction moves it out of the
    /// deque of recent ids, and it still settles, renews and releases.
    #[test]
    fn a_long_call_does_not_pin_the_permit_table() {
        let mut l = WindowLimiter::new();
        let r = AcquireRequest {
            lease: Duration::from_secs(30),
            ..req(0, 0, 0, 10)
        };
        let long = l.acquire(0, &r).unwrap();
        let mut now = 0;
        for _ in 0..4 {
            for i in 0..1000 {
                now += 10;
                let id = l.acquire(now, &r).unwrap();
                l.settle(now, id, 10);
                l.release(id);
                if i % 100 == 0 {
                    l.renew(now, long, r.lease);
                }
            }
            // A window later (the heartbeat beating every 10 s), everything else is gone.
            for _ in 0..7 {
                now += 10_000;
                l.renew(now, long, r.lease);
            }
            l.compact(now);
        }
        assert!(l.permits.recent.len() < 1000, "{}", l.permits.recent.len());
        assert_eq!(l.permits.old.len(), 1);
        assert!(l.holds(now, long));
        assert_eq!(l.in_flight(now, "S", "a"), 1);
        l.settle(now, long, 5);
        l.release(long);
        assert_eq!(l.in_flight(now, "S", "a"), 0);
        assert_eq!(l.source_window(now, "S", "a"), (0, 5));
    }

    /// Names are interned in slots that compaction frees and later names reuse: a
    /// forgotten permit of a freed slot never touches the name that took the slot over.
    #[test]
    fn freed_slots_are_reused_without_crosstalk() {
        let mut l = WindowLimiter::new();
        let mut a = req(0, 1000, 1, 400);
        a.scope = "S1";
        let old = l.acquire(0, &a).unwrap();
        l.settle(1, old, 100);
        l.release(old);
        l.compact(WINDOW_MS + 2);
        assert!(l.scope_ids.is_empty() && l.permits.is_empty());
        assert!(l.permits.recent.is_empty(), "the deque is bounded");
        let mut b = req(0, 1000, 1, 400);
        b.scope = "S2";
        b.source = "b";
        let new = l.acquire(WINDOW_MS + 3, &b).unwrap();
        assert_eq!(l.scope_ids["S2"], 0, "slot 0 reused");
        l.settle(WINDOW_MS + 4, old, 999);
        l.release(old);
        l.renew(WINDOW_MS + 4, old, Duration::from_secs(1));
        assert_eq!(l.source_window(WINDOW_MS + 5, "S2", "b"), (1, 400));
        assert_eq!(l.in_flight(WINDOW_MS + 5, "S2", "b"), 1);
        assert_eq!(l.source_window(WINDOW_MS + 5, "S1", "a"), (0, 0));
        // several scopes and sources side by side keep their own windows
        let mut c = b;
        c.source = "c";
        l.acquire(WINDOW_MS + 6, &c).unwrap();
        assert_eq!(l.scope_window(WINDOW_MS + 6, "S2"), (2, 800));
        assert_eq!(l.source_window(WINDOW_MS + 6, "S2", "c"), (1, 400));
        l.settle(WINDOW_MS + 7, new, 50);
        assert_eq!(l.scope_window(WINDOW_MS + 7, "S2"), (2, 450));
        assert!(l.holds(WINDOW_MS + 7, new));
        assert!(!l.holds(WINDOW_MS + 7, old));
    }

    /// Timestamps that go back (a clock read outside a lock) never reorder entries: the
    /// model keeps its own clock, and hints never underflow.
    #[test]
    fn time_never_goes_back() {
        let mut l = WindowLimiter::new();
        let r = req(2, 500, 0, 200);
        l.acquire(50_000, &r).unwrap();
        l.acquire(10_000, &r).unwrap(); // recorded at 50 000
        let e = l.acquire(70_000, &r).unwrap_err();
        assert_eq!(e.reason, RefusalReason::Rpm);
        assert_eq!(e.retry_after, Some(Duration::from_millis(40_000)));
        assert_eq!(l.now(), 70_000);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Acquire { dt: i64, est: u64 },
        Settle { pick: usize, tokens: u64 },
        Release { pick: usize },
        Renew { pick: usize },
        Compact,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (-3_000i64..5_000, 0u64..400).prop_map(|(dt, est)| Op::Acquire { dt, est }),
            2 => (0usize..64, 0u64..800).prop_map(|(pick, tokens)| Op::Settle { pick, tokens }),
            1 => (0usize..64).prop_map(|pick| Op::Release { pick }),
            1 => (0usize..64).prop_map(|pick| Op::Renew { pick }),
            1 => Just(Op::Compact),
        ]
    }

    #[derive(Debug, Clone, Copy)]
    struct Entry {
        at: u64,
        est: u64,
        /// (settled at, tokens)
        settled: Option<(u64, u64)>,
        lease_end: u64,
        released: bool,
    }

    impl Entry {
        /// Tokens counted at `now` by the specification (§14.3).
        fn tokens_at(&self, now: u64) -> u64 {
            match self.settled {
                Some((at, t)) if at + WINDOW_MS > now => t,
                Some(_) => 0,
                None if self.lease_end + WINDOW_MS > now => self.est,
                None => 0,
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Never over-admit, whatever order the timestamps arrive in: in any rolling
        /// window admissions ≤ RPM; at each admission the tokens counted by §14.3 (in
        /// flight or unsettled with a live lease, or settled within the window) plus the
        /// estimate ≤ TPM; in flight ≤ MAX_CONCURRENCY. No operation panics (hints never
        /// underflow).
        #[test]
        fn never_over_admits(ops in proptest::collection::vec(op(), 1..200), rpm in 1u32..20, tpm in 400u64..3000, conc in 1u32..6) {
            let mut l = WindowLimiter::new();
            let mut raw = 20_000i64;
            let lease = Duration::from_secs(20);
            let mut entries: HashMap<u64, Entry> = HashMap::new();
            let mut order: Vec<u64> = vec![];
            for o in ops {
                match o {
                    Op::Acquire { dt, est } => {
                        raw = (raw + dt).max(0);
                        let r = AcquireRequest { lease, ..req(rpm, tpm, conc, est) };
                        let res = l.acquire(raw as u64, &r);
                        let now = l.now();
                        if let Ok(id) = res {
                            let requests = entries.values().filter(|e| e.at + WINDOW_MS > now).count();
                            prop_assert!(requests < rpm as usize, "rpm over-admitted");
                            let used: u64 = entries.values().map(|e| e.tokens_at(now)).sum();
                            prop_assert!(used + est <= tpm, "tpm over-admitted: {} + {} > {}", used, est, tpm);
                            let open = entries.values().filter(|e| !e.released && e.lease_end > now).count();
                            prop_assert!(open < conc as usize, "concurrency over-admitted");
                            entries.insert(id, Entry { at: now, est, settled: None, lease_end: now + 20_000, released: false });
                            order.push(id);
                        }
                    }
                    Op::Settle { pick, tokens } if !order.is_empty() => {
                        let id = order[pick % order.len()];
                        l.settle(raw.max(0) as u64, id, tokens);
                        let now = l.now();
                        let e = entries.get_mut(&id).unwrap();
                        if e.settled.is_none() && e.lease_end + WINDOW_MS > now {
                            e.settled = Some((now, tokens));
                        }
                    }
                    Op::Release { pick } if !order.is_empty() => {
                        let id = order[pick % order.len()];
                        l.release(id);
                        entries.get_mut(&id).unwrap().released = true;
                    }
                    Op::Renew { pick } if !order.is_empty() => {
                        let id = order[pick % order.len()];
                        l.renew(raw.max(0) as u64, id, lease);
                        let now = l.now();
                        let e = entries.get_mut(&id).unwrap();
                        if e.lease_end > now {
                            e.lease_end = e.lease_end.max(now + 20_000);
                        }
                    }
                    Op::Compact => l.compact(raw.max(0) as u64),
                    _ => {}
                }
                let now = l.now();
                let open = entries.values().filter(|e| !e.released && e.lease_end > now).count();
                prop_assert_eq!(l.in_flight(now, "S", "a") as usize, open);
                let want: u64 = entries.values().map(|e| e.tokens_at(now)).sum();
                prop_assert_eq!(l.source_window(now, "S", "a").1, want);
            }
        }

        /// Under-admission is bounded: a saturating load of single requests at a steady
        /// pace gets every request admitted that the window allows.
        #[test]
        fn saturating_load_gets_full_rpm(rpm in 1u32..200, step in 1u64..500) {
            let mut l = WindowLimiter::new();
            let r = req(rpm, 0, 0, 0);
            let mut admitted_times = vec![];
            let mut now = 0;
            while now < WINDOW_MS {
                if l.acquire(now, &r).is_ok() { admitted_times.push(now); }
                now += step;
            }
            let possible = (WINDOW_MS.div_ceil(step)) as usize;
            prop_assert_eq!(admitted_times.len(), possible.min(rpm as usize));
        }
    }
}
