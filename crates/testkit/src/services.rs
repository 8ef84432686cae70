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

/// The Redis Cluster URL to test against (`POLYGW_TEST_REDIS_CLUSTER_URL`, default
/// `redis+cluster://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003`, the cluster `.ci/run`
/// starts with `.ci/redis-cluster.sh`), or `None` (skip) outside CI when a node is down.
pub fn redis_cluster_url() -> Option<String> {
    const KEY: &str = "POLYGW_TEST_REDIS_CLUSTER_URL";
    let url = std::env::var(KEY).unwrap_or_else(|_| {
        "redis+cluster://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003".to_string()
    });
    let hosts = url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.rsplit('@').next())
        .and_then(|rest| rest.split(['/', '?']).next())
        .unwrap_or_default()
        .to_string();
    let down: Vec<&str> = hosts.split(',').filter(|hp| !reachable(hp)).collect();
    if !hosts.is_empty() && down.is_empty() {
        return Some(url);
    }
    if in_ci() {
        panic!(
            "a Redis Cluster is required under CI=true but {down:?} of {hosts} is not reachable \
             (set {KEY} or run .ci/redis-cluster.sh; .ci/run starts it)"
        );
    }
    eprintln!(
        "skipping: the Redis Cluster is not reachable at {hosts} (run .ci/redis-cluster.sh, \
         or set {KEY})"
    );
    None
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

/// A `redis-server` this test starts on a free port of 127.0.0.1, under a temporary
/// directory, and can stop and start again on the same port (outage tests; never the
/// shared server on 6379). Killed (by its process id) when dropped.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: std::path::PathBuf,
    args: Vec<String>,
    child: Option<std::process::Child>,
}

impl RedisServer {
    /// Starts a plain server (`--port P`, no persistence).
    pub fn start() -> Result<RedisServer, String> {
        Self::start_with(|port| vec!["--port".into(), port.to_string()])
    }

    /// Starts a server with the listening arguments `listen(port)` returns (e.g. TLS:
    /// `--port 0 --tls-port P …`), no persistence, data and log in a temporary directory.
    pub fn start_with(listen: impl Fn(u16) -> Vec<String>) -> Result<RedisServer, String> {
        let port = free_port()?;
        let dir = std::env::temp_dir().join(unique_name("polygw-redis"));
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let mut args = listen(port);
        args.extend(
            [
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--logfile",
                "redis.log",
            ]
            .map(String::from),
        );
        let mut s = RedisServer {
            port,
            dir,
            args,
            child: None,
        };
        s.restart()?;
        Ok(s)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:P`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Its directory (its log is `redis.log` there).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Whether it is running.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills it (an outage: connections drop, the port refuses).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it (again) on the same port; waits until it accepts connections.
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        let child = std::process::Command::new("redis-server")
            .args(&self.args)
            .current_dir(&self.dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run redis-server: {e}"))?;
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port);
        for _ in 0..100 {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    self.child = None;
                    let log =
                        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(5).collect();
                    return Err(format!("redis-server exited ({status}): {tail:?}"));
                }
            }
            if reachable(&addr) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.stop();
        Err(format!("redis-server did not listen on {addr} within 5 s"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A port nothing listens on now.
pub fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// Starts an own [`RedisServer`], or — when that is impossible — skips (prints why and
/// returns `None`) outside CI and panics under `CI=true`.
pub fn own_redis_server() -> Option<RedisServer> {
    match RedisServer::start() {
        Ok(s) => Some(s),
        Err(e) if in_ci() => panic!("an own redis-server is required under CI=true: {e}"),
        Err(e) => {
            eprintln!("skipping: cannot start an own redis-server: {e}");
            None
        }
    }
}
