//! [`OcrClient`] (SPEC §10): an image through an OpenAI-compatible vision request,
//! RPM-governed, usage recorded as measured 0 tokens, settled 0, priced per call.

use std::sync::Arc;

use futures_util::future::{BoxFuture, FutureExt};
use polygw_core::hedge::HedgePolicy;
use polygw_core::ports::{ChunkObserver, OcrResult};
use polygw_core::round::LegKind;
use polygw_core::stall::ms;
use polygw_core::telemetry::{cost, CostBasis};
use polygw_core::{
    AttemptError, CallStats, ConfigWarning, ErrorClass, ErrorLabel, GatewayError, ScopeKind,
    SourceConfig, Usage, UsageSource,
};
use serde::Serialize;
use tracing::Instrument;

use crate::client::with_deadline;
use crate::clock::new_id;
use crate::engine::attempt::{Leg, SuccessFacts};
use crate::engine::call::CallShared;
use crate::engine::Engine;

/// The largest image accepted (bytes).
pub const MAX_IMAGE_BYTES: usize = 20 * 1024 * 1024;

/// The result of [`OcrClient::recognize`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OcrText {
    /// The recognized text.
    pub text: String,
    /// The model that answered.
    pub model: String,
    /// The source that answered.
    pub source: String,
    /// `PRICE_PER_CALL` of that source, when set.
    pub cost: Option<f64>,
    /// The logical call's id.
    pub logical_call_id: String,
    /// The call's figures.
    pub call_stats: CallStats,
}

/// An OCR client over one scope.
#[derive(Clone, Debug)]
pub struct OcrClient {
    pub(crate) engine: Arc<Engine>,
    pub(crate) warnings: Arc<Vec<ConfigWarning>>,
}

crate::scope_client::scope_client!(OcrClient, ScopeKind::Ocr, build_ocr);

struct OcrLeg<'i> {
    image: &'i [u8],
    mime: &'i str,
}

impl Leg for OcrLeg<'_> {
    type Output = OcrResult;

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
    ) -> BoxFuture<'a, Result<OcrResult, AttemptError>> {
        async move {
            let Some(t) = engine.ports.ocr.as_ref() else {
                return Err(AttemptError::new(
                    ErrorClass::Invalid,
                    ErrorLabel::Invalid,
                    "no OCR transport configured",
                ));
            };
            t.recognize(
                source,
                self.image,
                self.mime,
                &engine.scope.ocr_prompt,
                call_id,
            )
            .await
        }
        .boxed()
    }

    fn facts(&self, out: &OcrResult) -> SuccessFacts {
        SuccessFacts {
            // OCR tokens are not billed: a measured zero, never "unknown".
            usage: Usage::default(),
            usage_source: UsageSource::Measured,
            figures: None,
            http_status: out.http_status,
            model: out.model.clone(),
            per_call_cost: true,
            settle_override: Some(0),
            estimate: None,
        }
    }
}

impl OcrClient {
    /// Recognizes the text of one image (`mime` like `image/png`).
    pub async fn recognize(&self, image: &[u8], mime: &str) -> Result<OcrText, GatewayError> {
        if image.is_empty() {
            return Err(GatewayError::InvalidRequest {
                field: "image".into(),
                message: "is empty".into(),
            });
        }
        if image.len() > MAX_IMAGE_BYTES {
            return Err(GatewayError::InvalidRequest {
                field: "image".into(),
                message: format!("{} bytes exceeds the cap of {MAX_IMAGE_BYTES}", image.len()),
            });
        }
        if !mime.starts_with("image/") || mime.len() <= "image/".len() {
            return Err(GatewayError::InvalidRequest {
                field: "mime".into(),
                message: format!("{mime:?} is not an image type (e.g. image/png)"),
            });
        }
        let engine = &self.engine;
        let started = engine.ports.clock.now();
        let call = Arc::new(CallShared::new(
            new_id(),
            started,
            false,
            self.engine.ports.clock.clone(),
        ));
        engine.trace_call(&call, None, |_| {});
        let span = tracing::info_span!(
            "polygw.ocr",
            gen_ai.operation.name = "ocr",
            polygw.scope = %engine.scope.name,
            polygw.logical_call_id = %call.logical_call_id,
            error.type = tracing::field::Empty,
        );
        let leg = OcrLeg { image, mime };
        let off = HedgePolicy {
            after: None,
            stall_after: None,
            max_extra: 0,
        };
        let result = with_deadline(engine, &call, engine.run_call(&leg, &call, off, None))
            .instrument(span.clone())
            .await;
        if let Some(o) = call.otel() {
            let answer = result.as_ref().map(|won| polygw_core::otel::AnswerFacts {
                model: engine.scope.sources[won.info.source_idx].model.clone(),
                source: engine.scope.sources[won.info.source_idx].name.clone(),
                usage_source: "unavailable".to_string(),
                ..Default::default()
            });
            o.end_other(engine.ports.clock.now(), answer);
        }
        engine.conclude(&call, &span, result.as_ref().err());
        let won = result?;
        let src = &engine.scope.sources[won.info.source_idx];
        let p = call.progress();
        Ok(OcrText {
            text: won.output.text,
            model: won.output.model.unwrap_or_else(|| src.model.clone()),
            source: src.name.clone(),
            cost: cost(CostBasis::PerCall, src),
            logical_call_id: call.logical_call_id.clone(),
            call_stats: CallStats {
                attempts: p.attempts,
                total_latency_ms: ms(engine.ports.clock.now().saturating_duration_since(started)),
                generation_ms: ms(won.wall),
                ..Default::default()
            },
        })
    }
}
