//! The Redis backend against the testkit contract suites (real server, `127.0.0.1:6379`;
//! mandatory under `CI=true`), and the Redis-only behaviour: fail closed when the server
//! is unreachable, silent or kills the connection; keys with TTLs; NOSCRIPT fallback;
//! the drop-time settlement queue.
//!
//! Time is the server's: expiry cases use a 2 s test window and wait with margins.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use polygw_core::error::GovernanceError;
use polygw_core::ports::{BreakerStore, RateLimiter};
use polygw_core::settings::BreakerSettings;
use polygw_limiter_redis::{RedisGovernance, RedisLimiter, RedisOptions};
use polygw_testkit::breaker_contract::{self as bc, BreakerHarness};
use polygw_testkit::limiter_contract::{self as lc, LimiterHarness, Subject, WindowProbe};
use polygw_testkit::services::{redis_cluster_url, redis_url, unique_name};

/// The short window of the expiry cases.
const TEST_WINDOW: Duration = Duration::from_secs(2);

struct Real {
    url: String,
    opts: RedisOptions,
    base: tokio::time::Instant,
    gov: RedisGovernance,
    short: RedisGovernance,
}

/// The contract cases are about semantics, not timeouts (those have tests of their
/// own): a CI machine loaded by parallel builds and suites can hold a Redis reply past
/// the production bounds (1 s per reply, 2 s per operation), so these are generous.
async fn harness(url: &str) -> Real {
    harness_with(
        url,
        RedisOptions {
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(10),
            operation_timeout: Duration::from_secs(15),
            ..RedisOptions::default()
        },
    )
    .await
}

async fn harness_with(url: &str, opts: RedisOptions) -> Real {
    Real {
        url: url.to_string(),
        base: tokio::time::Instant::now(),
        gov: RedisGovernance::connect(url, opts.clone())
            .await
            .expect("connect"),
        short: RedisGovernance::connect(
            url,
            RedisOptions {
                window: TEST_WINDOW,
                ..opts.clone()
            },
        )
        .await
        .expect("connect"),
        opts,
    }
}

impl Real {
    async fn client(&self) -> RedisGovernance {
        RedisGovernance::connect(&self.url, self.opts.clone())
            .await
            .expect("connect a client")
    }
}

struct Probe(RedisLimiter);

#[async_trait]
impl WindowProbe for Probe {
    async fn source_window(
        &self,
        scope: &str,
        source: &str,
    ) -> Result<(u64, u64), GovernanceError> {
        self.0.source_window(scope, source).await
    }
    async fn scope_window(&self, scope: &str) -> Result<(u64, u64), GovernanceError> {
        self.0.scope_window(scope).await
    }
}

fn subject(g: &RedisGovernance) -> Subject {
    Subject {
        limiter: Arc::new(g.limiter()),
        probe: Arc::new(Probe(g.limiter())),
    }
}

#[async_trait]
impl LimiterHarness for Real {
    async fn subject(&self) -> Subject {
        subject(&self.gov)
    }
    async fn clients(&self, n: usize) -> Vec<Arc<dyn RateLimiter>> {
        let mut out: Vec<Arc<dyn RateLimiter>> = vec![];
        for _ in 0..n {
            let g = self.client().await;
            out.push(Arc::new(g.limiter()));
        }
        out
    }
    async fn windowed(&self) -> (Subject, Duration) {
        (subject(&self.short), TEST_WINDOW)
    }
    async fn crashable(&self) -> (Arc<dyn RateLimiter>, Box<dyn Fn() + Send + Sync>) {
        let g = self.client().await;
        let l = g.limiter();
        (Arc::new(l), Box::new(move || g.stop_heartbeat()))
    }
    async fn quiet(&self) -> Subject {
        let g = self.client().await;
        g.stop_heartbeat();
        subject(&g)
    }
    fn manual_time(&self) -> bool {
        false
    }
    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }
    fn now(&self) -> Duration {
        self.base.elapsed()
    }
    fn margin(&self) -> Duration {
        Duration::from_millis(250)
    }
}

#[async_trait]
impl BreakerHarness for Real {
    async fn store(&self) -> Arc<dyn BreakerStore> {
        Arc::new(self.gov.breakers())
    }
    async fn clients(&self, n: usize) -> Vec<Arc<dyn BreakerStore>> {
        let mut out: Vec<Arc<dyn BreakerStore>> = vec![];
        for _ in 0..n {
            let g = self.client().await;
            out.push(Arc::new(g.breakers()));
        }
        out
    }
    async fn crashable(&self) -> (Arc<dyn BreakerStore>, Box<dyn Fn() + Send + Sync>) {
        let g = self.client().await;
        let b = g.breakers();
        (Arc::new(b), Box::new(move || g.stop_heartbeat()))
    }
    async fn quiet(&self) -> Arc<dyn BreakerStore> {
        let g = self.client().await;
        g.stop_heartbeat();
        Arc::new(g.breakers())
    }
    fn settings(&self) -> BreakerSettings {
        BreakerSettings {
            failures: 3,
            // Long enough that a loaded machine does not pass it between two calls
            // that must see it open; `open_time_capped_at_open_max` uses a fifth of it.
            open: Duration::from_secs(1),
            open_max: Duration::from_secs(10),
            dead: Duration::from_secs(1),
            dead_after: 2,
        }
    }
    fn manual_time(&self) -> bool {
        false
    }
    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }
    fn now(&self) -> Duration {
        self.base.elapsed()
    }
    fn margin(&self) -> Duration {
        Duration::from_millis(250)
    }
}

/// One contract case per test, against the single server (`redis_url`) or the cluster
/// (`redis_cluster_url`).
macro_rules! contract_cases {
    ($suite:ident, $url:path; $($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some(url) = $url() else { return };
            $suite::$name(&harness(&url).await).await;
        }
    )*};
}

macro_rules! limiter_cases {
    ($url:path) => {
        contract_cases!(
            lc, $url;
            rpm_never_over_admitted,
            rpm_window_rolls,
            tpm_reserve_then_settle,
            tpm_window_rolls,
            concurrency_cap_and_release,
            lease_expiry_frees_the_slot,
            leases_renewed_while_held_and_end_after_a_crash,
            long_calls_hold_their_tpm_reservation,
            scope_limits_atomic_with_source,
            settle_and_release_idempotent,
            drop_settles_reservation_and_releases,
            unlimited_admits_everything,
            concurrent_acquirers_never_over_admit,
            concurrent_rpm_saturation,
            saturating_load_over_windows,
        );

        /// Random sequences (no time advance: the server's clock cannot be moved) match
        /// the reference model: admissions, refusal reasons, hints within the case's
        /// duration, in flight and windows.
        #[test]
        fn matches_reference_model() {
            let Some(url) = $url() else { return };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let h = rt.block_on(harness(&url));
            lc::model_proptest(&rt, &h, 96);
        }
    };
}

