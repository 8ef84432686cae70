use super::*;
use crate::response::UsageSource;
use crate::trace::TraceEntry;

const MS: u64 = 1_000_000;
const T0: u64 = 1_800_000_000_000 * MS;

fn row(call_id: &str, source: &str, index: u32) -> TelemetryRow {
    let mut r = TelemetryRow::new(RowKind::Attempt, call_id, "call-1", "default", "chat", 0);
    r.source = Some(source.into());
    r.provider = Some(source.split('-').next().unwrap_or("x").into());
    r.model = Some(format!("model-of-{source}").into());
    r.attempt_index = Some(index);
    r.stream = true;
    r
}

fn launch(t: u64, leg: usize, src: &str, why: &str, by: Option<&str>) -> TraceEntry {
    TraceEntry {
        t,
        event: TraceEvent::Launch {
            leg,
            src: src.to_string(),
            why: why.to_string(),
            by: by.map(str::to_string),
            mode: (why == "resume").then(|| "replay".to_string()),
            of: None,
            thr_ms: by.map(|_| 800),
            silent_ms: None,
            late: None,
        },
    }
}

/// A streamed call: the primary stalls, a hedge launches on the stall and loses, the
/// primary is cut after commit and resumed on a third source, which answers.
fn resumed_call() -> FinishedCall {
    let mut primary = row("a-1", "openai-1", 0);
    primary.error = Some("stream_cut".into());
    primary.stall_count = Some(1);
    primary.stall_ms = Some(900);
    primary.prompt_tokens = Some(100);
    primary.completion_tokens = Some(12);
    primary.usage_source = UsageSource::Estimated;
    primary.cost = Some(0.001);
    let mut hedge = row("a-2", "openai-2", 1);
    hedge.is_hedge = true;
    hedge.error = Some("hedge_cancelled".into());
    hedge.cost = Some(0.0);
    let mut resume = row("a-3", "anthropic-1", 2);
    resume.resume_mode = Some("replay".into());
    resume.resume_of = Some("a-1".into());
    resume.ok = true;
    resume.prompt_tokens = Some(110);
    resume.completion_tokens = Some(40);
    resume.cached_prompt_tokens = Some(64);
    resume.usage_source = UsageSource::Measured;
    resume.cost = Some(0.002);
    resume.ttft_ms = Some(250);
    resume.http_status = Some(200);
    let rec = |row: TelemetryRow, from: u64, to: u64| AttemptRecord {
        row,
        start_ns: T0 + from * MS,
        end_ns: T0 + to * MS,
        server_address: Some("127.0.0.1".into()),
        server_port: Some(8080),
    };
    let parent = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    FinishedCall {
        context: CallContext::new("call-1", parent, &Sampler::default()),
        logical_call_id: "call-1".into(),
        scope: "default".into(),
        operation: "chat".into(),
        api: Some("chat".into()),
        stream: true,
        start_ns: T0,
        end_ns: T0 + 3_000 * MS,
        request: RequestFacts {
            model: Some("gpt-4o-mini".into()),
            max_tokens: Some(256),
            temperature: Some(0.2),
        },
        answer: Some(AnswerFacts {
            id: Some("chatcmpl-9".into()),
            model: "model-of-anthropic-1".into(),
            finish_reason: Some("stop".into()),
            source: "anthropic-1".into(),
            input_tokens: 110,
            output_tokens: 52,
            cache_read_tokens: Some(64),
            cache_write_tokens: None,
            usage_source: "measured".into(),
            ttft_ms: Some(300),
        }),
        error_type: None,
        attempts: vec![
            rec(hedge, 900, 1_200),
            rec(primary, 0, 1_500),
            rec(resume, 1_500, 3_000),
        ],
        cache_hit: false,
        trace: CallTrace {
            events: vec![
                launch(0, 0, "openai-1", "primary", None),
                TraceEntry {
                    t: 300,
                    event: TraceEvent::FirstToken { leg: 0 },
                },
                TraceEntry {
                    t: 300,
                    event: TraceEvent::Commit { leg: 0 },
                },
                launch(900, 1, "openai-2", "hedge", Some("stall")),
                TraceEntry {
                    t: 1_200,
                    event: TraceEvent::Cancel {
                        leg: 1,
                        why: "hedge_cancelled".into(),
                    },
                },
                launch(1_500, 0, "anthropic-1", "resume", None),
                TraceEntry {
                    t: 3_000,
                    event: TraceEvent::Won { leg: 0 },
                },
            ],
            dropped: 0,
        },
        conversation_id: Some("session-7".into()),
        agent_id: None,
        client_key_id: Some("key_1".into()),
        contents: None,
    }
}

