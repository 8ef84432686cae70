//! `polygw serve`: the OpenAI-compatible proxy of `polygw-serve` over the scopes
//! configured in the environment (SPEC §11, §15; docs/SERVE.md). This command only
//! loads the scopes (each as its declared `{S}__KIND`), shares one metrics registry and
//! one telemetry recorder per database, reads the client keys, checks where it may
//! listen, and handles the signals: the first starts a drain (`/readyz` 503, the
//! listener closed, in-flight calls and streams finish within `--grace-s`, telemetry
//! and settlements flushed, exit 0), a second stops at once (exit 130); the grace's end
//! or a second signal cuts what is left and says so in one line.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use polygw::core::ports::TelemetryRecorder;
use polygw::core::Secret;
use polygw::{GatewayClient, Metrics, ScopeKind};
use polygw_serve::{Proxy, ProxyConfig, Scope, ServerLimits};
use tokio::sync::watch;

use crate::env;

/// Arguments of `polygw serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Scopes to serve (repeatable; default: every chat and embedding scope configured).
    #[arg(long)]
    pub scope: Vec<String>,
    /// Address to listen on. Without POLYGW_PROXY_KEYS only a loopback address is
    /// accepted (see --allow-unauthenticated).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Listen on a non-loopback address without client keys (anyone who can reach it
    /// spends your upstream quota).
    #[arg(long)]
    pub allow_unauthenticated: bool,
    /// Without client keys: another Host value to accept besides loopback names
    /// (repeatable; `name` or `name:port`).
    #[arg(long = "allowed-host")]
    pub allowed_hosts: Vec<String>,
    /// Without client keys: another Origin to accept besides loopback origins
    /// (repeatable; `scheme://host[:port]`).
    #[arg(long = "allowed-origin")]
    pub allowed_origins: Vec<String>,
    /// On SIGTERM/Ctrl-C the proxy drains (/readyz answers 503, new connections are
    /// refused): how long in-flight calls and streams may take to finish (seconds);
    /// then what is left is cut. A second signal stops at once.
    #[arg(long, default_value_t = 30.0)]
    pub grace_s: f64,
    /// Largest request body accepted (bytes).
    #[arg(long, default_value_t = 10 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// A call that cannot be admitted for this long answers 429 rate_limit_exceeded
    /// with Retry-After (seconds).
    #[arg(long, default_value_t = 10.0)]
    pub max_wait_s: f64,
    /// A stream with no first chunk after this long gets its headers and an SSE
    /// comment every this many seconds until the first chunk.
    #[arg(long, default_value_t = 15.0)]
    pub keepalive_s: f64,
    /// Calls running at once per scope.
    #[arg(long, default_value_t = 256)]
    pub max_calls_per_scope: usize,
    /// Calls waiting for a slot per scope; beyond it: 429 at once.
    #[arg(long, default_value_t = 1024)]
    pub max_queued_per_scope: usize,
    /// A request head must arrive within this (seconds, from its first byte).
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout_s: f64,
    /// A request body must arrive within this (seconds).
    #[arg(long, default_value_t = 60.0)]
    pub body_timeout_s: f64,
    /// A connection idle (between requests, or not reading its answer) this long is
    /// closed (seconds).
    #[arg(long, default_value_t = 60.0)]
    pub idle_timeout_s: f64,
    /// Largest request head (bytes).
    #[arg(long, default_value_t = 64 * 1024)]
    pub max_header_bytes: usize,
    /// Open connections in total (default: half the open-file limit, 64..16384).
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Open connections per client address.
    #[arg(long, default_value_t = 64)]
    pub max_connections_per_client: usize,
    /// Read the scopes' variables from this file too (dotenv syntax; a variable it sets
    /// wins over the process's), and reload them on SIGHUP or when the file changes: new
    /// calls get the new configuration, calls in flight finish with theirs, and a file
    /// that fails a check is refused whole (the running configuration is kept).
    #[arg(long)]
    pub env_file: Option<std::path::PathBuf>,
}