/// The client-key half of the limiter contract (SPEC §21.1): a key's keys live in the key
/// id's own slot.
macro_rules! key_cases {
    ($url:path) => {
        contract_cases!(
            kc, $url;
            key_rpm_never_over_admitted,
            key_rpm_window_rolls,
            key_tpm_reserve_then_settle,
            key_concurrency_cap_and_finish,
            key_budget_reserve_then_settle,
            key_top_up_holds_money_only,
            key_drop_settles_at_the_reservation,
            key_leases_renewed_while_held_and_settled_after_a_crash,
            keys_are_independent,
            key_unlimited_admits_everything,
            concurrent_key_callers_never_over_admit,
        );

        /// Random sequences (no time advance) match `KeyQuotas`: admissions, refusal
        /// reasons, hints within the case's duration, every figure.
        #[test]
        fn matches_key_model() {
            let Some(url) = $url() else { return };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let h = rt.block_on(harness(&url));
            kc::key_model_proptest(&rt, &h, 96);
        }
    };
}

macro_rules! breaker_cases {
    ($url:path) => {
        contract_cases!(
            bc, $url;
            opens_after_consecutive_failures,
            only_consecutive_feeding_failures_count,
            half_open_admits_one_probe_and_success_closes,
            failed_probe_doubles_open_time,
            open_time_capped_at_open_max,
            probe_lease_expires_and_neutral_frees,
            cooldown_from_retry_after,
            a_huge_cooldown_is_bounded_alike,
            dead_source_out_for_dead_s,
            concurrent_half_open_grants_one_probe,
            sources_are_independent,
            outcomes_count_only_in_their_epoch,
            stale_probe_changes_nothing,
            only_the_dead_period_revives_a_dead_source,
            reset_and_drain_act_at_once_for_every_client,
            probe_renewed_while_held_and_freed_after_a_crash,
            release_probe_frees_it,
        );

        /// Random admit/record sequences match `BreakerState` (no time advance).
        #[test]
        fn matches_reference_model() {
            let Some(url) = $url() else { return };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let h = rt.block_on(harness(&url));
            bc::model_proptest(&rt, &h, 96);
        }
    };
}

/// The contract suites on the single server.
mod limiter_contract {
    use super::*;
    limiter_cases!(redis_url);
}

mod breaker_contract {
    use super::*;
    breaker_cases!(redis_url);
}

mod key_contract {
    use super::*;
    use polygw_testkit::limiter_contract::keys as kc;
    key_cases!(redis_url);
}

/// The same suites on the local 3-node Redis Cluster (SPEC §14.10): every scope's keys
/// share one slot, the scripts declare their keys and the cluster connection routes them.
mod cluster_limiter_contract {
    use super::*;
    limiter_cases!(redis_cluster_url);
}

mod cluster_breaker_contract {
    use super::*;
    breaker_cases!(redis_cluster_url);
}

mod cluster_key_contract {
    use super::*;
    use polygw_testkit::limiter_contract::keys as kc;
    key_cases!(redis_cluster_url);
}

/// A TCP proxy in front of the real server, to cut, kill or silence connections.
mod proxy {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::task::JoinHandle;

    #[derive(Debug)]
    pub struct Proxy {
        pub addr: SocketAddr,
        /// Local addresses of the proxy's connections to the server (as the server sees
        /// its clients), newest last.
        pub upstreams: Arc<Mutex<Vec<SocketAddr>>>,
        /// While set, bytes are swallowed instead of forwarded (a server that went silent).
        pub silent: Arc<AtomicBool>,
        tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
    }

    fn host_port(url: &str) -> String {
        let rest = url.split("://").nth(1).unwrap_or(url);
        let rest = rest.rsplit('@').next().unwrap_or(rest);
        rest.split('/').next().unwrap_or(rest).to_string()
    }

    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        silent: Arc<AtomicBool>,
    ) {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if silent.load(Ordering::SeqCst) {
                        continue;
                    }
                    if to.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown().await;
    }

    impl Proxy {
        pub async fn start(url: &str) -> Proxy {
            Self::start_on(url, "127.0.0.1:0".parse().unwrap()).await
        }

        /// A proxy listening on `addr`.
        pub async fn start_on(url: &str, addr: SocketAddr) -> Proxy {
            let upstream = host_port(url);
            // The previous listener on `addr` may still be closing (its task was aborted).
            let mut tries = 0;
            let listener = loop {
                match TcpListener::bind(addr).await {
                    Ok(l) => break l,
                    Err(e) if tries < 50 => {
                        tries += 1;
                        let _ = e;
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    }
                    Err(e) => panic!("bind {addr}: {e}"),
                }
            };
            let addr = listener.local_addr().unwrap();
            let upstreams = Arc::new(Mutex::new(vec![]));
            let silent = Arc::new(AtomicBool::new(false));
            let tasks: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::new(Mutex::new(vec![]));
            let (ups, sil, ts) = (upstreams.clone(), silent.clone(), tasks.clone());
            let accept = tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        continue;
                    };
                    ups.lock().unwrap().push(server.local_addr().unwrap());
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let a = tokio::spawn(pipe(cr, sw, sil.clone()));
                    let b = tokio::spawn(pipe(sr, cw, sil.clone()));
                    ts.lock().unwrap().extend([a, b]);
                }
            });
            tasks.lock().unwrap().push(accept);
            Proxy {
                addr,
                upstreams,
                silent,
                tasks,
            }
        }

        pub fn url(&self) -> String {
            format!("redis://{}", self.addr)
        }

        /// Stops listening and cuts every connection (the server is gone).
        pub fn shut_down(&self) {
            for t in self.tasks.lock().unwrap().drain(..) {
                t.abort();
            }
        }
    }

    impl Drop for Proxy {
        fn drop(&mut self) {
            self.shut_down();
        }
    }
}

mod fail_closed {
    use super::proxy::Proxy;
    use super::*;
    use polygw_core::ports::Admission;
    use polygw_testkit::limiter_contract::Req;
    use std::sync::atomic::Ordering;

    /// Bound on how long an operation may take against a dead server (operation timeout
    /// 2 s plus scheduling slack on a loaded machine).
    const PROMPT: Duration = Duration::from_millis(3500);

    async fn acquire_fails_promptly(l: &dyn RateLimiter, r: &Req) -> GovernanceError {
        let t = tokio::time::Instant::now();
        let res = l.acquire(&r.get()).await;
        assert!(t.elapsed() < PROMPT, "took {:?}", t.elapsed());
        match res {
            Err(e) => e,
            Ok(Admission::Admitted(p)) => panic!("admitted without the server: {p:?}"),
            Ok(Admission::Refused(f)) => panic!("refused instead of failing: {f:?}"),
        }
    }

    /// A port where nothing listens: connecting fails, and a lazily built backend fails
    /// every operation — never an admission.
    #[tokio::test]
    async fn nothing_listening_is_an_error() {
        // Mandatory under CI like every Redis test, although this one needs no server.
        let Some(_url) = redis_url() else { return };
        let dead = "redis://127.0.0.1:1";
        let t = tokio::time::Instant::now();
        let e = RedisGovernance::connect(dead, RedisOptions::default())
            .await
            .expect_err("nothing listens on port 1");
        assert!(t.elapsed() < PROMPT);
        assert_eq!(e.backend, "redis");

        let g = RedisGovernance::connect_lazy(dead, RedisOptions::default()).unwrap();
        let r = Req::new("DOWN", "a").source_limits(10, 0, 0);
        for _ in 0..3 {
            let e = acquire_fails_promptly(&g.limiter(), &r).await;
            assert_eq!(e.backend, "redis");
        }
        assert!(g.limiter().in_flight("DOWN", "a").await.is_err());
        let b = g.breakers();
        assert!(b.admit("DOWN", "a", Duration::from_secs(1)).await.is_err());
        assert!(b
            .record(
                "DOWN",
                "a",
                polygw_core::breaker::BreakerOutcome::Failure,
                0,
                false,
                &BreakerSettings::default()
            )
            .await
            .is_err());
        assert!(b.state("DOWN", "a").await.is_err());
    }

