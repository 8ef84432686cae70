//! Shared helpers of the cross-crate suites: mock upstreams, environment for sources,
//! a spawned `polygw serve`, an OpenAI client pointed at it, and the pinned client SDKs
//! (Python's venv, Node's node_modules) with a runner for their scripts ([`sdk`]).

#![allow(dead_code)] // each suite uses a subset

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use async_openai::config::OpenAIConfig;
use async_openai::types::chat::{
    ChatCompletionRequestMessage, ChatCompletionRequestUserMessageArgs,
};
use async_openai::Client;
use polygw_mock_upstream::{Behavior, MockConfig, MockUpstream};

/// The program under test (this package's own build of `polygw`).
pub const BIN: &str = env!("CARGO_BIN_EXE_polygw-under-test");

/// Runs the program with exactly this environment (plus `PATH`).
pub fn polygw(args: &[&str], env: &[(String, String)]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().cloned())
        .output()
        .expect("run polygw")
}

/// stdout and stderr as text.
pub fn text(o: &std::process::Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A mock that answers only requests carrying `Bearer sk-<name>-upstream-secret`.
pub async fn keyed_mock(name: &str, default: Behavior) -> MockUpstream {
    let m = MockUpstream::start(MockConfig {
        require_key: Some(format!("sk-{name}-upstream-secret")),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    m.set_default(default);
    m
}

/// A mock upstream on loopback answering `default` when no script is queued.
pub async fn mock(default: Behavior) -> MockUpstream {
    let m = MockUpstream::start(MockConfig::default()).await.unwrap();
    m.set_default(default);
    m
}

/// Environment of one source `{scope}__{NAME}__0__…` on mock `m`, plus `extra` fields.
pub fn source(
    scope: &str,
    name: &str,
    m: &MockUpstream,
    extra: &[(&str, &str)],
) -> Vec<(String, String)> {
    let p = format!("{scope}__{}__0", name.to_uppercase());
    let mut v = vec![
        (format!("{p}__BASE_URL"), m.base_url()),
        (
            format!("{p}__API_KEY"),
            format!("sk-{name}-upstream-secret"),
        ),
        (format!("{p}__MODEL"), format!("model-{name}")),
    ];
    v.extend(
        extra
            .iter()
            .map(|(k, x)| (format!("{p}__{k}"), x.to_string())),
    );
    v
}

/// A running `polygw serve` child; killed on drop.
pub struct Serve {
    pub child: Child,
    pub base: String,
    pub lines: mpsc::Receiver<String>,
}

impl Serve {
    /// Sends SIGTERM (a graceful shutdown) and returns every line printed until the
    /// process's output ends (or 10 s pass without a line).
    pub fn terminate(&self) -> Vec<String> {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success());
        let mut lines = Vec::new();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(10)) {
            lines.push(l);
        }
        lines
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `polygw serve` on an ephemeral port with exactly this environment (and a
/// 5 s grace period).
pub fn serve(env: &[(String, String)]) -> Serve {
    serve_args(&["--grace-s", "5"], env)
}

/// The program with these arguments and exactly this environment, its output piped.
pub fn spawn(args: &[&str], env: &[(String, String)]) -> Child {
    Command::new(BIN)
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().cloned())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn polygw")
}

/// Starts `polygw serve --listen 127.0.0.1:0 ARGS…` with exactly this environment; every
/// output line goes to `lines`.
// The child is killed and waited for by `Serve`'s drop.
#[allow(clippy::zombie_processes)]
pub fn serve_args(args: &[&str], env: &[(String, String)]) -> Serve {
    let mut all = vec!["serve", "--listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let mut child = spawn(&all, env);
    let (tx, rx) = mpsc::channel();
    for pipe in [
        Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    let mut seen = Vec::new();
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("serve did not start: {seen:?}"));
        if let Some(rest) = line.split("on http://").nth(1) {
            let addr = rest.split('/').next().unwrap().to_string();
            return Serve {
                child,
                base: format!("http://{addr}"),
                lines: rx,
            };
        }
        seen.push(line);
    }
}

/// An OpenAI client (async-openai) pointed at a proxy.
pub fn openai(base: &str, key: &str) -> Client<OpenAIConfig> {
    Client::with_config(
        OpenAIConfig::new()
            .with_api_base(format!("{base}/v1"))
            .with_api_key(key),
    )
}

/// A user message.
pub fn user(text: &str) -> ChatCompletionRequestMessage {
    ChatCompletionRequestUserMessageArgs::default()
        .content(text)
        .build()
        .unwrap()
        .into()
}

/// The pinned client SDKs: Python's in `target/sdk-venv` (tests/python/requirements.txt),
/// Node's in `tests/node/node_modules` (tests/node/package-lock.json); `.ci/run`
/// installs both. A test that needs one calls [`python_sdks`] / [`node_sdks`]: when the
/// SDKs are missing or not the pinned versions, the test prints why and skips — except
/// under `CI=true`, where that is a failure.
pub mod sdk {
    use std::io::Read;
    use std::path::{Path, PathBuf};
    use std::process::{Command, Stdio};
    use std::time::Duration;

    use tokio::time::Instant;

    /// The workspace's root (this package is `tests/`).
    pub fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("tests/ has a parent")
            .to_path_buf()
    }

    /// The virtualenv `.ci/run` makes (`POLYGW_SDK_VENV` overrides it).
    pub fn venv() -> PathBuf {
        std::env::var_os("POLYGW_SDK_VENV")
            .map(PathBuf::from)
            .unwrap_or_else(|| root().join("target/sdk-venv"))
    }

    /// `tests/node`, where `npm ci` installs the Node SDKs.
    pub fn node_dir() -> PathBuf {
        root().join("tests/node")
    }

    /// `tests/agents`: the coding agents' pinned npm packages.
    pub fn agents_dir() -> PathBuf {
        root().join("tests/agents")
    }

    const AGENTS_HOW: &str =
        "run .ci/run (its step \"client SDKs\"), or: (cd tests/agents && npm ci)";

    /// Claude Code's executable ([`agent`]).
    pub fn claude_code(test: &str) -> Option<PathBuf> {
        agent(test, "@anthropic-ai/claude-code", "claude")
    }

    /// The Codex CLI's executable ([`agent`]).
    pub fn codex(test: &str) -> Option<PathBuf> {
        agent(test, "@openai/codex", "codex")
    }

    /// An agent's executable `bin`, when tests/agents/node_modules holds the version of
    /// `name` that tests/agents/package.json pins and it runs; else `None` after
    /// printing why (a panic under `CI=true`).
    fn agent(test: &str, name: &str, bin: &str) -> Option<PathBuf> {
        let dir = agents_dir();
        let read = |p: PathBuf| -> Result<serde_json::Value, String> {
            let t = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            serde_json::from_str(&t).map_err(|e| format!("{}: {e}", p.display()))
        };
        let want = match read(dir.join("package.json")) {
            Ok(v) => v["dependencies"][name].clone(),
            Err(e) => return missing(test, e, AGENTS_HOW),
        };
        match read(dir.join("node_modules").join(name).join("package.json")) {
            Ok(v) if v["version"] == want => {}
            Ok(v) => {
                return missing(
                    test,
                    format!("{name} wants {want}, node_modules has {}", v["version"]),
                    AGENTS_HOW,
                )
            }
            Err(e) => return missing(test, format!("{name} is not installed ({e})"), AGENTS_HOW),
        }
        let bin = dir.join("node_modules/.bin").join(bin);
        match Command::new(&bin).arg("--version").output() {
            Ok(o) if o.status.success() => Some(bin),
            Ok(o) => missing(
                test,
                format!(
                    "{} --version failed: {}",
                    bin.display(),
                    String::from_utf8_lossy(&o.stderr)
                ),
                AGENTS_HOW,
            ),
            Err(e) => missing(test, format!("{}: {e}", bin.display()), AGENTS_HOW),
        }
    }

    const PHOENIX_HOW: &str = "run .ci/run (its step \"client SDKs\"), or: python3 -m venv \
        target/phoenix-venv && target/phoenix-venv/bin/pip install -r tests/python/phoenix-requirements.txt";

    /// Arize Phoenix's `phoenix` command in `target/phoenix-venv`, when the version
    /// tests/python/phoenix-requirements.txt pins is installed there; else `None` after
    /// printing why (a panic under `CI=true`).
    pub fn phoenix(test: &str) -> Option<PathBuf> {
        let venv = root().join("target/phoenix-venv");
        let bin = venv.join("bin/phoenix");
        if !bin.exists() {
            return missing(
                test,
                format!("{} does not exist", bin.display()),
                PHOENIX_HOW,
            );
        }
        let req = root().join("tests/python/phoenix-requirements.txt");
        let want = std::fs::read_to_string(&req).ok().and_then(|t| {
            pins(&t)
                .into_iter()
                .find(|(n, _)| n == "arize-phoenix")
                .map(|(_, v)| v)
        });
        let check = "import importlib.metadata as m; print(m.version('arize-phoenix'))";
        let have = Command::new(venv.join("bin/python"))
            .args(["-c", check])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        match (want, have) {
            (Some(w), Some(h)) if w == h => Some(bin),
            (w, h) => missing(
                test,
                format!("arize-phoenix: pinned {w:?}, installed {h:?}"),
                PHOENIX_HOW,
            ),
        }
    }

    /// `tests/python/NAME`.
    pub fn python_script(name: &str) -> PathBuf {
        root().join("tests/python").join(name)
    }

    const PYTHON_HOW: &str = "run .ci/run (its step \"client SDKs\"), or: python3 -m venv \
        target/sdk-venv && target/sdk-venv/bin/pip install -r tests/python/requirements.txt";
    const NODE_HOW: &str = "run .ci/run (its step \"client SDKs\"), or: (cd tests/node && npm ci)";

    fn missing<T>(test: &str, why: String, how: &str) -> Option<T> {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("CI=true and {test} cannot run: {why} ({how})");
        }
        eprintln!("skipping {test}: {why} ({how})");
        None
    }

    /// `name==version` pins of a requirements file.
    fn pins(requirements: &str) -> Vec<(String, String)> {
        requirements
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter_map(|l| l.split_once("=="))
            .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
            .collect()
    }

    /// The venv's Python, when every pin of tests/python/requirements.txt is installed
    /// in it at its version; else `None` after printing why (a panic under `CI=true`).
    pub fn python_sdks(test: &str) -> Option<PathBuf> {
        let py = venv().join("bin/python");
        if !py.exists() {
            return missing(test, format!("{} does not exist", py.display()), PYTHON_HOW);
        }
        let req = root().join("tests/python/requirements.txt");
        let text = match std::fs::read_to_string(&req) {
            Ok(t) => t,
            Err(e) => return missing(test, format!("{}: {e}", req.display()), PYTHON_HOW),
        };
        let pins = pins(&text);
        let names: Vec<String> = pins.iter().map(|(n, _)| format!("{n:?}")).collect();
        let check = format!(
            "import importlib.metadata as m\nfor n in [{}]:\n    try: print(n, m.version(n))\n    except m.PackageNotFoundError: print(n, '-')",
            names.join(", ")
        );
        let out = match Command::new(&py).args(["-c", &check]).output() {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
            Ok(o) => {
                return missing(
                    test,
                    format!(
                        "{} failed: {}",
                        py.display(),
                        String::from_utf8_lossy(&o.stderr)
                    ),
                    PYTHON_HOW,
                )
            }
            Err(e) => return missing(test, format!("{}: {e}", py.display()), PYTHON_HOW),
        };
        let wrong: Vec<String> = pins
            .iter()
            .zip(out.lines())
            .filter(|((_, want), line)| line.split_whitespace().nth(1) != Some(want.as_str()))
            .map(|((n, want), line)| format!("{n} wants {want}, has {line}"))
            .collect();
        if !wrong.is_empty() || out.lines().count() != pins.len() {
            return missing(
                test,
                format!("{} is out of date: {}", venv().display(), wrong.join("; ")),
                PYTHON_HOW,
            );
        }
        Some(py)
    }

    /// `node`, when tests/node/node_modules holds every dependency of
    /// tests/node/package.json at its pinned version; else `None` after printing why (a
    /// panic under `CI=true`).
    pub fn node_sdks(test: &str) -> Option<PathBuf> {
        let node = PathBuf::from("node");
        match Command::new(&node).arg("--version").output() {
            Ok(o) if o.status.success() => {}
            _ => return missing(test, "node is not installed".into(), NODE_HOW),
        }
        let dir = node_dir();
        let read = |p: PathBuf| -> Result<serde_json::Value, String> {
            let t = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            serde_json::from_str(&t).map_err(|e| format!("{}: {e}", p.display()))
        };
        let pkg = match read(dir.join("package.json")) {
            Ok(v) => v,
            Err(e) => return missing(test, e, NODE_HOW),
        };
        let deps = pkg["dependencies"].as_object().cloned().unwrap_or_default();
        for (name, want) in deps {
            let have = read(dir.join("node_modules").join(&name).join("package.json"))
                .map(|v| v["version"].clone());
            match have {
                Ok(v) if v == want => {}
                Ok(v) => {
                    return missing(
                        test,
                        format!("{name} wants {want}, node_modules has {v}"),
                        NODE_HOW,
                    )
                }
                Err(e) => return missing(test, format!("{name} is not installed ({e})"), NODE_HOW),
            }
        }
        Some(node)
    }

    /// What a script printed, and how it ended.
    #[derive(Debug)]
    pub struct ScriptRun {
        pub ok: bool,
        pub stdout: String,
        pub stderr: String,
        pub took: Duration,
    }

    impl ScriptRun {
        /// The last stdout line as JSON (the scripts print their findings there);
        /// panics with the whole output when the script failed.
        pub fn json(&self) -> serde_json::Value {
            assert!(
                self.ok,
                "the script failed:\n--- stdout\n{}\n--- stderr\n{}",
                self.stdout, self.stderr
            );
            let last = self.stdout.lines().last().unwrap_or("");
            serde_json::from_str(last).unwrap_or_else(|e| {
                panic!(
                    "the script's last line is not JSON ({e}):\n{}\n{}",
                    self.stdout, self.stderr
                )
            })
        }
    }

    /// Runs `program ARGS…` with these extra variables (on a blocking thread), killed
    /// after `limit`.
    pub async fn run(
        program: PathBuf,
        args: Vec<String>,
        env: Vec<(String, String)>,
        limit: Duration,
    ) -> ScriptRun {
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let mut child = Command::new(&program)
                .args(&args)
                .envs(env)
                // Loopback only, whatever proxy the environment names; no bytecode
                // files in the work tree.
                .env("NO_PROXY", "127.0.0.1,localhost")
                .env("no_proxy", "127.0.0.1,localhost")
                .env("PYTHONDONTWRITEBYTECODE", "1")
                .current_dir(root())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
            let pipe = |mut r: Box<dyn Read + Send>| {
                std::thread::spawn(move || {
                    let mut s = String::new();
                    let _ = r.read_to_string(&mut s);
                    s
                })
            };
            let out = pipe(Box::new(child.stdout.take().unwrap()));
            let err = pipe(Box::new(child.stderr.take().unwrap()));
            let status = loop {
                if let Some(st) = child.try_wait().unwrap() {
                    break Some(st);
                }
                if started.elapsed() > limit {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let (stdout, mut stderr) = (out.join().unwrap(), err.join().unwrap());
            if status.is_none() {
                stderr.push_str(&format!("\n[killed after {limit:?}]"));
            }
            ScriptRun {
                ok: status.is_some_and(|s| s.success()),
                stdout,
                stderr,
                took: started.elapsed(),
            }
        })
        .await
        .unwrap()
    }
}
