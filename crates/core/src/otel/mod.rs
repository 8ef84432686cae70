//! OpenTelemetry (SPEC §26.1), the pure part: what a finished call looks like as spans
//! and metric points in the GenAI semantic conventions. The exporter (an adapter behind
//! [`crate::ports::otel::OtelExporter`]) only turns these into the SDK's types and ships
//! them; every name and value is decided here, where it is unit-tested.
//!
//! The conventions are pinned at [`SEMCONV_VERSION`] (docs/TELEMETRY.md has the table).
//! They are still marked Development; the names used here are the ones of that version
//! (`gen_ai.provider.name`, not the older `gen_ai.system`; the cache token names
//! `gen_ai.usage.cache_read.input_tokens` and `gen_ai.usage.cache_creation.input_tokens`).

pub mod context;
mod redact;

pub use context::{span_id_of, trace_id_of, CallContext, Sampler, SpanId, TraceId, TraceParent};
pub use redact::redact_secrets;

use crate::telemetry::{RowKind, TelemetryRow};
use crate::trace::{CallTrace, TraceEvent};

/// The version of the OpenTelemetry semantic conventions the names follow.
pub const SEMCONV_VERSION: &str = "1.42.0";
/// Its schema URL (set on the instrumentation scope).
pub const SCHEMA_URL: &str = "https://opentelemetry.io/schemas/1.42.0";

/// Attribute names of the pinned conventions, and polygw's own (`polygw.*`).
pub mod attr {
    #![allow(missing_docs)]
    pub const OPERATION_NAME: &str = "gen_ai.operation.name";
    pub const PROVIDER_NAME: &str = "gen_ai.provider.name";
    pub const REQUEST_MODEL: &str = "gen_ai.request.model";
    pub const REQUEST_MAX_TOKENS: &str = "gen_ai.request.max_tokens";
    pub const REQUEST_TEMPERATURE: &str = "gen_ai.request.temperature";
    pub const REQUEST_STREAM: &str = "gen_ai.request.stream";
    pub const RESPONSE_ID: &str = "gen_ai.response.id";
    pub const RESPONSE_MODEL: &str = "gen_ai.response.model";
    pub const RESPONSE_FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
    pub const RESPONSE_TIME_TO_FIRST_CHUNK: &str = "gen_ai.response.time_to_first_chunk";
    pub const USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
    pub const USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
    pub const USAGE_CACHE_READ_INPUT_TOKENS: &str = "gen_ai.usage.cache_read.input_tokens";
    pub const USAGE_CACHE_CREATION_INPUT_TOKENS: &str = "gen_ai.usage.cache_creation.input_tokens";
    pub const USAGE_REASONING_OUTPUT_TOKENS: &str = "gen_ai.usage.reasoning.output_tokens";
    pub const CONVERSATION_ID: &str = "gen_ai.conversation.id";
    pub const AGENT_ID: &str = "gen_ai.agent.id";
    pub const INPUT_MESSAGES: &str = "gen_ai.input.messages";
    pub const OUTPUT_MESSAGES: &str = "gen_ai.output.messages";
    pub const TOKEN_TYPE: &str = "gen_ai.token.type";
    pub const SERVER_ADDRESS: &str = "server.address";
    pub const SERVER_PORT: &str = "server.port";
    pub const ERROR_TYPE: &str = "error.type";
    pub const HTTP_RESPONSE_STATUS_CODE: &str = "http.response.status_code";

    pub const SCOPE: &str = "polygw.scope";
    pub const API: &str = "polygw.api";
    pub const SOURCE: &str = "polygw.source";
    pub const LOGICAL_CALL_ID: &str = "polygw.logical_call_id";
    pub const CALL_ID: &str = "polygw.call_id";
    pub const ATTEMPT_INDEX: &str = "polygw.attempt_index";
    pub const LEG_ROLE: &str = "polygw.leg_role";
    pub const HEDGE_REASON: &str = "polygw.hedge_reason";
    pub const RESUME_MODE: &str = "polygw.resume_mode";
    pub const RESUME_OF: &str = "polygw.resume_of";
    pub const USAGE_SOURCE: &str = "polygw.usage_source";
    pub const COST: &str = "polygw.cost";
    pub const ATTEMPTS: &str = "polygw.attempts";
    pub const HEDGES: &str = "polygw.hedges";
    pub const RESUMES: &str = "polygw.resumes";
    pub const CACHE_HIT: &str = "polygw.cache_hit";
    pub const STALL_COUNT: &str = "polygw.stall_count";
    pub const STALL_MS: &str = "polygw.stall_ms";
    pub const CLIENT_KEY_ID: &str = "polygw.client_key_id";
    pub const OUTCOME: &str = "polygw.outcome";
    pub const LEG: &str = "polygw.leg";
    pub const TRIGGER: &str = "polygw.trigger";
    pub const THRESHOLD_MS: &str = "polygw.threshold_ms";
    pub const REASON: &str = "polygw.reason";
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A string.
    Str(String),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// An array of strings.
    StrArray(Vec<String>),
}

