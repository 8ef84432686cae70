//! Embeddings, OCR, the response cache and structured output (SPEC §10), with fakes
//! under tokio's paused clock.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw::core::ports::ResponseCache;
use polygw::core::telemetry::RowKind;
use polygw::core::{CacheError, ScopeKind};
use polygw::{
    AttemptError, ChatRequest, EmbeddingClient, ErrorClass, ErrorLabel, GatewayClient,
    GatewayError, LlmResponse, OcrClient, ScopeSettings, SourceConfig, TerminalReason, UsageSource,
};
use polygw_limiter_memory::{MemoryBreakerStore, MemoryCache, MemoryLimiter};
use polygw_testkit::clock::TokioClock;
use polygw_testkit::fakes::{FakeEmbedder, FakeOcr, FakeTransport, RecordingTelemetry, Script};
use serde::Deserialize;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn scope(n: usize) -> ScopeSettings {
    let sources = (0..n)
        .map(|i| {
            SourceConfig::new(
                "s",
                i as u32,
                "http://127.0.0.1:9/v1",
                "",
                format!("model-{i}"),
            )
        })
        .collect();
    let mut s = ScopeSettings::new("X", sources);
    s.retry.backoff_base = ms(10);
    s.retry.backoff_max = ms(100);
    s
}

// ---------------------------------------------------------------- embeddings

mod embeddings {
    use super::*;

    async fn client(
        s: ScopeSettings,
    ) -> (EmbeddingClient, Arc<FakeEmbedder>, Arc<RecordingTelemetry>) {
        let clock = Arc::new(TokioClock);
        let emb = Arc::new(FakeEmbedder::default());
        let rows = RecordingTelemetry::new();
        let c = EmbeddingClient::builder(s)
            .transport(FakeTransport::new(clock.clone()))
            .embedding_transport(emb.clone())
            .telemetry(rows.clone())
            .limiter(Arc::new(MemoryLimiter::new(clock.clone())))
            .breakers(Arc::new(MemoryBreakerStore::new(clock.clone())))
            .clock(clock)
            .build_embedding()
            .await
            .unwrap();
        (c, emb, rows)
    }

