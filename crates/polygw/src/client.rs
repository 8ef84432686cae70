//! [`GatewayClient`]: one scope as one chat endpoint. Cheap to clone; `chat()` is a
//! `Send`, cancel-safe future (dropping it cancels every attempt, SPEC §9).

use std::sync::Arc;

use futures_util::future::{BoxFuture, FutureExt};
use polygw_core::cache_key::cache_key;
use polygw_core::hedge::HedgePolicy;
use polygw_core::ports::{ChatAttempt, ChunkObserver, TransportResult};
use polygw_core::resume::{
    estimate_prompt_tokens, estimate_tokens, prefill_expressible, prefill_request, PrefillDialect,
    ResumeMode,
};
use polygw_core::round::LegKind;
use polygw_core::stall::{generation_ms, ms};
use polygw_core::usage::{call_usage, LegUsage};
use polygw_core::{
    AttemptError, CallStats, ChatRequest, ConfigWarning, GatewayError, GovernanceError,
    LlmResponse, SourceConfig, ToolCall,
};
use tracing::Instrument;

use crate::clock::new_id;
use crate::engine::attempt::{Leg, SuccessFacts};
use crate::engine::call::CallShared;
use crate::engine::round::{DeltaSink, Won};
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::stream::ChatStream;

/// Options of one call.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CallOptions {
    /// The longest this call may go without progress — waiting for admission, or in
    /// rate-limited rounds — before it ends `stalled` (with `retry_after`, the earliest
    /// time a source could take it): the scope's `RETRY__STALL_WINDOW_S`, lowered for
    /// this call. `polygw serve --max-wait-s` uses it to answer 429 instead of holding
    /// a client.
    pub max_wait: Option<std::time::Duration>,
    /// What errors call [`CallOptions::max_wait`] when it is the bound that ended a call
    /// (`polygw serve` says `--max-wait-s`).
    pub max_wait_name: Option<String>,
    /// The call's `logical_call_id`, when the caller must know it before the call
    /// starts (`polygw serve` answers with it in `x-request-id`, also when it sends its
    /// headers before the first chunk). Default: a new UUIDv7. It must be unique.
    pub logical_call_id: Option<String>,
    /// The API route the call came by (`chat`, `responses`, `messages`: the telemetry
    /// `api` column, SPEC §18.4); `None` for a library call.
    pub api: Option<&'static str>,
    /// The call's affinity key (SPEC §20.2): the client's `prompt_cache_key`, session id
    /// or user (`polygw serve` passes what the request and its headers carry). `None`:
    /// the request's own `prompt_cache_key`, `metadata.session_id` or `user` (in its
    /// overlay), else a hash of its system prompt and first user message. Under
    /// `{S}__AFFINITY=session` a key sticks to the source that last served it.
    pub affinity_key: Option<String>,
    /// The client key the call is charged to (SPEC §21.1): admitted before the call
    /// ([`GatewayClient::admit_key`]), settled with what all its attempts spent; its id is
    /// every row's `client_key_id`.
    pub client_key: Option<crate::client_keys::KeyGrant>,
    /// The agent session and agents the call is for (SPEC §24.6): on every row of it.
    pub attribution: polygw_core::telemetry::Attribution,
    /// The caller's W3C `traceparent` (SPEC §26.1): the call's span continues its
    /// trace. `polygw serve` passes the client's header.
    pub trace_parent: Option<polygw_core::otel::TraceParent>,
    /// The model the client named (the span's `gen_ai.request.model`); default: the
    /// scope's name.
    pub model: Option<String>,
}

impl CallOptions {
    /// Sets [`CallOptions::max_wait`].
    pub fn with_max_wait(mut self, d: std::time::Duration) -> Self {
        self.max_wait = Some(d);
        self
    }

    /// Sets [`CallOptions::max_wait`] and the name errors give it.
    pub fn with_max_wait_named(mut self, d: std::time::Duration, name: impl Into<String>) -> Self {
        self.max_wait = Some(d);
        self.max_wait_name = Some(name.into());
        self
    }

