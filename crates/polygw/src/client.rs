//! [`GatewayClient`]: one scope as one chat endpoint. Cheap to clone; `chat()` is a
//! `Send`, cancel-safe future (dropping it cancels every attempt, SPEC §9).

use std::sync::Arc;

use futures_util::future::BoxFuture;
use polygw_core::cache_key::cache_key;
use polygw_core::hedge::HedgePolicy;
use polygw_core::ports::{ChatAttempt, ChunkObserver, TransportResult};
use polygw_core::stall::{generation_ms, ms};
use polygw_core::{
    AttemptError, CallStats, ChatRequest, ConfigWarning, GatewayError, GovernanceError,
    LlmResponse, SourceConfig, TerminalReason,
};
use tracing::Instrument;

use crate::clock::new_id;
use crate::engine::attempt::{Leg, SuccessFacts};
use crate::engine::call::CallShared;
use crate::engine::round::{DeltaSink, Won};
use crate::engine::Engine;
use crate::metrics::Metrics;

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
        observer: &'a dyn ChunkObserver,
    ) -> BoxFuture<'a, Result<TransportResult, AttemptError>> {
        engine.ports.transport.chat(ChatAttempt {
            source,
            request: self.request,
            call_id,
            stall_threshold: engine.scope.stream.stall_threshold,
            observer,
        })
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
        }
    }
}

/// Runs `fut` under the call deadline: on expiry every leg is dropped (their rows say
/// `deadline`) and the call ends with `deadline_exceeded`.
pub(crate) async fn with_deadline<T>(
    engine: &Engine,
    call: &CallShared,
    fut: impl std::future::Future<Output = Result<T, GatewayError>>,
) -> Result<T, GatewayError> {
    let Some(deadline) = engine.scope.call_deadline else {
        return fut.await;
    };
    let mut fut = Box::pin(fut);
    let left = (call.started + deadline).saturating_duration_since(engine.ports.clock.now());
    match tokio::time::timeout(left, &mut fut).await {
        Ok(r) => r,
        Err(_) => {
            call.mark_deadline();
            drop(fut);
            Err(call.terminal(
                TerminalReason::DeadlineExceeded,
                Some(format!(
                    "CALL_DEADLINE_S of {:.3}s passed",
                    deadline.as_secs_f64()
                )),
            ))
        }
    }
}

impl GatewayClient {
    /// The client's metrics.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.engine.metrics.clone()
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
        self.chat_inner(request, None).await
    }

    /// Like [`GatewayClient::chat`], streaming the committed leg's chunks to `sink` as
    /// they arrive (passthrough; the request must have `stream = true`). After the
    /// first incremental chunk no new leg starts and a failure is not retried.
    pub async fn chat_streaming(
        &self,
        request: ChatRequest,
        sink: Arc<dyn DeltaSink>,
    ) -> Result<LlmResponse, GatewayError> {
        self.chat_inner(request, Some(sink)).await
    }

    pub(crate) fn new_call(&self, stream: bool) -> (Arc<CallShared>, tracing::Span) {
        let engine = &self.engine;
        let call = Arc::new(CallShared::new(new_id(), engine.ports.clock.now(), stream));
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
    ) -> Result<LlmResponse, GatewayError> {
        request
            .validate()
            .map_err(|(field, message)| GatewayError::InvalidRequest { field, message })?;
        let engine = &self.engine;
        let (call, span) = self.new_call(request.stream);
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
                self.engine.metrics.hedge_win(&self.engine.scope.name);
            }
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
        let key = engine
            .scope
            .cache
            .ttl
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
        engine.budget().record_call(call.started);
        let policy = HedgePolicy::for_request(&engine.scope.hedge, request.stream);
        let leg = ChatLeg { request };
        let won = engine.run_call(&leg, call, policy, sink).await?;
        let response = self.response(won, call);
        if let (Some(k), Some(ttl)) = (&key, engine.scope.cache.ttl) {
            if response.finish_reason.is_some() {
                if let Err(e) = engine.ports.cache.put(k, &response, ttl).await {
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
            hedge_won: false,
            generation_ms: 0,
            stall_ms: None,
            stall_count: None,
        };
        engine.emit_cache_hit(call, &hit.model);
        engine.metrics.cache_hit(&engine.scope.name);
        hit
    }

    fn response(&self, won: Won<TransportResult>, call: &CallShared) -> LlmResponse {
        let engine = &self.engine;
        let src = &engine.scope.sources[won.info.source_idx];
        let tr = won.output;
        let figures = tr.stream;
        let stall_ms = figures.and_then(|f| f.stall_ms);
        let p = call.progress();
        LlmResponse {
            content: tr.content,
            reasoning_content: tr.reasoning_content,
            tool_calls: tr.tool_calls,
            finish_reason: tr.finish_reason,
            model: tr.model.unwrap_or_else(|| src.model.clone()),
            source: src.name.clone(),
            usage: tr.usage,
            usage_source: tr.usage_source,
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
                hedge_won: won.info.is_hedge,
                generation_ms: generation_ms(ms(won.wall), stall_ms),
                stall_ms,
                stall_count: figures.and_then(|f| f.stall_count),
            },
        }
    }
}