    /// Built while the server is down (as the facade builds it, lazily): operations fail
    /// closed, then succeed once the server is reachable.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lazy_backend_recovers_when_the_server_comes_up() {
        let Some(url) = redis_url() else { return };
        // A free port where nothing listens yet.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let g = RedisGovernance::connect_lazy(&format!("redis://{addr}"), RedisOptions::default())
            .unwrap();
        let sc = unique_name("LAZY");
        let r = Req::new(&sc, "a").source_limits(10, 0, 0);
        acquire_fails_promptly(&g.limiter(), &r).await;
        let _proxy = Proxy::start_on(&url, addr).await;
        let mut admitted = false;
        for _ in 0..40 {
            match g.limiter().acquire(&r.get()).await {
                Ok(Admission::Admitted(mut p)) => {
                    p.finish(0).await.unwrap();
                    admitted = true;
                    break;
                }
                Ok(Admission::Refused(f)) => panic!("unexpected refusal {f:?}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        assert!(admitted, "the backend reconnects once the server is up");
        assert_eq!(g.limiter().source_window(&sc, "a").await.unwrap(), (1, 0));
    }

    /// The server kills the live connection (CLIENT KILL): the next operations fail or,
    /// once reconnected, succeed — and every admission is one the script recorded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_connection_never_admits_blindly() {
        let Some(url) = redis_url() else { return };
        let proxy = Proxy::start(&url).await;
        let g = RedisGovernance::connect(&proxy.url(), RedisOptions::default())
            .await
            .expect("connect through the proxy");
        let observer = RedisGovernance::connect(&url, RedisOptions::default())
            .await
            .unwrap()
            .limiter();
        let sc = unique_name("KILL");
        let r = Req::new(&sc, "a").source_limits(1000, 0, 0);
        let mut admitted = 0u64;
        let mut errors = 0u64;
        for round in 0..3 {
            lc::admit(&g.limiter(), &r).await.finish(0).await.unwrap();
            admitted += 1;
            let victim = *proxy.upstreams.lock().unwrap().last().unwrap();
            let client = redis::Client::open(url.as_str()).unwrap();
            let mut killer = client.get_multiplexed_async_connection().await.unwrap();
            let killed: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ADDR")
                .arg(victim.to_string())
                .arg("SKIPME")
                .arg("yes")
                .query_async(&mut killer)
                .await
                .unwrap_or_else(|e| panic!("round {round}: CLIENT KILL ADDR {victim}: {e}"));
            assert_eq!(killed, 1, "killed the governance connection");
            // Until it has reconnected, operations fail; none admits without the script.
            let mut recovered = false;
            for _ in 0..20 {
                match g.limiter().acquire(&r.get()).await {
                    Ok(Admission::Admitted(mut p)) => {
                        admitted += 1;
                        p.finish(0).await.unwrap();
                        recovered = true;
                        break;
                    }
                    Ok(Admission::Refused(f)) => panic!("unexpected refusal {f:?}"),
                    Err(e) => {
                        assert_eq!(e.backend, "redis");
                        errors += 1;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            assert!(recovered, "reconnects after the kill");
            assert_eq!(
                observer.source_window(&sc, "a").await.unwrap().0,
                admitted,
                "every admission was recorded by the script"
            );
        }
        eprintln!("killed 3 connections: {errors} operations failed closed, {admitted} admitted");
    }

    /// A server that stops answering: operations fail within the operation timeout.
    /// Permits dropped meanwhile (hedge losers, cancelled calls) and acquires that timed
    /// out queue their releases, which are retried with backoff — never discarded — and
    /// land once the server answers again: nothing stays held (SPEC §14.5; the queue used
    /// to give the first up after three tries and discard the rest for 2 s).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn silent_server_times_out_and_queued_releases_land_later() {
        let Some(url) = redis_url() else { return };
        let proxy = Proxy::start(&url).await;
        let opts = RedisOptions {
            flush_timeout: Duration::from_secs(1),
            max_backoff: Duration::from_millis(300),
            ..RedisOptions::default()
        };
        let g = RedisGovernance::connect(&proxy.url(), opts).await.unwrap();
        let observer = RedisGovernance::connect(&url, RedisOptions::default())
            .await
            .unwrap()
            .limiter();
        let sc = unique_name("SILENT");
        let r = Req::new(&sc, "a").source_limits(0, 0, 0).est(10);
        lc::admit(&g.limiter(), &r).await.finish(0).await.unwrap();
        let mut held = vec![];
        for _ in 0..10 {
            held.push(lc::admit(&g.limiter(), &r).await);
        }
        proxy.silent.store(true, Ordering::SeqCst);
        for _ in 0..2 {
            acquire_fails_promptly(&g.limiter(), &r).await;
        }
        let t = tokio::time::Instant::now();
        assert!(g
            .breakers()
            .admit(&sc, "a", Duration::from_secs(1))
            .await
            .is_err());
        assert!(t.elapsed() < PROMPT);
        drop(held);
        let e = g
            .limiter()
            .flush()
            .await
            .expect_err("the settlements cannot land yet");
        assert!(e.message.contains("not applied within"), "{e}");
        assert_eq!(observer.in_flight(&sc, "a").await.unwrap(), 10);
        // The server comes back at the same address (the silent connection is cut; the
        // connection manager reconnects).
        let addr = proxy.addr;
        proxy.shut_down();
        drop(proxy);
        let _back = Proxy::start_on(&url, addr).await;
        let mut flushed = false;
        for _ in 0..20 {
            if g.limiter().flush().await.is_ok() {
                flushed = true;
                break;
            }
        }
        assert!(flushed, "the queue drains once the server is back");
        assert_eq!(
            observer.in_flight(&sc, "a").await.unwrap(),
            0,
            "every queued release landed"
        );
        // dropped unsettled: each settled its reservation (10 each); the timed-out
        // acquires (if their scripts ran) settled 0
        assert_eq!(observer.source_window(&sc, "a").await.unwrap().1 % 10, 0);
        assert_eq!(g.limiter().settlements_dropped(), 0);
    }

    /// The queue is bounded: what does not fit is counted (and logged), never silent;
    /// what fits lands.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queue_overflow_is_counted() {
        let Some(url) = redis_url() else { return };
        let proxy = Proxy::start(&url).await;
        let opts = RedisOptions {
            queue_capacity: 4,
            flush_timeout: Duration::from_millis(500),
            max_backoff: Duration::from_millis(200),
            ..RedisOptions::default()
        };
        let g = RedisGovernance::connect(&proxy.url(), opts).await.unwrap();
        let sc = unique_name("OVERFLOW");
        let r = Req::new(&sc, "a").est(1);
        let mut held = vec![];
        for _ in 0..10 {
            held.push(lc::admit(&g.limiter(), &r).await);
        }
        proxy.silent.store(true, Ordering::SeqCst);
        drop(held);
        let l = g.limiter();
        // The task holds one job while retrying it; four more wait in the queue.
        let dropped = l.settlements_dropped();
        assert!((5..=6).contains(&dropped), "dropped {dropped}");
        let e = l.flush().await.expect_err("not drained, and some dropped");
        assert!(
            e.message.contains("dropped because the queue was full"),
            "{e}"
        );
        let addr = proxy.addr;
        proxy.shut_down();
        drop(proxy);
        let _back = Proxy::start_on(&url, addr).await;
        let mut ok = false;
        for _ in 0..20 {
            if l.flush().await.is_ok() {
                ok = true;
                break;
            }
        }
        assert!(ok);
        assert_eq!(l.settlements_dropped(), dropped, "counted once, kept");
        // The dropped ones end with their leases (not renewed any more).
        let in_flight = l.in_flight(&sc, "a").await.unwrap() as u64;
        assert_eq!(in_flight, dropped);
    }

    /// The server goes away while connected: operations fail promptly.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn server_gone_fails_closed() {
        let Some(url) = redis_url() else { return };
        let proxy = Proxy::start(&url).await;
        let g = RedisGovernance::connect(&proxy.url(), RedisOptions::default())
            .await
            .unwrap();
        let sc = unique_name("GONE");
        let r = Req::new(&sc, "a").source_limits(5, 0, 1);
        let held = lc::admit(&g.limiter(), &r).await;
        proxy.shut_down();
        for _ in 0..3 {
            acquire_fails_promptly(&g.limiter(), &r).await;
        }
        // A permit dropped meanwhile cannot settle yet; flush says so within its bound
        // (the release stays queued and is retried).
        drop(held);
        let t = tokio::time::Instant::now();
        assert!(g.limiter().flush().await.is_err());
        assert!(
            t.elapsed() < RedisOptions::default().flush_timeout + PROMPT,
            "bounded wait: {:?}",
            t.elapsed()
        );
    }
}

mod redis_specific {
    use super::*;
    use polygw_core::breaker::BreakerOutcome;
    use polygw_core::ports::Admission;
    use polygw_testkit::limiter_contract::Req;