fn secs(flag: &str, v: f64) -> Result<Duration> {
    if !v.is_finite() || v < 0.0 {
        bail!("--{flag} {v}: expected a number of seconds ≥ 0");
    }
    Ok(Duration::from_secs_f64(v))
}

fn positive_secs(flag: &str, v: f64) -> Result<Duration> {
    let d = secs(flag, v)?;
    if d.is_zero() {
        bail!("--{flag} {v}: expected a number of seconds > 0");
    }
    Ok(d)
}

/// The served scopes, their shared metrics and telemetry recorders.
struct Loaded {
    scopes: Vec<Scope>,
    recorders: Vec<Arc<dyn TelemetryRecorder>>,
    /// Per database (redacted URL): its recorder and the scopes writing to it.
    databases: Vec<Reported>,
    /// The telemetry databases' URLs, credentials included (never printed).
    telemetry_urls: Vec<Secret>,
    /// Each scope's settings, by name (its sources' prices bound unknown costs).
    settings: HashMap<String, polygw::ScopeSettings>,
}

/// A database the final flush reports on: its redacted URL, its recorder, the scopes
/// writing to it.
type Reported = (String, Arc<dyn TelemetryRecorder>, Vec<String>);

/// A telemetry database's recorder and response store.
type Database = (
    Arc<dyn TelemetryRecorder>,
    Arc<dyn polygw::core::ports::ResponseStore>,
);

/// The recorders opened so far, by URL: a reload reuses them (one recorder per
/// database for the life of the process).
#[derive(Default)]
struct Recorders(HashMap<String, Database>);

/// Builds the clients of the named scopes (default: every chat and embedding scope) from
/// `env`, sharing `metrics` and one telemetry recorder per database URL.
async fn load(
    env: &env::Env,
    named: &[String],
    metrics: &Arc<Metrics>,
    opened: &mut Recorders,
) -> Result<Loaded> {
    let names = env.scopes(named)?;
    let mut users: HashMap<String, Vec<String>> = HashMap::new();
    let mut scopes = Vec::new();
    let mut settings = HashMap::new();
    for name in names {
        let kind = env.kind_of(&name)?;
        if kind == ScopeKind::Ocr {
            if named.is_empty() {
                eprintln!("note: scope {name} is an OCR scope ({name}__KIND=ocr): not served (OpenAI's API has no OCR endpoint)");
                continue;
            }
            bail!("scope {name} is an OCR scope ({name}__KIND=ocr): polygw serve serves chat and embedding scopes");
        }
        let loaded = env
            .load(&name, kind)
            .with_context(|| format!("scope {name}"))?;
        env::print_warnings(&name, &loaded.warnings);
        settings.insert(name.clone(), loaded.settings.clone());
        let mut b = GatewayClient::builder(loaded.settings.clone()).metrics(metrics.clone());
        if let Some(url) = &loaded.settings.telemetry_url {
            let key = url.expose().to_string();
            if !opened.0.contains_key(&key) {
                let sql = polygw::telemetry::SqlRecorder::connect(
                    url.expose(),
                    polygw::telemetry::RecorderConfig::default(),
                )
                .await
                .with_context(|| {
                    format!(
                        "{name}__TELEMETRY__URL={}",
                        polygw::core::secret::redact_url(url.expose())
                    )
                })?;
                // Stored Responses live in the same database (SPEC §18.1).
                let store: Arc<dyn polygw::core::ports::ResponseStore> =
                    Arc::new(sql.response_store());
                opened.0.insert(key.clone(), (Arc::new(sql), store));
            }
            let (rec, store) = opened.0.get(&key).context("just inserted")?;
            users.entry(key).or_default().push(name.clone());
            b = b.telemetry(rec.clone()).responses(store.clone());
        }
        let clients = b
            .build_all()
            .await
            .with_context(|| format!("scope {name}"))?;
        if let Some(s) = Scope::of_kind(kind, clients) {
            scopes.push(s);
        }
    }
    if scopes.is_empty() {
        bail!("no chat or embedding scope to serve");
    }
    let telemetry_urls = users.keys().map(|u| Secret::new(u.clone())).collect();
    let databases: Vec<Reported> = users
        .into_iter()
        .filter_map(|(url, users)| {
            let (rec, _) = opened.0.get(&url)?;
            Some((polygw::core::secret::redact_url(&url), rec.clone(), users))
        })
        .collect();
    Ok(Loaded {
        scopes,
        recorders: databases.iter().map(|(_, r, _)| r.clone()).collect(),
        databases,
        telemetry_urls,
        settings,
    })
}

