//! Retry under real provider behaviour (SPEC §14.1, §14.2, §14.8, §14.9): hints
//! honoured on 429 and 503, no tight loop whatever the upstream answers, admission waits
//! bounded by the stall window in total, `RETRY__PREFER=same`, context-length routing.
//! tokio's paused clock and event-driven fakes.

use std::sync::Arc;
use std::time::Duration;

use polygw::core::ports::SplitMix64;
use polygw::{
    AttemptError, ChatRequest, ErrorClass, ErrorLabel, GatewayClient, RetryPrefer, ScopeSettings,
    SourceConfig, TerminalReason,
};
use polygw_limiter_memory::{MemoryBreakerStore, MemoryLimiter};
use polygw_testkit::clock::TokioClock;
use polygw_testkit::fakes::{FakeTransport, RecordingTelemetry, Script};
use tokio::time::Instant;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn scope(n: usize) -> ScopeSettings {
    let sources = (0..n)
        .map(|i| {
            let mut s =
                SourceConfig::new("s", i as u32, "http://127.0.0.1:9/v1", "", format!("m{i}"));
            s.priority = i as u32;
            s
        })
        .collect();
    ScopeSettings::new("LLM", sources)
}

async fn client(s: ScopeSettings) -> (GatewayClient, Arc<FakeTransport>) {
    let clock = Arc::new(TokioClock);
    let fake = FakeTransport::new(clock.clone());
    let client = GatewayClient::builder(s)
        .transport(fake.clone())
        .telemetry(RecordingTelemetry::new())
        .limiter(Arc::new(MemoryLimiter::new(clock.clone())))
        .breakers(Arc::new(MemoryBreakerStore::new(clock.clone())))
        .clock(clock)
        .rng(Arc::new(SplitMix64::new(3)))
        .build()
        .await
        .expect("client");
    (client, fake)
}

fn hinted(class: ErrorClass, label: ErrorLabel, status: u16, hint: Option<Duration>) -> Script {
    Script::Fail {
        after: ms(5),
        error: AttemptError::new(class, label, format!("HTTP {status}"))
            .with_status(status)
            .with_retry_after(hint),
    }
}

fn starts(fake: &FakeTransport, source: &str, t0: Instant) -> Vec<Duration> {
    fake.calls()
        .iter()
        .filter(|c| c.source == source)
        .map(|c| c.started.duration_since(t0.into_std()))
        .collect()
}

/// A 429 whose hint is 0 (or in the past: the transport reads both as no hint) used to
/// be retried at once, refunded, again and again: 170 requests in 6 s from one call. Now
/// each source cools down for the backoff, growing with every round.
#[tokio::test(start_paused = true)]
async fn a_zero_hint_never_makes_a_tight_loop() {
    let mut s = scope(2);
    s.retry.max_attempts = 2;
    let (c, fake) = client(s).await;
    for src in ["s-0", "s-1"] {
        // Even a zero hint reaching the engine (the transport reads it as none).
        fake.set_default(
            src,
            hinted(
                ErrorClass::RateLimited,
                ErrorLabel::RateLimited,
                429,
                Some(Duration::ZERO),
            ),
        );
    }
    let t0 = Instant::now();
    let e = c.chat(ChatRequest::user("x")).await.unwrap_err();
    assert_eq!(e.terminal_reason(), Some(TerminalReason::Stalled));
    let calls = fake.calls().len();
    // Cooldowns 0.5, 1, 2, 4, 8, 8 … s per source: about ten requests each in 60 s.
    assert!(calls <= 24, "{calls} requests in the 60 s stall window");
    for src in ["s-0", "s-1"] {
        let t = starts(&fake, src, t0);
        for w in t.windows(2) {
            assert!(w[1] - w[0] >= ms(500), "{src}: {t:?}");
        }
    }
}