    fn texts(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("text number {i}")).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn order_is_preserved_across_batches_with_a_retried_batch() {
        let mut s = scope(2);
        for x in &mut s.sources {
            x.batch_size = 2;
        }
        let (c, emb, rows) = client(s).await;
        emb.push_outcome(None);
        emb.push_outcome(Some(
            AttemptError::new(ErrorClass::Transient, ErrorLabel::ServerError, "boom")
                .with_status(500),
        ));
        let input = texts(5);
        let e = c.embed(&input).await.unwrap();
        assert_eq!(e.vectors.len(), 5);
        for (t, v) in input.iter().zip(&e.vectors) {
            assert_eq!(v[0], t.len() as f32, "vector of {t} out of order");
        }
        assert_eq!(e.call_stats.attempts, 4, "3 batches + 1 retry");
        assert_eq!(e.usage_source, UsageSource::Measured);
        assert_eq!(
            e.usage.prompt_tokens,
            input.iter().map(|t| t.len() as u64).sum::<u64>()
        );
        let batches = emb.batches.lock().unwrap().clone();
        assert_eq!(batches.len(), 4);
        assert_eq!(
            batches[1].1, batches[2].1,
            "the failed batch is sent again, same texts"
        );
        let r = rows.rows_of(&e.logical_call_id);
        assert_eq!(r.len(), 4);
        assert!(r.iter().all(|x| &*x.operation == "embedding"));
        assert_eq!(r.iter().filter(|x| !x.ok).count(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_without_usage_makes_the_whole_call_unavailable_with_null_cost() {
        let mut s = scope(1);
        s.sources[0].batch_size = 1;
        s.sources[0].input_price = Some(0.1);
        s.sources[0].output_price = Some(0.1);
        let (c, emb, _) = client(s).await;
        *emb.unavailable_marker.lock().unwrap() = Some("b".into());
        let e = c
            .embed(&["a".into(), "b".into(), "c".into()])
            .await
            .unwrap();
        assert_eq!(e.usage_source, UsageSource::Unavailable);
        assert_eq!(e.cost, None, "one unknown batch makes the total unknown");
        let e = c.embed(&["a".into(), "c".into()]).await.unwrap();
        assert_eq!(e.usage_source, UsageSource::Measured);
        assert!(e.cost.unwrap() > 0.0);
    }

    #[tokio::test(start_paused = true)]
    async fn hedge_keys_on_an_embedding_scope_warn_and_batch_size_is_the_smallest() {
        let mut s = scope(2);
        s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(500));
        s.sources[0].batch_size = 8;
        s.sources[1].batch_size = 3;
        let (c, _, _) = client(s).await;
        assert!(c.warnings().iter().any(|w| w.message.contains("chat-only")));
        assert_eq!(c.batch_size(), 3);
        let e = c.embed(&[]).await.unwrap();
        assert!(e.vectors.is_empty() && e.call_stats.attempts == 0);
    }
}

// ---------------------------------------------------------------- OCR

mod ocr {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_ocr_call_records_measured_zero_tokens_and_its_per_call_price() {
        let clock = Arc::new(TokioClock);
        let mut s = scope(1);
        s.sources[0].price_per_call = Some(0.002);
        s.sources[0].tpm = 600; // ignored for OCR: nothing is reserved
        s.sources[0].rpm = 10;
        let rows = RecordingTelemetry::new();
        let limiter = Arc::new(MemoryLimiter::new(clock.clone()));
        let c = OcrClient::builder(s)
            .transport(FakeTransport::new(clock.clone()))
            .ocr_transport(Arc::new(FakeOcr))
            .telemetry(rows.clone())
            .limiter(limiter.clone())
            .breakers(Arc::new(MemoryBreakerStore::new(clock.clone())))
            .clock(clock)
            .build_ocr()
            .await
            .unwrap();
        let t = c.recognize(b"\x89PNG....", "image/png").await.unwrap();
        assert_eq!(t.text, "text of image/png (8 bytes)");
        assert_eq!(t.cost, Some(0.002));
        let row = &rows.rows_of(&t.logical_call_id)[0];
        assert_eq!(&*row.operation, "ocr");
        assert_eq!(row.usage_source, UsageSource::Measured);
        assert_eq!(
            (row.prompt_tokens, row.completion_tokens),
            (Some(0), Some(0))
        );
        assert_eq!(row.cost, Some(0.002));
        assert_eq!(
            limiter.source_window("X", "s-0"),
            (1, 0),
            "RPM counted, 0 tokens settled"
        );
        let e = c.recognize(b"x", "text/plain").await.unwrap_err();
        assert!(matches!(e, GatewayError::InvalidRequest { ref field, .. } if field == "mime"));
        let e = c.recognize(b"", "image/png").await.unwrap_err();
        assert!(matches!(e, GatewayError::InvalidRequest { ref field, .. } if field == "image"));
    }

    #[test]
    fn scope_kind_operations() {
        assert_eq!(ScopeKind::Ocr.operation(), "ocr");
    }
}

// ---------------------------------------------------------------- cache

mod cache {
    use super::*;

    #[derive(Debug)]
    struct BrokenCache;

    #[async_trait]
    impl ResponseCache for BrokenCache {
        async fn get(&self, _k: &str) -> Result<Option<LlmResponse>, CacheError> {
            Err(CacheError("disk on fire".into()))
        }
        async fn put(&self, _k: &str, _r: &LlmResponse, _t: Duration) -> Result<(), CacheError> {
            Err(CacheError("disk on fire".into()))
        }
    }

    async fn client(
        cache: Arc<dyn ResponseCache>,
    ) -> (GatewayClient, Arc<FakeTransport>, Arc<RecordingTelemetry>) {
        let clock = Arc::new(TokioClock);
        let mut s = scope(1);
        s.cache.ttl = Some(Duration::from_secs(60));
        s.sources[0].input_price = Some(1.0);
        s.sources[0].output_price = Some(1.0);
        let fake = FakeTransport::new(clock.clone());
        let rows = RecordingTelemetry::new();
        let c = GatewayClient::builder(s)
            .transport(fake.clone())
            .telemetry(rows.clone())
            .cache(cache)
            .limiter(Arc::new(MemoryLimiter::new(clock.clone())))
            .breakers(Arc::new(MemoryBreakerStore::new(clock.clone())))
            .clock(clock)
            .build()
            .await
            .unwrap();
        (c, fake, rows)
    }

    #[tokio::test(start_paused = true)]
    async fn a_hit_costs_nothing_and_writes_a_cache_hit_row() {
        let (c, fake, rows) = client(Arc::new(MemoryCache::new(100, Arc::new(TokioClock)))).await;
        fake.push("s-0", Script::ok(ms(200), "cached answer"));
        let first = c.chat(ChatRequest::user("same")).await.unwrap();
        let hit = c
            .chat(ChatRequest::user("same").with_stream(true))
            .await
            .unwrap();
        assert_eq!(fake.calls().len(), 1, "the hit never reached the upstream");
        assert_eq!(hit.content, "cached answer");
        assert!(hit.call_stats.cache_hit);
        assert_eq!(
            (hit.call_stats.attempts, hit.call_stats.generation_ms),
            (0, 0)
        );
        assert_ne!(hit.logical_call_id, first.logical_call_id);
        let r = rows.rows_of(&hit.logical_call_id);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].kind, RowKind::CacheHit);
        assert!(r[0].cache_hit && r[0].ok);
        assert_eq!(r[0].cost, Some(0.0), "free, not unknown");
        // another generation parameter is another key
        fake.push("s-0", Script::ok(ms(10), "fresh"));
        let other = c
            .chat(ChatRequest::user("same").with_temperature(0.2))
            .await
            .unwrap();
        assert_eq!(other.content, "fresh");
        // TTL
        tokio::time::sleep(Duration::from_secs(61)).await;
        fake.push("s-0", Script::ok(ms(10), "after ttl"));
        assert_eq!(
            c.chat(ChatRequest::user("same")).await.unwrap().content,
            "after ttl"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_cache_never_fails_a_call() {
        let (c, fake, _) = client(Arc::new(BrokenCache)).await;
        fake.set_default("s-0", Script::ok(ms(10), "still works"));
        assert_eq!(
            c.chat(ChatRequest::user("q")).await.unwrap().content,
            "still works"
        );
        assert_eq!(
            c.chat(ChatRequest::user("q")).await.unwrap().content,
            "still works"
        );
        assert_eq!(fake.calls().len(), 2);
    }
}

// ---------------------------------------------------------------- structured output

mod structured {
    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Answer {
        city: String,
        population: u64,
    }

    async fn client(reasks: u32) -> (GatewayClient, Arc<FakeTransport>, Arc<RecordingTelemetry>) {
        let clock = Arc::new(TokioClock);
        let mut s = scope(1);
        s.max_reasks = reasks;
        let fake = FakeTransport::new(clock.clone());
        let rows = RecordingTelemetry::new();
        let c = GatewayClient::builder(s)
            .transport(fake.clone())
            .telemetry(rows.clone())
            .limiter(Arc::new(MemoryLimiter::new(clock.clone())))
            .breakers(Arc::new(MemoryBreakerStore::new(clock.clone())))
            .clock(clock)
            .build()
            .await
            .unwrap();
        (c, fake, rows)
    }

    #[tokio::test(start_paused = true)]
    async fn a_reask_that_succeeds_on_the_second_round() {
        let (c, fake, rows) = client(2).await;
        fake.push("s-0", Script::ok(ms(700), "Sure! The city is Paris."));
        fake.push(
            "s-0",
            Script::ok(
                ms(300),
                "```json\n{\"city\":\"Paris\",\"population\":2100000}\n```",
            ),
        );
        let s = c
            .chat_json::<Answer>(ChatRequest::user("Which city? Population?"))
            .await
            .unwrap();
        assert_eq!(
            s.value,
            Answer {
                city: "Paris".into(),
                population: 2_100_000
            }
        );
        assert_eq!(s.rounds, 2);
        assert_eq!(
            s.response.call_stats.attempts, 2,
            "attempts add up over rounds"
        );
        assert_eq!(
            s.response.call_stats.generation_ms, 300,
            "the last round's generation"
        );
        assert_eq!(s.response.call_stats.total_latency_ms, 1000);
        let r = rows.rows_of(&s.response.logical_call_id);
        assert_eq!(r.len(), 2, "one logical call, two attempts");
        assert!(r.iter().all(|x| x.kind == RowKind::Attempt && x.ok));
    }

    #[tokio::test(start_paused = true)]
    async fn exhausted_reasks_end_in_structured_invalid() {
        let (c, fake, rows) = client(1).await;
        fake.set_default("s-0", Script::ok(ms(10), "no json here"));
        let e = c
            .chat_json::<Answer>(ChatRequest::user("json please"))
            .await
            .unwrap_err();
        assert_eq!(
            e.terminal_reason(),
            Some(TerminalReason::StructuredInvalid),
            "{e}"
        );
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        assert_eq!(fake.calls().len(), 2, "first answer + 1 re-ask");
        let ctx = e.context().unwrap();
        let r = rows.rows_of(&ctx.logical_call_id);
        let term: Vec<_> = r
            .iter()
            .filter(|x| x.kind == RowKind::TerminalFailure)
            .collect();
        assert_eq!(term.len(), 1);
        assert_eq!(term[0].error.as_deref(), Some("structured_invalid"));
    }

    #[cfg(feature = "schema")]
    #[tokio::test(start_paused = true)]
    async fn schema_violations_are_reasked() {
        let (c, fake, _) = client(2).await;
        fake.push(
            "s-0",
            Script::ok(ms(10), "{\"city\":\"Paris\",\"population\":-5}"),
        );
        fake.push(
            "s-0",
            Script::ok(ms(10), "{\"city\":\"Paris\",\"population\":5}"),
        );
        let schema = serde_json::json!({
            "type": "object",
            "required": ["city", "population"],
            "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 0}}
        });
        let s = c
            .chat_json_with_schema::<Answer>(ChatRequest::user("q"), Some(&schema))
            .await
            .unwrap();
        assert_eq!(s.value.population, 5);
        assert_eq!(s.rounds, 2);
        let bad = serde_json::json!({"type": 12});
        let e = c
            .chat_json_with_schema::<Answer>(ChatRequest::user("q"), Some(&bad))
            .await
            .unwrap_err();
        assert!(matches!(e, GatewayError::InvalidRequest { ref field, .. } if field == "schema"));
    }

    /// Without the `schema` feature a schema is refused, naming the feature: never
    /// silently unchecked.
    #[cfg(not(feature = "schema"))]
    #[tokio::test(start_paused = true)]
    async fn without_the_schema_feature_a_schema_is_refused() {
        let (c, fake, _) = client(1).await;
        let schema = serde_json::json!({"type": "object"});
        let e = c
            .chat_json_with_schema::<Answer>(ChatRequest::user("q"), Some(&schema))
            .await
            .unwrap_err();
        assert!(
            matches!(e, GatewayError::InvalidRequest { ref field, ref message } if field == "schema" && message.contains("`schema` cargo feature")),
            "{e}"
        );
        assert!(fake.calls().is_empty(), "nothing was sent");
    }
}
