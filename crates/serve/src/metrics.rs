//! The proxy's own counters for `/metrics` (next to the library's): authentication
//! failures, requests refused before any call, connections accepted, refused and
//! closed by a limit, and the scopes' gates. Failed authentications are also logged,
//! at most one line per [`AUTH_LOG_EVERY`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The least time between two log lines about failed authentications.
pub const AUTH_LOG_EVERY: Duration = Duration::from_secs(10);

/// Counters of the proxy and its server.
#[derive(Debug, Default)]
pub struct ProxyCounters {
    auth_failures: AtomicU64,
    auth_log: Mutex<AuthLog>,
    refused: Mutex<BTreeMap<&'static str, u64>>,
    connections: Mutex<BTreeMap<&'static str, u64>>,
    closed: Mutex<BTreeMap<&'static str, u64>>,
    open: AtomicU64,
}

#[derive(Debug, Default)]
struct AuthLog {
    last: Option<Instant>,
    unlogged: u64,
}

fn bump(m: &Mutex<BTreeMap<&'static str, u64>>, k: &'static str) {
    *m.lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(k)
        .or_default() += 1;
}

impl ProxyCounters {
    /// A request without a valid client key: counted, and logged at a bounded rate.
    pub fn auth_failed(&self, peer: Option<SocketAddr>, why: &str) {
        self.auth_failures.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let mut log = self.auth_log.lock().unwrap_or_else(|e| e.into_inner());
        log.unlogged += 1;
        if log
            .last
            .is_some_and(|t| now.duration_since(t) < AUTH_LOG_EVERY)
        {
            return;
        }
        let n = std::mem::take(&mut log.unlogged);
        log.last = Some(now);
        drop(log);
        let peer = peer.map_or_else(|| "unknown".to_string(), |p| p.ip().to_string());
        tracing::warn!(
            failures = n,
            client = %peer,
            "authentication failed ({why}); {n} failure(s) since the last such line (at most one line per {} s)",
            AUTH_LOG_EVERY.as_secs()
        );
    }

    /// Failed authentications so far.
    pub fn auth_failures(&self) -> u64 {
        self.auth_failures.load(Ordering::Relaxed)
    }

    /// A request refused before any call (`host`, `origin`, `content_type`, …).
    pub fn refused(&self, reason: &'static str) {
        bump(&self.refused, reason);
    }

    /// A connection accepted, or refused at a cap (`accepted`, `refused_total`,
    /// `refused_per_client`).
    pub fn connection(&self, outcome: &'static str) {
        bump(&self.connections, outcome);
    }

    /// A connection closed by a limit (`header_timeout`, `header_too_large`, `idle`,
    /// `write_stalled`, `body_timeout`).
    pub fn closed(&self, reason: &'static str) {
        bump(&self.closed, reason);
    }

    /// One more open connection.
    pub fn opened(&self) {
        self.open.fetch_add(1, Ordering::Relaxed);
    }

    /// One less open connection.
    pub fn gone(&self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }

    /// Connections open now.
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    /// Count of a refusal reason (tests).
    pub fn refused_count(&self, reason: &str) -> u64 {
        self.refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(reason)
            .copied()
            .unwrap_or(0)
    }

    /// Prometheus text; `gates` is (scope, running, waiting, refused) per scope.
    pub fn render(&self, gates: &[(String, usize, usize, u64)]) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# HELP polygw_proxy_auth_failures_total Requests refused for a missing or wrong client key."
        );
        let _ = writeln!(s, "# TYPE polygw_proxy_auth_failures_total counter");
        let _ = writeln!(
            s,
            "polygw_proxy_auth_failures_total {}",
            self.auth_failures()
        );
        let maps = [
            (
                "polygw_proxy_requests_refused_total",
                "Requests refused before any call, by reason.",
                "reason",
                &self.refused,
            ),
            (
                "polygw_proxy_connections_total",
                "Connections accepted or refused at a cap.",
                "outcome",
                &self.connections,
            ),
            (
                "polygw_proxy_connections_closed_total",
                "Connections closed by a limit, by reason.",
                "reason",
                &self.closed,
            ),
        ];
        for (name, help, label, m) in maps {
            let _ = writeln!(s, "# HELP {name} {help}");
            let _ = writeln!(s, "# TYPE {name} counter");
            for (k, n) in m.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                let _ = writeln!(s, "{name}{{{label}=\"{k}\"}} {n}");
            }
        }
        let _ = writeln!(
            s,
            "# HELP polygw_proxy_connections_open Connections open now."
        );
        let _ = writeln!(s, "# TYPE polygw_proxy_connections_open gauge");
        let _ = writeln!(s, "polygw_proxy_connections_open {}", self.open());
        let _ = writeln!(
            s,
            "# HELP polygw_proxy_scope_calls Calls of a scope running or waiting for a slot now."
        );
        let _ = writeln!(s, "# TYPE polygw_proxy_scope_calls gauge");
        for (scope, running, waiting, _) in gates {
            let _ = writeln!(
                s,
                "polygw_proxy_scope_calls{{scope=\"{scope}\",state=\"running\"}} {running}"
            );
            let _ = writeln!(
                s,
                "polygw_proxy_scope_calls{{scope=\"{scope}\",state=\"waiting\"}} {waiting}"
            );
        }
        let _ = writeln!(
            s,
            "# HELP polygw_proxy_scope_calls_refused_total Calls turned away by a scope's cap and queue (429)."
        );
        let _ = writeln!(s, "# TYPE polygw_proxy_scope_calls_refused_total counter");
        for (scope, _, _, refused) in gates {
            let _ = writeln!(
                s,
                "polygw_proxy_scope_calls_refused_total{{scope=\"{scope}\"}} {refused}"
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn auth_failures_are_all_counted_and_logged_at_a_bounded_rate() {
        let c = ProxyCounters::default();
        for _ in 0..1000 {
            c.auth_failed(None, "wrong key");
        }
        assert_eq!(c.auth_failures(), 1000);
        // One line was written; the other 999 wait for the next line.
        assert_eq!(c.auth_log.lock().unwrap().unlogged, 999);
        tokio::time::advance(AUTH_LOG_EVERY).await;
        c.auth_failed(None, "wrong key");
        assert_eq!(c.auth_log.lock().unwrap().unlogged, 0);
        let text = c.render(&[("LLM".into(), 1, 2, 3)]);
        assert!(
            text.contains("polygw_proxy_auth_failures_total 1001"),
            "{text}"
        );
        assert!(text.contains("polygw_proxy_scope_calls{scope=\"LLM\",state=\"waiting\"} 2"));
    }
}