    /// Charges the call to a client key ([`CallOptions::client_key`]).
    pub fn with_client_key(mut self, charge: Arc<crate::client_keys::KeyCharge>) -> Self {
        self.client_key = Some(crate::client_keys::KeyGrant(charge));
        self
    }

    /// Sets [`CallOptions::affinity_key`].
    pub fn with_affinity_key(mut self, key: impl Into<String>) -> Self {
        self.affinity_key = Some(key.into());
        self
    }

    /// Sets [`CallOptions::logical_call_id`].
    pub fn with_logical_call_id(mut self, id: impl Into<String>) -> Self {
        self.logical_call_id = Some(id.into());
        self
    }

    /// A new logical call id (what a call gets when none is given).
    pub fn new_logical_call_id() -> String {
        new_id()
    }
}

/// A chat client over one scope. See the crate documentation for an example.
#[derive(Clone, Debug)]
pub struct GatewayClient {
    pub(crate) engine: Arc<Engine>,
    pub(crate) warnings: Arc<Vec<ConfigWarning>>,
}

crate::scope_client::scope_client!(GatewayClient, polygw_core::ScopeKind::Chat, build);

/// The chat attempt.
struct ChatLeg<'r> {
    request: &'r ChatRequest,
    /// The request's signed blobs placed in their families (SPEC §23.5), when the
    /// scope's sources of its API belong to more than one.
    placed: Option<&'r polygw_core::native::family::Placed>,
}

impl ChatLeg<'_> {
    /// The request as `source`'s family may receive it: `None` when it is (no signed
    /// blob another family produced).
    fn for_family(&self, engine: &Engine, source: &SourceConfig) -> Option<ChatRequest> {
        let placed = self.placed?;
        let native = self.request.native.as_ref()?;
        if native.api != source.api || !placed.any_foreign(source.family()) {
            return None;
        }
        let mut body = native.body.clone();
        let s = placed.keep_for(native.api, &mut body, source.family());
        if s.removed == 0 {
            return None;
        }
        tracing::info!(
            scope = %engine.scope.name,
            source = %source.name,
            family = %source.family(),
            removed = s.removed,
            thinking_off = s.thinking_off,
            "signed blocks another signature family produced were removed for this source"
        );
        let mut out = self.request.clone();
        out.native = Some(Arc::new(polygw_core::native::NativeRequest {
            body,
            ..(**native).clone()
        }));
        Some(out)
    }
}

impl<'r> ChatLeg<'r> {
    /// Sends the attempt to `source` as given.
    fn send<'a>(
        &'a self,
        engine: &'a Engine,
        source: &'a SourceConfig,
        call_id: &'a str,
        traceparent: Option<&'a str>,
        observer: &'a dyn ChunkObserver,
        kind: &'a LegKind,
    ) -> BoxFuture<'a, Result<TransportResult, AttemptError>> {
        let stall_threshold = engine.scope.stream.stall_threshold;
        match kind {
            LegKind::Resume {
                mode: ResumeMode::Prefill,
                prefix,
                ..
            } => {
                // The original request plus the delivered text as an assistant
                // prefill in the source's dialect; max tokens reduced by what was
                // delivered (estimated).
                let dialect = source.prefill.unwrap_or(PrefillDialect::Assistant);
                let request =
                    prefill_request(self.request, dialect, prefix, estimate_tokens(prefix));
                async move {
                    let attempt = ChatAttempt {
                        source,
                        request: &request,
                        call_id,
                        stall_threshold,
                        observer,
                        traceparent,
                    };
                    engine.ports.transport.chat(attempt).await
                }
                .boxed()
            }
            // Fresh legs and replays send the original request.
            _ => engine.ports.transport.chat(ChatAttempt {
                source,
                request: self.request,
                call_id,
                stall_threshold,
                observer,
                traceparent,
            }),
        }
    }
}

/// `request` with the signed state of its native body removed, and what went; `None`
/// when it had none (the refusal then stands).
fn without_signed_state(
    request: &ChatRequest,
) -> Option<(ChatRequest, polygw_core::native::signed::Stripped)> {
    let native = request.native.as_ref()?;
    let mut body = native.body.clone();
    let stripped = polygw_core::native::signed::strip_signed(native.api, &mut body);
    if stripped.removed == 0 {
        return None;
    }
    let mut out = request.clone();
    out.native = Some(Arc::new(polygw_core::native::NativeRequest {
        body,
        ..(**native).clone()
    }));
    Some((out, stripped))
}

