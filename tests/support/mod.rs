//! Shared helpers of the cross-crate suites: mock upstreams, environment for sources,
//! a spawned `polygw serve`, an OpenAI client pointed at it.

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