    async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
        redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// Every key the backend writes is namespaced under the scope's hash tag and has a TTL
    /// no longer than what it must remember (plus the margin, twice for the limiter's).
    #[tokio::test]
    async fn keys_are_namespaced_with_ttls() {
        let Some(url) = redis_url() else { return };
        let h = harness(&url).await;
        let sc = unique_name("TTL");
        let l = h.gov.limiter();
        let r = Req::new(&sc, "a")
            .source_limits(10, 1000, 2)
            .scope_limits(10, 1000)
            .est(10)
            .lease(Duration::from_secs(30));
        let mut p = lc::admit(&l, &r).await;
        p.settle(5).await.unwrap();
        let _held = lc::admit(&l, &r).await;
        let b = h.gov.breakers();
        let s = BreakerSettings::default();
        b.record(&sc, "a", BreakerOutcome::Failure, 0, false, &s)
            .await
            .unwrap();
        b.record(&sc, "b", BreakerOutcome::Dead, 0, false, &s)
            .await
            .unwrap();

        let mut con = raw(&url).await;
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("polygw:{{{sc}}}:*"))
            .query_async(&mut con)
            .await
            .unwrap();
        keys.sort();
        let pre = format!("polygw:{{{sc}}}");
        let want: Vec<String> = [
            "scope:ledger",
            "scope:totals",
            "scope:win",
            "source:a:breaker",
            "source:a:inflight",
            "source:a:win",
            "source:b:breaker",
        ]
        .iter()
        .map(|k| format!("{pre}:{k}"))
        .collect();
        assert_eq!(keys, want);
        let day = 24 * 3600 * 1000;
        for k in &keys {
            let ttl: i64 = redis::cmd("PTTL")
                .arg(k)
                .query_async(&mut con)
                .await
                .unwrap();
            // The limiter's keys share their scope's (or source's) deadline: the longest
            // lease + the window + the margin, moved a margin further when it falls
            // short (see lua/acquire.lua).
            let max = if k.ends_with(":breaker") {
                day + 300_000
            } else {
                30_000 + 60_000 + 2 * 10_000
            };
            assert!(ttl > 0 && ttl <= max, "{k}: ttl {ttl} ms (max {max})");
        }
        // a breaker back to its initial state leaves no key
        b.record(&sc, "a", BreakerOutcome::Success, 0, false, &s)
            .await
            .unwrap();
        let n: i64 = redis::cmd("EXISTS")
            .arg(format!("{pre}:source:a:breaker"))
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(n, 0);
        p.finish(5).await.unwrap();
    }

    /// A client key's keys (SPEC §21.1) are namespaced under the key id's own hash tag and
    /// expire: the window keys a lease + the window + two margins on; the state and
    /// in-flight keys (the day's and the month's spend) at the month's end + the margin at
    /// the latest, never before it. Finished and emptied, the in-flight set is gone, and
    /// written again it gets its deadline back.
    #[tokio::test]
    async fn client_key_keys_are_namespaced_with_ttls() {
        use polygw_core::client_key::BudgetPeriod;
        use polygw_core::key_quota::period_end_ms;
        use polygw_testkit::limiter_contract::keys::{admit_key, KeyReq};
        let Some(url) = redis_url() else { return };
        let h = harness(&url).await;
        let l = h.gov.limiter();
        let r = KeyReq {
            rpm: 10,
            tpm: 1000,
            conc: 3,
            day: Some(1_000_000),
            month: Some(5_000_000),
            est: 10,
            nanos: 1_000,
            lease: Duration::from_secs(30),
            ..KeyReq::new()
        };
        admit_key(&l, &r).await.finish(5, 500).await.unwrap();
        let mut held = admit_key(&l, &r).await;
        let now = l.key_usage(&r.key).await.unwrap().now_unix_ms;
        let mut con = raw(&url).await;
        let pre = format!("polygw:key:{{{}}}", r.key);
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{pre}:*"))
            .query_async(&mut con)
            .await
            .unwrap();
        keys.sort();
        let want: Vec<String> = ["inflight", "ledger", "state", "win"]
            .iter()
            .map(|k| format!("{pre}:{k}"))
            .collect();
        assert_eq!(keys, want);
        let month_left = period_end_ms(BudgetPeriod::Month, now + 30_000) - now;
        let probe = con.clone();
        let pttl = |k: String| {
            let mut con = probe.clone();
            async move {
                let t: i64 = redis::cmd("PTTL")
                    .arg(&k)
                    .query_async(&mut con)
                    .await
                    .unwrap();
                t
            }
        };
        for k in ["win", "ledger"] {
            let ttl = pttl(format!("{pre}:{k}")).await;
            assert!(
                ttl > 0 && ttl <= 30_000 + 60_000 + 2 * 10_000,
                "{k}: ttl {ttl}"
            );
        }
        for k in ["inflight", "state"] {
            let ttl = pttl(format!("{pre}:{k}")).await as u64;
            let max = month_left.max(30_000 + 60_000) + 2 * 10_000;
            assert!(
                ttl + 1_000 >= month_left && ttl <= max,
                "{k}: ttl {ttl}, month ends in {month_left}"
            );
        }
        held.finish(5, 500).await.unwrap();
        let n: i64 = redis::cmd("EXISTS")
            .arg(format!("{pre}:inflight"))
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(n, 0, "an empty in-flight set is gone");
        let _again = admit_key(&l, &r).await;
        assert!(pttl(format!("{pre}:inflight")).await > 0);
        assert_eq!(l.key_usage(&r.key).await.unwrap().month_nanos, 2_000);
    }