/// A 503 with `Retry-After: 2` cools its source down: no request to it for 2 s, from
/// this call or any other; other sources stay usable at once.
#[tokio::test(start_paused = true)]
async fn a_503_hint_is_a_cooldown_of_its_source() {
    let (c, fake) = client(scope(1)).await;
    fake.push(
        "s-0",
        hinted(
            ErrorClass::Transient,
            ErrorLabel::ServerError,
            503,
            Some(secs(2)),
        ),
    );
    fake.push("s-0", Script::ok(ms(5), "ok"));
    let t0 = Instant::now();
    let r = c.chat(ChatRequest::user("x")).await.unwrap();
    assert_eq!(r.content, "ok");
    let t = starts(&fake, "s-0", t0);
    assert_eq!(t.len(), 2);
    assert!(t[1] >= secs(2), "{t:?}");

    let (c, fake) = client(scope(2)).await;
    fake.push(
        "s-0",
        hinted(
            ErrorClass::Transient,
            ErrorLabel::ServerError,
            503,
            Some(secs(2)),
        ),
    );
    fake.set_default("s-1", Script::ok(ms(5), "from s-1"));
    fake.set_default("s-0", Script::ok(ms(5), "from s-0"));
    let t0 = Instant::now();
    let r = c.chat(ChatRequest::user("a")).await.unwrap();
    assert_eq!(r.source, "s-1");
    assert!(
        starts(&fake, "s-1", t0)[0] < secs(1),
        "the other source at once"
    );
    // Another call within the cooldown goes to s-1 although s-0 is preferred.
    let r = c.chat(ChatRequest::user("b")).await.unwrap();
    assert_eq!(r.source, "s-1");
    tokio::time::sleep(secs(2)).await;
    let r = c.chat(ChatRequest::user("c")).await.unwrap();
    assert_eq!(r.source, "s-0", "after the hint");
}

/// Admission waits add up over the call: budget-consuming rounds in between used to
/// restart the window (calls held 118 s with a 60 s window).
#[tokio::test(start_paused = true)]
async fn admission_waits_never_exceed_the_stall_window_in_total() {
    let mut s = scope(1);
    s.retry.max_attempts = 20;
    s.retry.stall_window = secs(10);
    let (c, fake) = client(s).await;
    fake.set_default(
        "s-0",
        hinted(
            ErrorClass::Transient,
            ErrorLabel::ServerError,
            503,
            Some(secs(6)),
        ),
    );
    let t0 = Instant::now();
    let e = c.chat(ChatRequest::user("x")).await.unwrap_err();
    assert_eq!(e.terminal_reason(), Some(TerminalReason::Stalled), "{e}");
    let elapsed = t0.elapsed();
    assert!(elapsed <= secs(11), "{elapsed:?}");
    assert!(fake.calls().len() <= 3, "{}", fake.calls().len());
}

/// Without `CONTEXT_WINDOW`s a context-length rejection goes once to an untried source
/// whose `MODEL` differs; a source with the same model is not tried.
#[tokio::test(start_paused = true)]
async fn context_length_without_windows_goes_to_another_model() {
    let mut s = scope(3);
    s.sources[1].model = "m0".into(); // the same model as s-0
    let (c, fake) = client(s.clone()).await;
    fake.set_default("s-0", too_long());
    fake.set_default("s-1", Script::ok(ms(5), "same model"));
    fake.set_default("s-2", Script::ok(ms(5), "another model"));
    let r = c.chat(ChatRequest::user("long")).await.unwrap();
    assert_eq!(
        (r.content.as_str(), r.source.as_str()),
        ("another model", "s-2")
    );
    assert_eq!(fake.calls_to("s-1"), 0, "the same model would refuse too");
    // Every other source has the same model: the rejection is final at once.
    let mut s = scope(2);
    s.sources[1].model = "m0".into();
    let (c, fake) = client(s).await;
    fake.set_default("s-0", too_long());
    fake.set_default("s-1", Script::ok(ms(5), "same model"));
    let e = c.chat(ChatRequest::user("long")).await.unwrap_err();
    assert_eq!(e.terminal_reason(), Some(TerminalReason::Rejected));
    assert_eq!(fake.calls_to("s-1"), 0);
}

