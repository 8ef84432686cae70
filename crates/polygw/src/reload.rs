//! Configuration reload for library users (SPEC §26.2): [`GatewayClient::reconfigured`]
//! builds a client over new settings that keeps the old one's state, and
//! [`ReloadingClient`] follows an env file with it — on SIGHUP and when the file's
//! content changes.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use polygw_core::reload::{scope_changes, ScopeChanges};
use polygw_core::{ConfigError, GatewayError, ScopeKind, ScopeSettings};

use crate::client::GatewayClient;

impl GatewayClient {
    /// A client over `settings` (the same scope, reloaded) that keeps this one's state
    /// where the settings that define it did not change (SPEC §26.2): the transport and
    /// its connections, the clock, the random source and the metrics always; the
    /// limiter, breakers, latency and affinity stores while `REDIS__URL` and
    /// `TLS__CA_FILE` are the same; the telemetry recorder and the response store while
    /// `TELEMETRY__URL` is; the response cache while its settings are; the latency
    /// evidence while the hedge window and backend are. A source whose name now points
    /// at another upstream (API, base URL or model) gets its breaker reset. Calls on
    /// this client go on with it; new calls should use the returned one.
    pub async fn reconfigured(
        &self,
        settings: ScopeSettings,
    ) -> Result<(GatewayClient, ScopeChanges), GatewayError> {
        let old = &self.engine.scope;
        if !settings.name.eq_ignore_ascii_case(&old.name) {
            return Err(GatewayError::Config(ConfigError::Invalid {
                key: "scope".into(),
                value: settings.name.clone(),
                expected: format!("the scope {} (a client reloads its own scope)", old.name),
            }));
        }
        let p = &self.engine.ports;
        let mut b = GatewayClient::builder(settings.clone())
            .transport(p.transport.clone())
            .clock(p.clock.clone())
            .rng(p.rng.clone())
            .metrics(self.engine.metrics.clone());
        let same_governance =
            settings.redis_url == old.redis_url && settings.tls_ca_file == old.tls_ca_file;
        if same_governance {
            b = b
                .limiter(p.limiter.clone())
                .breakers(p.breakers.clone())
                .affinity_store(p.affinity.clone());
            if let Some(l) = &p.latency {
                b = b.latency_store(l.clone());
            }
            if settings.hedge.window == old.hedge.window {
                b = b.upstream_evidence(p.evidence.clone());
            }
        }
        if settings.telemetry_url == old.telemetry_url {
            b = b
                .telemetry(p.telemetry.clone())
                .responses(p.responses.clone());
        }
        if settings.cache == old.cache {
            b = b.cache(p.cache.clone());
        }
        let client = b.build().await?;
        let changes = client.took_over_from(Some(old)).await;
        Ok((client, changes))
    }

    /// What this client changes from `before` (the settings it replaces; `None`: a new
    /// scope), having reset the breaker of every source whose name now points at another
    /// upstream (a failure of the old upstream must not hold the new one out).
    pub async fn took_over_from(&self, before: Option<&ScopeSettings>) -> ScopeChanges {
        let now = &self.engine.scope;
        let changes = scope_changes(before, now);
        for source in changes.to_reset() {
            if let Err(e) = self.reset_breaker(source).await {
                tracing::warn!(scope = %now.name, source, error = %e, "resetting the breaker of a changed source failed");
            }
        }
        changes
    }
}

/// How often a [`ReloadingClient`] looks at its file.
pub const RELOAD_POLL: Duration = Duration::from_secs(1);

struct Inner {
    scope: String,
    path: PathBuf,
    current: ArcSwap<GatewayClient>,
    /// The file's content last loaded or refused (a change is a new content).
    seen: Mutex<Option<Vec<u8>>>,
    /// One reload at a time.
    reloading: tokio::sync::Mutex<()>,
}

/// A chat client of one scope that follows an env file (SPEC §26.2): the scope's
/// variables come from the process environment with the file's over them (a variable
/// the file sets wins), and are reloaded on SIGHUP (Unix) and when the file's content
/// changes (looked at every [`RELOAD_POLL`]). A reload is whole or nothing: a file that
/// does not load or fails a guard is refused (logged), and the running client stays.
/// [`ReloadingClient::client`] is the client to use now; a call keeps the client it
/// began with. Dropping it stops watching.
pub struct ReloadingClient {
    inner: Arc<Inner>,
    watcher: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for ReloadingClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadingClient")
            .field("scope", &self.inner.scope)
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

/// The scope's settings from the process environment with `path`'s variables over them.
fn load(scope: &str, path: &Path) -> Result<ScopeSettings, GatewayError> {
    let file = crate::env::env_file_vars(path)?;
    let vars = crate::env::overlay(crate::process_vars(Some(scope))?, &file, Some(scope));
    Ok(polygw_core::config::load_scope(vars, scope, ScopeKind::Chat)?.settings)
}

impl ReloadingClient {
    /// Loads scope `scope` from the environment and `path`, builds its client, and
    /// starts watching `path` (on the current tokio runtime).
    pub async fn watch(scope: &str, path: impl Into<PathBuf>) -> Result<Self, GatewayError> {
        let path = path.into();
        let seen = std::fs::read(&path).ok();
        let client = GatewayClient::from_settings(load(scope, &path)?).await?;
        let inner = Arc::new(Inner {
            scope: scope.to_uppercase(),
            path,
            current: ArcSwap::from_pointee(client),
            seen: Mutex::new(seen),
            reloading: tokio::sync::Mutex::new(()),
        });
        let watcher = tokio::spawn(watch_loop(Arc::downgrade(&inner)));
        Ok(ReloadingClient { inner, watcher })
    }

    /// The client to use now.
    pub fn client(&self) -> GatewayClient {
        (**self.inner.current.load()).clone()
    }

    /// Reloads the file now: the new client is in place when this returns `Ok` (with
    /// what changed); on an error nothing changed.
    pub async fn reload(&self) -> Result<ScopeChanges, GatewayError> {
        reload(&self.inner).await
    }
}

impl Drop for ReloadingClient {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

async fn reload(inner: &Inner) -> Result<ScopeChanges, GatewayError> {
    let _one = inner.reloading.lock().await;
    if let Ok(mut seen) = inner.seen.lock() {
        *seen = std::fs::read(&inner.path).ok();
    }
    let settings = load(&inner.scope, &inner.path)?;
    let (client, changes) = inner.current.load().reconfigured(settings).await?;
    inner.current.store(Arc::new(client));
    Ok(changes)
}

async fn watch_loop(inner: std::sync::Weak<Inner>) {
    #[cfg(unix)]
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    let mut tick = tokio::time::interval(RELOAD_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        #[cfg(unix)]
        let hangup = async {
            match hup.as_mut() {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let hangup = std::future::pending::<()>();
        let forced = tokio::select! {
            () = hangup => true,
            _ = tick.tick() => false,
        };
        let Some(inner) = inner.upgrade() else { return };
        if !forced {
            let now = std::fs::read(&inner.path).ok();
            let changed = inner.seen.lock().is_ok_and(|seen| *seen != now);
            if !changed {
                continue;
            }
        }
        match reload(&inner).await {
            Ok(c) => {
                tracing::info!(scope = %inner.scope, file = %inner.path.display(), changes = %c.summary(), "configuration reloaded")
            }
            Err(e) => {
                tracing::error!(scope = %inner.scope, file = %inner.path.display(), error = %e, "reload refused; the running configuration is kept")
            }
        }
    }
}
