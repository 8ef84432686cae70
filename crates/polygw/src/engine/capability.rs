//! What the process has learned about its sources: a source that refused an assistant
//! prefill is not prefill-capable for the rest of the process (SPEC §13.2), and one
//! that refused `max_tokens` gets `max_completion_tokens` (SPEC §24.4), whichever
//! client of its scope learned it. One warning per source.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use polygw_core::SourceConfig;

use super::Engine;

/// (scope, source name, base URL, model) of sources that refused prefill.
type Key = (String, String, String, String);

fn refused() -> &'static Mutex<HashSet<Key>> {
    static REFUSED: OnceLock<Mutex<HashSet<Key>>> = OnceLock::new();
    REFUSED.get_or_init(|| Mutex::new(HashSet::new()))
}

/// (scope, source name, base URL, model) of sources that take the output cap only as
/// `max_completion_tokens`.
fn completion_cap() -> &'static Mutex<HashSet<Key>> {
    static LEARNED: OnceLock<Mutex<HashSet<Key>>> = OnceLock::new();
    LEARNED.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Whether any source was learned so (every attempt asks: no lock, no key, until one
/// was).
static ANY_COMPLETION_CAP: AtomicBool = AtomicBool::new(false);

impl Engine {
    fn capability_key(&self, source: usize) -> Key {
        self.key_of(&self.scope.sources[source])
    }

    fn key_of(&self, s: &SourceConfig) -> Key {
        (
            self.scope.name.clone(),
            s.name.clone(),
            s.base_url.clone(),
            s.model.clone(),
        )
    }

    /// The source as an attempt sends to it: with `max_completion_tokens` when the
    /// process learned it takes the cap only so (`None`: as configured).
    pub(crate) fn learned_source(&self, s: &SourceConfig) -> Option<SourceConfig> {
        if s.max_completion_tokens || !ANY_COMPLETION_CAP.load(Ordering::Relaxed) {
            return None;
        }
        let learned = completion_cap()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&self.key_of(s));
        learned.then(|| SourceConfig {
            max_completion_tokens: true,
            ..s.clone()
        })
    }

    /// The source refused `max_tokens`: it gets `max_completion_tokens` from now on.
    pub(crate) fn mark_max_completion_tokens(&self, s: &SourceConfig) {
        let newly = completion_cap()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(self.key_of(s));
        ANY_COMPLETION_CAP.store(true, Ordering::Relaxed);
        if newly {
            tracing::warn!(
                scope = %self.scope.name,
                source = %s.name,
                model = %s.model,
                "the source refused max_tokens: the cap is sent as max_completion_tokens for the rest of the process (set MAX_TOKENS_FIELD=max_completion_tokens to say so up front)"
            );
        }
    }

    /// The source accepts an assistant prefill: configured (`PREFILL`) and not
    /// learned otherwise.
    pub(crate) fn prefill_capable(&self, source: usize) -> bool {
        self.scope.sources[source].prefill.is_some()
            && !refused()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&self.capability_key(source))
    }

    /// Whether a leg on `source` may continue `delivered` by prefill (SPEC §23.6): the
    /// source takes prefill (configured, not refused), the request's body for it
    /// can carry one (thinking off on a `messages` source, never a `responses` one),
    /// the delivered output is text only, and its end suits the source (no trailing
    /// whitespace to Anthropic).
    pub(crate) fn prefills<L: super::attempt::Leg>(
        &self,
        leg: &L,
        delivered: &polygw_core::resume::Transcript,
        source: usize,
    ) -> bool {
        use polygw_core::resume::{prefill_possible, prefill_takes_trailing_whitespace};
        let s = &self.scope.sources[source];
        prefill_possible(
            self.prefill_capable(source) && leg.prefill_allowed(s),
            prefill_takes_trailing_whitespace(s.api),
            delivered,
        )
    }

    /// The sources [`Engine::prefills`] allows for `delivered`.
    pub(crate) fn prefill_targets<L: super::attempt::Leg>(
        &self,
        leg: &L,
        delivered: &polygw_core::resume::Transcript,
    ) -> std::collections::BTreeSet<usize> {
        (0..self.scope.sources.len())
            .filter(|&i| self.prefills(leg, delivered, i))
            .collect()
    }

    /// The source refused a prefill: replay only from now on.
    pub(crate) fn mark_no_prefill(&self, source: usize) {
        let newly = refused()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(self.capability_key(source));
        if newly {
            let s = &self.scope.sources[source];
            tracing::warn!(
                scope = %self.scope.name,
                source = %s.name,
                prefill = ?s.prefill,
                "the source refused an assistant prefill: it is resumed by replay for the rest of the process"
            );
        }
    }
}