/// SPEC §17.2 (issue 22, item 12): a call that no source can serve within the stall
/// window ends at once — a source full for a minute, or tripped for a minute, with a
/// 5 s window — with the earliest admission as its `retry_after` and the bound named;
/// one that can be served within the window waits for it; a refusal that may clear
/// sooner (a slot in use) keeps the call waiting, up to the window.
#[tokio::test(start_paused = true)]
async fn waits_beyond_the_stall_window_end_at_once() {
    // Quota: RPM 1, used by a first call.
    let mut s = scope(1);
    s.sources[0].rpm = 1;
    s.retry.stall_window = secs(5);
    let (c, fake) = client(s.clone()).await;
    fake.set_default("s-0", Script::ok(ms(5), "ok"));
    c.chat(ChatRequest::user("first")).await.unwrap();
    let t0 = Instant::now();
    let e = c.chat(ChatRequest::user("second")).await.unwrap_err();
    let elapsed = t0.elapsed();
    assert_eq!(e.terminal_reason(), Some(TerminalReason::Stalled), "{e}");
    assert!(elapsed < ms(10), "known at once: {elapsed:?}");
    let ctx = e.context().unwrap();
    let hint = ctx.retry_after.unwrap();
    assert!(hint > secs(55) && hint <= secs(60), "{hint:?}");
    assert!(
        e.to_string().contains("RETRY__STALL_WINDOW_S of 5 s"),
        "the bound is named: {e}"
    );
    assert_eq!(fake.calls().len(), 1, "no request while the quota is spent");
    // The same quota with a window that covers the wait: the call waits and is served.
    s.retry.stall_window = secs(90);
    let (c, fake) = client(s).await;
    fake.set_default("s-0", Script::ok(ms(5), "ok"));
    c.chat(ChatRequest::user("first")).await.unwrap();
    let t0 = Instant::now();
    c.chat(ChatRequest::user("second")).await.unwrap();
    let waited = t0.elapsed();
    assert!(waited >= secs(59) && waited <= secs(62), "{waited:?}");

    // Breaker: one failure opens it for 60 s; the next call ends at once.
    let mut s = scope(1);
    s.breaker.failures = 1;
    s.breaker.open = secs(60);
    s.retry.stall_window = secs(5);
    s.retry.max_attempts = 1;
    let (c, fake) = client(s).await;
    fake.set_default(
        "s-0",
        hinted(ErrorClass::Transient, ErrorLabel::ServerError, 500, None),
    );
    assert!(c.chat(ChatRequest::user("trip")).await.is_err());
    let t0 = Instant::now();
    let e = c.chat(ChatRequest::user("after")).await.unwrap_err();
    assert_eq!(e.terminal_reason(), Some(TerminalReason::Stalled), "{e}");
    assert!(t0.elapsed() < ms(10), "breaker wait {:?}", t0.elapsed());
    assert_eq!(
        fake.calls().len(),
        1,
        "the open breaker let nothing through"
    );

    // A slot in use may free any time: the call waits, bounded by the window.
    let mut s = scope(1);
    s.sources[0].max_concurrency = 1;
    s.retry.stall_window = secs(5);
    let (c, fake) = client(s).await;
    fake.set_default("s-0", Script::ok(secs(600), "slow"));
    let slow = tokio::spawn({
        let c = c.clone();
        async move { c.chat(ChatRequest::user("slow")).await }
    });
    fake.wait_until(|calls| calls.len() == 1).await;
    let t0 = Instant::now();
    let e = c.chat(ChatRequest::user("waits")).await.unwrap_err();
    let elapsed = t0.elapsed();
    assert_eq!(e.terminal_reason(), Some(TerminalReason::Stalled), "{e}");
    assert!(
        elapsed >= secs(5) && elapsed <= secs(6),
        "concurrency wait {elapsed:?}"
    );
    slow.abort();
}

