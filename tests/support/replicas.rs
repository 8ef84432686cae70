//! The multi-replica deployment of docs/DEPLOYMENT.md, started by a test: three
//! `polygw serve` processes run from `deploy/polygw@.service`'s `ExecStart` with the
//! environment of `deploy/polygw.env.example` (test values for the addresses and the
//! secrets), behind a real HAProxy running `deploy/haproxy.cfg` (test ports and check
//! timings), one in-process mock upstream per replica (so that every upstream request
//! is known to come from one replica), a Redis Cluster for governance and PostgreSQL
//! for telemetry.
//!
//! - [`services`]: HAProxy, the Redis Cluster and PostgreSQL, or a skip (a failure under
//!   `CI=true`, `polygw_testkit::services`' rule).
//! - [`Deployment`]: the whole setup, torn down on drop (every child killed by its id).
//! - [`OwnCluster`]: a 3-node Redis Cluster of the test's own (outage tests never stop
//!   the shared one other suites use).
//! - [`eventually`]: polls a condition until a deadline (no bare sleeps).

#![allow(dead_code)] // each test uses a subset

use std::collections::BTreeMap;
use std::future::Future;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::types::chat::{
    ChatCompletionRequestMessage, ChatCompletionRequestUserMessageArgs,
    ChatCompletionStreamOptions, CreateChatCompletionRequestArgs,
};
use async_openai::Client;
use futures_util::StreamExt;
use polygw::core::TelemetryRow;
use polygw_mock_upstream::{Behavior, MockConfig, MockUpstream, Prices};
use polygw_testkit::services::{free_port, in_ci, postgres_url, redis_cluster_url, unique_name};
use tokio::time::Instant;

/// The program under test (this package's own build of `polygw`).
pub const BIN: &str = env!("CARGO_BIN_EXE_polygw-under-test");

/// Where the unit's `ExecStart` runs the program in a real install.
const INSTALLED_BIN: &str = "/usr/local/bin/polygw";

/// The scope of `deploy/polygw.env.example`; each test renames it to a scope of its own
/// (the Redis Cluster and the database are shared with other tests).
const EXAMPLE_SCOPE: &str = "LLM";

/// The example's one source (`LLM__OPENAI__0__…`) is named `openai-0`.
pub const SOURCE: &str = "openai-0";

/// The client key the tests use (the example's are placeholders).
pub const CLIENT_KEY: &str = "replicas-client-key-0123456789";

/// The upstream key the replicas send (each mock requires it).
const UPSTREAM_KEY: &str = "sk-replicas-upstream-key-0123456789";

/// The workspace's root (this package is `tests/`).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A file of `deploy/`.
pub fn deploy(file: &str) -> PathBuf {
    root().join("deploy").join(file)
}

// === services ==========================================================================

/// What a deployment needs besides the program.
#[derive(Debug, Clone)]
pub struct Services {
    /// The `haproxy` program.
    pub haproxy: PathBuf,
    /// The shared local Redis Cluster (`.ci/redis-cluster.sh`).
    pub cluster: String,
    /// PostgreSQL.
    pub postgres: String,
}

/// The services, or `None` (the test prints why and skips) outside CI; under `CI=true`
/// a missing one fails the test.
pub fn services() -> Option<Services> {
    let haproxy = haproxy_program()?;
    let cluster = redis_cluster_url()?;
    let postgres = postgres_url()?;
    Some(Services {
        haproxy,
        cluster,
        postgres,
    })
}