/// An attribute.
pub type Attr = (&'static str, Value);

fn s(v: impl Into<String>) -> Value {
    Value::Str(v.into())
}

fn int(v: u64) -> Value {
    Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
}

/// The kind of a span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// A request to a GenAI service (the call and its upstream requests alike).
    Client,
}

/// One span, ready to be handed to an SDK.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanOut {
    /// Its trace.
    pub trace_id: TraceId,
    /// Its id.
    pub span_id: SpanId,
    /// Its parent, if any.
    pub parent: Option<SpanId>,
    /// Whether the parent is the caller's (another process's) span.
    pub parent_remote: bool,
    /// `{gen_ai.operation.name} {gen_ai.request.model}`.
    pub name: String,
    /// Its kind.
    pub kind: SpanKind,
    /// Start, nanoseconds since the Unix epoch.
    pub start_ns: u64,
    /// End, nanoseconds since the Unix epoch.
    pub end_ns: u64,
    /// Attributes.
    pub attributes: Vec<Attr>,
    /// Events.
    pub events: Vec<EventOut>,
    /// The span's status is Error with this description (the `error.type`).
    pub error: Option<String>,
}

impl SpanOut {
    /// The value of attribute `key`, if set.
    pub fn attr(&self, key: &str) -> Option<&Value> {
        self.attributes
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
    }
}

/// One span event.
#[derive(Debug, Clone, PartialEq)]
pub struct EventOut {
    /// Its name (`polygw.hedge_launched`, `polygw.stall`, `polygw.resume`,
    /// `polygw.commit`, `polygw.no_leg`, `polygw.end`).
    pub name: &'static str,
    /// When, nanoseconds since the Unix epoch.
    pub at_ns: u64,
    /// Attributes.
    pub attributes: Vec<Attr>,
}

/// What the client asked, as far as the span says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestFacts {
    /// The model the client named (the scope's name when it named none).
    pub model: Option<String>,
    /// Its output cap.
    pub max_tokens: Option<u64>,
    /// Its temperature.
    pub temperature: Option<f64>,
}

/// The answer of a call that succeeded.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AnswerFacts {
    /// The upstream's response id, when known.
    pub id: Option<String>,
    /// The model that answered.
    pub model: String,
    /// Its finish reason.
    pub finish_reason: Option<String>,
    /// The source that answered.
    pub source: String,
    /// The usage shown to the client.
    pub input_tokens: u64,
    /// The usage shown to the client.
    pub output_tokens: u64,
    /// Cached prompt tokens read, when reported.
    pub cache_read_tokens: Option<u64>,
    /// Prompt tokens written to the cache, when reported.
    pub cache_write_tokens: Option<u64>,
    /// Where the usage came from (`measured`, `estimated`, …).
    pub usage_source: String,
    /// Time to the first chunk, for streams.
    pub ttft_ms: Option<u64>,
}

/// One upstream request of the call: its row and when it ran.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptRecord {
    /// Its telemetry row.
    pub row: TelemetryRow,
    /// Start, nanoseconds since the Unix epoch.
    pub start_ns: u64,
    /// End, nanoseconds since the Unix epoch.
    pub end_ns: u64,
    /// The source's host.
    pub server_address: Option<String>,
    /// The source's port.
    pub server_port: Option<u16>,
}

/// The message contents, captured only when
/// `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`, secrets redacted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Contents {
    /// `gen_ai.input.messages` (JSON).
    pub input: String,
    /// `gen_ai.output.messages` (JSON), on success.
    pub output: Option<String>,
}

