//! Signature families in the engine (SPEC §23.5). Before a native call's first round,
//! the signed blobs of its request (thinking signatures, redacted thinking, encrypted
//! reasoning) are looked up in the scope's store — one `get_many`, on the affinity
//! store: memory, or Redis shared by every replica — and the call remembers the
//! conversation's family, which hedge and resume legs prefer. Each leg then sends its
//! source only what that source's family can verify (core's
//! [`polygw_core::native::family::Placed::keep_for`]). When the call is won, the blobs
//! of the answer the client received are remembered as the winner's family, for
//! `SIGNATURE__TTL_S`.
//!
//! Only scopes whose sources of the request's API belong to more than one family pay
//! for any of this; and the store is a hint, not governance: a failed lookup or write is
//! logged, and the blobs pass unplaced (the safety net of `signed` answers a refusal).

use std::sync::{Arc, Mutex};

use polygw_core::native::family::{self, Placed};
use polygw_core::ports::StreamDelta;
use polygw_core::source::SourceApi;
use polygw_core::ChatRequest;

use super::call::CallShared;
use super::round::{Commit, DeltaSink};
use super::Engine;

impl Engine {
    /// Whether the scope's sources of `api` belong to more than one signature family
    /// (else nothing the scope sends can be foreign to the source it reaches).
    pub(crate) fn families_differ(&self, api: SourceApi) -> bool {
        let mut families = self
            .scope
            .sources
            .iter()
            .filter(|s| s.api == api)
            .map(|s| s.family());
        match families.next() {
            None => false,
            Some(f) => families.any(|g| g != f),
        }
    }

    /// The request's signed blobs with the families the store knows, and the
    /// conversation's family set on the call; `None` when there is nothing to place.
    /// The caller asks only where [`Engine::families_differ`] for the request's API.
    pub(crate) async fn place_signed(
        &self,
        request: &ChatRequest,
        call: &CallShared,
    ) -> Option<Arc<Placed>> {
        let native = request.native.as_ref()?;
        let refs = family::signed_in_request(native.api, &native.body);
        if refs.is_empty() {
            return None;
        }
        let keys: Vec<String> = refs.iter().map(|r| r.key.clone()).collect();
        let families = match self.ports.affinity.get_many(&self.scope.name, &keys).await {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(error = %e, "signature family lookup failed; signed blocks pass unplaced");
                Vec::new()
            }
        };
        let placed = Placed::new(refs, families);
        if let Some(f) = placed.session_family() {
            call.set_family(f.clone());
        }
        Some(Arc::new(placed))
    }

    /// The blobs `keys` reached the client from the scope's source `source`: remembered
    /// as its family's.
    pub(crate) async fn remember_signed(&self, source: usize, keys: &[String]) {
        if keys.is_empty() {
            return;
        }
        let family = self.scope.sources[source].family();
        if let Err(e) = self
            .ports
            .affinity
            .put_many(&self.scope.name, keys, family, self.scope.signature_ttl)
            .await
        {
            tracing::warn!(error = %e, "signature family write failed; those blocks will pass unplaced");
        }
    }
}

/// The blobs of a plain native answer of `api` (its bytes as the source sent them).
pub(crate) fn signed_in_body(api: SourceApi, body: &[u8]) -> Vec<String> {
    let needle: &[u8] = match api {
        SourceApi::Messages => b"\"signature\"",
        SourceApi::Responses => b"\"encrypted_content\"",
        SourceApi::Chat => return Vec::new(),
    };
    let has = |n: &[u8]| body.windows(n.len()).any(|w| w == n);
    let signed = has(needle) || (api == SourceApi::Messages && has(b"redacted_thinking"));
    if !signed {
        return Vec::new();
    }
    match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body) {
        Ok(obj) => family::signed_in_answer(api, &obj),
        Err(_) => Vec::new(),
    }
}

/// A stream's sink that notes the blobs of the native events the client receives.
pub(crate) struct SignedSink {
    inner: Arc<dyn DeltaSink>,
    api: SourceApi,
    keys: Mutex<Vec<String>>,
}

impl SignedSink {
    pub(crate) fn new(inner: Arc<dyn DeltaSink>, api: SourceApi) -> Self {
        SignedSink {
            inner,
            api,
            keys: Mutex::new(Vec::new()),
        }
    }

    /// The blobs seen so far.
    pub(crate) fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.keys.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl DeltaSink for SignedSink {
    fn committed(&self, commit: &Commit) {
        self.inner.committed(commit);
    }

    fn send(&self, delta: StreamDelta) {
        if let Some(k) = delta
            .native
            .as_ref()
            .and_then(|e| family::signed_in_event(self.api, &e.data))
        {
            self.keys.lock().unwrap_or_else(|e| e.into_inner()).push(k);
        }
        self.inner.send(delta);
    }

    fn attempts_running(&self, n: usize) {
        self.inner.attempts_running(n);
    }
}