impl Leg for ChatLeg<'_> {
    type Output = TransportResult;

    fn stream(&self) -> bool {
        self.request.stream
    }

    fn call<'a>(
        &'a self,
        engine: &'a Engine,
        source: &'a SourceConfig,
        call_id: &'a str,
        traceparent: Option<&'a str>,
        observer: &'a dyn ChunkObserver,
        kind: &'a LegKind,
    ) -> BoxFuture<'a, Result<TransportResult, AttemptError>> {
        async move {
            // What the process learned about the source (SPEC §24.4).
            let learned = engine.learned_source(source);
            let src = learned.as_ref().unwrap_or(source);
            // Only what the source's signature family can verify (SPEC §23.5).
            let adapted = self.for_family(engine, src);
            let this = ChatLeg {
                request: adapted.as_ref().unwrap_or(self.request),
                placed: None,
            };
            let r = this
                .send(engine, src, call_id, traceparent, observer, kind)
                .await;
            match r {
                // The source takes the cap only as `max_completion_tokens`: learned,
                // and the request sent again at once — not a failure of the call.
                Err(e)
                    if src.api == polygw_core::source::SourceApi::Chat
                        && !src.max_completion_tokens
                        && polygw_core::classify::wants_max_completion_tokens(&e) =>
                {
                    engine.mark_max_completion_tokens(source);
                    let again = SourceConfig {
                        max_completion_tokens: true,
                        ..src.clone()
                    };
                    this.send(engine, &again, call_id, traceparent, observer, kind)
                        .await
                }
                // The source refused signed state another source produced (thinking
                // signatures, encrypted reasoning; SPEC §23.5's safety net): sent once
                // more, at once, without it — not a failure of the call.
                Err(e)
                    if this
                        .request
                        .native
                        .as_ref()
                        .is_some_and(|n| n.api == src.api)
                        && polygw_core::native::signed::signature_rejection(src.api, &e) =>
                {
                    match without_signed_state(this.request) {
                        Some((request, stripped)) => {
                            tracing::warn!(
                                scope = %engine.scope.name,
                                source = %src.name,
                                removed = stripped.removed,
                                thinking_off = stripped.thinking_off,
                                "the source refused signed state from another source (thinking \
                                 signatures or encrypted reasoning): sent once more without it"
                            );
                            ChatLeg {
                                request: &request,
                                placed: None,
                            }
                            .send(engine, src, call_id, traceparent, observer, kind)
                            .await
                        }
                        None => Err(e),
                    }
                }
                r => r,
            }
        }
        .boxed()
    }

    fn estimate_prompt_tokens(&self) -> u64 {
        estimate_prompt_tokens(self.request)
    }

    fn reasoning_effort(&self) -> Option<&str> {
        self.request.reasoning_effort.as_deref().or_else(|| {
            let o = self.request.overlay.as_ref()?;
            o.get("reasoning_effort")
                .or_else(|| o.get("reasoning").and_then(|r| r.get("effort")))
                .and_then(serde_json::Value::as_str)
        })
    }

    fn single_choice(&self) -> bool {
        self.request
            .overlay
            .as_ref()
            .and_then(|o| o.get("n"))
            .and_then(serde_json::Value::as_u64)
            .is_none_or(|n| n <= 1)
    }

    fn max_output_tokens(&self) -> u64 {
        let overlay = self.request.overlay.as_ref().and_then(|o| {
            ["max_completion_tokens", "max_tokens"]
                .iter()
                .find_map(|k| o.get(*k).and_then(serde_json::Value::as_u64))
        });
        overlay
            .or(self.request.max_tokens.map(u64::from))
            .unwrap_or(0)
    }

    fn estimates_usage(&self) -> bool {
        true
    }

    fn servable_by(&self, source: &SourceConfig) -> bool {
        self.request.servable_by(source)
    }

    fn resumable(&self) -> bool {
        // Native streams too (SPEC §23.6): the proxy's encoder continues the stream the
        // client received (by prefill or replay; see `prefill_allowed`).
        true
    }

    fn prefill_allowed(&self, source: &SourceConfig) -> bool {
        prefill_expressible(self.request, source)
    }

    fn received_bytes(&self, out: &TransportResult) -> usize {
        out.content.len()
            + out.reasoning_content.as_deref().map_or(0, str::len)
            + out
                .tool_calls
                .iter()
                .map(|t| t.arguments.len() + t.name.as_ref().map_or(0, String::len))
                .sum::<usize>()
    }

    fn facts(&self, out: &TransportResult) -> SuccessFacts {
        SuccessFacts {
            usage: out.usage,
            usage_source: out.usage_source,
            figures: out.stream,
            http_status: out.http_status,
            model: out.model.clone(),
            per_call_cost: false,
            settle_override: None,
            estimate: None,
        }
    }
}