/// `haproxy` (`POLYGW_TEST_HAPROXY`, else on `PATH` or in `/usr/sbin`), checked to run.
fn haproxy_program() -> Option<PathBuf> {
    let candidates: Vec<PathBuf> = match std::env::var_os("POLYGW_TEST_HAPROXY") {
        Some(p) => vec![PathBuf::from(p)],
        None => std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
            .map(|d| d.join("haproxy"))
            .collect(),
    };
    let found = candidates.into_iter().find(|p| {
        Command::new(p)
            .arg("-v")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    match found {
        Some(p) => Some(p),
        None if in_ci() => panic!(
            "HAProxy is required under CI=true but no working `haproxy` was found \
             (.ci/run installs Debian's haproxy package; POLYGW_TEST_HAPROXY points elsewhere)"
        ),
        None => {
            eprintln!(
                "skipping: HAProxy is not installed (apt-get install haproxy, or set \
                 POLYGW_TEST_HAPROXY)"
            );
            None
        }
    }
}

// === deploy/ files, as systemd would read them =========================================

/// `KEY=value` lines of a systemd `EnvironmentFile` (blank lines and `#`/`;` comments
/// skipped; a value in matching quotes loses them), in file order.
pub fn env_file(path: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .enumerate()
        .map(|(n, l)| (n + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#') && !l.starts_with(';'))
        .map(|(n, l)| {
            let (k, v) = l
                .split_once('=')
                .unwrap_or_else(|| panic!("{}:{n}: not KEY=value: {l}", path.display()));
            let v = v.trim();
            let v = ['"', '\'']
                .iter()
                .find_map(|q| v.strip_prefix(*q).and_then(|x| x.strip_suffix(*q)))
                .unwrap_or(v);
            (k.trim().to_string(), v.to_string())
        })
        .collect()
}

/// The command line of the unit's `ExecStart` for instance `instance`: `%i` replaced,
/// `${NAME}` expanded from `env` as systemd does (one word each). Any other specifier or
/// an undefined variable is a failure: the unit and the env file must agree.
pub fn exec_start(unit: &Path, env: &BTreeMap<String, String>, instance: &str) -> Vec<String> {
    let text = std::fs::read_to_string(unit)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", unit.display()));
    assert!(
        text.lines()
            .any(|l| l.trim() == "EnvironmentFile=/etc/polygw/polygw.env"),
        "{} reads its environment from /etc/polygw/polygw.env (docs/DEPLOYMENT.md)",
        unit.display()
    );
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("ExecStart="))
        .unwrap_or_else(|| panic!("{} has no ExecStart=", unit.display()));
    line.split_whitespace()
        .map(|w| expand(w, env, instance))
        .collect()
}

fn expand(word: &str, env: &BTreeMap<String, String>, instance: &str) -> String {
    let mut out = String::new();
    let mut rest = word;
    while let Some(i) = rest.find(['%', '$']) {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("%i") {
            out.push_str(instance);
            rest = t;
        } else if let Some(t) = tail.strip_prefix("%%") {
            out.push('%');
            rest = t;
        } else if let Some(t) = tail.strip_prefix("${") {
            let end = t
                .find('}')
                .unwrap_or_else(|| panic!("unclosed ${{ in ExecStart word {word}"));
            let name = &t[..end];
            let v = env.get(name).unwrap_or_else(|| {
                panic!("ExecStart uses ${{{name}}}, which deploy/polygw.env.example does not set")
            });
            out.push_str(v);
            rest = &t[end + 1..];
        } else {
            panic!("ExecStart word {word}: only %i, %% and ${{NAME}} are supported here");
        }
    }
    out.push_str(rest);
    out
}

/// `deploy/haproxy.cfg` with the test's ports, check timings and stats socket, and
/// without the process lines of `global` that belong to a service manager. Every
/// replaced line must be in the file exactly once: a changed file fails here, loudly.
pub fn haproxy_config(template: &str, port: u16, servers: &[String; 3], dir: &Path) -> String {
    let subs: Vec<(&str, String)> = vec![
        ("    bind :8080\n", format!("    bind 127.0.0.1:{port}\n")),
        (
            "    server polygw-1 127.0.0.1:8081\n",
            format!("    server polygw-1 {}\n", servers[0]),
        ),
        (
            "    server polygw-2 127.0.0.1:8082\n",
            format!("    server polygw-2 {}\n", servers[1]),
        ),
        (
            "    server polygw-3 127.0.0.1:8083\n",
            format!("    server polygw-3 {}\n", servers[2]),
        ),
        (
            "inter 2s fastinter 500ms downinter 1s",
            "inter 100ms fastinter 100ms downinter 100ms".into(),
        ),
        (
            "    stats socket /run/haproxy/admin.sock ",
            format!("    stats socket {}/admin.sock ", dir.display()),
        ),
        (
            "    log /dev/log local0\n",
            "    log stdout format raw local0\n".into(),
        ),
        ("    log /dev/log local1 notice\n", String::new()),
        ("    chroot /var/lib/haproxy\n", String::new()),
        ("    user haproxy\n", String::new()),
        ("    group haproxy\n", String::new()),
        ("    daemon\n", String::new()),
    ];
    let mut cfg = template.to_string();
    for (from, to) in subs {
        assert_eq!(
            cfg.matches(from).count(),
            1,
            "deploy/haproxy.cfg no longer has `{}` once: update tests/support/replicas.rs \
             (the suite runs the file as written, with only these lines changed)",
            from.trim()
        );
        cfg = cfg.replace(from, &to);
    }
    cfg
}

// === processes =========================================================================

/// Every line a child prints, and the first line matching a prefix, through a channel.
fn capture(child: &mut Child) -> (Arc<Mutex<Vec<String>>>, mpsc::Receiver<String>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = mpsc::channel();
    let pipes: Vec<Box<dyn Read + Send>> = vec![
        Box::new(child.stdout.take().expect("piped stdout")),
        Box::new(child.stderr.take().expect("piped stderr")),
    ];
    for pipe in pipes {
        let (log, tx) = (log.clone(), tx.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                log.lock().unwrap().push(line.clone());
                let _ = tx.send(line);
            }
        });
    }
    (log, rx)
}

/// Sends a signal (`TERM`, `KILL`, …) to a process by its id.
pub fn signal(pid: u32, name: &str) {
    let ok = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{name} {pid}");
}

/// One `polygw serve` replica.
pub struct Replica {
    pub name: String,
    child: Child,
    /// `127.0.0.1:PORT`, from its start line.
    pub addr: String,
    log: Arc<Mutex<Vec<String>>>,
    exited: Option<ExitStatus>,
}

impl Replica {
    /// Runs `argv` (the unit's `ExecStart`, the installed path replaced by the program
    /// under test) with exactly `env` (plus `PATH`), and waits for its start line.
    pub fn spawn(name: &str, argv: &[String], env: &[(String, String)]) -> Replica {
        assert_eq!(
            argv[0], INSTALLED_BIN,
            "the unit runs {INSTALLED_BIN} (docs/DEPLOYMENT.md installs it there)"
        );
        let mut child = Command::new(BIN)
            .args(&argv[1..])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn polygw serve");
        let (log, rx) = capture(&mut child);
        let until = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            let left = until.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.split(" on http://").nth(1) {
                        break rest.split('/').next().unwrap_or_default().to_string();
                    }
                }
                Err(_) => {
                    let status = child.try_wait().ok().flatten();
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "replica {name} did not start ({status:?}):\n{}",
                        log.lock().unwrap().join("\n")
                    );
                }
            }
        };
        Replica {
            name: name.to_string(),
            child,
            addr,
            log,
            exited: None,
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, and reaped.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        self.exited = self.child.wait().ok();
    }

    /// SIGTERM (a drain).
    pub fn terminate(&self) {
        signal(self.pid(), "TERM");
    }

    /// Waits (polling) for the process to exit, at most `limit`.
    pub async fn exit_status(&mut self, limit: Duration) -> ExitStatus {
        let until = Instant::now() + limit;
        loop {
            if let Some(s) = self.exited {
                return s;
            }
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                self.exited = Some(s);
                return s;
            }
            assert!(
                Instant::now() < until,
                "replica {} still running after {limit:?}:\n{}",
                self.name,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Everything it printed so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// Waits until it printed a line containing `needle`.
    pub async fn wait_for_line(&self, needle: &str, limit: Duration) -> String {
        let mut found = None;
        eventually(&format!("{} printed {needle:?}", self.name), limit, || {
            found = self
                .log
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.contains(needle))
                .cloned();
            std::future::ready(found.is_some())
        })
        .await;
        found.unwrap_or_default()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if self.exited.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// HAProxy running the generated configuration in the foreground (`-db`).
pub struct Haproxy {
    child: Child,
    pub port: u16,
    dir: tempfile::TempDir,
    log: Arc<Mutex<Vec<String>>>,
}

impl Haproxy {
    /// Starts HAProxy in front of `servers` on a free port (another one if that port
    /// was taken meanwhile), and waits until its stats socket answers.
    pub fn start(program: &Path, servers: &[String; 3]) -> Haproxy {
        let template = std::fs::read_to_string(deploy("haproxy.cfg")).expect("deploy/haproxy.cfg");
        let mut last = String::new();
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("tempdir");
            let port = free_port().expect("a free port");
            let cfg = dir.path().join("haproxy.cfg");
            std::fs::write(&cfg, haproxy_config(&template, port, servers, dir.path()))
                .expect("write haproxy.cfg");
            let check = Command::new(program)
                .args(["-c", "-f"])
                .arg(&cfg)
                .output()
                .expect("run haproxy -c");
            assert!(
                check.status.success(),
                "haproxy -c refuses the generated configuration:\n{}{}",
                String::from_utf8_lossy(&check.stdout),
                String::from_utf8_lossy(&check.stderr)
            );
            let mut child = Command::new(program)
                .args(["-db", "-f"])
                .arg(&cfg)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn haproxy");
            let (log, _rx) = capture(&mut child);
            let mut h = Haproxy {
                child,
                port,
                dir,
                log,
            };
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until {
                if let Ok(Some(_)) = h.child.try_wait() {
                    break;
                }
                if h.stat().is_ok() && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return h;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = h.child.kill();
            let _ = h.child.wait();
            last = h.log();
        }
        panic!("HAProxy did not start:\n{last}");
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Everything it printed (its request log included).
    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    fn stat(&self) -> std::io::Result<String> {
        let mut s = UnixStream::connect(self.dir.path().join("admin.sock"))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.write_all(b"show stat\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    }

    /// The status of every request HAProxy answered (its request log, `option
    /// httplog`: the field after the timers).
    pub fn statuses(&self) -> Vec<u16> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(" \"POST ") || l.contains(" \"GET /v1"))
            .filter_map(|l| l.split_whitespace().nth(5)?.parse().ok())
            .collect()
    }

    /// Every request HAProxy logged so far was answered 200: no error reached a client
    /// (async-openai's default client would retry a 5xx out of sight).
    pub fn assert_all_answered_200(&self) {
        let st = self.statuses();
        assert!(!st.is_empty(), "HAProxy logged no request:\n{}", self.log());
        assert!(
            st.iter().all(|s| *s == 200),
            "HAProxy answered {st:?}:\n{}",
            self.log()
        );
    }

    /// The backend's servers and their status (`UP`, `DOWN`, `UP 1/2`, …), from the
    /// stats socket.
    pub fn servers(&self) -> BTreeMap<String, String> {
        let text = self.stat().expect("HAProxy's stats socket");
        let mut lines = text.lines();
        let header: Vec<&str> = lines
            .next()
            .unwrap_or_default()
            .trim_start_matches("# ")
            .split(',')
            .collect();
        let col = |name: &str| header.iter().position(|h| *h == name).expect("stat column");
        let (px, sv, st) = (col("pxname"), col("svname"), col("status"));
        lines
            .map(|l| l.split(',').collect::<Vec<_>>())
            .filter(|f| f.len() > st && f[px] == "polygw_replicas" && f[sv].starts_with("polygw-"))
            .map(|f| (f[sv].to_string(), f[st].to_string()))
            .collect()
    }

    /// Waits until HAProxy sees each server in the given state (`UP` or `DOWN`).
    pub async fn wait_states(&self, want: [&str; 3], limit: Duration) {
        let names = ["polygw-1", "polygw-2", "polygw-3"];
        let mut seen = BTreeMap::new();
        eventually(
            &format!("HAProxy sees the replicas {want:?}"),
            limit,
            || {
                seen = self.servers();
                std::future::ready(
                    names
                        .iter()
                        .zip(want)
                        .all(|(n, w)| seen.get(*n).is_some_and(|s| s == w)),
                )
            },
        )
        .await;
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// === the deployment ====================================================================

/// A deployment's knobs.
pub struct Options {
    /// The Redis (Cluster) URL of governance.
    pub redis_url: String,
    /// Scope keys set on top of the example's (`LIMITS__LEASE_S`, …).
    pub scope_keys: Vec<(&'static str, String)>,
    /// `POLYGW_GRACE_S` (the example's is 30).
    pub grace_s: u32,
    /// What every mock answers.
    pub behavior: Behavior,
    /// Process variables set on top of the example's (`POLYGW_KEYS_DB`, …).
    pub env: Vec<(&'static str, String)>,
}

/// Three replicas, their mocks, HAProxy in front.
pub struct Deployment {
    /// The scope this deployment serves (the example's `LLM`, renamed).
    pub scope: String,
    pub mocks: Vec<MockUpstream>,
    pub replicas: Vec<Replica>,
    pub lb: Haproxy,
    pub redis_url: String,
    pub postgres: String,
    /// The mocks' prices: the example's `INPUT_PRICE` / `OUTPUT_PRICE`.
    pub prices: Prices,
    /// Unix ms when it started (rows are read from then on).
    pub started_ms: i64,
    /// A connection to the governance backend, made on first use.
    governance: tokio::sync::OnceCell<polygw_limiter_redis::RedisGovernance>,
}

fn now_ms() -> i64 {
    #[allow(clippy::disallowed_methods)]
    let t = std::time::SystemTime::now();
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Deployment {
    /// Starts it and waits until HAProxy sees the three replicas ready.
    pub async fn start(svc: &Services, opts: Options) -> Deployment {
        let started_ms = now_ms() - 1_000;
        // A name of letters and digits only: a scope name, a model name, a key tag.
        let scope = unique_name("REPL")
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .collect::<String>()
            .to_uppercase();
        let example = env_file(&deploy("polygw.env.example"));
        let get = |k: &str| {
            example
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("deploy/polygw.env.example has no {k}"))
        };
        // A price set by the test (`opts.scope_keys`) replaces the example's: the mocks
        // bill at the sources' prices, so that the bill is the spend.
        let price = |k: &str| -> f64 {
            let key = format!("OPENAI__0__{k}");
            opts.scope_keys
                .iter()
                .find(|(s, _)| *s == key)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| get(&format!("{EXAMPLE_SCOPE}__{key}")))
                .parse()
                .expect("a price")
        };
        let prices = Prices::new(price("INPUT_PRICE"), price("OUTPUT_PRICE"));
        let mut mocks = Vec::new();
        for _ in 0..3 {
            let m = MockUpstream::start(MockConfig {
                require_key: Some(UPSTREAM_KEY.into()),
                prices: Some(prices),
                ..MockConfig::default()
            })
            .await
            .expect("start a mock upstream");
            m.set_default(opts.behavior.clone());
            mocks.push(m);
        }
        let mut replicas = Vec::new();
        for (i, m) in mocks.iter().enumerate() {
            let env = replica_env(&example, &scope, m, &opts, svc);
            let map: BTreeMap<String, String> = env.iter().cloned().collect();
            // %i is the port: 0 asks for an ephemeral one (the start line says which).
            let argv = exec_start(&deploy("polygw@.service"), &map, "0");
            replicas.push(Replica::spawn(&format!("polygw-{}", i + 1), &argv, &env));
        }
        let servers: [String; 3] = std::array::from_fn(|i| replicas[i].addr.clone());
        let lb = Haproxy::start(&svc.haproxy, &servers);
        let d = Deployment {
            scope,
            mocks,
            replicas,
            lb,
            redis_url: opts.redis_url,
            postgres: svc.postgres.clone(),
            prices,
            started_ms,
            governance: tokio::sync::OnceCell::new(),
        };
        d.lb.wait_states(["UP"; 3], Duration::from_secs(20)).await;
        d
    }

    /// The model clients ask for: the scope's name.
    pub fn model(&self) -> String {
        self.scope.to_lowercase()
    }

    /// An OpenAI client through HAProxy.
    pub fn client(&self) -> Client<OpenAIConfig> {
        openai(&self.lb.base())
    }

    /// An OpenAI client straight to replica `i`.
    pub fn direct(&self, i: usize) -> Client<OpenAIConfig> {
        openai(&self.replicas[i].base())
    }

    /// Every upstream request of every mock: `(mock index, request)`.
    pub fn upstream_requests(&self) -> Vec<(usize, polygw_mock_upstream::RecordedRequest)> {
        self.mocks
            .iter()
            .enumerate()
            .flat_map(|(i, m)| m.requests().into_iter().map(move |r| (i, r)))
            .collect()
    }

    /// The governance backend the replicas share (one connection, made on first use).
    async fn governance(&self) -> &polygw_limiter_redis::RedisGovernance {
        self.governance
            .get_or_init(|| async {
                polygw_limiter_redis::RedisGovernance::connect(
                    &self.redis_url,
                    polygw_limiter_redis::RedisOptions::default(),
                )
                .await
                .expect("connect to the governance's Redis")
            })
            .await
    }

    /// A client key's figures on the shared governance (in flight, window, spend).
    pub async fn key_usage(&self, key_id: &str) -> polygw::core::ports::KeyUsage {
        use polygw::core::ports::RateLimiter;
        self.governance()
            .await
            .limiter()
            .key_usage(key_id)
            .await
            .expect("key_usage")
    }

    /// Runs `polygw keys ARGS` against the replicas' key store (`--db`, the telemetry
    /// database), off the runtime's threads; fails the test unless it exits 0.
    pub async fn keys(&self, args: &[&str]) -> KeysOutput {
        let mut argv = vec!["keys".to_string(), "--db".into(), self.postgres.clone()];
        argv.extend(args.iter().map(|a| a.to_string()));
        let out = tokio::task::spawn_blocking(move || {
            Command::new(BIN)
                .args(&argv)
                .env_clear()
                .env("PATH", std::env::var("PATH").unwrap_or_default())
                .stdin(Stdio::null())
                .output()
                .expect("run polygw keys")
        })
        .await
        .expect("polygw keys");
        let o = KeysOutput {
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        };
        assert!(
            out.status.success(),
            "polygw keys {args:?}: {:?}\n{}{}",
            out.status,
            o.stdout,
            o.stderr
        );
        o
    }

    /// `polygw keys create --name NAME LIMITS…`: the key (printed once) and its id.
    pub async fn create_key(&self, name: &str, limits: &[&str]) -> NewKey {
        let mut args = vec!["create", "--name", name];
        args.extend_from_slice(limits);
        let o = self.keys(&args).await;
        let secret = o.stdout.trim().to_string();
        assert!(secret.starts_with("pgw-"), "the key on stdout: {o:?}");
        // stderr: `client key key_… (NAME): shown once — …`
        let id = o
            .stderr
            .split_whitespace()
            .find(|w| w.starts_with("key_"))
            .unwrap_or_else(|| panic!("the key's id on stderr: {o:?}"))
            .to_string();
        NewKey { secret, id }
    }

    /// The scope's in-flight count on the shared governance.
    pub async fn in_flight(&self) -> u32 {
        let g = polygw_limiter_redis::RedisGovernance::connect(
            &self.redis_url,
            polygw_limiter_redis::RedisOptions::default(),
        )
        .await
        .expect("connect to the governance's Redis");
        use polygw::core::ports::RateLimiter;
        g.limiter()
            .in_flight(&self.scope, SOURCE)
            .await
            .expect("in_flight")
    }

    /// The scope's telemetry rows in PostgreSQL.
    pub async fn rows(&self) -> Vec<TelemetryRow> {
        polygw_telemetry_sql::read_rows(&self.postgres, Some(self.started_ms))
            .await
            .expect("read the telemetry rows")
            .into_iter()
            .filter(|r| *r.scope == *self.scope)
            .collect()
    }

    /// Prints what the processes said (on a failure, from the test's drop).
    pub fn dump(&self) {
        for r in &self.replicas {
            eprintln!("--- {} ---\n{}", r.name, r.log());
        }
        eprintln!("--- haproxy ---\n{}", self.lb.log());
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump();
        }
    }
}

/// What `polygw keys` printed.
#[derive(Debug, Clone)]
pub struct KeysOutput {
    pub stdout: String,
    pub stderr: String,
}

/// A key `polygw keys create` made.
#[derive(Debug, Clone)]
pub struct NewKey {
    /// The key itself (what a client sends).
    pub secret: String,
    /// Its public id (`client_key_id` of the rows, the governance's name for it).
    pub id: String,
}

/// The example's environment for one replica: its scope renamed to `scope`, the
/// secrets and addresses a test's own, `opts.scope_keys` and `opts.env` on top.
fn replica_env(
    example: &[(String, String)],
    scope: &str,
    mock: &MockUpstream,
    opts: &Options,
    svc: &Services,
) -> Vec<(String, String)> {
    let prefix = format!("{EXAMPLE_SCOPE}__");
    let mut env: Vec<(String, String)> = example
        .iter()
        .map(|(k, v)| match k.strip_prefix(&prefix) {
            Some(rest) => (format!("{scope}__{rest}"), v.clone()),
            None => (k.clone(), v.clone()),
        })
        .collect();
    let mut set = |k: String, v: String| {
        let slot = env
            .iter_mut()
            .find(|(key, _)| *key == k)
            .unwrap_or_else(|| panic!("deploy/polygw.env.example has no {k} to set"));
        slot.1 = v;
    };
    set("POLYGW_PROXY_KEYS".into(), CLIENT_KEY.into());
    set("POLYGW_GRACE_S".into(), opts.grace_s.to_string());
    set(format!("{scope}__OPENAI__0__BASE_URL"), mock.base_url());
    set(format!("{scope}__OPENAI__0__API_KEY"), UPSTREAM_KEY.into());
    set(format!("{scope}__REDIS__URL"), opts.redis_url.clone());
    set(format!("{scope}__TELEMETRY__URL"), svc.postgres.clone());
    for (k, v) in &opts.scope_keys {
        let key = format!("{scope}__{k}");
        match env.iter_mut().find(|(e, _)| *e == key) {
            Some(slot) => slot.1 = v.clone(),
            None => env.push((key, v.clone())),
        }
    }
    for (k, v) in &opts.env {
        match env.iter_mut().find(|(e, _)| e == k) {
            Some(slot) => slot.1 = v.clone(),
            None => env.push((k.to_string(), v.clone())),
        }
    }
    env
}

// === the client ========================================================================

/// An OpenAI client (async-openai) at `base` with the test's client key.
pub fn openai(base: &str) -> Client<OpenAIConfig> {
    openai_with_key(base, CLIENT_KEY)
}

/// An OpenAI client (async-openai) at `base` with the client key `key`. Note that
/// async-openai retries a 429 or a 5xx (up to three times, after its `Retry-After`) out
/// of sight, except a 429 of type `insufficient_quota` (a budget refusal).
pub fn openai_with_key(base: &str, key: &str) -> Client<OpenAIConfig> {
    Client::with_config(
        OpenAIConfig::new()
            .with_api_base(format!("{base}/v1"))
            .with_api_key(key),
    )
}

fn user(text: &str) -> ChatCompletionRequestMessage {
    ChatCompletionRequestUserMessageArgs::default()
        .content(text)
        .build()
        .expect("a user message")
        .into()
}

/// What a client saw of one streamed call.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    pub content: String,
    pub finish: Option<String>,
    pub error: Option<String>,
}

impl Seen {
    /// The whole answer arrived: `want` exactly, and a finish reason.
    pub fn intact(&self, want: &str) -> bool {
        self.error.is_none() && self.content == want && self.finish.as_deref() == Some("Stop")
    }
}

/// A streamed call; `first` counts streams that received their first content chunk.
pub async fn stream(
    c: &Client<OpenAIConfig>,
    model: &str,
    prompt: &str,
    first: Arc<AtomicUsize>,
) -> Seen {
    let req = CreateChatCompletionRequestArgs::default()
        .model(model)
        .messages(vec![user(prompt)])
        .stream(true)
        .stream_options(ChatCompletionStreamOptions {
            include_usage: Some(true),
            include_obfuscation: None,
        })
        .build()
        .expect("a request");
    let mut seen = Seen::default();
    let mut st = match c.chat().create_stream(req).await {
        Ok(s) => s,
        Err(e) => {
            seen.error = Some(e.to_string());
            return seen;
        }
    };
    let mut counted = false;
    while let Some(chunk) = st.next().await {
        match chunk {
            Ok(chunk) => {
                for ch in chunk.choices {
                    if let Some(t) = ch.delta.content {
                        seen.content.push_str(&t);
                        if !counted {
                            counted = true;
                            first.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    if let Some(f) = ch.finish_reason {
                        seen.finish = Some(format!("{f:?}"));
                    }
                }
            }
            Err(e) => {
                seen.error = Some(e.to_string());
                break;
            }
        }
    }
    seen
}

/// A plain call: its answer's text, or the error's status, `code` and message.
pub async fn chat(c: &Client<OpenAIConfig>, model: &str, prompt: &str) -> Result<String, Failure> {
    let req = CreateChatCompletionRequestArgs::default()
        .model(model)
        .messages(vec![user(prompt)])
        .build()
        .expect("a request");
    match c.chat().create(req).await {
        Ok(r) => Ok(r
            .choices
            .into_iter()
            .filter_map(|ch| ch.message.content)
            .collect()),
        Err(e) => Err(Failure::of(e)),
    }
}

/// A failed call as the client saw it.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The HTTP status (0: no answer).
    pub status: u16,
    /// `error.code` (from the JSON body of a 5xx too, which async-openai keeps as text).
    pub code: Option<String>,
    pub message: String,
}

impl Failure {
    fn of(e: OpenAIError) -> Failure {
        match e {
            OpenAIError::ApiError(r) => {
                let mut code = r.api_error.code.clone();
                let mut message = r.api_error.message.clone();
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&message) {
                    code = v["error"]["code"].as_str().map(str::to_string);
                    message = v["error"]["message"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                }
                Failure {
                    status: r.status_code.as_u16(),
                    code,
                    message,
                }
            }
            other => Failure {
                status: 0,
                code: None,
                message: other.to_string(),
            },
        }
    }
}

/// A plain call over raw HTTP (no client-side retry, unlike async-openai's default
/// client, which retries 5xx answers after their `Retry-After`): status, JSON body,
/// `Retry-After`.
pub async fn raw_chat(
    base: &str,
    model: &str,
    prompt: &str,
) -> (u16, serde_json::Value, Option<String>) {
    raw_chat_with_key(base, CLIENT_KEY, model, prompt).await
}

/// [`raw_chat`] with the client key `key`.
pub async fn raw_chat_with_key(
    base: &str,
    key: &str,
    model: &str,
    prompt: &str,
) -> (u16, serde_json::Value, Option<String>) {
    raw_chat_on(&reqwest::Client::new(), base, key, model, prompt).await
}

/// [`raw_chat_with_key`] on the HTTP client `http` (its connections kept alive).
pub async fn raw_chat_on(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    model: &str,
    prompt: &str,
) -> (u16, serde_json::Value, Option<String>) {
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .timeout(Duration::from_secs(20))
        .json(
            &serde_json::json!({"model": model, "messages": [{"role": "user", "content": prompt}]}),
        )
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {base}/v1/chat/completions: {e}"));
    let status = r.status().as_u16();
    let retry_after = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let text = r.text().await.unwrap_or_default();
    let body = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, body, retry_after)
}

/// `GET {base}{path}`: status and JSON body.
pub async fn get_json(base: &str, path: &str) -> (u16, serde_json::Value) {
    let r = reqwest::Client::new()
        .get(format!("{base}{path}"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {base}{path}: {e}"));
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
    )
}

/// `GET {base}/metrics`, the value of one sample line (`name{labels}`), summed over
/// lines that start with `prefix`.
pub async fn metric(base: &str, prefix: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

// === time ==============================================================================

/// Polls `f` (every 20 ms) until it gives a value; fails the test after `limit`.
pub async fn poll<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let until = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < until, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `cond` (every 20 ms) until it holds; fails the test after `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let until = Instant::now() + limit;
    loop {
        if cond().await {
            return;
        }
        assert!(Instant::now() < until, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// === a Redis Cluster of the test's own =================================================

/// A 3-node Redis Cluster on free ports, with a password, in a temporary directory;
/// nodes can be stopped and started again (they keep their `nodes.conf`, not their
/// data). Every node is killed (by its id) on drop.
pub struct OwnCluster {
    dir: tempfile::TempDir,
    ports: [u16; 3],
    nodes: [Option<Child>; 3],
    password: String,
}

impl OwnCluster {
    /// Starts it, or `None` (skip; a failure under CI) when it cannot be made.
    pub fn start() -> Option<OwnCluster> {
        match Self::try_start() {
            Ok(c) => Some(c),
            Err(e) if in_ci() => panic!("an own Redis Cluster is required under CI=true: {e}"),
            Err(e) => {
                eprintln!("skipping: cannot start an own Redis Cluster: {e}");
                None
            }
        }
    }

    fn try_start() -> Result<OwnCluster, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let mut ports = [0u16; 3];
        for p in &mut ports {
            // The cluster bus listens on port + 10000.
            *p = loop {
                let p = free_port()?;
                if p < 55_000 && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
                    break p;
                }
            };
        }
        let mut c = OwnCluster {
            dir,
            ports,
            nodes: [None, None, None],
            password: format!("pw-{}", unique_name("cluster")),
        };
        for i in 0..3 {
            c.restart(i)?;
        }
        let nodes: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .env("REDISCLI_AUTH", &c.password)
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .map_err(|e| format!("redis-cli: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            ));
        }
        let until = Instant::now() + Duration::from_secs(20);
        while !(0..3).all(|i| c.node_ok(i)) {
            if Instant::now() > until {
                return Err("the cluster did not become ok within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(c)
    }

    /// `redis+cluster://:PASSWORD@127.0.0.1:P1,…`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://:{}@{}", self.password, hosts.join(","))
    }

    /// The password (tests check it is never shown).
    pub fn password(&self) -> &str {
        &self.password
    }

    fn cli(&self, i: usize, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .env("REDISCLI_AUTH", &self.password)
            .args(["-p", &self.ports[i].to_string()])
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Whether node `i` answers and sees the cluster ok.
    pub fn node_ok(&self, i: usize) -> bool {
        self.cli(i, &["cluster", "info"])
            .is_some_and(|t| t.lines().any(|l| l.trim() == "cluster_state:ok"))
    }

    /// The node holding `key`'s slot.
    pub fn owner_of(&self, key: &str) -> usize {
        let live = (0..3)
            .find(|i| self.nodes[*i].is_some())
            .expect("a live node");
        let slot: u32 = self
            .cli(live, &["cluster", "keyslot", key])
            .and_then(|t| t.trim().parse().ok())
            .expect("cluster keyslot");
        let nodes = self
            .cli(live, &["cluster", "nodes"])
            .expect("cluster nodes");
        for line in nodes.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let Some(port) = f
                .get(1)
                .and_then(|a| a.split('@').next())
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse::<u16>().ok())
            else {
                continue;
            };
            let holds = f.iter().skip(8).any(|r| {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                matches!((a.parse::<u32>(), b.parse::<u32>()), (Ok(a), Ok(b)) if a <= slot && slot <= b)
            });
            if holds {
                return self
                    .ports
                    .iter()
                    .position(|p| *p == port)
                    .expect("one of ours");
            }
        }
        panic!("no node holds slot {slot}");
    }

    /// Kills node `i` (an outage: its port refuses).
    pub fn stop(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts node `i` (again) on its port and waits until it answers.
    pub fn restart(&mut self, i: usize) -> Result<(), String> {
        self.stop(i);
        let port = self.ports[i];
        let dir = self.dir.path().join(port.to_string());
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--protected-mode", "no", "--cluster-enabled", "yes"])
            .args(["--cluster-config-file", "nodes.conf"])
            .args(["--cluster-node-timeout", "1000"])
            .args(["--save", "", "--appendonly", "no", "--logfile", "redis.log"])
            .args([
                "--requirepass",
                &self.password,
                "--masterauth",
                &self.password,
            ])
            .current_dir(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run redis-server: {e}"))?;
        self.nodes[i] = Some(child);
        let until = Instant::now() + Duration::from_secs(5);
        while self.cli(i, &["ping"]).is_none_or(|t| t.trim() != "PONG") {
            if Instant::now() > until {
                return Err(format!("redis-server on {port} did not answer within 5 s"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

impl Drop for OwnCluster {
    fn drop(&mut self) {
        for i in 0..3 {
            self.stop(i);
        }
    }
}