/// A finished logical call: everything its spans and metric points are made of.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishedCall {
    /// Its place in the trace.
    pub context: CallContext,
    /// Its id.
    pub logical_call_id: String,
    /// The scope.
    pub scope: String,
    /// `chat`, `embedding` or `ocr`.
    pub operation: String,
    /// The API route it came by (`chat`, `messages`, `responses`), when known.
    pub api: Option<String>,
    /// Whether the client streamed.
    pub stream: bool,
    /// Start, nanoseconds since the Unix epoch.
    pub start_ns: u64,
    /// End, nanoseconds since the Unix epoch.
    pub end_ns: u64,
    /// The request.
    pub request: RequestFacts,
    /// The answer, when the call succeeded.
    pub answer: Option<AnswerFacts>,
    /// The terminal reason, when it failed.
    pub error_type: Option<String>,
    /// Its upstream requests, in the order they ended.
    pub attempts: Vec<AttemptRecord>,
    /// Whether the cache answered.
    pub cache_hit: bool,
    /// Its decision trace.
    pub trace: CallTrace,
    /// `gen_ai.conversation.id`: the agent session (SPEC §24.6).
    pub conversation_id: Option<String>,
    /// `gen_ai.agent.id`.
    pub agent_id: Option<String>,
    /// The client key's id (never the key).
    pub client_key_id: Option<String>,
    /// The contents, when captured.
    pub contents: Option<Contents>,
}

/// The GenAI operation name of a polygw operation.
pub fn operation_name(operation: &str) -> &str {
    match operation {
        "embedding" => "embeddings",
        other => other,
    }
}

/// The role of an attempt in its call: `primary`, `retry`, `hedge` or `resume`.
pub fn leg_role(row: &TelemetryRow) -> &'static str {
    if row.resume_mode.is_some() {
        "resume"
    } else if row.is_hedge {
        "hedge"
    } else if row.attempt_index.unwrap_or(0) == 0 {
        "primary"
    } else {
        "retry"
    }
}

impl FinishedCall {
    fn request_model(&self) -> &str {
        self.request.model.as_deref().unwrap_or(&self.scope)
    }

    fn at(&self, offset_ms: u64) -> u64 {
        self.start_ns
            .saturating_add(offset_ms.saturating_mul(1_000_000))
            .min(self.end_ns.max(self.start_ns))
    }

    /// The trigger that launched each attempt (its `Launch` event's `by`), by
    /// attempt index: the k-th launch of the trace is attempt k.
    fn triggers(&self) -> Vec<(String, Option<String>)> {
        self.trace
            .events
            .iter()
            .filter_map(|e| match &e.event {
                TraceEvent::Launch { src, by, .. } => Some((src.clone(), by.clone())),
                _ => None,
            })
            .collect()
    }

    /// The total cost of its attempts, when every one is known.
    pub fn cost(&self) -> Option<f64> {
        self.attempts
            .iter()
            .try_fold(0.0, |sum, a| a.row.cost.map(|c| sum + c))
    }

    /// The call's span, then one child span per upstream request.
    pub fn spans(&self) -> Vec<SpanOut> {
        let mut out = Vec::with_capacity(1 + self.attempts.len());
        out.push(self.call_span());
        let triggers = self.triggers();
        for a in &self.attempts {
            out.push(self.attempt_span(a, &triggers));
        }
        out
    }

