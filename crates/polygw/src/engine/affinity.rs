//! Prompt-cache affinity in the engine (SPEC §20.2). Before a chat call's first round its
//! affinity key is looked up: the source that last served it. The retry loop hands that
//! source to the pick of each round's primary ([`super::admission::PickPrefs::sticky`]),
//! where core's [`polygw_core::affinity::affinity_order`] tries it first within its
//! priority tier — through the breaker store and the limiter like any candidate, so a
//! source that is refused (open breaker, cooldown, dead, over a quota) or failed in the
//! call is passed over for the normal order. Hedge legs and continuation (resume) rounds
//! pick without it, as before. The winner's source is written back with the scope's TTL.
//!
//! The store is a hint, not governance: a lookup or a write that fails is logged and the
//! call goes on (the normal order), never failed for it.

use polygw_core::affinity::{AffinityKey, AffinityOutcome};
use polygw_core::ScopeKind;

use super::call::CallShared;
use super::Engine;

/// What the store said about a call's key.
#[derive(Debug)]
pub(crate) struct Recall {
    key: AffinityKey,
    /// The source the key had (a name: it may be one this scope no longer has).
    stored: Option<String>,
    /// That source's index, when the scope has it.
    pub sticky: Option<usize>,
}

impl Engine {
    /// Whether calls of this engine keep affinity: a chat scope with `AFFINITY=session`
    /// and more than one source.
    pub(crate) fn affinity_applies(&self) -> bool {
        self.kind == ScopeKind::Chat && self.scope.affinity.applies(self.scope.sources.len())
    }

    /// The source the call's key last went to (`None`: the call has no key, or the scope
    /// keeps no affinity).
    pub(crate) async fn recall(&self, call: &CallShared) -> Option<Recall> {
        if !self.affinity_applies() {
            return None;
        }
        let key = call.affinity()?;
        let stored = match self
            .ports
            .affinity
            .get(&self.scope.name, key.as_str())
            .await
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "affinity lookup failed; the normal order applies");
                None
            }
        };
        let sticky = stored
            .as_deref()
            .and_then(|n| self.scope.sources.iter().position(|s| s.name == n));
        Some(Recall {
            key,
            stored,
            sticky,
        })
    }

    /// The call was won on `winner`: it becomes the key's source, for the scope's TTL.
    pub(crate) async fn remember(&self, r: &Recall, winner: usize) {
        let name = &self.scope.sources[winner].name;
        self.scope_metrics
            .affinity(AffinityOutcome::of(r.stored.as_deref(), name));
        if let Err(e) = self
            .ports
            .affinity
            .put(
                &self.scope.name,
                r.key.as_str(),
                name,
                self.scope.affinity.ttl,
            )
            .await
        {
            tracing::warn!(error = %e, "affinity write failed; the session may move");
        }
    }
}