fn str_attr<'a>(s: &'a SpanOut, k: &str) -> &'a str {
    match s.attr(k) {
        Some(Value::Str(v)) => v,
        other => panic!("{k}: {other:?} on {}", s.name),
    }
}

fn int_attr(s: &SpanOut, k: &str) -> i64 {
    match s.attr(k) {
        Some(Value::Int(v)) => *v,
        other => panic!("{k}: {other:?} on {}", s.name),
    }
}

#[test]
fn a_resumed_call_is_one_span_with_a_child_per_upstream_request() {
    let call = resumed_call();
    let spans = call.spans();
    assert_eq!(spans.len(), 4);
    let root = &spans[0];
    assert_eq!(root.name, "chat gpt-4o-mini");
    assert_eq!(root.kind, SpanKind::Client);
    assert_eq!(
        context::hex(&root.trace_id),
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "the caller's trace is continued"
    );
    assert_eq!(
        root.parent.map(|p| context::hex(&p)).as_deref(),
        Some("00f067aa0ba902b7")
    );
    assert!(root.parent_remote);
    assert_eq!(str_attr(root, attr::OPERATION_NAME), "chat");
    assert_eq!(str_attr(root, attr::CONVERSATION_ID), "session-7");
    assert_eq!(str_attr(root, attr::PROVIDER_NAME), "anthropic");
    assert_eq!(int_attr(root, attr::USAGE_INPUT_TOKENS), 110);
    assert_eq!(int_attr(root, attr::USAGE_OUTPUT_TOKENS), 52);
    assert_eq!(int_attr(root, attr::USAGE_CACHE_READ_INPUT_TOKENS), 64);
    assert_eq!(int_attr(root, attr::ATTEMPTS), 3);
    assert_eq!(int_attr(root, attr::HEDGES), 1);
    assert_eq!(int_attr(root, attr::RESUMES), 1);
    assert_eq!(root.attr(attr::COST), Some(&Value::Float(0.003)));
    assert_eq!(
        root.attr(attr::RESPONSE_FINISH_REASONS),
        Some(&Value::StrArray(vec!["stop".into()]))
    );
    assert_eq!(root.error, None);
    assert!(
        root.attr(attr::INPUT_MESSAGES).is_none(),
        "contents are off by default"
    );
    let names: Vec<&str> = root.events.iter().map(|e| e.name).collect();
    assert_eq!(
        names,
        [
            "polygw.commit",
            "polygw.stall",
            "polygw.hedge_launched",
            "polygw.resume",
        ]
    );
    assert_eq!(root.events[3].at_ns, T0 + 1_500 * MS);

    for child in &spans[1..] {
        assert_eq!(child.trace_id, root.trace_id);
        assert_eq!(child.parent, Some(root.span_id));
        assert!(!child.parent_remote);
        assert_eq!(child.kind, SpanKind::Client);
        // The id the upstream request's traceparent carried.
        let sent = call.context.upstream_header(str_attr(child, attr::CALL_ID));
        assert_eq!(
            TraceParent::parse(&sent).map(|p| p.span_id),
            Some(child.span_id)
        );
        assert_eq!(str_attr(child, attr::SERVER_ADDRESS), "127.0.0.1");
    }
    let by_role = |role: &str| {
        spans[1..]
            .iter()
            .find(|s| str_attr(s, attr::LEG_ROLE) == role)
            .unwrap_or_else(|| panic!("no {role} span"))
    };
    let hedge = by_role("hedge");
    assert_eq!(str_attr(hedge, attr::HEDGE_REASON), "stall");
    assert_eq!(hedge.error.as_deref(), Some("hedge_cancelled"));
    let primary = by_role("primary");
    assert_eq!(str_attr(primary, attr::ERROR_TYPE), "stream_cut");
    assert_eq!(int_attr(primary, attr::STALL_COUNT), 1);
    assert!(primary.attr(attr::RESPONSE_MODEL).is_none());
    let resume = by_role("resume");
    assert_eq!(resume.name, "chat model-of-anthropic-1");
    assert_eq!(str_attr(resume, attr::RESUME_MODE), "replay");
    assert_eq!(str_attr(resume, attr::RESUME_OF), "a-1");
    assert_eq!(int_attr(resume, attr::USAGE_INPUT_TOKENS), 110);
    assert_eq!(
        str_attr(resume, attr::RESPONSE_MODEL),
        "model-of-anthropic-1"
    );
    assert_eq!(str_attr(resume, attr::USAGE_SOURCE), "measured");
    assert_eq!(
        (resume.start_ns, resume.end_ns),
        (T0 + 1_500 * MS, T0 + 3_000 * MS)
    );
    assert_eq!(resume.error, None);
}