    fn call_span(&self) -> SpanOut {
        let op = operation_name(&self.operation);
        let model = self.request_model();
        let mut a: Vec<Attr> = vec![
            (attr::OPERATION_NAME, s(op)),
            (attr::REQUEST_MODEL, s(model)),
            (attr::SCOPE, s(&self.scope)),
            (attr::LOGICAL_CALL_ID, s(&self.logical_call_id)),
        ];
        // What is false or zero is left out (every attribute is encoded per span).
        if self.stream {
            a.push((attr::REQUEST_STREAM, Value::Bool(true)));
        }
        if let Some(api) = &self.api {
            a.push((attr::API, s(api)));
        }
        if let Some(m) = self.request.max_tokens {
            a.push((attr::REQUEST_MAX_TOKENS, int(m)));
        }
        if let Some(t) = self.request.temperature {
            a.push((attr::REQUEST_TEMPERATURE, Value::Float(t)));
        }
        if let Some(c) = &self.conversation_id {
            a.push((attr::CONVERSATION_ID, s(c)));
        }
        if let Some(c) = &self.agent_id {
            a.push((attr::AGENT_ID, s(c)));
        }
        if let Some(k) = &self.client_key_id {
            a.push((attr::CLIENT_KEY_ID, s(k)));
        }
        let attempts = self.attempts.len() as u64;
        let hedges = self.attempts.iter().filter(|x| x.row.is_hedge).count() as u64;
        let resumes = self
            .attempts
            .iter()
            .filter(|x| x.row.resume_mode.is_some())
            .count() as u64;
        a.push((attr::ATTEMPTS, int(attempts)));
        if hedges > 0 {
            a.push((attr::HEDGES, int(hedges)));
        }
        if resumes > 0 {
            a.push((attr::RESUMES, int(resumes)));
        }
        if self.cache_hit {
            a.push((attr::CACHE_HIT, Value::Bool(true)));
        }
        if let Some(c) = self.cost() {
            a.push((attr::COST, Value::Float(c)));
        }
        if let Some(r) = &self.answer {
            if let Some(p) = self
                .attempts
                .iter()
                .find(|x| x.row.source.as_deref() == Some(r.source.as_str()) && x.row.ok)
                .and_then(|x| x.row.provider.as_deref())
            {
                a.push((attr::PROVIDER_NAME, s(p)));
            }
            a.push((attr::SOURCE, s(&r.source)));
            if let Some(id) = &r.id {
                a.push((attr::RESPONSE_ID, s(id)));
            }
            a.push((attr::RESPONSE_MODEL, s(&r.model)));
            if let Some(f) = &r.finish_reason {
                a.push((
                    attr::RESPONSE_FINISH_REASONS,
                    Value::StrArray(vec![f.clone()]),
                ));
            }
            a.push((attr::USAGE_INPUT_TOKENS, int(r.input_tokens)));
            a.push((attr::USAGE_OUTPUT_TOKENS, int(r.output_tokens)));
            if let Some(c) = r.cache_read_tokens {
                a.push((attr::USAGE_CACHE_READ_INPUT_TOKENS, int(c)));
            }
            if let Some(c) = r.cache_write_tokens {
                a.push((attr::USAGE_CACHE_CREATION_INPUT_TOKENS, int(c)));
            }
            a.push((attr::USAGE_SOURCE, s(&r.usage_source)));
            if let Some(t) = r.ttft_ms {
                a.push((
                    attr::RESPONSE_TIME_TO_FIRST_CHUNK,
                    Value::Float(t as f64 / 1e3),
                ));
            }
        }
        if let Some(e) = &self.error_type {
            a.push((attr::ERROR_TYPE, s(e)));
        }
        if let Some(c) = &self.contents {
            a.push((attr::INPUT_MESSAGES, s(&c.input)));
            if let Some(o) = &c.output {
                a.push((attr::OUTPUT_MESSAGES, s(o)));
            }
        }
        SpanOut {
            trace_id: self.context.trace_id,
            span_id: self.context.span_id,
            parent: self.context.parent,
            parent_remote: self.context.parent.is_some(),
            name: format!("{op} {model}"),
            kind: SpanKind::Client,
            start_ns: self.start_ns,
            end_ns: self.end_ns.max(self.start_ns),
            attributes: a,
            events: self.events(),
            error: self.error_type.clone(),
        }
    }