/// SPEC §24.2: with client keys on the memory backend (no `REDIS__URL`), a key's spend of
/// the current UTC day and month is restored from the rows of the scopes' telemetry
/// databases before serving, so that a restart does not reset a budget. An unknown cost
/// counts at its upper bound (SPEC §20.4: the estimate's prompt at the dearest price and
/// what arrived plus the source's `MAX_OUTPUT_TOKENS`), else 0 (said in the log line).
/// A database that cannot be read is a warning: the keys then start from what the others
/// hold.
async fn restore_key_spend(loaded: &Loaded) {
    use polygw::core::key_funds::DEFAULT_MAX_OUTPUT_TOKENS;
    use polygw::core::key_quota::{period_start_ms, restored_spend, RestoredSpend};
    use polygw::core::telemetry::{gap_cost_range, TokenPrices};
    let memory: Vec<&GatewayClient> = loaded
        .scopes
        .iter()
        .filter(|s| {
            loaded
                .settings
                .get(&s.name)
                .is_some_and(|st| st.redis_url.is_none())
        })
        .filter_map(|s| match &s.client {
            polygw_serve::ScopeClient::Chat(c) => Some(c),
            polygw_serve::ScopeClient::Embedding(_) => None,
        })
        .collect();
    if memory.is_empty() {
        return;
    }
    let now = u64::try_from(polygw::core::ports::Clock::unix_ms(
        &polygw::clock::TokioClock,
    ))
    .unwrap_or(0);
    let month =
        polygw::core::key_quota::period_id(polygw::core::client_key::BudgetPeriod::Month, now);
    let since = period_start_ms(polygw::core::client_key::BudgetPeriod::Month, month);
    let bound = |r: &polygw::core::TelemetryRow| {
        let src = loaded
            .settings
            .get(&*r.scope)?
            .sources
            .iter()
            .find(|s| Some(s.name.as_str()) == r.source.as_deref())?;
        let allowance = src.max_output_tokens.unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS);
        gap_cost_range(
            r.est_prompt_tokens.unwrap_or(0),
            r.est_received_tokens.unwrap_or(0),
            allowance,
            &TokenPrices::of(src),
        )?
        .high
    };
    let mut total: HashMap<String, RestoredSpend> = HashMap::new();
    for url in &loaded.telemetry_urls {
        let rows = match polygw::telemetry::read_rows(url.expose(), i64::try_from(since).ok()).await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(
                    database = %polygw::core::secret::redact_url(url.expose()),
                    error = %e,
                    "client keys' spend not restored from this telemetry database"
                );
                continue;
            }
        };
        for (k, s) in restored_spend(rows.iter(), now, bound) {
            let t = total.entry(k).or_default();
            t.day_nanos += s.day_nanos;
            t.month_nanos += s.month_nanos;
            t.unbounded_rows += s.unbounded_rows;
        }
    }
    let unbounded: u64 = total.values().map(|s| s.unbounded_rows).sum();
    for (key, s) in &total {
        for c in &memory {
            if let Err(e) = c.restore_key_spend(key, s.day_nanos, s.month_nanos).await {
                tracing::warn!(key = %key, error = %e, "client key's spend not restored");
            }
        }
    }
    if !total.is_empty() {
        tracing::info!(
            keys = total.len(),
            unknown_cost_rows_counted_as_0 = unbounded,
            "client keys' spend of this UTC day and month restored from telemetry"
        );
    }
}

