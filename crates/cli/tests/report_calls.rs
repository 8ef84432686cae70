//! `polygw report` over calls made for real (SPEC §19.4, §21.1; issues 24, 26): the library
//! against two in-process mock upstreams with SQLite telemetry — a call hedged on its
//! first-token trigger, a stream resumed after a stall, one resumed after a cut, a plain
//! one and a failed one, charged to two client keys (one of them named in
//! `polygw_client_keys`) and to none — then the built program over the file:
//!
//! - `--call ID` prints the call's rows and its timeline, found by its logical_call_id or
//!   a row's call_id; an unknown id and a call without a trace are clear errors; the same
//!   on PostgreSQL (when reachable; always under CI);
//! - the text report's spend per key and slowest calls;
//! - the HTML report (and a call's page) loaded in headless Chromium: no console message,
//!   the timeline chart in the rendered DOM with one bar per leg. Under `CI=true` a
//!   missing Chromium fails; elsewhere the test prints why and skips.
//!
//! Every fault is decided by the scripts, never by a race: the slow primary takes 30 s
//! against a hedge after 0.2 s, the stall lasts 30 s against a trigger at 0.4 s.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use futures_util::StreamExt as _;
use polygw::client_keys::KeyCharge;
use polygw::core::client_key::{ClientKey, KeyLimits};
use polygw::core::ports::telemetry::TelemetryRecorder;
use polygw::core::ports::ClientKeyStore;
use polygw::core::trace::{CallTrace, TraceEvent};
use polygw::core::{RowKind, TelemetryRow};
use polygw::telemetry::{RecorderConfig, SqlKeyStore, SqlRecorder};
use polygw::{CallOptions, ChatRequest, GatewayClient};
use polygw_mock_upstream::{Behavior, Fault, MockConfig, MockUpstream, Stall};
use polygw_testkit::browser::{chromium, load};
use polygw_testkit::services::{postgres_url, unique_name};

/// The logical call ids of the scenarios.
struct Ids {
    hedged: String,
    stalled: String,
    cut: String,
    plain: String,
    failed: String,
}

impl Ids {
    fn all(&self) -> [&str; 5] {
        [
            &self.hedged,
            &self.stalled,
            &self.cut,
            &self.plain,
            &self.failed,
        ]
    }
}

/// A telemetry database with the scenarios' rows.
struct Calls {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    url: String,
    ids: Ids,
    /// The key named in `polygw_client_keys` (`team-alpha`) and the one that is not.
    alpha: String,
    beta: String,
}

fn words(n: u32) -> Behavior {
    Behavior {
        chunk_count: Some(n),
        ..Behavior::default()
    }
}

async fn mock() -> MockUpstream {
    let m = MockUpstream::start(MockConfig::default()).await.unwrap();
    m.set_default(words(30));
    m
}

fn vars(a: &MockUpstream, b: &MockUpstream, db: &str) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = Vec::new();
    for (name, m, prio) in [("A", a, "0"), ("B", b, "1")] {
        let p = format!("LLM__{name}__0");
        v.extend([
            (format!("{p}__BASE_URL"), m.base_url()),
            (
                format!("{p}__API_KEY"),
                format!("sk-{name}-upstream-secret"),
            ),
            (format!("{p}__MODEL"), format!("model-{name}")),
            (format!("{p}__PRIORITY"), prio.into()),
            (format!("{p}__PREFILL"), "assistant".into()),
            (format!("{p}__INPUT_PRICE"), "1.0".into()),
            (format!("{p}__OUTPUT_PRICE"), "2.0".into()),
        ]);
    }
    for (k, x) in [
        ("HEDGE__AFTER_S", "0.2"),
        ("HEDGE__STALL_AFTER_S", "0.4"),
        ("HEDGE__MAX_EXTRA", "1"),
        ("HEDGE__BUDGET_PCT", "0"),
        ("RETRY__MAX_ATTEMPTS", "2"),
        ("RETRY__BACKOFF_BASE_S", "0.01"),
        ("RETRY__BACKOFF_MAX_S", "0.02"),
        ("BREAKER__FAILURES", "100"),
        ("STREAM__STALL_THRESHOLD_MS", "300"),
    ] {
        v.push((format!("LLM__{k}"), x.into()));
    }
    v.push(("LLM__TELEMETRY__URL".into(), db.into()));
    v
}

fn options(id: &str, key: Option<&str>) -> CallOptions {
    let o = CallOptions::default().with_logical_call_id(id);
    match key {
        Some(k) => o.with_client_key(KeyCharge::unmetered(k)),
        None => o,
    }
}