    fn events(&self) -> Vec<EventOut> {
        let mut out = Vec::new();
        for e in &self.trace.events {
            let at = self.at(e.t);
            let mut push = |name: &'static str, attributes: Vec<Attr>| {
                out.push(EventOut {
                    name,
                    at_ns: at,
                    attributes,
                })
            };
            match &e.event {
                TraceEvent::Round { .. } => {}
                TraceEvent::Launch {
                    leg,
                    src,
                    why,
                    by,
                    mode,
                    thr_ms,
                    ..
                } => {
                    let mut a = vec![(attr::LEG, int(*leg as u64)), (attr::SOURCE, s(src))];
                    if let Some(b) = by {
                        a.push((attr::TRIGGER, s(b)));
                    }
                    if let Some(t) = thr_ms {
                        a.push((attr::THRESHOLD_MS, int(*t)));
                    }
                    if by.as_deref() == Some("stall") {
                        push("polygw.stall", a.clone());
                    }
                    match why.as_str() {
                        "hedge" => push("polygw.hedge_launched", a),
                        "resume" => {
                            if let Some(m) = mode {
                                a.push((attr::RESUME_MODE, s(m)));
                            }
                            push("polygw.resume", a)
                        }
                        // Primary and retry legs are the child spans themselves.
                        _ => {}
                    }
                }
                TraceEvent::NoLeg { leg, by, why } => {
                    let a = vec![
                        (attr::LEG, int(*leg as u64)),
                        (attr::TRIGGER, s(by)),
                        (attr::REASON, s(why)),
                    ];
                    if by == "stall" {
                        push("polygw.stall", a.clone());
                    }
                    push("polygw.no_leg", a)
                }
                TraceEvent::Commit { leg } => {
                    push("polygw.commit", vec![(attr::LEG, int(*leg as u64))])
                }
                // A leg's first token, cancellation, failure and win are on its span
                // (its times, status and `error.type`).
                TraceEvent::FirstToken { .. }
                | TraceEvent::Cancel { .. }
                | TraceEvent::Fail { .. }
                | TraceEvent::Won { .. } => {}
                TraceEvent::End { why } => push("polygw.end", vec![(attr::REASON, s(why))]),
            }
        }
        out
    }

    fn attempt_span(&self, x: &AttemptRecord, triggers: &[(String, Option<String>)]) -> SpanOut {
        let r = &x.row;
        let op = operation_name(&r.operation);
        let model = r.model.as_deref().unwrap_or("unknown");
        let mut a: Vec<Attr> = vec![
            (attr::OPERATION_NAME, s(op)),
            (attr::REQUEST_MODEL, s(model)),
            (attr::CALL_ID, s(&r.call_id)),
            (attr::LEG_ROLE, s(leg_role(r))),
            (attr::USAGE_SOURCE, s(r.usage_source.as_str())),
        ];
        if let Some(p) = &r.provider {
            a.push((attr::PROVIDER_NAME, s(&**p)));
        }
        if let Some(src) = &r.source {
            a.push((attr::SOURCE, s(&**src)));
        }
        if let Some(i) = r.attempt_index {
            a.push((attr::ATTEMPT_INDEX, int(u64::from(i))));
            if let Some((src, Some(by))) = triggers.get(i as usize) {
                if r.source.as_deref() == Some(src.as_str()) && r.is_hedge {
                    a.push((attr::HEDGE_REASON, s(by)));
                }
            }
        }
        if let Some(h) = &x.server_address {
            a.push((attr::SERVER_ADDRESS, s(h)));
        }
        if let Some(p) = x.server_port {
            a.push((attr::SERVER_PORT, int(u64::from(p))));
        }
        if let Some(m) = &r.resume_mode {
            a.push((attr::RESUME_MODE, s(m)));
        }
        if let Some(o) = &r.resume_of {
            a.push((attr::RESUME_OF, s(o)));
        }
        if let Some(st) = r.http_status {
            a.push((attr::HTTP_RESPONSE_STATUS_CODE, int(u64::from(st))));
        }
        if let Some(t) = r.prompt_tokens {
            a.push((attr::USAGE_INPUT_TOKENS, int(t)));
        }
        if let Some(t) = r.completion_tokens {
            a.push((attr::USAGE_OUTPUT_TOKENS, int(t)));
        }
        if let Some(t) = r.cached_prompt_tokens {
            a.push((attr::USAGE_CACHE_READ_INPUT_TOKENS, int(t)));
        }
        if let Some(t) = r.cache_write_tokens {
            a.push((attr::USAGE_CACHE_CREATION_INPUT_TOKENS, int(t)));
        }
        if let Some(t) = r.reasoning_tokens {
            a.push((attr::USAGE_REASONING_OUTPUT_TOKENS, int(t)));
        }
        if let Some(c) = r.cost {
            a.push((attr::COST, Value::Float(c)));
        }
        if let Some(t) = r.ttft_ms {
            a.push((
                attr::RESPONSE_TIME_TO_FIRST_CHUNK,
                Value::Float(t as f64 / 1e3),
            ));
        }
        if let Some(n) = r.stall_count.filter(|n| *n > 0) {
            a.push((attr::STALL_COUNT, int(u64::from(n))));
            if let Some(ms) = r.stall_ms {
                a.push((attr::STALL_MS, int(ms)));
            }
        }
        // The answering attempt carries the response's identity.
        let answered = self
            .answer
            .as_ref()
            .filter(|ans| r.ok && r.source.as_deref() == Some(ans.source.as_str()));
        if let Some(ans) = answered {
            a.push((attr::RESPONSE_MODEL, s(&ans.model)));
            if let Some(id) = &ans.id {
                a.push((attr::RESPONSE_ID, s(id)));
            }
            if let Some(f) = &ans.finish_reason {
                a.push((
                    attr::RESPONSE_FINISH_REASONS,
                    Value::StrArray(vec![f.clone()]),
                ));
            }
        }
        let error = if r.ok { None } else { r.error.clone() };
        if let Some(e) = &error {
            a.push((attr::ERROR_TYPE, s(e)));
        }
        SpanOut {
            trace_id: self.context.trace_id,
            span_id: span_id_of(&r.call_id),
            parent: Some(self.context.span_id),
            parent_remote: false,
            name: format!("{op} {model}"),
            kind: SpanKind::Client,
            start_ns: x.start_ns,
            end_ns: x.end_ns.max(x.start_ns),
            attributes: a,
            events: Vec::new(),
            error,
        }
    }

    /// The metric points of the call (SPEC §26.1): per upstream request, the GenAI
    /// client metrics; per call, polygw's counters.
    pub fn metric_points(&self) -> Vec<Point> {
        let mut out = Vec::new();
        let op = operation_name(&self.operation);
        for x in &self.attempts {
            let r = &x.row;
            // The source names its scope: the request's points carry no `polygw.scope`
            // (each attribute is hashed at every measurement).
            let mut base: Vec<Attr> = vec![
                (attr::OPERATION_NAME, s(op)),
                (
                    attr::REQUEST_MODEL,
                    s(r.model.as_deref().unwrap_or("unknown")),
                ),
            ];
            if let Some(p) = &r.provider {
                base.push((attr::PROVIDER_NAME, s(&**p)));
            }
            if let Some(h) = &x.server_address {
                base.push((attr::SERVER_ADDRESS, s(h)));
            }
            if let Some(src) = &r.source {
                base.push((attr::SOURCE, s(&**src)));
            }
            let mut dur = base.clone();
            if let (false, Some(e)) = (r.ok, &r.error) {
                dur.push((attr::ERROR_TYPE, s(e)));
            }
            out.push(Point {
                instrument: Instrument::OperationDuration,
                value: x.end_ns.saturating_sub(x.start_ns) as f64 / 1e9,
                attributes: dur,
            });
            for (kind, n) in [("input", r.prompt_tokens), ("output", r.completion_tokens)] {
                if let Some(n) = n {
                    let mut t = base.clone();
                    t.push((attr::TOKEN_TYPE, s(kind)));
                    out.push(Point {
                        instrument: Instrument::TokenUsage,
                        value: n as f64,
                        attributes: t,
                    });
                }
            }
            if let Some(t) = r.ttft_ms {
                out.push(Point {
                    instrument: Instrument::TimeToFirstChunk,
                    value: t as f64 / 1e3,
                    attributes: base.clone(),
                });
            }
            let mut at = base.clone();
            at.push((attr::LEG_ROLE, s(leg_role(r))));
            at.push((
                attr::OUTCOME,
                s(if r.ok {
                    "ok"
                } else {
                    r.error.as_deref().unwrap_or("error")
                }),
            ));
            out.push(Point {
                instrument: Instrument::Attempts,
                value: 1.0,
                attributes: at,
            });
            if let Some(c) = r.cost.filter(|c| *c > 0.0) {
                out.push(Point {
                    instrument: Instrument::Cost,
                    value: c,
                    attributes: base,
                });
            }
        }
        let outcome = match (&self.error_type, self.cache_hit) {
            (Some(e), _) => e.clone(),
            (None, true) => "cache_hit".to_string(),
            (None, false) => "ok".to_string(),
        };
        let call_attrs = vec![
            (attr::OPERATION_NAME, s(op)),
            (attr::SCOPE, s(&self.scope)),
            (attr::OUTCOME, s(outcome)),
        ];
        out.push(Point {
            instrument: Instrument::Calls,
            value: 1.0,
            attributes: call_attrs.clone(),
        });
        out.push(Point {
            instrument: Instrument::CallDuration,
            value: self.end_ns.saturating_sub(self.start_ns) as f64 / 1e9,
            attributes: call_attrs,
        });
        out
    }
}

