//! Readiness (`GET /readyz`, SPEC §21.2): whether this replica should get traffic — it
//! is not draining, every served scope's governance backend answers, and every
//! telemetry database it writes to is writable. Liveness is `/healthz` (the process
//! serves), which stays 200 while draining.
//!
//! - Each check is bounded by [`CHECK_TIMEOUT`] and they run concurrently: a scope's
//!   governance once per scope (Redis: one command routed to the scope's slot; memory:
//!   always ready), a database once however many scopes share it.
//! - Single flight and a short reuse ([`REUSE`]): probes that arrive together share one
//!   run, and its result answers for `REUSE` — the endpoint has no auth, so a flood of
//!   probes never becomes a flood of Redis and database round trips.
//! - The body names what is not ready with the backends' own errors, which name their
//!   target with its password redacted; the password of each configured URL is
//!   redacted from them once more, so no secret reaches the answer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use polygw::core::ports::TelemetryRecorder;
use polygw::core::secret::{redact_fragments, redact_url};
use polygw::ScopeSettings;
use serde_json::{json, Value};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::scope::ScopeClient;
use crate::state::State;

/// The longest one check may take; past it the check fails (`no answer within …`).
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a finished run answers later probes.
pub const REUSE: Duration = Duration::from_millis(500);

/// The readiness state of a proxy: the drain flag and the last run of the checks.
#[derive(Debug, Default)]
pub(crate) struct Readiness {
    draining: AtomicBool,
    last: Mutex<Option<(Instant, Arc<Checked>)>>,
}

/// The outcome of one run of the checks.
#[derive(Debug)]
pub(crate) struct Checked {
    /// Every check passed.
    pub ready: bool,
    /// The `/readyz` body.
    pub body: Value,
}

impl Readiness {
    /// From now on `/readyz` answers 503 `draining` (irreversible).
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether a drain has started.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The checks' outcome: the last run's when it is recent, else a new run (one at a
    /// time: probes that arrive during a run wait for it).
    pub async fn checked(&self, st: &State) -> Arc<Checked> {
        let mut last = self.last.lock().await;
        if let Some((at, c)) = last.as_ref() {
            if at.elapsed() < REUSE {
                return c.clone();
            }
        }
        let c = Arc::new(run(st).await);
        *last = Some((Instant::now(), c.clone()));
        c
    }
}

/// The password of a URL (`scheme://user:password@host…`), to redact from messages.
fn password_of(url: &str) -> Option<&str> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let userinfo = authority.rsplit_once('@')?.0;
    userinfo
        .split_once(':')
        .map(|(_, pw)| pw)
        .filter(|p| !p.is_empty())
}

/// `text` without the passwords of these URLs.
fn scrub(text: String, urls: &[Option<&str>]) -> String {
    urls.iter()
        .flatten()
        .filter_map(|u| password_of(u))
        .fold(text, |t, pw| redact_fragments(&t, pw))
}

fn settings(client: &ScopeClient) -> &ScopeSettings {
    match client {
        ScopeClient::Chat(c) => c.settings(),
        ScopeClient::Embedding(c) => c.settings(),
    }
}

fn recorder(client: &ScopeClient) -> Arc<dyn TelemetryRecorder> {
    match client {
        ScopeClient::Chat(c) => c.telemetry_recorder(),
        ScopeClient::Embedding(c) => c.telemetry_recorder(),
    }
}

/// The address of the recorder itself (not of its vtable): one database, one check.
fn same(a: &Arc<dyn TelemetryRecorder>, b: &Arc<dyn TelemetryRecorder>) -> bool {
    std::ptr::eq(Arc::as_ptr(a).cast::<()>(), Arc::as_ptr(b).cast::<()>())
}

/// A database the proxy writes telemetry to.
struct Database {
    recorder: Arc<dyn TelemetryRecorder>,
    /// Its URL, password redacted (`None`: a recorder given without one).
    shown: Option<String>,
    /// Its URL as configured (to scrub its password from errors).
    url: Option<String>,
    scopes: Vec<String>,
}