/// `RETRY__PREFER=same` retries a source once after a transient failure; `other` (the
/// default) goes to the next source.
#[tokio::test(start_paused = true)]
async fn prefer_same_retries_the_same_source_once() {
    for (prefer, want) in [(RetryPrefer::Same, "s-0"), (RetryPrefer::Other, "s-1")] {
        let mut s = scope(2);
        s.retry.prefer = prefer;
        s.retry.backoff_base = ms(100);
        let (c, fake) = client(s).await;
        fake.push(
            "s-0",
            hinted(ErrorClass::Transient, ErrorLabel::ServerError, 500, None),
        );
        fake.set_default("s-0", Script::ok(ms(5), "s-0"));
        fake.set_default("s-1", Script::ok(ms(5), "s-1"));
        let r = c.chat(ChatRequest::user("x")).await.unwrap();
        assert_eq!(r.source, want, "{prefer:?}");
    }
    // Once only: a second failure goes elsewhere.
    let mut s = scope(2);
    s.retry.prefer = RetryPrefer::Same;
    s.retry.backoff_base = ms(100);
    let (c, fake) = client(s).await;
    fake.set_default(
        "s-0",
        hinted(ErrorClass::Transient, ErrorLabel::ServerError, 500, None),
    );
    fake.set_default("s-1", Script::ok(ms(5), "s-1"));
    let r = c.chat(ChatRequest::user("x")).await.unwrap();
    assert_eq!(r.source, "s-1");
    assert_eq!(fake.calls_to("s-0"), 2);
}

/// `RETRY__PREFER=same` waits before retrying the same source: its hint (a 429 whose
/// hint is at most `BACKOFF_MAX_S`) or the backoff (a 5xx); a longer hint goes to the
/// next source; an open breaker sends the retry elsewhere too.
#[tokio::test(start_paused = true)]
async fn prefer_same_waits_for_the_hint_or_the_backoff() {
    let cases = [
        // (first failure of s-0, where the retry goes, earliest retry after). Before
        // the fix a hinted 429 went to s-1: s-0 was cooling down when the retry came.
        (
            hinted(
                ErrorClass::RateLimited,
                ErrorLabel::RateLimited,
                429,
                Some(ms(700)),
            ),
            "s-0",
            ms(700),
        ),
        // A 5xx without hint: the same source after the backoff (full jitter, ≤ 100
        // ms here, so no lower bound).
        (
            hinted(ErrorClass::Transient, ErrorLabel::ServerError, 503, None),
            "s-0",
            Duration::ZERO,
        ),
        (
            hinted(
                ErrorClass::RateLimited,
                ErrorLabel::RateLimited,
                429,
                Some(secs(30)),
            ),
            "s-1",
            Duration::ZERO,
        ),
    ];
    for (failure, want, after) in cases {
        let mut s = scope(2);
        s.retry.prefer = RetryPrefer::Same;
        s.retry.backoff_base = ms(100);
        s.retry.backoff_max = secs(2);
        let (c, fake) = client(s).await;
        fake.push("s-0", failure);
        fake.set_default("s-0", Script::ok(ms(5), "s-0"));
        fake.set_default("s-1", Script::ok(ms(5), "s-1"));
        let t0 = Instant::now();
        let r = c.chat(ChatRequest::user("x")).await.unwrap();
        assert_eq!(r.source, want, "retry after {after:?}");
        let st = starts(&fake, want, t0);
        let retry = *st.last().unwrap();
        assert!(
            retry >= after,
            "{want} retried at {retry:?}, before {after:?}"
        );
        assert!(retry < after + ms(200), "{want} retried late: {retry:?}");
    }
    // An open breaker: the same source is not retried.
    let mut s = scope(2);
    s.retry.prefer = RetryPrefer::Same;
    s.breaker.failures = 1;
    let (c, fake) = client(s).await;
    fake.push(
        "s-0",
        hinted(ErrorClass::Transient, ErrorLabel::ServerError, 500, None),
    );
    fake.set_default("s-0", Script::ok(ms(5), "s-0"));
    fake.set_default("s-1", Script::ok(ms(5), "s-1"));
    let r = c.chat(ChatRequest::user("x")).await.unwrap();
    assert_eq!(r.source, "s-1", "the breaker of s-0 opened");
    assert_eq!(fake.calls_to("s-0"), 1);
}

