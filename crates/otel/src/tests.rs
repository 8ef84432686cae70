// Semantic conventions 1.42 marks the GenAI names deprecated only because they moved to
// their own repository (semantic-conventions-genai); the names themselves are unchanged.
#![allow(deprecated)]

use super::*;
use opentelemetry_semantic_conventions as semconv;
use polygw_core::otel::attr;

/// The names core uses are those of the conventions version it pins: the crate of
/// that version says so.
#[test]
fn the_names_are_those_of_the_pinned_conventions() {
    assert_eq!(semconv::SCHEMA_URL, SCHEMA_URL);
    use semconv::attribute as a;
    for (ours, theirs) in [
        (attr::OPERATION_NAME, a::GEN_AI_OPERATION_NAME),
        (attr::PROVIDER_NAME, a::GEN_AI_PROVIDER_NAME),
        (attr::REQUEST_MODEL, a::GEN_AI_REQUEST_MODEL),
        (attr::REQUEST_MAX_TOKENS, a::GEN_AI_REQUEST_MAX_TOKENS),
        (attr::REQUEST_TEMPERATURE, a::GEN_AI_REQUEST_TEMPERATURE),
        (attr::REQUEST_STREAM, a::GEN_AI_REQUEST_STREAM),
        (attr::RESPONSE_ID, a::GEN_AI_RESPONSE_ID),
        (attr::RESPONSE_MODEL, a::GEN_AI_RESPONSE_MODEL),
        (
            attr::RESPONSE_FINISH_REASONS,
            a::GEN_AI_RESPONSE_FINISH_REASONS,
        ),
        (
            attr::RESPONSE_TIME_TO_FIRST_CHUNK,
            a::GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK,
        ),
        (attr::USAGE_INPUT_TOKENS, a::GEN_AI_USAGE_INPUT_TOKENS),
        (attr::USAGE_OUTPUT_TOKENS, a::GEN_AI_USAGE_OUTPUT_TOKENS),
        (
            attr::USAGE_CACHE_READ_INPUT_TOKENS,
            a::GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
        ),
        (
            attr::USAGE_CACHE_CREATION_INPUT_TOKENS,
            a::GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS,
        ),
        (
            attr::USAGE_REASONING_OUTPUT_TOKENS,
            a::GEN_AI_USAGE_REASONING_OUTPUT_TOKENS,
        ),
        (attr::CONVERSATION_ID, a::GEN_AI_CONVERSATION_ID),
        (attr::AGENT_ID, a::GEN_AI_AGENT_ID),
        (attr::INPUT_MESSAGES, a::GEN_AI_INPUT_MESSAGES),
        (attr::OUTPUT_MESSAGES, a::GEN_AI_OUTPUT_MESSAGES),
        (attr::TOKEN_TYPE, a::GEN_AI_TOKEN_TYPE),
        (attr::SERVER_ADDRESS, a::SERVER_ADDRESS),
        (attr::SERVER_PORT, a::SERVER_PORT),
        (attr::ERROR_TYPE, a::ERROR_TYPE),
        (
            attr::HTTP_RESPONSE_STATUS_CODE,
            a::HTTP_RESPONSE_STATUS_CODE,
        ),
    ] {
        assert_eq!(ours, theirs);
    }
    use semconv::metric as m;
    assert_eq!(Instrument::TokenUsage.name(), m::GEN_AI_CLIENT_TOKEN_USAGE);
    assert_eq!(
        Instrument::OperationDuration.name(),
        m::GEN_AI_CLIENT_OPERATION_DURATION
    );
    assert_eq!(
        Instrument::TimeToFirstChunk.name(),
        m::GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK
    );
    // Ours never take a convention's namespace.
    for i in Instrument::ALL {
        assert!(i.name().starts_with("gen_ai.client.") || i.name().starts_with("polygw."));
    }
}

#[test]
fn a_span_keeps_its_ids_times_events_and_status() {
    let parent = polygw_core::otel::TraceParent::parse(
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    );
    let ctx = polygw_core::otel::CallContext::new("c", parent, &Sampler::default());
    let out = SpanOut {
        trace_id: ctx.trace_id,
        span_id: ctx.span_id,
        parent: ctx.parent,
        parent_remote: true,
        name: "chat m".into(),
        kind: polygw_core::otel::SpanKind::Client,
        start_ns: 1_000_000_000,
        end_ns: 3_000_000_000,
        attributes: vec![
            ("a", Value::Int(3)),
            ("b", Value::StrArray(vec!["stop".into()])),
        ],
        events: vec![polygw_core::otel::EventOut {
            name: "polygw.resume",
            at_ns: 2_000_000_000,
            attributes: vec![],
        }],
        error: Some("all_sources_failed".into()),
    };
    let d = span_data(out, &scope());
    assert_eq!(
        d.span_context.trace_id().to_string(),
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );
    assert_eq!(d.parent_span_id.to_string(), "00f067aa0ba902b7");
    assert!(d.parent_span_is_remote);
    assert_eq!(d.span_kind, opentelemetry::trace::SpanKind::Client);
    assert_eq!(
        d.end_time.duration_since(d.start_time).unwrap(),
        Duration::from_secs(2)
    );
    assert_eq!(d.events.events[0].name, "polygw.resume");
    assert_eq!(d.status, Status::error("all_sources_failed"));
    assert_eq!(d.attributes.len(), 2);
    assert_eq!(d.instrumentation_scope.schema_url(), Some(SCHEMA_URL));
}

#[test]
fn a_full_queue_drops_and_counts_and_never_blocks() {
    // A receiver that is never reached: an endpoint on a closed port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let vars = [
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".to_string(),
            format!("http://127.0.0.1:{port}"),
        ),
        ("OTEL_METRICS_EXPORTER".to_string(), "none".to_string()),
        ("OTEL_BSP_MAX_QUEUE_SIZE".to_string(), "1".to_string()),
        ("OTEL_BSP_SCHEDULE_DELAY".to_string(), "3600000".to_string()),
    ];
    let c = OtelConfig::from_env(&|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
        .unwrap()
        .unwrap();
    let otel = Otel::start(c).unwrap();
    assert!(otel.enabled() && otel.traces() && !otel.captures_content());
    let call = || polygw_core::otel::FinishedCall {
        context: polygw_core::otel::CallContext::new("x", None, &Sampler::default()),
        logical_call_id: "x".into(),
        scope: "s".into(),
        operation: "chat".into(),
        api: None,
        stream: false,
        start_ns: 0,
        end_ns: 1,
        request: Default::default(),
        answer: None,
        error_type: Some("cancelled".into()),
        attempts: vec![],
        cache_hit: false,
        trace: Default::default(),
        conversation_id: None,
        agent_id: None,
        client_key_id: None,
        contents: None,
    };
    let started = Instant::now();
    for _ in 0..1_000 {
        otel.export(call());
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "export never waits"
    );
    assert!(otel.dropped() > 0, "a full queue drops");
    // The flush ships what waits: the receiver is down, so those calls count as dropped.
    let before = otel.dropped();
    assert!(!otel.flush(Duration::from_secs(10)));
    assert!(otel.dropped() > before);
}