/// The databases to check: the recorders given to the proxy, and every scope's own
/// recorder when the scope has a `TELEMETRY__URL` (a scope without one has telemetry
/// off, or a recorder given in code that the proxy was not told about).
fn databases(st: &State) -> Vec<Database> {
    let mut dbs: Vec<Database> = st
        .recorders
        .iter()
        .map(|r| Database {
            recorder: r.clone(),
            shown: None,
            url: None,
            scopes: Vec::new(),
        })
        .collect();
    for s in st.scopes().iter() {
        let rec = recorder(&s.scope.client);
        let url = settings(&s.scope.client).telemetry_url.as_ref();
        let i = match dbs.iter().position(|d| same(&d.recorder, &rec)) {
            Some(i) => i,
            None if url.is_some() => {
                dbs.push(Database {
                    recorder: rec,
                    shown: None,
                    url: None,
                    scopes: Vec::new(),
                });
                dbs.len() - 1
            }
            None => continue,
        };
        let d = &mut dbs[i];
        d.scopes.push(s.scope.name.clone());
        if d.url.is_none() {
            if let Some(u) = url {
                d.shown = Some(redact_url(u.expose()));
                d.url = Some(u.expose().to_string());
            }
        }
    }
    dbs
}

async fn bounded<E: std::fmt::Display>(
    f: impl std::future::Future<Output = Result<(), E>>,
) -> Result<(), String> {
    match tokio::time::timeout(CHECK_TIMEOUT, f).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
    }
}

/// Runs every check once (concurrently).
async fn run(st: &State) -> Checked {
    let scopes = st.scopes();
    let governance = join_all(scopes.iter().map(|s| async move {
        let set = settings(&s.scope.client);
        let backend = if set.redis_url.is_some() {
            "redis"
        } else {
            "memory"
        };
        let r = match &s.scope.client {
            ScopeClient::Chat(c) => bounded(c.check_governance()).await,
            ScopeClient::Embedding(c) => bounded(c.check_governance()).await,
        };
        let redis = set.redis_url.as_ref().map(|u| u.expose());
        (
            s.scope.name.clone(),
            backend,
            r.map_err(|e| scrub(e, &[redis])),
        )
    }))
    .await;
    let dbs = databases(st);
    let telemetry = join_all(dbs.iter().map(|d| async move {
        bounded(d.recorder.check_writable())
            .await
            .map_err(|e| scrub(e, &[d.url.as_deref()]))
    }))
    .await;

    let mut not_ready = Vec::new();
    let gov: Vec<Value> = governance
        .into_iter()
        .map(|(scope, backend, r)| match r {
            Ok(()) => json!({"scope": scope, "backend": backend, "ok": true}),
            Err(e) => {
                not_ready.push(format!("governance of scope {scope} ({backend}): {e}"));
                json!({"scope": scope, "backend": backend, "ok": false, "error": e})
            }
        })
        .collect();
    let tel: Vec<Value> = dbs
        .iter()
        .zip(telemetry)
        .map(|(d, r)| match r {
            Ok(()) => json!({"database": d.shown, "scopes": d.scopes, "ok": true}),
            Err(e) => {
                let name = d.shown.as_deref().unwrap_or("(a recorder given in code)");
                not_ready.push(format!("telemetry database {name}: {e}"));
                json!({"database": d.shown, "scopes": d.scopes, "ok": false, "error": e})
            }
        })
        .collect();
    let ready = not_ready.is_empty();
    Checked {
        ready,
        body: json!({
            "status": if ready { "ready" } else { "not_ready" },
            "governance": gov,
            "telemetry": tel,
            "not_ready": not_ready,
        }),
    }
}

