//! OpenTelemetry (SPEC §26.1), the facade's part: the process's exporter as the
//! `OTEL_*` variables configure it, and what a call collects for it — its place in the
//! trace, each upstream request's row and times, and how it ended. The call hands the
//! whole to the exporter once, when the last of its legs lets go of it, so that a
//! losing hedge leg that finishes after the answer is in the trace too.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use polygw_core::otel::{
    redact_secrets, AnswerFacts, AttemptRecord, CallContext, Contents, FinishedCall, RequestFacts,
};
use polygw_core::ports::NullExporter;

pub use polygw_core::otel::TraceParent;
pub use polygw_core::ports::OtelExporter;
use polygw_core::telemetry::TelemetryRow;
use polygw_core::{ConfigError, GatewayError, LlmResponse};

/// The process's exporter, read from its environment once (every client of the
/// process shares it: one queue, one thread, one meter provider).
pub fn from_env() -> Result<Arc<dyn OtelExporter>, GatewayError> {
    static PROCESS: OnceLock<Result<Arc<dyn OtelExporter>, String>> = OnceLock::new();
    PROCESS.get_or_init(start).clone().map_err(|e| {
        GatewayError::Config(ConfigError::Invalid {
            key: "OTEL_*".to_string(),
            value: String::new(),
            expected: e,
        })
    })
}

#[cfg(feature = "otel")]
fn start() -> Result<Arc<dyn OtelExporter>, String> {
    Ok(match polygw_otel::Otel::from_env()? {
        Some(o) => Arc::new(o),
        None => Arc::new(NullExporter),
    })
}

#[cfg(not(feature = "otel"))]
fn start() -> Result<Arc<dyn OtelExporter>, String> {
    let set = [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ]
    .into_iter()
    .find(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()));
    match set {
        Some(k) => Err(format!(
            "{k} is set but this build of polygw has no OpenTelemetry (the `otel` feature)"
        )),
        None => Ok(Arc::new(NullExporter)),
    }
}

/// Where the upstream of a source is: host and port of its base URL.
pub(crate) fn server_of(base_url: &str) -> (Option<String>, Option<u16>) {
    match url::Url::parse(base_url) {
        Ok(u) => (u.host_str().map(str::to_string), u.port_or_known_default()),
        Err(_) => (None, None),
    }
}

/// The upstream's response id of a plain answer: from the object when the transport
/// kept one, else read from its bytes without building the whole tree (a stream's id is
/// not kept).
fn response_id(r: &LlmResponse) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct IdOnly {
        id: Option<String>,
    }
    match (&r.upstream, &r.upstream_body) {
        (Some(o), _) => o.get("id").and_then(|v| v.as_str()).map(str::to_string),
        (None, Some(b)) => serde_json::from_slice::<IdOnly>(b).ok().and_then(|i| i.id),
        (None, None) => None,
    }
}

/// How a call ended.
#[derive(Debug, Default)]
struct Ending {
    at: Option<Instant>,
    answer: Option<AnswerFacts>,
    error_type: Option<String>,
    output: Option<String>,
    cache_hit: bool,
}

