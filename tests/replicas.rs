//! Many replicas (SPEC §21.2, docs/DEPLOYMENT.md): three `polygw serve` processes
//! started from `deploy/polygw@.service` with `deploy/polygw.env.example`, behind a real
//! HAProxy running `deploy/haproxy.cfg` (health checks on `/readyz`), sharing governance
//! on a Redis Cluster and telemetry in PostgreSQL; one mock upstream per replica; the
//! async-openai client through HAProxy.
//!
//! - a replica killed (SIGKILL) during streams: the others serve on, its slots free by
//!   lease expiry, telemetry spend reconciles with the mocks' billing;
//! - a replica stopped (SIGTERM): it drains — its streams finish intact, HAProxy takes
//!   it out, no telemetry row is lost, exit 0;
//! - a Redis Cluster node down and back: calls fail closed with a clear error, the
//!   replicas report not ready, and everything recovers with nothing leaked;
//! - a drain that outlasts its grace: what is left is cut, said in one line, exit 0;
//! - client keys from the key store (`polygw keys`, in the same PostgreSQL): a key's
//!   budget and RPM hold across the three replicas under 32 concurrent clients,
//!   reconciled with the upstreams' logs and billing and the rows; a key revoked during
//!   load is refused by every replica within 5 s.
//!
//! Timing is by events and by polling conditions with deadlines. Under `CI=true` a
//! missing HAProxy, Redis Cluster or PostgreSQL fails the test; elsewhere it skips.

#[path = "support/replicas.rs"]
mod replicas;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use polygw::core::RowKind;
use polygw_mock_upstream::{Behavior, EndKind};
use replicas::{
    chat, eventually, get_json, metric, openai_with_key, poll, raw_chat, raw_chat_on,
    raw_chat_with_key, services, stream, Deployment, Failure, NewKey, Options, OwnCluster, Seen,
    Services,
};
use serde_json::json;
use tokio::time::Instant;

/// `n` chunks `w0 w1 …`, `gap_ms` apart: the answer every mock streams.
fn words(n: usize, gap_ms: f64) -> (Behavior, String) {
    let chunks: Vec<String> = (0..n).map(|i| format!("w{i} ")).collect();
    let text = chunks.concat();
    let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
    (
        Behavior {
            gap_ms,
            ..Behavior::text(&refs)
        },
        text,
    )
}

/// Starts `n` streams through HAProxy and waits until each has its first chunk (so
/// that each is committed on its replica: HAProxy can no longer move it).
async fn streams_started(d: &Deployment, n: usize) -> Vec<tokio::task::JoinHandle<Seen>> {
    let first = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (c, model, first) = (d.client(), d.model(), first.clone());
            tokio::spawn(async move { stream(&c, &model, &format!("stream {i}"), first).await })
        })
        .collect();
    eventually(
        "every stream has its first chunk",
        Duration::from_secs(20),
        || std::future::ready(first.load(Ordering::SeqCst) == n),
    )
    .await;
    tasks
}

/// `n` plain calls at once through HAProxy (async-openai), each answered `text`.
async fn chats_succeed(d: &Deployment, n: usize, what: &str, text: &str) {
    let calls = (0..n).map(|i| {
        let (c, model) = (d.client(), d.model());
        let prompt = format!("{what} {i}");
        async move { chat(&c, &model, &prompt).await }
    });
    for got in futures_util::future::join_all(calls).await {
        assert_eq!(got.map_err(|f| f.message).as_deref(), Ok(text), "{what}");
    }
}