/// The instruments (SPEC §26.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Instrument {
    /// `gen_ai.client.token.usage` (histogram, `{token}`), per upstream request.
    TokenUsage,
    /// `gen_ai.client.operation.duration` (histogram, `s`), per upstream request.
    OperationDuration,
    /// `gen_ai.client.operation.time_to_first_chunk` (histogram, `s`), per streamed
    /// upstream request that received a chunk.
    TimeToFirstChunk,
    /// `polygw.attempts` (counter): upstream requests, by role and outcome.
    Attempts,
    /// `polygw.cost` (counter, `USD`): the known cost of upstream requests.
    Cost,
    /// `polygw.calls` (counter): logical calls, by outcome.
    Calls,
    /// `polygw.call.duration` (histogram, `s`): logical calls, as the client waited.
    CallDuration,
}

impl Instrument {
    /// Every instrument.
    pub const ALL: [Instrument; 7] = [
        Instrument::TokenUsage,
        Instrument::OperationDuration,
        Instrument::TimeToFirstChunk,
        Instrument::Attempts,
        Instrument::Cost,
        Instrument::Calls,
        Instrument::CallDuration,
    ];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Instrument::TokenUsage => "gen_ai.client.token.usage",
            Instrument::OperationDuration => "gen_ai.client.operation.duration",
            Instrument::TimeToFirstChunk => "gen_ai.client.operation.time_to_first_chunk",
            Instrument::Attempts => "polygw.attempts",
            Instrument::Cost => "polygw.cost",
            Instrument::Calls => "polygw.calls",
            Instrument::CallDuration => "polygw.call.duration",
        }
    }

    /// Its unit.
    pub fn unit(self) -> &'static str {
        match self {
            Instrument::TokenUsage => "{token}",
            Instrument::OperationDuration
            | Instrument::TimeToFirstChunk
            | Instrument::CallDuration => "s",
            Instrument::Attempts => "{request}",
            Instrument::Cost => "USD",
            Instrument::Calls => "{call}",
        }
    }

    /// Whether it is a histogram (else a monotonic counter).
    pub fn is_histogram(self) -> bool {
        matches!(
            self,
            Instrument::TokenUsage
                | Instrument::OperationDuration
                | Instrument::TimeToFirstChunk
                | Instrument::CallDuration
        )
    }

    /// The bucket boundaries the conventions advise, for a histogram.
    pub fn boundaries(self) -> &'static [f64] {
        match self {
            Instrument::TokenUsage => &[
                1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0,
                4194304.0, 16777216.0, 67108864.0,
            ],
            Instrument::OperationDuration
            | Instrument::TimeToFirstChunk
            | Instrument::CallDuration => &[
                0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
                81.92,
            ],
            _ => &[],
        }
    }

    /// Its description.
    pub fn description(self) -> &'static str {
        match self {
            Instrument::TokenUsage => "Tokens used per upstream request, by token type",
            Instrument::OperationDuration => "Duration of each upstream GenAI request",
            Instrument::TimeToFirstChunk => {
                "Time to the first chunk of a streamed upstream request"
            }
            Instrument::Attempts => "Upstream requests, by leg role and outcome",
            Instrument::Cost => "Known cost of upstream requests, in USD",
            Instrument::Calls => "Logical calls, by outcome",
            Instrument::CallDuration => "Duration of logical calls, as the client waited",
        }
    }
}

/// One measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// Which instrument.
    pub instrument: Instrument,
    /// The value.
    pub value: f64,
    /// Its attributes.
    pub attributes: Vec<Attr>,
}

/// Whether a row is one of a call's upstream requests (the others are the terminal and
/// cache-hit rows, which the call span itself describes).
pub fn is_upstream_request(row: &TelemetryRow) -> bool {
    row.kind == RowKind::Attempt
}

#[cfg(test)]
mod tests;