    /// A key that emptied (Redis deletes it) and is written again gets its group's deadline
    /// back, although the ledger's bookkeeping says the deadline is set: no key is ever
    /// left without a TTL.
    #[tokio::test]
    async fn keys_written_again_after_emptying_get_a_ttl() {
        let Some(url) = redis_url() else { return };
        let h = harness(&url).await;
        let sc = unique_name("RETTL");
        let l = h.gov.limiter();
        let r = Req::new(&sc, "a")
            .source_limits(10, 1000, 2)
            .scope_limits(10, 1000)
            .est(10)
            .lease(Duration::from_secs(30));
        lc::admit(&l, &r).await.finish(5).await.unwrap();
        let mut con = raw(&url).await;
        let inflight = format!("polygw:{{{sc}}}:source:a:inflight");
        let n: i64 = redis::cmd("EXISTS")
            .arg(&inflight)
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(n, 0, "the released slot emptied the set");
        let mut p = lc::admit(&l, &r).await;
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&inflight)
            .query_async(&mut con)
            .await
            .unwrap();
        assert!(ttl > 0 && ttl <= 110_000, "{inflight}: ttl {ttl}");
        p.finish(5).await.unwrap();
    }

    /// After SCRIPT FLUSH the scripts are loaded again transparently (NOSCRIPT fallback).
    #[tokio::test]
    async fn noscript_falls_back() {
        let Some(url) = redis_url() else { return };
        let h = harness(&url).await;
        let sc = unique_name("NOSCRIPT");
        let r = Req::new(&sc, "a").source_limits(2, 0, 0);
        let l = h.gov.limiter();
        lc::admit(&l, &r).await.finish(0).await.unwrap();
        let mut con = raw(&url).await;
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut con)
            .await
            .unwrap();
        let mut p = lc::admit(&l, &r).await;
        p.finish(0).await.unwrap();
        assert_eq!(lc::refuse(&l, &r).await.reason.as_str(), "rpm");
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(
            h.gov
                .breakers()
                .admit(&sc, "a", Duration::from_secs(1))
                .await
                .unwrap(),
            polygw_core::breaker::BreakerAdmit::Allowed {
                probe: false,
                epoch: 0
            }
        );
    }

    /// Permits dropped from many tasks, and from a thread with no runtime, are settled by
    /// the background queue; shutdown waits for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn drop_queue_is_flushed_on_shutdown() {
        let Some(url) = redis_url() else { return };
        let h = harness(&url).await;
        let sc = unique_name("QUEUE");
        let l = h.gov.limiter();
        let r = Req::new(&sc, "a").source_limits(0, 0, 100).est(3);
        let mut tasks = vec![];
        for _ in 0..40 {
            let (l, r) = (l.clone(), r.clone());
            tasks.push(tokio::spawn(async move {
                let p = lc::admit(&l, &r).await;
                drop(p);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let p = lc::admit(&l, &r).await;
        std::thread::spawn(move || drop(p)).join().unwrap();
        h.gov.shutdown().await.unwrap();
        assert_eq!(l.in_flight(&sc, "a").await.unwrap(), 0);
        assert_eq!(l.source_window(&sc, "a").await.unwrap(), (41, 123));
    }

    /// SPEC §14.7: a half-open probe is freed when the caller drops the admission while
    /// its script is in flight (the script granted the probe, nobody read the answer).
    /// The store queues a release by the admission's token; it used to stay out until its
    /// lease ended (up to 630 s), the source refused as `circuit_open` meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_admission_dropped_in_flight_is_released() {
        let Some(url) = redis_url() else { return };
        let g = RedisGovernance::connect(&url, RedisOptions::default())
            .await
            .unwrap();
        let b = g.breakers();
        let sc = unique_name("PROBEDROP");
        let s = BreakerSettings {
            failures: 1,
            open: Duration::from_millis(200),
            dead: Duration::from_secs(1),
            ..BreakerSettings::default()
        };
        b.record(&sc, "a", BreakerOutcome::Failure, 0, false, &s)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut granted_and_dropped = false;
        for _ in 0..50 {
            let before = b.state(&sc, "a").await.unwrap().epoch;
            // Polled once (the script is handed to the connection), then dropped.
            let dropped =
                tokio::time::timeout(Duration::ZERO, b.admit(&sc, "a", Duration::from_secs(600)))
                    .await;
            if let Ok(done) = dropped {
                // Answered within one poll: give it back and try again.
                if let Ok(polygw_core::breaker::BreakerAdmit::Allowed { epoch, .. }) = done {
                    b.release_probe(&sc, "a", epoch);
                }
                b.flush().await.unwrap();
                continue;
            }
            b.flush().await.unwrap();
            let st = b.state(&sc, "a").await.unwrap();
            if st.epoch > before {
                granted_and_dropped = true;
                assert_eq!(st.probe_until, 0, "the dropped admission's probe is free");
                break;
            }
        }
        assert!(
            granted_and_dropped,
            "no admission was dropped after its script ran in 50 tries"
        );
        assert!(matches!(
            b.admit(&sc, "a", Duration::from_secs(1)).await.unwrap(),
            polygw_core::breaker::BreakerAdmit::Allowed { probe: true, .. }
        ));
    }

    /// A key's window keys expire long before its state (which keeps the month's spend):
    /// once they are gone, the state's token total reads 0 — not what the expired entries
    /// held — while the spend stays.
    #[tokio::test]
    async fn a_keys_window_keys_expire_before_its_spend() {
        use polygw_testkit::limiter_contract::keys::{admit_key, KeyReq};
        let Some(url) = redis_url() else { return };
        let opts = RedisOptions {
            window: Duration::from_millis(300),
            key_margin: Duration::from_millis(100),
            ..RedisOptions::default()
        };
        let g = RedisGovernance::connect(&url, opts).await.unwrap();
        let l = g.limiter();
        let r = KeyReq {
            tpm: 100,
            est: 60,
            nanos: 500,
            lease: Duration::from_millis(200),
            ..KeyReq::new()
        };
        admit_key(&l, &r).await.finish(60, 400).await.unwrap();
        let pre = format!("polygw:key:{{{}}}", r.key);
        let mut con = raw(&url).await;
        // The window keys' deadline: lease + window + margin (+ a margin of hysteresis).
        tokio::time::sleep(Duration::from_millis(200 + 300 + 2 * 100 + 300)).await;
        let n: i64 = redis::cmd("EXISTS")
            .arg(format!("{pre}:ledger"))
            .arg(format!("{pre}:win"))
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(n, 0, "the window keys expired");
        let u = l.key_usage(&r.key).await.unwrap();
        assert_eq!((u.tokens, u.requests, u.month_nanos), (0, 0, 400));
        admit_key(&l, &r).await.finish(60, 0).await.unwrap();
        assert_eq!(l.key_usage(&r.key).await.unwrap().tokens, 60);
    }

    /// A key admission dropped while its script is in flight (the script admitted it,
    /// nobody read the answer) is finished at 0 tokens and 0 cost through the queue: its
    /// slot and its reservations do not stay out until its lease ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_admission_dropped_in_flight_is_finished() {
        use polygw_testkit::limiter_contract::keys::KeyReq;
        let Some(url) = redis_url() else { return };
        let g = RedisGovernance::connect(&url, RedisOptions::default())
            .await
            .unwrap();
        let l = g.limiter();
        let r = KeyReq {
            conc: 1,
            day: Some(10_000),
            nanos: 4_000,
            est: 50,
            ..KeyReq::new()
        };
        let mut admitted_and_dropped = false;
        for _ in 0..50 {
            let before = l.key_usage(&r.key).await.unwrap().requests;
            let dropped = tokio::time::timeout(Duration::ZERO, l.acquire_key(&r.get())).await;
            if let Ok(done) = dropped {
                if let Ok(polygw_core::ports::KeyAdmission::Admitted(mut p)) = done {
                    p.finish(0, 0).await.unwrap();
                }
                continue;
            }
            l.flush().await.unwrap();
            let u = l.key_usage(&r.key).await.unwrap();
            if u.requests > before {
                admitted_and_dropped = true;
                assert_eq!(
                    (u.in_flight, u.reserved_nanos, u.day_nanos, u.tokens),
                    (0, 0, 0, 0),
                    "the dropped admission is finished at 0"
                );
                break;
            }
        }
        assert!(
            admitted_and_dropped,
            "no admission was dropped after its script ran in 50 tries"
        );
    }

    /// Nothing listening: a key admission and a key reading are errors (fail closed),
    /// never an admission.
    #[tokio::test]
    async fn key_admission_fails_closed() {
        use polygw_testkit::limiter_contract::keys::KeyReq;
        let g = RedisGovernance::connect_lazy(
            "redis://127.0.0.1:1",
            RedisOptions {
                operation_timeout: Duration::from_millis(500),
                ..RedisOptions::default()
            },
        )
        .unwrap();
        let r = KeyReq::new();
        let e = g.limiter().acquire_key(&r.get()).await.unwrap_err();
        assert_eq!(e.backend, "redis");
        assert!(g.limiter().key_usage(&r.key).await.is_err());
    }

    /// Scope names that would break the cluster hash tag are refused (an error, never an
    /// admission).
    #[tokio::test]
    async fn braces_in_scope_are_rejected() {
        let Some(url) = redis_url() else { return };
        let h = harness(&url).await;
        let r = Req::new("A}B", "a");
        assert!(matches!(
            h.gov.limiter().acquire(&r.get()).await,
            Err(GovernanceError { .. })
        ));
        assert!(h
            .gov
            .breakers()
            .admit("{X", "a", Duration::from_secs(1))
            .await
            .is_err());
    }

    /// Admissions are refused with the server's hint even when process clocks disagree:
    /// two clients with different local clocks see one window (time is `TIME`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn independent_clients_share_one_window() {
        let Some(url) = redis_url() else { return };
        let h = harness(&url).await;
        let clients = LimiterHarness::clients(&h, 3).await;
        let sc = unique_name("SHARED");
        let r = Req::new(&sc, "a").source_limits(3, 0, 0);
        for c in &clients {
            match c.acquire(&r.get()).await.unwrap() {
                Admission::Admitted(mut p) => p.finish(0).await.unwrap(),
                Admission::Refused(f) => panic!("{f:?}"),
            }
        }
        for c in &clients {
            let f = lc::refuse(c.as_ref(), &r).await;
            let hint = f.retry_after.unwrap();
            assert!(hint <= Duration::from_secs(60) && hint > Duration::from_secs(55));
        }
    }
}