/// Attempt rows by call id.
async fn attempts(d: &Deployment) -> BTreeMap<String, polygw::core::TelemetryRow> {
    d.rows()
        .await
        .into_iter()
        .filter(|r| r.kind == RowKind::Attempt)
        .map(|r| (r.call_id.clone(), r))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_during_streams_others_serve_its_slots_expire_spend_reconciles() {
    let Some(svc) = services() else { return };
    let lease_s = 3.0;
    let (behavior, text) = words(12, 50.0);
    let d = Deployment::start(
        &svc,
        Options {
            redis_url: svc.cluster.clone(),
            scope_keys: vec![("LIMITS__LEASE_S", lease_s.to_string())],
            grace_s: 10,
            behavior,
            env: vec![],
        },
    )
    .await;

    // Six streams; HAProxy (leastconn) spreads them over the three replicas.
    let tasks = streams_started(&d, 6).await;
    let victim = 0;
    let k = d.mocks[victim].requests().len();
    assert!(
        k >= 1,
        "the victim serves a stream: {:?}",
        d.upstream_requests().len()
    );
    let mut d = d;
    let killed_at = Instant::now();
    d.replicas[victim].kill();

    // Its streams are cut at the client; the others' arrive whole.
    let mut cut = 0;
    for t in tasks {
        let seen = t.await.unwrap();
        if !seen.intact(&text) {
            assert!(
                seen.error.is_some(),
                "a cut stream ends with an error: {seen:?}"
            );
            cut += 1;
        }
    }
    assert_eq!(cut, k, "exactly the killed replica's streams were cut");

    // The others keep serving through HAProxy (a refused connection is sent on).
    chats_succeed(&d, 6, "after the kill", &text).await;
    d.lb.wait_states(["DOWN", "UP", "UP"], Duration::from_secs(10))
        .await;
    chats_succeed(&d, 3, "after it is out", &text).await;
    d.lb.assert_all_answered_200();

    // Its slots stay held until their leases end (the process cannot release them)…
    let dr = &d;
    let held = poll(
        "the live replicas' slots released",
        Duration::from_secs(5),
        || async move {
            let n = dr.in_flight().await as usize;
            (n <= k).then_some(n)
        },
    )
    .await;
    let early = killed_at.elapsed() < Duration::from_secs_f64(lease_s * 2.0 / 3.0);
    if early {
        assert_eq!(held, k, "the killed replica's slots, still leased");
    }
    // …and then free by themselves.
    eventually(
        "the killed replica's slots freed by lease expiry",
        Duration::from_secs_f64(lease_s + 5.0),
        || async move { dr.in_flight().await == 0 },
    )
    .await;
    let freed_after = killed_at.elapsed();
    assert!(
        freed_after >= Duration::from_secs_f64(lease_s * 2.0 / 3.0 - 0.1),
        "freed by the lease's end (at least 2/3 of it after the last renewal), not \
         earlier: {freed_after:?}"
    );

    // Telemetry: every upstream request of a live replica has its attempt row, with
    // the tokens and cost the upstream billed; the killed replica wrote none (its k
    // calls were in flight), and what the upstream billed for them is the whole gap.
    let served: BTreeSet<String> = d
        .upstream_requests()
        .into_iter()
        .filter(|(i, _)| *i != victim)
        .filter_map(|(_, r)| r.call_id)
        .collect();
    let sr = &served;
    let rows = poll(
        "every live replica's rows in PostgreSQL",
        Duration::from_secs(10),
        || async move {
            let rows = attempts(dr).await;
            sr.iter().all(|id| rows.contains_key(id)).then_some(rows)
        },
    )
    .await;
    let mut recorded = 0.0;
    let mut billed_live = 0.0;
    let mut billed_lost = 0.0;
    for (i, m) in d.mocks.iter().enumerate() {
        for e in m.billing() {
            let id = e.call_id.clone().expect("x-polygw-call-id");
            let cost = d.prices.cost(&e);
            match rows.get(&id) {
                Some(r) => {
                    assert_ne!(i, victim, "the killed replica wrote no row for {id}");
                    assert_eq!(r.prompt_tokens, Some(e.prompt_tokens), "{id}");
                    assert_eq!(r.completion_tokens, Some(e.completion_tokens), "{id}");
                    let rc = r.cost.expect("a priced row");
                    assert!((rc - cost).abs() < 1e-12, "{id}: row {rc} vs billed {cost}");
                    recorded += rc;
                    billed_live += cost;
                }
                None => {
                    assert_eq!(i, victim, "{id} was served by a live replica: it has a row");
                    assert!(
                        matches!(e.end, EndKind::ClientDisconnected | EndKind::ResetMidStream),
                        "{id} was cut by the kill: {:?}",
                        e.end
                    );
                    billed_lost += cost;
                }
            }
        }
    }
    assert_eq!(
        rows.len(),
        served.len(),
        "no row without an upstream request"
    );
    assert!(
        (recorded - billed_live).abs() < 1e-9,
        "{recorded} vs {billed_live}"
    );
    assert!(billed_lost > 0.0, "the cut streams were billed in part");
    eprintln!(
        "killed replica: {k} streams cut; recorded spend {recorded:.9} = billed by the live \
         replicas' upstream; {billed_lost:.9} billed for the cut streams, unrecorded; slots \
         freed {freed_after:?} after the kill (lease {lease_s} s; {held} held {})",
        if early {
            "while leased"
        } else {
            "seen too late to compare"
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stopped_with_sigterm_drains_its_streams_and_loses_no_row() {
    let Some(svc) = services() else { return };
    let (behavior, text) = words(20, 50.0);
    let mut d = Deployment::start(
        &svc,
        Options {
            redis_url: svc.cluster.clone(),
            scope_keys: vec![],
            grace_s: 20,
            behavior,
            env: vec![],
        },
    )
    .await;
    let tasks = streams_started(&d, 6).await;
    let drained = 1;
    let held = d.mocks[drained].requests().len();
    assert!(held >= 1, "the drained replica serves a stream");

    d.replicas[drained].terminate();
    d.replicas[drained]
        .wait_for_line("shutting down: draining", Duration::from_secs(5))
        .await;
    // HAProxy takes it out (its listener is closed; /readyz would say `draining`)…
    d.lb.wait_states(["UP", "DOWN", "UP"], Duration::from_secs(10))
        .await;
    // …and new calls go to the others meanwhile, none refused.
    chats_succeed(&d, 6, "while draining", &text).await;
    // Its in-flight streams finish intact, like every other.
    for t in tasks {
        let seen = t.await.unwrap();
        assert!(seen.intact(&text), "{seen:?}");
    }
    d.lb.assert_all_answered_200();
    let status = d.replicas[drained]
        .exit_status(Duration::from_secs(20))
        .await;
    assert_eq!(status.code(), Some(0), "{}", d.replicas[drained].log());
    let log = d.replicas[drained].log();
    assert!(
        !log.contains("grace period over"),
        "nothing was cut:\n{log}"
    );
    assert!(
        log.contains(&format!("written {held}, dropped 0, pending 0")),
        "its rows flushed on the way out:\n{log}"
    );
    assert_eq!(
        d.mocks[drained].requests().len(),
        held,
        "no new call reached it"
    );

    // No row lost: one attempt row per upstream request, across the replicas.
    let upstream: BTreeSet<String> = d
        .upstream_requests()
        .into_iter()
        .filter_map(|(_, r)| r.call_id)
        .collect();
    assert_eq!(upstream.len(), 12);
    let (dr, n) = (&d, upstream.len());
    let rows = poll(
        "every row in PostgreSQL",
        Duration::from_secs(10),
        || async move {
            let rows = attempts(dr).await;
            (rows.len() >= n).then_some(rows)
        },
    )
    .await;
    assert_eq!(rows.keys().cloned().collect::<BTreeSet<_>>(), upstream);
    assert!(rows.values().all(|r| r.ok), "every attempt succeeded");
    assert_eq!(
        d.in_flight().await,
        0,
        "every slot released (not left to its lease)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_node_down_fails_closed_and_recovers_with_nothing_leaked() {
    let Some(svc) = services() else { return };
    let Some(mut cluster) = OwnCluster::start() else {
        return;
    };
    let (behavior, text) = words(5, 10.0);
    let mut d = Deployment::start(
        &svc,
        Options {
            redis_url: cluster.url(),
            scope_keys: vec![],
            grace_s: 10,
            behavior,
            env: vec![],
        },
    )
    .await;
    let model = d.model();
    let c = d.client();
    assert_eq!(
        chat(&c, &model, "before").await.map_err(|f| f.message),
        Ok(text.clone())
    );

    // The node that holds the scope's slot goes down.
    let node = cluster.owner_of(&format!("polygw:{{{}}}:scope:totals", d.scope));
    cluster.stop(node);
    let stopped = Instant::now();
    let before = d.upstream_requests().len();

    // A replica asked directly fails closed at once, saying why, without a secret.
    let (status, body, _) = raw_chat(&d.replicas[0].base(), &model, "direct").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "governance_backend", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("governance backend redis"), "{body}");
    assert!(!body.to_string().contains(cluster.password()), "{body}");
    // Through HAProxy, while it still sends to the replicas or once it has taken them
    // out: a clear error, never an upstream call.
    for i in 0..3 {
        let (status, body, _) = raw_chat(&d.lb.base(), &model, &format!("outage {i}")).await;
        assert_eq!(status, 503, "{body}");
        assert!(
            matches!(
                body["error"]["code"].as_str(),
                Some("governance_backend" | "no_replica_ready")
            ),
            "{body}"
        );
        assert!(!body.to_string().contains(cluster.password()), "{body}");
    }
    // Every replica reports it not ready, naming the scope's governance…
    for r in &d.replicas {
        let base = r.base();
        let base = &base;
        let body = poll(
            "/readyz says not ready",
            Duration::from_secs(10),
            || async move {
                let (status, b) = get_json(base, "/readyz").await;
                (status == 503).then_some(b)
            },
        )
        .await;
        assert_eq!(body["status"], "not_ready", "{body}");
        assert!(
            body["not_ready"][0]
                .as_str()
                .is_some_and(|s| s.starts_with(&format!("governance of scope {} (redis)", d.scope))),
            "{body}"
        );
        assert!(!body.to_string().contains(cluster.password()), "{body}");
    }
    // …so HAProxy takes them all out and answers for them, in OpenAI's format.
    d.lb.wait_states(["DOWN"; 3], Duration::from_secs(10)).await;
    let (status, body, retry_after) = raw_chat(&d.lb.base(), &model, "all down").await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (503, &json!("no_replica_ready")),
        "{body}"
    );
    assert_eq!(retry_after.as_deref(), Some("1"));
    assert_eq!(
        d.upstream_requests().len(),
        before,
        "fail closed: no upstream request without an admission"
    );

    // The node comes back: every replica is ready again, calls pass.
    eprintln!("outage seen by HAProxy after {:?}", stopped.elapsed());
    cluster.restart(node).expect("restart the node");
    let restarted = Instant::now();
    d.lb.wait_states(["UP"; 3], Duration::from_secs(30)).await;
    eprintln!("recovered {:?} after the restart", restarted.elapsed());
    let first = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..3)
        .map(|i| {
            let (c, model, first) = (d.client(), model.clone(), first.clone());
            tokio::spawn(async move { stream(&c, &model, &format!("after {i}"), first).await })
        })
        .collect();
    for t in tasks {
        let seen = t.await.unwrap();
        assert!(seen.intact(&text), "{seen:?}");
    }
    assert_eq!(
        chat(&c, &model, "after").await.map_err(|f| f.message),
        Ok(text)
    );
    // Nothing leaked: every slot released (well before the 30 s lease of the example),
    // no settlement dropped.
    let t = Instant::now();
    let dr = &d;
    eventually(
        "in_flight back to 0",
        Duration::from_secs(10),
        || async move { dr.in_flight().await == 0 },
    )
    .await;
    assert!(t.elapsed() < Duration::from_secs(10));
    for r in &d.replicas {
        let dropped = metric(&r.base(), "polygw_governance_settlements_dropped_total").await;
        assert_eq!(dropped, 0.0, "{}", r.name);
    }
    for r in d.replicas.iter_mut() {
        r.terminate();
        assert_eq!(r.exit_status(Duration::from_secs(20)).await.code(), Some(0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_past_its_grace_cuts_what_is_left_and_says_so_in_one_line() {
    let Some(svc) = services() else { return };
    // A stream far longer than the grace.
    let (behavior, _) = words(100, 200.0);
    let mut d = Deployment::start(
        &svc,
        Options {
            redis_url: svc.cluster.clone(),
            scope_keys: vec![],
            grace_s: 1,
            behavior,
            env: vec![],
        },
    )
    .await;
    let mut tasks = streams_started(&d, 1).await;
    let busy = (0..3)
        .find(|i| !d.mocks[*i].requests().is_empty())
        .expect("a replica serves the stream");
    let stopped = Instant::now();
    d.replicas[busy].terminate();
    let seen = tasks.pop().unwrap().await.unwrap();
    assert!(
        seen.error
            .as_deref()
            .is_some_and(|e| e.contains("server_shutdown")),
        "the stream ends with polygw's error event: {seen:?}"
    );
    assert!(!seen.content.is_empty(), "{seen:?}");
    let status = d.replicas[busy].exit_status(Duration::from_secs(15)).await;
    assert_eq!(status.code(), Some(0));
    let elapsed = stopped.elapsed();
    assert!(
        elapsed >= Duration::from_secs(1),
        "the grace was given: {elapsed:?}"
    );
    let log = d.replicas[busy].log();
    let cut: Vec<&str> = log.lines().filter(|l| l.contains("grace period")).collect();
    assert_eq!(
        cut,
        [
            "grace period over (1 s): cut 1 connection(s) with calls still running (streams \
          ended with an error event, plain calls a 503)"
        ],
        "one line says what was cut:\n{log}"
    );
    // The cut call's row was flushed on the way out.
    assert!(log.contains("written 1, dropped 0, pending 0"), "{log}");
    let id = d.mocks[busy].requests()[0]
        .call_id
        .clone()
        .expect("a call id");
    let row = attempts(&d)
        .await
        .remove(&id)
        .expect("the cut attempt's row");
    assert!(!row.ok, "{row:?}");
}

// ---- client keys across replicas (SPEC §21.1; issue 26, item 3) ----------------------
//
// The key store is the replicas' telemetry database (`POLYGW_KEYS_DB` = the PostgreSQL
// URL); keys are made and revoked with `polygw keys` as an operator would.

/// The key tests' source prices (per 1M tokens, in and out; the mocks bill the same):
/// high, so that a budget of 1.00 runs out after a few dozen calls.
const KEY_PRICE: f64 = 400.0;
/// Every answer's chunks (= its completion tokens, as the mock reports them) and the
/// source's `MAX_OUTPUT_TOKENS`: what each call (without a cap of its own) reserves for
/// its output and is sent as its cap (SPEC §24.1).
const ANSWER_TOKENS: usize = 4;
/// Concurrent clients on one key.
const CLIENTS: usize = 32;
/// The key limits of the budget and RPM cases.
const BUDGET: &str = "1.00/day";
const BUDGET_NANOS: u64 = 1_000_000_000;
const KEY_RPM: usize = 120;

/// Three replicas that load their client keys from the telemetry database, on a priced
/// source whose own RPM is far above anything the tests send (only the keys' limits
/// bind); every answer is `ANSWER_TOKENS` chunks.
async fn key_deployment(svc: &Services) -> (Deployment, String) {
    let (behavior, text) = words(ANSWER_TOKENS, 0.0);
    let d = Deployment::start(
        svc,
        Options {
            redis_url: svc.cluster.clone(),
            scope_keys: vec![
                ("OPENAI__0__INPUT_PRICE", KEY_PRICE.to_string()),
                ("OPENAI__0__OUTPUT_PRICE", KEY_PRICE.to_string()),
                ("OPENAI__0__MAX_OUTPUT_TOKENS", ANSWER_TOKENS.to_string()),
                ("OPENAI__0__RPM", "100000".into()),
            ],
            grace_s: 10,
            behavior,
            env: vec![("POLYGW_KEYS_DB", svc.postgres.clone())],
        },
    )
    .await;
    assert_eq!(
        d.prices.input, KEY_PRICE,
        "the mocks bill at the sources' prices"
    );
    (d, text)
}

/// What a call of `prompt` reserves against its key's budget, nanos: the proxy's prompt
/// estimate with its margin plus `MAX_OUTPUT_TOKENS`, at the source's prices
/// (`key_quota::key_reservation`).
fn reservation(prompt: &str) -> u64 {
    use polygw::core::key_quota::{price_nanos, ScopePrices};
    let p = price_nanos(KEY_PRICE);
    let est = polygw::core::resume::estimate_prompt_tokens(&polygw::ChatRequest::user(prompt));
    ScopePrices {
        input: p,
        output: p,
        per_call: None,
    }
    .reserve_nanos(
        polygw::core::key_funds::with_margin(est, polygw::core::key_funds::ESTIMATE_MARGIN_PCT),
        ANSWER_TOKENS as u64,
    )
    .expect("a priced scope")
}

/// The largest number of instants within any half-open window of `w`.
fn max_in_window<T: Copy + Ord + std::ops::Add<D, Output = T>, D: Copy>(
    times: &mut [T],
    w: D,
) -> usize {
    times.sort_unstable();
    let (mut best, mut j) = (0, 0);
    for i in 0..times.len() {
        while j < times.len() && times[j] < times[i] + w {
            j += 1;
        }
        best = best.max(j - i);
    }
    best
}

/// Polls until the key has nothing in flight and nothing reserved (every call settled);
/// its figures then.
async fn key_settled(d: &Deployment, key_id: &str) -> polygw::core::ports::KeyUsage {
    poll(
        &format!("key {key_id}: every call settled"),
        Duration::from_secs(10),
        || async move {
            let u = d.key_usage(key_id).await;
            (u.in_flight == 0 && u.reserved_nanos == 0).then_some(u)
        },
    )
    .await
}

/// What one case of a key measured.
#[derive(Debug)]
struct KeyFigures {
    calls: usize,
    /// Calls per replica (by the mock each replica calls).
    per_replica: [usize; 3],
    /// Σ of the rows' costs as the governance settles them (`settlement_nanos`).
    spend_nanos: u64,
    /// The key's day spend on the governance backend.
    settled_day_nanos: u64,
    /// What the upstreams billed for the key's calls.
    billed: f64,
    /// Most upstream requests of the key within any 60 s window (their arrivals).
    upstream_window: usize,
    /// Most rows of the key within any 60 s window (their `created_at_ms`).
    rows_window: usize,
    /// The key's requests in the backend's window.
    usage_requests: u64,
}

/// Reconciles one key after its case: its upstream requests are exactly those with
/// `call_id`s in `ids`; every one has its attempt row in PostgreSQL, with the key's id;
/// the rows' costs are what the upstreams billed (their prices are the sources'), each
/// call within its reservation `reserve`; the governance's settled spend equals the
/// rows' (`settlement_nanos`: an unknown cost settles at least at the reservation) and
/// stays within the budget; no 60 s window holds more than `rpm` requests, by the
/// upstreams' logs, by the rows, and by the backend.
async fn reconcile_key(
    d: &Deployment,
    key: &NewKey,
    ids: &BTreeSet<String>,
    reserve: u64,
    rpm: usize,
    day_at_start: u64,
) -> KeyFigures {
    use polygw::core::client_key::BudgetPeriod;
    use polygw::core::key_quota::{period_id, settlement_nanos};
    let usage = key_settled(d, &key.id).await;
    let rows = poll(
        &format!("key {}: a row per upstream request in PostgreSQL", key.id),
        Duration::from_secs(10),
        || async move {
            let rows: BTreeMap<String, polygw::core::TelemetryRow> = d
                .rows()
                .await
                .into_iter()
                .filter(|r| r.client_key_id.as_deref() == Some(key.id.as_str()))
                .map(|r| (r.call_id.clone(), r))
                .collect();
            ids.iter().all(|id| rows.contains_key(id)).then_some(rows)
        },
    )
    .await;
    assert!(
        rows.values().all(|r| r.kind == RowKind::Attempt && r.ok),
        "only successful attempts: {:?}",
        rows.values().filter(|r| !r.ok).collect::<Vec<_>>()
    );
    assert_eq!(
        rows.keys().cloned().collect::<BTreeSet<_>>(),
        *ids,
        "key {}: no row without an upstream request",
        key.id
    );
    // The bill is the spend: each upstream request's billed cost is its row's.
    for m in &d.mocks {
        let n = m.requests().len();
        let got = m.wait_for_billed(n, Duration::from_secs(5)).await.len();
        assert_eq!(got, n, "every upstream request billed");
    }
    let mut billed = 0.0;
    let mut billed_n = 0;
    let mut per_replica = [0usize; 3];
    let mut arrivals = Vec::new();
    for (i, m) in d.mocks.iter().enumerate() {
        for r in m.requests() {
            if r.call_id.as_ref().is_some_and(|id| ids.contains(id)) {
                per_replica[i] += 1;
                arrivals.push(r.arrived_at);
            }
        }
        for e in m.billing() {
            let Some(row) = e.call_id.as_ref().and_then(|id| rows.get(id)) else {
                continue;
            };
            let cost = d.prices.cost(&e);
            assert_eq!(row.prompt_tokens, Some(e.prompt_tokens), "{}", row.call_id);
            assert_eq!(
                row.completion_tokens,
                Some(e.completion_tokens),
                "{}",
                row.call_id
            );
            let rc = row.cost.expect("a priced row");
            assert!(
                (rc - cost).abs() < 1e-12,
                "{}: row {rc} vs billed {cost}",
                row.call_id
            );
            billed += cost;
            billed_n += 1;
        }
    }
    assert_eq!((arrivals.len(), billed_n), (ids.len(), ids.len()));
    // Per call (its rows: one attempt each here), what the governance settles.
    let mut calls: BTreeMap<&str, Vec<Option<f64>>> = BTreeMap::new();
    for r in rows.values() {
        calls
            .entry(&r.logical_call_id)
            .or_default()
            .push(polygw::core::telemetry::key_cost(r));
    }
    let mut spend_nanos = 0u64;
    for (lid, costs) in &calls {
        let n = settlement_nanos(reserve, costs.iter().copied());
        assert!(
            n <= reserve,
            "call {lid} cost {n} nanos, more than it reserved ({reserve})"
        );
        spend_nanos += n;
    }
    assert!(
        (billed - spend_nanos as f64 / 1e9).abs() < 1e-9,
        "billed {billed} vs rows {spend_nanos} nanos"
    );
    let day_now = period_id(BudgetPeriod::Day, usage.now_unix_ms);
    if day_now == day_at_start {
        assert_eq!(
            usage.day_nanos, spend_nanos,
            "key {}: the governance settled the sum of the rows' costs",
            key.id
        );
        assert!(usage.month_nanos >= usage.day_nanos, "{usage:?}");
    } else {
        eprintln!("the UTC day changed during the case: its settled spend is not compared");
    }
    assert!(
        spend_nanos <= BUDGET_NANOS,
        "key {}: spent {spend_nanos} nanos, over its budget of {BUDGET_NANOS} (every call \
         cost at most its reservation: the budget must hold exactly)",
        key.id
    );
    // RPM: every 60 s window, by the upstreams' own logs and by the rows.
    let upstream_window = max_in_window(&mut arrivals, Duration::from_secs(60));
    let mut created: Vec<i64> = rows.values().map(|r| r.created_at_ms).collect();
    let rows_window = max_in_window(&mut created, 60_000);
    assert!(
        upstream_window <= rpm && rows_window <= rpm && usage.requests as usize <= rpm,
        "key {}: {upstream_window} upstream requests / {rows_window} rows / {} admissions \
         within 60 s, RPM {rpm}",
        key.id,
        usage.requests
    );
    KeyFigures {
        calls: calls.len(),
        per_replica,
        spend_nanos,
        settled_day_nanos: usage.day_nanos,
        billed,
        upstream_window,
        rows_window,
        usage_requests: usage.requests,
    }
}

/// A client key with a budget of 1.00 per day and an RPM of 120 (SPEC §21.1), admitted
/// by three replicas on one Redis Cluster, under 32 concurrent clients through HAProxy.
/// Two keys with the same limits, one case each, so that each limit binds:
///
/// - **budget**: 32 async-openai clients with prompts whose calls reserve 0.0155 and cost
///   0.012 each, until each is refused `key_budget_day` (a 429 of type
///   `insufficient_quota`, which async-openai does not retry); then one client, call by
///   call with nothing else in flight, until refused too: the budget is spent to within
///   one reservation, and never over;
/// - **RPM**: 32 clients with prompts that reserve 0.005 (120 of them cost 0.36: the
///   budget cannot bind) until each is refused `key_rpm`; exactly 120 are admitted. These
///   clients speak raw HTTP: async-openai retries a 429 after its `Retry-After` (here the
///   window's ~60 s) out of sight.
///
/// Each case is reconciled against the upstreams' own logs and billing and the rows in
/// PostgreSQL (`reconcile_key`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_budget_and_rpm_hold_across_three_replicas_under_32_concurrent_clients() {
    use polygw::core::client_key::{format_nanos, BudgetPeriod};
    use polygw::core::key_quota::period_id;
    let Some(svc) = services() else { return };
    let (d, text) = key_deployment(&svc).await;
    let model = d.model();
    let limits = [
        "--scope",
        d.scope.as_str(),
        "--rpm",
        "120",
        "--budget",
        BUDGET,
    ];
    let spend = d.create_key(&format!("{model}-budget"), &limits).await;
    let rate = d.create_key(&format!("{model}-rpm"), &limits).await;
    let day = period_id(BudgetPeriod::Day, d.key_usage(&spend.id).await.now_unix_ms);
    // Both keys loaded by every replica (each reloads the store every 2 s).
    for r in &d.replicas {
        let base = r.base();
        let (base, key) = (&base, &rate.secret);
        eventually(
            &format!("{} knows the new keys", r.name),
            Duration::from_secs(5),
            || async move {
                // A wrong model is refused after the key is looked up: 404, not 401, and
                // nothing is admitted or sent upstream.
                let (st, _, _) = raw_chat_with_key(base, key, "no-such-model", "x").await;
                st != 401
            },
        )
        .await;
    }

    // ---- budget -------------------------------------------------------------------------
    // Prompts of one length: every call reserves the same.
    let spend_prompt = |c: usize, n: usize| format!("budget {c:02}-{n:03} {}", "x".repeat(64));
    let reserve = reservation(&spend_prompt(0, 0));
    assert_eq!(
        reserve, 13_600_000,
        "34 tokens (24 prompt + 25 %, 4 answer) at 400 per 1M"
    );
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (lb, key, model, text) = (
                d.lb.base(),
                spend.secret.clone(),
                model.clone(),
                text.clone(),
            );
            tokio::spawn(async move {
                let client = openai_with_key(&lb, &key);
                let mut ok = 0;
                loop {
                    match chat(&client, &model, &spend_prompt(c, ok)).await {
                        Ok(t) => {
                            assert_eq!(t, text);
                            ok += 1;
                            assert!(ok < 1000, "client {c}: never refused");
                        }
                        Err(f) => return (ok, f),
                    }
                }
            })
        })
        .collect();
    let ended = tokio::time::timeout(
        Duration::from_secs(30),
        futures_util::future::join_all(clients),
    )
    .await
    .expect("every client refused within 30 s");
    let ran_out = started.elapsed();
    let budget_msg = format!(
        "reached its budget of {} per day",
        format_nanos(BUDGET_NANOS)
    );
    let reserves_msg = format!("this call reserves {}", format_nanos(reserve));
    // A refusal names the key, its limit, the reservation and either the day's reset
    // (the budget is spent) or that calls in flight hold it (SPEC §24.2: a short
    // Retry-After; `spent` asks for the first).
    let check_refusal = |f: &Failure, spent: bool| {
        assert_eq!(
            (f.status, f.code.as_deref()),
            (429, Some("key_budget_day")),
            "{f:?}"
        );
        let reset = f.message.contains("resets at ") && f.message.ends_with("T00:00:00Z");
        let held = f
            .message
            .contains("calls of this key in flight hold the rest");
        assert!(
            f.message.contains(&spend.id)
                && f.message.contains(&budget_msg)
                && f.message.contains(&reserves_msg)
                && (reset || (held && !spent)),
            "the refusal names the key, its limit, the reservation and the reset: {f:?}"
        );
    };
    let mut concurrent_ok = 0;
    for e in ended {
        let (ok, f) = e.expect("a budget client");
        check_refusal(&f, false);
        concurrent_ok += ok;
    }
    // What the 32 left: calls refused while others' reservations were in flight. One
    // client, call by call once everything is settled, spends the rest.
    let top = openai_with_key(&d.lb.base(), &spend.secret);
    let mut topped = 0;
    let last = loop {
        key_settled(&d, &spend.id).await;
        match chat(&top, &model, &spend_prompt(99, topped)).await {
            Ok(t) => {
                assert_eq!(t, text);
                topped += 1;
                assert!(topped < 100, "the top-up is never refused");
            }
            Err(f) => break f,
        }
    };
    check_refusal(&last, true);
    let ids: BTreeSet<String> = d
        .upstream_requests()
        .into_iter()
        .filter_map(|(_, r)| r.call_id)
        .collect();
    assert_eq!(
        ids.len(),
        concurrent_ok + topped,
        "one upstream request per admitted call"
    );
    let b = reconcile_key(&d, &spend, &ids, reserve, KEY_RPM, day).await;
    assert!(
        b.spend_nanos + reserve > BUDGET_NANOS,
        "refused with nothing in flight: less than one reservation ({reserve}) is left of \
         the budget, spent {}",
        b.spend_nanos
    );
    assert!(
        b.per_replica.iter().all(|n| *n > 0),
        "every replica admitted: {:?}",
        b.per_replica
    );

    // ---- RPM ----------------------------------------------------------------------------
    let rate_prompt = |c: usize, n: usize| format!("r{c:02}{n:03}");
    let rate_reserve = reservation(&rate_prompt(0, 0));
    assert!(
        KEY_RPM as u64 * rate_reserve + CLIENTS as u64 * rate_reserve < BUDGET_NANOS,
        "the budget cannot bind in the RPM case"
    );
    let before: BTreeSet<String> = ids;
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (lb, key, model) = (d.lb.base(), rate.secret.clone(), model.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let mut ok = 0;
                loop {
                    let (st, body, retry_after) =
                        raw_chat_on(&http, &lb, &key, &model, &rate_prompt(c, ok)).await;
                    if st != 200 {
                        return (ok, st, body, retry_after);
                    }
                    ok += 1;
                    assert!(
                        ok <= KEY_RPM,
                        "client {c}: more than the key's RPM admitted"
                    );
                }
            })
        })
        .collect();
    let ended = tokio::time::timeout(
        Duration::from_secs(30),
        futures_util::future::join_all(clients),
    )
    .await
    .expect("every client refused within 30 s");
    let bound = started.elapsed();
    let mut admitted = 0;
    let rpm_msg = format!("reached its limit of {KEY_RPM} requests per minute; resets at ");
    for e in ended {
        let (ok, st, body, retry_after) = e.expect("an RPM client");
        admitted += ok;
        assert_eq!(
            (st, &body["error"]["code"]),
            (429, &json!("key_rpm")),
            "{body}"
        );
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&rate.id) && message.contains(&rpm_msg),
            "the refusal names the key, its limit and the reset: {body}"
        );
        let secs: u64 = retry_after
            .as_deref()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("a Retry-After: {body}"));
        assert!((1..=60).contains(&secs), "Retry-After {secs}");
    }
    assert_eq!(
        admitted, KEY_RPM,
        "every client ran until refused: the window is full"
    );
    let ids: BTreeSet<String> = d
        .upstream_requests()
        .into_iter()
        .filter_map(|(_, r)| r.call_id)
        .filter(|id| !before.contains(id))
        .collect();
    assert_eq!(ids.len(), KEY_RPM);
    let r = reconcile_key(&d, &rate, &ids, rate_reserve, KEY_RPM, day).await;
    assert_eq!(r.usage_requests as usize, KEY_RPM);
    assert!(
        r.per_replica.iter().all(|n| *n > 0),
        "every replica admitted: {:?}",
        r.per_replica
    );

    // A limit change reaches every replica within 5 s as well: the RPM lifted
    // (`polygw keys set --rpm 0`), each replica, asked directly, admits the key again.
    let changed = Instant::now();
    d.keys(&["set", &rate.id, "--rpm", "0"]).await;
    let mut lifted = Vec::new();
    for rep in &d.replicas {
        let base = rep.base();
        let (base, key, m) = (&base, &rate.secret, &model);
        poll(
            &format!("{} admits the key once its RPM is lifted", rep.name),
            Duration::from_secs(5).saturating_sub(changed.elapsed()),
            || async move {
                let (st, body, _) = raw_chat_with_key(base, key, m, "lifted").await;
                match (st, body["error"]["code"].as_str()) {
                    (200, _) => Some(()),
                    (429, Some("key_rpm")) => None,
                    _ => panic!("{st}: {body}"),
                }
            },
        )
        .await;
        lifted.push(changed.elapsed());
    }

    let units = |n: u64| n as f64 / 1e9;
    eprintln!(
        "key budget {BUDGET}, RPM {KEY_RPM}, {CLIENTS} clients through HAProxy on 3 replicas:\n  \
         budget case: {} calls ({concurrent_ok} concurrent + {topped} one by one; per replica \
         {:?}), budget ran out after {ran_out:?}; spent {:.9} (upstream bill {:.9}, settled \
         {:.9}) of 1.00: overshoot {:.9} (≤ one reservation {:.3} allowed), {:.9} left; \
         most in 60 s {} upstream / {} rows of RPM {KEY_RPM}\n  RPM case: {} calls admitted \
         (per replica {:?}) before the limit bound after {bound:?}; most in 60 s {} upstream / \
         {} rows / {} in the backend: RPM overshoot {}; spent {:.9}; the RPM lifted with \
         `polygw keys set` was in force on polygw-1/2/3 after {lifted:?}",
        b.calls,
        b.per_replica,
        units(b.spend_nanos),
        b.billed,
        units(b.settled_day_nanos),
        units(b.spend_nanos) - 1.0,
        units(reserve),
        1.0 - units(b.spend_nanos),
        b.upstream_window,
        b.rows_window,
        r.calls,
        r.per_replica,
        r.upstream_window,
        r.rows_window,
        r.usage_requests,
        r.upstream_window as i64 - KEY_RPM as i64,
        units(r.spend_nanos),
    );
}