fn too_long() -> Script {
    Script::Fail {
        after: ms(5),
        error: AttemptError::new(ErrorClass::Rejected, ErrorLabel::Rejected, "HTTP 400")
            .with_status(400)
            .with_provider(
                Some("context_length_exceeded".into()),
                Some("This model's maximum context length is 8192 tokens".into()),
            ),
    }
}

/// A context-length rejection goes once to an untried source with a larger window.
#[tokio::test(start_paused = true)]
async fn context_length_goes_to_a_larger_window_once() {
    let mut s = scope(3);
    s.sources[0].context_window = Some(8_000);
    s.sources[1].context_window = Some(4_000);
    s.sources[2].context_window = Some(32_000);
    let (c, fake) = client(s.clone()).await;
    fake.set_default("s-0", too_long());
    fake.set_default("s-2", Script::ok(ms(5), "fits"));
    let r = c.chat(ChatRequest::user("long")).await.unwrap();
    assert_eq!((r.content.as_str(), r.source.as_str()), ("fits", "s-2"));
    assert_eq!(fake.calls_to("s-1"), 0, "a smaller window is not tried");

    // The larger one refuses too: final, with the provider's code.
    let (c, fake) = client(s).await;
    fake.set_default("s-0", too_long());
    fake.set_default("s-2", too_long());
    let e = c.chat(ChatRequest::user("longer")).await.unwrap_err();
    assert_eq!(e.terminal_reason(), Some(TerminalReason::Rejected));
    assert_eq!(e.context().unwrap().attempts, 2);
    assert_eq!(
        e.last_error().unwrap().provider_code.as_deref(),
        Some("context_length_exceeded")
    );
}

/// Issue 22, item 19 (SPEC §17.9): windows of 8k, 16k and 200k and a 25k-token prompt.
/// Without `CONTEXT_WINDOW`s (three models), each rejects in turn until the 200k one
/// answers; with them, the two that cannot hold it are never sent it.
#[tokio::test(start_paused = true)]
async fn context_routing_goes_as_far_as_the_windows_allow() {
    let prompt = "word ".repeat(20_000); // ≈ 25 000 estimated tokens
    let mut s = scope(3);
    for (i, m) in ["small", "medium", "large"].iter().enumerate() {
        s.sources[i].model = (*m).into();
        s.sources[i].priority = i as u32;
    }
    let (c, fake) = client(s.clone()).await;
    fake.set_default("s-0", too_long());
    fake.set_default("s-1", too_long());
    fake.set_default("s-2", Script::ok(ms(5), "fits"));
    let r = c.chat(ChatRequest::user(prompt.clone())).await.unwrap();
    assert_eq!((r.content.as_str(), r.source.as_str()), ("fits", "s-2"));
    assert_eq!((fake.calls_to("s-0"), fake.calls_to("s-1")), (1, 1));

    s.sources[0].context_window = Some(8_000);
    s.sources[1].context_window = Some(16_000);
    s.sources[2].context_window = Some(200_000);
    let (c, fake) = client(s.clone()).await;
    fake.set_default("s-0", too_long());
    fake.set_default("s-1", too_long());
    fake.set_default("s-2", Script::ok(ms(5), "fits"));
    let r = c.chat(ChatRequest::user(prompt.clone())).await.unwrap();
    assert_eq!(r.source, "s-2");
    assert_eq!(
        (fake.calls_to("s-0"), fake.calls_to("s-1")),
        (0, 0),
        "skipped before any request"
    );
    assert_eq!(r.call_stats.attempts, 1);

    // A short prompt the 8k window rejects anyway (the estimate is an estimate): the
    // next is the smallest larger window, then the next.
    let (c, fake) = client(s).await;
    fake.set_default("s-0", too_long());
    fake.set_default("s-1", too_long());
    fake.set_default("s-2", Script::ok(ms(5), "fits"));
    let r = c.chat(ChatRequest::user("short")).await.unwrap();
    assert_eq!(r.source, "s-2");
    assert_eq!((fake.calls_to("s-0"), fake.calls_to("s-1")), (1, 1));
}
