//! [`MemoryLimiter`]: core's reference limiter model under a mutex, with permits whose
//! drop-time settlement applies directly (it is in-process, so it never blocks for long).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use polygw_core::error::GovernanceError;
use polygw_core::ports::{AcquireRequest, Admission, Clock, Permit, PermitBackend, RateLimiter};
use polygw_core::window::{WindowLimiter, WINDOW_MS};

use crate::{elapsed_ms, lock};

/// Clock time between two compactions of the model's permit table. Nothing can be
/// forgotten before its entry leaves the window, so compacting by time alone bounds the
/// table to the acquires of the last 75 s while costing O(entries) only every 15 s.
const COMPACT_EVERY_MS: u64 = WINDOW_MS / 4;

/// In-process [`RateLimiter`]: RPM, TPM (reserve then settle) and concurrency per source,
/// scope-wide RPM/TPM atomically with them (SPEC §4.2). Cheap to clone (shared state).
#[derive(Clone)]
pub struct MemoryLimiter {
    shared: Arc<Shared>,
}

struct Shared {
    clock: Arc<dyn Clock>,
    base: Instant,
    state: Mutex<State>,
}

struct State {
    model: WindowLimiter,
    last_compact_ms: u64,
}

impl fmt::Debug for MemoryLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLimiter").finish_non_exhaustive()
    }
}

impl Shared {
    fn now_ms(&self) -> u64 {
        elapsed_ms(self.clock.as_ref(), self.base)
    }
}

impl MemoryLimiter {
    /// A limiter on `clock`; its windows start at the clock's current reading.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        let base = clock.now();
        MemoryLimiter {
            shared: Arc::new(Shared {
                clock,
                base,
                state: Mutex::new(State {
                    model: WindowLimiter::new(),
                    last_compact_ms: 0,
                }),
            }),
        }
    }

    /// `(requests, tokens)` in a source's rolling window now (tests, metrics).
    pub fn source_window(&self, scope: &str, source: &str) -> (u64, u64) {
        let now = self.shared.now_ms();
        lock(&self.shared.state)
            .model
            .source_window(now, scope, source)
    }

    /// `(requests, tokens)` in a scope's rolling window now (tests, metrics).
    pub fn scope_window(&self, scope: &str) -> (u64, u64) {
        let now = self.shared.now_ms();
        lock(&self.shared.state).model.scope_window(now, scope)
    }

    /// Drops every entry that left its window and every finished permit now (it also
    /// happens on its own on the first acquire after every 15 s of clock time).
    pub fn compact(&self) {
        let now = self.shared.now_ms();
        let mut st = lock(&self.shared.state);
        st.model.compact(now);
        st.last_compact_ms = now;
    }
}

#[async_trait]
impl RateLimiter for MemoryLimiter {
    async fn acquire<'r>(&self, req: &AcquireRequest<'r>) -> Result<Admission, GovernanceError> {
        let now = self.shared.now_ms();
        let admitted = {
            let mut st = lock(&self.shared.state);
            if now.saturating_sub(st.last_compact_ms) >= COMPACT_EVERY_MS {
                st.model.compact(now);
                st.last_compact_ms = now;
            }
            st.model.acquire(now, req)
        };
        Ok(match admitted {
            Ok(id) => Admission::Admitted(Permit::new(
                req.est_tokens,
                Box::new(MemoryPermit {
                    shared: self.shared.clone(),
                    id,
                    settled: AtomicBool::new(false),
                }),
            )),
            Err(refusal) => Admission::Refused(refusal),
        })
    }

    async fn in_flight(&self, scope: &str, source: &str) -> Result<u32, GovernanceError> {
        let now = self.shared.now_ms();
        Ok(lock(&self.shared.state).model.in_flight(now, scope, source))
    }
}

/// The backend of a memory permit. The first settlement wins (as in the Redis backend),
/// whichever path it takes; release is idempotent in the model.
struct MemoryPermit {
    shared: Arc<Shared>,
    id: u64,
    settled: AtomicBool,
}

impl fmt::Debug for MemoryPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPermit")
            .field("id", &self.id)
            .field("settled", &self.settled.load(Ordering::Relaxed))
            .finish()
    }
}

impl MemoryPermit {
    fn apply(&self, tokens: Option<u64>, release: bool) {
        let settle = tokens.filter(|_| !self.settled.swap(true, Ordering::AcqRel));
        if settle.is_none() && !release {
            return;
        }
        let mut st = lock(&self.shared.state);
        if let Some(t) = settle {
            st.model.settle(self.id, t);
        }
        if release {
            st.model.release(self.id);
        }
    }
}

#[async_trait]
impl PermitBackend for MemoryPermit {
    async fn settle(&self, tokens: u64) -> Result<(), GovernanceError> {
        self.apply(Some(tokens), false);
        Ok(())
    }

    async fn release(&self) -> Result<(), GovernanceError> {
        self.apply(None, true);
        Ok(())
    }

    async fn settle_and_release(&self, tokens: u64) -> Result<(), GovernanceError> {
        self.apply(Some(tokens), true);
        Ok(())
    }

    fn settle_on_drop(&self, tokens: Option<u64>) {
        self.apply(tokens, true);
    }
}
