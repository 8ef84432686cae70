//! [`EmbeddingClient`] (SPEC §10): texts in batches, each batch through admission and
//! the retry loop (no hedging), order preserved, usage merged three-state, cost NULL
//! when any batch's is unknown.

use std::sync::Arc;

use futures_util::future::{BoxFuture, FutureExt};
use polygw_core::hedge::HedgePolicy;
use polygw_core::ports::{ChunkObserver, EmbeddingResult};
use polygw_core::round::LegKind;
use polygw_core::stall::ms;
use polygw_core::telemetry::{cost, CostBasis};
use polygw_core::{
    AttemptError, CallStats, ConfigWarning, EmbeddingInput, ErrorClass, ErrorLabel, GatewayError,
    ScopeKind, SourceConfig, Usage, UsageSource,
};
use serde::Serialize;
use tracing::Instrument;

use crate::client::{with_deadline, CallOptions};
use crate::clock::new_id;
use crate::engine::attempt::{Leg, SuccessFacts};
use crate::engine::call::CallShared;
use crate::engine::Engine;

/// The result of [`EmbeddingClient::embed`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Embeddings {
    /// One vector per input text, in input order.
    pub vectors: Vec<Vec<f32>>,
    /// Usage summed over batches.
    pub usage: Usage,
    /// Any batch unavailable → unavailable; else any estimated → estimated; else measured.
    pub usage_source: UsageSource,
    /// Sum of batch costs; `None` if any batch's cost is unknown.
    pub cost: Option<f64>,
    /// The model of the last batch.
    pub model: String,
    /// The sources that answered, per batch.
    pub sources: Vec<String>,
    /// The logical call's id.
    pub logical_call_id: String,
    /// `attempts` over all batches; `generation_ms` summed over batches.
    pub call_stats: CallStats,
}

/// An embedding client over one scope.
#[derive(Clone, Debug)]
pub struct EmbeddingClient {
    pub(crate) engine: Arc<Engine>,
    pub(crate) warnings: Arc<Vec<ConfigWarning>>,
}

crate::scope_client::scope_client!(EmbeddingClient, ScopeKind::Embedding, build_embedding);

struct EmbedLeg<'t> {
    inputs: &'t [EmbeddingInput],
}

impl Leg for EmbedLeg<'_> {
    type Output = EmbeddingResult;

    fn stream(&self) -> bool {
        false
    }

    fn call<'a>(
        &'a self,
        engine: &'a Engine,
        source: &'a SourceConfig,
        call_id: &'a str,
        _traceparent: Option<&'a str>,
        _observer: &'a dyn ChunkObserver,
        _kind: &'a LegKind,
    ) -> BoxFuture<'a, Result<EmbeddingResult, AttemptError>> {
        let n = self.inputs.len();
        async move {
            let Some(t) = engine.ports.embedder.as_ref() else {
                return Err(AttemptError::new(
                    ErrorClass::Invalid,
                    ErrorLabel::Invalid,
                    "no embedding transport configured",
                ));
            };
            let r = t.embed_inputs(source, self.inputs, call_id).await?;
            if r.vectors.len() != n {
                return Err(AttemptError::new(
                    ErrorClass::Invalid,
                    ErrorLabel::Invalid,
                    format!("{} vectors for {n} inputs", r.vectors.len()),
                )
                .with_usage(r.usage, r.usage_source));
            }
            Ok(r)
        }
        .boxed()
    }

    fn facts(&self, out: &EmbeddingResult) -> SuccessFacts {
        SuccessFacts {
            usage: out.usage,
            usage_source: out.usage_source,
            figures: None,
            http_status: out.http_status,
            model: out.model.clone(),
            per_call_cost: false,
            settle_override: None,
            estimate: None,
        }
    }
}

impl EmbeddingClient {
    /// Admits an embedding call of `texts` against the client key `key` (see
    /// [`crate::GatewayClient::admit_key`]): its reservation is the inputs' estimated
    /// tokens, nothing generated.
    pub async fn admit_key(
        &self,
        key: &polygw_core::client_key::ClientKey,
        texts: &[EmbeddingInput],
    ) -> Result<Arc<crate::client_keys::KeyCharge>, crate::client_keys::KeyAdmitError> {
        let tokens: u64 = texts.iter().map(EmbeddingInput::estimate_tokens).sum();
        self.engine.admit_key(key, tokens, Some(0)).await
    }

    /// The batch size: the smallest `BATCH_SIZE` of the scope's sources, so that any
    /// source can take any batch.
    pub fn batch_size(&self) -> usize {
        self.engine
            .scope
            .sources
            .iter()
            .map(|s| s.batch_size as usize)
            .min()
            .unwrap_or(1)
            .max(1)
    }

    /// The client's metrics.
    pub fn metrics(&self) -> Arc<crate::metrics::Metrics> {
        self.engine.metrics.clone()
    }

