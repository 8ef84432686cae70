//! The OpenTelemetry port (SPEC §26.1): where finished calls go to become spans and
//! metrics. The engine hands each finished call over at once and never waits; the
//! adapter (`polygw-otel`) queues it, bounded, and counts what it drops. The null
//! exporter, the default, collects nothing, so a call without OpenTelemetry pays one
//! branch.

use crate::otel::{FinishedCall, Sampler};

/// Takes finished calls.
pub trait OtelExporter: Send + Sync + std::fmt::Debug {
    /// Whether calls are collected at all (false: the engine builds nothing).
    fn enabled(&self) -> bool;
    /// Whether traces are exported (metrics may be on alone).
    fn traces(&self) -> bool {
        self.enabled()
    }
    /// The trace sampler in force.
    fn sampler(&self) -> Sampler {
        Sampler::default()
    }
    /// Whether message contents are captured
    /// (`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`).
    fn captures_content(&self) -> bool {
        false
    }
    /// Takes one finished call; never blocks (a full queue drops it, counted).
    fn export(&self, call: FinishedCall);
    /// Calls dropped so far (queue full or export failed).
    fn dropped(&self) -> u64;
    /// Ships what is queued, waiting at most `timeout`; true when everything went.
    fn flush(&self, _timeout: std::time::Duration) -> bool {
        true
    }
}

/// No OpenTelemetry: the default.
#[derive(Debug, Default, Clone, Copy)]
pub struct NullExporter;

impl OtelExporter for NullExporter {
    fn enabled(&self) -> bool {
        false
    }
    fn export(&self, _call: FinishedCall) {}
    fn dropped(&self) -> u64 {
        0
    }
}