/// Runs the scenarios; their rows in an SQLite file of a temporary directory.
async fn make_calls() -> Calls {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let url = format!("sqlite://{}", dir.join("telemetry.db").display());
    let u = unique_name("rc");
    let ids = Ids {
        hedged: format!("{u}-hedged"),
        stalled: format!("{u}-stalled"),
        cut: format!("{u}-cut"),
        plain: format!("{u}-plain"),
        failed: format!("{u}-failed"),
    };
    let (alpha, beta) = (format!("key_{u}_alpha"), format!("key_{u}_beta"));
    let (a, b) = (mock().await, mock().await);
    let client = GatewayClient::from_vars(vars(&a, &b, &url), "LLM")
        .await
        .unwrap();

    // 1. The primary is slow to start: hedged after 0.2 s on b, which wins.
    a.push_script(Behavior {
        ttft_ms: 30_000.0,
        ..words(30)
    });
    let r = client
        .chat_with(
            ChatRequest::user("one: hedged").with_stream(true),
            options(&ids.hedged, Some(&alpha)),
        )
        .await
        .unwrap();
    assert_eq!(r.source, "b-0", "the hedge won");

    // 2. A passthrough stream stalls for 30 s after 10 chunks: resumed on b at 0.4 s.
    a.push_script(Behavior {
        stalls: vec![Stall {
            before_chunk: 10,
            ms: 30_000.0,
        }],
        ..words(30)
    });
    let mut st = client.chat_stream_with(
        ChatRequest::user("two: stalled"),
        options(&ids.stalled, Some(&alpha)),
    );
    let mut done = None;
    while let Some(ev) = st.next().await {
        if let polygw::ChatEvent::Done(r) = ev.unwrap() {
            done = Some(r);
        }
    }
    let r = done.expect("the stalled stream's answer");
    assert_eq!((r.source.as_str(), r.call_stats.resumes), ("b-0", 1));

    // 3. The stream is cut after 12 chunks: continued on b.
    a.push_script(Behavior {
        fault: Some(Fault::ResetAfter { chunks: 12 }),
        ..words(30)
    });
    let r = client
        .chat_with(
            ChatRequest::user("three: cut").with_stream(true),
            options(&ids.cut, Some(&beta)),
        )
        .await
        .unwrap();
    assert_eq!((r.source.as_str(), r.call_stats.resumes), ("b-0", 1));

    // 4. A plain call, charged to no key.
    let r = client
        .chat_with(ChatRequest::user("four: plain"), options(&ids.plain, None))
        .await
        .unwrap();
    assert_eq!(r.source, "a-0");

    // 5. Every source answers 500: the call fails.
    a.set_default(Behavior::status(500));
    b.set_default(Behavior::status(500));
    client
        .chat_with(
            ChatRequest::user("five: failed").with_stream(true),
            options(&ids.failed, Some(&beta)),
        )
        .await
        .expect_err("every source fails");

    let flushed = client.shutdown().await;
    assert_eq!(flushed.dropped, 0);
    a.shutdown().await;
    b.shutdown().await;

    // The alpha key has a name; beta is not in the table (deleted, or another database's).
    let store = SqlKeyStore::connect(&url, Duration::from_secs(10))
        .await
        .unwrap();
    store.create(key(&alpha, "team-alpha")).await.unwrap();
    store.close().await;
    Calls {
        _dir: tmp,
        dir,
        url,
        ids,
        alpha,
        beta,
    }
}

/// A client key row (its hash is a placeholder: no key in clear anywhere).
fn key(id: &str, name: &str) -> ClientKey {
    ClientKey {
        id: id.into(),
        name: name.into(),
        // Unique per id (the shared PostgreSQL keeps earlier runs' keys; hashes are unique).
        hash: polygw::core::client_key::hash_key(id),
        prefix: "pgw-test".into(),
        scopes: Vec::new(),
        models: Vec::new(),
        limits: KeyLimits::default(),
        created_at_ms: 1,
        updated_at_ms: 1,
        revoked_at_ms: None,
    }
}

