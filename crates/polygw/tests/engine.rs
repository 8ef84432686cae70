//! The call engine under tokio's paused clock with event-driven fake transports:
//! retries, admission, deadline, hedging (both triggers), stats, telemetry rows and
//! cancellation. Covers the predecessor's hedge matrix (batches C–I, table G) and the
//! stall-hedge cases.

use std::sync::Arc;
use std::time::Duration;

use polygw::core::ports::{BreakerStore, RateLimiter};
use polygw::core::telemetry::RowKind;
use polygw::{
    ChatRequest, ErrorClass, ErrorLabel, GatewayClient, GatewayError, ScopeSettings, SourceConfig,
    TerminalReason, Usage, UsageSource,
};
use polygw_limiter_memory::{MemoryBreakerStore, MemoryLimiter};
use polygw_testkit::clock::TokioClock;
use polygw_testkit::fakes::{FakeEnd, FakeTransport, Gate, RecordingTelemetry, Script};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

struct H {
    client: GatewayClient,
    fake: Arc<FakeTransport>,
    rows: Arc<RecordingTelemetry>,
    limiter: Arc<MemoryLimiter>,
    breakers: Arc<MemoryBreakerStore>,
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
    let mut s = ScopeSettings::new("LLM", sources);
    s.retry.backoff_base = ms(100);
    s.retry.backoff_max = secs(1);
    s
}

async fn harness_with(s: ScopeSettings) -> H {
    let clock = Arc::new(TokioClock);
    let fake = FakeTransport::new(clock.clone());
    let rows = RecordingTelemetry::new();
    let limiter = Arc::new(MemoryLimiter::new(clock.clone()));
    let breakers = Arc::new(MemoryBreakerStore::new(clock.clone()));
    let client = GatewayClient::builder(s)
        .transport(fake.clone())
        .telemetry(rows.clone())
        .limiter(limiter.clone())
        .breakers(breakers.clone())
        .clock(clock)
        .rng(Arc::new(polygw::core::ports::SplitMix64::new(7)))
        .build()
        .await
        .expect("client");
    H {
        client,
        fake,
        rows,
        limiter,
        breakers,
    }
}

async fn harness(n: usize, f: impl FnOnce(&mut ScopeSettings)) -> H {
    let mut s = scope(n);
    f(&mut s);
    harness_with(s).await
}

fn labels(rows: &[polygw::core::TelemetryRow]) -> Vec<String> {
    let mut v: Vec<String> = rows
        .iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .map(|r| r.error.clone().unwrap_or_else(|| "ok".into()))
        .collect();
    v.sort();
    v
}

fn attempt_rows(h: &H) -> Vec<polygw::core::TelemetryRow> {
    h.rows
        .rows()
        .into_iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .collect()
}

async fn in_flight_all(h: &H, n: usize) -> Vec<u32> {
    let mut v = vec![];
    for i in 0..n {
        v.push(h.limiter.in_flight("LLM", &format!("s-{i}")).await.unwrap());
    }
    v
}

