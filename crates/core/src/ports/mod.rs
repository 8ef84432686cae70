//! The ports of SPEC §1: traits the adapters implement and tests swap. Each has a
//! null (or trivial) implementation beside it where that makes sense.

pub mod affinity;
pub mod breaker;
pub mod cache;
pub mod clock;
pub mod key_store;
pub mod keys;
pub mod latency_store;
pub mod limiter;
pub mod observer;
pub mod otel;
pub mod rng;
pub mod store;
pub mod telemetry;
pub mod transport;

pub use affinity::{AffinityStore, NullAffinity};
pub use breaker::{BreakerStore, NullBreakerStore};
pub use cache::{NullCache, ResponseCache};
pub use clock::{Clock, ManualClock};
pub use key_store::ClientKeyStore;
pub use keys::{KeyAcquire, KeyAdmission, KeyPermit, KeyPermitBackend, KeyUsage};
pub use latency_store::{LatencyStore, SourceSketch};
pub use limiter::{
    AcquireRequest, Admission, Permit, PermitBackend, RateLimiter, Refusal, UnlimitedLimiter,
};
pub use observer::{
    passed_header, passed_headers, ChunkObserver, NullObserver, RawText, StreamDelta, ToolCallDelta,
};
pub use otel::{NullExporter, OtelExporter};
pub use rng::{Rng, SplitMix64};
pub use store::{
    answered_input, conversation, entry_bytes, BrokenChain, NullStore, ResponseStore,
    StoredResponse,
};
pub use telemetry::{FlushReport, NullRecorder, TelemetryRecorder};
pub use transport::{
    ChatAttempt, EmbeddingResult, EmbeddingTransport, NativeAnswer, NativeCall, OcrResult,
    OcrTransport, Transport, TransportResult,
};

/// mockall mocks of every port (feature `mock`; tests only): exact call expectations.
#[cfg(any(test, feature = "mock"))]
pub use self::{
    affinity::MockAffinityStore,
    breaker::MockBreakerStore,
    cache::MockResponseCache,
    clock::MockClock,
    keys::MockKeyPermitBackend,
    limiter::{MockPermitBackend, MockRateLimiter},
    observer::MockChunkObserver,
    rng::MockRng,
    store::MockResponseStore,
    telemetry::MockTelemetryRecorder,
    transport::{MockEmbeddingTransport, MockOcrTransport, MockTransport},
};

/// Runs a future that never pends (the ports' test doubles answer at once): polls it
/// once with a no-op waker.
#[cfg(test)]
pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("a test double's future pended"),
    }
}
