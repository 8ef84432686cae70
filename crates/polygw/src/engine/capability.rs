//! What the process has learned about its sources: a source that refused an assistant
//! prefill is not prefill-capable for the rest of the process (SPEC §13.2), whichever
//! client of its scope learned it. One warning per source.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use super::Engine;

/// (scope, source name, base URL, model) of sources that refused prefill.
type Key = (String, String, String, String);

fn refused() -> &'static Mutex<HashSet<Key>> {
    static REFUSED: OnceLock<Mutex<HashSet<Key>>> = OnceLock::new();
    REFUSED.get_or_init(|| Mutex::new(HashSet::new()))
}

impl Engine {
    fn capability_key(&self, source: usize) -> Key {
        let s = &self.scope.sources[source];
        (
            self.scope.name.clone(),
            s.name.clone(),
            s.base_url.clone(),
            s.model.clone(),
        )
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
