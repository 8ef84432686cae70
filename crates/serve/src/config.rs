//! The proxy's settings ([`ProxyConfig`]: what the router does) and the server's
//! ([`ServerLimits`]: what one listening socket accepts). `Default` gives the
//! documented values (docs/SERVE.md).

use std::time::Duration;

use polygw::core::Secret;

/// What the router does with requests. `Default` is a keyless proxy on loopback
/// semantics (see `client_keys`).
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Client bearer keys (`POLYGW_PROXY_KEYS`), compared in constant time. Empty: no
    /// key is asked, and every request must then pass the loopback checks instead
    /// (`Host` a loopback name or one of `allowed_hosts`, `Origin` absent or loopback
    /// or one of `allowed_origins`, a JSON `Content-Type` on POST).
    pub client_keys: Vec<Secret>,
    /// Extra `Host` values accepted without client keys (`name` or `name:port`).
    pub allowed_hosts: Vec<String>,
    /// Extra `Origin` values accepted without client keys (`scheme://host[:port]`).
    pub allowed_origins: Vec<String>,
    /// The largest request body (bytes); over it: 413.
    pub max_body_bytes: usize,
    /// The whole request body must arrive within this (else 408).
    pub body_timeout: Duration,
    /// The longest request target (bytes); over it: 414.
    pub max_uri_bytes: usize,
    /// A call that cannot be admitted (quota, cooldown on an upstream hint, the
    /// scope's queue) for this long ends as a 429 `rate_limit_exceeded` with
    /// `Retry-After` (`--max-wait-s`).
    pub max_wait: Duration,
    /// A streamed call with no committed leg after this long gets its 200 headers and
    /// an SSE comment (`: keepalive`) every `keepalive` until its first chunk
    /// (`--keepalive-s`).
    pub keepalive: Duration,
    /// Calls running at once per scope (`--max-calls-per-scope`).
    pub max_calls_per_scope: usize,
    /// Calls waiting for one of those slots, per scope; beyond it: 429 at once
    /// (`--max-queued-per-scope`).
    pub max_queued_per_scope: usize,
    /// Client keys of a key store (`POLYGW_KEYS_DB`, SPEC §21.1), with their scopes,
    /// models, limits and budgets; alongside `client_keys`. Loaded (and reloading) before
    /// the proxy serves.
    pub key_ring: Option<crate::keys::KeyRing>,
    /// The key of the admin routes (`POLYGW_ADMIN_KEY`, SPEC §26.3); `None`: they answer
    /// 404.
    pub admin_key: Option<Secret>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            client_keys: Vec::new(),
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            max_body_bytes: 10 * 1024 * 1024,
            body_timeout: Duration::from_secs(60),
            max_uri_bytes: 8 * 1024,
            max_wait: Duration::from_secs(10),
            keepalive: Duration::from_secs(15),
            max_calls_per_scope: 256,
            max_queued_per_scope: 1024,
            key_ring: None,
            admin_key: None,
        }
    }
}

/// What one listening socket accepts ([`crate::serve`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerLimits {
    /// A request head (request line and headers) must be complete within this, from
    /// its first byte (else 408 and the connection closes).
    pub header_timeout: Duration,
    /// A connection with no request for this long is closed (keep-alive idle), and so
    /// is one whose answer the client has not read for this long (a blocked write).
    pub idle_timeout: Duration,
    /// The largest request head (bytes); over it: 431 and the connection closes.
    pub max_header_bytes: usize,
    /// Open connections in total; beyond it a new connection gets a 503 and is closed.
    pub max_connections: usize,
    /// Open connections per client address; beyond it: 429 and closed.
    pub max_connections_per_client: usize,
    /// On shutdown, how long in-flight calls may take to finish; then open streams
    /// get an error event and plain calls a 503, and the connections close.
    pub grace: Duration,
}

/// The default cap of open connections when the file-descriptor limit is unknown.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_header_bytes: 64 * 1024,
            max_connections: default_max_connections(),
            max_connections_per_client: 64,
            grace: Duration::from_secs(30),
        }
    }
}

/// Half the process's open-file limit (the other half stays for upstream connections,
/// telemetry and Redis), between 64 and 16 384; [`DEFAULT_MAX_CONNECTIONS`] when the
/// limit cannot be read (`/proc/self/limits`, Linux).
pub fn default_max_connections() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|soft| soft.parse::<usize>().ok())
        })
        .map(|soft| (soft / 2).clamp(64, 16_384))
        .unwrap_or(DEFAULT_MAX_CONNECTIONS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = ProxyConfig::default();
        assert_eq!(c.max_body_bytes, 10 * 1024 * 1024);
        assert_eq!(c.max_wait, Duration::from_secs(10));
        assert_eq!(c.keepalive, Duration::from_secs(15));
        let l = ServerLimits::default();
        assert_eq!(l.max_header_bytes, 64 * 1024);
        assert!((64..=16_384).contains(&l.max_connections));
    }
}