/// Redis Cluster specifics (SPEC §14.10): a scope's keys live on one node; a
/// single-server URL pointed at a cluster node fails closed for scopes it does not own;
/// errors name the URL with its password redacted.
mod cluster {
    use super::*;
    use polygw_core::ports::Admission;
    use polygw_testkit::limiter_contract::Req;

    fn nodes(url: &str) -> Vec<String> {
        polygw_core::config::guards::redis_nodes(url)
            .expect("a cluster url")
            .0
    }

    async fn raw(node: &str) -> redis::aio::MultiplexedConnection {
        redis::Client::open(node)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// Every key of a scope is on the one node that owns its hash tag's slot, whichever
    /// node that is; scopes spread over the nodes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_scope_lives_on_one_node_and_scopes_spread() {
        let Some(url) = redis_cluster_url() else {
            return;
        };
        let g = RedisGovernance::connect(&url, RedisOptions::default())
            .await
            .unwrap();
        let nodes = nodes(&url);
        let mut owners = std::collections::BTreeSet::new();
        for _ in 0..12 {
            let sc = unique_name("SLOT");
            let r = Req::new(&sc, "a")
                .source_limits(10, 1000, 2)
                .scope_limits(10, 1000)
                .est(10);
            let mut p = lc::admit(&g.limiter(), &r).await;
            p.finish(5).await.unwrap();
            let _held = lc::admit(&g.limiter(), &r).await;
            g.breakers()
                .record(
                    &sc,
                    "a",
                    polygw_core::breaker::BreakerOutcome::Failure,
                    0,
                    false,
                    &BreakerSettings::default(),
                )
                .await
                .unwrap();
            let mut holders = vec![];
            for n in &nodes {
                let mut con = raw(n).await;
                let keys: Vec<String> = redis::cmd("KEYS")
                    .arg(format!("polygw:{{{sc}}}:*"))
                    .query_async(&mut con)
                    .await
                    .unwrap();
                if !keys.is_empty() {
                    holders.push((n.clone(), keys.len()));
                }
            }
            assert_eq!(holders.len(), 1, "{sc}: keys on {holders:?}");
            // scope: win, ledger, totals; source a: win, inflight, breaker
            assert!(holders[0].1 >= 6, "{holders:?}");
            owners.insert(holders[0].0.clone());
        }
        assert!(owners.len() >= 2, "12 scopes all on {owners:?}");
    }