    /// Telemetry rows dropped so far (queue overflow).
    pub fn telemetry_dropped(&self) -> u64 {
        self.engine.ports.telemetry.dropped()
    }

    /// Embeds `texts` (order preserved).
    pub async fn embed(&self, texts: &[String]) -> Result<Embeddings, GatewayError> {
        self.embed_with(texts, CallOptions::default()).await
    }

    /// [`EmbeddingClient::embed`] with per-call options (a bound on waiting without
    /// progress, the logical call id).
    pub async fn embed_with(
        &self,
        texts: &[String],
        options: CallOptions,
    ) -> Result<Embeddings, GatewayError> {
        let inputs: Vec<EmbeddingInput> = texts.iter().cloned().map(EmbeddingInput::Text).collect();
        self.embed_inputs_with(&inputs, options).await
    }

    /// Embeds inputs that may be token arrays (passed through as sent: SPEC §17.5),
    /// with per-call options.
    pub async fn embed_inputs_with(
        &self,
        texts: &[EmbeddingInput],
        options: CallOptions,
    ) -> Result<Embeddings, GatewayError> {
        let engine = &self.engine;
        let started = engine.ports.clock.now();
        let id = options.logical_call_id.unwrap_or_else(new_id);
        let call = Arc::new(CallShared::new(
            id,
            started,
            false,
            self.engine.ports.clock.clone(),
        ));
        call.set_max_wait(options.max_wait, options.max_wait_name.clone());
        call.set_api(options.api);
        call.set_key(options.client_key.clone().map(|k| k.0));
        engine.trace_call(&call, options.trace_parent, |o| {
            o.set_model(options.model.clone())
        });
        let span = tracing::info_span!(
            "polygw.embed",
            gen_ai.operation.name = "embeddings",
            polygw.scope = %engine.scope.name,
            polygw.logical_call_id = %call.logical_call_id,
            polygw.inputs = texts.len(),
            gen_ai.usage.input_tokens = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let result = with_deadline(engine, &call, self.run(texts, &call))
            .instrument(span.clone())
            .await;
        if let Ok(e) = &result {
            span.record("gen_ai.usage.input_tokens", e.usage.prompt_tokens);
        }
        if let Some(o) = call.otel() {
            let answer = result.as_ref().map(|e| polygw_core::otel::AnswerFacts {
                model: e.model.clone(),
                source: e.sources.first().cloned().unwrap_or_default(),
                input_tokens: e.usage.prompt_tokens,
                usage_source: e.usage_source.as_str().to_string(),
                ..Default::default()
            });
            o.end_other(engine.ports.clock.now(), answer);
        }
        engine.conclude(&call, &span, result.as_ref().err());
        result
    }

    async fn run(
        &self,
        texts: &[EmbeddingInput],
        call: &Arc<CallShared>,
    ) -> Result<Embeddings, GatewayError> {
        let engine = &self.engine;
        let mut out = Embeddings {
            vectors: Vec::with_capacity(texts.len()),
            usage: Usage::default(),
            usage_source: UsageSource::Measured,
            cost: Some(0.0),
            model: String::new(),
            sources: Vec::new(),
            logical_call_id: call.logical_call_id.clone(),
            call_stats: CallStats::default(),
        };
        let off = HedgePolicy {
            after: None,
            stall_after: None,
            max_extra: 0,
        };
        let mut generation = 0u64;
        for batch in texts.chunks(self.batch_size()) {
            let leg = EmbedLeg { inputs: batch };
            let won = engine.run_call(&leg, call, off, None).await?;
            let src = &engine.scope.sources[won.info.source_idx];
            generation += ms(won.wall);
            out.usage = out.usage.add(&won.facts.usage);
            out.usage_source = out.usage_source.merge(won.facts.usage_source);
            let batch_cost = cost(
                CostBasis::Tokens {
                    usage: &won.facts.usage,
                    source: won.facts.usage_source,
                },
                src,
            );
            out.cost = match (out.cost, batch_cost) {
                (Some(a), Some(b)) => Some(a + b),
                _ => None,
            };
            out.model = won
                .output
                .model
                .clone()
                .unwrap_or_else(|| src.model.clone());
            out.sources.push(src.name.clone());
            out.vectors.extend(won.output.vectors);
        }
        if texts.is_empty() {
            out.cost = Some(0.0);
        }
        let p = call.progress();
        out.call_stats = CallStats {
            attempts: p.attempts,
            cache_hit: false,
            total_latency_ms: ms(engine
                .ports
                .clock
                .now()
                .saturating_duration_since(call.started)),
            hedges: 0,
            resumes: 0,
            hedge_won: false,
            generation_ms: generation,
            stall_ms: None,
            stall_count: None,
        };
        Ok(out)
    }
}
