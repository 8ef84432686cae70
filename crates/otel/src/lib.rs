//! polygw's OpenTelemetry exporter (SPEC §26.1): the adapter behind
//! [`polygw_core::ports::OtelExporter`].
//!
//! The engine hands over each finished call ([`FinishedCall`]) with one `try_send`
//! into a bounded queue and goes on; a full queue drops the call and counts it. One
//! thread, `polygw-otel`, owns everything else: it turns calls into spans and metric
//! measurements (the mapping is core's, [`FinishedCall::spans`] and
//! [`FinishedCall::metric_points`]), batches spans and ships them with the OTLP
//! exporter of `opentelemetry-otlp` over http/protobuf. Metrics are aggregated by the
//! SDK's meter provider and pushed by its periodic reader. HTTP goes through the
//! workspace's reqwest on a small runtime of the exporter's own, so an export that is
//! slow or fails never touches a call's runtime.

// The exporter's thread paces its batches and its flush by the machine's clock: they
// decide when spans leave, never anything about a call, so there is no Clock to inject.
#![allow(clippy::disallowed_methods)]

mod config;
mod http;

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use opentelemetry::metrics::{Counter, Histogram, MeterProvider as _};
use opentelemetry::trace::{SpanContext, SpanId, Status, TraceFlags, TraceId, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use opentelemetry_sdk::Resource;
use polygw_core::otel::{FinishedCall, Instrument, Sampler, SpanOut, Value, SCHEMA_URL};
use polygw_core::ports::OtelExporter;

pub use config::{OtelConfig, PROTOCOL};

/// The instrumentation scope's name.
pub const SCOPE_NAME: &str = "polygw";

enum Msg {
    Call(Box<FinishedCall>),
    Flush(SyncSender<bool>),
}

/// The exporter. Dropping it stops its thread after a last export of what is queued.
#[derive(Debug)]
pub struct Otel {
    tx: SyncSender<Msg>,
    dropped: Arc<AtomicU64>,
    traces: bool,
    sampler: Sampler,
    capture_content: bool,
}

impl Otel {
    /// OpenTelemetry as the process environment's `OTEL_*` variables say; `Ok(None)`
    /// when they turn it off (no OTLP endpoint set). An error names the variable.
    pub fn from_env() -> Result<Option<Otel>, String> {
        match OtelConfig::from_env(&|k| std::env::var(k).ok())? {
            Some(c) => Otel::start(c).map(Some),
            None => Ok(None),
        }
    }

    /// Starts the exporter's thread.
    pub fn start(config: OtelConfig) -> Result<Otel, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("polygw-otel-io")
            .enable_all()
            .build()
            .map_err(|e| format!("OpenTelemetry: cannot start its runtime: {e}"))?;
        let client = http::Client::new(runtime.handle().clone(), config.timeout)?;
        let resource = resource(&config);
        let span_exporter = if config.traces {
            let mut e = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(client.clone())
                .with_endpoint(config.traces_endpoint.clone())
                .with_headers(config.traces_headers.iter().cloned().collect())
                .with_timeout(config.timeout)
                .build()
                .map_err(|e| format!("OpenTelemetry: the trace exporter: {e}"))?;
            e.set_resource(&resource);
            Some(e)
        } else {
            None
        };
        let dropped = Arc::new(AtomicU64::new(0));
        let meters = if config.metrics {
            let exporter = opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .with_http_client(client)
                .with_endpoint(config.metrics_endpoint.clone())
                .with_headers(config.metrics_headers.iter().cloned().collect())
                .with_timeout(config.timeout)
                .build()
                .map_err(|e| format!("OpenTelemetry: the metric exporter: {e}"))?;
            let reader = PeriodicReader::builder(exporter)
                .with_interval(config.metric_interval)
                .build();
            let provider = SdkMeterProvider::builder()
                .with_reader(reader)
                .with_resource(resource)
                .build();
            Some(Meters::new(provider, dropped.clone()))
        } else {
            None
        };
        let (tx, rx) = sync_channel(config.queue);
        let worker = Worker {
            rx,
            spans: span_exporter,
            meters,
            dropped: dropped.clone(),
            batch: config.batch,
            delay: config.delay,
            runtime,
        };
        std::thread::Builder::new()
            .name("polygw-otel".into())
            .spawn(move || worker.run())
            .map_err(|e| format!("OpenTelemetry: cannot start its thread: {e}"))?;
        Ok(Otel {
            tx,
            dropped,
            traces: config.traces,
            sampler: config.sampler,
            capture_content: config.capture_content,
        })
    }
}