/// What reloading `--env-file` needs (SPEC §26.2).
struct Reload {
    path: std::path::PathBuf,
    named: Vec<String>,
    proxy: Proxy,
    metrics: Arc<Metrics>,
    opened: Arc<tokio::sync::Mutex<Recorders>>,
    /// The databases the final flush reports on (those of the configuration served).
    databases: Arc<std::sync::Mutex<Vec<Reported>>>,
    /// The settings served now, by scope.
    running: HashMap<String, polygw::ScopeSettings>,
}

/// How often the env file is looked at for a change.
const RELOAD_POLL: Duration = Duration::from_secs(1);

/// Reloads the env file on SIGHUP, and when its content changes (looked at every
/// [`RELOAD_POLL`]; an editor that replaces the file is seen too).
async fn reload_loop(mut r: Reload) {
    #[cfg(unix)]
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    let mut seen = std::fs::read(&r.path).ok();
    let mut tick = tokio::time::interval(RELOAD_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        #[cfg(unix)]
        let hangup = next_signal(&mut hup);
        #[cfg(not(unix))]
        let hangup = std::future::pending::<()>();
        let why = tokio::select! {
            () = hangup => "SIGHUP",
            _ = tick.tick() => {
                let now = std::fs::read(&r.path).ok();
                if now == seen {
                    continue;
                }
                seen = now;
                "the file changed"
            }
        };
        if r.proxy.is_draining() {
            return;
        }
        reload(&mut r, why).await;
    }
}

/// One reload: the whole file loads and passes every check, or nothing changes.
async fn reload(r: &mut Reload, why: &str) {
    let shown = r.path.display().to_string();
    let loaded = match env::Env::with_file(&r.path) {
        Ok(env) => {
            let mut opened = r.opened.lock().await;
            load(&env, &r.named, &r.metrics, &mut opened).await
        }
        Err(e) => Err(e),
    };
    let loaded = match loaded {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(file = %shown, error = %format!("{e:#}"), "reload refused; the running configuration is kept");
            eprintln!(
                "reload of {shown} ({why}) refused: {e:#}; the running configuration is kept"
            );
            return;
        }
    };
    let mut lines = Vec::new();
    for scope in &loaded.scopes {
        let before = r.running.get(&scope.name);
        let changes = match &scope.client {
            polygw_serve::ScopeClient::Chat(c) => c.took_over_from(before).await,
            polygw_serve::ScopeClient::Embedding(c) => {
                polygw::core::reload::scope_changes(before, c.settings())
            }
        };
        lines.push(format!("{}: {}", scope.name, changes.summary()));
    }
    for gone in r
        .running
        .keys()
        .filter(|k| !loaded.settings.contains_key(*k))
    {
        lines.push(format!("{gone}: no longer served"));
    }
    r.proxy.replace_scopes(loaded.scopes);
    r.running = loaded.settings;
    if let Ok(mut d) = r.databases.lock() {
        *d = loaded.databases;
    }
    tracing::info!(file = %shown, reason = why, changes = %lines.join(" | "), "configuration reloaded");
    eprintln!("reloaded {shown} ({why}): {}", lines.join(" | "));
}

/// The next delivery of a signal (never, when it could not be installed).
#[cfg(unix)]
async fn next_signal(sig: &mut Option<tokio::signal::unix::Signal>) {
    match sig.as_mut() {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}

/// Counts SIGTERM and Ctrl-C (SIGINT) from the start of the command.
fn signals() -> watch::Receiver<u32> {
    let (tx, rx) = watch::channel(0u32);
    tokio::spawn(async move {
        #[cfg(unix)]
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        loop {
            #[cfg(unix)]
            let terminate = next_signal(&mut term);
            #[cfg(not(unix))]
            let terminate = std::future::pending::<()>();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                () = terminate => {}
            }
            tx.send_modify(|n| *n += 1);
        }
    });
    rx
}