    /// A plain `redis://` URL to one cluster node cannot follow the slot map: for a
    /// scope another node owns the server answers MOVED, and that is a governance error
    /// (fail closed), never an admission. `redis+cluster://` reaches it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_single_node_url_fails_closed_on_moved() {
        let Some(url) = redis_cluster_url() else {
            return;
        };
        let first = nodes(&url)[0].clone();
        let single = RedisGovernance::connect(&first, RedisOptions::default())
            .await
            .unwrap();
        let cluster = RedisGovernance::connect(&url, RedisOptions::default())
            .await
            .unwrap();
        let mut moved = 0;
        for _ in 0..12 {
            let sc = unique_name("MOVED");
            let r = Req::new(&sc, "a").source_limits(5, 0, 0);
            match single.limiter().acquire(&r.get()).await {
                Err(e) => {
                    assert!(e.message.to_lowercase().contains("moved"), "{e}");
                    assert!(e.message.contains(&first), "names the URL: {e}");
                    moved += 1;
                }
                Ok(Admission::Admitted(mut p)) => p.finish(0).await.unwrap(),
                Ok(Admission::Refused(f)) => panic!("{f:?}"),
            }
            lc::admit(&cluster.limiter(), &r)
                .await
                .finish(0)
                .await
                .unwrap();
        }
        assert!(moved > 0, "no scope of 12 hashed to another node");
    }

    /// Errors name the target with its password redacted, never the password.
    #[tokio::test]
    async fn errors_name_the_url_without_its_password() {
        let Some(_url) = redis_cluster_url() else {
            return;
        };
        for url in [
            "redis+cluster://user:hunter2@127.0.0.1:1,127.0.0.1:2",
            "redis://:hunter2@127.0.0.1:1",
            "rediss://:hunter2@127.0.0.1:1/0",
        ] {
            let e = RedisGovernance::connect(url, RedisOptions::default())
                .await
                .expect_err("nothing listens there");
            assert!(!e.message.contains("hunter2"), "{e}");
            assert!(e.message.contains("127.0.0.1:1"), "{e}");
            let lazy = RedisGovernance::connect_lazy(url, RedisOptions::default()).unwrap();
            let r = Req::new("DOWN", "a");
            let e = lazy.limiter().acquire(&r.get()).await.unwrap_err();
            assert!(!e.message.contains("hunter2"), "{e}");
        }
        let e = RedisGovernance::connect("redis+cluster://:hunter2@h1,h2", RedisOptions::default())
            .await
            .unwrap_err();
        assert!(
            !e.message.contains("hunter2") && e.message.contains("invalid url"),
            "{e}"
        );
    }
}

/// TLS (`rediss://`, SPEC §14.10): an own redis-server with a TLS port and a certificate
/// this test generates (with the `openssl` program), trusted through
/// `RedisOptions::ca_file` (`{S}__TLS__CA_FILE`). Skipped, saying why, when `openssl` or a
/// TLS-capable redis-server is missing (a failure under `CI=true`).
mod tls {
    use super::*;
    use polygw_testkit::services::{in_ci, RedisServer};
    use std::path::{Path, PathBuf};
    use std::process::Command;

    fn skip(why: String) -> Option<(RedisServer, PathBuf)> {
        if in_ci() {
            panic!("the TLS test cannot run under CI=true: {why}");
        }
        eprintln!("skipping the TLS test: {why}");
        None
    }

    fn openssl(dir: &Path, args: &[&str]) -> Result<(), String> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .map_err(|e| format!("cannot run openssl: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// A CA and a server certificate for 127.0.0.1 / localhost signed by it.
    fn certificates(dir: &Path) -> Result<(), String> {
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-days",
                "2",
                "-subj",
                "/CN=polygw test CA",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        )?;
        openssl(
            dir,
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        )?;
        std::fs::write(
            dir.join("ext.cnf"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
        )
        .map_err(|e| e.to_string())?;
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "server.crt",
                "-days",
                "2",
                "-extfile",
                "ext.cnf",
            ],
        )
    }

    fn tls_server() -> Option<(RedisServer, PathBuf)> {
        let dir = std::env::temp_dir().join(unique_name("polygw-tls"));
        if let Err(e) = std::fs::create_dir_all(&dir) {
            return skip(format!("cannot create {}: {e}", dir.display()));
        }
        if let Err(e) = certificates(&dir) {
            return skip(format!("cannot generate a certificate: {e}"));
        }
        let d = dir.clone();
        let server = RedisServer::start_with(move |port| {
            let f = |n: &str| d.join(n).display().to_string();
            vec![
                "--port".into(),
                "0".into(),
                "--tls-port".into(),
                port.to_string(),
                "--tls-cert-file".into(),
                f("server.crt"),
                "--tls-key-file".into(),
                f("server.key"),
                "--tls-ca-cert-file".into(),
                f("ca.crt"),
                "--tls-auth-clients".into(),
                "no".into(),
            ]
        });
        match server {
            Ok(s) => Some((s, dir.join("ca.crt"))),
            Err(e) => skip(format!("redis-server cannot serve TLS here: {e}")),
        }
    }

    /// The limiter and breaker contracts pass over TLS with the generated CA trusted; the
    /// same server without that CA is refused (certificate verification, fail closed).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn contract_cases_over_tls_with_a_private_ca() {
        let Some(_shared) = redis_url() else { return };
        let Some((server, ca)) = tls_server() else {
            return;
        };
        let url = format!("rediss://127.0.0.1:{}", server.port());
        let opts = RedisOptions {
            ca_file: Some(ca.clone()),
            ..RedisOptions::default()
        };
        let h = harness_with(&url, opts).await;
        lc::rpm_never_over_admitted(&h).await;
        lc::concurrency_cap_and_release(&h).await;
        lc::leases_renewed_while_held_and_end_after_a_crash(&h).await;
        lc::keys::key_budget_reserve_then_settle(&h).await;
        bc::opens_after_consecutive_failures(&h).await;
        bc::release_probe_frees_it(&h).await;

        let e = RedisGovernance::connect(&url, RedisOptions::default())
            .await
            .expect_err("the system roots do not trust the test CA");
        assert!(e.message.contains(&url), "{e}");
        let missing = RedisOptions {
            ca_file: Some(ca.with_file_name("missing.crt")),
            ..RedisOptions::default()
        };
        let e = RedisGovernance::connect(&url, missing).await.unwrap_err();
        assert!(e.message.contains("missing.crt"), "{e}");
        let _ = std::fs::remove_dir_all(ca.parent().unwrap());
    }
}

/// The key scripts across a day's, a month's and a year's end (SPEC §24.1, §24.2): the
/// real `key_*.lua` scripts, their clock moved from the server's `TIME` to two trailing
/// arguments (the only edit), replay random admissions and settlements of 16 calls in
/// flight across each boundary against core's `KeyQuotas` at the same instants; every
/// answer and every usage figure must agree, and each day's settled spend stays within
/// its budget.
mod periods {
    use polygw_core::client_key::BudgetPeriod;
    use polygw_core::error::RefusalReason;
    use polygw_core::key_quota::{
        format_utc, period_end_ms, period_id, period_start_ms, KeyQuotas,
    };
    use polygw_core::ports::KeyAcquire;
    use polygw_testkit::services::{redis_url, unique_name};
    use redis::aio::MultiplexedConnection;
    use redis::Script;
    use std::time::Duration;

    const LIB: &str = include_str!("../src/lua/key_lib.lua");
    const TIME: &str = "local t = redis.call('TIME')";
    const WINDOW_MS: u64 = 60_000;
    const MARGIN_MS: u64 = 3_600_000;
    const LEASE_MS: u64 = 600_000;

    /// A key script whose `now` is its last two arguments (seconds, microseconds).
    fn timed(body: &str) -> Script {
        assert!(LIB.contains(TIME), "key_lib.lua reads the server's TIME");
        let lib = LIB.replace(TIME, "local t = {ARGV[#ARGV - 1], ARGV[#ARGV]}");
        Script::new(&format!("{lib}{body}"))
    }

