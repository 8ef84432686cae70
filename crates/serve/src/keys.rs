//! Client keys from the key store (SPEC §21.1): the proxy's [`KeyRing`] holds every key
//! of the store by hash and reloads them every [`KeyRing::refresh_every`] (2 s by default),
//! so a key created, changed or revoked with `polygw keys` reaches every replica within
//! a few seconds. A key is looked up by the SHA-256 of what the client presents: the
//! ring never holds a key in clear.
//!
//! Fail closed: until the first load succeeds, no store key is accepted; a failed reload
//! keeps the last keys (and says so once a minute), so a database blip neither lets a
//! revoked key back in nor turns every client away.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use polygw::core::client_key::{check_access, hash_key, looks_like_key, ClientKey, KeyDenial};
use polygw::core::ports::ClientKeyStore;

/// How often the ring reloads by default.
pub const DEFAULT_REFRESH: Duration = Duration::from_secs(2);

/// The keys of a key store, by hash.
#[derive(Debug, Clone)]
pub struct KeyRing {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: Arc<dyn ClientKeyStore>,
    every: Duration,
    keys: RwLock<Option<HashMap<String, Arc<ClientKey>>>>,
    warned: std::sync::Mutex<Option<Instant>>,
}

/// What a presented key is.
#[derive(Debug, Clone)]
pub enum Lookup {
    /// A valid key of the store.
    Valid(Arc<ClientKey>),
    /// A key of the store that was revoked.
    Revoked(String),
    /// Not a key of the store.
    Unknown,
    /// The store's keys were never loaded (its database unreachable since the start).
    Unavailable,
}

impl KeyRing {
    /// A ring over `store`, reloading every `every` once [`KeyRing::spawn_refresh`] runs.
    pub fn new(store: Arc<dyn ClientKeyStore>, every: Duration) -> KeyRing {
        KeyRing {
            inner: Arc::new(Inner {
                store,
                every,
                keys: RwLock::new(None),
                warned: std::sync::Mutex::new(None),
            }),
        }
    }

    /// The reload interval.
    pub fn refresh_every(&self) -> Duration {
        self.inner.every
    }

    /// Loads the store's keys now; the number of keys.
    pub async fn refresh(&self) -> Result<usize, polygw::core::TelemetryError> {
        let list = self.inner.store.list().await?;
        let n = list.len();
        let map = list
            .into_iter()
            .map(|k| (k.hash.clone(), Arc::new(k)))
            .collect();
        *self.inner.keys.write().unwrap_or_else(|e| e.into_inner()) = Some(map);
        Ok(n)
    }

    /// Reloads every [`KeyRing::refresh_every`] while the ring lives (a failure keeps the
    /// last keys and is logged once a minute).
    pub fn spawn_refresh(&self) {
        let weak = Arc::downgrade(&self.inner);
        let every = self.inner.every;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(inner) = weak.upgrade() else { return };
                let ring = KeyRing { inner };
                if let Err(e) = ring.refresh().await {
                    let mut w = ring.inner.warned.lock().unwrap_or_else(|e| e.into_inner());
                    let now = Instant::now();
                    if w.is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(60))
                    {
                        *w = Some(now);
                        tracing::warn!(error = %e, "reloading the client keys failed: the last keys loaded stay in force");
                    }
                }
            }
        });
    }

    /// What `presented` is.
    pub fn lookup(&self, presented: &str) -> Lookup {
        let keys = self.inner.keys.read().unwrap_or_else(|e| e.into_inner());
        let Some(keys) = keys.as_ref() else {
            return Lookup::Unavailable;
        };
        if !looks_like_key(presented.trim()) {
            return Lookup::Unknown;
        }
        match keys.get(&hash_key(presented)) {
            Some(k) if k.revoked_at_ms.is_some() => Lookup::Revoked(k.id.clone()),
            Some(k) => Lookup::Valid(k.clone()),
            None => Lookup::Unknown,
        }
    }
}

/// Whether `key` may call `scope` for `model`; the client's 403 otherwise.
pub fn access(key: &ClientKey, scope: &str, model: &str) -> Result<(), crate::errors::ApiError> {
    check_access(key, scope, model).map_err(|d| {
        let code = match d {
            KeyDenial::Revoked => "invalid_api_key",
            KeyDenial::Scope(_) | KeyDenial::Model(_) => "model_not_allowed",
        };
        let mut e = crate::errors::ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            "permission_error",
            code,
            d.message(&key.id),
        );
        e.should_retry = Some(false);
        e
    })
}

/// A call's admission against the client key it came with (none: nothing to charge):
/// the key's scopes and models, then its limits and budgets. The charge goes into the
/// call's options.
pub async fn admit(
    key: Option<&Arc<ClientKey>>,
    scope: &str,
    model: &str,
    admitted: impl AsyncFnOnce(
        &ClientKey,
    ) -> Result<
        Arc<polygw::client_keys::KeyCharge>,
        polygw::client_keys::KeyAdmitError,
    >,
) -> Result<Option<Arc<polygw::client_keys::KeyCharge>>, crate::errors::ApiError> {
    let Some(key) = key else { return Ok(None) };
    access(key, scope, model)?;
    match admitted(key).await {
        Ok(c) => Ok(Some(c)),
        Err(polygw::client_keys::KeyAdmitError::Refused {
            refusal,
            reserve_nanos,
            est_tokens,
        }) => {
            let req = polygw::core::ports::KeyAcquire {
                key_id: &key.id,
                rpm: key.limits.rpm,
                tpm: key.limits.tpm,
                max_concurrency: key.limits.max_concurrency,
                budget_day_nanos: key.limits.budget_day_nanos,
                budget_month_nanos: key.limits.budget_month_nanos,
                est_tokens,
                reserve_nanos,
                lease: Duration::ZERO,
                top_up: false,
            };
            Err(crate::errors::from_key_refusal(
                &refusal,
                &req,
                crate::http::unix_now_ms(),
            ))
        }
        Err(polygw::client_keys::KeyAdmitError::Backend(e)) => {
            let mut api = crate::errors::ApiError::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "governance_backend",
                format!("the client key's limits could not be checked: {e}"),
            );
            api.retry_after = Some(1);
            Err(api)
        }
    }
}