#[test]
fn a_failed_call_names_its_error_and_an_unknown_cost_stays_unknown() {
    let mut call = resumed_call();
    call.answer = None;
    call.error_type = Some("all_sources_failed".into());
    call.attempts[0].row.cost = None;
    let root = &call.spans()[0];
    assert_eq!(root.error.as_deref(), Some("all_sources_failed"));
    assert_eq!(str_attr(root, attr::ERROR_TYPE), "all_sources_failed");
    assert!(root.attr(attr::COST).is_none(), "NULL, not 0");
    assert!(root.attr(attr::RESPONSE_MODEL).is_none());
    let points = call.metric_points();
    let calls: Vec<&Point> = points
        .iter()
        .filter(|p| p.instrument == Instrument::Calls)
        .collect();
    assert_eq!(calls.len(), 1);
    assert!(calls[0]
        .attributes
        .contains(&(attr::OUTCOME, Value::Str("all_sources_failed".into()))));
}

#[test]
fn captured_contents_go_on_the_call_span_only() {
    let mut call = resumed_call();
    call.contents = Some(Contents {
        input: r#"[{"role":"user","parts":[{"type":"text","content":"hi"}]}]"#.into(),
        output: Some("[]".into()),
    });
    let spans = call.spans();
    assert!(spans[0].attr(attr::INPUT_MESSAGES).is_some());
    assert!(spans[0].attr(attr::OUTPUT_MESSAGES).is_some());
    assert!(spans[1..]
        .iter()
        .all(|s| s.attr(attr::INPUT_MESSAGES).is_none()));
}

#[test]
fn metric_points_count_every_request_and_its_tokens() {
    let call = resumed_call();
    let points = call.metric_points();
    let of = |i: Instrument| points.iter().filter(move |p| p.instrument == i);
    assert_eq!(of(Instrument::OperationDuration).count(), 3);
    assert_eq!(of(Instrument::Attempts).count(), 3);
    let tokens: f64 = of(Instrument::TokenUsage).map(|p| p.value).sum();
    assert_eq!(tokens, 100.0 + 12.0 + 110.0 + 40.0);
    assert!(of(Instrument::TokenUsage).all(|p| p
        .attributes
        .iter()
        .any(|(k, v)| *k == attr::TOKEN_TYPE
            && matches!(v, Value::Str(t) if t == "input" || t == "output"))));
    assert_eq!(
        of(Instrument::TimeToFirstChunk).next().map(|p| p.value),
        Some(0.25)
    );
    let cost: f64 = of(Instrument::Cost).map(|p| p.value).sum();
    assert!((cost - 0.003).abs() < 1e-12, "{cost}");
    assert_eq!(of(Instrument::Calls).count(), 1);
    assert_eq!(
        of(Instrument::CallDuration).next().map(|p| p.value),
        Some(3.0)
    );
    for i in Instrument::ALL {
        assert!(!i.name().is_empty() && !i.unit().is_empty());
        assert_eq!(i.is_histogram(), !i.boundaries().is_empty(), "{}", i.name());
    }
}

#[test]
fn a_call_without_a_caller_is_a_root_span_of_its_own_trace() {
    let mut call = resumed_call();
    call.context = CallContext::new("call-1", None, &Sampler::default());
    let root = &call.spans()[0];
    assert_eq!(root.parent, None);
    assert!(!root.parent_remote);
    assert_eq!(root.trace_id, trace_id_of("call-1"));
}
