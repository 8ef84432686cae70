//! Per-call counts of the `polygw serve` process for the `serve` benchmark (issue 27):
//! system calls, context switches and allocations from `perf stat -p` (the
//! `raw_syscalls:sys_enter` tracepoint, the `context-switches` software event, and
//! uprobes on glibc's `malloc`, `calloc`, `realloc` and `posix_memalign` — what C code
//! such as SQLite allocates — and on the binary's own allocator when it links one:
//! mimalloc's `mi_malloc_aligned`, `mi_zalloc_aligned`, `mi_realloc_aligned`, which
//! Rust's global allocator calls), and
//! instructions from callgrind (`callgrind_control -z` after a warm-up, `-d` after the
//! measured calls). Counts, not durations: the probes slow the process, not what it does.
//! Each count is taken over a phase of calls, minus the process's idle rate over a
//! phase of the same length without calls.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";
const ALLOC_FNS: [&str; 4] = ["malloc", "calloc", "realloc", "posix_memalign"];

/// What one phase counted, per call.
#[derive(Debug, Clone, Copy, Default)]
pub struct PerCall {
    pub syscalls: f64,
    pub switches: f64,
    /// malloc + calloc + realloc + posix_memalign.
    pub allocations: f64,
}

/// Why counting cannot run here, or `None` when it can: `perf` with tracepoints and
/// uprobes on glibc (added here when missing; needs root).
pub fn unavailable() -> Option<String> {
    if !Path::new(LIBC).exists() {
        return Some(format!(
            "{LIBC} not found (glibc on x86-64 Linux is assumed)"
        ));
    }
    for f in ALLOC_FNS {
        // "already exists" is fine; any other failure shows in the check below.
        let _ = Command::new("perf")
            .args(["probe", "-q", "-x", LIBC, "--add", f])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    let out = Command::new("perf")
        .args(["stat", "-x,", "-e"])
        .arg(events(Some(&[])))
        .args(["--", "true"])
        .output();
    match out {
        Err(e) => Some(format!("perf cannot run: {e}")),
        Ok(o) if !o.status.success() => Some(format!(
            "perf stat with syscall tracepoints and malloc uprobes failed (root is needed): {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Ok(_) => None,
    }
}

/// The events of a phase: system calls and context switches, or (`Some`: with the
/// binary's own allocator events) the allocations alone — counted apart, because a
/// uprobe's trap changes how threads are scheduled.
fn events(allocations: Option<&[String]>) -> String {
    let e: Vec<String> = match allocations {
        None => vec![
            "raw_syscalls:sys_enter".to_string(),
            "context-switches".to_string(),
        ],
        Some(own) => ALLOC_FNS
            .iter()
            .map(|f| format!("probe_libc:{f}"))
            .chain(own.iter().cloned())
            .collect(),
    };
    e.join(",")
}

/// The allocator entry points Rust's global allocator calls in `bin` when it links
/// mimalloc, as uprobe events (probes on an earlier build of the same path are
/// replaced: a uprobe points into one file).
pub fn own_allocator_events(bin: &str) -> Vec<String> {
    let listed = |bin: &str| -> Vec<String> {
        let out = Command::new("perf").args(["probe", "-l"]).output();
        let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
        text.unwrap_or_default()
            .lines()
            .filter(|l| l.trim_end().ends_with(&format!("in {bin})")))
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .collect()
    };
    // A uprobe on an earlier build points at an offset that may now be inside an
    // instruction: remove it before the process runs with it.
    remove_events(&listed(bin));
    for f in [
        "mi_malloc_aligned",
        "mi_zalloc_aligned",
        "mi_realloc_aligned",
    ] {
        let _ = Command::new("perf")
            .args(["probe", "-q", "-x", bin, "--add", f])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    listed(bin)
}

/// A `perf stat -p` running until [`Stat::stop`].
pub struct Stat {
    child: Child,
    out: PathBuf,
    started: Instant,
}

impl Stat {
    pub fn start(pid: u32, allocations: Option<&[String]>, dir: &Path, tag: &str) -> Stat {
        let out = dir.join(format!("perf-{tag}.csv"));
        let child = Command::new("perf")
            .args(["stat", "-x,", "-o"])
            .arg(&out)
            .arg("-e")
            .arg(events(allocations))
            .args(["-p", &pid.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn perf stat");
        // perf attaches to every thread of the process before it counts.
        std::thread::sleep(Duration::from_millis(300));
        Stat {
            child,
            out,
            started: Instant::now(),
        }
    }

    /// Stops counting; (syscalls, context switches, allocations) and the time counted.
    pub fn stop(mut self) -> ([f64; 3], Duration) {
        let wall = self.started.elapsed();
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        let mut c = [0.0; 3];
        for line in text.lines() {
            let f: Vec<&str> = line.split(',').collect();
            let (Some(v), Some(ev)) = (f.first(), f.get(2)) else {
                continue;
            };
            let Ok(v) = v.parse::<f64>() else { continue };
            if ev.starts_with("raw_syscalls") {
                c[0] += v;
            } else if ev.starts_with("context-switches") {
                c[1] += v;
            } else if ev.starts_with("probe_") {
                c[2] += v;
            }
        }
        (c, wall)
    }
}

/// The process's idle rates (per second), counted over `over` with no calls.
pub fn idle_rates(pid: u32, own: &[String], dir: &Path, over: Duration) -> [f64; 3] {
    let mut rates = [0.0; 3];
    for allocations in [None, Some(own)] {
        let s = Stat::start(pid, allocations, dir, "idle");
        std::thread::sleep(over);
        let (c, wall) = s.stop();
        for (r, x) in rates.iter_mut().zip(c) {
            *r += x / wall.as_secs_f64();
        }
    }
    rates
}

/// Per-call counts of phases of `calls` calls each (the counts summed, with the
/// phases' total time), the idle share taken out.
pub fn per_call(counted: [f64; 3], wall: [Duration; 3], idle: [f64; 3], calls: usize) -> PerCall {
    let n = calls.max(1) as f64;
    let net = |i: usize| ((counted[i] - idle[i] * wall[i].as_secs_f64()) / n).max(0.0);
    PerCall {
        syscalls: net(0),
        switches: net(1),
        allocations: net(2),
    }
}

/// Removes uprobe events (the binary's own, after counting: a probe outliving the
/// build it points into would trap inside an instruction of the next one).
pub fn remove_events(events: &[String]) {
    for e in events {
        let _ = Command::new("perf")
            .args(["probe", "-q", "-d", e])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Asks a process running under callgrind to zero its counters (`-z`) or dump them
/// (`-d`); the dump's total instructions (`summary:`/`totals:` line of the newest file
/// with `prefix`).
pub fn callgrind(pid: u32, zero: bool, dir: &Path, prefix: &str) -> Option<u64> {
    let flag = if zero { "-z" } else { "-d" };
    let ok = Command::new("callgrind_control")
        .args([flag, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if zero || !ok {
        return None;
    }
    let newest = std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())?;
    let text = std::fs::read_to_string(newest.path()).ok()?;
    text.lines()
        .filter_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .max()
}

/// Whether callgrind can run here.
pub fn callgrind_unavailable() -> Option<String> {
    for tool in ["valgrind", "callgrind_control"] {
        let found = Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!("{tool} not found"));
        }
    }
    None
}