/// Runs `fut` under the call deadline: on expiry every leg is dropped (their rows say
/// `deadline`) and the call ends with `deadline_exceeded`.
///
/// The call's future (the round, its legs, the transport: ≈ 10 KiB) is boxed here,
/// before it is stored in any other future: the future a caller holds stays small, so
/// moving it (into a task, a `select!`, a join set) copies a pointer, not the whole
/// state (docs/BENCHMARKS.md, "Call overhead").
pub(crate) fn with_deadline<'a, T: 'a>(
    engine: &'a Engine,
    call: &'a CallShared,
    fut: impl std::future::Future<Output = Result<T, GatewayError>> + Send + 'a,
) -> impl std::future::Future<Output = Result<T, GatewayError>> + Send + 'a {
    deadline_boxed(engine, call, Box::pin(fut))
}

async fn deadline_boxed<T>(
    engine: &Engine,
    call: &CallShared,
    mut fut: std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<T, GatewayError>> + Send + '_>,
    >,
) -> Result<T, GatewayError> {
    let Some(deadline) = engine.scope.call_deadline else {
        return fut.await;
    };
    let left = (call.started + deadline).saturating_duration_since(engine.ports.clock.now());
    match tokio::time::timeout(left, &mut fut).await {
        Ok(r) => r,
        Err(_) => {
            call.mark_deadline();
            drop(fut);
            Err(engine.deadline_error(call))
        }
    }
}

impl GatewayClient {
    /// Forwards a request to another endpoint of the scope's first source (by
    /// priority) that speaks `api` (SPEC §23.7: `count_tokens`), outside its quotas;
    /// `None` when no source speaks it. The answer comes as the source sent it.
    pub async fn native_call(
        &self,
        api: polygw_core::source::SourceApi,
        endpoint: &str,
        body: &serde_json::Map<String, serde_json::Value>,
        headers: &[(String, String)],
        client: Option<&polygw_core::request::ClientCredential>,
    ) -> Option<Result<polygw_core::ports::NativeAnswer, polygw_core::AttemptError>> {
        let source = self
            .engine
            .scope
            .sources
            .iter()
            .filter(|s| s.api == api)
            .filter(|s| client.is_some() || s.auth != Some(polygw_core::source::SourceAuth::Client))
            .min_by_key(|s| s.priority)?;
        let call_id = new_id();
        let call = polygw_core::ports::NativeCall {
            source,
            endpoint,
            body,
            headers,
            client,
            call_id: &call_id,
        };
        Some(self.engine.ports.transport.native_call(call).await)
    }