/// The body of `/readyz` while draining.
pub(crate) fn draining_body() -> Value {
    json!({
        "status": "draining",
        "not_ready": ["draining: the server is shutting down (in-flight calls are finishing)"],
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use async_trait::async_trait;
    use axum::extract::State as AxState;
    use axum::http::StatusCode;
    use polygw::core::ports::{
        AcquireRequest, Admission, FlushReport, NullBreakerStore, RateLimiter, UnlimitedLimiter,
    };
    use polygw::core::{GovernanceError, Secret, TelemetryError, TelemetryRow};
    use polygw::{GatewayClient, SourceConfig};

    use super::*;
    use crate::{Proxy, ProxyConfig, Scope};

    const REDIS_PASSWORD: &str = "hunter2-redis-password";
    const DB_PASSWORD: &str = "s3cret-database-password";

    /// A governance backend whose ping fails (echoing its password, as a careless
    /// driver might) while `down`.
    #[derive(Debug, Default)]
    struct Backend {
        down: AtomicBool,
        pings: AtomicUsize,
    }

    #[async_trait]
    impl RateLimiter for Backend {
        async fn acquire<'r>(
            &self,
            req: &AcquireRequest<'r>,
        ) -> Result<Admission, GovernanceError> {
            UnlimitedLimiter.acquire(req).await
        }
        async fn in_flight(&self, _: &str, _: &str) -> Result<u32, GovernanceError> {
            Ok(0)
        }
        async fn ping(&self, scope: &str) -> Result<(), GovernanceError> {
            self.pings.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                return Err(GovernanceError::new(
                    "redis",
                    format!("ping of {scope}: auth with {REDIS_PASSWORD} refused"),
                ));
            }
            Ok(())
        }
    }

    /// A telemetry database that is read-only while `down`.
    #[derive(Debug, Default)]
    struct Database {
        down: AtomicBool,
        checks: AtomicUsize,
    }

    #[async_trait]
    impl TelemetryRecorder for Database {
        fn record(&self, _: TelemetryRow) {}
        fn dropped(&self) -> u64 {
            0
        }
        async fn flush(&self) -> Result<FlushReport, TelemetryError> {
            Ok(FlushReport::default())
        }
        async fn check_writable(&self) -> Result<(), TelemetryError> {
            self.checks.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                return Err(TelemetryError(format!("read-only; password {DB_PASSWORD}")));
            }
            Ok(())
        }
    }

    async fn proxy(backend: Arc<Backend>, db: Arc<Database>) -> Proxy {
        let mut s = ScopeSettings::new(
            "LLM",
            vec![SourceConfig::new("a", 0, "http://127.0.0.1:9", "", "m")],
        );
        s.redis_url = Some(Secret::new(format!(
            "redis://:{REDIS_PASSWORD}@127.0.0.1:1/"
        )));
        s.telemetry_url = Some(Secret::new(format!(
            "postgres://polygw:{DB_PASSWORD}@127.0.0.1:1/polygw"
        )));
        let client = GatewayClient::builder(s)
            .limiter(backend)
            .breakers(Arc::new(NullBreakerStore))
            .telemetry(db)
            .build()
            .await
            .unwrap();
        // A second scope on in-memory governance and without telemetry.
        let plain = GatewayClient::builder(ScopeSettings::new(
            "EMBED",
            vec![SourceConfig::new("b", 0, "http://127.0.0.1:9", "", "m")],
        ))
        .build()
        .await
        .unwrap();
        Proxy::new(
            ProxyConfig::default(),
            vec![Scope::chat(client), Scope::chat(plain)],
        )
    }

    async fn readyz(p: &Proxy) -> (StatusCode, Value) {
        let r = crate::route::meta::readyz(AxState(p.state.clone())).await;
        let status = r.status();
        let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn ready_names_what_is_not_without_secrets_and_drains() {
        let (backend, db) = (Arc::new(Backend::default()), Arc::new(Database::default()));
        let p = proxy(backend.clone(), db.clone()).await;

        let (status, body) = readyz(&p).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["status"], "ready");
        assert_eq!(body["governance"][0]["backend"], "redis");
        assert_eq!(body["governance"][1]["backend"], "memory");
        assert_eq!(
            body["telemetry"],
            json!([{"database": "postgres://polygw:%3Credacted%3E@127.0.0.1:1/polygw",
                    "scopes": ["LLM"], "ok": true}]),
            "one database, checked once; the scope without telemetry has none"
        );

        // Probes within REUSE share one run.
        let (pings, checks) = (
            backend.pings.load(Ordering::SeqCst),
            db.checks.load(Ordering::SeqCst),
        );
        readyz(&p).await;
        assert_eq!(backend.pings.load(Ordering::SeqCst), pings);
        assert_eq!(db.checks.load(Ordering::SeqCst), checks);

        backend.down.store(true, Ordering::SeqCst);
        db.down.store(true, Ordering::SeqCst);
        tokio::time::advance(REUSE).await;
        let (status, body) = readyz(&p).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(body["status"], "not_ready");
        let text = body.to_string();
        assert!(
            !text.contains(REDIS_PASSWORD) && !text.contains(DB_PASSWORD),
            "{text}"
        );
        let not_ready: Vec<String> = serde_json::from_value(body["not_ready"].clone()).unwrap();
        assert_eq!(not_ready.len(), 2, "{text}");
        assert!(
            not_ready[0].starts_with("governance of scope LLM (redis): "),
            "{text}"
        );
        assert!(
            not_ready[1].starts_with(
                "telemetry database postgres://polygw:%3Credacted%3E@127.0.0.1:1/polygw: "
            ),
            "{text}"
        );

        // Draining: 503 at once, nothing checked.
        backend.down.store(false, Ordering::SeqCst);
        db.down.store(false, Ordering::SeqCst);
        tokio::time::advance(REUSE).await;
        p.start_draining();
        let pings = backend.pings.load(Ordering::SeqCst);
        let (status, body) = readyz(&p).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["status"], "draining");
        assert_eq!(backend.pings.load(Ordering::SeqCst), pings);
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_that_hangs_fails_within_the_bound() {
        #[derive(Debug)]
        struct Hangs;
        #[async_trait]
        impl TelemetryRecorder for Hangs {
            fn record(&self, _: TelemetryRow) {}
            fn dropped(&self) -> u64 {
                0
            }
            async fn flush(&self) -> Result<FlushReport, TelemetryError> {
                Ok(FlushReport::default())
            }
            async fn check_writable(&self) -> Result<(), TelemetryError> {
                std::future::pending().await
            }
        }
        let client = GatewayClient::builder(ScopeSettings::new(
            "LLM",
            vec![SourceConfig::new("a", 0, "http://127.0.0.1:9", "", "m")],
        ))
        .build()
        .await
        .unwrap();
        let p = Proxy::with_telemetry(
            ProxyConfig::default(),
            vec![Scope::chat(client)],
            None,
            vec![Arc::new(Hangs)],
        );
        let started = Instant::now();
        let (status, body) = readyz(&p).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(started.elapsed(), CHECK_TIMEOUT);
        assert_eq!(
            body["not_ready"][0],
            "telemetry database (a recorder given in code): no answer within 1s"
        );
    }

    #[test]
    fn passwords_of_urls() {
        assert_eq!(
            password_of("redis://:hunter2-pass@h:6379/0"),
            Some("hunter2-pass")
        );
        assert_eq!(password_of("postgres://u:pw9876@h/db?x=@y"), Some("pw9876"));
        assert_eq!(
            password_of("redis+cluster://u:s3cret-pw@a:1,b:2"),
            Some("s3cret-pw")
        );
        assert_eq!(password_of("redis://h:6379"), None);
        assert_eq!(password_of("postgres://user@h/db"), None);
        assert_eq!(password_of("sqlite://x.db"), None);
    }

    #[test]
    fn scrub_removes_a_password_however_it_is_quoted() {
        let url = "redis://:correct-horse-battery@127.0.0.1:1/";
        let t = scrub(
            "connect to 127.0.0.1:1 with correct-horse-battery failed".into(),
            &[Some(url)],
        );
        assert!(!t.contains("correct-horse"), "{t}");
        assert!(t.contains("<redacted>"), "{t}");
    }
}