fn polygw(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_polygw"))
        .args(args)
        .env_remove("POLYGW_LOG")
        .output()
        .expect("run polygw")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `polygw report --db URL --call ID`, which must succeed: its output.
fn explain(url: &str, id: &str) -> String {
    let out = polygw(&["report", "--db", url, "--call", id]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    text
}

fn assert_has(text: &str, wants: &[&str]) {
    for w in wants {
        assert!(text.contains(w), "{w:?} in\n{text}");
    }
}

/// What each scenario's timeline and rows must say.
fn assert_scenarios(url: &str, ids: &Ids) {
    let t = explain(url, &ids.hedged);
    assert_has(
        &t,
        &[
            &format!("Call: {} (scope LLM, chat, streamed)", ids.hedged),
            "round 1: hedge after first token 200 ms (configured), after a stall 400 ms \
             (configured)",
            "leg 0 launched on a-0: primary",
            "leg 1 launched on b-0: hedge on its first token trigger",
            "leg 0 cancelled (hedge_cancelled)",
            "leg 1 won",
            "ok: the answer",
        ],
    );
    let t = explain(url, &ids.stalled);
    assert_has(
        &t,
        &[
            "leg 0 committed: its chunks reach the caller",
            "leg 1 launched on b-0: resume by prefill on its stall trigger",
            "leg 1 won",
            "resume by prefill of #0",
        ],
    );
    // Aggregated: the cut leg's round ends; the next one continues it.
    let t = explain(url, &ids.cut);
    assert_has(
        &t,
        &[
            "leg 0 failed (truncated)",
            "round 2: ",
            "leg 0 launched on b-0: resume by prefill",
            "leg 0 won",
            "resume by prefill of #0",
        ],
    );
    let t = explain(url, &ids.plain);
    assert_has(&t, &["leg 0 launched on a-0: primary", "leg 0 won"]);
    assert!(!t.contains("Client key:"), "{t}");
    let t = explain(url, &ids.failed);
    assert_has(&t, &["call ended: ", "call failed: ", "server_error"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_call_explains_each_call_on_sqlite_and_postgres() {
    let c = make_calls().await;
    assert_scenarios(&c.url, &c.ids);

    // By a row's call_id (the hedged call's losing leg): the same call.
    let rows = polygw::telemetry::read_rows(&c.url, None).await.unwrap();
    let loser = rows
        .iter()
        .find(|r| r.logical_call_id == c.ids.hedged && !r.ok)
        .unwrap()
        .clone();
    let t = explain(&c.url, &loser.call_id);
    assert!(
        t.contains(&format!("Call: {} (", c.ids.hedged)),
        "found by call_id:\n{t}"
    );
    assert!(t.contains(&format!("Client key: {} (team-alpha)", c.alpha)));
    let t = explain(&c.url, &c.ids.cut);
    assert!(t.contains(&format!(
        "Client key: {} (not in polygw_client_keys)",
        c.beta
    )));

    // An unknown id, and a row written before traces: clear errors, exit 1.
    let out = polygw(&["report", "--db", &c.url, "--call", "no-such-call"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("has the logical_call_id or call_id no-such-call"),
        "{}",
        stderr(&out)
    );
    let rec = SqlRecorder::connect(&c.url, RecorderConfig::default())
        .await
        .unwrap();
    let mut old = TelemetryRow::new(RowKind::Attempt, "old-a", "old-call", "LLM", "chat", 1_000);
    old.source = Some("a-0".into());
    old.ok = true;
    rec.record(old);
    rec.shutdown().await;
    let out = polygw(&["report", "--db", &c.url, "--call", "old-call"]);
    assert!(!out.status.success());
    assert!(stdout(&out).contains("old-a"), "the rows are shown");
    assert!(
        stderr(&out).contains("call old-call has no decision trace"),
        "{}",
        stderr(&out)
    );

    // The whole report: spend per key, the slowest calls.
    let out = polygw(&["report", "--db", &c.url]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    let cells = |prefix: &str| -> Vec<String> {
        text.lines()
            .skip_while(|l| *l != "Spend per client key")
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} in\n{text}"))
            .split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(str::to_string)
            .collect()
    };
    let alpha = cells(&c.alpha);
    assert_eq!(alpha[1..4], ["team-alpha", "2", "0"], "{alpha:?}");
    assert_ne!(alpha[7], "unknown", "priced: {alpha:?}");
    let beta = cells(&c.beta);
    assert_eq!(
        beta[1..4],
        ["(not in polygw_client_keys)", "2", "1"],
        "{beta:?}"
    );
    // The plain call and the old row.
    assert_eq!(cells("(no client key)")[2], "2");
    let slowest: String = text
        .lines()
        .skip_while(|l| *l != "Slowest calls")
        .take(8)
        .collect::<Vec<_>>()
        .join("\n");
    for id in c.ids.all() {
        assert!(slowest.contains(id), "{id} in\n{slowest}");
    }
    assert!(!text.contains("upstream-secret"), "no secret");

    // PostgreSQL: the same rows under ids of their own, in the shared test database.
    let Some(pg) = postgres_url() else {
        return;
    };
    let p = unique_name("pg");
    let renamed = |s: &str| format!("{p}-{s}");
    let rec = SqlRecorder::connect(&pg, RecorderConfig::default())
        .await
        .unwrap();
    let mut n = 0;
    for mut r in rows.into_iter().filter(|r| r.logical_call_id != "old-call") {
        r.call_id = renamed(&r.call_id);
        r.logical_call_id = renamed(&r.logical_call_id);
        r.resume_of = r.resume_of.as_deref().map(renamed);
        r.client_key_id = r.client_key_id.as_deref().map(renamed);
        rec.record(r);
        n += 1;
    }
    let flushed = rec.flush().await.unwrap();
    assert_eq!((flushed.written, flushed.dropped), (n, 0));
    rec.shutdown().await;
    let store = SqlKeyStore::connect(&pg, Duration::from_secs(10))
        .await
        .unwrap();
    store
        .create(key(&renamed(&c.alpha), &renamed("team-alpha")))
        .await
        .unwrap();
    store.close().await;
    let pg_ids = Ids {
        hedged: renamed(&c.ids.hedged),
        stalled: renamed(&c.ids.stalled),
        cut: renamed(&c.ids.cut),
        plain: renamed(&c.ids.plain),
        failed: renamed(&c.ids.failed),
    };
    assert_scenarios(&pg, &pg_ids);
    let t = explain(&pg, &renamed(&loser.call_id));
    assert!(t.contains(&format!("Call: {} (", pg_ids.hedged)), "{t}");
    assert!(
        t.contains(&format!(
            "Client key: {} ({})",
            renamed(&c.alpha),
            renamed("team-alpha")
        )),
        "{t}"
    );
    let out = polygw(&["report", "--db", &pg, "--call", &renamed("nothing")]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("has the logical_call_id or call_id"));
}

// ------------------------------------------------------------- headless Chromium

/// The `data-call` ids of the chart's calls and the number of leg bars, in a DOM.
fn chart_of(dom: &str) -> (Vec<String>, usize) {
    let start = dom
        .find("<svg id=\"call-timelines\"")
        .unwrap_or_else(|| panic!("no timeline chart in the rendered DOM"));
    let chart = &dom[start..start + dom[start..].find("</svg>").unwrap()];
    let calls = chart
        .split("<g class=\"call\" data-call=\"")
        .skip(1)
        .map(|s| s[..s.find('"').unwrap()].to_string())
        .collect();
    (calls, chart.matches("<rect class=\"leg leg-").count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_html_report_renders_in_headless_chromium() {
    let Some(bin) = chromium() else {
        return;
    };
    let c = make_calls().await;

    // The check sees console messages on this Chromium (else it would be blind).
    let probe = c.dir.join("probe.html");
    std::fs::write(
        &probe,
        "<!DOCTYPE html><html><body><script>console.error('polygw-' + 'probe')</script>\
         </body></html>",
    )
    .unwrap();
    let seen = load(&bin, &c.dir, &probe);
    assert!(
        seen.console.iter().any(|l| l.contains("polygw-probe")),
        "Chromium logged no console message for the probe: {:?}",
        seen.console
    );

    // The report.
    let html = c.dir.join("report.html");
    let out = polygw(&["report", "--db", &c.url, "--html", html.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let page = load(&bin, &c.dir, &html);
    assert!(page.console.is_empty(), "console: {:#?}", page.console);
    let (calls, bars) = chart_of(&page.dom);
    // Every call of the database is among the 20 slowest; its bars are its launches.
    let mut want: Vec<&str> = c.ids.all().to_vec();
    want.sort_unstable();
    let mut got: Vec<&str> = calls.iter().map(String::as_str).collect();
    got.sort_unstable();
    assert_eq!(got, want);
    let rows = polygw::telemetry::read_rows(&c.url, None).await.unwrap();
    let launches: usize = rows
        .iter()
        .filter_map(|r| r.trace.as_deref())
        .map(|t| {
            CallTrace::from_json(t)
                .unwrap()
                .events
                .iter()
                .filter(|e| matches!(e.event, TraceEvent::Launch { .. }))
                .count()
        })
        .sum();
    assert!(launches >= 8, "{launches} legs");
    assert_eq!(bars, launches, "one bar per leg");
    for want in [
        "class=\"leg leg-won\"",
        "class=\"leg leg-cancelled\"",
        "class=\"leg leg-failed\"",
        "class=\"mark mark-stall\"",
        "class=\"mark mark-resume\"",
        "class=\"mark mark-end\"",
        "<h3>Spend per client key</h3>",
        "team-alpha",
    ] {
        assert!(page.dom.contains(want), "{want} in the rendered DOM");
    }

    // A call's page.
    let one = c.dir.join("call.html");
    let out = polygw(&[
        "report",
        "--db",
        &c.url,
        "--call",
        &c.ids.stalled,
        "--html",
        one.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let page = load(&bin, &c.dir, &one);
    assert!(page.console.is_empty(), "console: {:#?}", page.console);
    let (calls, bars) = chart_of(&page.dom);
    assert_eq!((calls, bars), (vec![c.ids.stalled.clone()], 2));
    assert!(page.dom.contains("<pre id=\"call-trace\">"));
}
