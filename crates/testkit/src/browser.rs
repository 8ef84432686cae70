//! Headless Chromium for tests that check what a person's browser shows (the HTML
//! report, the admin status page): where it is, and the DOM and console of a page it
//! loaded. Under `CI=true` a missing Chromium fails the test; elsewhere it skips.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::services::{in_ci, unique_name};

/// A URL with its credentials (`user:pass@`) left out, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(s), Some(a)) if a > s => format!("{}://…@{}", &url[..s], &url[a + 1..]),
        _ => url.to_string(),
    }
}

/// Chromium (`POLYGW_TEST_CHROMIUM`, else `chromium` / `chromium-browser` on PATH), or
/// `None` (skip) outside CI; under `CI=true` a missing one fails.
pub fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("POLYGW_TEST_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["chromium", "chromium-browser"] {
        for dir in std::env::split_paths(&path) {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    if in_ci() {
        panic!(
            "Chromium is required under CI=true and is not on PATH (.ci/run installs \
             Debian's chromium; or set POLYGW_TEST_CHROMIUM)"
        );
    }
    eprintln!(
        "skipping: Chromium is not on PATH (apt-get install chromium, or set \
         POLYGW_TEST_CHROMIUM)"
    );
    None
}

/// What Chromium made of a page: the serialized DOM after load, and the console
/// messages it logged.
#[derive(Debug)]
pub struct Loaded {
    /// The serialized DOM after load.
    pub dom: String,
    /// Console messages, uncaught errors and refused loads (stderr lines).
    pub console: Vec<String>,
}

/// Loads `file` in headless Chromium (`--dump-dom`), with its console on stderr; a
/// profile of its own under `dir`; killed after 120 s.
// The bound on a child process is wall-clock time by nature: no Clock to inject.
#[allow(clippy::disallowed_methods)]
pub fn load(bin: &Path, dir: &Path, file: &Path) -> Loaded {
    load_url(bin, dir, &format!("file://{}", file.display()))
}

/// Loads `url` in headless Chromium (`--dump-dom`), as [`load`] does a file.
// The bound on a child process is wall-clock time by nature: no Clock to inject.
#[allow(clippy::disallowed_methods)]
pub fn load_url(bin: &Path, dir: &Path, url: &str) -> Loaded {
    let profile = dir.join(unique_name("chromium-profile"));
    let mut child = Command::new(bin)
        .args([
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    // A bound, not a window: a healthy run takes a second or two.
    let limit = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("Chromium did not finish loading {} in 120 s", redact(url));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let dom = out_t.join().unwrap();
    let stderr = err_t.join().unwrap();
    assert!(status.success(), "Chromium failed ({status}):\n{stderr}");
    assert!(
        dom.contains("</html>"),
        "no DOM from Chromium:\n{dom}\n{stderr}"
    );
    let console = stderr
        .lines()
        .filter(|l| l.contains("CONSOLE") || l.contains("Uncaught") || l.contains("Refused to"))
        .map(str::to_string)
        .collect();
    Loaded { dom, console }
}
