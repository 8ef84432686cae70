//! Local services for integration tests (Redis, PostgreSQL).
//!
//! Under `CI=true` a missing service is a test failure, never a skip. Outside CI a test
//! that needs a missing service prints why and returns early (skips).

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Whether this run is CI (`CI=true`): services are then mandatory.
pub fn in_ci() -> bool {
    std::env::var("CI")
        .map(|v| v == "true" || v == "1")
        .unwrap_or(false)
}

fn reachable(host_port: &str) -> bool {
    let addrs: Vec<SocketAddr> = match host_port.to_socket_addrs() {
        Ok(a) => a.collect(),
        Err(_) => return false,
    };
    addrs
        .iter()
        .any(|a| TcpStream::connect_timeout(a, Duration::from_millis(500)).is_ok())
}

fn service(name: &str, env_key: &str, default_url: &str, host_port: &str) -> Option<String> {
    let url = std::env::var(env_key).unwrap_or_else(|_| default_url.to_string());
    let hp = url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.rsplit('@').next())
        .and_then(|rest| rest.split('/').next())
        .filter(|s| !s.is_empty())
        .unwrap_or(host_port)
        .to_string();
    if reachable(&hp) {
        return Some(url);
    }
    if in_ci() {
        panic!(
            "{name} is required under CI=true but {hp} is not reachable \
             (set {env_key} or start the service; .ci/run starts it)"
        );
    }
    eprintln!("skipping: {name} is not reachable at {hp} (set {env_key} to point elsewhere)");
    None
}

/// The Redis URL to test against (`POLYGW_TEST_REDIS_URL`, default
/// `redis://127.0.0.1:6379`), or `None` (skip) outside CI when it is down.
pub fn redis_url() -> Option<String> {
    service(
        "Redis",
        "POLYGW_TEST_REDIS_URL",
        "redis://127.0.0.1:6379",
        "127.0.0.1:6379",
    )
}

/// The PostgreSQL URL to test against (`POLYGW_TEST_POSTGRES_URL`, default
/// `postgres://postgres@127.0.0.1:5432/test`), or `None` (skip) outside CI when down.
pub fn postgres_url() -> Option<String> {
    service(
        "PostgreSQL",
        "POLYGW_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
        "127.0.0.1:5432",
    )
}

/// A name unique to this process and call, for keys, schemas and files.
pub fn unique_name(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    #[allow(clippy::disallowed_methods)]
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        t % 1_000_000_000,
        N.fetch_add(1, Ordering::Relaxed)
    )
}