/// A key revoked with `polygw keys revoke` while 8 async-openai clients call through
/// HAProxy on it (SPEC §21.1): every replica, hit directly, refuses it (401
/// `invalid_api_key`, "was revoked") within 5 s of the command; so does HAProxy's every
/// client; its calls in flight finish and release their slots, and nothing more reaches
/// an upstream. The propagation time is measured per replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_during_load_is_refused_by_every_replica_within_5_s() {
    let Some(svc) = services() else { return };
    let (d, text) = key_deployment(&svc).await;
    let model = d.model();
    let name = format!("{model}-revoked");
    let created = Instant::now();
    let key = d
        .create_key(&name, &["--scope", d.scope.as_str(), "--concurrency", "64"])
        .await;
    // A new key reaches every replica (asked directly) within the same 5 s.
    let mut loaded = Vec::new();
    for r in &d.replicas {
        let base = r.base();
        let (base, secret, m) = (&base, &key.secret, &model);
        poll(
            &format!("{} accepts the new key", r.name),
            Duration::from_secs(5).saturating_sub(created.elapsed()),
            || async move {
                let (st, body, _) = raw_chat_with_key(base, secret, m, "created").await;
                match st {
                    200 => Some(()),
                    401 => None,
                    other => panic!("{other}: {body}"),
                }
            },
        )
        .await;
        loaded.push(created.elapsed());
    }

    // Load through HAProxy until each client is refused.
    let served = Arc::new(AtomicUsize::new(0));
    let load: Vec<_> = (0..8)
        .map(|i| {
            let (lb, secret, model, text, served) = (
                d.lb.base(),
                key.secret.clone(),
                model.clone(),
                text.clone(),
                served.clone(),
            );
            tokio::spawn(async move {
                let c = openai_with_key(&lb, &secret);
                let mut n = 0;
                loop {
                    match chat(&c, &model, &format!("load {i} {n}")).await {
                        Ok(t) => {
                            assert_eq!(t, text);
                            n += 1;
                            served.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(f) => return (n, f, Instant::now()),
                    }
                }
            })
        })
        .collect();
    let s = &served;
    eventually("the load runs", Duration::from_secs(10), || {
        std::future::ready(s.load(Ordering::SeqCst) >= 40)
    })
    .await;

    let revoked = Instant::now();
    let out = d.keys(&["revoke", &name]).await;
    let committed = Instant::now();
    assert!(
        out.stdout
            .contains(&format!("client key {} ({name}) revoked", key.id)),
        "{out:?}"
    );
    let refused = |st: u16, body: &serde_json::Value| {
        assert_eq!(
            (st, &body["error"]["code"]),
            (401, &json!("invalid_api_key")),
            "{body}"
        );
        assert_eq!(
            body["error"]["message"],
            json!(format!("The API key {} was revoked", key.id)),
            "{body}"
        );
    };
    // Each replica, asked directly and concurrently until it refuses.
    let probes = d.replicas.iter().map(|r| {
        let (base, secret, m, name) = (r.base(), key.secret.clone(), model.clone(), r.name.clone());
        async move {
            let http = reqwest::Client::new();
            let (base, secret, m, http) = (&base, &secret, &m, &http);
            poll(
                &format!("{name} refuses the revoked key"),
                Duration::from_secs(5).saturating_sub(revoked.elapsed()),
                || async move {
                    let (st, body, _) = raw_chat_on(http, base, secret, m, "probe").await;
                    match st {
                        200 => None,
                        _ => Some((Instant::now(), st, body)),
                    }
                },
            )
            .await
        }
    });
    let seen = futures_util::future::join_all(probes).await;
    let mut propagation = Vec::new();
    for (at, st, body) in &seen {
        refused(*st, body);
        propagation.push((
            at.saturating_duration_since(revoked),
            at.saturating_duration_since(committed),
        ));
    }
    // Every load client ends refused the same way, within the same 5 s.
    let ends = tokio::time::timeout(
        Duration::from_secs(10),
        futures_util::future::join_all(load),
    )
    .await
    .expect("every load client refused");
    let mut load_ok = 0;
    let mut last_client = Duration::ZERO;
    for e in ends {
        let (n, f, at) = e.expect("a load client");
        load_ok += n;
        assert_eq!(
            (f.status, f.code.as_deref()),
            (401, Some("invalid_api_key")),
            "{f:?}"
        );
        assert_eq!(
            f.message,
            format!("The API key {} was revoked", key.id),
            "{f:?}"
        );
        last_client = last_client.max(at.saturating_duration_since(revoked));
    }
    assert!(last_client < Duration::from_secs(5), "{last_client:?}");
    // Its calls in flight at the revocation finished and released their slots…
    let u = key_settled(&d, &key.id).await;
    // …and nothing more reaches an upstream: asked again, every replica and HAProxy refuse.
    let before = d.upstream_requests().len();
    for base in d.replicas.iter().map(|r| r.base()).chain([d.lb.base()]) {
        let (st, body, _) = raw_chat_with_key(&base, &key.secret, &model, "after").await;
        refused(st, &body);
    }
    assert_eq!(
        d.upstream_requests().len(),
        before,
        "a revoked key reaches no upstream"
    );
    // Every call the key made has its row, with its id.
    let ids: BTreeSet<String> = d
        .upstream_requests()
        .into_iter()
        .filter_map(|(_, r)| r.call_id)
        .collect();
    let (dr, ids_ref, kid) = (&d, &ids, &key.id);
    poll(
        "the key's rows in PostgreSQL",
        Duration::from_secs(10),
        || async move {
            let rows = dr.rows().await;
            let of_key: BTreeSet<&str> = rows
                .iter()
                .filter(|r| r.client_key_id.as_deref() == Some(kid.as_str()))
                .map(|r| r.call_id.as_str())
                .collect();
            ids_ref
                .iter()
                .all(|id| of_key.contains(id.as_str()))
                .then_some(())
        },
    )
    .await;
    eprintln!(
        "revocation during load ({load_ok} calls of 8 clients through HAProxy, {} upstream \
         requests, in flight after {}): refused by polygw-1/2/3 {:?} after the command started \
         ({:?} after it returned); the last HAProxy client refused after {last_client:?}; a \
         new key was accepted by each replica after {loaded:?}",
        ids.len(),
        u.in_flight,
        propagation.iter().map(|p| p.0).collect::<Vec<_>>(),
        propagation.iter().map(|p| p.1).collect::<Vec<_>>(),
    );
}