    struct Key {
        con: MultiplexedConnection,
        keys: Vec<String>,
        acquire: Script,
        finish: Script,
        usage: Script,
    }

    impl Key {
        fn invoke<'a>(&self, s: &'a Script, at: u64) -> (redis::ScriptInvocation<'a>, u64) {
            let mut inv = s.prepare_invoke();
            for k in &self.keys {
                inv.key(k);
            }
            (inv, at)
        }

        async fn run<T: redis::FromRedisValue>(
            &self,
            inv: (redis::ScriptInvocation<'_>, u64),
        ) -> T {
            let (mut inv, at) = inv;
            inv.arg(at / 1000).arg((at % 1000) * 1000);
            inv.invoke_async(&mut self.con.clone())
                .await
                .expect("script")
        }

        async fn acquire(&self, at: u64, id: &str, day: u64, nanos: u64) -> Vec<i64> {
            let mut inv = self.invoke(&self.acquire, at);
            inv.0
                .arg(id)
                .arg(0)
                .arg(0)
                .arg(0)
                .arg(day)
                .arg("")
                .arg(0)
                .arg(nanos)
                .arg(LEASE_MS)
                .arg(WINDOW_MS)
                .arg(MARGIN_MS)
                .arg("0");
            self.run(inv).await
        }

        async fn finish(&self, at: u64, id: &str, cost: u64, nanos: u64) {
            let mut inv = self.invoke(&self.finish, at);
            inv.0
                .arg(id)
                .arg(0)
                .arg(cost)
                .arg(0)
                .arg(nanos)
                .arg(WINDOW_MS)
                .arg(MARGIN_MS);
            self.run::<redis::Value>(inv).await;
        }

        async fn usage(&self, at: u64) -> Vec<i64> {
            let mut inv = self.invoke(&self.usage, at);
            inv.0.arg(WINDOW_MS);
            self.run(inv).await
        }
    }

    fn req<'a>(key: &'a str, day: u64, nanos: u64) -> KeyAcquire<'a> {
        KeyAcquire {
            key_id: key,
            rpm: 0,
            tpm: 0,
            max_concurrency: 0,
            budget_day_nanos: Some(day),
            budget_month_nanos: None,
            est_tokens: 0,
            reserve_nanos: nanos,
            lease: Duration::from_millis(LEASE_MS),
            top_up: false,
        }
    }

    /// One boundary: 20 s of calls on each side of `boundary` (Unix ms).
    async fn across(url: &str, boundary: u64, seed: u64) {
        let con = redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let name = unique_name("MIDNIGHT");
        let p = format!("polygw:key:{{{name}}}");
        let key = Key {
            con,
            keys: ["win", "inflight", "ledger", "state"]
                .iter()
                .map(|s| format!("{p}:{s}"))
                .collect(),
            acquire: timed(include_str!("../src/lua/key_acquire.lua")),
            finish: timed(include_str!("../src/lua/key_finish.lua")),
            usage: timed(include_str!("../src/lua/key_usage.lua")),
        };
        let mut model = KeyQuotas::new();
        let mut rng = fastrand::Rng::with_seed(seed);
        let budget = 1_000_000u64;
        // (model permit id, redis permit id, reserved nanos)
        let mut flying: Vec<(u64, String, u64)> = Vec::new();
        let mut settled_by_day = std::collections::BTreeMap::<u64, u64>::new();
        let mut at = boundary - 20_000;
        let mut n = 0;
        while at < boundary + 20_000 {
            at += rng.u64(1..400);
            if flying.len() < 16 && rng.bool() {
                let nanos = rng.u64(10_000..80_000);
                n += 1;
                let id = format!("p{n}");
                let got = key.acquire(at, &id, budget, nanos).await;
                let want = model.acquire(at, &req(&name, budget, nanos));
                match (&got[..], want) {
                    ([1, now], Ok(mid)) => {
                        assert_eq!(*now as u64, at);
                        flying.push((mid, id, nanos));
                    }
                    ([0, 4, hint], Err(r)) => {
                        assert_eq!(r.reason, RefusalReason::KeyBudgetDay, "at {at}");
                        let want = r.retry_after.map_or(-1, |d| d.as_millis() as i64);
                        assert_eq!(*hint, want, "hint at {at}");
                    }
                    (got, want) => panic!("at {at}: redis {got:?}, model {want:?}"),
                }
            } else if !flying.is_empty() {
                let (mid, id, nanos) = flying.swap_remove(rng.usize(..flying.len()));
                // Billed at most what was reserved, sometimes nothing.
                let cost = if rng.u8(..10) == 0 {
                    0
                } else {
                    rng.u64(0..=nanos)
                };
                key.finish(at, &id, cost, nanos).await;
                model.finish(at, mid, 0, cost);
                *settled_by_day.entry(at / 86_400_000).or_default() += cost;
            }
            let got = key.usage(at).await;
            let want = model.usage(at, &name);
            assert_eq!(
                got,
                vec![
                    at as i64,
                    i64::from(want.in_flight),
                    want.requests as i64,
                    want.tokens as i64,
                    want.reserved_nanos as i64,
                    want.day_nanos as i64,
                    want.month_nanos as i64
                ],
                "usage at {at} (boundary {boundary})"
            );
        }
        for (day, s) in &settled_by_day {
            assert!(*s <= budget, "day {day} settled {s} of {budget}");
        }
        assert!(
            settled_by_day.len() == 2,
            "settlements on both sides: {settled_by_day:?}"
        );
    }

    /// The wall clock, Unix ms. Redis expires the keys at the simulated times
    /// (`PEXPIREAT`) by its own clock: the times the test plays must lie ahead of it,
    /// or the keys vanish as they are written.
    #[allow(
        clippy::disallowed_methods,
        reason = "Redis expires keys by the wall clock"
    )]
    fn wall_ms() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }

    /// The first month end after `from` for which `pick(start, end)` holds.
    fn month_end(from: u64, pick: impl Fn(u64, u64) -> bool) -> u64 {
        let mut end = period_end_ms(BudgetPeriod::Month, from);
        for _ in 0..120 {
            let start =
                period_start_ms(BudgetPeriod::Month, period_id(BudgetPeriod::Month, end - 1));
            if pick(start, end) {
                return end;
            }
            end = period_end_ms(BudgetPeriod::Month, end);
        }
        panic!("no such month within ten years of {}", format_utc(from));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_key_scripts_roll_days_months_and_years_as_core_does() {
        let Some(url) = redis_url() else { return };
        // Boundaries ahead of the wall clock (see `wall_ms`): a day's end; the end of
        // a 31-day month; the end of a February of 29 days (a leap day, then March);
        // a year's end.
        const DAY: u64 = 86_400_000;
        let from = wall_ms() + 30 * DAY;
        let days = [
            period_end_ms(BudgetPeriod::Day, from),
            month_end(from, |s, e| e - s == 31 * DAY),
            month_end(from, |s, e| e - s == 29 * DAY),
            month_end(from, |_, e| format_utc(e).ends_with("-01-01T00:00:00Z")),
        ];
        for (i, b) in days.into_iter().enumerate() {
            across(&url, b, 7 + i as u64).await;
        }
    }
}