/// Tasks alive once the memory store's lease ticker has had its tick: it ends at the
/// first tick (a third of the lease) that finds no lease held, so after one tick no task
/// is left of a finished call.
async fn alive_tasks() -> usize {
    tokio::time::sleep(polygw_core::settings::DEFAULT_LEASE / 3 + Duration::from_millis(1)).await;
    tokio::task::yield_now().await;
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

fn assert_send<T: Send>(_: &T) {}

// ---------------------------------------------------------------- basics, retries

mod basics {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn plain_success_figures_and_row() {
        let h = harness(1, |_| {}).await;
        h.fake.push("s-0", Script::ok(ms(300), "hello"));
        let fut = h.client.chat(ChatRequest::user("hi"));
        assert_send(&fut);
        let r = fut.await.unwrap();
        assert_eq!(r.content, "hello");
        assert_eq!(r.source, "s-0");
        assert_eq!(r.model, "model-0");
        let st = r.call_stats;
        assert_eq!(
            (st.attempts, st.hedges, st.hedge_won, st.cache_hit),
            (1, 0, false, false)
        );
        assert_eq!(st.generation_ms, 300);
        assert_eq!(
            (st.stall_ms, st.stall_count),
            (None, None),
            "plain call: no stall figures"
        );
        assert_eq!(r.ttft_ms, None);
        assert_eq!(st.total_latency_ms, 300);
        let rows = h.rows.rows_of(&r.logical_call_id);
        assert_eq!(rows.len(), 1);
        let row = &rows[0];
        assert!(row.ok && row.error.is_none());
        assert_eq!(row.usage_source, UsageSource::Measured);
        assert_eq!(
            (row.prompt_tokens, row.completion_tokens),
            (Some(10), Some(5))
        );
        assert_eq!(row.cost, None, "no price configured: cost unknown, not 0");
        assert_eq!(row.attempt_index, Some(0));
        assert_eq!(row.latency_ms, Some(300));
    }

    #[tokio::test(start_paused = true)]
    async fn stream_figures_come_from_chunk_timestamps() {
        let h = harness(1, |s| s.stream.stall_threshold = ms(1000)).await;
        h.fake.push(
            "s-0",
            Script::stream(ms(200), &[ms(100), ms(2500), ms(100), ms(1500)], "abcdef"),
        );
        let r = h
            .client
            .chat(ChatRequest::user("hi").with_stream(true))
            .await
            .unwrap();
        assert_eq!(r.ttft_ms, Some(200));
        assert_eq!(r.max_inter_token_ms, Some(2500));
        let st = r.call_stats;
        assert_eq!(st.stall_count, Some(2));
        assert_eq!(st.stall_ms, Some(4000));
        // wall = 200 + 100 + 2500 + 100 + 1500 = 4400 = generation + stall
        assert_eq!(st.generation_ms + st.stall_ms.unwrap(), 4400);
        assert_eq!(st.generation_ms, 400);
        let row = &attempt_rows(&h)[0];
        assert_eq!((row.stall_ms, row.stall_count), (Some(4000), Some(2)));
        assert_eq!(row.ttft_ms, Some(200));
        assert!(row.stream);
    }

    #[tokio::test(start_paused = true)]
    async fn transient_failure_retries_on_another_source_and_generation_excludes_backoff() {
        let h = harness(2, |s| {
            s.sources[1].priority = 1;
            s.retry.backoff_base = secs(5);
            s.retry.backoff_max = secs(5);
        })
        .await;
        h.fake.push("s-0", Script::http(ms(100), 503));
        h.fake.push("s-1", Script::ok(ms(200), "fine"));
        let r = h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!(
            r.source, "s-1",
            "the failed source is not retried while another is admissible"
        );
        assert_eq!(r.call_stats.attempts, 2);
        assert_eq!(
            r.call_stats.generation_ms, 200,
            "winner's transport time only"
        );
        assert!(r.call_stats.total_latency_ms >= 300, "{:?}", r.call_stats);
        assert!(r.call_stats.total_latency_ms <= 5300, "{:?}", r.call_stats);
        assert_eq!(labels(&h.rows.rows()), ["ok", "server_error"]);
        let state = h.breakers.state("LLM", "s-0").await.unwrap();
        assert_eq!(state.consecutive_failures, 1, "5xx feeds the breaker");
    }

    #[tokio::test(start_paused = true)]
    async fn retry_exhausted_carries_last_error_and_reasons_and_a_terminal_row() {
        let h = harness(2, |s| s.retry.max_attempts = 2).await;
        h.fake.set_default("s-0", Script::http(ms(10), 500));
        h.fake.set_default("s-1", Script::http(ms(10), 502));
        let e = h.client.chat(ChatRequest::user("hi")).await.unwrap_err();
        assert_eq!(e.terminal_reason(), Some(TerminalReason::RetryExhausted));
        let ctx = e.context().unwrap();
        assert_eq!(ctx.attempts, 2);
        assert_eq!(
            ctx.last_error.as_ref().unwrap().label,
            ErrorLabel::ServerError
        );
        assert_eq!(ctx.reasons.len(), 2, "{:?}", ctx.reasons);
        let rows = h.rows.rows_of(&ctx.logical_call_id);
        let term: Vec<_> = rows
            .iter()
            .filter(|r| r.kind == RowKind::TerminalFailure)
            .collect();
        assert_eq!(term.len(), 1);
        assert_eq!(term[0].error.as_deref(), Some("retry_exhausted"));
        assert_eq!(term[0].usage_source, UsageSource::Unavailable);
        assert_eq!(term[0].cost, None);
        assert!(!term[0].ok);
    }

    #[tokio::test(start_paused = true)]
    async fn rejected_ends_the_call_at_once_keeping_the_provider_code() {
        // Same model on both sources: a context-length rejection has nowhere larger to
        // go (SPEC §14.9), so it is final.
        let h = harness(2, |s| s.sources[1].model = "model-0".into()).await;
        let err = polygw::AttemptError::new(ErrorClass::Rejected, ErrorLabel::Rejected, "too long")
            .with_status(400)
            .with_provider(
                Some("context_length_exceeded".into()),
                Some("max 8k".into()),
            );
        h.fake.set_default(
            "s-0",
            Script::Fail {
                after: ms(5),
                error: err.clone(),
            },
        );
        h.fake.set_default(
            "s-1",
            Script::Fail {
                after: ms(5),
                error: err,
            },
        );
        let e = h.client.chat(ChatRequest::user("hi")).await.unwrap_err();
        assert!(matches!(e, GatewayError::Rejected(_)), "{e}");
        assert_eq!(e.context().unwrap().attempts, 1);
        assert_eq!(
            e.last_error().unwrap().provider_code.as_deref(),
            Some("context_length_exceeded")
        );
        assert!(e.to_string().contains("context_length_exceeded"));
    }

    #[tokio::test(start_paused = true)]
    async fn rate_limited_rounds_are_refunded_and_wait_for_the_cooldown() {
        let h = harness(1, |s| s.retry.max_attempts = 1).await;
        h.fake
            .push("s-0", Script::rate_limited(ms(10), Some(secs(2))));
        h.fake.push("s-0", Script::ok(ms(10), "after cooldown"));
        let r = h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!(r.content, "after cooldown");
        assert_eq!(r.call_stats.attempts, 2);
        assert!(r.call_stats.total_latency_ms >= 2010, "{:?}", r.call_stats);
        let st = h.breakers.state("LLM", "s-0").await.unwrap();
        assert_eq!(st.consecutive_failures, 0, "429 does not feed the breaker");
    }

    #[tokio::test(start_paused = true)]
    async fn endless_429s_end_in_stalled() {
        let h = harness(1, |s| s.retry.stall_window = secs(5)).await;
        h.fake
            .set_default("s-0", Script::rate_limited(ms(10), Some(secs(1))));
        let e = h.client.chat(ChatRequest::user("hi")).await.unwrap_err();
        assert_eq!(e.terminal_reason(), Some(TerminalReason::Stalled), "{e}");
        assert!(e.context().unwrap().attempts >= 3);
    }

    #[tokio::test(start_paused = true)]
    async fn no_runnable_fail_lists_every_source_reason() {
        let h = harness(2, |s| {
            s.retry.on_no_runnable = polygw::core::OnNoRunnable::Fail;
            for src in &mut s.sources {
                src.rpm = 1;
            }
        })
        .await;
        h.client.chat(ChatRequest::user("a")).await.unwrap();
        h.client.chat(ChatRequest::user("b")).await.unwrap();
        let e = h.client.chat(ChatRequest::user("c")).await.unwrap_err();
        match &e {
            GatewayError::NoRunnableSource(ctx) => {
                assert_eq!(ctx.reasons.len(), 2);
                for r in ctx.reasons.values() {
                    assert_eq!(r.to_string(), "refused: rpm");
                }
                assert!(ctx.retry_after.is_some(), "the window hint is reported");
            }
            other => panic!("{other}"),
        }
        assert_eq!(e.context().unwrap().attempts, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn no_runnable_wait_waits_for_the_window() {
        let h = harness(1, |s| s.sources[0].rpm = 1).await;
        h.client.chat(ChatRequest::user("a")).await.unwrap();
        let r = h.client.chat(ChatRequest::user("b")).await;
        // The stall window (60 s) equals the RPM window: the wait ends first or exactly.
        match r {
            Ok(r) => assert!(
                r.call_stats.total_latency_ms >= 59_000,
                "{:?}",
                r.call_stats
            ),
            Err(e) => assert_eq!(e.terminal_reason(), Some(TerminalReason::Stalled)),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_waiting_for_a_slot_runs_when_one_frees() {
        let h = harness(1, |s| s.sources[0].max_concurrency = 2).await;
        h.fake.set_default("s-0", Script::ok(ms(200), "x"));
        let started = tokio::time::Instant::now();
        let calls: Vec<_> = (0..3)
            .map(|i| {
                let c = h.client.clone();
                tokio::spawn(async move { c.chat(ChatRequest::user(format!("{i}"))).await })
            })
            .collect();
        let mut latencies = vec![];
        for c in calls {
            latencies.push(c.await.unwrap().unwrap().call_stats.total_latency_ms);
        }
        latencies.sort();
        assert_eq!(latencies[..2], [200, 200]);
        // Not the 30 s lease of the slots it waited for: the first release wakes it.
        assert!(latencies[2] <= 450, "{latencies:?}");
        assert!(started.elapsed() <= ms(450));
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_waiting_for_tokens_runs_when_a_settlement_frees_them() {
        // est 1000 of a 2000 TPM: two calls reserve it all; they settle 20 tokens each.
        let h = harness(1, |s| {
            s.sources[0].tpm = 2000;
            s.sources[0].est_tokens = 1000;
        })
        .await;
        h.fake.set_default(
            "s-0",
            Script::Ok {
                ttft: ms(200),
                gaps: vec![],
                text: "x".into(),
                usage: Some(Usage::new(10, 10)),
            },
        );
        let calls: Vec<_> = (0..3)
            .map(|i| {
                let c = h.client.clone();
                tokio::spawn(async move { c.chat(ChatRequest::user(format!("{i}"))).await })
            })
            .collect();
        let mut latencies = vec![];
        for c in calls {
            latencies.push(c.await.unwrap().unwrap().call_stats.total_latency_ms);
        }
        latencies.sort();
        assert!(latencies[2] <= 450, "not the 60 s window: {latencies:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn dead_source_is_skipped_afterwards() {
        let h = harness(2, |s| s.sources[1].priority = 1).await;
        h.fake.push("s-0", Script::http(ms(5), 401));
        h.fake.push("s-0", Script::http(ms(5), 401));
        h.fake.set_default("s-0", Script::ok(ms(5), "s-0 again"));
        h.fake.set_default("s-1", Script::ok(ms(5), "ok"));
        let r = h.client.chat(ChatRequest::user("a")).await.unwrap();
        assert_eq!(r.source, "s-1");
        // SPEC §17.4: one 401 is not enough (BREAKER__DEAD_AFTER = 2).
        let r = h.client.chat(ChatRequest::user("b")).await.unwrap();
        assert_eq!(r.source, "s-1");
        assert_eq!(h.fake.calls_to("s-0"), 2, "s-0 was tried again once");
        let r = h.client.chat(ChatRequest::user("c")).await.unwrap();
        assert_eq!(r.source, "s-1", "s-0 is dead for BREAKER__DEAD_S");
        assert_eq!(h.fake.calls_to("s-0"), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_cancels_and_labels_deadline() {
        let h = harness(1, |s| s.call_deadline = Some(secs(2))).await;
        h.fake.set_default("s-0", Script::Hang);
        let e = h.client.chat(ChatRequest::user("a")).await.unwrap_err();
        assert_eq!(
            e.terminal_reason(),
            Some(TerminalReason::DeadlineExceeded),
            "{e}"
        );
        assert_eq!(labels(&h.rows.rows()), ["deadline"]);
        let term = h
            .rows
            .rows()
            .into_iter()
            .find(|r| r.kind == RowKind::TerminalFailure)
            .unwrap();
        assert_eq!(term.error.as_deref(), Some("deadline_exceeded"));
        assert_eq!(term.latency_ms, Some(2000));
        assert_eq!(in_flight_all(&h, 1).await, [0]);
        // the reservation was kept (cancelled → est)
        assert_eq!(h.fake.calls()[0].end, FakeEnd::Dropped);
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_bounds_backoff_waits() {
        let h = harness(1, |s| {
            s.call_deadline = Some(secs(3));
            s.retry.backoff_base = secs(8);
            s.retry.backoff_max = secs(8);
        })
        .await;
        h.fake.set_default("s-0", Script::http(ms(10), 500));
        let started = tokio::time::Instant::now();
        let e = h.client.chat(ChatRequest::user("a")).await.unwrap_err();
        assert!(matches!(
            e.terminal_reason(),
            Some(TerminalReason::DeadlineExceeded | TerminalReason::RetryExhausted)
        ));
        assert!(started.elapsed() <= secs(3), "{:?}", started.elapsed());
    }

    #[tokio::test(start_paused = true)]
    async fn invalid_request_names_the_field() {
        let h = harness(1, |_| {}).await;
        let e = h.client.chat(ChatRequest::default()).await.unwrap_err();
        assert!(matches!(e, GatewayError::InvalidRequest { ref field, .. } if field == "messages"));
        assert!(h.fake.calls().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn usage_unavailable_settles_the_estimate_and_costs_null() {
        let h = harness(1, |s| {
            s.sources[0].tpm = 6000;
            s.sources[0].input_price = Some(1.0);
            s.sources[0].output_price = Some(2.0);
        })
        .await;
        h.fake.push(
            "s-0",
            Script::Ok {
                ttft: ms(5),
                gaps: vec![],
                text: "x".into(),
                usage: None,
            },
        );
        let r = h.client.chat(ChatRequest::user("a")).await.unwrap();
        assert_eq!(r.usage_source, UsageSource::Unavailable);
        assert_eq!(
            h.limiter.source_window("LLM", "s-0"),
            (1, 100),
            "est = 6000/60 settled"
        );
        let row = &attempt_rows(&h)[0];
        assert_eq!((row.cost, row.prompt_tokens), (None, None));
        h.fake.push(
            "s-0",
            Script::Ok {
                ttft: ms(5),
                gaps: vec![],
                text: "x".into(),
                usage: Some(Usage::new(1000, 500)),
            },
        );
        h.client.chat(ChatRequest::user("b")).await.unwrap();
        let row = attempt_rows(&h).pop().unwrap();
        assert_eq!(row.cost, Some((1000.0 * 1.0 + 500.0 * 2.0) / 1e6));
        assert_eq!(h.limiter.source_window("LLM", "s-0"), (2, 1600));
    }
}

// ---------------------------------------------------------------- first-token hedge (table G)

mod hedge_first_token {
    use super::*;

    fn hedged(n: usize) -> impl FnOnce(&mut ScopeSettings) {
        move |s: &mut ScopeSettings| {
            let _ = n;
            s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(500));
            s.hedge.budget_pct = 0;
            s.sources
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| x.priority = i as u32);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn plain_call_triggers_hedge_and_fast_leg_wins() {
        let h = harness(2, hedged(2)).await;
        h.fake.push("s-0", Script::Hang);
        h.fake.push("s-1", Script::ok(ms(100), "fast"));
        let r = h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!(r.content, "fast");
        let st = r.call_stats;
        assert_eq!((st.attempts, st.hedges, st.hedge_won), (2, 1, true));
        assert_eq!(st.total_latency_ms, 600, "threshold + fast leg");
        assert_eq!(
            st.generation_ms, 100,
            "excludes time before the hedge leg started"
        );
        let rows = h.rows.rows_of(&r.logical_call_id);
        assert_eq!(labels(&rows), ["hedge_cancelled", "ok"]);
        assert!(rows.iter().all(|x| x.logical_call_id == r.logical_call_id));
        let winner = rows.iter().find(|x| x.ok).unwrap();
        assert!(winner.is_hedge && winner.source.as_deref() == Some("s-1"));
        assert!(rows.iter().all(|x| x.kind != RowKind::TerminalFailure));
        assert_eq!(alive_tasks().await, 0, "no task outlives the call");
    }

    #[tokio::test(start_paused = true)]
    async fn stream_hedges_only_while_the_first_token_is_absent() {
        let h = harness(2, hedged(2)).await;
        // first token at 100 ms, then a long (but allowed) gap
        h.fake
            .push("s-0", Script::stream(ms(100), &[secs(3)], "ab"));
        let r = h
            .client
            .chat(ChatRequest::user("hi").with_stream(true))
            .await
            .unwrap();
        assert_eq!((r.call_stats.attempts, r.call_stats.hedges), (1, 0));
        // no first token within 500 ms → hedge
        h.fake.push("s-0", Script::stream(secs(2), &[], "late"));
        h.fake.push("s-1", Script::stream(ms(100), &[], "early"));
        let r = h
            .client
            .chat(ChatRequest::user("hi").with_stream(true))
            .await
            .unwrap();
        assert_eq!(
            (
                r.call_stats.attempts,
                r.call_stats.hedges,
                r.call_stats.hedge_won
            ),
            (2, 1, true)
        );
        assert_eq!(r.content, "early");
        assert_eq!(r.ttft_ms, Some(100), "figures come from the winner");
    }

    #[tokio::test(start_paused = true)]
    async fn hedge_is_silent_when_no_other_source_is_admissible() {
        let h = harness(2, |s| {
            hedged(2)(s);
            s.sources[1].max_concurrency = 1;
        })
        .await;
        // Occupy s-1's only slot.
        let blocker = match h
            .limiter
            .acquire(&polygw::core::ports::AcquireRequest {
                scope: "LLM",
                source: "s-1",
                rpm: 0,
                tpm: 0,
                max_concurrency: 1,
                scope_rpm: 0,
                scope_tpm: 0,
                est_tokens: 0,
                lease: secs(600),
            })
            .await
            .unwrap()
        {
            polygw::core::ports::Admission::Admitted(p) => p,
            _ => panic!("slot"),
        };
        h.fake.push("s-0", Script::ok(secs(2), "slow but fine"));
        let r = h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!((r.call_stats.attempts, r.call_stats.hedges), (1, 0));
        assert_eq!(r.content, "slow but fine");
        assert_eq!(h.fake.calls_to("s-1"), 0);
        drop(blocker);
    }

    #[tokio::test(start_paused = true)]
    async fn single_source_scope_behaves_unhedged() {
        let h = harness(1, |s| {
            s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(500))
        })
        .await;
        assert!(!h.client.warnings().is_empty(), "one-source hedge warning");
        h.fake.push("s-0", Script::ok(secs(2), "x"));
        let r = h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!((r.call_stats.attempts, r.call_stats.hedges), (1, 0));
        assert_eq!(r.call_stats.total_latency_ms, 2000);
    }

    #[tokio::test(start_paused = true)]
    async fn winner_settles_usage_loser_keeps_estimate_and_slots_free() {
        let h = harness(2, |s| {
            hedged(2)(s);
            for x in &mut s.sources {
                x.tpm = 60_000; // est = 1000
            }
        })
        .await;
        h.fake.push("s-0", Script::Hang);
        h.fake.push(
            "s-1",
            Script::Ok {
                ttft: ms(50),
                gaps: vec![],
                text: "w".into(),
                usage: Some(Usage::new(300, 20)),
            },
        );
        h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!(
            h.limiter.source_window("LLM", "s-1"),
            (1, 320),
            "winner: actual usage"
        );
        assert_eq!(
            h.limiter.source_window("LLM", "s-0"),
            (1, 1000),
            "loser: reservation kept"
        );
        assert_eq!(in_flight_all(&h, 2).await, [0, 0]);
    }

    #[tokio::test(start_paused = true)]
    async fn loser_does_not_feed_the_breaker() {
        let h = harness(2, |s| {
            hedged(2)(s);
            s.breaker.failures = 1;
        })
        .await;
        for _ in 0..3 {
            h.fake.push("s-0", Script::Hang);
            h.fake.push("s-1", Script::ok(ms(10), "w"));
            h.client.chat(ChatRequest::user("hi")).await.unwrap();
        }
        let st = h.breakers.state("LLM", "s-0").await.unwrap();
        assert_eq!(st.consecutive_failures, 0);
        assert!(!st.is_tripped());
        assert_eq!(
            h.fake.calls_to("s-0"),
            3,
            "still chosen first: not penalised"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn caller_drop_cancels_every_leg_as_cancelled() {
        let h = harness(2, hedged(2)).await;
        h.fake.set_default("s-0", Script::Hang);
        h.fake.set_default("s-1", Script::Hang);
        let client = h.client.clone();
        let fake = h.fake.clone();
        let call = tokio::spawn(async move { client.chat(ChatRequest::user("hi")).await });
        fake.wait_started(2).await;
        call.abort();
        let _ = call.await;
        assert_eq!(
            labels(&h.rows.rows()),
            ["cancelled", "cancelled"],
            "no hedge_cancelled on caller drop"
        );
        assert!(
            h.rows.rows().iter().all(|r| r.kind == RowKind::Attempt),
            "a dropped call is not a failed call"
        );
        assert_eq!(in_flight_all(&h, 2).await, [0, 0]);
        assert!(h.fake.calls().iter().all(|c| c.end == FakeEnd::Dropped));
        assert_eq!(alive_tasks().await, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_cuts_the_hedged_tree() {
        let h = harness(2, |s| {
            hedged(2)(s);
            s.call_deadline = Some(secs(2));
        })
        .await;
        h.fake.set_default("s-0", Script::Hang);
        h.fake.set_default("s-1", Script::Hang);
        let e = h.client.chat(ChatRequest::user("hi")).await.unwrap_err();
        assert!(matches!(e, GatewayError::DeadlineExceeded(_)));
        assert_eq!(e.context().unwrap().attempts, 2);
        assert_eq!(labels(&h.rows.rows()), ["deadline", "deadline"]);
        assert_eq!(in_flight_all(&h, 2).await, [0, 0]);
    }

    #[tokio::test(start_paused = true)]
    async fn primary_that_finishes_first_wins_back() {
        let h = harness(2, hedged(2)).await;
        h.fake.push("s-0", Script::ok(ms(800), "primary"));
        h.fake.push("s-1", Script::Hang);
        let r = h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!(r.content, "primary");
        assert_eq!((r.call_stats.hedges, r.call_stats.hedge_won), (1, false));
        assert_eq!(r.call_stats.generation_ms, 800);
        let rows = h.rows.rows_of(&r.logical_call_id);
        let loser = rows.iter().find(|x| !x.ok).unwrap();
        assert_eq!(
            (loser.source.as_deref(), loser.error.as_deref()),
            (Some("s-1"), Some("hedge_cancelled"))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn legs_completing_together_go_to_the_earliest_launched() {
        let h = harness(2, hedged(2)).await;
        let gate = Gate::new();
        h.fake.push(
            "s-0",
            Script::Gated {
                gate: gate.clone(),
                then: Box::new(Script::ok(ms(0), "primary")),
            },
        );
        h.fake.push(
            "s-1",
            Script::Gated {
                gate: gate.clone(),
                then: Box::new(Script::ok(ms(0), "hedge")),
            },
        );
        let client = h.client.clone();
        let call = tokio::spawn(async move { client.chat(ChatRequest::user("hi")).await });
        h.fake.wait_started(2).await;
        gate.open();
        let r = call.await.unwrap().unwrap();
        assert_eq!(r.content, "primary");
        assert!(!r.call_stats.hedge_won);
        // both completed: both are normal success rows (nobody was cancelled)
        assert_eq!(labels(&h.rows.rows_of(&r.logical_call_id)), ["ok", "ok"]);
    }

    #[tokio::test(start_paused = true)]
    async fn both_legs_failing_counts_the_budget_once() {
        let h = harness(2, |s| {
            hedged(2)(s);
            s.retry.max_attempts = 2;
        })
        .await;
        h.fake.set_default(
            "s-0",
            Script::fail(secs(1), ErrorClass::Transient, ErrorLabel::ServerError),
        );
        h.fake.set_default(
            "s-1",
            Script::fail(ms(800), ErrorClass::Transient, ErrorLabel::ServerError),
        );
        let e = h.client.chat(ChatRequest::user("hi")).await.unwrap_err();
        assert_eq!(e.terminal_reason(), Some(TerminalReason::RetryExhausted));
        assert_eq!(e.context().unwrap().attempts, 4, "two rounds of two legs");
    }

    #[tokio::test(start_paused = true)]
    async fn all_legs_429_are_refunded() {
        let h = harness(2, |s| {
            hedged(2)(s);
            s.retry.max_attempts = 1;
            s.retry.stall_window = secs(3);
        })
        .await;
        h.fake
            .set_default("s-0", Script::rate_limited(secs(1), Some(ms(200))));
        h.fake
            .set_default("s-1", Script::rate_limited(ms(600), Some(ms(200))));
        let e = h.client.chat(ChatRequest::user("hi")).await.unwrap_err();
        assert_eq!(e.terminal_reason(), Some(TerminalReason::Stalled), "{e}");
    }

    #[tokio::test(start_paused = true)]
    async fn mixed_429_and_failure_counts_the_budget() {
        let h = harness(2, |s| {
            hedged(2)(s);
            s.retry.max_attempts = 1;
        })
        .await;
        h.fake.push("s-0", Script::rate_limited(secs(1), None));
        h.fake.push(
            "s-1",
            Script::fail(ms(700), ErrorClass::Transient, ErrorLabel::Timeout),
        );
        let e = h.client.chat(ChatRequest::user("hi")).await.unwrap_err();
        assert_eq!(
            e.terminal_reason(),
            Some(TerminalReason::RetryExhausted),
            "{e}"
        );
        assert_eq!(e.last_error().unwrap().label, ErrorLabel::Timeout);
    }

    #[tokio::test(start_paused = true)]
    async fn a_leg_failing_while_another_runs_is_recorded_and_the_round_goes_on() {
        let h = harness(2, hedged(2)).await;
        h.fake.push(
            "s-0",
            Script::fail(ms(900), ErrorClass::Transient, ErrorLabel::ServerError),
        );
        h.fake.push("s-1", Script::ok(ms(1000), "late win"));
        let r = h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!(r.content, "late win");
        assert_eq!(r.call_stats.attempts, 2);
        assert_eq!(
            labels(&h.rows.rows_of(&r.logical_call_id)),
            ["ok", "server_error"]
        );
        assert_eq!(
            h.breakers
                .state("LLM", "s-0")
                .await
                .unwrap()
                .consecutive_failures,
            1
        );
    }

    #[tokio::test(start_paused = true)]
    async fn up_to_max_extra_legs_one_trigger_each() {
        let h = harness(3, |s| {
            hedged(3)(s);
            s.hedge.max_extra = 2;
        })
        .await;
        h.fake.push("s-0", Script::Hang);
        h.fake.push("s-1", Script::Hang);
        h.fake.push("s-2", Script::ok(ms(100), "third"));
        let r = h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!(
            (
                r.call_stats.attempts,
                r.call_stats.hedges,
                r.call_stats.hedge_won
            ),
            (3, 2, true)
        );
        assert_eq!(
            r.call_stats.total_latency_ms, 1100,
            "legs at 0, 500, 1000 ms"
        );
        let calls = h.fake.calls();
        let starts: Vec<u128> = calls
            .iter()
            .map(|c| (c.started - calls[0].started).as_millis())
            .collect();
        assert_eq!(starts, [0, 500, 1000]);
        assert_eq!(
            labels(&h.rows.rows_of(&r.logical_call_id)),
            ["hedge_cancelled", "hedge_cancelled", "ok"]
        );
    }

    /// The budget is a token bucket (SPEC §19.1): full at the start (a burst of
    /// `HEDGE__BURST` legs), refilled by `BUDGET_PCT` of a leg per call.
    #[tokio::test(start_paused = true)]
    async fn hedge_budget_is_a_bucket_with_a_burst() {
        let h = harness(2, |s| {
            hedged(2)(s);
            s.hedge.budget_pct = 20;
            s.hedge.burst = 2;
        })
        .await;
        for _ in 0..8 {
            h.fake.push("s-0", Script::ok(secs(1), "slow"));
            h.fake.push("s-1", Script::ok(secs(5), "slower"));
        }
        let mut hedges = vec![];
        for i in 0..8 {
            let r = h
                .client
                .chat(ChatRequest::user(format!("{i}")))
                .await
                .unwrap();
            hedges.push(r.call_stats.hedges);
        }
        // Full (2 legs; the first call's credit is capped); the second call leaves 0.2
        // of a leg; the sixth call's credit makes a whole one again.
        assert_eq!(
            hedges,
            [1, 1, 0, 0, 0, 1, 0, 0],
            "burst of 2, then one per 5 calls"
        );
    }
}

// ---------------------------------------------------------------- auto hedging (SPEC §19)

mod hedge_auto {
    use super::*;

    fn prioritized(s: &mut ScopeSettings) {
        s.sources
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| x.priority = i as u32);
    }

    /// With the defaults (both triggers `auto`, 10 %, 50 samples), nothing hedges until
    /// the scope has 50 legs; then the first-token threshold is the distribution's 90th
    /// percentile (here the answers take 100..=2000 ms: about 1.81 s), within bounds.
    #[tokio::test(start_paused = true)]
    async fn the_first_token_threshold_follows_the_distribution() {
        let h = harness(2, prioritized).await;
        // Before 50 samples: a slow primary is not hedged.
        h.fake.push("s-0", Script::ok(secs(10), "slow"));
        let r = h.client.chat(ChatRequest::user("cold")).await.unwrap();
        assert_eq!(
            (r.call_stats.hedges, r.call_stats.total_latency_ms),
            (0, 10_000)
        );
        // 100 answers of 100..=1981 ms in a scrambled order; a hedge leg, should one
        // fire for the slowest, loses (the fallback is slower still).
        h.fake.set_default("s-1", Script::ok(secs(60), "later"));
        let mut hedged = 0;
        for i in 0..100u64 {
            h.fake
                .push("s-0", Script::ok(ms(100 + 19 * (i * 37 % 100)), "ok"));
            let r = h
                .client
                .chat(ChatRequest::user(format!("{i}")))
                .await
                .unwrap();
            assert_eq!(r.content, "ok");
            hedged += r.call_stats.hedges;
        }
        assert!(
            hedged <= 12,
            "about 10 % of the calls past the first 50: {hedged}"
        );
        // A fast answer is not hedged.
        h.fake.push("s-0", Script::ok(ms(300), "fast"));
        let r = h.client.chat(ChatRequest::user("fast")).await.unwrap();
        assert_eq!(r.call_stats.hedges, 0);
        // A slow primary now: hedged at about the 90th percentile.
        h.fake.push("s-0", Script::ok(secs(30), "stuck"));
        h.fake.push("s-1", Script::ok(ms(100), "rescued"));
        let r = h.client.chat(ChatRequest::user("slow")).await.unwrap();
        assert_eq!(r.content, "rescued");
        assert_eq!(r.call_stats.hedges, 1);
        let t = r.call_stats.total_latency_ms;
        assert!(
            (1_800..=2_050).contains(&t),
            "hedged at ≈ p90 (1.81 s) + 100 ms: {t} ms"
        );
        // SPEC §19.4: the winner's row explains the call.
        let rows = h.rows.rows_of(&r.logical_call_id);
        let winner = rows.iter().find(|x| x.ok).unwrap();
        let trace =
            polygw_core::trace::CallTrace::from_json(winner.trace.as_deref().unwrap()).unwrap();
        let lines = trace.timeline().join("\n");
        for want in [
            "round 1: hedge after first token",
            "(from the source's latency)",
            "leg 0 launched on s-0: primary",
            "leg 1 launched on s-1: hedge on its first token trigger",
            "leg 0 cancelled (hedge_cancelled)",
            "leg 1 won",
        ] {
            assert!(lines.contains(want), "{want:?} in\n{lines}");
        }
        let loser = rows.iter().find(|x| !x.ok).unwrap();
        assert_eq!(loser.trace, None, "only the call's last row carries it");
    }

    /// One streamed call whose primary (`s-0`) goes silent for `silence` after its 4th
    /// chunk, with a healthy `s-1`: its stats, once the answer is whole and the stall
    /// was rescued by one extra leg.
    async fn stalled_call(h: &H, i: u32, silence: Duration) -> polygw::CallStats {
        let gaps = [ms(50); 9];
        let mut stall = vec![ms(50); 9];
        stall[3] = silence;
        h.fake
            .push("s-0", Script::stream(ms(100), &stall, "abcdefghij"));
        h.fake
            .push("s-1", Script::stream(ms(100), &gaps, "abcdefghij"));
        let r = h
            .client
            .chat(ChatRequest::user(format!("stall {i}")).with_stream(true))
            .await
            .unwrap();
        assert_eq!(r.content, "abcdefghij");
        let st = r.call_stats;
        assert_eq!(st.hedges + st.resumes, 1, "stall {i} rescued: {st:?}");
        st
    }

    /// SPEC §19.1, item 3 of issue 24: a quiet scope rescues consecutive stalls, each at
    /// the stall threshold (the bucket's burst), and the `auto` stall threshold is the
    /// gap distribution's (ordinary gaps of 50 ms: the 1 s floor). Without priors: with
    /// them (the default), 60 legs give the learned value 30 % of the weight, and a
    /// threshold moves from its prior at most ×1.5 per window (see the next test).
    #[tokio::test(start_paused = true)]
    async fn consecutive_stalls_in_a_quiet_scope_are_each_rescued() {
        let h = harness(2, |s| {
            prioritized(s);
            s.hedge.priors = polygw::core::threshold::Priors {
                after: None,
                stall: None,
            };
        })
        .await;
        let gaps = [ms(50); 9];
        for i in 0..60 {
            h.fake
                .push("s-0", Script::stream(ms(100), &gaps, "abcdefghij"));
            let r = h
                .client
                .chat(ChatRequest::user(format!("{i}")).with_stream(true))
                .await
                .unwrap();
            assert_eq!(r.call_stats.hedges + r.call_stats.resumes, 0, "call {i}");
        }
        for i in 0..3 {
            let st = stalled_call(&h, i, secs(60)).await;
            // Last chunk at 250 ms, the stall hedge 1 s later, a 550 ms leg after it.
            assert!(
                st.total_latency_ms < 2_500,
                "stall {i}: {} ms",
                st.total_latency_ms
            );
        }
    }

    /// SPEC §25.1: a fresh process is protected from its first call. With the defaults
    /// alone, the first stream that goes silent for 40 s mid-answer is continued on the
    /// second source at the stall prior (10 s), and the next two likewise (the budget's
    /// burst); a first token that takes 20 s is hedged at the first-token prior (15 s).
    #[tokio::test(start_paused = true)]
    async fn a_fresh_process_is_protected_by_the_priors() {
        let h = harness(2, prioritized).await;
        let gaps = [ms(50); 9];
        for i in 0..3 {
            let st = stalled_call(&h, i, secs(40)).await;
            // Silent from 250 ms; the stall prior 10 s later; a 550 ms leg after it.
            assert!(
                (10_000..11_500).contains(&st.total_latency_ms),
                "stall {i}: {} ms",
                st.total_latency_ms
            );
        }
        // The three legs spent the budget's burst: a fresh process for the first token.
        let h = harness(2, prioritized).await;
        h.fake
            .push("s-0", Script::stream(secs(20), &gaps, "slow first token"));
        h.fake
            .push("s-1", Script::stream(ms(100), &gaps, "abcdefghij"));
        let r = h
            .client
            .chat(ChatRequest::user("slow first token").with_stream(true))
            .await
            .unwrap();
        let st = r.call_stats;
        assert_eq!((st.hedges, r.content.as_str()), (1, "abcdefghij"), "{st:?}");
        assert!(
            (15_000..16_000).contains(&st.total_latency_ms),
            "hedged at the first-token prior: {} ms",
            st.total_latency_ms
        );
    }

    /// SPEC §25.1: evidence is kept per upstream (base URL and model) and shared by
    /// every scope of the process that reaches it: a quiet scope whose source is the
    /// same upstream as a busy scope's reads the busy scope's legs (its own threshold,
    /// not the prior); a source on another model of the same URL does not.
    #[tokio::test(start_paused = true)]
    async fn scopes_reaching_one_upstream_share_its_evidence() {
        async fn client_on(
            book: &Arc<polygw::UpstreamEvidence>,
            name: &str,
            sources: Vec<SourceConfig>,
        ) -> (GatewayClient, Arc<FakeTransport>) {
            let fake = FakeTransport::new(Arc::new(TokioClock));
            let c = GatewayClient::builder(ScopeSettings::new(name, sources))
                .transport(fake.clone())
                .telemetry(RecordingTelemetry::new())
                .clock(Arc::new(TokioClock))
                .upstream_evidence(book.clone())
                .build()
                .await
                .unwrap();
            (c, fake)
        }
        let book = polygw::UpstreamEvidence::isolated(secs(600));
        let (busy, fake) = client_on(
            &book,
            "BUSY",
            vec![
                SourceConfig::new("u", 0, "http://127.0.0.1:9/v1/", "", "m"),
                SourceConfig::new("other", 0, "http://127.0.0.1:10/v1", "", "x"),
            ],
        )
        .await;
        for i in 0..200 {
            fake.push("u-0", Script::ok(ms(300), "ok"));
            fake.push("other-0", Script::ok(ms(300), "ok"));
            busy.chat(ChatRequest::user(format!("{i}"))).await.unwrap();
        }
        // The quiet scope names the URL without its trailing slash: the same upstream.
        let (quiet, _) = client_on(
            &book,
            "QUIET",
            vec![
                SourceConfig::new("q", 0, "http://127.0.0.1:9/v1", "", "m"),
                SourceConfig::new("r", 0, "http://127.0.0.1:9/v1", "", "another-model"),
            ],
        )
        .await;
        let views = quiet.hedge_latency(false);
        let busy_views = busy.hedge_latency(false);
        assert_eq!(views[0].0, "q-0");
        assert_eq!(
            views[0].1.ttft.samples(),
            busy_views[0].1.ttft.samples(),
            "one upstream, one book"
        );
        assert!(
            views[0].1.ttft.samples() > 50,
            "{:?}",
            views[0].1.ttft.samples()
        );
        assert_eq!(
            views[1].1.ttft.samples(),
            0,
            "another model is another upstream"
        );
        let t = quiet.hedge_thresholds(false);
        assert_eq!(
            t[0].1.after.origin,
            polygw_core::hedge::ThresholdOrigin::Source,
            "the busy scope's legs: {t:?}"
        );
    }

    /// SPEC §25.1: a long prompt or a high reasoning effort is not slow at the plain
    /// first-token prior: 20 s to the first token of a high-effort call is waited out
    /// (its prior is 45 s).
    #[tokio::test(start_paused = true)]
    async fn the_first_token_prior_grows_with_the_reasoning_effort() {
        let h = harness(2, prioritized).await;
        let gaps = [ms(50); 9];
        h.fake
            .push("s-0", Script::stream(secs(20), &gaps, "abcdefghij"));
        h.fake
            .push("s-1", Script::stream(ms(100), &gaps, "0123456789"));
        let r = h
            .client
            .chat(
                ChatRequest::user("think hard")
                    .with_stream(true)
                    .with_reasoning_effort("high"),
            )
            .await
            .unwrap();
        assert_eq!((r.call_stats.hedges, r.content.as_str()), (0, "abcdefghij"));
    }

    /// SPEC §19.1, the no-feedback-loop rule carried out by the engine: a leg the hedge
    /// beats is cancelled before its first token, and it stays in its source's
    /// distribution as a censored sample. Dropped instead, every cancellation would take
    /// the slowest answers out, the 90th percentile would fall, more calls would be
    /// hedged and cancelled — the threshold would spiral down. Here 300 answers of
    /// 100..=1981 ms, each slow one hedged: the threshold stays at the true p90, or no
    /// lower than `earlier` may take it on the true distribution (the quantile of 1.2 ×
    /// the share, p88 ≈ 1.75 s; DECISIONS 166).
    #[tokio::test(start_paused = true)]
    async fn hedging_never_pulls_its_own_threshold_down() {
        let h = harness(2, prioritized).await;
        h.fake.set_default("s-1", Script::ok(ms(100), "rescued"));
        let mut hedged = 0;
        for i in 0..300u64 {
            h.fake
                .push("s-0", Script::ok(ms(100 + 19 * (i * 37 % 100)), "ok"));
            let r = h
                .client
                .chat(ChatRequest::user(format!("{i}")))
                .await
                .unwrap();
            hedged += r.call_stats.hedges;
        }
        assert!(hedged >= 20, "the slow answers were hedged: {hedged}");
        let t = h.client.hedge_thresholds(false)[0].1.after.value.unwrap();
        assert!(
            t >= ms(1_740),
            "the threshold stays at the true p90 (≈ 1.81 s) or p88 (≈ 1.75 s): {t:?}"
        );
        let latency = h.client.hedge_latency(false);
        let (name, s0) = &latency[0];
        assert_eq!(name, "s-0");
        let s1 = &latency[1].1;
        assert_eq!(
            s0.ttft.samples(),
            300,
            "one sample per leg, cancelled or not"
        );
        assert_eq!(
            s1.ttft.samples(),
            u64::from(hedged),
            "the hedge legs' too, won or cancelled"
        );
        assert_eq!(
            s0.ttft.censored() + s1.ttft.censored(),
            u64::from(hedged),
            "each hedged call cancelled one leg before its first token: a censored sample"
        );
        assert!(s0.ttft.censored() >= 10, "{}", s0.ttft.censored());
    }

    /// A trigger that finds the hedge budget spent asks again while its leg stays silent
    /// (every eighth of the threshold): a stall is rescued once the calls that start
    /// meanwhile refill the budget, instead of waiting out the whole stall. The call's
    /// trace says why the first attempt launched nothing.
    #[tokio::test(start_paused = true)]
    async fn a_stall_that_finds_the_budget_spent_is_rescued_once_it_refills() {
        use polygw_core::hedge::ThresholdSetting;
        let h = harness(2, |s| {
            prioritized(s);
            s.hedge.after = ThresholdSetting::Off;
            s.hedge.stall_after = ThresholdSetting::Static(secs(1));
            s.hedge.budget_pct = 50;
            s.hedge.burst = 1;
            s.hedge.max_extra = 1;
        })
        .await;
        let mut stall = vec![ms(50); 9];
        stall[3] = secs(60);
        let gaps = [ms(50); 9];
        // Call 1 takes the bucket's one leg; call 2 finds half a leg.
        for _ in 0..2 {
            h.fake
                .push("s-0", Script::stream(ms(100), &stall, "abcdefghij"));
            h.fake
                .push("s-1", Script::stream(ms(100), &gaps, "abcdefghij"));
        }
        let r = h
            .client
            .chat(ChatRequest::user("one").with_stream(true))
            .await
            .unwrap();
        assert_eq!(r.call_stats.hedges, 1, "the burst rescues the first stall");
        let client = h.client.clone();
        let two = tokio::spawn(async move {
            client
                .chat(ChatRequest::user("two").with_stream(true))
                .await
        });
        // Call 2 stalls at 250 ms; its trigger at 1.25 s finds half a leg. At 5 s a
        // third call starts and adds the other half.
        tokio::time::sleep(secs(5)).await;
        h.fake.push("s-0", Script::ok(ms(100), "three"));
        let r3 = h
            .client
            .chat(ChatRequest::user("three").with_stream(true))
            .await
            .unwrap();
        assert_eq!(r3.call_stats.hedges, 0);
        let r = two.await.unwrap().unwrap();
        assert_eq!(r.content, "abcdefghij");
        assert_eq!(r.call_stats.hedges, 1, "rescued: {:?}", r.call_stats);
        let t = r.call_stats.total_latency_ms;
        assert!(
            (5_000..=5_900).contains(&t),
            "rescued within an eighth of the threshold of the refill, not after the 60 s stall: {t} ms"
        );
        let rows = h.rows.rows_of(&r.logical_call_id);
        let last = rows.iter().find(|x| x.trace.is_some()).unwrap();
        let trace =
            polygw_core::trace::CallTrace::from_json(last.trace.as_deref().unwrap()).unwrap();
        let lines = trace.timeline().join("\n");
        let refusals = trace
            .events
            .iter()
            .filter(|e| matches!(e.event, polygw_core::trace::TraceEvent::NoLeg { .. }))
            .count();
        assert_eq!(
            refusals, 1,
            "the first refusal of the silence only:\n{lines}"
        );
        for want in [
            "leg 0: its stall trigger fired, no extra leg (the hedge budget is spent)",
            "leg 1 launched on s-1",
            // SPEC §25.2: the launch, ~4.75 s after the stall threshold, says why.
            "on its stall trigger",
            "into leg 0's silence (threshold 1000 ms) — later than it: the hedge budget was spent until then",
        ] {
            assert!(lines.contains(want), "{want:?} in\n{lines}");
        }
        let launch = trace
            .events
            .iter()
            .find_map(|e| match &e.event {
                polygw_core::trace::TraceEvent::Launch {
                    leg: 1,
                    silent_ms,
                    late,
                    ..
                } => Some((*silent_ms, late.clone())),
                _ => None,
            })
            .unwrap();
        assert!(
            launch.0.is_some_and(|s| (4_700..=5_700).contains(&s)),
            "{launch:?}"
        );
        assert_eq!(launch.1.as_deref(), Some("hedge_budget"));
    }

    /// A single-source scope never hedges `auto` (no other source); `off` turns it off.
    #[tokio::test(start_paused = true)]
    async fn auto_needs_two_sources_and_off_turns_it_off() {
        for (n, off) in [(1, false), (2, true)] {
            let h = harness(n, |s| {
                prioritized(s);
                if off {
                    s.hedge.after = polygw_core::hedge::ThresholdSetting::Off;
                    s.hedge.stall_after = polygw_core::hedge::ThresholdSetting::Off;
                }
            })
            .await;
            for i in 0..60 {
                h.fake.push("s-0", Script::ok(ms(100), "ok"));
                h.client
                    .chat(ChatRequest::user(format!("{i}")))
                    .await
                    .unwrap();
            }
            h.fake.push("s-0", Script::ok(secs(10), "slow"));
            let r = h.client.chat(ChatRequest::user("slow")).await.unwrap();
            assert_eq!(r.call_stats.hedges, 0, "{n} source(s), off: {off}");
        }
    }
}

// ---------------------------------------------------------------- recovery (SPEC §19.3)

mod recovery {
    use super::*;

    /// Issue 24, item 6: after an outage of the primary (every request answered 500),
    /// with the default breaker (open 2 s, doubling per failed probe up to 30 s) and a
    /// call every 200 ms, how long after the outage's end the primary serves again.
    async fn recovery_after(outage: Duration, failure: Script) -> Duration {
        let h = harness(2, |s| {
            s.sources
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| x.priority = i as u32);
        })
        .await;
        h.fake.set_default("s-1", Script::ok(ms(50), "fallback"));
        let start = tokio::time::Instant::now();
        let end = start + outage;
        loop {
            let now = tokio::time::Instant::now();
            if now < end {
                h.fake.set_default("s-0", failure.clone());
            } else {
                h.fake.set_default("s-0", Script::ok(ms(50), "primary"));
            }
            let r = h.client.chat(ChatRequest::user("tick")).await.unwrap();
            if r.content == "primary" {
                return now.saturating_duration_since(end);
            }
            assert!(now < end + secs(120), "the primary never came back");
            tokio::time::sleep(ms(200)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_primary_serves_again_soon_after_an_outage() {
        for outage in [secs(10), secs(60), secs(600)] {
            let back = recovery_after(outage, Script::http(ms(5), 500)).await;
            eprintln!("outage {outage:?} (500s): primary again {back:?} after its end");
            assert!(back <= secs(3), "outage {outage:?}: back after {back:?}");
        }
    }

    /// An outage whose requests time out (each probe costs its caller 5 s) backs off as
    /// SPEC §19.3 says: open 2 s doubling up to 30 s, so the primary is back within
    /// `BREAKER__OPEN_MAX_S` (and the probe's own 5 s) of the outage's end.
    #[tokio::test(start_paused = true)]
    async fn an_outage_of_timeouts_backs_off_up_to_open_max() {
        let timeout = Script::fail(secs(5), ErrorClass::Transient, ErrorLabel::Timeout);
        for outage in [secs(10), secs(60), secs(600)] {
            let back = recovery_after(outage, timeout.clone()).await;
            eprintln!("outage {outage:?} (timeouts): primary again {back:?} after its end");
            assert!(back <= secs(36), "outage {outage:?}: back after {back:?}");
        }
    }
}

// ---------------------------------------------------------------- retry throttle

mod retry_throttle {
    use super::*;

    /// SPEC §25.4, measured: every source answering 503, ten calls one second apart
    /// cost at most 15 upstream requests, and each call is answered within 1.5 s (the
    /// throttle stops polygw's retries once the bucket is at half; failovers to untried
    /// sources go on; the breakers open, and then the calls are answered at once).
    #[tokio::test(start_paused = true)]
    async fn an_outage_is_not_multiplied() {
        let h = harness(2, |_| {}).await;
        for src in ["s-0", "s-1"] {
            h.fake.set_default(src, Script::http(ms(20), 503));
        }
        let mut answered = vec![];
        for i in 0..10 {
            let t0 = tokio::time::Instant::now();
            let e = h
                .client
                .chat(ChatRequest::user(format!("{i}")).with_stream(true))
                .await
                .unwrap_err();
            let took = t0.elapsed();
            answered.push((took, e.context().map_or(0, |c| c.attempts)));
            assert!(took <= ms(1_500), "call {i} answered after {took:?}: {e}");
            tokio::time::sleep(secs(1).saturating_sub(took)).await;
        }
        let upstream = h.fake.calls().len();
        eprintln!("upstream requests {upstream}; (time, attempts) per call {answered:?}");
        assert!(upstream <= 15, "{upstream} upstream requests for 10 calls");
    }

    /// SPEC §25.4: a failover to a source not yet tried is never throttled, and goes at
    /// once: after one 529 from the only busy source, a fresh scope serving one user
    /// fails over with no backoff.
    #[tokio::test(start_paused = true)]
    async fn a_quiet_scope_fails_over_at_once() {
        let h = harness(2, |s| {
            s.sources
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| x.priority = i as u32);
        })
        .await;
        h.fake.push("s-0", Script::http(ms(30), 529));
        h.fake
            .set_default("s-1", Script::ok(ms(50), "from the other source"));
        let r = h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!(r.content, "from the other source");
        assert_eq!(r.call_stats.attempts, 2);
        assert!(
            r.call_stats.total_latency_ms <= 90,
            "no backoff before the failover: {} ms",
            r.call_stats.total_latency_ms
        );
    }

    /// The throttle never stops a retry while the bucket is above half: a single
    /// source failing once is retried (after its backoff), as before.
    #[tokio::test(start_paused = true)]
    async fn a_retry_goes_while_the_bucket_is_full() {
        let h = harness(1, |_| {}).await;
        h.fake.push("s-0", Script::http(ms(10), 500));
        h.fake.set_default("s-0", Script::ok(ms(10), "ok"));
        let r = h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!((r.content.as_str(), r.call_stats.attempts), ("ok", 2));
    }

    /// Once the bucket is at half, a call whose only source failed is answered at once
    /// with its error (`retry_exhausted`, the throttle named), not retried.
    #[tokio::test(start_paused = true)]
    async fn a_drained_bucket_stops_retries_of_tried_sources() {
        let h = harness(1, |s| s.breaker.failures = 100).await;
        h.fake.set_default("s-0", Script::http(ms(10), 500));
        // 3 + 2: the bucket falls from 10 to 5 (retries go while above half).
        let _ = h.client.chat(ChatRequest::user("a")).await.unwrap_err();
        let _ = h.client.chat(ChatRequest::user("b")).await.unwrap_err();
        let before = h.fake.calls().len();
        let e = h.client.chat(ChatRequest::user("c")).await.unwrap_err();
        assert_eq!(h.fake.calls().len() - before, 1, "the first attempt only");
        assert_eq!(e.terminal_reason(), Some(TerminalReason::RetryExhausted));
        assert!(e.to_string().contains("RETRY__THROTTLE_MAX"), "{e}");
    }
}

// ---------------------------------------------------------------- stall hedge

mod hedge_stall {
    use super::*;

    fn stall_hedged(s: &mut ScopeSettings) {
        s.hedge.stall_after = polygw_core::hedge::ThresholdSetting::Static(secs(2));
        s.hedge.budget_pct = 0;
        s.sources
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| x.priority = i as u32);
    }

    #[tokio::test(start_paused = true)]
    async fn stalled_stream_is_beaten_by_a_stall_hedge() {
        let h = harness(2, stall_hedged).await;
        h.fake.push(
            "s-0",
            Script::stream(ms(100), &[ms(50), secs(30), ms(50)], "aaaa"),
        );
        h.fake
            .push("s-1", Script::stream(ms(200), &[ms(50), ms(50)], "bbb"));
        let r = h
            .client
            .chat(ChatRequest::user("hi").with_stream(true))
            .await
            .unwrap();
        assert_eq!(r.content, "bbb");
        let st = r.call_stats;
        assert_eq!((st.attempts, st.hedges, st.hedge_won), (2, 1, true));
        // primary's last chunk at 150 ms; trigger at 2150; hedge done at 2150 + 300
        assert_eq!(st.total_latency_ms, 2450);
        assert_eq!(
            st.generation_ms, 300,
            "winner figures: its own wall, no stall"
        );
        assert_eq!((st.stall_ms, st.stall_count), (Some(0), Some(0)));
        assert_eq!(r.ttft_ms, Some(200));
    }

    #[tokio::test(start_paused = true)]
    async fn plain_request_with_only_stall_after_is_unhedged() {
        let h = harness(2, stall_hedged).await;
        h.fake.push("s-0", Script::ok(secs(30), "slow plain"));
        let r = h.client.chat(ChatRequest::user("hi")).await.unwrap();
        assert_eq!((r.call_stats.attempts, r.call_stats.hedges), (1, 0));
        assert_eq!(r.call_stats.total_latency_ms, 30_000);
    }

    #[tokio::test(start_paused = true)]
    async fn triggers_are_independent() {
        // only AFTER_S: a mid-stream stall does not hedge
        let h = harness(2, |s| {
            s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(secs(1));
            s.hedge.budget_pct = 0;
            s.sources[1].priority = 1;
        })
        .await;
        h.fake
            .push("s-0", Script::stream(ms(100), &[secs(10)], "ab"));
        let r = h
            .client
            .chat(ChatRequest::user("hi").with_stream(true))
            .await
            .unwrap();
        assert_eq!(r.call_stats.hedges, 0);
        // only STALL_AFTER_S: a late first token does not hedge
        let h = harness(2, stall_hedged).await;
        h.fake
            .push("s-0", Script::stream(secs(10), &[ms(10)], "ab"));
        let r = h
            .client
            .chat(ChatRequest::user("hi").with_stream(true))
            .await
            .unwrap();
        assert_eq!(r.call_stats.hedges, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn watchdog_killing_the_stalled_primary_does_not_fail_the_round() {
        let h = harness(2, |s| {
            stall_hedged(s);
            s.retry.max_attempts = 1;
        })
        .await;
        h.fake.push(
            "s-0",
            Script::ChunksThenFail {
                ttft: ms(100),
                gaps: vec![ms(50)],
                after_last: secs(5),
                error: polygw::AttemptError::new(
                    ErrorClass::Transient,
                    ErrorLabel::StallTimeout,
                    "watchdog",
                ),
            },
        );
        h.fake.push(
            "s-1",
            Script::stream(ms(100), &[secs(4), ms(100)], "hedge wins"),
        );
        let r = h
            .client
            .chat(ChatRequest::user("hi").with_stream(true))
            .await
            .unwrap();
        assert_eq!(r.content, "hedge wins");
        assert!(r.call_stats.hedge_won);
        let rows = h.rows.rows_of(&r.logical_call_id);
        assert_eq!(labels(&rows), ["ok", "stall_timeout"]);
        assert_eq!(
            h.breakers
                .state("LLM", "s-0")
                .await
                .unwrap()
                .consecutive_failures,
            1,
            "the watchdog kill is an attempt failure (breaker fed)"
        );
        // winner figures from the winner: its own 4 s stall
        assert_eq!(r.call_stats.stall_count, Some(1));
        assert_eq!(r.call_stats.stall_ms, Some(4000));
    }

    #[tokio::test(start_paused = true)]
    async fn stall_hedge_fires_again_after_new_chunks() {
        let h = harness(3, |s| {
            stall_hedged(s);
            s.hedge.max_extra = 2;
        })
        .await;
        // primary: chunk, 3 s stall (trigger 1), chunk, 3 s stall (trigger 2), …
        h.fake.push(
            "s-0",
            Script::stream(ms(10), &[secs(3), secs(3), secs(60)], "abcd"),
        );
        h.fake.push("s-1", Script::Hang);
        h.fake.push("s-2", Script::stream(ms(10), &[], "third"));
        let r = h
            .client
            .chat(ChatRequest::user("hi").with_stream(true))
            .await
            .unwrap();
        assert_eq!(r.call_stats.hedges, 2);
        assert_eq!(r.content, "third");
    }
}

// ---------------------------------------------------------------- cancellation (SPEC §9)

mod cancellation {
    use super::*;

    /// Drop the call at many points of its life (admission, first leg, after the hedge
    /// trigger, mid-stream, during backoff): in-flight returns to 0 everywhere, every
    /// started attempt has exactly one row, no task survives.
    #[tokio::test(start_paused = true)]
    async fn dropping_at_every_await_point_leaves_nothing_behind() {
        for drop_at in (0..4000).step_by(137) {
            let h = harness(3, |s| {
                s.hedge.after = polygw_core::hedge::ThresholdSetting::Static(ms(300));
                s.hedge.stall_after = polygw_core::hedge::ThresholdSetting::Static(ms(900));
                s.hedge.max_extra = 2;
                s.hedge.budget_pct = 0;
                s.retry.backoff_base = ms(400);
                s.sources
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| x.priority = i as u32);
            })
            .await;
            h.fake.push(
                "s-0",
                Script::fail(ms(200), ErrorClass::Transient, ErrorLabel::ServerError),
            );
            h.fake.push(
                "s-1",
                Script::stream(ms(500), &[ms(100), secs(2), ms(100)], "abcd"),
            );
            h.fake
                .push("s-2", Script::stream(ms(100), &[ms(1500)], "xy"));
            h.fake.set_default("s-0", Script::Hang);
            let r = tokio::time::timeout(
                ms(drop_at),
                h.client.chat(ChatRequest::user("hi").with_stream(true)),
            )
            .await;
            let attempts = h.fake.calls().len();
            let rows = attempt_rows(&h);
            assert_eq!(
                rows.len(),
                attempts,
                "drop at {drop_at} ms: one row per attempt"
            );
            assert_eq!(
                in_flight_all(&h, 3).await,
                [0, 0, 0],
                "drop at {drop_at} ms"
            );
            assert_eq!(alive_tasks().await, 0, "drop at {drop_at} ms");
            let running = h
                .fake
                .calls()
                .iter()
                .filter(|c| c.end == FakeEnd::Running)
                .count();
            assert_eq!(running, 0, "drop at {drop_at} ms: every attempt ended");
            for row in &rows {
                let label = row.error.as_deref().unwrap_or("ok");
                assert!(
                    ["ok", "cancelled", "hedge_cancelled", "server_error"].contains(&label),
                    "drop at {drop_at} ms: unexpected label {label}"
                );
            }
            if r.is_err() {
                assert!(
                    h.rows.rows().iter().all(|x| x.kind == RowKind::Attempt),
                    "drop at {drop_at} ms: a dropped call writes no terminal row"
                );
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn dropped_probe_frees_the_half_open_slot() {
        let h = harness(1, |s| {
            s.breaker.failures = 1;
            s.breaker.open = secs(1);
        })
        .await;
        h.fake.push("s-0", Script::http(ms(10), 500));
        let _ = tokio::time::timeout(secs(2), h.client.chat(ChatRequest::user("a"))).await;
        // breaker open; after 1 s a probe is admitted: drop it mid-flight
        tokio::time::sleep(secs(2)).await;
        h.fake.push("s-0", Script::Hang);
        let _ = tokio::time::timeout(ms(100), h.client.chat(ChatRequest::user("b"))).await;
        tokio::task::yield_now().await;
        tokio::time::sleep(ms(1)).await;
        h.fake.push("s-0", Script::ok(ms(10), "probe ok"));
        let r = h.client.chat(ChatRequest::user("c")).await.unwrap();
        assert_eq!(r.content, "probe ok", "a new probe was admitted at once");
        assert!(!h.breakers.state("LLM", "s-0").await.unwrap().is_tripped());
    }
}