/// What a traced call collects.
#[derive(Debug)]
pub(crate) struct OtelCall {
    exporter: Arc<dyn OtelExporter>,
    scope: String,
    operation: &'static str,
    pub context: CallContext,
    start_unix_ms: i64,
    started: Instant,
    request: Mutex<RequestFacts>,
    input: Mutex<Option<String>>,
    attempts: Mutex<Vec<AttemptRecord>>,
    ending: Mutex<Ending>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl OtelCall {
    pub(crate) fn new(
        exporter: Arc<dyn OtelExporter>,
        scope: &str,
        operation: &'static str,
        logical_call_id: &str,
        parent: Option<TraceParent>,
        started: Instant,
        start_unix_ms: i64,
    ) -> Self {
        OtelCall {
            context: CallContext::new(logical_call_id, parent, &exporter.sampler()),
            exporter,
            scope: scope.to_string(),
            operation,
            start_unix_ms,
            started,
            request: Mutex::new(RequestFacts::default()),
            input: Mutex::new(None),
            attempts: Mutex::new(Vec::new()),
            ending: Mutex::new(Ending::default()),
        }
    }

    /// The `traceparent` an upstream request of attempt `call_id` carries; `None` when
    /// the call's trace is not exported (the upstream then sees none from us either,
    /// as with any caller that does not trace).
    pub(crate) fn upstream_header(&self, call_id: &str) -> Option<String> {
        self.exporter
            .traces()
            .then(|| self.context.upstream_header(call_id))
    }

    fn ns(&self, at: Instant) -> u64 {
        let base = u64::try_from(self.start_unix_ms.max(0)).unwrap_or(0) * 1_000_000;
        base + u64::try_from(at.saturating_duration_since(self.started).as_nanos())
            .unwrap_or(u64::MAX / 2)
    }

    /// What the client asked.
    pub(crate) fn set_request(&self, request: &polygw_core::ChatRequest, model: Option<String>) {
        *lock(&self.request) = RequestFacts {
            model,
            max_tokens: request.max_tokens.map(u64::from),
            temperature: request.temperature,
        };
        if self.exporter.captures_content() {
            let messages: Vec<serde_json::Value> = request
                .messages
                .iter()
                .map(|m| {
                    serde_json::json!({
                        "role": m.role,
                        "parts": [{"type": "text", "content": m.content}],
                    })
                })
                .collect();
            *lock(&self.input) = Some(redact_secrets(
                &serde_json::Value::Array(messages).to_string(),
            ));
        }
    }

    /// One upstream request ended with `row`.
    pub(crate) fn attempt(
        &self,
        row: &TelemetryRow,
        started: Instant,
        ended: Instant,
        server: &(Option<String>, Option<u16>),
    ) {
        let rec = AttemptRecord {
            row: row.clone(),
            start_ns: self.ns(started),
            end_ns: self.ns(ended),
            server_address: server.0.clone(),
            server_port: server.1,
        };
        lock(&self.attempts).push(rec);
    }

    /// The call ended with `result`.
    pub(crate) fn end(&self, at: Instant, result: Result<&LlmResponse, &GatewayError>) {
        let answer = result.map(|r| {
            let facts = AnswerFacts {
                id: response_id(r),
                model: r.model.clone(),
                finish_reason: r.finish_reason.clone(),
                source: r.source.clone(),
                input_tokens: r.usage.prompt_tokens,
                output_tokens: r.usage.completion_tokens,
                cache_read_tokens: r.usage.cached_prompt_tokens,
                cache_write_tokens: r.usage.cache_write_tokens,
                usage_source: r.usage_source.as_str().to_string(),
                ttft_ms: r.ttft_ms,
            };
            let output = self.exporter.captures_content().then(|| {
                redact_secrets(
                    &serde_json::json!([{
                        "role": "assistant",
                        "parts": [{"type": "text", "content": r.content}],
                        "finish_reason": r.finish_reason,
                    }])
                    .to_string(),
                )
            });
            (facts, output, r.call_stats.cache_hit)
        });
        self.end_with(at, answer);
    }

    /// An embedding or OCR call ended: `answer` is what it answered.
    pub(crate) fn end_other(&self, at: Instant, answer: Result<AnswerFacts, &GatewayError>) {
        self.end_with(at, answer.map(|a| (a, None, false)));
    }

    fn end_with(
        &self,
        at: Instant,
        answer: Result<(AnswerFacts, Option<String>, bool), &GatewayError>,
    ) {
        let mut e = lock(&self.ending);
        if e.at.is_some() {
            return;
        }
        e.at = Some(at);
        match answer {
            Ok((facts, output, cache_hit)) => {
                e.answer = Some(facts);
                e.output = output;
                e.cache_hit = cache_hit;
            }
            Err(err) => {
                e.error_type = Some(
                    err.terminal_reason()
                        .map(|r| r.as_str())
                        .unwrap_or("invalid_request")
                        .to_string(),
                );
            }
        }
    }

    /// The model the client named (embedding and OCR calls).
    pub(crate) fn set_model(&self, model: Option<String>) {
        lock(&self.request).model = model;
    }

    /// Hands the finished call to the exporter (the call's last reference is going).
    pub(crate) fn finish(&self, call: &crate::engine::call::CallShared, now: Instant) {
        let ending = std::mem::take(&mut *lock(&self.ending));
        // A call whose future was dropped (the client went away) never ended: it is
        // `cancelled`, as its rows say.
        let error_type = match (&ending.answer, ending.error_type) {
            (None, None) => Some("cancelled".to_string()),
            (_, e) => e,
        };
        let attribution = call.attribution();
        let contents = lock(&self.input).take().map(|input| Contents {
            input,
            output: ending.output,
        });
        self.exporter.export(FinishedCall {
            context: self.context.clone(),
            logical_call_id: call.logical_call_id.clone(),
            scope: self.scope.clone(),
            operation: self.operation.to_string(),
            api: call.api().map(str::to_string),
            stream: call.stream,
            start_ns: self.ns(self.started),
            end_ns: self.ns(ending.at.unwrap_or(now)),
            request: std::mem::take(&mut *lock(&self.request)),
            answer: ending.answer,
            error_type,
            attempts: std::mem::take(&mut *lock(&self.attempts)),
            cache_hit: ending.cache_hit,
            trace: call.trace_snapshot(),
            conversation_id: attribution.session,
            agent_id: attribution.agent,
            client_key_id: call.client_key_id(),
            contents,
        });
    }
}