    /// The client's metrics.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.engine.metrics.clone()
    }

    /// The store of OpenAI Responses answers of this scope (`polygw serve`'s
    /// `/v1/responses` with `store`).
    pub fn response_store(&self) -> Arc<dyn polygw_core::ports::ResponseStore> {
        self.engine.ports.responses.clone()
    }

    /// Admits a call of `request` against the client key `key` (SPEC §21.1), before the
    /// call: the key's RPM, TPM, concurrency and budgets, reserved at the call's
    /// estimate and this scope's highest prices, atomically in the governance backend.
    /// The charge goes into [`CallOptions::with_client_key`]; it settles by itself when
    /// the call and its attempts are done. Refused: over a limit (the
    /// refusal names it and when it passes); or the backend failed (fail closed).
    pub async fn admit_key(
        &self,
        key: &polygw_core::client_key::ClientKey,
        request: &ChatRequest,
    ) -> Result<Arc<crate::client_keys::KeyCharge>, crate::client_keys::KeyAdmitError> {
        self.engine
            .admit_key(
                key,
                polygw_core::resume::estimate_prompt_tokens(request),
                request.output_cap(),
            )
            .await
    }

    /// Restores a client key's spend of the current UTC day and month into this scope's
    /// governance backend when its state does not outlive the process (memory; SPEC
    /// §24.2); `Ok(false)` when the backend keeps spend itself (Redis).
    pub async fn restore_key_spend(
        &self,
        key_id: &str,
        day_nanos: u64,
        month_nanos: u64,
    ) -> Result<bool, polygw_core::GovernanceError> {
        self.engine
            .ports
            .limiter
            .restore_key_spend(key_id, day_nanos, month_nanos)
            .await
    }

    /// A client key's figures in this scope's governance backend (in flight, the
    /// window's requests and tokens, the day's and month's spend).
    pub async fn key_usage(
        &self,
        key_id: &str,
    ) -> Result<polygw_core::ports::KeyUsage, polygw_core::GovernanceError> {
        self.engine.ports.limiter.key_usage(key_id).await
    }

    /// The hedge thresholds in force now for each source (SPEC §19), for requests
    /// streamed or plain: the value and where it comes from (configured, the source's
    /// distribution, the scope's pooled one, or not yet: too few samples).
    pub fn hedge_thresholds(&self, stream: bool) -> Vec<(String, polygw_core::hedge::Thresholds)> {
        let e = &self.engine;
        let now = e.ports.clock.now();
        let fill = e.budget().fill(now, e.scope.hedge.budget_pct);
        let t = e.latency.thresholds(stream, now, fill);
        e.scope
            .sources
            .iter()
            .map(|s| s.name.clone())
            .zip(t)
            .collect()
    }

    /// The live latency distributions `auto` thresholds come from (SPEC §19.1), per
    /// source: time to first token and each streamed leg's longest gap, observed and
    /// censored samples (legs cancelled or cut before the event), for streamed
    /// (`stream`) or plain requests. Empty sketches when no trigger is `auto`.
    pub fn hedge_latency(
        &self,
        stream: bool,
    ) -> Vec<(String, polygw_core::latency::LatencySnapshot)> {
        let e = &self.engine;
        let v = e.latency.views(stream, e.ports.clock.now());
        e.scope
            .sources
            .iter()
            .map(|s| s.name.clone())
            .zip(v)
            .collect()
    }

    /// Exchanges the sources' latency distributions with the shared store now (with Redis
    /// governance this happens every 5 s by itself): this process's samples out, every
    /// process's merge in.
    pub async fn exchange_latency(&self) -> Result<(), GatewayError> {
        crate::engine::latency::exchange_once(&self.engine)
            .await
            .map_err(|e| {
                GatewayError::terminal(
                    polygw_core::TerminalReason::GovernanceBackend,
                    polygw_core::FailureContext {
                        detail: Some(e.to_string()),
                        ..Default::default()
                    },
                )
            })
    }

    /// Telemetry rows dropped so far (queue overflow).
    pub fn telemetry_dropped(&self) -> u64 {
        self.engine.ports.telemetry.dropped()
    }

    /// In-flight attempts of a source, as the limiter sees them.
    pub async fn in_flight(&self, source: &str) -> Result<u32, GovernanceError> {
        self.engine
            .ports
            .limiter
            .in_flight(&self.engine.scope.name, source)
            .await
    }

    /// One logical chat call: cache, retry loop with admission and hedging, telemetry.
    pub async fn chat(&self, request: ChatRequest) -> Result<LlmResponse, GatewayError> {
        self.chat_inner(request, None, CallOptions::default()).await
    }

    /// [`GatewayClient::chat`] with per-call options.
    pub async fn chat_with(
        &self,
        request: ChatRequest,
        options: CallOptions,
    ) -> Result<LlmResponse, GatewayError> {
        self.chat_inner(request, None, options).await
    }

    /// Like [`GatewayClient::chat`], streaming the committed leg's chunks to `sink` as
    /// they arrive (passthrough; the request must have `stream = true`). After the
    /// first incremental chunk only resume legs start: a failure or a stall is
    /// continued on another attempt (SPEC §13) when the scope allows it.
    pub async fn chat_streaming(
        &self,
        request: ChatRequest,
        sink: Arc<dyn DeltaSink>,
    ) -> Result<LlmResponse, GatewayError> {
        self.chat_inner(request, Some(sink), CallOptions::default())
            .await
    }

    /// A streamed chat call as a `futures::Stream` of [`ChatEvent`]s: the committed
    /// leg's chunks as they arrive, resumed on another attempt after a failure or a
    /// stall when the scope allows it (SPEC §13), then the whole answer. The request
    /// is streamed from the upstream whatever its `stream` says. Dropping the stream
    /// cancels the call.
    ///
    /// [`ChatEvent`]: crate::ChatEvent
    pub fn chat_stream(&self, request: ChatRequest) -> ChatStream {
        self.chat_stream_with(request, CallOptions::default())
    }

    /// [`GatewayClient::chat_stream`] with per-call options.
    pub fn chat_stream_with(&self, mut request: ChatRequest, options: CallOptions) -> ChatStream {
        request.stream = true;
        let client = self.clone();
        ChatStream::new(move |sink| {
            Box::pin(async move { client.chat_inner(request, Some(sink), options).await })
        })
    }

    pub(crate) fn new_call(&self, stream: bool) -> (Arc<CallShared>, tracing::Span) {
        self.new_call_with_id(stream, None)
    }

    pub(crate) fn new_call_with_id(
        &self,
        stream: bool,
        id: Option<String>,
    ) -> (Arc<CallShared>, tracing::Span) {
        let engine = &self.engine;
        let id = id.unwrap_or_else(new_id);
        let call = Arc::new(CallShared::new(
            id,
            engine.ports.clock.now(),
            stream,
            engine.ports.clock.clone(),
        ));
        let span = tracing::info_span!(
            "polygw.chat",
            gen_ai.operation.name = "chat",
            polygw.scope = %engine.scope.name,
            polygw.logical_call_id = %call.logical_call_id,
            polygw.stream = stream,
            gen_ai.request.max_tokens = tracing::field::Empty,
            gen_ai.request.temperature = tracing::field::Empty,
            gen_ai.response.model = tracing::field::Empty,
            gen_ai.response.finish_reasons = tracing::field::Empty,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            polygw.source = tracing::field::Empty,
            polygw.attempts = tracing::field::Empty,
            polygw.hedges = tracing::field::Empty,
            polygw.hedge_won = tracing::field::Empty,
            polygw.cache_hit = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        (call, span)
    }

    async fn chat_inner(
        &self,
        request: ChatRequest,
        sink: Option<Arc<dyn DeltaSink>>,
        options: CallOptions,
    ) -> Result<LlmResponse, GatewayError> {
        request
            .validate()
            .map_err(|(field, message)| GatewayError::InvalidRequest { field, message })?;
        // A budgeted key's call is sent the cap it reserved for when it had none, or a
        // smaller one than its own that its budget pays for (SPEC §24.1).
        let request = match options.client_key.as_ref().and_then(|k| k.0.sent_cap()) {
            Some(cap) if request.output_cap().is_none_or(|own| own > cap) => {
                request.set_output_cap(cap)
            }
            _ => request,
        };
        let engine = &self.engine;
        let (call, span) = self.new_call_with_id(request.stream, options.logical_call_id);
        call.set_max_wait(options.max_wait, options.max_wait_name);
        call.set_api(options.api);
        call.set_key(options.client_key.map(|k| k.0));
        call.set_attribution(options.attribution);
        engine.trace_call(&call, options.trace_parent, |o| {
            o.set_request(&request, options.model.clone())
        });
        if engine.affinity_applies() {
            let given = options.affinity_key.as_deref();
            call.set_affinity(polygw_core::affinity::call_key(given, &request));
        }
        if let Some(m) = request.max_tokens {
            span.record("gen_ai.request.max_tokens", m);
        }
        if let Some(t) = request.temperature {
            span.record("gen_ai.request.temperature", t);
        }
        let result = with_deadline(engine, &call, self.run_chat(&request, &call, sink))
            .instrument(span.clone())
            .await;
        self.finish_call(&call, &span, &result);
        result
    }

    /// Metrics, span fields and the terminal row of a finished logical chat call.
    pub(crate) fn finish_call(
        &self,
        call: &CallShared,
        span: &tracing::Span,
        result: &Result<LlmResponse, GatewayError>,
    ) {
        if let Some(o) = call.otel() {
            o.end(self.engine.ports.clock.now(), result.as_ref());
        }
        if let Ok(r) = result {
            span.record("gen_ai.response.model", r.model.as_str());
            if let Some(f) = &r.finish_reason {
                span.record("gen_ai.response.finish_reasons", f.as_str());
            }
            span.record("gen_ai.usage.input_tokens", r.usage.prompt_tokens);
            span.record("gen_ai.usage.output_tokens", r.usage.completion_tokens);
            span.record("polygw.source", r.source.as_str());
            span.record("polygw.attempts", r.call_stats.attempts);
            span.record("polygw.hedges", r.call_stats.hedges);
            span.record("polygw.hedge_won", r.call_stats.hedge_won);
            span.record("polygw.cache_hit", r.call_stats.cache_hit);
            if r.call_stats.hedge_won {
                self.engine.scope_metrics.hedge_win();
            }
            self.engine.log_rescue(call, r);
        }
        self.engine.conclude(call, span, result.as_ref().err());
    }

    /// One chat through cache and retry loop, in an existing logical call (the
    /// caller applies the deadline).
    pub(crate) async fn run_chat(
        &self,
        request: &ChatRequest,
        call: &Arc<CallShared>,
        sink: Option<Arc<dyn DeltaSink>>,
    ) -> Result<LlmResponse, GatewayError> {
        let engine = &self.engine;
        // A native request is not answered from the response cache: its chat form does
        // not hold every field a native source reads, so two different requests could
        // share an entry (DECISIONS 172).
        let key = engine
            .scope
            .cache
            .ttl
            .filter(|_| request.native.is_none())
            .map(|_| cache_key(&engine.scope.name, request));
        if let Some(k) = &key {
            match engine.ports.cache.get(k).await {
                Ok(Some(hit)) => return Ok(self.cache_hit(hit, call)),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "response cache lookup failed; calling upstream")
                }
            }
        }
        if call.count_in_budget() {
            engine
                .budget()
                .record_call(engine.ports.clock.now(), engine.scope.hedge.budget_pct);
        }
        if engine.affinity_applies() && call.affinity().is_none() {
            // A structured call's re-asks (or any call without options): the request's.
            call.set_affinity(polygw_core::affinity::call_key(None, request));
        }
        let mut policy = HedgePolicy::for_request(&engine.scope.hedge, request.stream);
        // Signature families (SPEC §23.5): the request's signed blobs placed, and the
        // answer's noted for the winner's family.
        let signed_api = request
            .native
            .as_ref()
            .map(|n| n.api)
            .filter(|api| engine.families_differ(*api));
        let placed = match signed_api {
            Some(_) => engine.place_signed(request, call).await,
            None => None,
        };
        let signed_sink = match (signed_api, &sink) {
            (Some(api), Some(inner)) => Some(Arc::new(crate::engine::signatures::SignedSink::new(
                inner.clone(),
                api,
            ))),
            _ => None,
        };
        let sink: Option<Arc<dyn DeltaSink>> = match &signed_sink {
            Some(s) => Some(s.clone()),
            None => sink,
        };
        let leg = ChatLeg {
            request,
            placed: placed.as_deref(),
        };
        if !leg.single_choice() {
            // n > 1 (SPEC §17.5): the choices are the upstream's, passed through; no
            // other leg can join or continue them.
            policy.max_extra = 0;
        }
        let won = engine.run_call(&leg, call, policy, sink).await?;
        if let Some(api) = signed_api {
            let winner = won.info.source_idx;
            if engine.scope.sources[winner].api == api {
                let keys = match (&signed_sink, &won.output.raw_body) {
                    (Some(s), _) => s.take(),
                    (None, Some(body)) => crate::engine::signatures::signed_in_body(api, body),
                    (None, None) => Vec::new(),
                };
                engine.remember_signed(winner, &keys).await;
            }
        }
        let response = self.response(won, call);
        if let (Some(k), Some(ttl)) = (&key, engine.scope.cache.ttl) {
            if response.finish_reason.is_some() {
                // The cached copy holds the answer, not the upstream's own object.
                let cached = LlmResponse {
                    upstream: None,
                    upstream_headers: Vec::new(),
                    ..response.clone()
                };
                if let Err(e) = engine.ports.cache.put(k, &cached, ttl).await {
                    tracing::warn!(error = %e, "response cache store failed");
                }
            }
        }
        Ok(response)
    }

    fn cache_hit(&self, mut hit: LlmResponse, call: &CallShared) -> LlmResponse {
        let engine = &self.engine;
        hit.logical_call_id = call.logical_call_id.clone();
        hit.call_stats = CallStats {
            attempts: 0,
            cache_hit: true,
            total_latency_ms: ms(engine
                .ports
                .clock
                .now()
                .saturating_duration_since(call.started)),
            hedges: 0,
            resumes: 0,
            hedge_won: false,
            generation_ms: 0,
            stall_ms: None,
            stall_count: None,
        };
        engine.emit_cache_hit(call, &hit.model);
        engine.scope_metrics.cache_hit();
        hit
    }

    fn response(&self, won: Won<TransportResult>, call: &CallShared) -> LlmResponse {
        let engine = &self.engine;
        let src = &engine.scope.sources[won.info.source_idx];
        let tr = won.output;
        let figures = tr.stream;
        let stall_ms = figures.and_then(|f| f.stall_ms);
        // The answer: what the caller received (passthrough), or the winner's text
        // after the prefix it continued, verified (aggregated prefill).
        let (content, reasoning_content, tool_calls) = match won.answer {
            Some(t) => (
                t.content,
                (!t.reasoning.is_empty()).then_some(t.reasoning),
                t.tools
                    .into_iter()
                    .map(|(index, x)| ToolCall {
                        index,
                        id: x.id,
                        name: x.name,
                        arguments: x.arguments,
                    })
                    .collect(),
            ),
            None => (tr.content, tr.reasoning_content, tr.tool_calls),
        };
        // The winner's usage plus that of every other leg whose text the answer holds,
        // with the figures their rows record (SPEC §17.8).
        let LegUsage {
            usage,
            source: usage_source,
        } = call_usage(LegUsage::new(tr.usage, tr.usage_source), &won.parts);
        let answer_usage =
            polygw_core::usage::answer_usage(tr.usage, &won.parts, won.info.kind.resume_mode());
        let p = call.progress();
        LlmResponse {
            upstream: tr.raw,
            upstream_body: tr.raw_body,
            upstream_usage_object: tr.raw_usage_object,
            content,
            reasoning_content,
            tool_calls,
            finish_reason: tr.finish_reason,
            model: tr.model.unwrap_or_else(|| src.model.clone()),
            source: src.name.clone(),
            usage,
            usage_source,
            answer_usage,
            ttft_ms: figures.and_then(|f| f.ttft_ms),
            max_inter_token_ms: figures.and_then(|f| f.max_inter_token_ms),
            logical_call_id: call.logical_call_id.clone(),
            call_stats: CallStats {
                attempts: p.attempts,
                cache_hit: false,
                total_latency_ms: ms(engine
                    .ports
                    .clock
                    .now()
                    .saturating_duration_since(call.started)),
                hedges: p.hedges,
                resumes: p.resumes,
                hedge_won: won.info.is_hedge,
                generation_ms: generation_ms(ms(won.wall), stall_ms),
                stall_ms,
                stall_count: figures.and_then(|f| f.stall_count),
            },
            upstream_headers: tr.upstream_headers,
        }
    }
}