async fn nth_signal(mut rx: watch::Receiver<u32>, n: u32) {
    let _ = rx.wait_for(|seen| *seen >= n).await;
}

pub async fn run(args: ServeArgs) -> Result<ExitCode> {
    let grace = secs("grace-s", args.grace_s)?;
    let max_wait = secs("max-wait-s", args.max_wait_s)?;
    let keepalive = positive_secs("keepalive-s", args.keepalive_s)?;
    let header_timeout = positive_secs("header-timeout-s", args.header_timeout_s)?;
    let body_timeout = positive_secs("body-timeout-s", args.body_timeout_s)?;
    let idle_timeout = positive_secs("idle-timeout-s", args.idle_timeout_s)?;
    let keys: Vec<Secret> = std::env::var("POLYGW_PROXY_KEYS")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .map(Secret::new)
        .collect();
    // Client keys of a key store (SPEC §21.1): loaded before serving, reloaded every 2 s.
    let key_ring = match std::env::var(crate::keys::KEYS_DB_VAR) {
        Ok(url) if !url.trim().is_empty() => {
            let store =
                match polygw::telemetry::SqlKeyStore::connect(url.trim(), Duration::from_secs(10))
                    .await
                {
                    Ok(s) => s,
                    Err(e) => {
                        eprintln!(
                            "error: {}: the key store cannot be opened: {e}",
                            crate::keys::KEYS_DB_VAR
                        );
                        return Ok(ExitCode::from(2));
                    }
                };
            let ring = polygw_serve::keys::KeyRing::new(
                std::sync::Arc::new(store),
                polygw_serve::keys::DEFAULT_REFRESH,
            );
            match ring.refresh().await {
                Ok(n) => tracing::info!(keys = n, "client keys loaded from the key store"),
                Err(e) => {
                    eprintln!(
                        "error: {}: the client keys cannot be read: {e}",
                        crate::keys::KEYS_DB_VAR
                    );
                    return Ok(ExitCode::from(2));
                }
            }
            ring.spawn_refresh();
            Some(ring)
        }
        _ => None,
    };
    if keys.is_empty()
        && key_ring.is_none()
        && !args.listen.ip().is_loopback()
        && !args.allow_unauthenticated
    {
        eprintln!(
            "error: refusing to listen on {} without client keys: anyone who can reach it would \
             spend your upstream quota. Set POLYGW_PROXY_KEYS or POLYGW_KEYS_DB, listen on a loopback \
             address, or pass --allow-unauthenticated",
            args.listen
        );
        return Ok(ExitCode::from(2));
    }
    let sig = signals();
    // Everything that can stop the proxy from starting is configuration: exit 2.
    let env = match &args.env_file {
        Some(path) => match env::Env::with_file(path) {
            Ok(e) => e,
            Err(e) => {
                eprintln!("error: {e:#}");
                return Ok(ExitCode::from(2));
            }
        },
        None => env::Env::process(),
    };
    let metrics = Arc::new(Metrics::new());
    let opened = Arc::new(tokio::sync::Mutex::new(Recorders::default()));
    let loaded = match load(&env, &args.scope, &metrics, &mut *opened.lock().await).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: {e:#}");
            return Ok(ExitCode::from(2));
        }
    };
    if keys.is_empty() && key_ring.is_none() {
        eprintln!(
            "warning: POLYGW_PROXY_KEYS and POLYGW_KEYS_DB are not set: the proxy accepts any \
             local client (loopback Host and Origin, JSON bodies only)"
        );
    }
    // The admin routes (SPEC §26.3): off (404) without a key.
    let admin_key = std::env::var("POLYGW_ADMIN_KEY")
        .ok()
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
        .map(Secret::new);
    let config = ProxyConfig {
        admin_key,
        client_keys: keys,
        allowed_hosts: args.allowed_hosts.clone(),
        allowed_origins: args.allowed_origins.clone(),
        max_body_bytes: args.max_body_bytes,
        body_timeout,
        max_wait,
        keepalive,
        max_calls_per_scope: args.max_calls_per_scope.max(1),
        max_queued_per_scope: args.max_queued_per_scope,
        key_ring,
        ..ProxyConfig::default()
    };
    let limits = ServerLimits {
        header_timeout,
        idle_timeout,
        max_header_bytes: args.max_header_bytes.max(1024),
        max_connections: args
            .max_connections
            .unwrap_or_else(polygw_serve::default_max_connections)
            .max(1),
        max_connections_per_client: args.max_connections_per_client.max(1),
        grace,
    };
    if config.key_ring.is_some() {
        restore_key_spend(&loaded).await;
    }
    let databases = Arc::new(std::sync::Mutex::new(loaded.databases));
    let running = loaded.settings;
    let proxy = Proxy::with_telemetry(
        config,
        loaded.scopes,
        Some(metrics.clone()),
        loaded.recorders,
    );
    if let Some(path) = args.env_file.clone() {
        tokio::spawn(reload_loop(Reload {
            path,
            named: args.scope.clone(),
            proxy: proxy.clone(),
            metrics,
            opened,
            databases: databases.clone(),
            running,
        }));
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    println!(
        "polygw serving {} on http://{addr}/v1 (models: {})",
        proxy
            .scopes()
            .map(|s| format!("{} ({})", s.name, s.kind()))
            .collect::<Vec<_>>()
            .join(", "),
        proxy.known_models().join(", ")
    );
    let shutdown = {
        let sig = sig.clone();
        let proxy = proxy.clone();
        async move {
            nth_signal(sig, 1).await;
            eprintln!(
                "shutting down: draining (/readyz answers 503, new connections refused); \
                 finishing {} call(s) in flight (up to {} s; a second signal stops at once)",
                proxy.calls_running(),
                grace.as_secs_f64()
            );
        }
    };
    let second = || async {
        nth_signal(sig.clone(), 2).await;
        eprintln!(
            "second signal: stopping now, cutting {} call(s) still running (telemetry and \
             settlements not flushed)",
            proxy.calls_running()
        );
        std::process::exit(130);
    };
    let report = tokio::select! {
        r = polygw_serve::serve(listener, proxy.clone(), limits, shutdown) => r.context("serving")?,
        () = second() => unreachable!("exits"),
    };
    if report.cut {
        eprintln!(
            "grace period over ({} s): cut {} connection(s) with calls still running (streams \
             ended with an error event, plain calls a 503){}",
            grace.as_secs_f64(),
            report.cut_connections,
            if report.dropped > 0 {
                format!("; {} dropped after the final flush", report.dropped)
            } else {
                String::new()
            }
        );
    }
    let flush = async {
        // Every client flushes its settlements (and its recorder); the figures are the
        // recorder's, so they are printed once per database, not under every scope
        // that shares it.
        for s in proxy.scopes() {
            match &s.client {
                polygw_serve::ScopeClient::Chat(c) => c.shutdown().await,
                polygw_serve::ScopeClient::Embedding(c) => c.shutdown().await,
            };
        }
        let databases = databases
            .lock()
            .map(|d| d.clone())
            .unwrap_or_else(|p| p.into_inner().clone());
        for (url, rec, users) in &databases {
            match rec.flush().await {
                Ok(r) => eprintln!(
                    "telemetry {url} (scope(s) {}): written {}, dropped {}, pending {}",
                    users.join(", "),
                    r.written,
                    r.dropped,
                    r.pending
                ),
                Err(e) => eprintln!("telemetry {url}: the final flush failed: {e}"),
            }
        }
    };
    tokio::select! {
        () = flush => {}
        () = second() => {}
    }
    Ok(ExitCode::SUCCESS)
}