fn resource(c: &OtelConfig) -> Resource {
    Resource::builder_empty()
        .with_service_name(c.service_name.clone())
        .with_attributes(
            c.resource
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        )
        .with_attributes([
            KeyValue::new("telemetry.sdk.name", "opentelemetry"),
            KeyValue::new("telemetry.sdk.language", "rust"),
            KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        ])
        .build()
}

impl OtelExporter for Otel {
    fn enabled(&self) -> bool {
        true
    }

    fn traces(&self) -> bool {
        self.traces
    }

    fn sampler(&self) -> Sampler {
        self.sampler
    }

    fn captures_content(&self) -> bool {
        self.capture_content
    }

    fn export(&self, call: FinishedCall) {
        match self.tx.try_send(Msg::Call(Box::new(call))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    fn flush(&self, timeout: Duration) -> bool {
        let (reply, answer) = sync_channel(1);
        let deadline = Instant::now() + timeout;
        // The queue may be full: wait for room, up to the deadline.
        let mut msg = Msg::Flush(reply);
        loop {
            match self.tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Disconnected(_)) => return false,
                Err(TrySendError::Full(m)) => {
                    if Instant::now() >= deadline {
                        return false;
                    }
                    msg = m;
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        answer
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or(false)
    }
}

/// The instruments.
struct Meters {
    provider: SdkMeterProvider,
    histograms: Vec<(Instrument, Histogram<f64>)>,
    counters: Vec<(Instrument, Counter<f64>)>,
}

impl Meters {
    fn new(provider: SdkMeterProvider, dropped: Arc<AtomicU64>) -> Meters {
        let meter = provider.meter_with_scope(scope());
        let mut histograms = Vec::new();
        let mut counters = Vec::new();
        for i in Instrument::ALL {
            if i.is_histogram() {
                histograms.push((
                    i,
                    meter
                        .f64_histogram(i.name())
                        .with_unit(i.unit())
                        .with_description(i.description())
                        .with_boundaries(i.boundaries().to_vec())
                        .build(),
                ));
            } else {
                counters.push((
                    i,
                    meter
                        .f64_counter(i.name())
                        .with_unit(i.unit())
                        .with_description(i.description())
                        .build(),
                ));
            }
        }
        // What the queue dropped: observed at each export.
        let _ = meter
            .u64_observable_counter("polygw.otel.dropped")
            .with_unit("{call}")
            .with_description(
                "Finished calls the OpenTelemetry exporter dropped (queue full or export failed)",
            )
            .with_callback(move |o| o.observe(dropped.load(Ordering::Relaxed), &[]))
            .build();
        Meters {
            provider,
            histograms,
            counters,
        }
    }

    fn record(&self, call: &FinishedCall) {
        for p in call.metric_points() {
            let attrs: Vec<KeyValue> = p.attributes.into_iter().map(key_value).collect();
            if let Some((_, h)) = self.histograms.iter().find(|(i, _)| *i == p.instrument) {
                h.record(p.value, &attrs);
            } else if let Some((_, c)) = self.counters.iter().find(|(i, _)| *i == p.instrument) {
                c.add(p.value, &attrs);
            }
        }
    }
}

fn scope() -> InstrumentationScope {
    InstrumentationScope::builder(SCOPE_NAME)
        .with_version(env!("CARGO_PKG_VERSION"))
        .with_schema_url(SCHEMA_URL)
        .build()
}

fn key_value((k, v): (&'static str, Value)) -> KeyValue {
    match v {
        Value::Str(s) => KeyValue::new(k, s),
        Value::Int(i) => KeyValue::new(k, i),
        Value::Float(f) => KeyValue::new(k, f),
        Value::Bool(b) => KeyValue::new(k, b),
        Value::StrArray(a) => KeyValue::new(
            k,
            opentelemetry::Value::Array(opentelemetry::Array::String(
                a.into_iter().map(Into::into).collect(),
            )),
        ),
    }
}

fn time(ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(ns)
}

/// One span as the SDK's exporters take it.
pub fn span_data(s: SpanOut, scope: &InstrumentationScope) -> SpanData {
    let mut events = SpanEvents::default();
    for e in s.events {
        events.events.push(opentelemetry::trace::Event::new(
            e.name,
            time(e.at_ns),
            e.attributes.into_iter().map(key_value).collect(),
            0,
        ));
    }
    SpanData {
        span_context: SpanContext::new(
            TraceId::from_bytes(s.trace_id),
            SpanId::from_bytes(s.span_id),
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        ),
        parent_span_id: s.parent.map_or(SpanId::INVALID, SpanId::from_bytes),
        parent_span_is_remote: s.parent_remote,
        span_kind: match s.kind {
            polygw_core::otel::SpanKind::Client => opentelemetry::trace::SpanKind::Client,
        },
        name: Cow::Owned(s.name),
        start_time: time(s.start_ns),
        end_time: time(s.end_ns),
        attributes: s.attributes.into_iter().map(key_value).collect(),
        dropped_attributes_count: 0,
        events,
        links: SpanLinks::default(),
        status: match s.error {
            Some(e) => Status::error(e),
            None => Status::Unset,
        },
        instrumentation_scope: scope.clone(),
    }
}

struct Worker {
    rx: Receiver<Msg>,
    spans: Option<opentelemetry_otlp::SpanExporter>,
    meters: Option<Meters>,
    dropped: Arc<AtomicU64>,
    batch: usize,
    delay: Duration,
    /// Drives the HTTP requests; dropped (on this thread) when the worker ends.
    runtime: tokio::runtime::Runtime,
}

impl Worker {
    /// The longest the thread sleeps between two looks at the queue.
    const TICK: Duration = Duration::from_millis(25);

    fn run(self) {
        let scope = scope();
        // The thread wakes on its own, every tick, and drains the queue: a call's
        // `try_send` never finds it waiting, so handing a call over costs no system
        // call and no context switch (waking it once per call did: docs/BENCHMARKS.md,
        // "OpenTelemetry export").
        let tick = self.delay.clamp(Duration::from_millis(1), Self::TICK);
        // Spans waiting, and the calls they come from (a failed export drops calls).
        let mut pending: Vec<SpanData> = Vec::new();
        let mut calls = 0u64;
        let mut since: Option<Instant> = None;
        loop {
            std::thread::sleep(tick);
            loop {
                match self.rx.try_recv() {
                    Ok(Msg::Call(call)) => {
                        if let Some(m) = &self.meters {
                            m.record(&call);
                        }
                        if self.spans.is_some() && call.context.sampled {
                            pending.extend(call.spans().into_iter().map(|s| span_data(s, &scope)));
                            calls += 1;
                            since.get_or_insert_with(Instant::now);
                        }
                        if pending.len() >= self.batch {
                            self.ship(&mut pending, &mut calls);
                            since = None;
                        }
                    }
                    Ok(Msg::Flush(reply)) => {
                        let ok = self.ship(&mut pending, &mut calls);
                        since = None;
                        let metrics_ok = self
                            .meters
                            .as_ref()
                            .is_none_or(|m| m.provider.force_flush().is_ok());
                        let _ = reply.send(ok && metrics_ok);
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.ship(&mut pending, &mut calls);
                        if let Some(m) = &self.meters {
                            let _ = m.provider.shutdown();
                        }
                        return;
                    }
                }
            }
            if since.is_some_and(|t| t.elapsed() >= self.delay) {
                self.ship(&mut pending, &mut calls);
                since = None;
            }
        }
    }

    /// Exports the pending spans; false (and the calls counted as dropped) when the
    /// receiver refused them or could not be reached in time.
    fn ship(&self, pending: &mut Vec<SpanData>, calls: &mut u64) -> bool {
        let Some(exporter) = &self.spans else {
            return true;
        };
        if pending.is_empty() {
            return true;
        }
        let batch = std::mem::take(pending);
        let n = std::mem::take(calls);
        let result = self.runtime.block_on(exporter.export(batch));
        match result {
            Ok(()) => true,
            Err(e) => {
                self.dropped.fetch_add(n, Ordering::Relaxed);
                tracing::debug!(error = %e, calls = n, "OpenTelemetry: a span export failed; its calls are counted as dropped");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests;
